"""How the runtime's pods are replaced and removed without cutting calls (issue 33, "Calls survive deploys
and scale-in"): the Deployment's rollout strategy and how long one step of it may take.
docs/deploying.md, "Rollouts and scale-in".
"""

from __future__ import annotations

import copy
from typing import Any

from infra.deploy_timeouts import ROLLOUT_MARGIN_S

__all__ = ["ROLLOUT_STRATEGY", "rollout_step_s", "rollout_strategy"]

ROLLOUT_STRATEGY: dict[str, Any] = {
    "type": "RollingUpdate",
    "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
}
"""The runtime Deployment's update strategy: replace one pod at a time, never run one beyond the replicas.

With ``maxSurge`` 1 (the strategy before issue 33) a rollout needs a GPU beyond the replicas: at the HPA's
maximum, which is the GPU pool's ``maxNodes`` (``RegionWorkload.max_replicas``), the surge pod never gets a
node and the rollout fails at its deadline. ``maxSurge`` 0 / ``maxUnavailable`` 1 needs none: the
Deployment controller scales the old ReplicaSet down by one (that pod drains: preStop, up to
``terminationGracePeriodSeconds``) and the new one up by one. The replacement takes a GPU the pool has:
below ``maxNodes`` the cluster autoscaler adds a node for it (within ``maxNodes``), at ``maxNodes`` it waits,
Pending, for the draining pod's GPU. The Deployment controller counts a terminating pod neither as
available nor as a replica (kubernetes.io/docs/concepts/workloads/controllers/deployment, "Max
Unavailable"), so the next step starts once the replacement is ready.

What dips: the region admits on one pod fewer during each step (the draining pod takes no new caller, its
replacement loads): ``slots`` fewer free slots for up to ``rollout_step_s``; the calls on the draining pod
run to their end (at most the longest session). The alternative, pool max + 1 with the quota for it, keeps
capacity whole but holds one more GPU (an A100 80 GB) of regional quota for a pod that runs only during
rollouts, and at the HPA's maximum still waits on stock; GKE's upgrades of the GPU pool make the same choice
(``infra.components.gke_parts``: ``maxSurge`` 0, ``maxUnavailable`` 1)."""


def rollout_strategy() -> dict[str, Any]:
    """A fresh copy of ``ROLLOUT_STRATEGY`` for a manifest (the renderers' dicts are mutated downstream)."""
    return copy.deepcopy(ROLLOUT_STRATEGY)


def rollout_step_s(termination_grace_s: int, startup_budget_s: int) -> int:
    """The longest one step of a runtime rollout may take, s: the old pod's drain (``termination_grace_s``,
    3660 s for a 1 h longest session: at ``maxNodes`` the replacement waits for that GPU) + a node and the
    image pull (``ROLLOUT_MARGIN_S`` of ``infra.deploy_timeouts``, 900 s) + the weights wait and model load
    (``startup_budget_s``, 1800 s): 6360 s by default. The Deployment's ``progressDeadlineSeconds``: a step
    without progress for that long is stuck, not slow (with ``maxSurge`` 1 the deadline needed no drain,
    since the surge pod started at once).

    Raises:
        ValueError: a negative duration.
    """
    if termination_grace_s < 0 or startup_budget_s < 0:
        raise ValueError(
            f"termination_grace_s and startup_budget_s must be >= 0 s, got {termination_grace_s}, "
            f"{startup_budget_s}"
        )
    return termination_grace_s + ROLLOUT_MARGIN_S + startup_budget_s
