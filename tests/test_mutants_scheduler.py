"""Tests that kill mutants of runtime/engine/scheduler.py (the slot scheduler) that its selected tests
(test_scheduler.py, test_waiting_room.py, test_metrics_ticks.py) let survive (``make mutation
MODULE=runtime/engine/scheduler.py``; docs/mutation.md). Each docstring names the mutants it kills.

A recording engine stands in for the batch engine (its tick's outputs are set by the test), the clock is
injected and the tests call ``tick_once`` themselves: every figure is exact, none depends on time. The
event loop's callbacks are run by ``drain``."""

from __future__ import annotations

import asyncio
import itertools
import threading

import numpy as np
import pytest

from runtime.engine.api import FirstAudioTiming
from runtime.engine.batch import TickBuffers, TickTimings
from runtime.engine.model_presets import FRAME_SAMPLES
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import NodeFull, SlotScheduler, SlotSession
from runtime.metrics import RuntimeMetrics


class Tokenizer:
    def vocab_size(self) -> int:
        return 100

    def id_to_piece(self, token: int) -> str:
        return f"\u2581w{token}"


class Engine:
    """Records joins, leaves and ticks; each tick returns what the test put in ``audio``, ``text``,
    ``finished``, ``total_ms`` and ``memory``."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.calls: list[tuple] = []
        self.buffers = TickBuffers(slots, 1)
        self.audio: dict[int, float] = {}
        self.text: dict[int, int] = {}
        self.finished: list[int] = []
        self.total_ms = 10.0
        self.memory: int | None = None
        self.inputs: list[tuple[np.ndarray, np.ndarray]] = []

    def join(self, slot, sampling, prompt):
        self.calls.append(("join", slot, sampling, tuple(prompt)))

    def leave(self, slot):
        self.calls.append(("leave", slot))

    def tick(self, pcm_in, active):
        self.inputs.append((pcm_in.copy(), active.copy()))
        self.buffers.clear()
        for slot, level in self.audio.items():
            self.buffers.pcm[slot] = level
            self.buffers.audio_ready[slot] = True
        for slot, token in self.text.items():
            self.buffers.text_tokens[slot] = token
        return self.buffers.result(list(self.finished), TickTimings(total_ms=self.total_ms))

    def memory_allocated_bytes(self):
        return self.memory


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def drain(loop: asyncio.AbstractEventLoop) -> None:
    loop.run_until_complete(asyncio.sleep(0))
    loop.run_until_complete(asyncio.sleep(0))


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def value(metrics: RuntimeMetrics, name: str, **labels: str) -> float:
    got = metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if got is None else got


class Session:
    """A SlotSession with its outputs recorded."""

    def __init__(self, sid: str, prompt=(), first_audio: bool = True, **kw) -> None:
        self.out: list[tuple] = []
        self.done = 0
        self.timings: list[FirstAudioTiming] = []
        self.s = SlotSession(
            sid,
            SamplingParams(seed=len(sid)),
            list(prompt),
            lambda pcm, piece: self.out.append((None if pcm is None else float(pcm[0]), piece)),
            self._done,
            on_first_audio=self.timings.append if first_audio else None,
            **kw,
        )

    def _done(self) -> None:
        self.done += 1


def frame(level: float) -> np.ndarray:
    return np.full(FRAME_SAMPLES, level, dtype=np.float32)


def make(loop, slots: int = 3, **kw):
    engine = Engine(slots)
    metrics = RuntimeMetrics()
    clock = Clock()
    scheduler = SlotScheduler(engine, Tokenizer(), metrics, loop, clock=clock, **kw)  # type: ignore[arg-type]
    return scheduler, engine, metrics, clock


def test_push_frame_keeps_at_most_max_inbox_frames_and_stamps_the_first(loop):
    """Kills ``SlotSession.push_frame``: ``len(inbox) > max_inbox_frames`` (-> ``>=``), the oldest dropped
    (``popleft`` -> ``pop``), the return values, the default of 8 frames, and ``first_input_at`` set
    once, on the clock, after the append; ``last_input_at`` (a resume's gap starts there) at every frame."""
    times = itertools.count(5.0)
    s = Session("a", clock=lambda: next(times)).s
    assert s.max_inbox_frames == 8 and not s.started_input
    assert [s.push_frame(frame(k)) for k in range(8)] == [True] * 8
    assert s.first_input_at == 5.0 and s.started_input and s.last_input_at == 12.0
    assert s.push_frame(frame(8)) is False
    assert len(s.inbox) == 8 and float(s.inbox[0][0]) == 1.0 and float(s.inbox[-1][0]) == 8.0
    assert s.first_input_at == 5.0 and s.last_input_at == 13.0


def test_admit_hands_out_the_lowest_free_slot_and_refuses_a_full_node(loop):
    """Kills ``admit``: ``pop(0)`` -> ``pop()``, ``if not self._free`` negated, the ``NodeFull`` text, the
    session's clock set to the scheduler's, ``active_sessions`` (``slots - free``), and ``free_slots``;
    ``slots_total`` set at construction."""
    scheduler, engine, metrics, clock = make(loop, 2)
    assert value(metrics, "duplex_slots_total") == 2 and scheduler.free_slots == 2
    a, b, c = Session("a"), Session("bb"), Session("ccc")
    assert scheduler.admit(a.s) == 0 and a.s.clock is clock
    assert value(metrics, "duplex_active_sessions") == 1 and scheduler.free_slots == 1
    assert scheduler.admit(b.s) == 1 and value(metrics, "duplex_active_sessions") == 2
    with pytest.raises(NodeFull) as info:
        scheduler.admit(c.s)
    assert str(info.value) == "all 2 slots are in use" and c.s.slot == -1


def test_joins_and_leaves_apply_at_the_next_tick_and_free_the_lowest_slot_first(loop):
    """Kills ``_apply_commands``: the join (``_sessions[slot] = session``, ``engine.join`` with the
    session's sampling and prompt, ``on_prompt_done`` at once without a prompt, not with one), the leave
    (only the slot's own session: ``is`` -> ``is not``; ``engine.leave``, ``slot = -1``, the slot back in
    the sorted free list, ``active_sessions``, ``on_slot_freed``), and ``release``'s ``slot >= 0`` guard."""
    scheduler, engine, metrics, clock = make(loop, 3)
    freed: list[int] = []
    scheduler.on_slot_freed = lambda: freed.append(1)
    a, b = Session("a"), Session("bb", prompt=["step"])
    scheduler.admit(a.s)
    scheduler.admit(b.s)
    assert engine.calls == []  # applied by the tick thread, not by admit
    assert scheduler.tick_once() is True
    assert engine.calls == [("join", 0, a.s.sampling, ()), ("join", 1, b.s.sampling, ("step",))]
    drain(loop)
    assert (a.done, b.done) == (1, 0)
    scheduler.release(a.s)
    scheduler.release(a.s)  # twice before the tick: one leave
    scheduler.tick_once()
    assert engine.calls[2:] == [("leave", 0)] and a.s.slot == -1 and freed == [1]
    assert scheduler.free_slots == 2 and value(metrics, "duplex_active_sessions") == 1
    scheduler.release(a.s)  # after it left: nothing
    c = Session("ccc")
    assert scheduler.admit(c.s) == 0  # the freed slot, lowest first
    scheduler.release(b.s)
    scheduler.tick_once()
    assert scheduler._free == [1, 2]


def test_a_stale_leave_does_not_free_the_next_holder(loop):
    """Kills ``elif self._sessions[slot] is session`` -> ``is not`` / ``or``: a leave queued for a session
    whose slot another session now holds frees nothing."""
    scheduler, engine, metrics, clock = make(loop, 1)
    a, b = Session("a"), Session("bb")
    scheduler.admit(a.s)
    scheduler.tick_once()
    scheduler._commands.put(("leave", b.s))  # b never held the slot; its slot field says 0
    b.s.slot = 0
    scheduler.tick_once()
    assert ("leave", 0) not in engine.calls and scheduler._sessions[0] is a.s and scheduler.free_slots == 0


def test_tick_once_with_no_session_runs_nothing(loop):
    """Kills ``if not busy: return False`` negated: no tick, no count."""
    scheduler, engine, metrics, clock = make(loop, 2)
    assert scheduler.tick_once() is False
    assert engine.inputs == [] and scheduler.ticks == 0 and value(metrics, "duplex_ticks_total") == 0


def test_each_started_session_feeds_its_own_row(loop):
    """Kills ``tick_once``'s input: ``pcm_in[session.slot] = inbox.popleft()`` (another row, ``pop``), the
    rows cleared each tick (``pcm_in[:] = 0``, ``active[:] = False``), ``active`` only for sessions that
    started input (``if not session.started_input: continue`` negated), and a late frame counted as
    ``late_input``."""
    scheduler, engine, metrics, clock = make(loop, 3)
    a, b, c = Session("a"), Session("bb"), Session("ccc")
    for s in (a, b, c):
        scheduler.admit(s.s)
    a.s.push_frame(frame(1.0))
    a.s.push_frame(frame(2.0))
    b.s.push_frame(frame(3.0))
    scheduler.tick_once()
    pcm, active = engine.inputs[-1]
    assert active.tolist() == [True, True, False]
    assert pcm[:, 0].tolist() == [1.0, 3.0, 0.0]
    scheduler.tick_once()  # b started but has no frame: silence, counted late; a's second frame
    pcm, active = engine.inputs[-1]
    assert active.tolist() == [True, True, False] and pcm[:, 0].tolist() == [2.0, 0.0, 0.0]
    assert value(metrics, "duplex_frames_dropped_total", reason="late_input") == 1
    assert scheduler.ticks == 2 and value(metrics, "duplex_ticks_total") == 2


def test_outputs_reach_their_own_session_with_text_pieces(loop):
    """Kills ``tick_once``'s output: each session's own row (``result.pcm[slot]``), audio only where
    ``audio_ready``, ``on_output`` only when there is audio or text (``or`` -> ``and``), and
    ``_text_piece``: negative, padding (0 and 3) and out-of-vocabulary tokens dropped (``<`` -> ``<=``,
    ``>=`` -> ``>``), "\u2581" turned into a space."""
    scheduler, engine, metrics, clock = make(loop, 3)
    a, b, c = Session("a"), Session("bb"), Session("ccc")
    for s in (a, b, c):
        scheduler.admit(s.s)
    engine.audio = {1: 0.25}
    engine.text = {0: 7, 1: 3, 2: 100}
    scheduler.tick_once()
    drain(loop)
    assert a.out == [(None, " w7")] and b.out == [(0.25, None)] and c.out == []
    engine.audio = {}
    engine.text = {0: 0, 1: 99, 2: -2}
    scheduler.tick_once()
    drain(loop)
    assert a.out == [(None, " w7")] and b.out == [(0.25, None), (None, " w99")] and c.out == []
    engine.text = {0: 1}
    scheduler.tick_once()
    drain(loop)
    assert a.out[-1] == (None, " w1")


def test_prompt_finished_calls_its_session_once(loop):
    """Kills ``for slot in result.prompt_finished``: the finished slot's own session (``_sessions[slot]``),
    ``if finished is not None`` negated."""
    scheduler, engine, metrics, clock = make(loop, 3)
    a, b = Session("a", prompt=["p"]), Session("bb", prompt=["p"])
    scheduler.admit(a.s)
    scheduler.admit(b.s)
    engine.finished = [1, 2]  # slot 2 is empty
    scheduler.tick_once()
    drain(loop)
    assert (a.done, b.done) == (0, 1)


def test_tick_metrics_over_budget_and_memory(loop):
    """Kills the tick's metrics: ``tick_s = total_ms / 1e3``, ``tick_s > frame_s`` (-> ``>=``), the
    ``frame_ms / 1e3`` period, the duration observed, and the GPU memory gauge (``memory is not None``)."""
    scheduler, engine, metrics, clock = make(loop, 1)
    assert scheduler.frame_s == pytest.approx(0.08)
    a = Session("a")
    scheduler.admit(a.s)
    engine.total_ms = 80.0  # exactly the budget: not over
    scheduler.tick_once()
    assert value(metrics, "duplex_ticks_over_budget_total") == 0
    assert value(metrics, "duplex_gpu_memory_allocated_bytes") == 0
    engine.total_ms = 80.5
    engine.memory = 1234
    scheduler.tick_once()
    assert value(metrics, "duplex_ticks_over_budget_total") == 1
    assert value(metrics, "duplex_tick_duration_seconds_sum") == pytest.approx(0.1605)
    assert value(metrics, "duplex_tick_duration_seconds_count") == 2
    assert value(metrics, "duplex_gpu_memory_allocated_bytes") == 1234
    custom, *_ = make(loop, 1, frame_ms=40.0)
    assert custom.frame_s == pytest.approx(0.04)


def test_first_audio_timing_is_stamped_on_the_scheduler_clock(loop):
    """Kills the first-audio stamps: ``taken_at``/``taken_tick`` set once (``taken_tick < 0``), at the
    tick's start (after the frames were taken), ``ticks = tick - taken_tick``, the audio tick's start and
    end, ``first_audio_done`` (one timing per session), and ``_first_audio``'s guards (no callback, no
    input, not taken)."""
    scheduler, engine, metrics, clock = make(loop, 2)
    a, b = Session("a"), Session("bb", first_audio=False)
    scheduler.admit(a.s)
    scheduler.admit(b.s)
    clock.now = 200.0
    a.s.push_frame(frame(1.0))
    b.s.push_frame(frame(1.0))
    clock.now = 201.0
    scheduler.tick_once()  # tick 0 takes a's first frame
    assert (a.s.taken_at, a.s.taken_tick, a.s.first_input_at) == (201.0, 0, 200.0)
    clock.now = 202.0
    a.s.push_frame(frame(1.0))
    scheduler.tick_once()  # tick 1: no audio yet
    assert (a.s.taken_at, a.s.taken_tick) == (201.0, 0)
    engine.audio = {0: 0.5, 1: 0.5}
    clock.now = 203.0
    scheduler.tick_once()  # tick 2: first audio
    scheduler.tick_once()  # tick 3: audio again, no second timing
    drain(loop)
    assert a.timings == [
        FirstAudioTiming(arrived_at=200.0, taken_at=201.0, ticks=2, audio_tick_at=203.0, audio_tick_end=203.0)
    ]
    assert a.s.first_audio_done and b.s.first_audio_done and b.timings == []
    # audio before any input: no timing (not taken), and the flag is spent
    c = Session("ccc")
    scheduler.release(b.s)
    scheduler.tick_once()
    scheduler.admit(c.s)
    engine.audio = {1: 0.5}
    scheduler.tick_once()
    drain(loop)
    assert c.timings == [] and c.s.first_audio_done


def test_the_thread_runs_ticks_and_stops(loop):
    """Kills ``start``/``stop``/``alive`` and ``_run``'s loop (``while not self._stop.is_set()``, the idle
    wait on ``_wake``): a started scheduler ticks an admitted session's frames on its own thread and stops
    when told. Hang guards only (generous timeouts), no speed asserted."""
    engine = Engine(1)
    scheduler = SlotScheduler(engine, Tokenizer(), RuntimeMetrics(), loop, frame_ms=1.0)  # type: ignore[arg-type]
    ticked = threading.Event()
    original = engine.tick

    def tick(pcm_in, active):
        ticked.set()
        return original(pcm_in, active)

    engine.tick = tick  # type: ignore[method-assign]
    assert not scheduler.alive
    scheduler.start()
    try:
        assert scheduler.alive
        scheduler.admit(Session("a").s)
        assert ticked.wait(60)
    finally:
        scheduler.stop(timeout_s=60)
    assert not scheduler.alive


class Stop:
    """Stands in for the tick loop's stop event: set after ``loops`` checks; ``wait`` records the delay
    and moves the clock by it (a sleep on the injected clock)."""

    def __init__(self, clock: Clock, loops: int) -> None:
        self.clock, self.loops, self.waits = clock, loops, []

    def is_set(self) -> bool:
        self.loops -= 1
        return self.loops < 0

    def set(self) -> None:
        self.loops = 0

    def wait(self, delay: float) -> bool:
        self.waits.append(round(delay, 6))
        self.clock.now += delay
        return False


class Wake:
    def __init__(self) -> None:
        self.waits: list[float | None] = []
        self.cleared = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return False

    def clear(self) -> None:
        self.cleared += 1

    def set(self) -> None:
        pass


def test_the_tick_loop_paces_on_the_clock(loop):
    """Kills ``_run``'s pacing, run on the test's thread with an injected clock: ``next_tick`` from the
    clock (not None), ``+= frame_s`` (``=``, ``-=``), ``delay = next_tick - clock()`` (``+``), the wait only
    when ``delay > 0`` (``>= 0``: a tick of exactly 80 ms waits 0 s; ``> 1``), a tick loop more than a frame
    behind re-anchored, the idle branch (``tick_once()`` negated, ``wait(timeout=0.5)``, ``continue`` ->
    ``break``, ``next_tick`` re-read). Ticks take 30, 30, 80, 100 and 250 ms by the clock."""
    scheduler, engine, metrics, clock = make(loop, 1)
    durations = iter([0.03, 0.03, 0.08, 0.10, 0.25, 0.03])
    original = engine.tick

    def tick(pcm_in, active):
        clock.now += next(durations)
        return original(pcm_in, active)

    engine.tick = tick  # type: ignore[method-assign]
    scheduler._stop = stop = Stop(clock, 7)  # type: ignore[assignment]
    scheduler._wake = wake = Wake()  # type: ignore[assignment]
    scheduler._run()  # idle: nothing admitted yet
    assert wake.waits == [0.5] * 7 and wake.cleared == 7 and stop.waits == []
    scheduler.admit(Session("a").s)
    clock.now = 100.0
    stop.loops = 6
    scheduler._run()
    # 30 ms: wait 50; 30 ms: wait 50; 80 ms: on time, no wait; 100 ms: 20 late, no wait;
    # 250 ms: 190 late, more than a frame: re-anchored at the clock, so the last 30 ms tick waits 50.
    assert stop.waits == [0.05, 0.05, 0.05]
    assert clock.now == pytest.approx(100.0 + 0.03 + 0.05 + 0.03 + 0.05 + 0.08 + 0.10 + 0.25 + 0.03 + 0.05)


def test_stop_joins_the_thread_for_its_timeout(loop):
    """Kills ``stop``'s default ``timeout_s`` 5.0 (-> 6.0) and ``join(timeout_s)`` -> ``join(None)``."""
    scheduler, *_ = make(loop, 1)
    joined: list[float | None] = []

    class Thread:
        def join(self, timeout: float | None = None) -> None:
            joined.append(timeout)

    scheduler._thread = Thread()  # type: ignore[assignment]
    scheduler.stop()
    scheduler.stop(timeout_s=1.5)
    assert joined == [5.0, 1.5]


def test_first_audio_ticks_count_from_the_taking_tick(loop):
    """Kills ``ticks=tick - session.taken_tick`` -> ``+`` (a session taken at tick 1, first audio at tick
    3: 2 ticks) and ``on_first_audio is None or ...`` -> ``and`` (a session without the callback gets no
    call: the loop reports no failed callback)."""
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    scheduler, engine, metrics, clock = make(loop, 2)
    a, b = Session("a"), Session("bb", first_audio=False)
    scheduler.admit(a.s)
    scheduler.admit(b.s)
    b.s.push_frame(frame(1.0))
    scheduler.tick_once()  # tick 0: b only
    a.s.push_frame(frame(1.0))
    scheduler.tick_once()  # tick 1 takes a's first frame
    scheduler.tick_once()  # tick 2
    engine.audio = {0: 0.5, 1: 0.5}
    scheduler.tick_once()  # tick 3: first audio of both
    drain(loop)
    assert [t.ticks for t in a.timings] == [2] and a.s.taken_tick == 1
    assert errors == []


def test_a_session_that_has_not_started_does_not_stop_the_others(loop):
    """Kills ``if not session.started_input: continue`` -> ``break``: the first slot's session has sent
    nothing yet; the second's frame is still taken."""
    scheduler, engine, metrics, clock = make(loop, 2)
    a, b = Session("a"), Session("bb")
    scheduler.admit(a.s)
    scheduler.admit(b.s)
    b.s.push_frame(frame(2.0))
    scheduler.tick_once()
    pcm, active = engine.inputs[-1]
    assert active.tolist() == [False, True] and pcm[:, 0].tolist() == [0.0, 2.0]


def test_a_failing_tick_is_logged_and_raised(loop, caplog):
    """Kills ``tick_once``'s ``log.exception`` text (None, changed): the operator reads why the tick loop
    stopped; the error still propagates."""
    scheduler, engine, metrics, clock = make(loop, 1)

    def broken(pcm_in, active):
        raise RuntimeError("CUDA error: an illegal memory access")

    engine.tick = broken  # type: ignore[method-assign]
    scheduler.admit(Session("a").s)
    with pytest.raises(RuntimeError), caplog.at_level("ERROR"):
        scheduler.tick_once()
    assert [r.getMessage() for r in caplog.records] == [
        "tick failed; the tick loop stops and /healthz turns unhealthy"
    ]


def test_the_tick_thread_and_the_input_rows_are_what_the_engine_expects(loop):
    """Kills ``__init__``'s thread (the name ``tick-loop`` seen in thread dumps, ``daemon=True`` so that a
    stuck model cannot keep the process alive: ``None``, ``False``, left out) and the input rows' dtypes
    (float32 PCM and bool ``active``, as ``BatchEngine.tick`` takes them: ``dtype=None``, left out)."""
    scheduler, engine, metrics, clock = make(loop, 2)
    assert scheduler._thread.name == "tick-loop" and scheduler._thread.daemon is True
    a = Session("a")
    scheduler.admit(a.s)
    a.s.push_frame(frame(1.0))
    scheduler.tick_once()
    pcm, active = engine.inputs[-1]
    assert pcm.dtype == np.float32 and pcm.shape == (2, FRAME_SAMPLES)
    assert active.dtype == bool and active.tolist() == [True, False]
