"""``duplex_ticks_over_budget_total`` and ``duplex_tick_duration_seconds`` (runtime/metrics.py), counted by
the scheduler's tick loop (runtime/engine/scheduler.py) from each tick's ``timings.total_ms`` (issue 25).
The over-budget counter drives the node's "ticks over budget" alert (infra/node/monitoring/prometheus.py).

The ticks are the sim engine's (runtime/engine/sim.py) with its step-time knob scripted tick by tick and
its clock injected: the sim's ``time.perf_counter`` is a fake clock that only the injected ``sleep``
advances, by exactly the step time asked for, so each tick's measured duration is its scripted step time
and nothing depends on how fast this machine runs."""

from __future__ import annotations

import asyncio
import threading
import types
from collections.abc import Callable

import numpy as np
import pytest

import runtime.engine.sim as sim
from runtime.engine.model_presets import FRAME_MS, FRAME_SAMPLES
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import SlotScheduler, SlotSession
from runtime.engine.sim import SimEngine
from runtime.metrics import RuntimeMetrics

STEP_MS = [30.0, 79.9, 80.1, 120.0, 45.0, 240.0, 80.5, 10.0, 64.0, 1500.0]
"""Scripted step times of successive ticks (ms). Over the 80 ms frame: 80.1, 120, 240, 80.5, 1500 (5);
at or under it: 30, 79.9, 45, 10, 64 (5). Sum 2249.5 ms."""


class _Tokenizer:
    """The two calls the scheduler makes of a sentencepiece tokenizer."""

    def vocab_size(self) -> int:
        return 256

    def id_to_piece(self, token: int) -> str:
        return f"<{token}>"


class _FakeClock:
    """Seconds that pass only when ``sleep`` is called."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _ScriptedStepTime:
    """The sim's step-time knob (``StepTime.ms(batch)``), one scripted figure per tick. Asked once more
    than scripted (the tick after the last), it reads the metrics first: every scripted tick has been
    counted by then (the tick thread counts a tick before it starts the next) and none other has."""

    def __init__(self, steps_ms: list[float], read: Callable[[], dict[str, float]]) -> None:
        self.steps = list(steps_ms)
        self.read = read
        self.seen: dict[str, float] | None = None
        self.done = threading.Event()

    def ms(self, batch: int) -> float:
        if self.steps:
            return self.steps.pop(0)
        if self.seen is None:
            self.seen = self.read()
            self.done.set()
        return 0.0


def _sample(metrics: RuntimeMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    assert value is not None, name
    return value


async def test_ticks_over_the_80_ms_budget_are_counted_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten ticks of one live session with scripted step times (``STEP_MS``): the over-budget counter ends
    at 5 (the ticks over 80 ms: 80.1, 120, 240, 80.5, 1500), ``duplex_ticks_total`` and the histogram's
    count at 10, the histogram's sum at 2.2495 s, and its 80 ms bucket holds the 5 ticks at or under the
    frame (30, 79.9, 45, 10, 64 ms).

    Planted bug: the scheduler never incrementing ``ticks_over_budget`` (the ``.inc()`` after the budget
    comparison removed) — fails on it (0 != 5)."""
    clock = _FakeClock()
    monkeypatch.setattr(sim, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    metrics = RuntimeMetrics()

    def read() -> dict[str, float]:
        return {
            "over": _sample(metrics, "duplex_ticks_over_budget_total"),
            "ticks": _sample(metrics, "duplex_ticks_total"),
            "count": _sample(metrics, "duplex_tick_duration_seconds_count"),
            "sum": _sample(metrics, "duplex_tick_duration_seconds_sum"),
            "le_80ms": _sample(metrics, "duplex_tick_duration_seconds_bucket", le="0.08"),
            "le_1s": _sample(metrics, "duplex_tick_duration_seconds_bucket", le="1.0"),
        }

    step = _ScriptedStepTime(STEP_MS, read)
    engine = SimEngine(1, step, text_vocab=256, sleep=clock.sleep)  # type: ignore[arg-type]
    assert FRAME_MS == 80.0
    scheduler = SlotScheduler(engine, _Tokenizer(), metrics, asyncio.get_running_loop())  # type: ignore[arg-type]
    session = SlotSession("s1", SamplingParams(), [], lambda pcm, piece: None, lambda: None)
    session.push_frame(np.zeros(FRAME_SAMPLES, dtype=np.float32))  # input started: the slot steps every tick
    assert _sample(metrics, "duplex_ticks_over_budget_total") == 0.0
    scheduler.start()
    try:
        scheduler.admit(session)
        assert await asyncio.to_thread(step.done.wait, 60), "the tick loop did not run the scripted ticks"
    finally:
        scheduler.stop()
    assert step.seen is not None
    assert step.seen["over"] == 5
    assert step.seen["ticks"] == 10
    assert step.seen["count"] == 10
    assert step.seen["sum"] == pytest.approx(2.2495, abs=1e-9)
    assert step.seen["le_80ms"] == 5
    assert step.seen["le_1s"] == 9  # all but the 1500 ms tick
