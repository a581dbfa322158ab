"""A memory soak of the serving front end (issue 31): churning sessions for a long time against a real node,
each process's resident memory sampled on a fixed period, and the frames lost meanwhile.

``python -m runtime.tools.memory_soak --workers 2 --sessions 16 --minutes 120`` starts ``duplex serve`` on the
``sim`` model (``runtime.tools.bench_frontend.node``: its own process group on a free loopback port) and keeps
``--sessions`` Opus sessions going: each streams a prefix of one pre-encoded speech clip, between
``--session-s`` seconds (drawn per session from a seeded generator), ends with a normal close, and a new one
takes its place at once, so session objects, sockets, codecs and tasks are made and dropped all run long.
Every ``--sample-s`` seconds it reads ``VmRSS`` of every process of the node's group (``/proc/<pid>/status``;
the engine, and each worker with ``--workers N``).

The figure of merit is each worker's slope after warm-up: a least-squares line through the samples of the
run's second half, in MB per hour (``numpy.polyfit``). A node runs for weeks: a slope that is not flat
(say over 1 MB/h) is a leak or a garbage-collector policy that trades memory for frames
(``DUPLEX_GC_THRESHOLDS``, ``runtime/gc_policy.py``; ``--gc-thresholds`` sets it for the run).

Figures are written down (docs/benchmarks.md), never asserted; the run prints one JSON object. Units: MB are
10^6 bytes (``VmRSS`` is in KiB: converted), minutes and seconds of wall-clock time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.frontend.codecs.protocol import AudioFormat
from runtime.tools.bench_frontend import node, pid_group
from runtime.tools.loadgen import SessionResult, encode_messages, run_session, session_url, synthesize_speech

__all__ = ["SoakReport", "group_rss_mb", "slope_mb_per_hour", "soak"]

FRAME_SAMPLES = 1920
"""One 80 ms frame at 24 kHz (Kyutai's protocol; the sim model's frame)."""


def _pgid_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, ValueError, IndexError):
        return None


def _role(pid: int, pgid: int) -> str:
    """What a process of the node is: ``supervisor`` (the group leader, ``duplex serve``),
    ``resource_tracker`` (multiprocessing's), ``engine`` (the one with torch loaded: the model's process),
    else ``worker`` (a front-end worker; with ``--workers 0`` the supervisor serves itself)."""
    if pid == pgid:
        return "supervisor"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"resource_tracker" in argv:
            return "resource_tracker"
        with open(f"/proc/{pid}/maps", "rb") as maps:
            return "engine" if any(b"libtorch" in line for line in maps) else "worker"
    except OSError:
        return "gone"


def group_rss_mb(pgid: int) -> dict[int, tuple[str, float]]:
    """``{pid: (role, resident MB)}`` of every live process in process group ``pgid`` (``VmRSS``, KiB in
    ``/proc/<pid>/status``, as 10^6 bytes)."""
    found: dict[int, tuple[str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or _pgid_of(int(entry)) != pgid:
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                found[int(entry)] = (_role(int(entry), pgid), int(line.split()[1]) * 1024 / 1e6)
    return found


def slope_mb_per_hour(samples: list[tuple[float, float]]) -> float | None:
    """The least-squares slope (MB per hour) of ``(minutes, MB)`` samples; None for fewer than 3."""
    if len(samples) < 3:
        return None
    minutes, mb = np.array(samples).T
    return float(np.polyfit(minutes, mb, 1)[0] * 60.0)


@dataclass
class SoakReport:
    """One soak run.

    Attributes:
        rss: per pid, ``(role, [(minutes since start, MB), ...])``.
        sessions: sessions that ran (served or not); ``failed``: not served or ended early, ``failures``
            their reasons, counted.
        frames_lost: 80 ms frames the clients sent that were not answered (``SessionResult.frames_lost``).
    """

    workers: int
    sessions_concurrent: int
    minutes: float
    gc_thresholds: str
    rss: dict[int, tuple[str, list[tuple[float, float]]]] = field(default_factory=dict)
    sessions: int = 0
    failed: int = 0
    frames_sent: int = 0
    frames_lost: int = 0
    failures: dict[str, int] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        """The figures: per process its first, warm (a quarter in) and last sample and its second-half
        slope (MB/h); the sessions and frames."""
        processes = []
        for pid, (role, samples) in sorted(self.rss.items()):
            half = [s for s in samples if s[0] >= samples[-1][0] / 2] if samples else []
            warm = (
                next((mb for minute, mb in samples if minute >= samples[-1][0] / 4), None)
                if samples
                else None
            )
            processes.append(
                {
                    "pid": pid,
                    "role": role,
                    "first_mb": round(samples[0][1], 1) if samples else None,
                    "warm_mb": None if warm is None else round(warm, 1),
                    "last_mb": round(samples[-1][1], 1) if samples else None,
                    "second_half_slope_mb_per_h": None
                    if (slope := slope_mb_per_hour(half)) is None
                    else round(slope, 2),
                    "samples": [(round(m, 1), round(mb, 1)) for m, mb in samples],
                }
            )
        return {
            "workers": self.workers,
            "sessions_concurrent": self.sessions_concurrent,
            "minutes": self.minutes,
            "gc_thresholds": self.gc_thresholds,
            "sessions": self.sessions,
            "failed": self.failed,
            "failures": self.failures,
            "frames_sent": self.frames_sent,
            "frames_lost": self.frames_lost,
            "processes": processes,
            "host_cores": os.cpu_count(),
        }


async def _lane(
    url: str,
    clip: np.ndarray,
    messages: list[bytes],
    lengths: tuple[float, float],
    deadline: float,
    rng: random.Random,
    results: list[SessionResult],
) -> None:
    """Sessions one after another until ``deadline`` (monotonic s), each a prefix of ``clip``."""
    while time.monotonic() < deadline:
        frames = int(rng.uniform(*lengths) / 0.08)
        frames = max(1, min(frames, len(messages)))
        results.append(
            await run_session(
                url,
                clip[: frames * FRAME_SAMPLES],
                audio_format=AudioFormat.OPUS,
                messages=messages[:frames],
                tail_s=0.3,
            )
        )


async def _drive(
    port: int, pgid: int, report: SoakReport, lengths: tuple[float, float], sample_s: float, seed: int
) -> None:
    clip = synthesize_speech(
        "Hello, I would like to book a table for two tonight at eight, near the river if possible, "
        "and tell me about the weather tomorrow morning in Paris and the trains back home."
    )
    while len(clip) < lengths[1] * 24000:
        clip = np.concatenate([clip, clip])
    messages = encode_messages(clip, AudioFormat.OPUS)
    url = session_url(f"ws://127.0.0.1:{port}", audio_format=AudioFormat.OPUS)
    started = time.monotonic()
    deadline = started + report.minutes * 60
    results: list[SessionResult] = []
    rng = random.Random(seed)
    lanes = [
        asyncio.create_task(
            _lane(url, clip, messages, lengths, deadline, random.Random(rng.random()), results)
        )
        for _ in range(report.sessions_concurrent)
    ]

    async def sample() -> None:
        while True:
            minute = (time.monotonic() - started) / 60
            for pid, (role, mb) in group_rss_mb(pgid).items():
                report.rss.setdefault(pid, (role, []))[1].append((minute, mb))
            await asyncio.sleep(sample_s)

    sampler = asyncio.create_task(sample())
    await asyncio.gather(*lanes)
    sampler.cancel()
    report.sessions = len(results)
    report.failed = sum(1 for r in results if r.failure)
    report.failures = dict(Counter(r.failure[:100] for r in results if r.failure))
    report.frames_sent = sum(r.frames_sent for r in results)
    report.frames_lost = sum(r.frames_lost() for r in results if r.handshake)


def soak(
    *,
    workers: int,
    sessions: int,
    minutes: float,
    session_s: tuple[float, float] = (20.0, 60.0),
    sample_s: float = 60.0,
    gc_thresholds: str | None = None,
    step_ms: str = "30",
    seed: int = 31,
) -> SoakReport:
    """Run one soak (the module docstring's); the node is stopped at the end.

    Raises:
        ValueError: a bad range (``session_s`` not 0 < low <= high, ``minutes`` or ``sample_s`` <= 0).
        RuntimeError: the node did not start.
    """
    low, high = session_s
    if not 0 < low <= high:
        raise ValueError(f"session_s must be 0 < low <= high seconds, got {session_s}")
    if minutes <= 0 or sample_s <= 0:
        raise ValueError(f"minutes and sample_s must be > 0, got {minutes} and {sample_s}")
    env = {} if gc_thresholds is None else {"DUPLEX_GC_THRESHOLDS": gc_thresholds}
    report = SoakReport(workers, sessions, minutes, gc_thresholds or "the node's default")
    # Slots beyond the sessions: a replacement connects as its predecessor closes, before the engine has
    # freed that slot (a node_full refusal would be the harness's, not the node's).
    with node(workers, sessions + max(2, sessions // 4), step_ms, env=env) as port:
        pgid = pid_group(port)
        asyncio.run(_drive(port, pgid, report, session_s, sample_s, seed))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.tools.memory_soak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--sessions", type=int, default=16, help="concurrent sessions, each replaced as it ends"
    )
    parser.add_argument("--minutes", type=float, default=120.0)
    parser.add_argument("--session-s", type=float, nargs=2, default=(20.0, 60.0), metavar=("LOW", "HIGH"))
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument(
        "--gc-thresholds", default=None, help='DUPLEX_GC_THRESHOLDS for the run ("default": Python\'s)'
    )
    parser.add_argument("--step-ms", default="30")
    parser.add_argument("--seed", type=int, default=31)
    args = parser.parse_args(argv)
    try:
        report = soak(
            workers=args.workers,
            sessions=args.sessions,
            minutes=args.minutes,
            session_s=tuple(args.session_s),
            sample_s=args.sample_s,
            gc_thresholds=args.gc_thresholds,
            step_ms=args.step_ms,
            seed=args.seed,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(json.dumps(report.as_json()))


if __name__ == "__main__":
    main()
