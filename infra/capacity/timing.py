"""Time per tick (one batched 80 ms step of B slots) and the first-audio latency budget.

Roofline (Williams et al., CACM 2009): a kernel takes at least max(bytes moved / peak bandwidth,
FLOPs / peak throughput). One tick runs three phases in turn on the GPU, each estimated this way:
- Mimi encode of B frames: encoder weights once, each slot's conv state and transformer KV ring read and
  written; FLOPs of the convolutions and the 25 Hz transformer (fp32).
- LM step: every linear weight read once (the depformer reads each step's weights once per frame),
  the gathered embedding rows, and every slot's whole temporal KV ring (moshi reads the ring whole each
  step with an explicit mask, FIELD-NOTES); FLOPs = 2 x linear params x B + attention 4 x context x dim
  x layers x B. Under CFG the LM runs 2B rows.
- Mimi decode of B frames, as encode.

The estimate used for verdicts divides each bandwidth term by an achieved fraction of peak, each FLOP term
by another, and adds a fixed per-tick overhead (launches, sampling, Python). The first-audio budget built
on a tick is in ``latency.py``. These are ``TickModel``s:
``planning`` (assumptions for moshi with CUDA graphs), ``vllm-omni-fit`` (fitted to the published batched
PersonaPlex ticks on an H100: 28.0 ms at B=2, 32.6 at B=8, 45.0 at B=16, 70.2 at B=32, vLLM-Omni issue
7389), and ``roofline`` (peak, no overhead: a lower bound).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from runtime.engine.model_presets import FRAME_MS

from .gpus import GpuSpec, compute_precision
from .memory import lm_weight_bytes
from .models import ModelSpec
from .units import BYTES_PER_ELEMENT

STAGGER_GROUPS = (1, 2)
"""Sub-tick group counts the runtime runs (``runtime.engine.scheduler.STAGGER_GROUPS``; the planner does not
import the runtime's engine): 1 = one tick per 80 ms frame, 2 = two groups stepped 40 ms apart."""


@dataclass(frozen=True)
class TickModel:
    """Achieved fractions of peak and fixed overhead used to turn a roofline into an estimate.

    Attributes:
        name: preset name.
        weights_bw: fraction of peak bandwidth reached while streaming weights (GEMV/GEMM at small B).
        kv_bw: fraction of peak bandwidth reached reading KV rings (masked SDPA, no flash kernel).
        flops: fraction of peak tensor throughput reached.
        overhead_ms: fixed time per tick (ms).
        source: where the values come from.
    """

    name: str
    weights_bw: float
    kv_bw: float
    flops: float
    overhead_ms: float
    source: str


TICK_MODELS: dict[str, TickModel] = {
    "planning": TickModel(
        "planning",
        0.7,
        0.5,
        0.5,
        5.0,
        "planning assumption for moshi 0.2.13 with CUDA graphs; not measured: calibrate on the target GPU",
    ),
    # Fit of t = overhead + weights/(BW x w) + B x KV/(BW x k) to the vLLM-Omni figures (H100, PersonaPlex
    # bf16, CUDA graphs): slope 1.57 ms per slot for 1.57 GB of KV -> k = 0.30; intercept 13 ms with w = 0.7.
    # Residuals with this model: B=2 -17 %, B=8/16/32 within 2 % (B=1: 21.6 ms vs 30.2 ms published).
    "vllm-omni-fit": TickModel(
        "vllm-omni-fit",
        0.7,
        0.30,
        0.5,
        13.0,
        "fit to vLLM-Omni issue 7389 (H100, batched PersonaPlex)",
    ),
    "roofline": TickModel("roofline", 1.0, 1.0, 1.0, 0.0, "peak bandwidth and throughput: a lower bound"),
}
"""Tick models by name."""


class PhaseTime(BaseModel):
    """One phase of a tick: bytes, FLOPs, roofline and estimated time (ms)."""

    model_config = ConfigDict(frozen=True)

    name: str
    bytes: int
    flops: int
    roofline_ms: float
    estimate_ms: float
    bound: str


class TickPlan(BaseModel):
    """Time of one tick at ``sessions`` slots and the largest slot count inside the budget.

    With ``stagger_groups`` G > 1 (the runtime's ``DUPLEX_STAGGER_GROUPS``) the node ticks every
    ``period_ms`` = 80 / G ms, each sub-tick stepping one group of sessions; moshi's exec mask freezes the
    other groups' rows with ``torch.where`` but computes them, so a sub-tick costs a whole tick of
    ``sessions`` slots (``estimate_ms``) and must fit ``period_ms x (1 - margin)`` (``budget_ms``)."""

    model_config = ConfigDict(frozen=True)

    sessions: int
    tick_model: str
    phases: list[PhaseTime]
    overhead_ms: float
    roofline_ms: float
    estimate_ms: float
    frame_ms: float
    margin: float
    budget_ms: float
    within_budget: bool
    max_sessions: int
    stagger_groups: int = 1
    period_ms: float = FRAME_MS


def _phase(
    name: str,
    weight_bytes: float,
    kv_bytes: float,
    flops: float,
    peak_flops: float,
    gpu: GpuSpec,
    tm: TickModel,
) -> PhaseTime:
    bw = gpu.bandwidth_bytes_s
    t_w = weight_bytes / bw
    t_kv = kv_bytes / bw
    t_c = flops / peak_flops
    roof = max(t_w + t_kv, t_c)
    est = max(t_w / tm.weights_bw + t_kv / tm.kv_bw, t_c / tm.flops)
    bound = "memory" if t_w + t_kv >= t_c else "compute"
    return PhaseTime(
        name=name,
        bytes=int(weight_bytes + kv_bytes),
        flops=int(flops),
        roofline_ms=roof * 1e3,
        estimate_ms=est * 1e3,
        bound=bound,
    )


def tick_phases(
    model: ModelSpec,
    gpu: GpuSpec,
    precision: str,
    kv_precision: str,
    sessions: int,
    *,
    cfg: bool = False,
    tick_model: TickModel | None = None,
) -> list[PhaseTime]:
    """Encode, LM-weights, LM-KV and decode phases of one tick for ``sessions`` slots (see module docstring).

    The LM step is split in two rows, the weight stream (with its FLOPs) and the KV-ring reads (with the
    attention FLOPs), so they can be compared with capacity plans that list them apart.
    """
    tm = tick_model or TICK_MODELS["planning"]
    rows = sessions * (2 if cfg else 1)
    kv_b = BYTES_PER_ELEMENT[kv_precision]
    lm_flops = model.lm_flops_per_frame()
    peak_lin = gpu.flops_per_s(compute_precision(precision))
    att_prec = kv_precision if kv_precision in gpu.tflops else "fp16"
    peak_att = gpu.flops_per_s(att_prec if att_prec in gpu.tflops else "fp32")
    # weights: all but embeddings (only gathered rows are read)
    t = model.lm_tally
    emb_store = 4 if precision == "fp32" else 2
    w_bytes = lm_weight_bytes(model, precision) - t.embedding * emb_store
    d = model.lm.get("depformer_dim", 256)
    gathered = rows * ((model.codebooks + 1) * model.dim + model.dep_q * d) * emb_store
    kv_read = rows * (model.temporal_kv_elements_per_slot() + model.depformer_kv_elements_per_slot()) * kv_b
    kv_write = rows * (2 * model.layers * model.dim) * kv_b
    lin_flops = rows * (lm_flops["temporal_linear"] + lm_flops["depformer_linear"])
    att_flops = rows * (lm_flops["temporal_attention"] + lm_flops["depformer_attention"])
    ma = model.mimi_arith
    p = ma.params_by_module
    q = model.mimi["quantizer"]
    codebooks_used = min(model.dep_q, q["n_q"]) * q["bins"] * q["dimension"]
    enc_w = 4 * (
        p["encoder"] + p["encoder_transformer"] + p["downsample"] + p["quantizer"] // 2 + codebooks_used
    )
    dec_w = 4 * (
        p["decoder"] + p["decoder_transformer"] + p["upsample"] + p["quantizer"] // 2 + codebooks_used
    )
    half_kv = ma.transformer_kv_elements_per_slot // 2
    # each 25 Hz transformer step reads the ring; conv states read and written once per frame
    enc_state = (
        sessions
        * 4
        * (half_kv * ma.transformer_steps_per_frame + 2 * sum(c.state_elements for c in ma.encode_convs))
    )
    dec_state = (
        sessions
        * 4
        * (half_kv * ma.transformer_steps_per_frame + 2 * sum(c.state_elements for c in ma.decode_convs))
    )
    fp32 = gpu.flops_per_s("fp32")
    return [
        _phase("Mimi encode", enc_w, enc_state, sessions * ma.encode_flops_per_frame, fp32, gpu, tm),
        _phase("LM step: weights", w_bytes + gathered, 0, lin_flops, peak_lin, gpu, tm),
        _phase("LM step: KV cache read", 0, kv_read + kv_write, att_flops, peak_att, gpu, tm),
        _phase("Mimi decode", dec_w, dec_state, sessions * ma.decode_flops_per_frame, fp32, gpu, tm),
    ]


def tick_ms(
    model: ModelSpec,
    gpu: GpuSpec,
    precision: str,
    kv_precision: str,
    sessions: int,
    *,
    cfg: bool = False,
    tick_model: TickModel | None = None,
) -> float:
    """Estimated time of one tick (ms) under ``tick_model`` (overhead included)."""
    tm = tick_model or TICK_MODELS["planning"]
    ph = tick_phases(model, gpu, precision, kv_precision, sessions, cfg=cfg, tick_model=tm)
    return sum(p.estimate_ms for p in ph) + tm.overhead_ms


def tick_plan(
    model: ModelSpec,
    gpu: GpuSpec,
    precision: str,
    kv_precision: str,
    sessions: int,
    *,
    cfg: bool = False,
    margin: float = 0.2,
    tick_model: TickModel | None = None,
    search_limit: int = 4096,
    stagger_groups: int = 1,
) -> TickPlan:
    """Tick time at ``sessions`` and the largest slot count whose tick fits ``period x (1 - margin)``, the
    period being the 80 ms frame, or 80 / ``stagger_groups`` ms with staggered sub-batches (``TickPlan``).

    Raises:
        ValueError: ``stagger_groups`` not in ``STAGGER_GROUPS`` (1 or 2: what the runtime runs).
    """
    if stagger_groups not in STAGGER_GROUPS:
        raise ValueError(
            f"stagger_groups: must be one of {', '.join(map(str, STAGGER_GROUPS))}, got {stagger_groups!r}"
        )
    tm = tick_model or TICK_MODELS["planning"]
    phases = tick_phases(model, gpu, precision, kv_precision, sessions, cfg=cfg, tick_model=tm)
    est = sum(p.estimate_ms for p in phases) + tm.overhead_ms
    roof = sum(p.roofline_ms for p in phases)
    period = FRAME_MS / stagger_groups
    budget = period * (1.0 - margin)

    def fits(b: int) -> bool:
        return tick_ms(model, gpu, precision, kv_precision, b, cfg=cfg, tick_model=tm) <= budget

    # tick time grows with B: binary search the largest B inside the budget
    lo, hi = 0, 1
    while hi <= search_limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, search_limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return TickPlan(
        sessions=sessions,
        tick_model=tm.name,
        phases=phases,
        overhead_ms=tm.overhead_ms,
        roofline_ms=roof,
        estimate_ms=est,
        frame_ms=FRAME_MS,
        margin=margin,
        budget_ms=budget,
        within_budget=est <= budget,
        max_sessions=lo,
        stagger_groups=stagger_groups,
        period_ms=period,
    )


def sim_step_table(
    model: ModelSpec,
    gpu: GpuSpec,
    precision: str = "bf16",
    kv_precision: str = "bf16",
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    *,
    tick_model: TickModel | None = None,
) -> str:
    """The planner's tick time at each of ``batches`` as ``"B:ms,..."``: the value of the runtime's
    ``DUPLEX_SIM_STEP_MS`` for a ``sim`` node that steps as ``model`` would on ``gpu``
    (``runtime/engine/sim_timing.py``; the runtime does not import the planner, so the figure is passed this
    way).

    Example: ``sim_step_table(get_model("personaplex-7b"), get_gpu("h100"))``.
    """
    return ",".join(
        f"{b}:{tick_ms(model, gpu, precision, kv_precision, b, tick_model=tick_model):.1f}" for b in batches
    )
