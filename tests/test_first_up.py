"""What a first real ``pulumi up`` would hit and mocks accept (issue "every stack survives its first real
``pulumi up``"): each rule of GCP/GKE the stacks depend on, checked over the mocked programs and through
the policy pack, with a failing case for each."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from pulumi_harness import RecordedResource, StackRun, run_stack

from infra.capacity import gcp as gcp_catalog
from infra.node.compose import node_stop_timeout_s
from infra.node.profile import get_profile
from infra.policy.rules import (
    BACKEND_SERVICE,
    INSTANCE,
    StackResource,
    apis_enabled_for_features,
    check_resources,
    gpu_instance_graceful_shutdown,
    provisioning_model_sold,
    session_affinity_needs_hash_policy,
)
from infra.stack_config import StackConfigError
from infra.stack_config.keys import NODE_DRAIN_GRACE_S

SERVICE = "gcp:projects/service:Service"
NODE_POOL = "gcp:container/nodePool:NodePool"
CLUSTER = "gcp:container/cluster:Cluster"


@pytest.fixture(scope="module")
def multi_region() -> StackRun:
    return run_stack("multi-region")


@pytest.fixture(scope="module")
def scale5() -> StackRun:
    return run_stack("scale5-gcp")


def _policy_inputs(run: StackRun) -> list[tuple[str, dict, str, tuple[str, ...]]]:
    return [(r.type, r.plain, r.name, r.dependencies) for r in run.resources if r.custom]


# --- 1. every API a feature needs is enabled, and resources wait for it ------------------------------------


def test_image_streaming_pool_has_its_api_and_waits_for_it(multi_region: StackRun) -> None:
    services = {r.plain["service"]: r for r in multi_region.of_type(SERVICE)}
    assert "containerfilesystem.googleapis.com" in services
    streaming = [p for p in multi_region.of_type(NODE_POOL) if p.plain["nodeConfig"].get("gcfsConfig")]
    assert streaming, "the GPU pools turn image streaming on"
    api_urn = services["containerfilesystem.googleapis.com"].urn
    for pool in streaming:
        assert api_urn in pool.dependencies, pool.name
    assert check_resources(_policy_inputs(multi_region)) == []


@pytest.mark.parametrize("stack", ["multi-region", "scale5-gcp", "dev"])
def test_the_pack_fails_a_stack_that_forgets_an_api(stack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Today's program without the API the feature needs fails the pack with a message naming it."""
    from infra.program import gce, multi_region

    if stack == "multi-region":
        dropped = "containerfilesystem.googleapis.com"
        monkeypatch.setattr(multi_region, "GKE_APIS", tuple(a for a in multi_region.GKE_APIS if a != dropped))
    else:
        dropped = "secretmanager.googleapis.com"
        monkeypatch.setattr(gce, "GCP_APIS", tuple(a for a in gce.GCP_APIS if a != dropped))
    violations = check_resources(_policy_inputs(run_stack(stack)))
    assert violations and all(v.startswith("[apis-enabled-for-features]") for v in violations)
    assert all(dropped in v for v in violations)


def test_api_rule_cases() -> None:
    streaming_pool = {"nodeConfig": {"gcfsConfig": {"enabled": True}}}
    container = StackResource(SERVICE, {"service": "container.googleapis.com"}, "api-container")
    gcfs_api = "api-containerfilesystem"
    gcfs = StackResource(SERVICE, {"service": "containerfilesystem.googleapis.com"}, gcfs_api)
    pool_waits = StackResource(NODE_POOL, streaming_pool, "pool", ("api-container", gcfs_api))
    assert apis_enabled_for_features([container, gcfs, pool_waits]) == []
    [missing] = apis_enabled_for_features([container, pool_waits])
    assert "containerfilesystem.googleapis.com" in missing and "image streaming" in missing
    pool_early = StackResource(NODE_POOL, streaming_pool, "pool", ("api-container",))
    [early] = apis_enabled_for_features([container, gcfs, pool_early])
    assert "does not depend on its enablement" in early
    # Without the feature the extra API is not needed; without any Service the stack manages none.
    plain_pool = StackResource(NODE_POOL, {"nodeConfig": {}}, "pool", ("api-container",))
    assert apis_enabled_for_features([container, plain_pool]) == []
    assert apis_enabled_for_features([pool_early]) == []


# --- 2. the Kubernetes provider authenticates as the GCP provider does ------------------------------------


def test_kubeconfig_uses_application_default_credentials(multi_region: StackRun) -> None:
    providers = multi_region.of_type("pulumi:providers:kubernetes")
    assert len(providers) == 2
    for provider in providers:
        config = json.loads(provider.plain["kubeconfig"])
        [user] = config["users"]
        assert user["user"]["exec"]["command"] == "gke-gcloud-auth-plugin"
        assert user["user"]["exec"]["args"] == ["--use_application_default_credentials"]


# --- 4. a refresh does not replace the A100 VM -------------------------------------------------------------

FORCE_NEW_INSTANCE_INPUTS = frozenset({"scratchDisks", "name", "zone", "bootDisk", "guestAccelerators"})
"""Instance inputs the provider replaces the VM for (terraform-provider-google resource_compute_instance:
``scratch_disk``, ``name``, ``zone``, ``boot_disk`` are ForceNew; guest accelerators too when changed)."""


def _planned_replacement(resource: RecordedResource, refreshed: dict[str, Any]) -> set[str]:
    """The inputs for which ``pulumi up`` after a refresh would replace ``resource``: top-level inputs whose
    value differs between the program and the refreshed state, minus ``ignore_changes``, that are ForceNew
    or named by ``replace_on_changes`` (the engine's diff, reduced to what decides a replacement)."""
    program = resource.plain
    changed = {key for key in set(program) | set(refreshed) if program.get(key) != refreshed.get(key)}
    changed -= set(resource.ignore_changes)
    replace_keys = {path.split("[")[0] for path in resource.replace_on_changes}
    return {key for key in changed if key in FORCE_NEW_INSTANCE_INPUTS | replace_keys}


def test_a_refresh_with_gces_bundled_local_ssd_does_not_replace_the_vm(scale5: StackRun) -> None:
    [vm] = scale5.of_type(INSTANCE)
    assert gcp_catalog.MACHINE_TYPES[vm.plain["machineType"]].bundled_local_ssd
    refreshed = copy.deepcopy(vm.plain)
    refreshed["scratchDisks"] = [{"interface": "NVME", "size": 375, "deviceName": "local-ssd-0"}]
    assert _planned_replacement(vm, refreshed) == set()
    # The same state without the ignore is the replacement of every `up` the issue describes.
    unguarded = copy.copy(vm)
    unguarded.ignore_changes = ()
    assert _planned_replacement(unguarded, refreshed) == {"scratchDisks"}
    # A real change of the user-data still replaces it (cloud-init runs once per VM).
    changed = copy.deepcopy(vm.plain)
    changed["metadata"]["user-data"] += "\n# changed"
    assert _planned_replacement(vm, changed) == {"metadata"}


# --- 6. graceful shutdown covers the node's drain ---------------------------------------------------------


@pytest.mark.parametrize(("stack", "profile"), [("dev", "t4-int8"), ("scale5-gcp", "a100-80gb")])
def test_graceful_shutdown_covers_the_nodes_stop(stack: str, profile: str) -> None:
    run = run_stack(stack)
    [vm] = run.of_type(INSTANCE)
    graceful = vm.plain["scheduling"]["gracefulShutdown"]
    limits = {**get_profile(profile).limits.model_dump(), "drain_grace_s": NODE_DRAIN_GRACE_S}  # the stacks'
    needed = node_stop_timeout_s(get_profile(profile, limits=limits))
    assert graceful["enabled"] is True and graceful["maxDuration"]["seconds"] == needed
    assert vm.plain["metadata"][gcp_catalog.STOP_TIMEOUT_METADATA_KEY] == str(needed)


def test_graceful_shutdown_rule_and_limit() -> None:
    base = {
        "machineType": "a2-ultragpu-1g",
        "metadata": {gcp_catalog.STOP_TIMEOUT_METADATA_KEY: "160"},
        "scheduling": {"onHostMaintenance": "TERMINATE"},
    }
    [off] = gpu_instance_graceful_shutdown(INSTANCE, base)
    assert "not enabled" in off
    short = copy.deepcopy(base)
    short["scheduling"]["gracefulShutdown"] = {"enabled": True, "maxDuration": {"seconds": 30}}
    [too_short] = gpu_instance_graceful_shutdown(INSTANCE, short)
    assert "30 s, less than the 160 s" in too_short
    short["scheduling"]["gracefulShutdown"]["maxDuration"]["seconds"] = 160
    assert gpu_instance_graceful_shutdown(INSTANCE, short) == []
    cpu_vm = {"machineType": "e2-standard-4", "scheduling": {}}
    assert gpu_instance_graceful_shutdown(INSTANCE, cpu_vm) == []

    from infra.components.gce_node import graceful_shutdown_s

    slow = get_profile("a100-80gb", limits={"drain_grace_s": 3600})
    with pytest.raises(ValueError, match="at most 3600 s"):
        graceful_shutdown_s(slow)


# --- 7. no silent session affinity ----------------------------------------------------------------------


def test_affinity_rule() -> None:
    assert (
        session_affinity_needs_hash_policy(
            BACKEND_SERVICE, {"sessionAffinity": "CLIENT_IP", "localityLbPolicy": "RING_HASH"}
        )
        == []
    )
    [message] = session_affinity_needs_hash_policy(
        BACKEND_SERVICE, {"sessionAffinity": "CLIENT_IP", "localityLbPolicy": "LEAST_REQUEST"}
    )
    assert "has no effect" in message and "RING_HASH" in message
    assert session_affinity_needs_hash_policy(BACKEND_SERVICE, {"sessionAffinity": "CLIENT_IP"})
    assert session_affinity_needs_hash_policy(BACKEND_SERVICE, {"localityLbPolicy": "LEAST_REQUEST"}) == []


def test_global_backend_claims_no_affinity_it_cannot_have(multi_region: StackRun) -> None:
    [backend] = multi_region.of_type(BACKEND_SERVICE)
    assert session_affinity_needs_hash_policy(BACKEND_SERVICE, backend.plain) == []
    broken = {**backend.plain, "sessionAffinity": "CLIENT_IP"}
    assert session_affinity_needs_hash_policy(BACKEND_SERVICE, broken)


# --- 9. provisioning models GCE sells -------------------------------------------------------------------


def test_catalog_knows_what_is_sold_how() -> None:
    assert gcp_catalog.provisioning_problem("a3-highgpu-1g", "standard") == (
        "a3-highgpu-1g is sold only as spot or flex-start, not standard"
    )
    assert gcp_catalog.provisioning_problem("a3-highgpu-1g", "flex-start") is None
    assert gcp_catalog.provisioning_problem("n1-standard-8", "spot") is None
    with pytest.raises(ValueError, match="allowed values: flex-start, spot, standard"):
        gcp_catalog.provisioning_problem("n1-standard-8", "preemptible")


def test_provisioning_rule() -> None:
    h100 = {"machineType": "a3-highgpu-1g", "scheduling": {"onHostMaintenance": "TERMINATE"}}
    [standard] = provisioning_model_sold(INSTANCE, h100)
    assert "sold only as SPOT or FLEX_START" in standard
    spot = {
        "machineType": "a3-highgpu-1g",
        "scheduling": {"provisioningModel": "SPOT", "preemptible": True, "automaticRestart": False},
    }
    assert provisioning_model_sold(INSTANCE, spot) == []
    half_spot = copy.deepcopy(spot)
    half_spot["scheduling"]["automaticRestart"] = True
    [needs] = provisioning_model_sold(INSTANCE, half_spot)
    assert "SPOT needs" in needs
    flex = {"machineType": "a3-highgpu-1g", "scheduling": {"provisioningModel": "FLEX_START"}}
    flex_needs = provisioning_model_sold(INSTANCE, flex)  # and NO_RESERVATION (test_stacks_single_node)
    assert any("maxRunDuration" in p for p in flex_needs)


def test_dev_runs_on_spot_and_scale5_on_demand(scale5: StackRun) -> None:
    dev = run_stack("dev").one(INSTANCE).plain["scheduling"]
    assert dev["provisioningModel"] == "SPOT" and dev["preemptible"] is True
    assert dev["automaticRestart"] is False and dev["instanceTerminationAction"] == "STOP"
    assert scale5.one(INSTANCE).plain["scheduling"]["provisioningModel"] == "STANDARD"
    spot = run_stack("scale5-gcp", overrides={"duplexops:provisioningModel": "spot"})
    assert spot.one(INSTANCE).plain["scheduling"]["provisioningModel"] == "SPOT"
    assert check_resources(_policy_inputs(spot)) == []


def test_flex_start_scheduling_passes_the_pack() -> None:
    from infra.components.gce_node import reservation_affinity, scheduling
    from infra.stack_config import GceSettings

    settings = GceSettings(
        project="p",
        region="us-central1",
        zone="us-central1-a",
        machine_type="a3-highgpu-1g",
        accelerator_type=None,
        accelerator_count=1,
        boot_disk_gb=200,
        boot_disk_type="pd-balanced",
        public_source_ranges=("0.0.0.0/0",),
        subnet_cidr="10.64.0.0/24",
        enable_apis=True,
        usd_per_hour=None,
        price_source=None,
        price_read_on=None,
        provisioning_model="flex-start",
    )
    block = scheduling(settings, get_profile("a100-80gb"))
    assert block["provisioning_model"] == "FLEX_START"
    assert block["max_run_duration"] == {"seconds": gcp_catalog.FLEX_START_MAX_RUN_S}
    props = {
        "machineType": "a3-highgpu-1g",
        "scheduling": block,
        "reservationAffinity": reservation_affinity(settings),
    }
    assert provisioning_model_sold(INSTANCE, props) == []


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (
            "flex-start",
            "'flex-start' for machine type 'n1-standard-8': n1-standard-8 is sold only as "
            "standard or spot, not flex-start; allowed: standard, spot",
        ),
        (
            "preemptible",
            "duplexops:provisioningModel: unknown value 'preemptible'; allowed: standard, spot, flex-start",
        ),
    ],
)
def test_provisioning_model_config_errors(model: str, expected: str) -> None:
    with pytest.raises(StackConfigError) as caught:
        run_stack("dev", overrides={"duplexops:provisioningModel": model})
    assert expected in str(caught.value)


# --- 10. the cluster does not configure the default pool ------------------------------------------------


def test_clusters_have_no_cluster_level_node_config(multi_region: StackRun) -> None:
    clusters = multi_region.of_type(CLUSTER)
    assert len(clusters) == 2
    for cluster in clusters:
        assert "nodeConfig" not in cluster.plain and cluster.plain["removeDefaultNodePool"] is True


# --- 6, GKE: GPU node maintenance and upgrades drain through the PDB and the grace period ---------------


def test_gpu_node_disruption_drains_one_pod_at_a_time_within_its_grace(multi_region: StackRun) -> None:
    """What the cluster does on GPU host maintenance or a node upgrade (docs/deploying.md, "Stack
    multi-region"): GKE cordons the node and evicts its pods through the eviction API, which honours the
    PodDisruptionBudget; each pod's preStop drains (no new sessions, running ones finish) within
    terminationGracePeriodSeconds. Surge upgrades add a node before removing one (maxUnavailable 0)."""
    from infra.k8s.workload import drain_seconds
    from infra.node.profile import get_profile as profile_of

    pdbs = multi_region.of_type("kubernetes:policy/v1:PodDisruptionBudget")
    assert len(pdbs) == 2 and all(p.plain["spec"]["maxUnavailable"] == 1 for p in pdbs)
    pdb = pdbs[0]  # the same object in every region
    for deployment in multi_region.of_type("kubernetes:apps/v1:Deployment"):
        spec = deployment.plain["spec"]["template"]["spec"]
        if not any(c["name"] == "runtime" for c in spec["containers"]):
            continue
        [runtime] = [c for c in spec["containers"] if c["name"] == "runtime"]
        assert runtime["lifecycle"]["preStop"]["exec"]["command"]
        assert spec["terminationGracePeriodSeconds"] > drain_seconds(profile_of("a100-80gb"))
        assert pdb.plain["spec"]["selector"]["matchLabels"].items() <= (
            deployment.plain["spec"]["template"]["metadata"]["labels"].items()
        )
    for pool in multi_region.of_type(NODE_POOL):
        if pool.plain["name"] == "gpu":
            assert pool.plain["upgradeSettings"] == {"strategy": "SURGE", "maxSurge": 1, "maxUnavailable": 0}
