"""Capacity planner: VRAM, sessions, tick time, latency, bandwidth, power and cost from first principles.

Pure Python (no torch, no Pulumi). The stacks call::

    from infra.capacity import plan, check, max_sessions, require_feasible
    require_feasible("personaplex-7b", "l4", "int8", sessions=4)   # raises InfeasibleConfiguration
    slots = max_sessions("moshi-7b", "a100-80gb-sxm", "bf16")

Modules: ``units``, ``gpus``, ``gcp``, ``models``, ``memory``, ``timing``, ``latency``, ``network``,
``power``, ``plan``, ``seed_plan`` (the Scale-5 comparison), ``cli`` (the ``capacity`` command).
"""

from .plan import (
    CapacityPlan,
    InfeasibleConfiguration,
    Problem,
    Reason,
    Verdict,
    check,
    max_sessions,
    plan,
    require_feasible,
)

__all__ = [
    "CapacityPlan",
    "InfeasibleConfiguration",
    "Problem",
    "Reason",
    "Verdict",
    "check",
    "max_sessions",
    "plan",
    "require_feasible",
]
