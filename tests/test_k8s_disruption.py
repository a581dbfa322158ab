"""Calls survive the fleet's own operations (issue 33): the runtime's rollout never needs a GPU beyond the
pool's maximum, its deadlines follow from the drain, and the deploy's wait outlasts one step."""

from __future__ import annotations

import pytest
from k8s_fixtures import make_workload, one

from infra import deploy_timeouts
from infra.k8s import workload as k8s_workload
from infra.k8s.disruption import ROLLOUT_STRATEGY, rollout_step_s
from infra.k8s.region import region_objects


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
