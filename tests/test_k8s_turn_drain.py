"""coturn off the GPU pool, drained on removal (issue 33): a Deployment on the system pool with a
PodDisruptionBudget, kept by the cluster autoscaler, with a preStop hook that puts coturn in drain mode and
waits for it to exit (tried here against a stand-in coturn process), a grace of the longest call, and relay
ports for the whole region."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from k8s_fixtures import make_workload, one

from infra.k8s.manifest import validate_manifests
from infra.k8s.region import region_objects
from infra.k8s.turn import TURN_CONFIG_SECRET, TURN_NAME, turn_drain_command, turn_grace_s, turn_replicas
from infra.node.profile.relay import relay_quota

TURN_SECRET = "TurnSecretForTheRegions0123456789abcdefghij"
POD_RANGES = ("10.4.0.0/14",)


def _objects(**kw: object) -> list[dict]:
    return region_objects(make_workload(turn_secret=TURN_SECRET, turn_peer_ranges=POD_RANGES, **kw))


def test_coturn_is_a_deployment_on_the_system_pool_with_a_budget() -> None:
    workload = make_workload(
        turn_secret=TURN_SECRET,
        turn_peer_ranges=POD_RANGES,
        zones=("us-central1-a", "us-central1-b"),
        min_replicas=2,
    )
    objects = region_objects(workload)
    assert validate_manifests(objects) == []
    assert not [o for o in objects if o["kind"] == "DaemonSet"]  # a node drain skips DaemonSet pods
    coturn = one(objects, "Deployment", TURN_NAME)
    spec = coturn["spec"]
    assert spec["replicas"] == turn_replicas(workload) == 2
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod = spec["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-nodepool": "system"}
    assert "nvidia.com/gpu" not in str(pod)
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    assert spec["template"]["metadata"]["annotations"] == {
        "cluster-autoscaler.kubernetes.io/safe-to-evict": "false"
    }
    budget = one(objects, "PodDisruptionBudget", TURN_NAME)
    assert budget["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": spec["selector"]["matchLabels"]},
    }
    # The load balancer still reaches it: the Service selects the same pods.
    assert one(objects, "Service", TURN_NAME)["spec"]["selector"] == spec["selector"]["matchLabels"]


def test_the_grace_outlasts_the_longest_call_and_the_hook_drains() -> None:
    workload = make_workload(turn_secret=TURN_SECRET, turn_peer_ranges=POD_RANGES)
    pod = one(region_objects(workload), "Deployment", TURN_NAME)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == turn_grace_s(workload) == 3600 + 60
    [coturn] = pod["containers"]
    command = coturn["lifecycle"]["preStop"]["exec"]["command"]
    assert (
        command[:2] == ["/bin/sh", "-c"]
        and "kill -USR1" in command[2]
        and "/tmp/turnserver.pid" in command[2]
    )


def test_each_coturn_holds_the_regions_relay_quota() -> None:
    workload = make_workload(turn_secret=TURN_SECRET, turn_peer_ranges=POD_RANGES, max_replicas=4)
    conf = one(region_objects(workload), "Secret", TURN_CONFIG_SECRET)["stringData"]["turnserver.conf"]
    total = relay_quota(workload.max_replicas * workload.slots)[1]
    assert f"total-quota={total}" in conf.splitlines()
    assert total > relay_quota(workload.slots)[1]  # a GPU node's coturn held one pod's


FAKE_COTURN = """
import signal, sys, time, pathlib
state = pathlib.Path(sys.argv[1])
pathlib.Path(sys.argv[2]).write_text(str(__import__("os").getpid()))
def drain(signum, frame):
    (state / "draining").write_text("1")
signal.signal(signal.SIGUSR1, drain)
(state / "started").write_text("1")
while True:  # coturn's drain mode: exit once no allocation is left
    allocations = int((state / "allocations").read_text())
    if (state / "draining").exists() and allocations == 0:
        sys.exit(0)
    time.sleep(0.02)
"""


def _wait_for(path: Path) -> None:
    for _ in range(1000):
        if path.exists():
            return
        time.sleep(0.01)
    raise AssertionError(f"{path} never appeared")


def test_the_prestop_hook_waits_for_the_last_allocation() -> None:
    """The hook against a stand-in coturn that, like coturn's drain mode, exits once its allocation count
    is 0: the hook is still waiting while one allocation is left, and ends once coturn is gone."""
    state = Path(tempfile.mkdtemp(prefix="coturn-drain-"))
    pid_file = state / "turnserver.pid"
    (state / "allocations").write_text("2")
    fake = subprocess.Popen([sys.executable, "-c", FAKE_COTURN, str(state), str(pid_file)])
    try:
        _wait_for(state / "started")
        hook = subprocess.Popen(turn_drain_command(str(pid_file), poll_s=1))
        _wait_for(state / "draining")  # SIGUSR1 reached coturn
        (state / "allocations").write_text("1")
        assert hook.poll() is None and fake.poll() is None  # a call is still relayed: still waiting
        (state / "allocations").write_text("0")
        assert fake.wait(timeout=30) == 0
        assert hook.wait(timeout=30) == 0
    finally:
        for process in (fake,):
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)


def test_a_bad_hook_is_refused() -> None:
    with pytest.raises(ValueError, match="poll_s must be >= 1"):
        turn_drain_command("/tmp/turnserver.pid", poll_s=0)
    with pytest.raises(ValueError, match="an absolute path"):
        turn_drain_command("/tmp/$(reboot).pid")
