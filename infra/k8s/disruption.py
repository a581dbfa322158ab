"""How the runtime's pods are replaced and removed without cutting calls (issue 33, "Calls survive deploys
and scale-in"): the Deployment's rollout strategy and how long one step of it may take; the RBAC and
environment with which each runtime pod keeps its ``pod-deletion-cost`` at its live sessions.
docs/deploying.md, "Rollouts and scale-in".
"""

from __future__ import annotations

import copy
from typing import Any

from infra.deploy_timeouts import ROLLOUT_MARGIN_S
from infra.k8s.base import APP_NAME, RUNTIME_SERVICE_ACCOUNT, RegionWorkload, object_meta

__all__ = [
    "DELETION_COST_ROLE",
    "ROLLOUT_STRATEGY",
    "deletion_cost_env",
    "deletion_cost_rbac",
    "rollout_step_s",
    "rollout_strategy",
    "with_deletion_cost",
]

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


DELETION_COST_ROLE = "duplex-runtime-deletion-cost"
"""The Role (and RoleBinding) that lets the runtime pods patch pods of their namespace: the runtime keeps
its own pod's ``controller.kubernetes.io/pod-deletion-cost`` at its live sessions
(``runtime/fleet/deletion_cost.py``), so that a scale-in removes the idlest pod."""


def deletion_cost_rbac(workload: RegionWorkload) -> list[dict[str, Any]]:
    """Role ``DELETION_COST_ROLE``: ``patch`` on ``pods`` (core group) in the workload's namespace, nothing
    else (no ``get``, ``list``, ``watch``, no other kind); RoleBinding of it to the runtime's ServiceAccount.

    RBAC cannot name the pod (``resourceNames`` are fixed, pod names are not), so a runtime pod may patch
    any pod of its namespace (the runtime's, coturn's, nginx's), labels included; a ValidatingAdmissionPolicy
    limiting the patch to the caller's own pod (the token's ``authentication.kubernetes.io/pod-name``) and
    to this one annotation is the further fence, not built here (docs/deploying.md, "Rollouts and
    scale-in")."""
    rbac = "rbac.authorization.k8s.io"
    return [
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "Role",
            "metadata": object_meta(workload, DELETION_COST_ROLE, "runtime", app=APP_NAME),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}],
        },
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "RoleBinding",
            "metadata": object_meta(workload, DELETION_COST_ROLE, "runtime", app=APP_NAME),
            "roleRef": {"apiGroup": rbac, "kind": "Role", "name": DELETION_COST_ROLE},
            "subjects": [
                {"kind": "ServiceAccount", "name": RUNTIME_SERVICE_ACCOUNT, "namespace": workload.namespace}
            ],
        },
    ]


def deletion_cost_env() -> list[dict[str, Any]]:
    """The runtime container's environment for the deletion cost: ``DUPLEX_POD_DELETION_COST=true``,
    ``DUPLEX_POD_NAME`` and ``DUPLEX_POD_NAMESPACE`` from the downward API (``metadata.name``,
    ``metadata.namespace``). The token and the cluster's CA are the pod's default projected
    service-account volume (the runtime's ServiceAccount keeps ``automountServiceAccountToken``)."""
    return [
        {"name": "DUPLEX_POD_DELETION_COST", "value": "true"},
        {"name": "DUPLEX_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "DUPLEX_POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]


def with_deletion_cost(deployment: dict[str, Any]) -> dict[str, Any]:
    """``deployment`` (the runtime's, ``infra.k8s.workload.runtime_deployment``) with ``deletion_cost_env``
    appended to its ``runtime`` container; returned for chaining.

    Raises:
        ValueError: the Deployment has no container named ``runtime``.
    """
    containers = deployment["spec"]["template"]["spec"]["containers"]
    runtime = [c for c in containers if c.get("name") == "runtime"]
    if len(runtime) != 1:
        raise ValueError(f"with_deletion_cost: one container named 'runtime' needed, got {len(runtime)}")
    runtime[0].setdefault("env", []).extend(deletion_cost_env())
    return deployment
