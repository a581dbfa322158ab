"""Tests that kill mutants of infra/capacity/timing.py (the capacity planner's tick time and first-audio
budget) that the capacity tests let survive (``make mutation MODULE=infra/capacity/timing.py``;
docs/mutation.md). Each docstring names its mutants.

The roofline of one phase is worked by hand on a made-up GPU; the phases of real presets are pinned to the
planner's figures at this commit (``tick_phases`` of moshi-7b, two configurations) after checking the KV
term by hand, so that a changed coefficient anywhere in the formula moves a pinned figure."""

from __future__ import annotations

import dataclasses

import pytest

from infra.capacity.gpus import get_gpu
from infra.capacity.latency import LatencyAssumptions, latency_budget
from infra.capacity.models import get_model
from infra.capacity.timing import (
    TICK_MODELS,
    TickModel,
    _phase,
    sim_step_table,
    tick_ms,
    tick_phases,
    tick_plan,
)

MOSHI = get_model("moshi-7b")
L40S = get_gpu("l40s")
T4 = get_gpu("t4")
# 1000 GB/s = 1e12 bytes/s: one GB of traffic is one millisecond.
FLAT = dataclasses.replace(L40S, bandwidth_gb_s=1000.0)
HALF = TickModel("half", 0.5, 0.25, 0.5, 1.0, "test")


def test_phase_roofline_and_estimate_by_hand():
    """Kills ``_phase``: each of ``t_w``, ``t_kv``, ``t_c`` (``/`` -> ``*``), ``max`` of the roofline
    (``+`` -> ``-``), the estimate's fractions (``tm.weights_bw`` / ``tm.kv_bw`` / ``tm.flops`` swapped or
    ``/`` -> ``*``), ``* 1e3`` and the byte and FLOP fields. By hand, with 1e12 bytes/s: 2 GB of weights
    = 2 ms, 1 GB of KV = 1 ms, 1e12 FLOPs at 1e15/s = 1 ms; roofline max(2 + 1, 1) = 3 ms; estimate
    max(2/0.5 + 1/0.25, 1/0.5) = 8 ms."""
    p = _phase("x", 2e9, 1e9, 1e12, 1e15, FLAT, HALF)
    assert (p.name, p.bytes, p.flops, p.bound) == ("x", 3_000_000_000, 1_000_000_000_000, "memory")
    assert p.roofline_ms == pytest.approx(3.0) and p.estimate_ms == pytest.approx(8.0)


def test_phase_compute_bound_by_hand():
    """Kills ``_phase``: ``bound`` (``"compute"`` changed, ``>=`` -> ``<``), and the compute term of the
    roofline and the estimate: 1e13 FLOPs at 1e15/s = 10 ms > 3 ms of traffic; estimate 10 / 0.5 = 20 ms."""
    p = _phase("y", 2e9, 1e9, 1e13, 1e15, FLAT, HALF)
    assert p.bound == "compute"
    assert p.roofline_ms == pytest.approx(10.0) and p.estimate_ms == pytest.approx(20.0)


def test_phase_tie_is_memory_bound():
    """Kills ``t_w + t_kv >= t_c`` -> ``>``: 2 ms of traffic and 2 ms of compute is memory bound."""
    assert _phase("z", 1e9, 1e9, 2e12, 1e15, FLAT, HALF).bound == "memory"


MOSHI_L40S_INT8_B1 = [
    ("Mimi encode", 189770928, 433537024, 0.219642, 0.324672, "memory"),
    ("LM step: weights", 7383143424, 14749270016, 8.545305, 12.207578, "memory"),
    ("LM step: KV cache read", 1573584896, 1573748736, 1.821279, 3.642558, "memory"),
    ("Mimi decode", 193979524, 438849536, 0.224513, 0.331636, "memory"),
]
MOSHI_T4_FP32_FP8KV_B3_CFG = [
    ("Mimi encode", 222723344, 1300611072, 0.69601, 1.082566, "memory"),
    ("LM step: weights", 29501521920, 88495620096, 92.192256, 131.703223, "memory"),
    ("LM step: KV cache read", 4720754688, 9442492416, 14.752358, 29.504717, "memory"),
    ("Mimi decode", 226950276, 1316548608, 0.70922, 1.101485, "memory"),
]


def rows(phases):
    return [
        (p.name, p.bytes, p.flops, round(p.roofline_ms, 6), round(p.estimate_ms, 6), p.bound) for p in phases
    ]


def test_tick_phases_of_moshi_on_an_l40s_are_pinned():
    """Kills ``tick_phases``' arithmetic for the common case (INT8 weights, bf16 KV, one slot, the planning
    tick model by default): the embedding store (``emb_store`` 2), the gathered rows, the KV read and
    write, the Mimi weights (``// 2`` of the quantizer, the codebooks used) and states, and every phase's
    name. The KV row checked by hand: 2 x 32 layers x 3000 context x 4096 dim x 2 B = 1 572 864 000 bytes of
    temporal ring, plus the depformer's ring and one written position (2 x 32 x 4096 x 2 B = 524 288)."""
    assert rows(tick_phases(MOSHI, L40S, "int8", "bf16", 1)) == MOSHI_L40S_INT8_B1
    kv = tick_phases(MOSHI, L40S, "int8", "bf16", 1)[2].bytes
    temporal = 2 * 32 * 3000 * 4096 * 2
    depformer = MOSHI.depformer_kv_elements_per_slot() * 2
    assert kv == temporal + depformer + 2 * 32 * 4096 * 2
    assert rows(tick_phases(MOSHI, L40S, "int8", "bf16", 1, tick_model=TICK_MODELS["planning"])) == rows(
        tick_phases(MOSHI, L40S, "int8", "bf16", 1)
    )


def test_tick_phases_with_fp32_weights_cfg_and_a_kv_precision_the_gpu_lacks_are_pinned():
    """Kills ``tick_phases``: ``emb_store = 4 if precision == "fp32"`` (-> 2, ``!=``), ``rows = sessions x
    (2 if cfg else 1)`` (-> 3, ``1 if cfg``), the Mimi terms scaled by ``sessions`` (not rows), and
    ``att_prec``: fp8 KV on a T4 (no fp8) is timed at fp16 (``else "fp16"`` changed, ``in`` -> ``not in``)."""
    assert rows(tick_phases(MOSHI, T4, "fp32", "fp8", 3, cfg=True)) == MOSHI_T4_FP32_FP8KV_B3_CFG


def test_attention_falls_back_to_fp32_on_a_gpu_without_fp16():
    """Kills ``peak_att``'s fallback (``else "fp32"`` changed, ``att_prec in gpu.tflops`` -> ``not in``):
    without fp16 or the KV precision, attention runs at the fp32 peak."""
    no_fp16 = dataclasses.replace(L40S, tflops={"fp32": 10.0, "int8": 100.0})
    compute = dataclasses.replace(no_fp16, bandwidth_gb_s=1e6)  # traffic free: compute bound
    kv = tick_phases(MOSHI, compute, "int8", "bf16", 1)[2]
    assert kv.bound == "compute"
    assert kv.roofline_ms == pytest.approx(kv.flops / 10e12 * 1e3)
    with_fp16 = dataclasses.replace(compute, tflops={"fp32": 10.0, "fp16": 40.0, "int8": 100.0})
    kv = tick_phases(MOSHI, with_fp16, "int8", "bf16", 1)[2]
    assert kv.roofline_ms == pytest.approx(kv.flops / 40e12 * 1e3)
    with_bf16 = dataclasses.replace(compute, tflops={"fp32": 10.0, "fp16": 40.0, "bf16": 80.0, "int8": 100.0})
    kv = tick_phases(MOSHI, with_bf16, "int8", "bf16", 1)[2]
    assert kv.roofline_ms == pytest.approx(kv.flops / 80e12 * 1e3)


def test_a_config_without_depformer_dim_takes_256():
    """Kills ``model.lm.get("depformer_dim", 256)`` (-> 257, None, left out) in the gathered rows."""
    lm = {k: v for k, v in MOSHI.lm.items() if k != "depformer_dim"}
    bare = dataclasses.replace(MOSHI, lm=lm)
    explicit = dataclasses.replace(MOSHI, lm={**lm, "depformer_dim": 256})
    assert (
        tick_phases(bare, L40S, "int8", "bf16", 1)[1].bytes
        == tick_phases(explicit, L40S, "int8", "bf16", 1)[1].bytes
    )


def test_tick_ms_is_the_phases_plus_the_overhead():
    """Kills ``tick_ms``: ``sum`` of the estimates (``+`` -> ``-`` of the overhead), the default tick model
    (``TICK_MODELS["planning"]``), and ``cfg``/``tick_model`` not passed on."""
    phases = tick_phases(MOSHI, L40S, "int8", "bf16", 2)
    assert tick_ms(MOSHI, L40S, "int8", "bf16", 2) == pytest.approx(sum(p.estimate_ms for p in phases) + 5.0)
    roof = TICK_MODELS["roofline"]
    phases = tick_phases(MOSHI, L40S, "int8", "bf16", 2, cfg=True, tick_model=roof)
    assert tick_ms(MOSHI, L40S, "int8", "bf16", 2, cfg=True, tick_model=roof) == pytest.approx(
        sum(p.roofline_ms for p in phases)
    )
    assert tick_ms(MOSHI, L40S, "int8", "bf16", 2, tick_model=HALF) == pytest.approx(
        sum(p.estimate_ms for p in tick_phases(MOSHI, L40S, "int8", "bf16", 2, tick_model=HALF)) + 1.0
    )


def largest_fitting(model, gpu, precision, kv, budget, limit, **kw):
    best = 0
    for b in range(1, limit + 1):
        if tick_ms(model, gpu, precision, kv, b, **kw) <= budget:
            best = b
    return best


@pytest.mark.parametrize(
    "gpu, precision, cfg, margin",
    [
        ("l40s", "int8", False, 0.2),
        ("h100", "bf16", False, 0.2),
        ("t4", "int8", False, 0.2),
        ("h200", "int8", True, 0.1),
    ],
)
def test_tick_plan_finds_the_largest_batch_inside_the_budget(gpu, precision, cfg, margin):
    """Kills ``tick_plan``'s search: the doubling (``hi * 2`` -> ``* 3``, ``lo, hi = hi, ...`` swapped,
    ``hi <= search_limit`` -> ``<``), the bisection (``(lo + hi) // 2``, ``lo = mid``/``hi = mid`` swapped,
    ``hi - lo > 1`` -> ``> 2``), ``fits``' ``<=`` -> ``<`` and the budget ``80 x (1 - margin)``: the answer is
    the largest B whose tick fits, found here by trying every B."""
    g = get_gpu(gpu)
    plan = tick_plan(MOSHI, g, precision, "bf16", 1, cfg=cfg, margin=margin)
    assert plan.budget_ms == pytest.approx(80.0 * (1 - margin))
    assert plan.max_sessions == largest_fitting(MOSHI, g, precision, "bf16", plan.budget_ms, 200, cfg=cfg)
    assert plan.max_sessions > 0


def test_tick_plan_fields():
    """Kills ``tick_plan``: the default margin 0.2 (budget 64 ms), the default tick model, each field
    (``sessions``, ``tick_model``, ``phases``, ``overhead_ms``, ``roofline_ms`` as the sum of the phases'
    rooflines, ``estimate_ms`` with the overhead, ``frame_ms``, ``margin``), ``within_budget`` (``<=`` ->
    ``>``), and ``cfg``/``tick_model`` passed to the phases and the search."""
    plan = tick_plan(MOSHI, L40S, "int8", "bf16", 5)
    phases = tick_phases(MOSHI, L40S, "int8", "bf16", 5)
    assert (plan.sessions, plan.tick_model, plan.frame_ms, plan.margin, plan.budget_ms) == (
        5,
        "planning",
        80.0,
        0.2,
        pytest.approx(64.0),
    )
    assert plan.phases == phases and plan.overhead_ms == 5.0
    assert plan.roofline_ms == pytest.approx(sum(p.roofline_ms for p in phases))
    assert plan.estimate_ms == pytest.approx(tick_ms(MOSHI, L40S, "int8", "bf16", 5))
    assert plan.within_budget is True and plan.max_sessions == 12
    over = tick_plan(MOSHI, L40S, "int8", "bf16", 13)
    assert over.within_budget is False and over.max_sessions == 12
    cfg = tick_plan(MOSHI, L40S, "int8", "bf16", 5, cfg=True, tick_model=TICK_MODELS["vllm-omni-fit"])
    assert cfg.tick_model == "vllm-omni-fit" and cfg.overhead_ms == 13.0
    assert cfg.phases == tick_phases(
        MOSHI, L40S, "int8", "bf16", 5, cfg=True, tick_model=TICK_MODELS["vllm-omni-fit"]
    )
    assert cfg.max_sessions == largest_fitting(
        MOSHI, L40S, "int8", "bf16", 64.0, 40, cfg=True, tick_model=TICK_MODELS["vllm-omni-fit"]
    )


def test_tick_plan_stops_at_the_search_limit():
    """Kills ``hi = min(hi, search_limit + 1)`` (-> ``+ 2``, ``max``), the default limit 4096 and
    ``hi <= search_limit`` -> ``<``: a tiny model whose every batch fits is capped at the limit."""
    tiny = get_model("tiny")
    assert tick_plan(tiny, L40S, "fp32", "fp32", 1).max_sessions == 4096
    for limit in (1, 4, 5, 6):
        assert tick_plan(tiny, L40S, "fp32", "fp32", 1, search_limit=limit).max_sessions == limit
    assert tick_plan(MOSHI, L40S, "int8", "bf16", 1, search_limit=12).max_sessions == 12
    assert tick_plan(MOSHI, L40S, "int8", "bf16", 1, search_limit=11).max_sessions == 11
    assert tick_plan(MOSHI, L40S, "int8", "bf16", 1, search_limit=13).max_sessions == 12


def test_latency_budget_rows_and_totals():
    """Kills ``latency_budget`` (``infra.capacity.latency``): each row's name, low, high and note, the
    default assumptions (5-20 ms each way, 20-30 ms playback buffer; the 0-80 ms tick alignment is the tick
    period), the LM row (both LM phases, plus the overhead
    at the high end only), the acoustic delay, the floor (80 + 80 = 160 ms for moshi-7b: Moshi's
    "160 ms theoretical latency") and the totals as sums."""
    tick = tick_plan(MOSHI, L40S, "int8", "bf16", 4)
    ph = {p.name: p for p in tick.phases}
    budget = latency_budget(MOSHI, tick)
    lm = ("LM step: weights", "LM step: KV cache read")
    expected = [
        ("Network, client to server", 5.0, 20.0, "assumption: same region"),
        ("Frame accumulation", 80.0, 80.0, "1920 samples at 24 kHz before Mimi can encode"),
        ("Wait for the batch tick", 0.0, 80.0, "fixed 80 ms clock shared by all slots"),
        ("Mimi encode", ph["Mimi encode"].roofline_ms, ph["Mimi encode"].estimate_ms, "batch of 4"),
        (
            "LM step (temporal + depformer)",
            sum(ph[n].roofline_ms for n in lm),
            sum(ph[n].estimate_ms for n in lm) + 5.0,
            "batch of 4, incl. KV reads and tick overhead",
        ),
        ("Acoustic delay", 80.0, 80.0, "codebooks delayed 1 frame(s)"),
        ("Mimi decode", ph["Mimi decode"].roofline_ms, ph["Mimi decode"].estimate_ms, "batch of 4"),
        ("Network, server to client", 5.0, 20.0, "assumption: same region"),
        ("Client playback buffer", 20.0, 30.0, "assumption: browser AudioContext"),
    ]
    assert [(r.name, r.low_ms, r.high_ms, r.note) for r in budget.rows] == [
        (n, pytest.approx(lo), pytest.approx(hi), note) for n, lo, hi, note in expected
    ]
    assert budget.floor_ms == 160.0
    assert budget.low_ms == pytest.approx(sum(e[1] for e in expected))
    assert budget.high_ms == pytest.approx(sum(e[2] for e in expected))
    assert LatencyAssumptions() == LatencyAssumptions((5.0, 20.0), (5.0, 20.0), (20.0, 30.0))


def test_latency_budget_takes_the_callers_assumptions():
    """Kills ``a = assumptions or LatencyAssumptions()`` -> ``and``, and each assumption's ``[0]``/``[1]``
    swapped or read from another field."""
    tick = tick_plan(MOSHI, L40S, "int8", "bf16", 1)
    mine = LatencyAssumptions((1.0, 2.0), (3.0, 4.0), (8.0, 9.0))
    budget = latency_budget(MOSHI, tick, mine)
    by_name = {r.name: (r.low_ms, r.high_ms) for r in budget.rows}
    assert by_name["Network, client to server"] == (1.0, 2.0)
    assert by_name["Network, server to client"] == (3.0, 4.0)
    assert by_name["Wait for the batch tick"] == (0.0, 80.0)  # not an assumption: the tick period
    assert by_name["Client playback buffer"] == (8.0, 9.0)


def test_sim_step_table_format_and_defaults():
    """Kills ``sim_step_table``: the ``","`` join, the ``"{b}:{ms:.1f}"`` format, the default precisions
    (bf16, bf16), the default batches (1, 2, 4, 8, 16, 32, 64) and ``tick_model`` passed on."""
    h100 = get_gpu("h100")
    assert sim_step_table(MOSHI, h100) == "1:12.4,2:13.4,4:15.3,8:19.1,16:26.8,32:42.2,64:73.1"
    assert sim_step_table(MOSHI, h100, batches=(1, 8)) == "1:12.4,8:19.1"
    roof = TICK_MODELS["roofline"]
    assert sim_step_table(MOSHI, h100, "int8", "fp8", (3,), tick_model=roof) == (
        f"3:{tick_ms(MOSHI, h100, 'int8', 'fp8', 3, tick_model=roof):.1f}"
    )


def test_no_session_fits_when_one_does_not():
    """Kills ``tick_plan``'s start ``lo, hi = 0, 1`` -> ``1, 1``: moshi-7b with fp32 weights on a T4 needs
    148 ms a tick for one session, past the 64 ms budget: none fits, not one."""
    assert tick_ms(MOSHI, T4, "fp32", "bf16", 1) > 64.0
    assert tick_plan(MOSHI, T4, "fp32", "bf16", 1).max_sessions == 0


def test_a_tick_of_exactly_the_budget_fits():
    """Kills ``fits``' ``<= budget`` -> ``<``: a tick model whose overhead brings three sessions' tick to
    exactly the 64 ms budget fits three."""
    base = dataclasses.replace(TICK_MODELS["planning"], overhead_ms=0.0)
    exact = dataclasses.replace(
        base, overhead_ms=64.0 - tick_ms(MOSHI, L40S, "int8", "bf16", 3, tick_model=base)
    )
    assert tick_ms(MOSHI, L40S, "int8", "bf16", 3, tick_model=exact) == 64.0
    assert tick_plan(MOSHI, L40S, "int8", "bf16", 1, tick_model=exact).max_sessions == 3


def test_the_weights_phase_runs_at_the_weights_compute_precision():
    """Kills ``peak_lin = gpu.flops_per_s(compute_precision(precision))`` with the precision dropped
    (``flops_per_s(None)``, ``compute_precision(None)``): with traffic free, INT8 weights' linear FLOPs run
    at the L40S's INT8 peak, not its fp16 one."""
    compute = dataclasses.replace(L40S, bandwidth_gb_s=1e9)
    weights = tick_phases(MOSHI, compute, "int8", "bf16", 1)[1]
    assert weights.bound == "compute"
    assert weights.roofline_ms == pytest.approx(weights.flops / compute.flops_per_s("int8") * 1e3)
    assert compute.flops_per_s("int8") != compute.flops_per_s("fp16")
