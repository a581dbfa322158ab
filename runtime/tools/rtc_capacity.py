"""WebRTC sessions per front-end core (issue 22), measured so that the load generator cannot pass for the
server: ``python -m runtime.tools.rtc_bench capacity --sessions 16 24 32 40``.

Layout (needs at least 2 cores in this process's CPU affinity):

- the **front-end worker** (``duplex serve --workers 1``, the ``sim`` model) alone on one core (the last of
  the affinity; every one of its threads is pinned, again at each sample, since aiortc starts threads per
  session), at the bench's own nice;
- the **engine** and supervisor on the other cores, at the bench's nice;
- the **load generator** (aiortc clients, pre-encoded Opus, received packets counted, none decoded) on the
  other cores too, one process per core, ``--generator-nice`` (default 5) above the bench's: lower
  priority than the node, so a starved core shows up as the generator's lateness, not the worker's.

Per session count it reports the worker's own CPU (``/proc/<pid>/stat`` utime + stime, all its threads)
as a percentage of its core, over the whole run and over the steady part (every session streaming: from
5 s after the start to ``--seconds`` after it), and the busiest 1 s; frames lost, client side
(``SessionResult.frames_lost``: gaps in the node's audio, and audio that never came) and server side (the
runtime's ``duplex_frames_dropped_total``, all reasons, and its inbound ``duplex_rtp_packets_total``
concealed: packets its jitter buffer had to fill); first audio p50/p99; and whether **the generator kept
up**: each 20 ms packet's send lateness (when the replay track handed it over, against its schedule) and
its event loop's lag (a 20 ms ticker's overshoot, which also delays what it receives). A run whose
generator sent a packet more than ``LATE_LIMIT_MS`` late, or whose loop stalled that long, is
**invalid**: the node's losses could be the generator's. A count **passes** when its run is valid, every
session was served, no frame was lost on either side and the worker's steady CPU stayed under
``--max-worker-percent`` of its core. Figures are written down (docs/benchmarks.md), not asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.tools.bench_frontend import _get, _group_cpu_s, _metric, node
from runtime.tools.loadgen import _percentile, gather_sessions
from runtime.tools.loadgen_rtc import RtcLoadReport, RtcSessionResult, http_base, run_rtc_session
from runtime.tools.rtc_client import PACKET_S, PacketReplayTrack, encode_packets, local_candidate_nets

__all__ = [
    "LATE_LIMIT_MS",
    "CountResult",
    "GeneratorShare",
    "bench_capacity",
    "markdown",
    "pin",
    "split_cores",
]

_TICKS = os.sysconf("SC_CLK_TCK")
LATE_LIMIT_MS = 60.0
"""A generator packet sent this late (ms), or a loop stall this long, invalidates the run: the server's
jitter buffer adapts up to 60 ms (runtime/frontend/transports/webrtc/jitter.py), so later input may be
concealed there and
counted against the node."""
LATE_INPUT_PER_SESSION = 1.0
"""Late input frames per session a passing count may have: a session's packets arrive at a phase of the
80 ms tick that jitter may cross once (silence fed, the frame taken at the next tick, one frame of lead
from then on); seen on an idle core at 4 sessions. More means the worker hands frames over late."""
MAX_WORKER_PCT = 90.0
"""A passing count keeps the worker's steady CPU under this share of its core (%): headroom for bursts."""
MAX_WORKER_WAIT_PCT = 5.0
"""Above this share of the steady window spent waiting for its core (%), the worker shared its core with
other processes and the run is invalid: its losses may be theirs."""
STEADY_FROM_S = 5.0
"""The steady window starts this long after the load (every session connected by then on a sane run)."""
SAMPLE_S = 0.5
"""How often the worker's CPU is read (s); the busiest second is the max over two consecutive samples."""


def split_cores(affinity: set[int], worker_core: int | None = None) -> tuple[int, list[int]]:
    """(the worker's core, the other cores) of ``affinity``: ``worker_core`` or the highest.

    Raises:
        ValueError: fewer than two cores, or ``worker_core`` not among them (both named).
    """
    cores = sorted(affinity)
    if len(cores) < 2:
        raise ValueError(f"need at least 2 cores (one for the worker, one for the rest), have {cores}")
    chosen = cores[-1] if worker_core is None else worker_core
    if chosen not in cores:
        raise ValueError(f"--worker-core {chosen} is not among this process's cores {cores}")
    return chosen, [c for c in cores if c != chosen]


def pin(pid: int, cores: set[int]) -> int:
    """Pin every thread of process ``pid`` to ``cores`` (``sched_setaffinity`` per task: it is per
    thread); the number of threads pinned. Threads that exit meanwhile are skipped."""
    pinned = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.sched_setaffinity(int(task), cores)
            pinned += 1
    return pinned


def _allowed(pid: int) -> set[int]:
    """Every core some thread of ``pid`` may run on."""
    cores: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            cores |= os.sched_getaffinity(int(task))
    return cores


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _wait_s(pid: int) -> float:
    """Seconds the main thread of ``pid`` (or of this process: ``"self"``) spent runnable but waiting for
    a core (``/proc/<pid>/schedstat``'s second field, ns): time another process held its core."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9


def _worker_pid(port: int) -> int:
    """The pid of the worker that answered ``/healthz`` (its ``Server`` header: ``...pid=<n>``)."""
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/healthz", timeout=10) as response:
        return int(response.headers["Server"].split("pid=", 1)[1])


@dataclass
class GeneratorShare:
    """What one generator process saw of itself: ``sends`` packets handed to RTP senders,
    ``late_sends`` of them more than ``LATE_LIMIT_MS`` behind schedule, ``send_late_max_ms`` the worst;
    ``loop_lag_p99_ms`` / ``loop_lag_max_ms`` its event loop's 20 ms ticker overshoot; ``cpu_s`` its CPU
    seconds; ``wait_s`` the seconds its main thread waited for a core; ``cores`` the cores it ran on."""

    sends: int = 0
    late_sends: int = 0
    wait_s: float = 0.0
    send_late_max_ms: float = 0.0
    loop_lag_p99_ms: float = 0.0
    loop_lag_max_ms: float = 0.0
    cpu_s: float = 0.0
    cores: list[int] = field(default_factory=list)


_LATENESS: list[float] = []


def _metered_recv() -> None:
    """Wrap ``PacketReplayTrack.recv`` (in this generator process) to note each packet's lateness (s)."""
    recv = PacketReplayTrack.recv

    async def metered(self: PacketReplayTrack) -> Any:
        packet = await recv(self)
        if self._start is not None:
            _LATENESS.append(time.monotonic() - (self._start + (self.sent - 1) * PACKET_S))
        return packet

    PacketReplayTrack.recv = metered  # type: ignore[method-assign]


def _generator_init(nice: int) -> None:
    os.nice(nice)


def _generator_share(
    base: str, packets: list[bytes], count: int, stagger_s: float, max_duration_s: float
) -> tuple[list[RtcSessionResult], GeneratorShare]:
    """One generator process: ``count`` sessions replaying ``packets`` (started ``stagger_s`` apart)."""
    _metered_recv()
    # No cyclic collection in the generator: its full collections stalled it 60-70 ms with 20+ sessions,
    # which the kept-up rule calls invalid (a run is 30-60 s: the memory it keeps is small).
    gc.collect()
    gc.freeze()
    gc.disable()
    cpu0, wait0 = time.process_time(), _wait_s(os.getpid())
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.02)
            lags.append(time.monotonic() - before - 0.02)

    async def main() -> list[RtcSessionResult]:
        ticking = asyncio.create_task(ticker())

        async def one(i: int) -> RtcSessionResult:
            await asyncio.sleep(i * stagger_s)
            return await run_rtc_session(base, packets)

        try:
            tasks = [asyncio.create_task(one(i)) for i in range(count)]
            return await gather_sessions(tasks, max_duration_s, RtcSessionResult)
        finally:
            ticking.cancel()

    results = asyncio.run(main())
    late = [1e3 * s for s in _LATENESS]
    share = GeneratorShare(
        sends=len(late),
        late_sends=sum(1 for ms in late if ms > LATE_LIMIT_MS),
        send_late_max_ms=round(max(late, default=0.0), 1),
        loop_lag_p99_ms=round(1e3 * (_percentile(lags, 99) or 0.0), 1),
        loop_lag_max_ms=round(1e3 * max(lags, default=0.0), 1),
        cpu_s=time.process_time() - cpu0,
        wait_s=_wait_s(os.getpid()) - wait0,
        cores=sorted(os.sched_getaffinity(0)),
    )
    return results, share


@dataclass(frozen=True)
class WorkerFigures:
    """The front-end worker's CPU, in % of its one core: ``steady_pct`` over the steady window (every
    session streaming), ``run_pct`` over the whole run, ``peak_1s_pct`` the busiest second; ``wait_pct``:
    how much of the steady window its main thread was runnable but waited for the core (another process
    held it: 0 on a machine left to the bench); ``cores``: every core any of its threads was allowed, as
    read at the samples (the pinning, checked)."""

    steady_pct: float
    run_pct: float
    peak_1s_pct: float
    wait_pct: float
    cores: tuple[int, ...] = ()


@dataclass
class CountResult:
    """One session count's figures (the module docstring); ``row()`` is its JSON line."""

    sessions: int
    report: RtcLoadReport
    generators: list[GeneratorShare]
    worker: WorkerFigures
    engine_pct: float
    server: dict[str, float]
    wall_s: float

    @property
    def generator_kept_up(self) -> bool:
        """No generator packet or loop stall over ``LATE_LIMIT_MS``."""
        return all(g.late_sends == 0 and g.loop_lag_max_ms <= LATE_LIMIT_MS for g in self.generators)

    def frames_lost(self) -> tuple[int, int]:
        """(client side: frames lost over served sessions; server side: frames dropped for any reason but
        ``late_input`` plus inbound RTP packets that never came, 20 ms packets rounded up to 80 ms
        frames). A ``late_input`` frame is not lost: the tick fed silence and took the frame at the next
        tick (:meth:`late_input_per_session`)."""
        client = int(self.report.summary()["frames_lost"] or 0)
        dropped = self.server["frames_dropped"] - self.server["dropped_late_input"]
        server = int(dropped) + -(-int(self.server["rtp_lost"]) // 4)
        return client, server

    def late_input_per_session(self) -> float:
        """Server ticks that found a session's frame not yet there, per session (``late_input``)."""
        return self.server["dropped_late_input"] / self.sessions

    def verdict(self) -> str:
        """``"invalid: ..."``, ``"pass"`` or ``"fail: ..."`` (the module docstring's rule)."""
        if not self.generator_kept_up:
            return "invalid: the generator fell behind (its lateness, not the node's)"
        if self.worker.wait_pct > MAX_WORKER_WAIT_PCT:
            return f"invalid: other processes held the worker's core ({self.worker.wait_pct:.0f} % waiting)"
        summary = self.report.summary()
        client, server = self.frames_lost()
        why = []
        if summary["served"] != self.sessions:
            why.append(f"{summary['served']}/{self.sessions} served")
        if client or server:
            why.append(f"frames lost: client {client}, server {server}")
        if self.late_input_per_session() > LATE_INPUT_PER_SESSION:
            why.append(f"{self.late_input_per_session():.1f} late input frames per session")
        if self.worker.steady_pct >= MAX_WORKER_PCT:
            why.append(f"worker at {self.worker.steady_pct:.0f} % of its core")
        return "fail: " + "; ".join(why) if why else "pass"

    def row(self) -> dict[str, object]:
        summary = self.report.summary()
        client, server = self.frames_lost()
        sessions = self.report.sessions
        return {
            "sessions": self.sessions,
            "served": summary["served"],
            "verdict": self.verdict(),
            "worker_cpu_pct_of_core": {
                "steady": self.worker.steady_pct,
                "run": self.worker.run_pct,
                "peak_1s": self.worker.peak_1s_pct,
                "waiting_for_core": self.worker.wait_pct,
                "cores": list(self.worker.cores),
            },
            "worker_ms_per_session_s": round(10 * self.worker.steady_pct / self.sessions, 2),
            "engine_and_supervisor_cpu_pct": self.engine_pct,
            "frames_lost_client": client,
            "frames_lost_client_max_per_session": max((r.frames_lost() for r in sessions), default=0),
            "frames_lost_server": server,
            "late_input_frames_server": int(self.server["dropped_late_input"]),
            "server_counters": self.server,
            "client_packets_concealed": summary["concealed_packets"],
            "first_audio_ms_p50": _round(summary["first_audio_ms_p50"]),
            "first_audio_ms_p99": _round(summary["first_audio_ms_p99"]),
            "ice_connect_ms_p99": _round(summary["ice_connect_ms_p99"]),
            "generator": {
                "kept_up": self.generator_kept_up,
                "processes": len(self.generators),
                "sends": sum(g.sends for g in self.generators),
                "late_sends_over_60ms": sum(g.late_sends for g in self.generators),
                "send_late_max_ms": max((g.send_late_max_ms for g in self.generators), default=0.0),
                "loop_lag_p99_ms": max((g.loop_lag_p99_ms for g in self.generators), default=0.0),
                "loop_lag_max_ms": max((g.loop_lag_max_ms for g in self.generators), default=0.0),
                "cpu_pct_of_its_cores": round(100 * sum(g.cpu_s for g in self.generators) / self.wall_s, 1),
                "waiting_for_core_pct": round(100 * sum(g.wait_s for g in self.generators) / self.wall_s, 1),
                "cores": sorted({c for g in self.generators for c in g.cores}),
            },
            "wall_s": round(self.wall_s, 1),
        }


def _round(value: float | int | None) -> float | None:
    return None if value is None else round(float(value), 1)


def _server_counters(port: int) -> dict[str, float]:
    metrics = _get(port, "/metrics")[1]
    out: dict[str, float] = {"frames_dropped": 0.0}
    for reason in ("late_input", "input_overflow", "slow_client", "slow_worker"):
        out[f"dropped_{reason}"] = _metric(metrics, f'duplex_frames_dropped_total{{reason="{reason}"}}')
        out["frames_dropped"] += out[f"dropped_{reason}"]
    for outcome in ("received", "late", "concealed", "lost"):
        out[f"rtp_{outcome}"] = _metric(metrics, f'duplex_rtp_packets_total{{outcome="{outcome}"}}')
    out["webrtc_sessions_started"] = _metric(
        metrics, 'duplex_transport_sessions_started_total{transport="webrtc"}'
    )
    return out


@dataclass(frozen=True)
class Layout:
    """Where and how the processes run: ``worker_core`` alone for the worker, ``others`` for the rest;
    ``worker_nice``: the worker's nice (None: the bench's own; lower needs root or CAP_SYS_NICE);
    ``generator_nice``: added to the bench's nice for the generator processes."""

    worker_core: int
    others: tuple[int, ...]
    worker_nice: int | None = None
    generator_nice: int = 5


def _one_count(
    sessions: int, packets: list[bytes], seconds: float, step_ms: str, layout: Layout, stagger_s: float
) -> CountResult:
    processes = min(len(layout.others), sessions)
    counts = [len(range(p, sessions, processes)) for p in range(processes)]
    with node(
        1,
        sessions,
        step_ms,
        env={
            "DUPLEX_RTC_MEDIA_TIMEOUT_S": "10",
            "DUPLEX_RTC_ALLOWED_CANDIDATE_NETS": ",".join(local_candidate_nets()),
        },
    ) as port:
        worker = _worker_pid(port)
        pgid = os.getpgid(worker)
        pin(worker, {layout.worker_core})
        if layout.worker_nice is not None:
            for task in os.listdir(f"/proc/{worker}/task"):  # nice is per thread too
                os.setpriority(os.PRIO_PROCESS, int(task), layout.worker_nice)
        samples: list[tuple[float, float, float]] = []  # (time, CPU s, run-queue wait s)
        seen: set[int] = set()  # the cores the worker's threads were allowed, before each re-pin
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                with contextlib.suppress(OSError):
                    seen.update(_allowed(worker))
                    pin(worker, {layout.worker_core})  # threads aiortc started since
                    samples.append((time.monotonic(), _cpu_s(worker), _wait_s(worker)))
                done.wait(SAMPLE_S)

        group0 = _group_cpu_s(pgid)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        context = multiprocessing.get_context("spawn")
        with context.Pool(processes, initializer=_generator_init, initargs=(layout.generator_nice,)) as pool:
            base = http_base(f"ws://127.0.0.1:{port}")
            parts = pool.starmap(
                _generator_share,
                [(base, packets, n, stagger_s * processes, seconds + 90) for n in counts],
            )
        done.set()
        sampler.join()
        wall = time.monotonic() - started
        group = _group_cpu_s(pgid) - group0
        server = _server_counters(port)
    results: list[RtcSessionResult] = [r for part, _ in parts for r in part]
    steady = [x for x in samples if started + STEADY_FROM_S <= x[0] <= started + seconds] or samples
    (t0, c0, w0), (t1, c1, w1) = steady[0], steady[-1]
    per_s = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(samples, samples[2:], strict=False) if b[0] > a[0]]
    worker_cpu = samples[-1][1] - samples[0][1]
    return CountResult(
        sessions=sessions,
        report=RtcLoadReport(list(results), wall, sum(g.cpu_s for _, g in parts)),
        generators=[g for _, g in parts],
        worker=WorkerFigures(
            steady_pct=round(100 * (c1 - c0) / (t1 - t0), 1),
            run_pct=round(100 * worker_cpu / (samples[-1][0] - samples[0][0]), 1),
            peak_1s_pct=round(100 * max(per_s, default=0.0), 1),
            wait_pct=round(100 * (w1 - w0) / (t1 - t0), 1),
            cores=tuple(sorted(seen)),
        ),
        engine_pct=round(100 * (group - worker_cpu) / wall, 1),
        server=server,
        wall_s=wall,
    )


def bench_capacity(
    counts: list[int],
    *,
    clip: np.ndarray,
    seconds: float = 30.0,
    step_ms: str = "30",
    worker_core: int | None = None,
    worker_nice: int | None = None,
    generator_nice: int = 5,
    stagger_s: float = 0.05,
) -> list[CountResult]:
    """One run per session count, in order (the module docstring); prints nothing.

    Args:
        counts: session counts, each 1..256. clip: 24 kHz speech each session streams once (then
            silence); seconds: its length in s (>= 10).
        worker_core: the worker's core (default: the highest this process may use); worker_nice,
            generator_nice: :class:`Layout`'s.
        stagger_s: between two sessions' starts (s).

    Raises:
        ValueError: fewer than two cores, a bad count, ``seconds`` under 10, a negative nice or stagger.
        PermissionError: ``worker_nice`` below the bench's own without the right to raise priority.
    """
    if any(not 1 <= n <= 256 for n in counts) or not counts:
        raise ValueError(f"session counts must be between 1 and 256, got {counts}")
    if seconds < 10:
        raise ValueError(f"--seconds must be at least 10 (the steady window starts at 5 s), got {seconds}")
    if generator_nice < 0 or stagger_s < 0:
        raise ValueError(f"--generator-nice and --stagger-ms must be >= 0, got {generator_nice}, {stagger_s}")
    chosen, others = split_cores(os.sched_getaffinity(0), worker_core)
    layout = Layout(chosen, tuple(others), worker_nice, generator_nice)
    packets = encode_packets(clip)
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(others))  # the node (engine, supervisor) and the generator inherit this
    try:
        return [_one_count(n, packets, seconds, step_ms, layout, stagger_s) for n in counts]
    finally:
        os.sched_setaffinity(0, own)


def markdown(results: list[CountResult]) -> str:
    """The results as a Markdown table, then the highest passing count (or that none passed)."""
    lines = [
        "| sessions | served | worker CPU, % of its core: steady / run / peak 1 s / waiting | frames lost "
        "client / server | late input | first audio p50 / p99 | generator: late sends / loop lag max / CPU "
        "| verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for result in results:
        row = result.row()
        w, g = result.worker, row["generator"]
        assert isinstance(g, dict)
        lines.append(
            f"| {result.sessions} | {row['served']} | {w.steady_pct} / {w.run_pct} / {w.peak_1s_pct} / "
            f"{w.wait_pct} | {row['frames_lost_client']} / {row['frames_lost_server']} | "
            f"{row['late_input_frames_server']} | {row['first_audio_ms_p50']} / "
            f"{row['first_audio_ms_p99']} ms | {g['late_sends_over_60ms']} / {g['loop_lag_max_ms']} ms / "
            f"{g['cpu_pct_of_its_cores']} % | {row['verdict']} |"
        )
    passed = [r.sessions for r in results if r.verdict() == "pass"]
    lines += ["", f"Highest count that passed: {max(passed)}" if passed else "No count passed."]
    return "\n".join(lines)


def describe_machine() -> dict[str, object]:
    """The machine the figures come from: cores visible, load average, this process's nice."""
    return {
        "cores": sorted(os.sched_getaffinity(0)),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "bench_nice": os.nice(0),
    }


def dumps(result: CountResult) -> str:
    """One count's JSON line."""
    return json.dumps(result.row())
