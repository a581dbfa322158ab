"""Staggered sub-batches (issue 24, item 3; ``SlotScheduler(stagger_groups=2)``, ``DUPLEX_STAGGER_GROUPS``).

Two groups of sessions stepped 40 ms apart: a session joins the group of the first sub-tick that finds its
first frame, so its phase wait is under 40 ms wherever its frame falls in the 80 ms cycle, and from then on
its frames are taken by its own group's sub-ticks only, one per 80 ms. Every test runs on an injected clock
and calls ``SlotScheduler.tick_once`` itself: nothing depends on the machine's speed. The last tests run the
real tiny engine under the staggered scheduler: a session's token stream is the one it gets alone on the
plain 80 ms tick (the other group's rows are frozen by the engine's exec mask, never stepped twice).
"""

from __future__ import annotations

import asyncio
import copy
import math

import numpy as np
import pytest
from fake_clock import FakeClock
from test_latency_budget import _fake_bundle, _histogram, _Tokenizer

from runtime.config import RuntimeConfig
from runtime.engine.api import FirstAudioTiming
from runtime.engine.batch import UNGENERATED_TOKEN, BatchEngine, TickBuffers, TickResult, TickTimings
from runtime.engine.engine_core import LocalSlots
from runtime.engine.model_presets import FRAME_SAMPLES, get_preset
from runtime.engine.models import ModelBundle, build_tiny
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import SlotScheduler, SlotSession
from runtime.engine.sim import SimEngine, make_engine
from runtime.frontend.server import DuplexServer
from runtime.metrics import RuntimeMetrics
from runtime.tools.loadgen import run_session, session_url
from runtime.tools.local_redis import free_loopback_port

FRAME_S = 0.08
HALF_S = 0.04


class _RecordingEngine:
    """An engine that records which slots each tick stepped and which input frame it took for them; audio
    for a slot ``delay`` of its own steps after its first, each tick costing ``compute_s`` on the clock."""

    def __init__(self, slots: int, clock: FakeClock, *, delay: int = 1, compute_s: float = 0.012) -> None:
        self.slots = slots
        self.clock = clock
        self.delay = delay
        self.compute_s = compute_s
        self.stepped: list[list[int]] = []
        self.taken: dict[int, list[float]] = {s: [] for s in range(slots)}
        self._steps = [0] * slots
        self._out = TickBuffers(slots, 8)

    def join(self, slot: int, sampling: SamplingParams, prompt: object = None) -> None:
        self._steps[slot] = 0

    def leave(self, slot: int) -> None:
        self._steps[slot] = 0

    def tick(self, pcm_in: np.ndarray, active: np.ndarray) -> TickResult:
        self._out.clear()
        self.clock.now += self.compute_s
        rows = [int(s) for s in np.flatnonzero(active)]
        self.stepped.append(rows)
        for slot in rows:
            self.taken[slot].append(float(pcm_in[slot, 0]))
            self._steps[slot] += 1
            if self._steps[slot] > self.delay:
                self._out.audio_ready[slot] = True
        return self._out.result([], TickTimings(total_ms=self.compute_s * 1e3))

    def memory_allocated_bytes(self) -> None:
        return None


class _Caller:
    """A scheduler session that records its first-audio timing and how many audio frames it got."""

    def __init__(self, name: str) -> None:
        self.timing: FirstAudioTiming | None = None
        self.audio_frames = 0
        self.session = SlotSession(
            name,
            SamplingParams.greedy(),
            [],
            on_output=self._output,
            on_prompt_done=lambda: None,
            max_inbox_frames=64,
            on_first_audio=self._first_audio,
        )

    def _output(self, pcm: np.ndarray | None, piece: str | None) -> None:
        self.audio_frames += pcm is not None

    def _first_audio(self, timing: FirstAudioTiming) -> None:
        assert self.timing is None, "first-audio timing handed over twice"
        self.timing = timing

    def push(self, value: float) -> None:
        self.session.push_frame(np.full(FRAME_SAMPLES, value, dtype=np.float32))


def _scheduler(
    engine: object, clock: FakeClock, groups: int, metrics: RuntimeMetrics | None = None
) -> SlotScheduler:
    loop = asyncio.get_running_loop()
    return SlotScheduler(
        engine,  # type: ignore[arg-type]
        _Tokenizer(),  # type: ignore[arg-type]
        metrics or RuntimeMetrics(),
        loop,
        clock=clock,
        stagger_groups=groups,
    )


async def _tick_at(scheduler: SlotScheduler, clock: FakeClock, at: float) -> None:
    clock.now = at
    scheduler.tick_once()
    for _ in range(3):
        await asyncio.sleep(0)


@pytest.mark.parametrize("arrival_ms", [0.5, 12.0, 39.5, 40.5, 55.0, 79.5])
async def test_a_first_frame_is_taken_by_the_nearest_sub_tick(arrival_ms: float) -> None:
    """Sub-ticks at t0 + 40 k ms. A first frame arriving ``arrival_ms`` after t0 + 80 ms is taken by the next
    sub-tick, whichever group it steps: its phase wait is 40 - (arrival mod 40) ms, under 40 ms for every
    phase of the 80 ms cycle (0-80 ms on the plain tick), and the session joins that sub-tick's group.
    A scheduler that kept groups fixed by slot (slot 0 = group 0) would make the 40.5-79.5 ms arrivals wait
    for the sub-tick after next (up to 79.5 ms)."""
    clock = FakeClock()
    engine = _RecordingEngine(2, clock)
    scheduler = _scheduler(engine, clock, 2)
    caller = _Caller("a")
    t0 = clock.now
    scheduler.admit(caller.session)
    await _tick_at(scheduler, clock, t0)
    await _tick_at(scheduler, clock, t0 + HALF_S)
    await _tick_at(scheduler, clock, t0 + FRAME_S)
    arrival = t0 + FRAME_S + arrival_ms / 1e3
    k = 3
    while t0 + k * HALF_S < arrival:  # sub-ticks before the frame: nothing to take
        await _tick_at(scheduler, clock, t0 + k * HALF_S)
        k += 1
    clock.now = arrival
    for j in range(k, k + 8):
        caller.push(0.1)
        await _tick_at(scheduler, clock, t0 + j * HALF_S)
        if caller.timing is not None:
            break
    timing = caller.timing
    assert timing is not None
    expected_wait_ms = 40.0 - arrival_ms % 40.0
    assert timing.phase_wait_s * 1e3 == pytest.approx(expected_wait_ms, abs=1e-6)
    assert timing.phase_wait_s < HALF_S
    taking_tick = 2 + int(arrival_ms // 40.0) + 1
    assert caller.session.group == taking_tick % 2
    assert caller.session.taken_tick == taking_tick


async def test_each_group_is_stepped_once_per_frame_in_turn() -> None:
    """Two callers whose first frames fall in different halves of the cycle land in different groups; each
    sub-tick steps one group alone, so each caller is stepped every 80 ms (every second sub-tick), its
    frames taken in order, one per step; a caller that pushed nothing by its sub-tick is stepped on
    silence (``late_input``), never on the other group's turn."""
    clock = FakeClock()
    engine = _RecordingEngine(2, clock)
    metrics = RuntimeMetrics()
    scheduler = _scheduler(engine, clock, 2, metrics)
    a, b = _Caller("a"), _Caller("b")
    t0 = clock.now
    scheduler.admit(a.session)
    scheduler.admit(b.session)
    await _tick_at(scheduler, clock, t0)  # joins; nobody has sent yet
    a.push(1.0)
    await _tick_at(scheduler, clock, t0 + HALF_S)  # sub-tick 1: a's group is 1
    b.push(2.0)
    for k in range(2, 10):
        if k % 2 == 1 and k < 8:
            a.push(1.0 + k)
        if k % 2 == 0 and k > 2:
            b.push(2.0 + k)
        await _tick_at(scheduler, clock, t0 + k * HALF_S)
    slot_a, slot_b = a.session.slot, b.session.slot
    assert (a.session.group, b.session.group) == (1, 0)
    assert engine.stepped[0] == []
    for k in range(1, 10):
        assert engine.stepped[k] == ([slot_a] if k % 2 == 1 else [slot_b]), (k, engine.stepped)
    assert engine.taken[slot_a] == [1.0, 4.0, 6.0, 8.0, 0.0]  # sub-ticks 1, 3, 5, 7; 9 late: silence
    assert engine.taken[slot_b] == [2.0, 6.0, 8.0, 10.0]  # sub-ticks 2, 4, 6, 8
    assert metrics.frames_dropped.labels(reason="late_input")._value.get() == 1
    assert (a.audio_frames, b.audio_frames) == (4, 3)  # 5 and 4 steps, audio from the second


async def test_ticks_to_first_audio_count_the_sessions_own_steps() -> None:
    """With an engine whose audio comes one step after a slot's first (LMGen's acoustic delay), the budget
    reads 1 tick and the audio tick starts 80 ms after the taking one, staggered or not: sub-ticks of the
    other group do not count (a count of sub-ticks would say 2)."""
    for groups in (1, 2):
        clock = FakeClock()
        scheduler = _scheduler(_RecordingEngine(1, clock, delay=1), clock, groups)
        caller = _Caller("a")
        t0 = clock.now
        scheduler.admit(caller.session)
        await _tick_at(scheduler, clock, t0)
        period = FRAME_S / groups
        for k in range(1, 12):
            caller.push(0.5)
            await _tick_at(scheduler, clock, t0 + k * period)
        timing = caller.timing
        assert timing is not None, groups
        assert timing.ticks == 1, groups
        assert timing.audio_tick_at - timing.taken_at == pytest.approx(FRAME_S, abs=1e-9), groups


async def test_a_sub_tick_is_over_budget_past_its_own_period() -> None:
    """A 50 ms tick fits the plain 80 ms tick but not a 40 ms sub-tick: ``duplex_ticks_over_budget_total``
    counts against the period the node runs at."""
    counts = {}
    for groups in (1, 2):
        clock = FakeClock()
        metrics = RuntimeMetrics()
        scheduler = _scheduler(_RecordingEngine(1, clock, compute_s=0.05), clock, groups, metrics)
        caller = _Caller("a")
        scheduler.admit(caller.session)
        caller.push(0.1)
        await _tick_at(scheduler, clock, clock.now)
        counts[groups] = metrics.ticks_over_budget._value.get()
    assert counts == {1: 0, 2: 1}


async def test_bad_group_counts_are_refused_by_name() -> None:
    clock = FakeClock()
    for bad in (0, 3, -1):
        with pytest.raises(ValueError, match=r"stagger_groups must be one of 1, 2, got"):
            _scheduler(_RecordingEngine(1, clock), clock, bad)
    assert RuntimeConfig().stagger_groups == 1  # off by default
    assert RuntimeConfig(stagger_groups=2).stagger_groups == 2
    with pytest.raises(ValueError, match="stagger_groups"):
        RuntimeConfig(stagger_groups=3)


def test_the_engine_prompt_budget_follows_the_tick_period() -> None:
    """Persona prompt work must fit the period the engine is ticked at: 60 % of 40 ms staggered."""
    from types import SimpleNamespace

    bundle = SimpleNamespace(
        text_tokenizer=_Tokenizer(),
        lm=SimpleNamespace(num_codebooks=17, dep_q=8, delays=get_preset("sim").lm_kwargs["delays"]),
    )
    plain = make_engine("sim", bundle, 2)  # type: ignore[arg-type]
    staggered = make_engine("sim", bundle, 2, tick_period_ms=40.0)  # type: ignore[arg-type]
    assert isinstance(plain, SimEngine) and isinstance(staggered, SimEngine)
    assert plain.prompt_budget_ms == pytest.approx(48.0)
    assert staggered.prompt_budget_ms == pytest.approx(24.0)
    with pytest.raises(ValueError, match="tick_period_ms must be in"):
        make_engine("sim", bundle, 2, tick_period_ms=0.0)  # type: ignore[arg-type]


# --- the real tiny engine -------------------------------------------------------------------------------


class _TokenTap:
    """A ``BatchEngine`` that records each slot's (text, audio...) tokens at the ticks that stepped it."""

    def __init__(self, engine: BatchEngine) -> None:
        self.engine = engine
        self.slots = engine.slots
        self.tokens: dict[int, list[tuple[int, ...]]] = {s: [] for s in range(engine.slots)}

    def join(self, slot: int, sampling: SamplingParams, prompt: object = None) -> None:
        self.engine.join(slot, sampling, prompt)  # type: ignore[arg-type]

    def leave(self, slot: int) -> None:
        self.engine.leave(slot)

    def tick(self, pcm_in: np.ndarray, active: np.ndarray) -> TickResult:
        result = self.engine.tick(pcm_in, active)
        for slot in np.flatnonzero(active):
            if result.text_tokens[slot] != UNGENERATED_TOKEN:
                self.tokens[int(slot)].append(
                    (int(result.text_tokens[slot]), *map(int, result.audio_tokens[slot]))
                )
        return result

    def memory_allocated_bytes(self) -> None:
        return None


@pytest.fixture(scope="module")
def tiny() -> ModelBundle:
    return build_tiny(seed=0)


FRAMES = 12


def _speech(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((FRAMES, FRAME_SAMPLES)) * 0.1).astype(np.float32)


async def _tiny_run(
    bundle: ModelBundle, groups: int, callers: dict[str, tuple[int, int | None]]
) -> dict[str, list]:
    """Callers by name (admitted in order: slots 0, 1) -> (the sub-tick, 0 or 1, before which their first
    frame arrives; the seed of their speech, None: never sends); each sender pushes one frame of its speech
    every 80 ms from then. Their token streams."""
    clock = FakeClock()
    tap = _TokenTap(BatchEngine(copy.deepcopy(bundle), 2, clock=clock))
    scheduler = _scheduler(tap, clock, groups)
    sessions = {name: _Caller(name) for name in callers}
    for caller in sessions.values():
        scheduler.admit(caller.session)
    audio = {name: _speech(seed) for name, (_, seed) in callers.items() if seed is not None}
    sent = dict.fromkeys(callers, 0)
    t0 = clock.now
    await _tick_at(scheduler, clock, t0)  # joins and pre-roll
    period = FRAME_S / groups
    for k in range(1, 1 + FRAMES * groups + 2):
        for name, (first, _) in callers.items():
            turn = (k - 1) % groups == first
            if name in audio and turn and sent[name] < FRAMES:
                sessions[name].session.push_frame(audio[name][sent[name]])
                sent[name] += 1
        await _tick_at(scheduler, clock, t0 + k * period)
    return {name: tap.tokens[caller.session.slot] for name, caller in sessions.items()}


async def test_tiny_engine_staggered_streams_equal_the_plain_ones(tiny: ModelBundle) -> None:
    """Greedy decoding on the tiny model: two callers in different groups (one first heard before sub-tick 1,
    one before sub-tick 2) each get exactly the token stream they get alone in the same slot on the plain
    80 ms tick (the other slot joined and silent). A scheduler that stepped a row in the other group's
    sub-tick too (twice per frame, or on silence) would change its stream."""
    alone_a = (await _tiny_run(tiny, 1, {"a": (0, 0), "idle": (0, None)}))["a"]
    alone_b = (await _tiny_run(tiny, 1, {"idle": (0, None), "b": (0, 1)}))["b"]
    both = await _tiny_run(tiny, 2, {"a": (0, 0), "b": (1, 1)})
    for stream in (alone_a, alone_b, *both.values()):
        assert len(stream) >= FRAMES  # one step per frame sent (then silence: late input)
    # the steps on the callers' own frames
    assert both["a"][:FRAMES] == alone_a[:FRAMES]
    assert both["b"][:FRAMES] == alone_b[:FRAMES]
    assert both["a"][:FRAMES] != both["b"][:FRAMES]


# --- a real node, on real clocks: the setting reaches the tick loop ---------------------------------------


async def test_a_staggered_node_serves_every_session_one_step_per_frame() -> None:
    """``DUPLEX_STAGGER_GROUPS=2`` through ``RuntimeConfig`` and ``LocalSlots`` (what the engine process of
    ``--workers N`` runs too) to the scheduler (sim model, 5 ms steps): the tick loop runs at the 40 ms
    period, the prompt budget is 60 % of it, 3 sessions get their audio, and each one's first audio came one
    of its own steps after its first (the sim engine's acoustic delay, not 2 sub-ticks). Only counts are
    asserted: the clocks are real."""
    config = RuntimeConfig(
        host="127.0.0.1", port=free_loopback_port(), model="sim", sim_step_ms="5", max_sessions=3,
        auth_mode="off", metrics_cache_s=0, stagger_groups=2,
    )  # fmt: skip
    metrics = RuntimeMetrics()
    slots = LocalSlots(config, _fake_bundle(), metrics)  # type: ignore[arg-type]
    server = DuplexServer(config, slots, metrics=metrics)
    await server.start()
    try:
        assert slots.scheduler is not None and slots.scheduler.groups == 2
        assert math.isclose(slots.scheduler.period_s, 0.04)
        assert slots.engine.prompt_budget_ms == pytest.approx(24.0)
        pcm = np.full(FRAME_SAMPLES * 8, 0.05, dtype=np.float32)
        url = session_url(f"ws://127.0.0.1:{server.port}")
        results = await asyncio.gather(*(run_session(url, pcm, tail_s=0.3) for _ in range(3)))
        assert all(r.handshake and r.audio_messages > 0 for r in results), results
        for _ in range(100):  # the last observation may trail the client's close by a loop turn
            if _histogram(metrics, "duplex_first_audio_ticks")[0] >= 3:
                break
            await asyncio.sleep(0.02)
        assert _histogram(metrics, "duplex_first_audio_ticks") == (3, 3.0)
    finally:
        await server.close()
