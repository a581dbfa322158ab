"""Verdicts, machine-type rules, catalogs and formulas of the capacity planner (pure Python)."""

from __future__ import annotations

import pytest

from infra.capacity import InfeasibleConfiguration, Reason, check, gcp, max_sessions, plan, require_feasible
from infra.capacity.gpus import GPUS, get_gpu
from infra.capacity.memory import lm_weight_bytes
from infra.capacity.models import get_model
from infra.capacity.network import network_plan, ws_header_bytes
from infra.capacity.seed_plan import compare_scale5
from infra.capacity.timing import TICK_MODELS, tick_ms
from infra.capacity.units import GB, GiB

# ---- verdict reasons ------------------------------------------------------------------------------------


def test_feasible_config_has_no_problems():
    v = check("moshi-7b", "a100-80gb-sxm", "int8", 5)
    assert v.feasible and v.problems == []
    assert v.max_sessions >= 5


def test_out_of_memory_reason_and_amount():
    p = plan("personaplex-7b", "t4", "fp16", 4)
    v = p.verdict
    assert not v.feasible
    oom = [x for x in v.problems if x.reason is Reason.OUT_OF_MEMORY]
    assert len(oom) == 1
    short = (p.memory.required_bytes - p.memory.usable_bytes) / GB
    assert short > 0
    assert f"out of memory by {short:.1f} GB" in oom[0].detail


def test_out_of_memory_boundary_is_max_sessions():
    p = plan("moshi-7b", "l40s", "int8", 1, tick_model="roofline", margin=0.0)
    n = p.memory.max_sessions
    assert check("moshi-7b", "l40s", "int8", n, tick_model="roofline", margin=0.0).feasible or (
        Reason.OUT_OF_MEMORY not in check("moshi-7b", "l40s", "int8", n).reasons
    )
    over = check("moshi-7b", "l40s", "int8", n + 1, tick_model="roofline", margin=0.0)
    assert Reason.OUT_OF_MEMORY in over.reasons


def test_tick_over_budget_reason():
    v = check("moshi-7b", "l4", "bf16", 1)
    assert Reason.TICK_OVER_BUDGET in v.reasons
    assert "tick over budget" in next(p.detail for p in v.problems if p.reason is Reason.TICK_OVER_BUDGET)
    assert Reason.OUT_OF_MEMORY not in v.reasons


def test_margin_moves_the_tick_limit():
    tight = max_sessions("moshi-7b", "l40s", "int8", margin=0.5)
    loose = max_sessions("moshi-7b", "l40s", "int8", margin=0.0)
    assert tight < loose


def test_machine_type_cannot_carry_gpu():
    v = check("moshi-7b", "a100-80gb-sxm", "int8", 1, machine_type="n1-standard-8")
    assert Reason.MACHINE_TYPE_CANNOT_CARRY_GPU in v.reasons
    assert v.max_sessions == 0


def test_l40s_on_any_gcp_machine_type_is_refused():
    v = check("moshi-7b", "l40s", "int8", 1, machine_type="g2-standard-8")
    assert Reason.MACHINE_TYPE_CANNOT_CARRY_GPU in v.reasons
    assert "not offered on GCP" in v.problems[0].detail


def test_bf16_on_t4_is_unsupported():
    v = check("tiny", "t4", "bf16", 1)
    assert v.reasons == [Reason.PRECISION_UNSUPPORTED, Reason.PRECISION_UNSUPPORTED]  # weights and KV
    assert "bf16" in v.problems[0].detail


def test_fp8_on_a100_is_unsupported_but_on_h100_is_not():
    assert Reason.PRECISION_UNSUPPORTED in check("moshi-7b", "a100-80gb-sxm", "fp8", 1).reasons
    assert Reason.PRECISION_UNSUPPORTED not in check("moshi-7b", "h100", "fp8", 1).reasons


def test_int4_on_t4_falls_back_to_fp16_kv():
    p = plan("moshi-7b", "t4", "int4", 1)
    assert p.config.kv_precision == "fp16"
    assert Reason.PRECISION_UNSUPPORTED not in p.verdict.reasons


def test_several_reasons_at_once():
    v = check("personaplex-7b", "t4", "bf16", 50, machine_type="a2-highgpu-1g")
    assert set(v.reasons) >= {
        Reason.PRECISION_UNSUPPORTED,
        Reason.MACHINE_TYPE_CANNOT_CARRY_GPU,
        Reason.OUT_OF_MEMORY,
        Reason.TICK_OVER_BUDGET,
    }


def test_require_feasible_raises_with_reasons():
    with pytest.raises(InfeasibleConfiguration) as e:
        require_feasible("personaplex-7b", "l4", "bf16", 8)
    assert not e.value.verdict.feasible
    assert isinstance(e.value, ValueError)
    assert require_feasible("moshi-7b", "h100", "bf16", 8).verdict.feasible


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"model": "llama", "gpu": "l4"}, "model"),
        ({"model": "tiny", "gpu": "rtx4090"}, "gpu"),
        ({"model": "tiny", "gpu": "l4", "precision": "int2"}, "precision"),
        ({"model": "tiny", "gpu": "l4", "kv_precision": "int4"}, "kv_precision"),
        ({"model": "tiny", "gpu": "l4", "sessions": 0}, "sessions"),
        ({"model": "tiny", "gpu": "l4", "nodes": 0}, "nodes"),
        ({"model": "tiny", "gpu": "l4", "machine_type": "n2-standard-8"}, "machine_type"),
    ],
)
def test_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        plan(**kwargs)
    assert str(e.value).startswith(field + ":")


def test_unknown_gpu_lists_allowed_values():
    with pytest.raises(ValueError) as e:
        plan("tiny", "rtx4090")
    for key in GPUS:
        assert key in str(e.value)


# ---- GCP machine-type rules ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("machine", "gpu", "ok"),
    [
        ("n1-standard-8", "t4", True),
        ("n1-standard-8", "a100-40gb", False),
        ("n1-standard-8", "a100-80gb-sxm", False),
        ("n1-standard-4", "l4", False),
        ("g2-standard-8", "l4", True),
        ("g2-standard-8", "t4", False),
        ("a2-highgpu-1g", "a100-40gb", True),
        ("a2-highgpu-1g", "a100-80gb-sxm", False),
        ("a2-ultragpu-1g", "a100-80gb-sxm", True),
        ("a2-ultragpu-1g", "a100-80gb-pcie", False),
        ("a3-highgpu-1g", "h100", True),
        ("a3-highgpu-8g", "a100-40gb", False),
        ("g2-standard-8", "l40s", False),
    ],
)
def test_machine_type_carries(machine, gpu, ok):
    assert (gcp.carry_problem(machine, gpu) is None) is ok


def test_every_gcp_gpu_has_a_default_machine_type_that_carries_it():
    for gpu in gcp.GCP_GPUS:
        mt = gcp.DEFAULT_MACHINE_TYPE[gpu]
        assert gcp.carry_problem(mt, gpu) is None
    assert "l40s" not in gcp.GCP_GPUS and "a100-80gb-pcie" not in gcp.GCP_GPUS


def test_prices_have_source_and_date():
    for mt in gcp.MACHINE_TYPES.values():
        if mt.price is not None:
            assert mt.price.usd_per_hour > 0 and mt.price.source and mt.price.read_on
    assert gcp.MACHINE_TYPES["a2-highgpu-1g"].price.usd_per_hour == pytest.approx(3.67)


def test_monthly_cost_scales_with_nodes():
    one = plan("moshi-7b", "l4", "int8", 1, nodes=1).power
    three = plan("moshi-7b", "l4", "int8", 1, nodes=3).power
    assert three.cloud_usd_month == pytest.approx(3 * one.cloud_usd_month)
    assert one.cloud_usd_month == pytest.approx(gcp.MACHINE_TYPES["g2-standard-8"].price.usd_per_hour * 730)
    assert plan("moshi-7b", "l40s", "int8", 1).power.cloud_usd_month is None


# ---- catalogs and formulas -------------------------------------------------------------------------------


def test_gpu_catalog_shapes():
    assert not get_gpu("t4").supports("bf16")
    for g in GPUS.values():
        assert g.supports("fp16") and g.supports("int8")
        assert set(g.native) >= {"fp32"}
        assert g.bandwidth_gb_s > 0 and g.tdp_w > 0
    # driver-reported memory vs label: an L40S "48 GB" is 45 GiB
    assert get_gpu("l40s").memory_bytes / GiB == pytest.approx(45.0, abs=0.05)


def test_kv_cache_per_slot_matches_field_notes():
    spec = get_model("moshi-7b")
    kv = spec.temporal_kv_elements_per_slot() * 2
    assert kv == 2 * 32 * 3000 * 4096 * 2
    assert kv / GB == pytest.approx(1.57, abs=0.01)
    assert kv / GiB == pytest.approx(1.465, abs=0.001)
    assert spec.depformer_kv_elements_per_slot() * 2 == 192 * 1024
    # PersonaPlex as served: its checkpoint's 16 depformer steps, 8 built (served_lm_kwargs), so its
    # depformer ring is the 7B's, not the 384 KiB of 16 steps.
    assert get_model("personaplex-7b").depformer_kv_elements_per_slot() * 2 == 192 * 1024


def test_cfg_doubles_kv_but_not_mimi():
    a = plan("moshi-7b", "h100", "bf16", 2).memory.per_slot
    b = plan("moshi-7b", "h100", "bf16", 2, cfg=True).memory.per_slot
    by = lambda rows: {r.name: r.bytes for r in rows}  # noqa: E731
    assert by(b)["KV cache, temporal transformer"] == 2 * by(a)["KV cache, temporal transformer"]
    assert by(b)["Mimi streaming state"] == by(a)["Mimi streaming state"]


def test_weights_counted_once_not_per_session():
    p1 = plan("moshi-7b", "a100-80gb-sxm", "int8", 1).memory
    p5 = plan("moshi-7b", "a100-80gb-sxm", "int8", 5).memory
    k = 1 + p1.allocator_overhead
    assert p5.required_bytes - p1.required_bytes == pytest.approx(4 * p1.per_slot_bytes * k, rel=1e-6)


def test_int8_weights_keep_embeddings_16_bit():
    spec = get_model("moshi-7b")
    t = spec.lm_tally
    int8 = lm_weight_bytes(spec, "int8")
    assert int8 > t.total  # more than 1 byte per parameter
    assert int8 == pytest.approx(t.linear + 4 * t.linear_rows + 2 * t.embedding + 2 * t.other, rel=1e-9)
    assert lm_weight_bytes(spec, "bf16") == pytest.approx(2 * t.total, rel=1e-3)


def test_tick_grows_with_sessions_and_roofline_is_lower_bound():
    spec, g = get_model("personaplex-7b"), get_gpu("h100")
    prev = 0.0
    for b in (1, 2, 4, 8, 16, 32):
        t = tick_ms(spec, g, "bf16", "bf16", b)
        r = tick_ms(spec, g, "bf16", "bf16", b, tick_model=TICK_MODELS["roofline"])
        assert r < t and t > prev
        prev = t


@pytest.mark.parametrize(("batch", "published"), [(2, 28.0), (8, 32.6), (16, 45.0), (32, 70.2)])
def test_vllm_omni_anchor(batch, published):
    """Published batched PersonaPlex ticks on an H100 (FIELD-NOTES): the roofline stays below them, the
    fitted model within 20 %."""
    spec, g = get_model("personaplex-7b"), get_gpu("h100")
    assert tick_ms(spec, g, "bf16", "bf16", batch, tick_model=TICK_MODELS["roofline"]) < published
    fit = tick_ms(spec, g, "bf16", "bf16", batch, tick_model=TICK_MODELS["vllm-omni-fit"])
    assert fit == pytest.approx(published, rel=0.2)


def test_latency_floor_is_frame_plus_acoustic_delay():
    lat = plan("moshi-7b", "h100", "bf16", 1).latency
    assert lat.floor_ms == 160.0
    assert lat.low_ms > lat.floor_ms
    names = [r.name for r in lat.rows]
    assert "Frame accumulation" in names and "Acoustic delay" in names


def test_network_pcm_and_opus():
    pcm = network_plan(5, 2, "pcm")
    up, down = pcm.per_session
    assert up.audio_bps == 384_000
    assert up.total_bps > up.audio_bps
    assert pcm.fleet_ingress_bps == pytest.approx(2 * pcm.node_ingress_bps)
    opus = network_plan(5, 1, "opus")
    assert opus.session_total_bps < pcm.session_total_bps / 5
    assert (
        ws_header_bytes(100, False) == 2
        and ws_header_bytes(3841, True) == 8
        and ws_header_bytes(70000, False) == 10
    )


def test_power_and_heat():
    p = plan("moshi-7b", "l40s", "int8", 5, nodes=2).power
    assert p.gpu_w == 350
    assert p.fleet_wall_w == pytest.approx(2 * p.node_wall_w)
    assert p.node_btu_h == pytest.approx(p.node_wall_w * 3.412)


# ---- Scale-5 comparison ----------------------------------------------------------------------------------


def test_scale5_marks_the_known_errors():
    r = compare_scale5("moshi-7b")
    bad = {x.item for x in r.disagreements}
    assert "Total per session" in bad
    assert "Header 'VRAM Required'" in bad
    assert "Max sessions on L40S ('a 6th would OOM')" in bad
    assert "Raw PCM per session" in bad
    a100_p99 = next(x for x in r.rows if x.item == "p99 first audio (ms)" and x.gpu == "a100-80gb-pcie")
    assert not a100_p99.agrees and "below the 160 ms floor" in a100_p99.reason
    tdp = next(x for x in r.rows if x.item == "TDP" and x.gpu == "a100-80gb-pcie")
    assert not tdp.agrees
    assert all(x.reason for x in r.disagreements)
    # our own figures: five sessions fit comfortably on both GPUs
    assert all(p.verdict.feasible for p in r.plans.values())
