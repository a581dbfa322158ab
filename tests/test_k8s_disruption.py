"""Calls survive the fleet's own operations (issue 33): the runtime's rollout never needs a GPU beyond the
pool's maximum, its deadlines follow from the drain, the deploy's wait outlasts one step, and each runtime
pod may keep its own pod-deletion-cost (RBAC ``patch`` on pods, the downward API)."""

from __future__ import annotations

import pytest
from k8s_fixtures import make_workload, one

from infra import deploy_timeouts
from infra.k8s import workload as k8s_workload
from infra.k8s.disruption import DELETION_COST_ROLE, ROLLOUT_STRATEGY, rollout_step_s, with_deletion_cost
from infra.k8s.region import region_objects
from runtime.config import RuntimeConfig


def _gpus_at_peak(strategy: dict, replicas: int) -> int:
    """The most pods (one GPU each) the Deployment controller runs at once while rolling ``replicas`` pods:
    ``replicas`` + ``maxSurge`` (kubernetes.io/docs/concepts/workloads/controllers/deployment, "Max
    Surge"); a terminating pod keeps its GPU until it is gone, which ``maxUnavailable`` does not bound."""
    return replicas + int(strategy["rollingUpdate"]["maxSurge"])


def test_a_rollout_at_the_pools_maximum_needs_no_extra_gpu() -> None:
    workload = make_workload(min_replicas=2, max_replicas=4)
    deployment = one(region_objects(workload), "Deployment")
    strategy = deployment["spec"]["strategy"]
    # The HPA's maximum is the GPU pool's maxNodes: at peak every GPU of the pool holds a pod.
    assert _gpus_at_peak(strategy, workload.max_replicas) <= workload.max_replicas, strategy
    assert (
        strategy
        == ROLLOUT_STRATEGY
        == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
        }
    )


def test_a_step_may_last_the_old_pods_drain_plus_the_new_pods_start() -> None:
    workload = make_workload()
    deployment = one(region_objects(workload), "Deployment")
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    deadline = deployment["spec"]["progressDeadlineSeconds"]
    # At maxNodes the replacement is Pending for the old pod's whole drain, then loads: the old deadline
    # (startup budget + 1800 s = 3600 s) called a step stuck while the old pod still drained (3660 s).
    assert deadline >= grace + k8s_workload.startup_budget_s()
    assert deadline == rollout_step_s(grace, k8s_workload.startup_budget_s()) == 3660 + 900 + 1800


def test_pulumis_wait_outlasts_one_rollout_step() -> None:
    step = rollout_step_s(
        k8s_workload.termination_grace_s(make_workload().profile), k8s_workload.startup_budget_s()
    )
    assert step <= deploy_timeouts.PULUMI_RESOURCE_TIMEOUT_S
    assert deploy_timeouts.CI_DEPLOY_JOB_TIMEOUT_MIN * 60 > deploy_timeouts.PULUMI_RESOURCE_TIMEOUT_S


def test_a_negative_duration_is_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 0 s"):
        rollout_step_s(-1, 1800)


def test_each_runtime_pod_may_patch_pods_of_its_namespace_and_nothing_else() -> None:
    objects = region_objects(make_workload())
    role = one(objects, "Role", DELETION_COST_ROLE)
    assert role["metadata"]["namespace"] == "duplex"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]
    binding = one(objects, "RoleBinding", DELETION_COST_ROLE)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": DELETION_COST_ROLE,
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "duplex-runtime", "namespace": "duplex"}
    ]
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "duplex-runtime"
    assert pod.get("automountServiceAccountToken", True)  # the token the runtime patches with


def test_the_runtime_is_told_to_keep_its_deletion_cost_with_its_own_pod(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    [runtime] = one(region_objects(make_workload()), "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in runtime["env"]}
    assert env["DUPLEX_POD_DELETION_COST"]["value"] == "true"
    assert env["DUPLEX_POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["DUPLEX_POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    monkeypatch.setenv("DUPLEX_POD_DELETION_COST", "true")
    monkeypatch.setenv("DUPLEX_POD_NAME", "duplex-runtime-7d9f-abcde")
    monkeypatch.setenv("DUPLEX_POD_NAMESPACE", "duplex")
    config = RuntimeConfig()
    assert (config.pod_deletion_cost, config.pod_name, config.pod_namespace) == (
        True,
        "duplex-runtime-7d9f-abcde",
        "duplex",
    )


def test_with_deletion_cost_needs_the_runtime_container() -> None:
    with pytest.raises(ValueError, match="one container named 'runtime'"):
        with_deletion_cost({"spec": {"template": {"spec": {"containers": [{"name": "nginx"}]}}}})
