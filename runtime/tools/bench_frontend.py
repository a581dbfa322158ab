"""Benchmarks of the serving front end (issue 16), on one machine, against a real node on loopback.

Two runs, each against a fresh ``duplex serve`` on the ``sim`` model (a fixed step time, 30 ms by default)
started as a child process group, with ``--workers 0`` (one process: the model's tick, WebSockets, Opus,
tokens and HTTP on one interpreter, as before the split) or ``--workers N``:

- ``sessions``: S Opus sessions of speech at real-time pace from ``duplex loadgen``'s code (pre-encoded
  Opus, so the generator spends its CPU on sockets), then the node's figures: frames lost, first audio
  p99, tick p99 (from ``/metrics``), the node's CPU (its processes' user + system time, from
  ``/proc/<pid>/stat``) per Opus session-second, and the generator's own CPU.
- ``flood``: one session streams while a separate process floods the port for a bounded time with
  ``metrics`` (GET /metrics), ``upgrades`` (WebSocket upgrades without a token: 401) or ``tokens``
  (upgrades with valid, fresh tokens); the session's longest audio gap is the figure.

Figures are written down, not asserted: ``python -m runtime.tools.bench_frontend sessions --workers 1``. The
machine's other load shows in them; report its core count beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from runtime.frontend.codecs.protocol import AudioFormat
from runtime.tools.loadgen import run_load, run_session, session_url, synthesize_speech
from runtime.tools.local_redis import free_loopback_port

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_TICKS = os.sysconf("SC_CLK_TCK")


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with _NO_PROXY.open(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (from /proc)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat: pgrp
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICKS


def _histogram_quantile(metrics: str, name: str, q: float) -> float | None:
    """The ``q`` quantile of a Prometheus histogram's buckets (upper bound of the bucket reached)."""
    buckets: list[tuple[float, float]] = []
    for line in metrics.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return None
    buckets.sort()
    total = buckets[-1][1]
    for bound, count in buckets:
        if count >= q * total:
            return bound
    return None


def _metric(metrics: str, sample: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@contextlib.contextmanager
def node(workers: int, sessions: int, step_ms: str, *, env: dict[str, str] | None = None) -> Iterator[int]:
    """A ``duplex serve`` process group on a free port; yields the port once ``/readyz`` is 200."""
    port = free_loopback_port()
    environment = {
        **os.environ,
        "DUPLEX_AUTH_MODE": "off",
        "DUPLEX_MODEL": "sim",
        "DUPLEX_SIM_STEP_MS": step_ms,
        "DUPLEX_MAX_SESSIONS": str(sessions),
        "DUPLEX_DRAIN_GRACE_S": "1",
        # The load generator is one client address: the per-client handshake limit would refuse its burst.
        "DUPLEX_HANDSHAKE_RATE_PER_CLIENT": "0",
        **(env or {}),
    }
    command = [
        sys.executable,
        "-m",
        "runtime.tools.cli",
        "serve",
        "--port",
        str(port),
        "--workers",
        str(workers),
    ]
    with tempfile.NamedTemporaryFile(prefix="duplex-bench-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(
            command, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the node exited; log: {log.name}")
            with contextlib.suppress(OSError):
                if _get(port, "/readyz")[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node did not start; log: {log.name}")
            time.sleep(0.3)
        time.sleep(2.0 if workers else 0.5)  # every worker up
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def bench_sessions(workers: int, sessions: int, step_ms: str, seconds: float) -> dict[str, object]:
    """``sessions`` Opus sessions of ``seconds`` of speech; the figures of the module docstring."""
    clip = synthesize_speech(
        "Hello, I would like to book a table for two tonight at eight, near the river if possible, "
        "and tell me about the weather tomorrow morning in Paris and the trains back home."
    )
    while len(clip) < seconds * 24000:
        clip = np.concatenate([clip, clip])
    clip = clip[: int(seconds * 24000)]
    with node(workers, sessions, step_ms) as port:
        pgid = pid_group(port)
        cpu0 = _group_cpu_s(pgid)
        report = asyncio.run(
            run_load(
                session_url(f"ws://127.0.0.1:{port}", audio_format=AudioFormat.OPUS),
                [clip],
                sessions=sessions,
                audio_format=AudioFormat.OPUS,
                max_duration_s=seconds + 60,
            )
        )
        node_cpu = _group_cpu_s(pgid) - cpu0
        metrics = _get(port, "/metrics")[1]
    summary = report.summary()
    session_seconds = sum(r.frames_sent for r in report.served) * 0.08
    return {
        "workers": workers,
        "sessions": sessions,
        "step_ms": step_ms,
        "served": summary["served"],
        "cut": summary["cut"],
        "frames_lost": summary["frames_lost"],
        "late_input_frames": _metric(metrics, 'duplex_frames_dropped_total{reason="late_input"}'),
        "first_audio_ms_p99": summary["first_audio_ms_p99"],
        "inter_frame_gap_ms_p99": summary["inter_frame_gap_ms_p99"],
        "tick_p99_ms_bucket": _ms(_histogram_quantile(metrics, "duplex_tick_duration_seconds", 0.99)),
        "ticks_over_budget": _metric(metrics, "duplex_ticks_over_budget_total"),
        "node_cpu_s": round(node_cpu, 2),
        "node_cpu_ms_per_session_second": round(1e3 * node_cpu / session_seconds, 2)
        if session_seconds
        else None,
        "loadgen_cpu_percent": summary["loadgen_cpu_percent"],
        "wall_s": summary["wall_s"],
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def pid_group(port: int) -> int:
    """The process group of the node listening on ``port`` (the bench started it as a group leader)."""
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True).stdout
    pid = int(out.split("pid=", 1)[1].split(",", 1)[0])
    return os.getpgid(pid)


def _flood(port: int, kind: str, rate: float, seconds: float, keys_json: str | None, audience: str) -> None:
    """Child process: ``rate`` requests per second of ``kind`` for ``seconds`` (fire and forget)."""

    async def one(request: bytes) -> None:
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
            writer.write(request)
            await writer.drain()
            await asyncio.wait_for(reader.read(4096), 5)
            writer.close()

    def request() -> bytes:
        if kind == "metrics":
            return b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        path = "/api/chat?format=opus"
        if kind == "tokens":
            from runtime.frontend.gate.tokens import keys_from_mapping, mint_token

            key = keys_from_mapping(json.loads(keys_json or "{}"))[0]
            path += "&token=" + mint_token(key, audience=audience, ttl_s=60, personas=["*"])
        return (
            f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()

    async def main() -> None:
        tasks: set[asyncio.Task[None]] = set()
        start = time.monotonic()
        sent = 0
        while time.monotonic() - start < seconds:
            due = int((time.monotonic() - start) * rate)
            while sent < due:
                task = asyncio.create_task(one(request()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                sent += 1
            await asyncio.sleep(0.005)
        await asyncio.gather(*tasks, return_exceptions=True)
        print(json.dumps({"sent": sent}), flush=True)

    asyncio.run(main())


def bench_flood(workers: int, kind: str, rate: float, seconds: float, step_ms: str) -> dict[str, object]:
    """One session streams ``seconds + 4`` s while the port takes ``rate``/s of ``kind`` for ``seconds``."""
    from runtime.frontend.gate.tokens import generate_signing_key

    key = generate_signing_key("bench")
    keys_json = json.dumps({key.kid: key.secret.decode()})
    env = {"DUPLEX_AUTH_MODE": "token", "DUPLEX_TOKEN_KEYS": keys_json, "DUPLEX_TOKEN_REPLAY_CHECK": "memory"}
    clip = synthesize_speech("One two three four five six seven eight nine ten, and again from the start.")
    clip = np.tile(clip, int((seconds + 4) * 24000 // len(clip)) + 1)[: int((seconds + 4) * 24000)]
    with node(workers, 8, step_ms, env=env) as port:
        from runtime.frontend.gate.tokens import mint_token

        context = multiprocessing.get_context("spawn")
        flooder = context.Process(target=_flood, args=(port, kind, rate, seconds, keys_json, "duplex"))

        async def session() -> object:
            task = asyncio.create_task(
                run_session(
                    session_url(f"ws://127.0.0.1:{port}", audio_format=AudioFormat.OPUS),
                    clip,
                    audio_format=AudioFormat.OPUS,
                    token=mint_token(key, audience="duplex", ttl_s=120, personas=["*"]),
                )
            )
            await asyncio.sleep(1.5)
            flooder.start()
            return await task

        result = asyncio.run(session())
        flooder.join(seconds + 30)
        metrics = _get(port, "/metrics")[1]
    return {
        "workers": workers,
        "flood": kind,
        "rate_per_s": rate,
        "seconds": seconds,
        "session_served": result.handshake,  # type: ignore[attr-defined]
        "session_max_audio_gap_ms": round(result.max_audio_gap_s() * 1e3, 1),  # type: ignore[attr-defined]
        "session_frames_lost": result.frames_lost(),  # type: ignore[attr-defined]
        "rate_limited": _metric(metrics, 'duplex_admissions_refused_total{reason="rate_limited"}'),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.tools.bench_frontend", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sessions", help="S Opus sessions; frames lost, latencies, CPU")
    s.add_argument("--workers", type=int, default=1)
    s.add_argument("--sessions", type=int, default=64)
    s.add_argument("--step-ms", default="30")
    s.add_argument("--seconds", type=float, default=20.0)
    f = sub.add_parser("flood", help="one session's audio gaps under a flood of requests")
    f.add_argument("--workers", type=int, default=1)
    f.add_argument("--kind", choices=("metrics", "upgrades", "tokens"), required=True)
    f.add_argument("--rate", type=float, default=500.0)
    f.add_argument("--seconds", type=float, default=10.0)
    f.add_argument("--step-ms", default="30")
    args = parser.parse_args(argv)
    if args.command == "sessions":
        row = bench_sessions(args.workers, args.sessions, args.step_ms, args.seconds)
    else:
        row = bench_flood(args.workers, args.kind, args.rate, args.seconds, args.step_ms)
    row["host_cores"] = os.cpu_count()
    print(json.dumps(row))


if __name__ == "__main__":
    main()
