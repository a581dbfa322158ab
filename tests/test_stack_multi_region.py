"""The multi-region stack (``stacks/Pulumi.multi-region.yaml``) under Pulumi's mocks: per region the GKE
cluster, its GPU pool, Memorystore and the runtime's Kubernetes objects (captured, written out as
manifests and validated offline against the Kubernetes schemas); the global entry; the policy pack; and
what a third region adds."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml
from pulumi_harness import RecordedResource, StackRun, run_stack

from infra.policy.rules import check_resources
from infra.stack_config import StackConfigError

STACK = "multi-region"
CLUSTER = "gcp:container/cluster:Cluster"
NODE_POOL = "gcp:container/nodePool:NodePool"
REDIS = "gcp:redis/instance:Instance"
BACKEND = "gcp:compute/backendService:BackendService"
K8S_PREFIX = "kubernetes:"

THIRD_REGION = {
    "region": "asia-southeast1",
    "zones": ["asia-southeast1-c"],
    "minNodes": 1,
    "maxNodes": 2,
}


@pytest.fixture(scope="module")
def run() -> StackRun:
    return run_stack(STACK)


@pytest.fixture(scope="module")
def stack_file_regions() -> list[dict]:
    document = yaml.safe_load(Path("stacks/Pulumi.multi-region.yaml").read_text())
    return document["config"]["duplexops:regions"]


def _in_region(resources: list[RecordedResource], region: str) -> list[RecordedResource]:
    """The region's components (``region-<r>``, ``runtime-<r>``) and everything in them."""
    components = (f"region-{region}", f"runtime-{region}")
    return [
        r for r in resources if r.name in components or r.name.startswith(tuple(c + "-" for c in components))
    ]


def _one_in_region(run: StackRun, type_token: str, region: str, suffix: str = "") -> RecordedResource:
    found = [r for r in _in_region(run.of_type(type_token), region) if r.name.endswith(suffix)]
    assert len(found) == 1, f"{type_token} in {region} ({suffix!r}): {[r.name for r in found]}"
    return found[0]


def _manifests(run: StackRun, region: str) -> list[dict]:
    from infra.k8s.manifest import to_manifest

    return [
        to_manifest(r.type, r.plain)
        for r in run.resources
        if r.type.startswith(K8S_PREFIX) and r.custom and r.name.startswith(f"runtime-{region}-")
    ]


# --- per region: GCP ----------------------------------------------------------------------------------


def test_default_stack_has_two_regions(run: StackRun, stack_file_regions: list[dict]) -> None:
    assert len(stack_file_regions) >= 2
    clusters = run.of_type(CLUSTER)
    assert sorted(c.plain["location"] for c in clusters) == sorted(r["region"] for r in stack_file_regions)


@pytest.mark.parametrize("region", ["us-central1", "europe-west4"])
def test_cluster_settings(run: StackRun, region: str) -> None:
    cluster = _one_in_region(run, CLUSTER, region).plain
    assert cluster["location"] == region
    assert cluster["privateClusterConfig"]["enablePrivateNodes"] is True
    assert cluster["workloadIdentityConfig"]["workloadPool"] == "my-gcp-project.svc.id.goog"
    assert cluster["releaseChannel"]["channel"] == "REGULAR"
    assert cluster["gatewayApiConfig"]["channel"] == "CHANNEL_STANDARD"
    assert cluster["monitoringConfig"]["managedPrometheus"]["enabled"] is True
    assert "DCGM" in cluster["monitoringConfig"]["enableComponents"]
    assert cluster["removeDefaultNodePool"] is True
    assert cluster["deletionProtection"] is True
    assert [b["cidrBlock"] for b in cluster["masterAuthorizedNetworksConfig"]["cidrBlocks"]] == [
        "203.0.113.0/24"
    ]
    assert cluster["ipAllocationPolicy"]["clusterSecondaryRangeName"] == "pods"  # VPC-native: NEG pod IPs
    assert cluster["addonsConfig"]["gcsFuseCsiDriverConfig"]["enabled"] is True


@pytest.mark.parametrize(
    ("region", "zones", "bounds"),
    [
        ("us-central1", ["us-central1-a", "us-central1-c"], (1, 4)),
        ("europe-west4", ["europe-west4-a"], (1, 3)),
    ],
)
def test_gpu_pool(run: StackRun, region: str, zones: list[str], bounds: tuple[int, int]) -> None:
    pool = _one_in_region(run, NODE_POOL, region, "gpu-pool").plain
    config = pool["nodeConfig"]
    assert config["machineType"] == "a2-ultragpu-1g"
    [accelerator] = config["guestAccelerators"]
    assert accelerator["type"] == "nvidia-a100-80gb" and accelerator["count"] == 1
    assert accelerator["gpuDriverInstallationConfig"]["gpuDriverVersion"] in ("DEFAULT", "LATEST")
    assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"} in config["taints"]
    assert pool["nodeLocations"] == zones
    autoscaling = pool["autoscaling"]
    assert (autoscaling["totalMinNodeCount"], autoscaling["totalMaxNodeCount"]) == bounds
    # Surge upgrades never take a GPU node away before its replacement is up, and never more at once than
    # the PodDisruptionBudget lets go.
    upgrade = pool["upgradeSettings"]
    [pdb] = [m for m in _manifests(run, region) if m["kind"] == "PodDisruptionBudget"]
    assert upgrade["maxUnavailable"] == 0 and upgrade["maxSurge"] >= 1
    assert upgrade["maxUnavailable"] <= pdb["spec"]["maxUnavailable"]
    assert config["workloadMetadataConfig"]["mode"] == "GKE_METADATA"


@pytest.mark.parametrize("region", ["us-central1", "europe-west4"])
def test_redis_auth_and_tls(run: StackRun, region: str) -> None:
    redis = _one_in_region(run, REDIS, region).plain
    assert redis["authEnabled"] is True
    assert redis["transitEncryptionMode"] == "SERVER_AUTHENTICATION"
    assert redis["tier"] == "STANDARD_HA" and redis["region"] == region


# --- the global entry ---------------------------------------------------------------------------------


def test_global_entry(run: StackRun) -> None:
    backend = run.one(BACKEND).plain
    assert backend["timeoutSec"] >= 3600 + 60  # the a100-80gb profile's longest session, plus a margin
    assert backend["connectionDrainingTimeoutSec"] == 3600  # the longest session, GCP's maximum
    assert backend["sessionAffinity"] == "NONE" and backend["localityLbPolicy"] == "LEAST_REQUEST"
    assert backend["loadBalancingScheme"] == "EXTERNAL_MANAGED"
    groups = sorted(b["group"] for b in backend["backends"])
    assert groups == sorted(
        f"projects/my-gcp-project/zones/{zone}/networkEndpointGroups/duplex-multi-region-runtime"
        for zone in ("us-central1-a", "us-central1-c", "europe-west4-a")
    )
    assert all(b["balancingMode"] == "IN_FLIGHT" for b in backend["backends"])
    assert all(b["maxInFlightRequestsPerEndpoint"] == 5 for b in backend["backends"])  # slots per pod
    assert all(b["capacityScaler"] == 1.0 for b in backend["backends"])

    health = run.one("gcp:compute/healthCheck:HealthCheck").plain
    assert health["httpHealthCheck"]["requestPath"] == "/readyz"
    assert backend["healthChecks"] == "global-entry-readyz-id"

    certificate = run.one("gcp:compute/managedSslCertificate:ManagedSslCertificate").plain
    assert certificate["managed"]["domains"] == ["duplex.example.com"]
    https_proxy = run.one("gcp:compute/targetHttpsProxy:TargetHttpsProxy").plain
    assert https_proxy["sslCertificates"] == ["global-entry-certificate-id"]

    armor = run.one("gcp:compute/securityPolicy:SecurityPolicy").plain
    assert backend["securityPolicy"] == "global-entry-armor-id"
    throttle = [r for r in armor["rules"] if r["action"] == "throttle"]
    assert throttle and throttle[0]["rateLimitOptions"]["exceedAction"] == "deny(429)"
    forwarding = {
        r.plain["portRange"]: r.plain
        for r in run.of_type("gcp:compute/globalForwardingRule:GlobalForwardingRule")
    }
    assert set(forwarding) == {"443", "80"}


def test_global_entry_serves_the_page_and_only_the_runtime_paths(run: StackRun) -> None:
    """The browser client is the default; only the runtime's public paths reach the pods, so /metrics,
    /healthz and /readyz are not reachable from the internet."""
    from infra.node.webclient import WEB_DIR, render_web

    [url_map] = [r.plain for r in run.of_type("gcp:compute/uRLMap:URLMap") if "hostRules" in r.plain]
    page_id, runtime_id = "global-entry-page-backend-id", "global-entry-backend-id"
    assert url_map["defaultService"] == page_id
    [matcher] = url_map["pathMatchers"]
    assert matcher["defaultService"] == page_id
    [rule] = matcher["pathRules"]
    assert rule["service"] == runtime_id
    assert sorted(rule["paths"]) == ["/api/admission", "/api/chat", "/api/personas"]

    objects = {o.plain["name"]: o.plain for o in run.of_type("gcp:storage/bucketObject:BucketObject")}
    shipped = {path.removeprefix(f"{WEB_DIR}/"): content for path, content in render_web().items()}
    assert set(objects) == set(shipped)
    assert objects["index.html"]["content"] == shipped["index.html"].decode()
    assert objects["app.js"]["contentType"] == "text/javascript; charset=utf-8"
    backend = run.one("gcp:compute/backendBucket:BackendBucket").plain
    headers = dict(h.split(": ", 1) for h in backend["customResponseHeaders"])
    assert "connect-src 'self' wss://duplex.example.com" in headers["Content-Security-Policy"]
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert run.outputs["page"] == "https://duplex.example.com/"


def test_drained_region_gets_no_new_callers() -> None:
    regions = yaml.safe_load(Path("stacks/Pulumi.multi-region.yaml").read_text())["config"][
        "duplexops:regions"
    ]
    regions = [dict(r) for r in regions]
    regions[1]["serving"] = False
    run = run_stack(STACK, overrides={"duplexops:regions": regions})
    backends = run.one(BACKEND).plain["backends"]
    scalers = {b["group"].split("/")[3]: b["capacityScaler"] for b in backends}
    assert scalers == {"us-central1-a": 1.0, "us-central1-c": 1.0, "europe-west4-a": 0.0}
    # Its cluster keeps running: open conversations finish there.
    assert len(run.of_type(CLUSTER)) == 2
    assert run.outputs["capacity"]["totalSlots"] == {"min": 5, "max": 20}


def test_restricted_source_ranges_deny_the_rest() -> None:
    run = run_stack(STACK, overrides={"duplexops:publicSourceRanges": ["198.51.100.0/24", "203.0.113.0/24"]})
    rules = run.one("gcp:compute/securityPolicy:SecurityPolicy").plain["rules"]
    default = [r for r in rules if r["priority"] == 2147483647]
    assert default[0]["action"] == "deny(403)"
    throttle = [r for r in rules if r["action"] == "throttle"]
    assert throttle[0]["match"]["config"]["srcIpRanges"] == ["198.51.100.0/24", "203.0.113.0/24"]


# --- Kubernetes objects ---------------------------------------------------------------------------------


@pytest.mark.parametrize("region", ["us-central1", "europe-west4"])
def test_kubernetes_objects_validate_strictly(run: StackRun, region: str, tmp_path: Path) -> None:
    from infra.k8s.manifest import validate_manifests, write_manifests

    manifests = _manifests(run, region)
    path = tmp_path / f"{region}.yaml"
    write_manifests(manifests, path)
    written = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert len(written) == len(manifests) >= 8
    assert validate_manifests(written) == []


@pytest.mark.parametrize("region", ["us-central1", "europe-west4"])
def test_runtime_deployment(run: StackRun, region: str) -> None:
    manifests = _manifests(run, region)
    [deployment] = [m for m in manifests if m["kind"] == "Deployment" and "runtime" in m["metadata"]["name"]]
    pod = deployment["spec"]["template"]["spec"]
    [runtime] = [
        c for c in pod["containers"] if c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    ]
    assert str(runtime["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert runtime["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert runtime["livenessProbe"]["httpGet"]["path"] == "/healthz"
    startup = runtime["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60  # a 7B model load
    assert runtime["lifecycle"]["preStop"]
    assert pod["terminationGracePeriodSeconds"] >= 3600  # the longest session
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-a100-80gb"
    assert runtime["image"].startswith("us-central1-docker.pkg.dev/my-gcp-project/duplex-multi-region/")
    assert "@sha256:" in runtime["image"]
    assert "replicas" not in deployment["spec"]  # the HorizontalPodAutoscaler owns it

    [hpa] = [m for m in manifests if m["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    [metric] = hpa["spec"]["metrics"]
    assert "duplex_active_sessions" in json.dumps(metric)
    bounds = {"us-central1": (1, 4), "europe-west4": (1, 3)}[region]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == bounds


def test_no_secret_in_plain_kubernetes_objects(run: StackRun) -> None:
    """Secret values reach Kubernetes only inside Secret objects, as Pulumi secrets."""
    for resource in run.resources:
        if not resource.type.startswith(K8S_PREFIX) or resource.type == "kubernetes:core/v1:Secret":
            continue
        text = json.dumps(resource.plain)
        for value in run.secret_values:
            assert value not in text, f"{resource.name} holds a secret value"
    for secret in run.of_type("kubernetes:core/v1:Secret"):
        assert secret.is_secret("stringData") or secret.is_secret("data"), secret.name


# --- outputs --------------------------------------------------------------------------------------------


def test_outputs(run: StackRun) -> None:
    outputs = run.outputs
    assert outputs["endpoint"] == "wss://duplex.example.com/api/chat"
    assert outputs["globalIp"] == "198.51.100.7"
    assert set(outputs["regions"]) == {"us-central1", "europe-west4"}
    us = outputs["regions"]["us-central1"]
    assert us["kubectl"].startswith(
        "gcloud container clusters get-credentials duplex-multi-region-us-central1 "
    )
    assert us["capacity"]["slots"] == {"min": 5, "max": 20}
    capacity = outputs["capacity"]
    assert capacity["totalSlots"] == {"min": 10, "max": 35}
    assert capacity["usdPerMonth"]["max"] > capacity["usdPerMonth"]["min"] > 0
    text = json.dumps(outputs)
    for value in run.secret_values:
        assert value not in text


# --- policy pack ----------------------------------------------------------------------------------------


def _policy_inputs(run: StackRun) -> list[tuple[str, dict, str, tuple[str, ...]]]:
    return [(r.type, r.plain, r.name, r.dependencies) for r in run.resources if r.custom]


def test_policy_pack_passes(run: StackRun) -> None:
    assert check_resources(_policy_inputs(run)) == []


def test_policy_pack_fails_on_untainted_gpu_pool_plain_redis_and_short_timeout(run: StackRun) -> None:
    resources = _policy_inputs(run)
    broken = []
    for typ, props, name, deps in resources:
        props = json.loads(json.dumps(props))
        if typ == NODE_POOL and name.endswith("gpu-pool") and name.startswith("region-us-central1"):
            props["nodeConfig"]["taints"] = []
        if typ == REDIS and name.startswith("region-europe-west4"):
            props["transitEncryptionMode"] = "DISABLED"
        if typ == BACKEND:
            props.pop("timeoutSec")  # the 30 s default
        broken.append((typ, props, name, deps))
    violations = check_resources(broken)
    assert len(violations) == 3, violations
    assert any("[backend-timeout-fits-websockets]" in v and "default 30 s" in v for v in violations)
    assert any("[gpu-node-pool-tainted]" in v and "region-us-central1" in v for v in violations)
    assert any("[redis-auth-required]" in v and "transitEncryptionMode" in v for v in violations)


# --- adding a region ------------------------------------------------------------------------------------


def test_third_region_adds_exactly_one_region(run: StackRun, stack_file_regions: list[dict]) -> None:
    three = run_stack(STACK, overrides={"duplexops:regions": [*stack_file_regions, THIRD_REGION]})
    added = three.inventory - run.inventory
    assert not (run.inventory - three.inventory)  # nothing removed
    one_region = Counter(r.type for r in _in_region(run.resources, "europe-west4"))
    assert added == one_region
    new = Counter(r.type for r in _in_region(three.resources, "asia-southeast1"))
    assert new == one_region
    # The existing regions are declared as before (same names, same inputs).
    before = {(r.type, r.name): r.plain for r in _in_region(run.resources, "us-central1")}
    after = {(r.type, r.name): r.plain for r in _in_region(three.resources, "us-central1")}
    assert before == after
    backends = three.one(BACKEND).plain["backends"]
    assert len(backends) == 4 and any("asia-southeast1-c" in b["group"] for b in backends)


# --- configuration errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"duplexops:domain": None}, "duplexops:domain: missing"),
        ({"duplexops:adminSourceRanges": None}, "duplexops:adminSourceRanges: missing"),
        ({"duplexops:regions": []}, "duplexops:regions"),
        (
            {"duplexops:regions": [{"region": "us-central1", "zones": ["europe-west4-a"]}]},
            "duplexops:regions[0].zones: 'europe-west4-a' is not a zone of us-central1",
        ),
        (
            {"duplexops:regions": [{"region": "us-central1", "zones": ["us-central1-a"], "gpu": "l40s"}]},
            "regions[0].gpu: 'l40s' is not offered on GCP",
        ),
        (
            {
                "duplexops:regions": [
                    {"region": "us-central1", "zones": ["us-central1-a"]},
                    {"region": "us-central1", "zones": ["us-central1-c"]},
                ]
            },
            "duplexops:regions[1].region: 'us-central1' is already used by regions[0]",
        ),
        ({"duplexops:machineType": "a2-ultragpu-1g"}, "duplexops:machineType: does not apply to topology"),
    ],
)
def test_configuration_errors(overrides: dict, expected: str) -> None:
    with pytest.raises(StackConfigError) as error:
        run_stack(STACK, overrides=overrides)
    assert expected in str(error.value)
