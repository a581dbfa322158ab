"""The first-audio latency budget, term by term (issue 24, item 1; docs/benchmarks.md, "First-audio latency
budget"): ingress, phase wait, ticks to first audio, that tick's compute, egress.

The scheduler and the session run on one injected clock and the tests call ``SlotScheduler.tick_once``
themselves, so every figure is exact and none depends on the machine's speed. The sim engine spends its
step time through its injected ``sleep``, which moves the same clock: a tick's compute is its step time.
The last test runs a real node of each kind (``--workers 0`` and ``--workers 2``) on real clocks and checks
only what does not depend on time: every term observed once per session, and the tick count.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace

import numpy as np
import pytest
from fake_clock import FakeClock
from inproc_node import InProcessNode

from runtime.config import RuntimeConfig
from runtime.engine.api import FirstAudioTiming, SamplingParams
from runtime.engine.batch import TickBuffers, TickResult, TickTimings
from runtime.engine.engine_core import LocalSlots
from runtime.engine.model_presets import FRAME_SAMPLES, get_preset
from runtime.engine.scheduler import SlotScheduler, SlotSession
from runtime.engine.sim import SimEngine
from runtime.engine.sim_timing import StepTime
from runtime.engine.waiting_room import SlotAdmission
from runtime.frontend.gate.query import parse_session_query
from runtime.frontend.server import DuplexServer
from runtime.frontend.session.conversation import ChatSession, Transport
from runtime.metrics import RuntimeMetrics
from runtime.tools.loadgen import (
    FIRST_AUDIO_TERMS,
    Histogram,
    budget_line,
    first_audio_budget,
    parse_histograms,
    run_session,
    session_url,
)

FRAME_S = 0.08
STEP_MS = 30.0
"""The sim engine's step time here: the compute of every tick."""


class _Tokenizer:
    """What the scheduler and the sim engine ask of a sentencepiece tokenizer."""

    def vocab_size(self) -> int:
        return 256

    def id_to_piece(self, token: int) -> str:
        return f"<{token}>"


def _sim(clock: FakeClock, slots: int = 2) -> SimEngine:
    return SimEngine(slots, StepTime(((1, STEP_MS),)), text_vocab=256, sleep=clock.advance)


def sim_delay_ticks() -> int:
    """The sim engine's own delay, stepping it alone: ticks from the one that takes a live slot's first frame
    to the one whose output has audio for it (1 while the engine drops each session's first frame, as
    ``batch.py`` did before its encoder pre-roll; 0 without the drop)."""
    engine = _sim(FakeClock(), slots=1)
    engine.join(0, SamplingParams())
    pcm = np.full((1, FRAME_SAMPLES), 0.1, dtype=np.float32)
    for tick in range(10):
        if engine.tick(pcm, np.ones(1, dtype=bool)).audio_ready[0]:
            return tick
    raise AssertionError("the sim engine gave no audio in 10 ticks")


class _DelayEngine:
    """An engine whose audio for a slot comes ``delay`` ticks after the tick that first stepped it (the tick
    that took its first frame), each tick costing ``compute_s`` on the clock."""

    def __init__(self, slots: int, delay: int, clock: FakeClock, compute_s: float = 0.012) -> None:
        self.slots = slots
        self.delay = delay
        self.clock = clock
        self.compute_s = compute_s
        self._stepped = [-1] * slots  # ticks each slot has been stepped, -1 before its first
        self._out = TickBuffers(slots, 8)
        self.during_tick: Callable[[], object] | None = None
        """Called in the middle of a tick's compute (what the event loop does meanwhile)."""

    def join(self, slot: int, sampling: SamplingParams, prompt: object = None) -> None:
        self._stepped[slot] = -1

    def leave(self, slot: int) -> None:
        self._stepped[slot] = -1

    def tick(self, pcm_in: np.ndarray, active: np.ndarray) -> TickResult:
        self._out.clear()
        self.clock.advance(self.compute_s)
        if self.during_tick is not None:
            self.during_tick()
        for slot in np.flatnonzero(active):
            self._stepped[slot] += 1
            if self._stepped[slot] >= self.delay:
                self._out.audio_ready[slot] = True
                self._out.pcm[slot] = pcm_in[slot]
        return self._out.result([], TickTimings(total_ms=self.compute_s * 1e3))

    def memory_allocated_bytes(self) -> None:
        return None


def _scheduler(engine: object, clock: FakeClock, metrics: RuntimeMetrics | None = None) -> SlotScheduler:
    loop = asyncio.get_running_loop()
    return SlotScheduler(engine, _Tokenizer(), metrics or RuntimeMetrics(), loop, clock=clock)  # type: ignore[arg-type]


class _Session:
    """A scheduler session that records what it is handed, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []
        self.slot_session = SlotSession(
            "s",
            SamplingParams(),
            [],
            on_output=lambda pcm, piece: self.events.append(("output", pcm is not None)),
            on_prompt_done=lambda: None,
            on_first_audio=lambda timing: self.events.append(("first_audio", timing)),
        )

    @property
    def timing(self) -> FirstAudioTiming | None:
        found = [value for kind, value in self.events if kind == "first_audio"]
        assert len(found) <= 1, "the first-audio timing came more than once"
        return found[0] if found else None  # type: ignore[return-value]


async def _tick_at(scheduler: SlotScheduler, clock: FakeClock, at: float) -> None:
    """Set the clock to ``at``, run one tick, let the event loop run what it handed over."""
    clock.now = at
    scheduler.tick_once()
    for _ in range(3):
        await asyncio.sleep(0)


async def _first_audio_timing(
    scheduler: SlotScheduler, clock: FakeClock, session: _Session, arrive_before_tick_s: float
) -> FirstAudioTiming:
    """Ticks on the 80 ms grid from t0: the session joins at tick 0, its first frame arrives
    ``arrive_before_tick_s`` before tick 2, and one frame comes every tick after; ticks until its first
    audio (at most 10)."""
    t0 = clock.now
    scheduler.admit(session.slot_session)
    await _tick_at(scheduler, clock, t0)
    await _tick_at(scheduler, clock, t0 + FRAME_S)  # joined, no frame yet: ticks that must not count
    clock.now = t0 + 2 * FRAME_S - arrive_before_tick_s
    frame = np.full(FRAME_SAMPLES, 0.1, dtype=np.float32)
    for k in range(2, 12):
        session.slot_session.push_frame(frame)
        await _tick_at(scheduler, clock, t0 + k * FRAME_S)
        if session.timing is not None:
            return session.timing
    raise AssertionError(f"no first audio in 10 ticks; events: {session.events}")


@pytest.mark.parametrize("wait_ms", [0.0, 13.5, 41.0, 79.0])
async def test_a_frame_arriving_x_ms_before_a_tick_waits_x_ms(wait_ms: float) -> None:
    """Phase wait = the start of the tick that takes the first frame minus its arrival. A scheduler that
    stamped the tick's end instead (or the frame's own tick as its arrival) would be off by the step time
    (30 ms) or by the whole wait."""
    clock = FakeClock()
    scheduler = _scheduler(_sim(clock), clock)
    session = _Session()
    timing = await _first_audio_timing(scheduler, clock, session, wait_ms / 1e3)
    assert timing.phase_wait_s == pytest.approx(wait_ms / 1e3, abs=1e-9)
    assert timing.tick_compute_s == pytest.approx(STEP_MS / 1e3, abs=1e-9)
    assert timing.audio_tick_at == pytest.approx(timing.taken_at + timing.ticks * FRAME_S, abs=1e-9)
    # The timing reaches the event loop before the audio it describes.
    kinds = [kind for kind, value in session.events if kind == "first_audio" or value is True]
    assert kinds[:2] == ["first_audio", "output"], session.events


async def test_the_tick_count_is_the_sim_engines_delay() -> None:
    """Ticks to first audio, counted from the tick that takes the first frame (not from the join, not from
    1): exactly the sim engine's own delay (``sim_delay_ticks``), however many ticks the slot spent joined
    and idle before its caller's first frame."""
    clock = FakeClock()
    scheduler = _scheduler(_sim(clock), clock)
    session = _Session()
    timing = await _first_audio_timing(scheduler, clock, session, 0.02)
    assert timing.ticks == sim_delay_ticks()


@pytest.mark.parametrize("delay", [0, 1, 2, 5])
async def test_the_tick_count_follows_the_engine(delay: int) -> None:
    """The count is the engine's, whatever it is: an engine with a known delay of ``delay`` ticks."""
    clock = FakeClock()
    scheduler = _scheduler(_DelayEngine(2, delay, clock), clock)
    session = _Session()
    timing = await _first_audio_timing(scheduler, clock, session, 0.05)
    assert timing.ticks == delay
    assert timing.tick_compute_s == pytest.approx(0.012, abs=1e-9)


async def test_a_frame_that_arrives_while_a_tick_computes_waits_for_the_next() -> None:
    """A tick takes the frames that are there when it starts; one pushed while it computes (the event loop
    runs beside the tick thread) is the next tick's, and its phase wait runs from its arrival to that tick's
    start (never negative, never counted from the tick it missed)."""
    clock = FakeClock()
    engine = _DelayEngine(1, 0, clock, compute_s=0.03)
    scheduler = _scheduler(engine, clock)
    session = _Session()
    scheduler.admit(session.slot_session)
    t0 = clock.now
    await _tick_at(scheduler, clock, t0)
    frame = np.full(FRAME_SAMPLES, 0.1, dtype=np.float32)
    engine.during_tick = lambda: session.slot_session.push_frame(frame)  # arrives at t0 + 80 ms + 30 ms
    await _tick_at(scheduler, clock, t0 + FRAME_S)
    engine.during_tick = None
    assert session.timing is None and session.slot_session.taken_tick < 0
    await _tick_at(scheduler, clock, t0 + 2 * FRAME_S)
    assert session.timing is not None
    assert session.timing.phase_wait_s == pytest.approx(FRAME_S - 0.03, abs=1e-9)
    assert session.timing.ticks == 0


# --- the whole budget, through the front end's session and the in-process backend ----------------------


class _Transport(Transport):
    def __init__(self) -> None:
        self.audio: list[np.ndarray] = []

    async def send_audio(self, pcm: np.ndarray) -> None:
        self.audio.append(pcm)

    async def send_text(self, piece: str) -> None:
        pass

    async def close(self, code: int, reason: str) -> None:
        pass


class _Access:
    async def spend(self, claims: object) -> None:
        pass


def _fake_bundle() -> SimpleNamespace:
    """What ``LocalSlots`` reads of a model bundle for the sim model."""
    return SimpleNamespace(
        text_tokenizer=_Tokenizer(),
        lm=SimpleNamespace(num_codebooks=17, dep_q=8, delays=get_preset("sim").lm_kwargs["delays"]),
        mimi=None,
        source="sim",  # no weights directory, no repo: no voices.tgz to look for
        preset=get_preset("sim"),
    )


def _histogram(metrics: RuntimeMetrics, name: str) -> tuple[float, float]:
    """(count, sum) of histogram ``name`` in ``metrics``' registry."""
    count = metrics.registry.get_sample_value(f"{name}_count")
    total = metrics.registry.get_sample_value(f"{name}_sum")
    assert count is not None and total is not None, name
    return count, total


BUDGET = (
    "duplex_first_audio_ingress_seconds",
    "duplex_first_audio_phase_wait_seconds",
    "duplex_first_audio_ticks",
    "duplex_first_audio_tick_compute_seconds",
    "duplex_first_audio_egress_seconds",
)


@pytest.mark.parametrize("wait_ms, egress_ms", [(0.0, 0.0), (27.0, 4.5), (79.5, 61.0)])
async def test_the_terms_add_up_to_the_first_audio_latency(wait_ms: float, egress_ms: float) -> None:
    """Through ``ChatSession`` over ``LocalSlots`` (``--workers 0``), on one clock: each term is observed
    once, and ingress + phase wait + ticks x 80 ms + tick compute + egress is exactly the first-audio
    latency observed with them, when the ticks keep time. Each term is also checked against what the test
    did: a term computed from the wrong timestamps breaks the sum or its own value."""
    clock = FakeClock()
    metrics = RuntimeMetrics()
    config = RuntimeConfig(model="sim", auth_mode="off")
    slots = LocalSlots(config, _fake_bundle(), metrics)  # type: ignore[arg-type]
    slots.engine = _sim(clock)  # type: ignore[assignment]
    scheduler = _scheduler(slots.engine, clock, metrics)
    slots.scheduler = scheduler
    slots.admission = SlotAdmission(scheduler, wait_s=0.0, max_waiting=0, metrics=metrics)
    slots.warm = True
    front = SimpleNamespace(config=config, metrics=metrics, backend=slots, store=None, access=_Access())
    transport = _Transport()
    session = ChatSession(front, transport, parse_session_query("format=pcm"), SamplingParams(), None, "c")  # type: ignore[arg-type]
    session.clock = clock
    t0 = clock.now
    admit = asyncio.ensure_future(session.admit())
    for _ in range(3):
        await asyncio.sleep(0)
    await _tick_at(scheduler, clock, t0)  # the join; no persona: live at once
    await admit
    await session.wait_prompt()
    sender = asyncio.ensure_future(session.send_loop())
    try:
        clock.now = t0 + 2 * FRAME_S - wait_ms / 1e3
        frame = np.full(FRAME_SAMPLES, 1000 / 32768, dtype=np.float32)
        for k in range(2, 12):
            session.push_samples(frame)
            clock.now = t0 + k * FRAME_S
            scheduler.tick_once()
            clock.advance(egress_ms / 1e3)  # the way out: the event loop runs the session's sender now
            for _ in range(5):
                await asyncio.sleep(0)
            if transport.audio:
                break
        assert transport.audio, "no first audio in 10 ticks"
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
    (count, total), *terms = [
        _histogram(metrics, name) for name in ("duplex_first_audio_latency_seconds", *BUDGET)
    ]
    assert count == 1 and all(n == 1 for n, _ in terms)
    ingress, wait, ticks, compute, egress = (value for _, value in terms)
    assert ingress == 0.0  # one process: the front end's first frame is the engine's
    assert wait == pytest.approx(wait_ms / 1e3, abs=1e-9)
    assert ticks == sim_delay_ticks()
    assert compute == pytest.approx(STEP_MS / 1e3, abs=1e-9)
    assert egress == pytest.approx(egress_ms / 1e3, abs=1e-9)
    assert total == pytest.approx(ingress + wait + ticks * FRAME_S + compute + egress, abs=1e-9)


# --- a real node of each kind, on real clocks: structure only ---------------------------------------------


@contextlib.asynccontextmanager
async def _node(workers: int) -> AsyncIterator[tuple[int, RuntimeMetrics]]:
    config = RuntimeConfig(
        host="127.0.0.1", port=0, model="sim", sim_step_ms="5", max_sessions=2, auth_mode="off",
        metrics_cache_s=0,
    )  # fmt: skip
    metrics = RuntimeMetrics()
    server: InProcessNode | DuplexServer
    if workers:
        server = InProcessNode(config, copy.deepcopy(_fake_bundle()), workers=workers, metrics=metrics)  # type: ignore[arg-type]
    else:
        from runtime.tools.local_redis import free_loopback_port

        config = config.model_copy(update={"port": free_loopback_port()})
        server = DuplexServer(config, LocalSlots(config, _fake_bundle(), metrics), metrics=metrics)  # type: ignore[arg-type]
    await server.start()
    try:
        yield server.port, metrics
    finally:
        await server.close()


@pytest.mark.parametrize("workers", [0, 2], ids=["workers0", "workers2"])
async def test_every_term_is_observed_once_per_session_in_either_process_layout(workers: int) -> None:
    """``--workers 0`` (the engine's timing reaches the session in-process) and ``--workers 2`` (it crosses
    ZeroMQ as one ``FirstAudio`` message ahead of the audio): each of 2 sessions observes every term once,
    and the tick count is the sim engine's delay. No figure of time is asserted (real clocks)."""
    async with _node(workers) as (port, metrics):
        pcm = np.full(FRAME_SAMPLES * 6, 0.05, dtype=np.float32)
        url = session_url(f"ws://127.0.0.1:{port}")
        results = await asyncio.gather(*(run_session(url, pcm, tail_s=0.3) for _ in range(2)))
        assert all(r.handshake and r.audio_messages > 0 for r in results), results
        for _ in range(50):  # the last observation may trail the client's close by a loop turn
            if _histogram(metrics, "duplex_first_audio_egress_seconds")[0] >= 2:
                break
            await asyncio.sleep(0.02)
        assert _histogram(metrics, "duplex_first_audio_latency_seconds")[0] == 2
        for name in BUDGET:
            count, total = _histogram(metrics, name)
            assert count == 2, name
            assert total >= 0.0, name  # one host's monotonic clock: no term runs backwards
        assert _histogram(metrics, "duplex_first_audio_ticks")[1] == 2 * sim_delay_ticks()


# --- the load generator's report: the node's histograms before and after a run ----------------------------


def test_the_load_report_reads_the_runs_budget_from_the_nodes_metrics() -> None:
    """``duplex loadgen --metrics-url``: what the node observed between two reads of its ``/metrics``,
    whatever it had observed before; means exact, quantiles Prometheus's bucket estimate (linear within the
    bucket), the tick count's p99 within half a tick of the count."""
    metrics = RuntimeMetrics()
    metrics.observe_first_audio(
        5.0, ingress_s=1.0, phase_wait_s=1.0, ticks=9, tick_compute_s=1.0, egress_s=1.0
    )
    before = parse_histograms(metrics.render().decode(), [name for _, name in FIRST_AUDIO_TERMS])
    for wait_ms in (10.0, 20.0, 30.0, 70.0):  # this run: 4 sessions, 1 tick each
        metrics.observe_first_audio(
            (1.0 + wait_ms + 80.0 + 25.0 + 3.0) / 1e3,
            ingress_s=1e-3, phase_wait_s=wait_ms / 1e3, ticks=1, tick_compute_s=0.025, egress_s=3e-3,
        )  # fmt: skip
    after = parse_histograms(metrics.render().decode(), [name for _, name in FIRST_AUDIO_TERMS])
    budget = first_audio_budget(before, after, [150.0, 160.0, 170.0, 180.0])
    assert budget["sessions"] == 4
    assert budget["phase_wait_ms_mean"] == pytest.approx(32.5)
    assert budget["ticks_mean"] == 1.0 and round(budget["ticks_p99"] or 0) == 1
    assert budget["tick_compute_ms_mean"] == pytest.approx(25.0)
    assert budget["egress_ms_mean"] == pytest.approx(3.0) and budget["ingress_ms_mean"] == pytest.approx(1.0)
    terms = ("ingress_ms_mean", "phase_wait_ms_mean", "tick_compute_ms_mean", "egress_ms_mean")
    assert budget["total_ms_mean"] == pytest.approx(sum(budget[t] or 0 for t in terms) + 80.0)
    assert budget["pacing_ms_mean"] == pytest.approx(0.0, abs=1e-6)
    assert budget["outside_runtime_ms_mean"] == pytest.approx(165.0 - (budget["total_ms_mean"] or 0))
    # Phase-wait buckets (ms): ..., 5, 10, 20, 30, 40, 50, 60, 70, 80, ...: ranks 2 (p50) and 3.96 (p99).
    assert budget["phase_wait_ms_p50"] == pytest.approx(20.0)
    assert budget["phase_wait_ms_p99"] == pytest.approx(60.0 + 10.0 * 0.96)
    line = budget_line(budget)
    assert "phase wait 32.5" in line and "ticks 1.00 x 80" in line and "4 sessions" in line


def test_a_histogram_quantile_is_prometheus_s() -> None:
    """Linear within the bucket from the bound below (0 for the first), the highest finite bound in +Inf."""
    histogram = Histogram(((0.5, 0.0), (1.5, 10.0), (2.5, 10.0), (math.inf, 12.0)), 12.0, 14.0)
    assert histogram.quantile(0.5) == pytest.approx(0.5 + 1.0 * 6 / 10)
    assert histogram.quantile(0.99) == 2.5
    assert Histogram((), 0.0, 0.0).quantile(0.5) is None
