"""Latency of the sessions API (issue 23, "Measure and report"; issue 34, item 11):
``python -m runtime.tools.sessions_api_bench`` starts a redis-server on loopback, serves the runtime's own
handlers over aiohttp on loopback with an application token, and prints Markdown tables; asserts nothing.

- ``read``: one ended session of ``--minutes`` minutes in the store's key layout (a text piece every
  ``1 / --pieces-per-s`` s, with its timestamp), ``GET /api/sessions/<id>`` ``--reads`` times: the body size
  and the p50/p99/max of the whole request (HTTP, token check, Redis, JSON).
- ``list``: ``--sessions`` ended sessions and one active one (the oldest), written by the session store
  itself; ``GET /api/sessions?state=active&limit=1`` and ``?limit=100`` ``--reads`` times each.
- ``erase``: ended sessions written by the store until the events stream holds ``--entries`` entries;
  ``DELETE /api/sessions/<id>`` of ``--erases`` of them: each erase's time and the bytes Redis sent for it.

``list`` and ``erase`` use only the store's and the handlers' public names, so they also run on the code
before issue 34 (the "before" figures). Figures measured: docs/benchmarks.md, "Sessions API"."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import redis.asyncio as redis
from aiohttp import web

from runtime.frontend.gate.app_tokens import mint_app_token
from runtime.frontend.gate.tokens import SigningKey, TokenVerifier
from runtime.frontend.sessions_api import sessions_collection, sessions_item
from runtime.frontend.store.events import line_entry
from runtime.frontend.store.redis_store import SessionRecord, SessionStore
from runtime.tools.local_redis import RedisServer, free_loopback_port

__all__ = ["main", "measure"]

_SID = "5e55" * 8
_KEY = SigningKey("bench", "b" * 32)


async def _write_session(url: str, minutes: float, pieces_per_s: float) -> int:
    """One ended session of ``minutes`` with a piece every ``1 / pieces_per_s`` s; returns the piece count."""
    from runtime.frontend.store import keys  # here: ``list`` and ``erase`` also run on code without it

    client = redis.Redis.from_url(url, decode_responses=True)
    start = time.time() - minutes * 60
    count = int(minutes * 60 * pieces_per_s)
    words = [f" word{i % 97}" for i in range(count)]
    pipe = client.pipeline(transaction=False)
    fields: dict[Any, Any] = {
        "id": _SID,
        "node": "bench",
        "slot": "0",
        "started_at": repr(start),
        "persona": "",
        "format": "opus",
    }
    ended = {"state": "ended", "end_reason": "client_closed", "ended_at": repr(start + minutes * 60)}
    fields.update(ended, recording="0")
    pipe.hset(keys.session_key("duplex", _SID), mapping=fields)
    pipe.set(keys.transcript_key("duplex", _SID), "".join(words))
    lines = "".join(line_entry(start + n / pieces_per_s, words[n]) for n in range(count))
    pipe.set(keys.lines_key("duplex", _SID), lines)
    pipe.zadd(keys.index_key("duplex"), {_SID: start})
    pipe.zadd(keys.state_index_key("duplex", "ended"), {_SID: start})
    await pipe.execute()
    await client.aclose()
    return count


async def measure(url: str, *, minutes: float, pieces_per_s: float, reads: int) -> dict[str, float]:
    """Write the session, serve the handler, read it ``reads`` times; the figures (ms, bytes)."""
    pieces = await _write_session(url, minutes, pieces_per_s)
    front, runner, port = await _serve(url)
    headers = _headers()
    times_ms: list[float] = []
    size = 0
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(reads):
                began = time.perf_counter()
                async with http.get(
                    f"http://127.0.0.1:{port}/api/sessions/{_SID}", headers=headers
                ) as answer:
                    body = await answer.read()
                times_ms.append((time.perf_counter() - began) * 1000)
                assert answer.status == 200, body
                size = len(body)
        segments = len(json.loads(body)["transcript"]["segments"])
    finally:
        await runner.cleanup()
        await front.records.close()
    times_ms.sort()
    return {
        "pieces": pieces,
        "segments": segments,
        "body_kb": size / 1024,
        "p50_ms": statistics.median(times_ms),
        "p99_ms": times_ms[min(len(times_ms) - 1, int(0.99 * len(times_ms)))],
        "max_ms": times_ms[-1],
    }


def _reader(url: str) -> Any:
    """The sessions API's reader: ``RedisSessionReader`` (no AOF rewrite: not what is measured), or, on the
    code before issue 31, ``RedisSessionReader``."""
    from runtime.frontend.store import records

    if hasattr(records, "RedisSessionReader"):
        return records.RedisSessionReader(url, aof_rewrite_every_s=None)
    return records.RedisSessionReader(url)  # type: ignore[attr-defined,unused-ignore]


async def _serve(url: str) -> tuple[Any, web.AppRunner, int]:
    """The sessions API's handlers on a loopback port: (the front end stand-in, the runner, the port)."""
    front = SimpleNamespace(
        access=SimpleNamespace(app_verifier=TokenVerifier([_KEY], "bench", kind="app")), records=_reader(url)
    )

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/api/sessions":
            return await sessions_collection(front, request)  # type: ignore[arg-type]
        return await sessions_item(front, request)  # type: ignore[arg-type]

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_loopback_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return front, runner, port


def _headers() -> dict[str, str]:
    return {"Authorization": "Bearer " + mint_app_token(_KEY, ttl_s=3600, audience="bench")}


async def _write_sessions(url: str, sessions: int, pieces: int, *, active_first: bool) -> list[str]:
    """``sessions`` ended sessions of ``pieces`` text pieces each, written by the session store (one active
    session first, the oldest, when ``active_first``); returns the ended ones' ids, oldest first."""
    store = SessionStore(url, "bench", events_maxlen=10_000_000, max_backlog_ops=10_000_000)
    await store.start()
    start = time.time() - sessions - 3600
    if active_first:
        store.register_session(SessionRecord(uuid.uuid4().hex, "bench", 0, start - 1, "voice=NATF2", "opus"))
    ids = []
    for n in range(sessions):
        sid = uuid.uuid4().hex
        store.register_session(SessionRecord(sid, "bench", n % 32, start + n, "voice=NATF2", "opus"))
        for p in range(pieces):
            store.append_transcript(sid, f" word{p}")
        store.end_session(sid, "client_closed")
        ids.append(sid)
        if n % 1000 == 999:
            while store.backlog > 10_000:
                await asyncio.sleep(0.01)
    while store.backlog:
        await asyncio.sleep(0.01)
    await store.close()
    return ids


def _figures(times_ms: list[float]) -> dict[str, float]:
    times_ms = sorted(times_ms)
    return {
        "p50_ms": statistics.median(times_ms),
        "p99_ms": times_ms[min(len(times_ms) - 1, int(0.99 * len(times_ms)))],
        "max_ms": times_ms[-1],
    }


async def measure_listing(url: str, *, sessions: int, reads: int) -> dict[str, dict[str, float]]:
    """``sessions`` ended sessions and one active (the oldest); the figures (ms) of each listing."""
    await _write_sessions(url, sessions, 0, active_first=True)
    front, runner, port = await _serve(url)
    out: dict[str, dict[str, float]] = {}
    try:
        async with aiohttp.ClientSession() as http:
            for query in ("state=active&limit=1", "limit=100", "state=ended&limit=100"):
                times_ms = []
                for _ in range(reads):
                    began = time.perf_counter()
                    async with http.get(
                        f"http://127.0.0.1:{port}/api/sessions?{query}", headers=_headers()
                    ) as answer:
                        body = await answer.read()
                    times_ms.append((time.perf_counter() - began) * 1000)
                    assert answer.status == 200 and json.loads(body)["sessions"], body
                out[query] = _figures(times_ms)
    finally:
        await runner.cleanup()
        await front.records.close()
    return out


async def measure_erase(url: str, *, entries: int, erases: int) -> dict[str, float]:
    """Sessions of 48 text pieces (50 entries each) up to ``entries`` stream entries; ``erases`` of them
    erased by ``DELETE``: the figures (ms) and the bytes Redis sent per erase (KiB)."""
    ids = await _write_sessions(url, max(erases, entries // 50), 48, active_first=False)
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        from runtime.frontend.store.keys import events_key
    except ImportError:  # the code before issue 31 (the "before" figures)
        from runtime.frontend.store.events import events_key  # type: ignore[attr-defined,no-redef,unused-ignore]
    length = await client.xlen(events_key("duplex"))
    front, runner, port = await _serve(url)
    times_ms: list[float] = []
    sent: list[int] = []
    try:
        async with aiohttp.ClientSession() as http:
            for sid in ids[:: max(1, len(ids) // erases)][:erases]:
                before = int((await client.info("stats"))["total_net_output_bytes"])
                began = time.perf_counter()
                async with http.delete(
                    f"http://127.0.0.1:{port}/api/sessions/{sid}", headers=_headers()
                ) as answer:
                    await answer.read()
                times_ms.append((time.perf_counter() - began) * 1000)
                assert answer.status == 204, answer.status
                sent.append(int((await client.info("stats"))["total_net_output_bytes"]) - before)
    finally:
        await runner.cleanup()
        await front.records.close()
        await client.aclose()
    return {"entries": float(length), **_figures(times_ms), "sent_kib": statistics.median(sent) / 1024}


def _with_redis(run: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            run(server.url)
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--pieces-per-s", type=float, nargs="+", default=[4.0, 12.5])
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--scenario", choices=("read", "list", "erase"), default="read")
    parser.add_argument("--sessions", type=int, default=20_000, help="list: ended sessions")
    parser.add_argument("--entries", type=int, default=100_000, help="erase: events stream entries")
    parser.add_argument("--erases", type=int, default=10)
    args = parser.parse_args(argv)
    if args.scenario == "list":

        def run_list(url: str) -> None:
            figs = asyncio.run(measure_listing(url, sessions=args.sessions, reads=args.reads))
            print(f"| query ({args.sessions} ended sessions, 1 active) | p50 ms | p99 ms | max ms |")
            print("| --- | --- | --- | --- |")
            for query, fig in figs.items():
                print(f"| `{query}` | {fig['p50_ms']:.1f} | {fig['p99_ms']:.1f} | {fig['max_ms']:.1f} |")

        _with_redis(run_list)
        return
    if args.scenario == "erase":

        def run_erase(url: str) -> None:
            fig = asyncio.run(measure_erase(url, entries=args.entries, erases=args.erases))
            print("| stream entries | erases | p50 ms | p99 ms | max ms | KiB sent by Redis per erase |")
            print("| --- | --- | --- | --- | --- | --- |")
            print(
                f"| {fig['entries']:.0f} | {args.erases} | {fig['p50_ms']:.1f} | {fig['p99_ms']:.1f} | "
                f"{fig['max_ms']:.1f} | {fig['sent_kib']:.1f} |"
            )

        _with_redis(run_erase)
        return
    print("| pieces/s | pieces | segments | body KiB | p50 ms | p99 ms | max ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")

    def run_read(url: str) -> None:
        for rate in args.pieces_per_s:
            fig = asyncio.run(measure(url, minutes=args.minutes, pieces_per_s=rate, reads=args.reads))
            print(
                f"| {rate:g} | {fig['pieces']:.0f} | {fig['segments']:.0f} | {fig['body_kb']:.0f} | "
                f"{fig['p50_ms']:.1f} | {fig['p99_ms']:.1f} | {fig['max_ms']:.1f} |"
            )

    _with_redis(run_read)


if __name__ == "__main__":
    main()
