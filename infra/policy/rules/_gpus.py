"""GPUs and machine types, as the capacity planner's GCP catalog (``infra.capacity.gcp``) knows them:
what makes a VM or a node config a GPU host, and whether its machine type can carry its GPUs."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from infra.capacity.gcp import (
    ACCELERATOR_TYPES,
    DEFAULT_MACHINE_TYPE,
    GPU_LABELS,
    MACHINE_TYPES,
    MachineType,
    carry_problem,
)
from infra.policy.rules._common import (
    CLUSTER,
    INSTANCE,
    INSTANCE_TEMPLATE,
    NODE_POOL,
    UNKNOWN,
    _list,
    _obj,
    _Unknown,
    is_unknown,
)

ACCELERATOR_GPUS: dict[str, str] = {name: gpu for gpu, name in ACCELERATOR_TYPES.items()}
"""GCP accelerator type names (``guestAccelerators[].type``) -> the planner's GPU keys
(``infra.capacity.gcp``). Accelerators absent here are not in the planner's catalog."""

BUILT_IN_GPU_SERIES: frozenset[str] = frozenset(
    {m.name.split("-", 1)[0] for m in MACHINE_TYPES.values() if m.bundled} | {"a4", "a4x", "g4"}
)
"""Machine series whose GPUs come with the type: A2, A3, G2 from the planner's catalog, plus A4/A4X (B200,
GB200) and G4 (RTX PRO 6000), which GCP sells the same way but the planner does not model yet."""

_GKE_DEFAULT_MACHINE_TYPE = "e2-medium"  # nodeConfig.machineType when unset (GKE API default)


def _machine_type_name(value: str) -> str:
    """``zones/us-central1-a/machineTypes/n1-standard-8`` -> ``n1-standard-8``."""
    return value.rsplit("/", 1)[-1].strip().lower()


def _has_built_in_gpu(machine_type: str) -> bool:
    return _machine_type_name(machine_type).split("-", 1)[0] in BUILT_IN_GPU_SERIES


def _catalog_entry(machine_type: str) -> MachineType | None:
    """The catalog type ``machine_type`` behaves like: itself, a sibling of the same class
    (``n1-standard-32`` -> an ``n1-standard-*`` entry, ``a2-highgpu-4g`` -> ``a2-highgpu-*``), any N1 type
    for other N1 classes (``n1-highmem-8``, ``n1-custom-8-30720``: every N1 type takes the same GPUs), or
    None when the catalog knows nothing about it."""
    if machine_type in MACHINE_TYPES:
        return MACHINE_TYPES[machine_type]
    parts = machine_type.split("-")
    cls = "-".join(parts[:2])
    for entry in MACHINE_TYPES.values():
        if "-".join(entry.name.split("-")[:2]) == cls:
            return entry
    if parts[0] == "n1":
        return next(m for m in MACHINE_TYPES.values() if m.family == "N1")
    return None


def _gpu_homes(gpu: str) -> str:
    homes = sorted({m.name.rsplit("-", 1)[0] + "-*" for m in MACHINE_TYPES.values() if m.gpu == gpu})
    return "N1 types (attached)" if gpu == "t4" else " / ".join(homes) + " types"


def _carry_problem(machine_type: str, gpu: str, count: int | None) -> str | None:
    """Why ``machine_type`` cannot carry ``count`` x ``gpu`` (planner keys), or None when it can."""
    label = GPU_LABELS.get(gpu, gpu)
    fix = f'use machineType "{DEFAULT_MACHINE_TYPE[gpu]}"' if gpu in DEFAULT_MACHINE_TYPE else ""
    entry = _catalog_entry(machine_type)
    if entry is None:
        if _has_built_in_gpu(machine_type):
            return (
                f"{machine_type} is not in the capacity planner's GCP catalog (infra/capacity/gcp.py) and "
                f"its GPU comes with the type: drop guestAccelerators, or add the type to the catalog"
            )
        return f"{machine_type} cannot carry {gpu}: on GCP {label} comes only with {_gpu_homes(gpu)}; {fix}"
    problem = carry_problem(entry.name, gpu)
    if problem is not None:
        # The planner's message names the catalog entry; name the type the resource asked for instead.
        if problem.startswith(entry.name):
            problem = machine_type + problem[len(entry.name) :]
        return f"{problem}; {fix}" if fix else problem
    if count is None:
        return None
    if entry.bundled:
        expected: tuple[int, ...] = entry.gpu_count
        if entry.name != machine_type:
            match = re.search(r"-(\d+)g$", machine_type)
            expected = (int(match.group(1)),) if match else ()
        if expected and count not in expected:
            return (
                f"{machine_type} comes with {expected[0]} x {label} built in, not {count}: set the count "
                f"to {expected[0]} or drop guestAccelerators (the type brings its GPUs)"
            )
        return None
    if count not in entry.gpu_count:
        counts = [str(n) for n in entry.gpu_count]
        allowed = counts[0] if len(counts) == 1 else ", ".join(counts[:-1]) + " or " + counts[-1]
        return f"{machine_type} ({entry.family}) takes {allowed} {label} GPUs, not {count}; change the count"
    return None


def _accelerators(config: Mapping[str, Any]) -> list[Any] | _Unknown:
    """``guestAccelerators`` entries that attach a GPU (count unknown or > 0), or UNKNOWN."""
    accels = _list(config.get("guestAccelerators"))
    if isinstance(accels, _Unknown):
        return UNKNOWN
    attached: list[Any] = []
    for acc in accels:
        if isinstance(acc, _Unknown):
            attached.append(acc)
            continue
        if not isinstance(acc, dict):
            continue
        count = acc.get("count")
        if isinstance(count, int | float) and not isinstance(count, bool) and count <= 0:
            continue
        attached.append(acc)
    return attached


def _gpu_evidence(
    config: Mapping[str, Any], machine_type_default: str | None = None
) -> str | None | _Unknown:
    """What makes ``config`` (an instance's inputs or a ``nodeConfig``) a GPU host: a short description,
    None when it is not one, UNKNOWN when that cannot be told during preview."""
    accels = _accelerators(config)
    machine_type = config.get("machineType") or machine_type_default
    if isinstance(accels, list) and accels:
        names = []
        for acc in accels:
            kind = acc.get("type") if isinstance(acc, dict) else UNKNOWN
            names.append("an unknown accelerator" if is_unknown(kind) else _machine_type_name(str(kind)))
        return "guestAccelerators " + ", ".join(names)
    if isinstance(machine_type, str) and not is_unknown(machine_type) and _has_built_in_gpu(machine_type):
        return f"machineType {_machine_type_name(machine_type)}, whose GPU is built in"
    if isinstance(accels, _Unknown) or is_unknown(machine_type):
        return UNKNOWN
    return None


def _gpu_configs(resource_type: str, p: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], str | None]]:
    """(property path prefix, config, default machine type) for each place a resource declares a host."""
    if resource_type in (INSTANCE, INSTANCE_TEMPLATE):
        return [("", p, None)]
    configs: list[tuple[str, Mapping[str, Any], str | None]] = []
    if resource_type == NODE_POOL:
        node_config = _obj(p.get("nodeConfig"))
        if isinstance(node_config, dict):
            configs.append(("nodeConfig.", node_config, _GKE_DEFAULT_MACHINE_TYPE))
    elif resource_type == CLUSTER:
        removed = p.get("removeDefaultNodePool")
        node_config = _obj(p.get("nodeConfig"))
        # The default pool's config is judged unless the cluster removes that pool (or may: unknown).
        if (removed is False or removed is None) and isinstance(node_config, dict):
            configs.append(("nodeConfig.", node_config, _GKE_DEFAULT_MACHINE_TYPE))
        pools = _list(p.get("nodePools"))
        if isinstance(pools, list):
            for i, pool in enumerate(pools):
                pool_config = _obj(pool.get("nodeConfig")) if isinstance(pool, dict) else None
                if isinstance(pool_config, dict):
                    configs.append((f"nodePools[{i}].nodeConfig.", pool_config, _GKE_DEFAULT_MACHINE_TYPE))
    return configs
