"""Latency of reading a long conversation back through the sessions API (issue 23, "Measure and report"):
``python -m runtime.tools.sessions_api_bench`` starts a redis-server on loopback, writes one ended session of
``--minutes`` minutes in the session store's key layout (a text piece every ``1 / --pieces-per-s`` seconds,
with its timestamp), serves ``GET /api/sessions/<id>`` with the runtime's own handler over aiohttp on
loopback, and reads it ``--reads`` times in a row with an application token. Prints the body size and the
p50/p99/max of the whole request (HTTP, token check, Redis, JSON) as a Markdown table; asserts nothing.

Figures measured: docs/benchmarks.md, "Sessions API"."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import redis.asyncio as redis
from aiohttp import web

from runtime.frontend.gate.app_tokens import mint_app_token
from runtime.frontend.gate.tokens import SigningKey, TokenVerifier
from runtime.frontend.sessions_api import sessions_item
from runtime.frontend.store.events import index_key, line_entry, lines_key
from runtime.frontend.store.records import SessionRecords
from runtime.tools.local_redis import RedisServer, free_loopback_port

__all__ = ["main", "measure"]

_SID = "5e55" * 8
_KEY = SigningKey("bench", "b" * 32)


async def _write_session(url: str, minutes: float, pieces_per_s: float) -> int:
    """One ended session of ``minutes`` with a piece every ``1 / pieces_per_s`` s; returns the piece count."""
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
    pipe.hset(f"duplex:session:{_SID}", mapping=fields)
    pipe.set(f"duplex:transcript:{_SID}", "".join(words))
    lines = "".join(line_entry(start + n / pieces_per_s, words[n]) for n in range(count))
    pipe.set(lines_key("duplex", _SID), lines)
    pipe.zadd(index_key("duplex"), {_SID: start})
    await pipe.execute()
    await client.aclose()
    return count


async def measure(url: str, *, minutes: float, pieces_per_s: float, reads: int) -> dict[str, float]:
    """Write the session, serve the handler, read it ``reads`` times; the figures (ms, bytes)."""
    pieces = await _write_session(url, minutes, pieces_per_s)
    front = SimpleNamespace(
        access=SimpleNamespace(app_verifier=TokenVerifier([_KEY], "bench", kind="app")),
        records=SessionRecords(url),
    )

    async def handler(request: web.Request) -> web.StreamResponse:
        return await sessions_item(front, request)  # type: ignore[arg-type]

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_loopback_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    headers = {"Authorization": "Bearer " + mint_app_token(_KEY, ttl_s=3600, audience="bench")}
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--pieces-per-s", type=float, nargs="+", default=[4.0, 12.5])
    parser.add_argument("--reads", type=int, default=200)
    args = parser.parse_args(argv)
    print("| pieces/s | pieces | segments | body KiB | p50 ms | p99 ms | max ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            for rate in args.pieces_per_s:
                fig = asyncio.run(
                    measure(server.url, minutes=args.minutes, pieces_per_s=rate, reads=args.reads)
                )
                print(
                    f"| {rate:g} | {fig['pieces']:.0f} | {fig['segments']:.0f} | {fig['body_kb']:.0f} | "
                    f"{fig['p50_ms']:.1f} | {fig['p99_ms']:.1f} | {fig['max_ms']:.1f} |"
                )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
