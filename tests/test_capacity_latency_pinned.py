"""The planner's first-audio p99 at 5 sessions on an L40S and an A100 80 GB (PCIe, the Scale-5 plan's),
personaplex-7b INT8, pinned to figures worked by hand (issue 24), with and without staggered sub-batches.

As ``tests/test_capacity_pinned.py`` does for memory: every figure below was worked out from the model's
configuration (PersonaPlex: the 7B, its checkpoint with dep_q 16, served with 8, moshi 0.2.13 ``loaders.py``;
``runtime/engine/model_presets.py``), the GPUs' data sheets (``infra/capacity/gpus.py``: L40S 864 GB/s, fp32
91.6, fp16 362.05, int8 733 TFLOPS; A100 80 GB PCIe 1935 GB/s, fp32 19.5, fp16 312, int8 624) and the
planner's stated "planning" tick model (``infra/capacity/timing.py``: weights at 0.7 of peak bandwidth, KV
reads at 0.5, FLOPs at 0.5, 5 ms overhead per tick), then written here as literals. GB = 10**9 B; ms.

LM at INT8, as served: PersonaPlex's checkpoint stores 16 depformer steps, the runtime builds the agent's 8
(``served_lm_kwargs``), the planner counts those (every linear int8 with one fp32 scale per output row; norms
16-bit; embeddings are gathered, not streamed): linear weights 6,576,668,672 temporal + 131,072,000 text head
+ 8 x 4096 x 1024 depformer input + 6 x 8 x (1024 x 3072 + 1024 x 1024 + 1024 x 5632 + 2816 x 1024) depformer
layers + 8 x 1024 x 2048 heads = 7,374,635,008; output rows 1,408,256 temporal and text head + 8 x (1024 +
6 x 10,752 + 2048) depformer = 1,948,928; norms 278,528 (the depformer's are shared by its steps). Streamed
per tick: 7,374,635,008 + 4 x 1,948,928 + 2 x 278,528 = 7,382,987,776 B, plus the gathered embedding rows
5 x (17 x 4096 + 8 x 1024) x 2 = 778,240 B: 7,383,766,016 B. FLOPs 5 x (13,415,481,344 + 1,333,788,672) at
int8.

KV (fp16): each slot's whole temporal ring read every step, 2 x 32 x 3000 x 4096 elements, and the depformer's
2 x 6 x 8 x 1024; one step's K and V written, 2 x 32 x 4096: 5 x (786,432,000 + 98,304) x 2 + 5 x 262,144 x 2
= 7,867,924,480 B.

Mimi (fp32), 8 codebooks (``min(dep_q, 8)``, as the runtime sets them): encode weights 4 x (12,628,256 SEANet
encoder + 25,190,400 transformer + 1,048,576 downsample + 262,144 half the quantizer projections + 8 codebooks
x 2048 x 256) = 173,294,720 B; state per tick 5 x 4 x (2,048,000 KV ring x 2 steps of its 25 Hz transformer +
2 x 11,526 conv state) = 82,381,040 B; 5 x 433,537,024 FLOPs. Decode 4 x (14,724,641 + 25,190,400 + 2,048 +
262,144 + 4,194,304) = 177,494,148 B; state 5 x 4 x (4,096,000 + 2 x 12,672) = 82,426,880 B; 5 x 438,849,536
FLOPs.

Each phase: roofline max(bytes / BW, FLOPs / peak); estimate max(weights / (0.7 BW) + KV / (0.5 BW), FLOPs /
(0.5 peak)). Tick estimate = the four phases + 5 ms:

- L40S: encode 0.477229, LM weights 12.208608, KV 18.212788, decode 0.484279 -> 36.382904 ms (roofline
  18.249175 ms).
- A100 80 GB PCIe: encode 0.222327 (compute: 2,167,685,120 / 9.75e12 > memory 0.127940 + 0.085148),
  5.451285, 8.132222, decode 0.225051 (compute > memory 0.131040 + 0.085196) -> 19.030885 ms (roofline
  8.148469 ms).

First audio (latency.py): the phase wait is uniform over the tick period, p99 0.99 x 80 = 79.2 ms (39.6 ms
with two staggered groups); the acoustic delay one 80 ms step; the runtime's own p99 (what
``duplex_first_audio_latency_seconds`` measures) = phase wait p99 + 80 + the tick; the caller's adds the
frame (80 ms), the network (20 ms each way at worst) and the client's buffer (30 ms at worst):

- L40S: runtime 79.2 + 80 + 36.382904 = 195.582904 ms; caller 345.582904 ms. Staggered: a 36.383 ms
  whole-batch step every 40 ms is over the 32 ms budget (margin 20 %): infeasible.
- A100 80 GB PCIe: runtime 178.230885 ms, caller 328.230885 ms; staggered (19.03 <= 32: feasible) runtime
  138.630885 ms, caller 288.630885 ms.

Against the Scale-5 plan's p99 (180-220 ms on the L40S, 120-155 ms on the A100): the runtime's own p99 is in
its L40S range (195.6) and, staggered, in its A100 range (138.6); the caller's is 150 ms above both, since the
plan leaves out the frame, the acoustic delay and the wait for the tick (seed_plan.py).
"""

from __future__ import annotations

import pytest

from infra.capacity.plan import plan

TICK_MS = {"l40s": 36.382904, "a100-80gb-pcie": 19.030885}
ROOFLINE_MS = {"l40s": 18.249175, "a100-80gb-pcie": 8.148469}
PHASES_MS = {
    "l40s": (0.477229, 12.208608, 18.212788, 0.484279),
    "a100-80gb-pcie": (0.222327, 5.451285, 8.132222, 0.225051),
}
RUNTIME_P99_MS = {
    ("l40s", 1): 195.582904,
    ("a100-80gb-pcie", 1): 178.230885,
    ("a100-80gb-pcie", 2): 138.630885,
}
CALLER_P99_MS = {
    ("l40s", 1): 345.582904,
    ("a100-80gb-pcie", 1): 328.230885,
    ("a100-80gb-pcie", 2): 288.630885,
}


@pytest.mark.parametrize("gpu", ["l40s", "a100-80gb-pcie"])
def test_the_tick_at_5_sessions_is_the_hand_worked_figure(gpu: str) -> None:
    """Bytes per phase and the estimate of each (module docstring).

    Planted bug: ``tick_phases`` reading the KV ring at the weights' 0.7 instead of 0.5 of peak bandwidth
    (``t_kv / tm.weights_bw``) -- fails on it (L40S KV 13.01 ms, not 18.21)."""
    p = plan("personaplex-7b", gpu, "int8", 5)
    assert p.config.kv_precision == "fp16"
    phases = p.tick.phases
    assert [ph.bytes for ph in phases] == [
        173_294_720 + 82_381_040,
        7_383_766_016,
        7_867_924_480,
        177_494_148 + 82_426_880,
    ]
    assert [ph.estimate_ms for ph in phases] == pytest.approx(PHASES_MS[gpu], abs=1e-6)
    assert p.tick.estimate_ms == pytest.approx(TICK_MS[gpu], abs=1e-6)
    assert p.tick.roofline_ms == pytest.approx(ROOFLINE_MS[gpu], abs=1e-6)


@pytest.mark.parametrize(("gpu", "groups"), sorted(RUNTIME_P99_MS))
def test_first_audio_p99_at_5_sessions_is_the_hand_worked_figure(gpu: str, groups: int) -> None:
    """The runtime's own p99 and the caller's, term by term (module docstring).

    Planted bugs: a phase wait p99 of the whole period (80 ms, not 79.2) or of the 80 ms frame under
    staggering (not 39.6) -- each fails here."""
    lat = plan("personaplex-7b", gpu, "int8", 5, stagger_groups=groups).latency
    rows = {r.name: r for r in lat.rows}
    wait = rows["Wait for the batch tick"]
    assert (wait.low_ms, wait.high_ms) == (0.0, 80.0 / groups)
    assert wait.p99_ms == pytest.approx(0.99 * 80.0 / groups, abs=1e-9)
    assert lat.phase_wait_mean_ms == 40.0 / groups
    assert rows["Acoustic delay"].p99_ms == 80.0 and rows["Acoustic delay"].runtime_term == "ticks"
    compute = sum(r.p99_ms for r in lat.rows if r.runtime_term == "tick_compute")
    assert compute == pytest.approx(TICK_MS[gpu], abs=1e-6)  # the rows of the tick add up to it
    assert lat.runtime_p99_ms == pytest.approx(RUNTIME_P99_MS[gpu, groups], abs=1e-6)
    assert lat.p99_ms == pytest.approx(CALLER_P99_MS[gpu, groups], abs=1e-6)
    assert lat.floor_ms == 160.0


def test_staggering_is_refused_on_the_l40s_and_allowed_on_the_a100_at_5_sessions() -> None:
    """A sub-tick computes the whole batch (moshi's exec mask), so it costs the tick above and must fit
    40 ms x 0.8 = 32 ms: 36.4 ms on the L40S does not (at most 3 sessions do), 19.0 ms on the A100 does
    (at most 12 sessions, against 31 unstaggered)."""
    l40s = plan("personaplex-7b", "l40s", "int8", 5, stagger_groups=2)
    assert not l40s.verdict.feasible and l40s.tick.budget_ms == 32.0 and l40s.tick.max_sessions == 3
    assert "40 ms sub-tick of 2 staggered groups" in l40s.verdict.problems[0].detail
    a100 = plan("personaplex-7b", "a100-80gb-pcie", "int8", 5, stagger_groups=2)
    assert a100.verdict.feasible and a100.tick.max_sessions == 12
    assert plan("personaplex-7b", "a100-80gb-pcie", "int8", 5).tick.max_sessions == 31
