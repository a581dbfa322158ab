"""The planner's first-audio p99 at 5 sessions on an L40S and an A100 80 GB (PCIe, the Scale-5 plan's),
personaplex-7b INT8, pinned to figures worked by hand (issue 24), with and without staggered sub-batches.

As ``tests/test_capacity_pinned.py`` does for memory: every figure below was worked out from the model's
configuration (PersonaPlex: the 7B with dep_q 16, moshi 0.2.13 ``loaders.py``; ``runtime/engine/
model_presets.py``), the GPUs' data sheets (``infra/capacity/gpus.py``: L40S 864 GB/s, fp32 91.6, fp16
362.05, int8 733 TFLOPS; A100 80 GB PCIe 1935 GB/s, fp32 19.5, fp16 312, int8 624) and the planner's stated
"planning" tick model (``infra/capacity/timing.py``: weights at 0.7 of peak bandwidth, KV reads at 0.5,
FLOPs at 0.5, 5 ms overhead per tick), then written here as literals. GB = 10**9 B; ms.

LM at INT8 (every linear int8 with one fp32 scale per output row; norms 16-bit; embeddings are gathered, not
streamed): linear weights 6,576,668,672 temporal + 131,072,000 text head + 16 x 4096 x 1024 depformer input
+ 6 x 16 x (1024 x 3072 + 1024 x 1024 + 1024 x 5632 + 2816 x 1024) depformer layers + 16 x 1024 x 2048 heads
= 8,041,529,344; output rows 2,489,600; norms 278,528. Streamed per tick: 8,041,529,344 + 4 x 2,489,600 +
2 x 278,528 = 8,052,044,800 B, plus the gathered embedding rows 5 x (17 x 4096 + 16 x 1024) x 2 = 860,160 B:
8,052,904,960 B. FLOPs 5 x (13,415,481,344 + 2,667,577,344) at int8.

KV (fp16): each slot's whole temporal ring read every step, 2 x 32 x 3000 x 4096 elements, and the depformer's
2 x 6 x 16 x 1024; one step's K and V written, 2 x 32 x 4096: 5 x (786,432,000 + 196,608) x 2 + 5 x 262,144
x 2 = 7,868,907,520 B.

Mimi (fp32): encode weights 4 x (12,628,256 SEANet encoder + 25,190,400 transformer + 1,048,576 downsample +
262,144 half the quantizer projections + 16 codebooks x 2048 x 256) = 190,071,936 B; state per tick 5 x 4 x
(2,048,000 KV ring x 2 steps of its 25 Hz transformer + 2 x 11,526 conv state) = 82,381,040 B. Decode 4 x
(14,724,641 + 25,190,400 + 2,048 + 262,144 + 8,388,608) = 194,271,364 B; state 5 x 4 x (4,096,000 + 2 x
12,672) = 82,426,880 B.

Each phase: roofline max(bytes / BW, FLOPs / peak); estimate max(weights / (0.7 BW) + KV / (0.5 BW), FLOPs /
(0.5 peak)). Tick estimate = the four phases + 5 ms:

- L40S: encode 0.504969, LM weights 13.314988, KV 18.215064, decode 0.512019 -> 37.547040 ms (roofline
  19.063615 ms).
- A100 80 GB PCIe: 0.225475 (memory: 0.140326 + 0.085148 > compute 0.222334), 5.945297, 8.133238, 0.228622
  -> 19.532632 ms (roofline 8.512126 ms).

First audio (latency.py): the phase wait is uniform over the tick period, p99 0.99 x 80 = 79.2 ms (39.6 ms
with two staggered groups); the acoustic delay one 80 ms step; the runtime's own p99 (what
``duplex_first_audio_latency_seconds`` measures) = phase wait p99 + 80 + the tick; the caller's adds the
frame (80 ms), the network (20 ms each way at worst) and the client's buffer (30 ms at worst):

- L40S: runtime 79.2 + 80 + 37.547040 = 196.747040 ms; caller 346.747040 ms. Staggered: a 37.547 ms
  whole-batch step every 40 ms is over the 32 ms budget (margin 20 %): infeasible.
- A100 80 GB PCIe: runtime 178.732632 ms, caller 328.732632 ms; staggered (19.53 <= 32: feasible) runtime
  139.132632 ms, caller 289.132632 ms.

Against the Scale-5 plan's p99 (180-220 ms on the L40S, 120-155 ms on the A100): the runtime's own p99 is in
its L40S range (196.7) and, staggered, in its A100 range (139.1); the caller's is 150 ms above both, since the
plan leaves out the frame, the acoustic delay and the wait for the tick (seed_plan.py).
"""

from __future__ import annotations

import pytest

from infra.capacity.plan import plan

TICK_MS = {"l40s": 37.547040, "a100-80gb-pcie": 19.532632}
ROOFLINE_MS = {"l40s": 19.063615, "a100-80gb-pcie": 8.512126}
PHASES_MS = {
    "l40s": (0.504969, 13.314988, 18.215064, 0.512019),
    "a100-80gb-pcie": (0.225475, 5.945297, 8.133238, 0.228622),
}
RUNTIME_P99_MS = {
    ("l40s", 1): 196.747040,
    ("a100-80gb-pcie", 1): 178.732632,
    ("a100-80gb-pcie", 2): 139.132632,
}
CALLER_P99_MS = {
    ("l40s", 1): 346.747040,
    ("a100-80gb-pcie", 1): 328.732632,
    ("a100-80gb-pcie", 2): 289.132632,
}


@pytest.mark.parametrize("gpu", ["l40s", "a100-80gb-pcie"])
def test_the_tick_at_5_sessions_is_the_hand_worked_figure(gpu: str) -> None:
    """Bytes per phase and the estimate of each (module docstring).

    Planted bug: ``tick_phases`` reading the KV ring at the weights' 0.7 instead of 0.5 of peak bandwidth
    (``t_kv / tm.weights_bw``) -- fails on it (L40S KV 13.01 ms, not 18.22)."""
    p = plan("personaplex-7b", gpu, "int8", 5)
    assert p.config.kv_precision == "fp16"
    phases = p.tick.phases
    assert [ph.bytes for ph in phases] == [
        190_071_936 + 82_381_040,
        8_052_904_960,
        7_868_907_520,
        194_271_364 + 82_426_880,
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
    40 ms x 0.8 = 32 ms: 37.5 ms on the L40S does not (at most 3 sessions do), 19.5 ms on the A100 does
    (at most 12 sessions, against 30 unstaggered)."""
    l40s = plan("personaplex-7b", "l40s", "int8", 5, stagger_groups=2)
    assert not l40s.verdict.feasible and l40s.tick.budget_ms == 32.0 and l40s.tick.max_sessions == 3
    assert "40 ms sub-tick of 2 staggered groups" in l40s.verdict.problems[0].detail
    a100 = plan("personaplex-7b", "a100-80gb-pcie", "int8", 5, stagger_groups=2)
    assert a100.verdict.feasible and a100.tick.max_sessions == 12
    assert plan("personaplex-7b", "a100-80gb-pcie", "int8", 5).tick.max_sessions == 30
