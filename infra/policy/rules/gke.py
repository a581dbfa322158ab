"""The rules on GKE node pools and clusters: GPU node pools are tainted, and upgrade without an extra GPU."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from infra.names import GPU_TAINT, GPU_TAINT_KEY
from infra.policy.rules._common import (
    CLUSTER,
    NODE_POOL,
    UNKNOWN,
    _list,
    _normalize,
    _Unknown,
    is_unknown,
)
from infra.policy.rules._gpus import (
    _gpu_configs,
    _gpu_evidence,
)

# --------------------------------------------------------------------------------------------------------
# Rule 6: GPU node pools are tainted
# --------------------------------------------------------------------------------------------------------

GPU_TAINT_EFFECT = GPU_TAINT["effect"]


def gpu_node_pool_tainted(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A GKE node pool with GPUs (``nodeConfig.guestAccelerators`` non-empty, or a machine type whose GPU
    is built in) carries the taint ``nvidia.com/gpu`` with effect ``NO_SCHEDULE``, so that only pods that
    tolerate it (the runtime) land on the expensive nodes.

    Polices ``gcp:container/nodePool:NodePool`` and the node configs of ``gcp:container/cluster:Cluster``
    (default pool unless ``removeDefaultNodePool`` is true, inline ``nodePools``). Passes for what is
    unknown during preview: ``nodeConfig``, whether the pool has GPUs, ``taints``, and when no known taint
    matches but some taint's key or effect is unknown.
    """
    if resource_type not in (NODE_POOL, CLUSTER):
        return []
    p = _normalize(props)
    messages = []
    for prefix, config, default in _gpu_configs(resource_type, p):
        evidence = _gpu_evidence(config, default)
        if evidence is None or evidence is UNKNOWN:
            continue
        taints = _list(config.get("taints"))
        if isinstance(taints, _Unknown):
            continue
        undecided = False
        found = False
        for taint in taints:
            if not isinstance(taint, dict):
                undecided = undecided or taint is UNKNOWN
                continue
            key, effect = taint.get("key"), taint.get("effect")
            if is_unknown(key) or is_unknown(effect):
                undecided = True
            elif key == GPU_TAINT_KEY and isinstance(effect, str) and effect.upper() == GPU_TAINT_EFFECT:
                found = True
        if found or undecided:
            continue
        messages.append(
            f"GPU node pool ({prefix}{evidence}) has no {prefix}taints entry with key "
            f'"{GPU_TAINT_KEY}" and effect "{GPU_TAINT_EFFECT}". Add {json.dumps(GPU_TAINT)} to '
            f"{prefix}taints so only pods that tolerate it are scheduled on the GPU nodes."
        )
    return messages


# --------------------------------------------------------------------------------------------------------
# GPU node pools upgrade without an extra GPU
# --------------------------------------------------------------------------------------------------------

GKE_DEFAULT_MAX_SURGE = 1
"""GKE's ``maxSurge`` when ``upgradeSettings`` leaves it out (surge upgrades, one extra node)."""


def gpu_node_pool_upgrade_needs_no_extra_gpu(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A GKE node pool with GPUs (``gcp:container/nodePool:NodePool``) upgrades in place: strategy SURGE
    with ``maxSurge`` 0 and ``maxUnavailable`` at least 1. A surge node (GKE's default ``maxSurge`` 1) is
    one more GPU in the zone, and a BLUE_GREEN upgrade a whole second pool of them: GPUs such as the A100
    80 GB are scarce and quota is counted per GPU, so the upgrade stalls when the zone has none to spare
    (cloud.google.com/kubernetes-engine/docs/concepts/node-pool-upgrade-strategies). GKE refuses
    ``maxSurge`` and ``maxUnavailable`` both 0.

    Passes for what is unknown during preview: ``nodeConfig``, whether the pool has GPUs,
    ``upgradeSettings`` or its values.
    """
    if resource_type != NODE_POOL:
        return []
    p = _normalize(props)
    configs = _gpu_configs(resource_type, p)
    if not configs:
        return []
    _, config, default = configs[0]
    evidence = _gpu_evidence(config, default)
    if evidence is None or evidence is UNKNOWN:
        return []
    settings = p.get("upgradeSettings")
    if is_unknown(settings):
        return []
    settings = settings if isinstance(settings, dict) else {}
    strategy = settings.get("strategy") or "SURGE"
    surge, unavailable = settings.get("maxSurge"), settings.get("maxUnavailable")
    if any(is_unknown(v) for v in (strategy, surge, unavailable)):
        return []
    if strategy != "SURGE":
        return [
            f"GPU node pool ({evidence}) upgrades {strategy}: a second pool of GPUs during every upgrade. "
            'Set upgradeSettings = {"strategy": "SURGE", "maxSurge": 0, "maxUnavailable": 1}.'
        ]
    surge = GKE_DEFAULT_MAX_SURGE if surge is None else int(surge)
    unavailable = 0 if unavailable is None else int(unavailable)
    if surge > 0 or unavailable < 1:
        return [
            f"GPU node pool ({evidence}) upgrades with maxSurge {surge} and maxUnavailable {unavailable}: "
            + ("each surge node is one more GPU in the zone. " if surge > 0 else "GKE refuses both 0. ")
            + 'Set upgradeSettings = {"strategy": "SURGE", "maxSurge": 0, "maxUnavailable": 1}.'
        ]
    return []
