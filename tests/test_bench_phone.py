"""The phone bench's arithmetic (runtime/tools/bench_phone.py): frame arrivals grouped into ticks, and a
bridged frame's delay over the WebSocket clients' median arrival of its tick, on made-up arrival times (no
node, no clock). The bench itself runs a node: its figures are in docs/benchmarks.md, not asserted.

Planted bugs these catch: a delay measured against the tick's first arrival instead of its median; a call
frame after the WebSocket sessions ended charged to their last tick (a delay of seconds); a new tick
started inside one tick's spread of arrivals.
"""

from __future__ import annotations

import pytest

from runtime.tools.bench_phone import added_latency_ms, first_audio_terms, tick_groups

# Three WebSocket sessions' arrivals over three ticks 80 ms apart (s), each tick spread over 2 ms.
REFERENCE = [1.000, 1.001, 1.002, 1.080, 1.081, 1.082, 1.160, 1.161, 1.162]


def test_arrivals_group_into_ticks_with_their_first_and_median_arrival() -> None:
    starts, medians = tick_groups(list(reversed(REFERENCE)))
    assert starts == pytest.approx([1.000, 1.080, 1.160])
    assert medians == pytest.approx([1.001, 1.081, 1.161])


def test_a_bridged_frame_is_measured_against_its_ticks_median_arrival() -> None:
    bridged = [1.004, 1.0835, 1.161]
    assert added_latency_ms(REFERENCE, bridged) == pytest.approx([3.0, 2.5, 0.0])


def test_frames_without_a_reference_tick_are_left_out() -> None:
    # before the first tick, and two frames after the WebSocket sessions ended (one frame and ten later)
    assert added_latency_ms(REFERENCE, [0.5, 1.250, 2.0]) == []


def test_a_frame_just_past_the_references_last_tick_is_not_charged_a_whole_frame() -> None:
    """The quiet run with a p99 of exactly one frame (docs/benchmarks.md): after the WebSocket sessions'
    last tick (1.160), a call frame 79 ms later is the next tick's, not a 78 ms delay of the last one; and
    where the reference missed a tick (none at 1.080), a frame 79 ms after 1.000 is left out too. Half a
    frame in, with the next tick seen, a real delay still counts."""
    assert added_latency_ms(REFERENCE, [1.239]) == []
    gapped = [t for t in REFERENCE if not 1.07 < t < 1.09]
    assert added_latency_ms(gapped, [1.079]) == []
    assert added_latency_ms(REFERENCE, [1.0455]) == pytest.approx([44.5])


def test_a_frame_period_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="frame_s must be > 0"):
        tick_groups(REFERENCE, 0.0)


def test_first_audio_terms_split_the_calls_first_audio() -> None:
    budget = {
        "total_ms_mean": 150.0,
        "ingress_ms_mean": 0.5,
        "phase_wait_ms_mean": 40.0,
        "ticks_mean": 1.0,
        "tick_compute_ms_mean": 30.0,
        "egress_ms_mean": 1.5,
    }
    terms = first_audio_terms([300.0, 320.0], [60.0, 60.0], budget)
    assert terms["call_first_audio_ms_mean"] == 310.0
    assert terms["caller_pacing_ms_mean"] == 60.0  # the 4th 20 ms packet completes the first frame
    assert terms["runtime_ms_mean"] == 150.0
    # what is left: start -> the first input frame at the front end beyond the pacing (the gate, the
    # admission, the persona prompt) and the hops both ways
    assert terms["admission_and_hops_ms_mean"] == 100.0
    assert terms["ticks_ms_mean"] == 80.0
