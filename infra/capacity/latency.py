"""The first-audio latency budget: from the end of a caller's speech to the first agent audio played, term by
term, as a low-high range and a p99 (ms).

Terms (``latency_budget``): the network both ways and the client's playback buffer (assumptions), one 80 ms
frame accumulated before Mimi can encode it, the wait for the tick that takes it (the phase wait), the tick's
Mimi encode, LM step and Mimi decode (from ``timing.TickPlan``), and the model's acoustic delay (one 80 ms
step for the 7B presets). The runtime measures the terms it owns with the ``duplex_first_audio_*``
histograms (docs/benchmarks.md, "First-audio latency budget"); each row names the one that measures it.

The p99: the phase wait is the one term that varies from caller to caller for a given node: where a caller's
first frame falls in the tick cycle, uniform over one tick period for callers not aligned to the ticks, so its
mean is half the period and its p99 0.99 x the period (79.2 ms on the 80 ms tick; 39.6 ms with two staggered
sub-batch groups, ``timing.STAGGER_GROUPS``). Every other term is taken at the high end of its range (the
tick at the planner's estimate, the network and buffer at their assumed worst), so the p99 is that of the
phase wait with the rest at their worst: exact if those are constant, an upper bound otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from runtime.engine.model_presets import FRAME_MS

from .models import ModelSpec
from .timing import TickPlan

PHASE_WAIT_P99 = 0.99
"""The p99 of a uniform phase wait over one tick period, as a fraction of the period."""


class LatencyRow(BaseModel):
    """One row of the first-audio budget (ms).

    Attributes:
        name: the term.
        low_ms, high_ms: its range.
        p99_ms: its value in the budget's p99 (the high end, but for the phase wait: module docstring).
        runtime_term: the runtime's histogram term that measures it (``phase_wait``, ``ticks``,
            ``tick_compute``), "" where the runtime does not see it.
        note: where the figure comes from.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    low_ms: float
    high_ms: float
    p99_ms: float
    runtime_term: str = ""
    note: str = ""


class LatencyBudget(BaseModel):
    """Time from the end of the user's speech to the first agent audio played, as rows and totals (ms).

    Attributes:
        rows: the terms.
        floor_ms: one frame + the acoustic delay (160 ms for the 7B presets): no design goes below it.
        low_ms, high_ms: the rows' lows and highs summed.
        p99_ms: the caller's p99: every row's ``p99_ms`` summed (module docstring).
        runtime_p99_ms: the p99 of what the runtime's ``duplex_first_audio_latency_seconds`` measures (the
            rows with a ``runtime_term``: phase wait, the acoustic delay's tick, the tick's compute); its
            egress (the event loop, the codec: host CPU work, ms) is not planned.
        phase_wait_mean_ms: the phase wait's mean (half the tick period).
        stagger_groups: the tick's sub-tick groups (1: one tick per 80 ms frame).
    """

    model_config = ConfigDict(frozen=True)

    rows: list[LatencyRow]
    floor_ms: float
    low_ms: float
    high_ms: float
    p99_ms: float
    runtime_p99_ms: float
    phase_wait_mean_ms: float
    stagger_groups: int = 1


@dataclass(frozen=True)
class LatencyAssumptions:
    """Inputs of the latency budget that are not derived from the model or the GPU (ms, ranges).

    Defaults: a client in the same region (5-20 ms one way), a 20-30 ms client playback buffer. The phase
    wait is not an assumption: it is 0 to the tick period (``TickPlan.period_ms``).
    """

    uplink_ms: tuple[float, float] = (5.0, 20.0)
    downlink_ms: tuple[float, float] = (5.0, 20.0)
    client_buffer_ms: tuple[float, float] = (20.0, 30.0)


def _row(
    name: str, low: float, high: float, note: str, term: str = "", p99: float | None = None
) -> LatencyRow:
    return LatencyRow(
        name=name, low_ms=low, high_ms=high, p99_ms=high if p99 is None else p99, runtime_term=term, note=note
    )


def latency_budget(
    model: ModelSpec, tick: TickPlan, assumptions: LatencyAssumptions | None = None
) -> LatencyBudget:
    """First-audio budget (module docstring). Floor = one frame (80 ms: a whole 1920-sample frame must arrive
    before it is encoded) + the acoustic delay (max codebook delay x 80 ms) = 160 ms for the 7B presets (Moshi
    paper and kyutai-labs/moshi README: "160 ms theoretical latency"); the runtime reaches it since its
    encoder pre-roll (a caller's first frame is stepped in the tick that takes it, docs/runtime.md). Encode,
    step and decode come from the tick (low = roofline, high = estimate incl. overhead); the phase wait is 0
    to ``tick.period_ms``."""
    a = assumptions or LatencyAssumptions()
    ph = {p.name: p for p in tick.phases}
    enc, dec = ph["Mimi encode"], ph["Mimi decode"]
    lm_low = ph["LM step: weights"].roofline_ms + ph["LM step: KV cache read"].roofline_ms
    lm_high = ph["LM step: weights"].estimate_ms + ph["LM step: KV cache read"].estimate_ms + tick.overhead_ms
    period = tick.period_ms
    wait_note = (
        "fixed 80 ms clock shared by all slots"
        if tick.stagger_groups == 1
        else f"{tick.stagger_groups} sub-batch groups {period:g} ms apart: the nearest sub-tick takes it"
    )
    batch = f"batch of {tick.sessions}"
    rows = [
        _row("Network, client to server", *a.uplink_ms, "assumption: same region"),
        _row("Frame accumulation", FRAME_MS, FRAME_MS, "1920 samples at 24 kHz before Mimi can encode"),
        _row("Wait for the batch tick", 0.0, period, wait_note, "phase_wait", PHASE_WAIT_P99 * period),
        _row("Mimi encode", enc.roofline_ms, enc.estimate_ms, batch, "tick_compute"),
        _row("LM step (temporal + depformer)", lm_low, lm_high, f"{batch}, incl. KV reads and tick overhead",
             "tick_compute"),
        _row("Acoustic delay", model.acoustic_delay_ms, model.acoustic_delay_ms,
             f"codebooks delayed {model.acoustic_delay_frames} frame(s)", "ticks"),
        _row("Mimi decode", dec.roofline_ms, dec.estimate_ms, batch, "tick_compute"),
        _row("Network, server to client", *a.downlink_ms, "assumption: same region"),
        _row("Client playback buffer", *a.client_buffer_ms, "assumption: browser AudioContext"),
    ]  # fmt: skip
    return LatencyBudget(
        rows=rows,
        floor_ms=FRAME_MS + model.acoustic_delay_ms,
        low_ms=sum(r.low_ms for r in rows),
        high_ms=sum(r.high_ms for r in rows),
        p99_ms=sum(r.p99_ms for r in rows),
        runtime_p99_ms=sum(r.p99_ms for r in rows if r.runtime_term),
        phase_wait_mean_ms=period / 2,
        stagger_groups=tick.stagger_groups,
    )
