"""The planner's single entry: ``plan(...)`` builds every table; ``check``, ``max_sessions`` and
``require_feasible`` are the one-call forms the stacks use to refuse a configuration and to size the
runtime's slots.

``sessions`` is the number of concurrent sessions (slots) per node; ``nodes`` the node count (one GPU each).
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict

from . import gcp
from .gpus import GPUS, compute_precision, get_gpu
from .latency import LatencyAssumptions, LatencyBudget, latency_budget
from .memory import (
    DEFAULT_ALLOCATOR_OVERHEAD,
    DEFAULT_CUDA_CONTEXT_BYTES,
    DEFAULT_HEADROOM,
    MemoryPlan,
    memory_plan,
)
from .models import get_model
from .network import CODECS, DEFAULT_OPUS_KBPS, NetworkPlan, network_plan
from .power import PowerPlan, power_plan
from .timing import TICK_MODELS, TickPlan, tick_plan
from .units import GB, KV_PRECISIONS, WEIGHT_PRECISIONS, check_choice


class Reason(str, Enum):
    """Why a configuration is infeasible."""

    OUT_OF_MEMORY = "out_of_memory"
    TICK_OVER_BUDGET = "tick_over_budget"
    MACHINE_TYPE_CANNOT_CARRY_GPU = "machine_type_cannot_carry_gpu"
    PRECISION_UNSUPPORTED = "precision_unsupported"


class Problem(BaseModel):
    """One reason with its human-readable detail."""

    model_config = ConfigDict(frozen=True)

    reason: Reason
    detail: str


class Verdict(BaseModel):
    """Feasible or not, with every reason found, and the largest session count per node that would hold."""

    model_config = ConfigDict(frozen=True)

    feasible: bool
    problems: list[Problem]
    max_sessions: int
    max_sessions_by_memory: int
    max_sessions_by_tick: int
    warnings: list[str]

    @property
    def reasons(self) -> list[Reason]:
        """The reasons alone."""
        return [p.reason for p in self.problems]


class Config(BaseModel):
    """The configuration a plan was made for (after defaults were filled in)."""

    model_config = ConfigDict(frozen=True)

    model: str
    gpu: str
    precision: str
    kv_precision: str
    sessions: int
    nodes: int
    cfg: bool
    margin: float
    tick_model: str
    machine_type: str | None
    codec: str
    stagger_groups: int = 1


class ModelSummary(BaseModel):
    """The model's shape and parameter counts by part, as served (``lm_params``: what the runtime loads;
    ``stored_lm_params``: what the checkpoint holds, PersonaPlex's 16 depformer steps)."""

    model_config = ConfigDict(frozen=True)

    name: str
    params_by_part: dict[str, int]
    lm_params: int
    stored_lm_params: int
    layers: int
    dim: int
    heads: int
    context: int
    codebooks: int
    dep_q: int
    acoustic_delay_ms: float


class CapacityPlan(BaseModel):
    """Everything the planner derives for one configuration."""

    model_config = ConfigDict(frozen=True)

    config: Config
    model: ModelSummary
    memory: MemoryPlan
    tick: TickPlan
    latency: LatencyBudget
    network: NetworkPlan
    power: PowerPlan
    verdict: Verdict


class InfeasibleConfiguration(ValueError):
    """Raised by ``require_feasible``; ``verdict`` holds the reasons."""

    def __init__(self, verdict: Verdict):
        self.verdict = verdict
        super().__init__("; ".join(p.detail for p in verdict.problems))


def default_kv_precision(precision: str, gpu: str) -> str:
    """The KV precision moshi uses for ``precision`` weights: that of the activations (fp16 under INT8;
    bf16 for fp8/int4, or fp16 where the GPU has no bf16)."""
    act = {"int8": "fp16", "fp8": "bf16", "int4": "bf16"}.get(precision, precision)
    if act == "bf16" and precision != "bf16" and not GPUS[gpu].supports("bf16"):
        return "fp16"
    return act


def plan(
    model: str,
    gpu: str,
    precision: str = "bf16",
    sessions: int = 1,
    nodes: int = 1,
    *,
    kv_precision: str | None = None,
    cfg: bool = False,
    margin: float = 0.2,
    tick_model: str = "planning",
    machine_type: str | None = None,
    codec: str = "opus",
    opus_kbps: float = DEFAULT_OPUS_KBPS,
    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_BYTES,
    allocator_overhead: float = DEFAULT_ALLOCATOR_OVERHEAD,
    headroom: float = DEFAULT_HEADROOM,
    latency: LatencyAssumptions | None = None,
    stagger_groups: int = 1,
) -> CapacityPlan:
    """Plan ``sessions`` sessions per node of ``model`` on ``nodes`` nodes with one ``gpu`` each.

    Args:
        model: preset name (``tiny``, ``moshi-7b``, ``personaplex-7b``).
        gpu: GPU key (``gpus.GPUS``).
        precision: LM weight precision (fp32, bf16, fp16, int8, fp8, int4).
        sessions: concurrent sessions (slots) per node, >= 1.
        nodes: node count, >= 1.
        kv_precision: KV cache precision; default: moshi's (``default_kv_precision``).
        cfg: classifier-free guidance (the LM runs two rows per slot).
        margin: fraction of the 80 ms frame kept free; the tick must fit 80 x (1 - margin) ms.
        tick_model: ``planning``, ``vllm-omni-fit`` or ``roofline`` (``timing.TICK_MODELS``).
        machine_type: GCP machine type; default: the catalog's type for the GPU, none where GCP lacks it.
        codec: ``opus`` or ``pcm`` on the wire.
        opus_kbps: Opus bit rate per direction (kbit/s).
        cuda_context_bytes, allocator_overhead, headroom: memory assumptions (``memory.py``).
        latency: assumptions of the first-audio budget.
        stagger_groups: the runtime's ``DUPLEX_STAGGER_GROUPS``: 2 ticks every 40 ms, each sub-tick a whole
            batch's step (``timing.TickPlan``), halving the phase wait (``latency.py``).

    Raises:
        ValueError: a bad input; the message names the field and the allowed values.
    """
    spec = get_model(model)
    g = get_gpu(gpu)
    check_choice("precision", precision, WEIGHT_PRECISIONS)
    kv = kv_precision or default_kv_precision(precision, gpu)
    check_choice("kv_precision", kv, KV_PRECISIONS)
    check_choice("tick_model", tick_model, tuple(TICK_MODELS))
    check_choice("codec", codec, CODECS)
    if not isinstance(sessions, int) or sessions < 1:
        raise ValueError(f"sessions: must be an integer >= 1, got {sessions!r}")
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes: must be an integer >= 1, got {nodes!r}")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin: must be in [0, 1), got {margin!r}")
    mt = None
    if machine_type is not None:
        mt = gcp.get_machine_type(machine_type)
    elif gpu in gcp.DEFAULT_MACHINE_TYPE:
        mt = gcp.MACHINE_TYPES[gcp.DEFAULT_MACHINE_TYPE[gpu]]

    problems: list[Problem] = []
    warnings: list[str] = []
    for field, p in (("precision", precision), ("kv_precision", kv)):
        need = compute_precision(p) if field == "precision" else p
        if not g.supports(need):
            problems.append(
                Problem(
                    reason=Reason.PRECISION_UNSUPPORTED,
                    detail=f"{field} {p} is not supported natively on {g.name} "
                    f"(native: {', '.join(sorted(g.native))})",
                )
            )
    if precision in ("fp8", "int4"):
        warnings.append(f"moshi 0.2.13 has no {precision} weight path (only bf16/fp16 and bitsandbytes int8)")
    if precision == "int8":
        warnings.append("int8 = bitsandbytes LLM.int8: needs a CUDA GPU and the gpu-int8 extra")
    if mt is not None:
        why = gcp.carry_problem(mt.name, gpu)
        if why:
            problems.append(Problem(reason=Reason.MACHINE_TYPE_CANNOT_CARRY_GPU, detail=why))
    elif gpu not in gcp.GCP_GPUS:
        warnings.append(f"{gpu} is not offered on GCP: planned as an on-premises node (no cloud price)")

    mem = memory_plan(
        spec,
        g,
        precision,
        kv,
        sessions,
        cfg=cfg,
        cuda_context_bytes=cuda_context_bytes,
        allocator_overhead=allocator_overhead,
        headroom=headroom,
    )
    if not mem.fits:
        problems.append(
            Problem(
                reason=Reason.OUT_OF_MEMORY,
                detail=f"out of memory by {mem.shortfall_bytes / GB:.1f} GB: {sessions} sessions need "
                f"{mem.required_bytes / GB:.1f} GB, {g.name} leaves {mem.usable_bytes / GB:.1f} GB usable "
                f"(at most {mem.max_sessions} sessions fit)",
            )
        )
    tm = TICK_MODELS[tick_model]
    tick = tick_plan(
        spec, g, precision, kv, sessions, cfg=cfg, margin=margin, tick_model=tm, stagger_groups=stagger_groups
    )
    if not tick.within_budget:
        period = (
            "80 ms frame"
            if stagger_groups == 1
            else f"{tick.period_ms:g} ms sub-tick of {stagger_groups} staggered groups, each a whole "
            "batch's step"
        )
        problems.append(
            Problem(
                reason=Reason.TICK_OVER_BUDGET,
                detail=f"tick over budget: {tick.estimate_ms:.1f} ms for {sessions} sessions, budget "
                f"{tick.budget_ms:.1f} ms ({period}, margin {margin:.0%}; at most {tick.max_sessions} "
                f"sessions fit)",
            )
        )
    lat = latency_budget(spec, tick, latency)
    net = network_plan(sessions, nodes, codec, opus_kbps)
    pw = power_plan(g, nodes, machine_type=mt if mt is not None and mt.gpu == gpu else None)
    hw_ok = not any(
        p.reason in (Reason.PRECISION_UNSUPPORTED, Reason.MACHINE_TYPE_CANNOT_CARRY_GPU) for p in problems
    )
    max_s = min(mem.max_sessions, tick.max_sessions) if hw_ok else 0
    verdict = Verdict(
        feasible=not problems,
        problems=problems,
        max_sessions=max_s,
        max_sessions_by_memory=mem.max_sessions,
        max_sessions_by_tick=tick.max_sessions,
        warnings=warnings,
    )
    summary = ModelSummary(
        name=spec.name,
        params_by_part=spec.part_params(),
        lm_params=spec.lm_tally.total,
        stored_lm_params=spec.stored_lm_params,
        layers=spec.layers,
        dim=spec.dim,
        heads=spec.heads,
        context=spec.context,
        codebooks=spec.codebooks,
        dep_q=spec.dep_q,
        acoustic_delay_ms=spec.acoustic_delay_ms,
    )
    config = Config(
        model=model,
        gpu=gpu,
        precision=precision,
        kv_precision=kv,
        sessions=sessions,
        nodes=nodes,
        cfg=cfg,
        margin=margin,
        tick_model=tick_model,
        machine_type=mt.name if mt else None,
        codec=codec,
        stagger_groups=stagger_groups,
    )
    return CapacityPlan(
        config=config,
        model=summary,
        memory=mem,
        tick=tick,
        latency=lat,
        network=net,
        power=pw,
        verdict=verdict,
    )


def check(
    model: str, gpu: str, precision: str = "bf16", sessions: int = 1, nodes: int = 1, **kwargs
) -> Verdict:
    """The verdict of ``plan(...)`` alone (same arguments)."""
    return plan(model, gpu, precision, sessions, nodes, **kwargs).verdict


def max_sessions(model: str, gpu: str, precision: str = "bf16", **kwargs) -> int:
    """The largest session count per node that fits memory and the tick budget (0 when none does or the
    hardware cannot run the precision). Same keyword arguments as ``plan``."""
    return plan(model, gpu, precision, 1, **kwargs).verdict.max_sessions


def require_feasible(
    model: str, gpu: str, precision: str = "bf16", sessions: int = 1, nodes: int = 1, **kwargs
) -> CapacityPlan:
    """``plan(...)``, raising ``InfeasibleConfiguration`` (a ``ValueError``) with every reason when it
    cannot hold: the stacks call this to refuse a ``max_sessions`` above what fits."""
    p = plan(model, gpu, precision, sessions, nodes, **kwargs)
    if not p.verdict.feasible:
        raise InfeasibleConfiguration(p.verdict)
    return p


class FirstAudioCheck(BaseModel):
    """A first-audio p99 target (``limits.first_audio_p99_target_ms`` of a node profile) against the plan.

    Attributes:
        target_ms: the target.
        reachable_ms: the runtime's first-audio p99 with the tick at the GPU's roofline (peak bandwidth and
            throughput, no overhead): no node of this configuration measures less.
        estimate_ms: the same with the tick at the planner's estimate (tick model ``planning``).
        refused: the target is below ``reachable_ms``: its alert would fire whatever the node did.
        warned: the target is below ``estimate_ms`` (but reachable): the planner expects it missed.
        message: what to tell the operator ("" when neither).
    """

    model_config = ConfigDict(frozen=True)

    target_ms: float
    reachable_ms: float
    estimate_ms: float
    refused: bool
    warned: bool
    message: str


def first_audio_check(
    model: str, gpu: str, precision: str, sessions: int, stagger_groups: int, target_ms: float
) -> FirstAudioCheck:
    """Judge a first-audio p99 target against the runtime's own p99 (``LatencyBudget.runtime_p99_ms``: phase
    wait p99 + acoustic delay + the tick; what ``duplex_first_audio_latency_seconds`` measures and the node's
    FirstAudioLatencyHigh alert watches), once at the GPU's roofline and once at the planner's estimate.

    Raises:
        ValueError: a bad input (as ``plan``).
    """
    estimate = plan(model, gpu, precision, sessions, stagger_groups=stagger_groups).latency
    best = plan(model, gpu, precision, sessions, tick_model="roofline", stagger_groups=stagger_groups).latency
    wait = next(r for r in estimate.rows if r.runtime_term == "phase_wait")
    delay = next(r for r in estimate.rows if r.runtime_term == "ticks")
    setup = f"{model} at {precision} on {gpu} with {sessions} sessions"
    if stagger_groups > 1:
        setup += f" and {stagger_groups} staggered groups"
    terms = f"phase wait p99 {wait.p99_ms:.1f} ms + acoustic delay {delay.p99_ms:g} ms + the tick"
    refused = target_ms < best.runtime_p99_ms
    warned = not refused and target_ms < estimate.runtime_p99_ms
    message = ""
    if refused:
        message = (
            f"limits.first_audio_p99_target_ms={target_ms:g} is below what {setup} can reach: the runtime's "
            f"first-audio p99 is at least {best.runtime_p99_ms:.1f} ms even with the tick at the GPU's peak "
            f"({terms}; the planner estimates {estimate.runtime_p99_ms:.1f} ms), so its alert would never "
            f"clear; allowed: >= {best.runtime_p99_ms:.1f} ms (duplex capacity shows the budget)"
        )
    elif warned:
        message = (
            f"limits.first_audio_p99_target_ms={target_ms:g} is below the capacity planner's estimate of the "
            f"runtime's first-audio p99 for {setup}: {estimate.runtime_p99_ms:.1f} ms ({terms}); expect "
            "FirstAudioLatencyHigh to fire unless the GPU beats the planning estimate"
        )
    return FirstAudioCheck(
        target_ms=target_ms,
        reachable_ms=best.runtime_p99_ms,
        estimate_ms=estimate.runtime_p99_ms,
        refused=refused,
        warned=warned,
        message=message,
    )
