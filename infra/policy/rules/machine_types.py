"""The rule that attached GPUs are ones the machine type can carry (instances, templates, GKE node
pools and clusters)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra.policy.rules._common import (
    CLUSTER,
    INSTANCE,
    INSTANCE_TEMPLATE,
    NODE_POOL,
    _normalize,
    _q,
    _Unknown,
    is_unknown,
)
from infra.policy.rules._gpus import (
    ACCELERATOR_GPUS,
    _accelerators,
    _carry_problem,
    _gpu_configs,
    _machine_type_name,
)

# --------------------------------------------------------------------------------------------------------
# Rule 4: machine types carry their GPUs
# --------------------------------------------------------------------------------------------------------


def machine_type_carries_gpu(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """Every attached accelerator (``guestAccelerators[].type``) is one the machine type can carry,
    according to the capacity planner's GCP catalog (``infra.capacity.gcp``): T4 only on N1 types (1, 2
    or 4), and on A2/A3/G2 types only the GPU the type brings, in the count the type fixes
    (``nvidia-tesla-a100`` on ``n1-standard-8`` and ``nvidia-tesla-t4`` on an ``a2-*`` type are refused).
    An accelerator the catalog does not know (V100, P4, the ``-vws`` variants, ...) is refused too: the
    planner cannot size a node for it.

    Polices instances and instance templates (top-level ``machineType``/``guestAccelerators``), node pools
    (``nodeConfig``) and clusters (``nodeConfig`` of the default pool unless ``removeDefaultNodePool`` is
    true, and each inline ``nodePools[].nodeConfig``). A node config without ``machineType`` is GKE's
    ``e2-medium``. Passes for what is unknown during preview: ``guestAccelerators``, ``machineType``, an
    accelerator's ``type`` (its ``count``, when unknown, is not checked), ``removeDefaultNodePool``.
    """
    if resource_type not in (INSTANCE, INSTANCE_TEMPLATE, NODE_POOL, CLUSTER):
        return []
    p = _normalize(props)
    messages = []
    for prefix, config, default in _gpu_configs(resource_type, p):
        accels = _accelerators(config)
        if isinstance(accels, _Unknown) or not accels:
            continue
        machine_type = config.get("machineType") or default
        if is_unknown(machine_type):
            continue
        for i, acc in enumerate(accels):
            if not isinstance(acc, dict):
                continue
            where = f"{prefix}guestAccelerators[{i}]"
            kind = acc.get("type")
            if is_unknown(kind):
                continue
            if machine_type is None:
                messages.append(f"{where} attaches {_q(kind)} but {prefix}machineType is not set; set it.")
                continue
            accelerator = _machine_type_name(str(kind))
            gpu = ACCELERATOR_GPUS.get(accelerator)
            if gpu is None:
                known = ", ".join(sorted(ACCELERATOR_GPUS))
                messages.append(
                    f"{where}.type {_q(kind)} is not in the capacity planner's GCP catalog "
                    f"(infra/capacity/gcp.py knows {known}); use one of those or add it to the catalog."
                )
                continue
            raw_count = acc.get("count")
            count = (
                int(raw_count)
                if isinstance(raw_count, int | float) and not isinstance(raw_count, bool)
                else None
            )
            problem = _carry_problem(_machine_type_name(str(machine_type)), gpu, count)
            if problem is not None:
                messages.append(
                    f"{prefix}machineType {_q(machine_type)} cannot carry {where} "
                    f"({count if count is not None else '?'} x {accelerator}): {problem}."
                )
    return messages
