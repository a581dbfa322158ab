"""The rule on GKE node pools and clusters: GPU node pools are tainted."""

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
