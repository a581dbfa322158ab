"""What a first real ``pulumi up`` would hit and mocks accept (issue "every stack survives its first real
``pulumi up``"): each rule of GCP/GKE the stacks depend on, checked over the mocked programs and through
the policy pack, with a failing case for each."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
from fresh_project import (
    FRESH_PROJECT_CHECKS,
    apis_enabled_before_use,
    buckets_uniform_and_private,
    global_backends_list_existing_negs,
    no_public_members,
    no_service_account_keys,
    node_pools_start_with_nodes,
)
from pulumi_harness import RecordedResource, StackRun, run_stack

from infra.capacity import gcp as gcp_catalog
from infra.node.bundle.compose import node_stop_timeout_s
from infra.node.profile.profiles import get_profile
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
from infra.stack_config.keys_node import NODE_DRAIN_GRACE_S

SERVICE = "gcp:projects/service:Service"
NODE_POOL = "gcp:container/nodePool:NodePool"
CLUSTER = "gcp:container/cluster:Cluster"
NEG = "gcp:compute/networkEndpointGroup:NetworkEndpointGroup"


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


def test_api_rule_step_0() -> None:
    """Issue 20 item 1: the rule no longer skips gcp:projects/: a project IAM binding needs Cloud Resource
    Manager, a step-0 API (passes, enabled by hand); a stack that declares a step-0 API fails with the
    gcloud command."""
    from infra.gcp_apis import required_apis

    binding = {"role": "roles/viewer", "member": "user:a@example.org"}
    assert "cloudresourcemanager.googleapis.com" in required_apis("gcp:projects/iAMMember:IAMMember", binding)
    assert "serviceusage.googleapis.com" in required_apis(SERVICE, {"service": "x.googleapis.com"})
    container = StackResource(SERVICE, {"service": "container.googleapis.com"}, "api-container")
    iam = StackResource("gcp:projects/iAMMember:IAMMember", binding, "binding", ())
    assert apis_enabled_for_features([container, iam]) == []
    crm = StackResource(SERVICE, {"service": "cloudresourcemanager.googleapis.com"}, "api-crm")
    [declared] = apis_enabled_for_features([container, crm, iam])
    assert (
        "step-0 API" in declared and "gcloud services enable cloudresourcemanager.googleapis.com" in declared
    )


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
    backend = multi_region.named("global-entry-backend")  # the runtime's (the other serves the page)
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
    """The cluster-level node_config shapes only the transient default pool (removed at once): its service
    account and nothing the pools need; ignored after creation (issue 20 item 20)."""
    clusters = multi_region.of_type(CLUSTER)
    assert len(clusters) == 2
    for cluster in clusters:
        assert cluster.plain["removeDefaultNodePool"] is True
        assert "nodeConfig" in cluster.ignore_changes
        assert "machineType" not in cluster.plain["nodeConfig"]


# --- 6, GKE: GPU node maintenance and upgrades drain through the PDB and the grace period ---------------


def test_gpu_node_disruption_drains_one_pod_at_a_time_within_its_grace(multi_region: StackRun) -> None:
    """What the cluster does on GPU host maintenance or a node upgrade (docs/deploying.md, "Stack
    multi-region"): GKE cordons the node and evicts its pods through the eviction API, which honours the
    PodDisruptionBudget; each pod's preStop drains (no new sessions, running ones finish) within
    terminationGracePeriodSeconds. GPU pools upgrade one node at a time in place (no surge node: it would
    need one more GPU; issue 20 item 11)."""
    from infra.k8s.workload import drain_seconds
    from infra.node.profile.profiles import get_profile as profile_of

    pdbs = [
        p
        for p in multi_region.of_type("kubernetes:policy/v1:PodDisruptionBudget")
        if p.plain["metadata"]["name"] == "duplex-runtime"  # coturn has its own (infra.k8s.turn)
    ]
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
            assert pool.plain["upgradeSettings"] == {"strategy": "SURGE", "maxSurge": 0, "maxUnavailable": 1}


# --- the fresh-project model: every stack's first `up` ---------------------------------------------------


def _urn(typ: str, name: str, parent: str = "pulumi:pulumi:Stack") -> str:
    return f"urn:pulumi:t::duplexops::{parent}${typ}::{name}"


def _res(typ: str, name: str, inputs: dict[str, Any], *deps: RecordedResource, **kw: Any) -> RecordedResource:
    """A hand-built resource of a fake run, depending on ``deps``."""
    return RecordedResource(
        typ, name, inputs, True, urn=_urn(typ, name), dependencies=tuple(d.urn for d in deps), **kw
    )


def _fake_run(*resources: RecordedResource) -> StackRun:
    return StackRun("t", {}, list(resources), [], {}, set(), Path("."))


FRESH_STACKS = ("dev", "scale5-gcp", "scale5-onprem", "multi-region")


@functools.cache
def _first_up(stack: str) -> StackRun:
    """One run of ``stack`` shared by its fresh-project checks."""
    return run_stack(stack)


@pytest.mark.parametrize("check", [c.name for c in FRESH_PROJECT_CHECKS])
@pytest.mark.parametrize("stack", FRESH_STACKS)
def test_every_stack_passes_the_fresh_project_on_its_first_up(stack: str, check: str) -> None:
    """Every stack's first ``up`` in a brand-new project (``tests/fresh_project.py``): APIs enabled before
    use, the secure-by-default org policies, GKE pools that start with nodes, NEGs that exist where the
    global backend lists them. Guards issue 20 items 1-4."""
    run = _first_up(stack)
    [found] = [c for c in FRESH_PROJECT_CHECKS if c.name == check]
    problems = found.check(run)
    assert problems == [], f"{stack} fails the fresh-project check {check}:\n" + "\n".join(problems)


def test_fresh_project_apis_need_a_service_created_first() -> None:
    """A resource whose API is off in a new project fails unless a Service enabling it comes first (directly,
    or through its parent); a step-0 API declared as a Service fails (the call needs it)."""
    api = _res(SERVICE, "api-compute", {"service": "compute.googleapis.com"})
    ok = _res("gcp:compute/network:Network", "net", {}, api)
    assert apis_enabled_before_use(_fake_run(api, ok)) == []
    early = _res("gcp:compute/network:Network", "net", {})
    [message] = apis_enabled_before_use(_fake_run(api, early))
    assert "net needs compute.googleapis.com" in message and "not ordered after" in message
    [missing] = apis_enabled_before_use(_fake_run(early))
    assert "does not enable" in missing
    component = RecordedResource(
        "x:Comp", "comp", {}, False, urn=_urn("x:Comp", "comp"), dependencies=(api.urn,)
    )
    child = _res("gcp:compute/network:Network", "net", {}, parent=component.urn)
    assert apis_enabled_before_use(_fake_run(api, component, child)) == []
    binding = _res("gcp:projects/iAMMember:IAMMember", "binding", {"role": "roles/viewer"})
    assert apis_enabled_before_use(_fake_run(binding)) == []  # step 0: enabled by hand
    crm = _res(SERVICE, "api-crm", {"service": "cloudresourcemanager.googleapis.com"})
    [step0] = apis_enabled_before_use(_fake_run(crm))
    assert "step-0 API" in step0 and "gcloud services enable cloudresourcemanager.googleapis.com" in step0


def test_fresh_project_refuses_public_members_keys_and_open_buckets() -> None:
    """Secure-by-default organizations: no allUsers/allAuthenticatedUsers, buckets uniform and not public,
    no service-account keys."""
    public = _res("gcp:storage/bucketIAMMember:BucketIAMMember", "pub", {"member": "allUsers", "bucket": "b"})
    [message] = no_public_members(_fake_run(public))
    assert "pub grants member" in message
    members = _res(
        "gcp:projects/iAMBinding:IAMBinding", "b", {"members": ["user:a@x.org", "allAuthenticatedUsers"]}
    )
    [binding] = no_public_members(_fake_run(members))
    assert "members[1]" in binding
    private = _res("gcp:storage/bucketIAMMember:BucketIAMMember", "p", {"member": "serviceAccount:a@x"})
    assert no_public_members(_fake_run(private)) == []
    open_bucket = _res("gcp:storage/bucket:Bucket", "open", {"uniformBucketLevelAccess": False})
    assert len(buckets_uniform_and_private(_fake_run(open_bucket))) == 2
    closed = _res(
        "gcp:storage/bucket:Bucket",
        "closed",
        {"uniformBucketLevelAccess": True, "publicAccessPrevention": "enforced"},
    )
    assert buckets_uniform_and_private(_fake_run(closed)) == []
    key = _res("gcp:serviceaccount/key:Key", "key", {"serviceAccountId": "sa"})
    [refused] = no_service_account_keys(_fake_run(key))
    assert "disableServiceAccountKeyCreation" in refused


def test_fresh_project_pools_without_initial_count_have_no_node() -> None:
    """A pool without initialNodeCount starts empty; with the default pool removed the cluster has no node."""
    cluster = _res(
        CLUSTER, "c", {"location": "us-central1", "removeDefaultNodePool": True, "initialNodeCount": 1}
    )
    autoscaled = {"totalMinNodeCount": 1, "totalMaxNodeCount": 3}
    empty = _res(NODE_POOL, "gpu", {"nodeLocations": ["us-central1-a"], "autoscaling": autoscaled}, cluster)
    problems = node_pools_start_with_nodes(_fake_run(cluster, empty))
    assert len(problems) == 2
    assert "gpu starts with 0 node(s), below its autoscaling minimum 1" in problems[0]
    assert "c has no node at creation" in problems[1]
    started = _res(
        NODE_POOL,
        "gpu",
        {"nodeLocations": ["us-central1-a"], "autoscaling": autoscaled, "initialNodeCount": 1},
        cluster,
    )
    assert node_pools_start_with_nodes(_fake_run(cluster, started)) == []
    kept_default = _res(CLUSTER, "d", {"location": "us-central1-a", "initialNodeCount": 1})
    assert node_pools_start_with_nodes(_fake_run(kept_default)) == []


def test_fresh_project_negs_exist_only_where_pods_or_preprovisioning_put_them() -> None:
    """A global backend listing a NEG in a zone where nothing creates it is a 404; the NEG annotation's
    "zones" (ingress-gce PR 3152) or a rolled-out Deployment confined to one zone create it."""
    cluster = _res(CLUSTER, "c", {"location": "us-central1"})
    pool = _res(NODE_POOL, "p", {"nodeLocations": ["us-central1-a", "us-central1-b"]}, cluster)
    provider = _res("pulumi:providers:kubernetes", "k8s", {}, cluster)
    ref = f"{provider.urn}::k8s-id"

    def service(zones: list[str] | None) -> RecordedResource:
        neg: dict[str, Any] = {"exposed_ports": {"8998": {"name": "rt"}}}
        if zones is not None:
            neg["zones"] = zones
        meta = {"annotations": {"cloud.google.com/neg": json.dumps(neg)}}
        return _res(
            "kubernetes:core/v1:Service",
            "svc",
            {"metadata": meta, "spec": {"selector": {"app": "rt"}}},
            provider=ref,
        )

    def backend(*deps: RecordedResource) -> RecordedResource:
        groups = [{"group": f"projects/p/zones/us-central1-{z}/networkEndpointGroups/rt"} for z in "ab"]
        return _res("gcp:compute/backendService:BackendService", "be", {"backends": groups}, *deps)

    plain = service(None)
    assert (
        len(global_backends_list_existing_negs(_fake_run(cluster, pool, provider, plain, backend(plain))))
        == 2
    )
    everywhere = service(["*"])
    assert (
        global_backends_list_existing_negs(
            _fake_run(cluster, pool, provider, everywhere, backend(everywhere))
        )
        == []
    )
    one = service(["us-central1-a", "europe-west4-a"])
    [left] = global_backends_list_existing_negs(_fake_run(cluster, pool, provider, one, backend(one)))
    assert "in us-central1-b" in left
    # One zone of nodes and a rolled-out Deployment: its pod, and so the NEG, is in that zone.
    single = _res(NODE_POOL, "p", {"nodeLocations": ["us-central1-a"]}, cluster)
    pods = {"spec": {"replicas": 1, "template": {"metadata": {"labels": {"app": "rt"}}}}}
    deployment = _res("kubernetes:apps/v1:Deployment", "rt", pods, provider=ref)
    [only_b] = global_backends_list_existing_negs(
        _fake_run(cluster, single, provider, plain, deployment, backend(plain, deployment))
    )
    assert "in us-central1-b" in only_b
    declared = _res(NEG, "neg-b", {"name": "rt", "zone": "us-central1-b"})
    assert (
        global_backends_list_existing_negs(
            _fake_run(
                cluster, single, provider, plain, deployment, declared, backend(plain, deployment, declared)
            )
        )
        == []
    )
