"""The multi-region stack (``stacks/Pulumi.multi-region.yaml``) under Pulumi's mocks: per region the GKE
cluster, its GPU pool, Memorystore and the runtime's Kubernetes objects (captured, written out as
manifests and validated offline against the Kubernetes schemas); the global entry; the policy pack; and
what a third region adds."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml
from pulumi_harness import MOCK_IP, RecordedResource, StackRun, run_stack

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


def _runtime_backend(run: StackRun) -> RecordedResource:
    """The runtime's backend service (the other one is the page's)."""
    return run.named("global-entry-backend")


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
    # GKE Dataplane V2: NetworkPolicy enforced (the TURN relay's egress fence, infra.k8s.turn).
    assert cluster["datapathProvider"] == "ADVANCED_DATAPATH"
    assert "networkPolicy" not in cluster  # the legacy Calico add-on is not for Dataplane V2 clusters


@pytest.mark.parametrize(
    ("region", "zones", "bounds"),
    [
        ("us-central1", ["us-central1-a", "us-central1-c"], (2, 4)),
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
    # Upgrades need no GPU beyond the pool's (no surge node), and take no more nodes at once than the
    # PodDisruptionBudget lets go.
    upgrade = pool["upgradeSettings"]
    [pdb] = [
        m
        for m in _manifests(run, region)
        if m["kind"] == "PodDisruptionBudget" and m["metadata"]["name"] == "duplex-runtime"
    ]
    assert upgrade["maxSurge"] == 0 and upgrade["maxUnavailable"] == 1
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
    backend = _runtime_backend(run).plain
    assert backend["timeoutSec"] >= 3600 + 60  # the a100-80gb profile's longest session, plus a margin
    assert backend["connectionDrainingTimeoutSec"] == 3600  # the longest session, GCP's maximum
    assert backend["sessionAffinity"] == "NONE" and backend["localityLbPolicy"] == "WEIGHTED_ROUND_ROBIN"
    assert backend["loadBalancingScheme"] == "EXTERNAL_MANAGED"
    groups = sorted(b["group"] for b in backend["backends"])
    assert groups == sorted(
        f"projects/my-gcp-project/zones/{zone}/networkEndpointGroups/duplex-multi-region-runtime"
        for zone in ("us-central1-a", "us-central1-c", "europe-west4-a")
    )
    # Issue 33: balanced on the slot utilisation each pod reports (ORCA endpoint-load-metrics), which
    # counts WebRTC calls and held resumes; IN_FLIGHT counted a WebSocket for its life, not a WebRTC call.
    assert backend["customMetrics"] == [{"name": "slot_utilization", "dryRun": False}]
    for b in backend["backends"]:
        assert b["balancingMode"] == "CUSTOM_METRICS", b
        assert b["customMetrics"] == [{"name": "slot_utilization", "maxUtilization": 1.0, "dryRun": False}]
        assert "maxInFlightRequestsPerEndpoint" not in b
    assert all(b["capacityScaler"] == 1.0 for b in backend["backends"])

    health = run.named("global-entry-readyz").plain
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


CERTIFICATE = "gcp:compute/managedSslCertificate:ManagedSslCertificate"


def test_a_new_domain_gets_a_new_certificate_before_the_old_goes(run: StackRun) -> None:
    """Issue 33 (latent): a managed certificate's domains cannot change in place, so a new ``domain``
    replaces it; with a fixed name the replacement (created first) collided with the old one. Named after
    the domain, the new one is created beside the old, the proxy switched to it, the old deleted last."""
    other = run_stack(STACK, overrides={"duplexops:domain": "voice.example.org"})
    before, after = run.one(CERTIFICATE), other.one(CERTIFICATE)
    assert after.plain["managed"]["domains"] == ["voice.example.org"]
    assert before.plain["name"] != after.plain["name"]
    for certificate in (before, after):
        name = certificate.plain["name"]
        assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name), name
        assert not certificate.delete_before_replace  # create the new one, then delete the old
    # Same logical resource (a replacement, not a second certificate), still the proxy's only one.
    assert before.name == after.name
    assert other.one("gcp:compute/targetHttpsProxy:TargetHttpsProxy").plain["sslCertificates"] == [
        f"{after.name}-id"
    ]
    # The same domain keeps its certificate (no replacement on an unrelated update).
    assert run_stack(STACK).one(CERTIFICATE).plain["name"] == before.plain["name"]


def test_certificate_name_refuses_an_empty_domain_and_a_long_prefix() -> None:
    from infra.components.global_entry import certificate_name

    with pytest.raises(ValueError, match="domain is empty"):
        certificate_name("duplex", "")
    with pytest.raises(ValueError, match="over GCP's 63 characters"):
        certificate_name("d" * 50, "duplex.example.com")


def test_global_entry_serves_the_page_and_only_the_runtime_paths(run: StackRun) -> None:
    """The browser client is the default; only the runtime's public paths reach the pods, so /metrics,
    /healthz and /readyz are not reachable from the internet."""
    from infra.node.bundle.webclient import WEB_DIR, render_web

    [url_map] = [r.plain for r in run.of_type("gcp:compute/uRLMap:URLMap") if "hostRules" in r.plain]
    page_id, runtime_id = "global-entry-page-backend-id", "global-entry-backend-id"
    assert url_map["defaultService"] == page_id
    [matcher] = url_map["pathMatchers"]
    assert matcher["defaultService"] == page_id
    [rule, *regional] = matcher["pathRules"]
    assert rule["service"] == runtime_id
    # Issue 33: a 503 before the upgrade (a pod full as the caller reached it) is tried on another pod.
    retry = rule["routeAction"]["retryPolicy"]
    assert "gateway-error" in retry["retryConditions"] and retry["numRetries"] >= 2
    assert "perTryTimeout" not in retry  # a WebSocket's try lasts its session: the backend's timeout
    assert sorted(rule["paths"]) == [
        "/api/admission",
        "/api/carriers/exotel",
        "/api/carriers/plivo",  # the phone carriers' media streams (issue 32)
        "/api/carriers/telnyx",
        "/api/carriers/twilio",
        "/api/chat",
        "/api/personas",
        "/api/rtc",
        "/api/rtc/*",  # the ICE servers and DELETE of a WebRTC session
        "/api/sessions",
        "/api/sessions/*",
    ]
    # Issue 33: each region's /r/<region>/* to its resume router, nothing else (the pods' other paths
    # stay unreachable: the router proxies only the resume and offer routes).
    assert {r["paths"][0]: r["service"] for r in regional} == {
        f"/r/{region}/*": f"global-entry-resume-{region}-id" for region in ("us-central1", "europe-west4")
    }
    assert all(len(r["paths"]) == 1 for r in regional)

    # Every region's page pods serve the shipped files.
    shipped = {path.removeprefix(f"{WEB_DIR}/"): content for path, content in render_web().items()}
    for region in ("us-central1", "europe-west4"):
        [files] = [
            m
            for m in _manifests(run, region)
            if m["kind"] == "ConfigMap" and m["metadata"]["name"] == "duplex-page"
        ]
        assert {k: v for k, v in files["data"].items() if k != "nginx.conf"} == {
            name: content.decode() for name, content in shipped.items()
        }
    backend = run.named("global-entry-page-backend").plain
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
    backends = _runtime_backend(run).plain["backends"]
    scalers = {b["group"].split("/")[3]: b["capacityScaler"] for b in backends}
    assert scalers == {"us-central1-a": 1.0, "us-central1-c": 1.0, "europe-west4-a": 0.0}
    # Its cluster keeps running: open conversations finish there.
    assert len(run.of_type(CLUSTER)) == 2
    assert run.outputs["capacity"]["totalSlots"] == {"min": 10, "max": 20}


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
    assert runtime["image"].startswith(f"{region}-docker.pkg.dev/my-gcp-project/duplex-multi-region/")
    assert "@sha256:" in runtime["image"]
    assert "replicas" not in deployment["spec"]  # the HorizontalPodAutoscaler owns it

    [hpa] = [m for m in manifests if m["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    [metric] = hpa["spec"]["metrics"]
    assert "duplex_active_sessions" in json.dumps(metric)
    bounds = {"us-central1": (2, 4), "europe-west4": (1, 3)}[region]
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
    assert us["capacity"]["slots"] == {"min": 10, "max": 20}
    capacity = outputs["capacity"]
    assert capacity["totalSlots"] == {"min": 15, "max": 35}
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
        if typ == BACKEND and name == "global-entry-backend":
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
    # and, in the global entry, the new region's resume-router backend service (its /r/<region>/* rule)
    assert added == one_region + Counter({"gcp:compute/backendService:BackendService": 1})
    assert three.named("global-entry-resume-asia-southeast1")
    new = Counter(r.type for r in _in_region(three.resources, "asia-southeast1"))
    assert new == one_region
    # The existing regions are declared as before (same names, same inputs).
    before = {(r.type, r.name): r.plain for r in _in_region(run.resources, "us-central1")}
    after = {(r.type, r.name): r.plain for r in _in_region(three.resources, "us-central1")}
    assert before == after
    backends = _runtime_backend(three).plain["backends"]
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


# --- a fresh project's first `up` (issue 20) ------------------------------------------------------------


def _regions(**changes: object) -> list[dict]:
    """The stack file's regions, ``changes`` applied to each."""
    regions = yaml.safe_load(Path("stacks/Pulumi.multi-region.yaml").read_text())["config"][
        "duplexops:regions"
    ]
    return [{**r, **changes} for r in regions]


@pytest.mark.parametrize("region", ["us-central1", "europe-west4"])
def test_every_backend_zone_always_holds_a_runtime_pod(run: StackRun, region: str) -> None:
    """Issue 20 item 2: GKE's NEG controller makes a zone's NEG only once a pod of the Service runs there
    (kubernetes/ingress-gce issue 1755); a backend service naming a NEG that does not exist fails (404,
    gke-autoneg-controller issue 50). Every zone the backend service lists must always hold a runtime pod:
    a GPU node in each zone from the start, at least as many pods as zones, spread one per zone as a
    scheduling rule; and the Service asks the controller for the NEG of each zone (ingress-gce PR 3152)."""
    pool = _one_in_region(run, NODE_POOL, region, "gpu-pool").plain
    zones = pool["nodeLocations"]
    backends = _runtime_backend(run).plain["backends"]
    listed = sorted(b["group"].split("/")[3] for b in backends if b["description"].startswith(region))
    assert listed == sorted(zones)
    assert pool["initialNodeCount"] >= 1  # per zone

    manifests = _manifests(run, region)
    [hpa] = [m for m in manifests if m["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["minReplicas"] >= len(zones)
    [deployment] = [
        m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == "duplex-runtime"
    ]
    template = deployment["spec"]["template"]
    [spread] = template["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone"
    assert spread["maxSkew"] == 1 and spread["whenUnsatisfiable"] == "DoNotSchedule"
    assert spread["labelSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()

    [service] = [m for m in manifests if m["kind"] == "Service" and m["metadata"]["name"] == "duplex-runtime"]
    neg = json.loads(service["metadata"]["annotations"]["cloud.google.com/neg"])
    assert neg["zones"] == zones
    assert neg["exposed_ports"]["8998"]["name"] == "duplex-multi-region-runtime"


def test_fewer_pods_than_zones_is_refused() -> None:
    """Issue 20 item 2: a region whose minNodes is below its number of zones would leave a zone without a
    pod, hence without the NEG its backend names: the configuration says so before anything is declared."""
    with pytest.raises(StackConfigError) as error:
        run_stack(STACK, overrides={"duplexops:regions": _regions(minNodes=1)})
    assert "duplexops:regions[0].minNodes: 1 is below the number of zones (2" in str(error.value)


def test_node_pools_start_with_nodes(run: StackRun) -> None:
    """Issue 20 item 3: a pool with autoscaling and no initial_node_count starts empty
    (terraform-provider-google 8270, 11594); the default pool is removed, so the cluster would have no
    node. Both pools start with one node per zone, and a later change of the count (ForceNew in the
    provider) never replaces a pool: it is ignored after creation."""
    pools = run.of_type(NODE_POOL)
    assert len(pools) == 4
    for pool in pools:
        assert pool.plain["initialNodeCount"] == 1, pool.name
        assert "initialNodeCount" in pool.ignore_changes, pool.name
    for cluster in run.of_type(CLUSTER):
        assert cluster.plain["removeDefaultNodePool"] is True


@pytest.mark.parametrize("region", ["us-central1", "europe-west4"])
def test_a_zone_out_of_gpus_does_not_fail_the_gpu_pool(run: StackRun, region: str) -> None:
    """Issue 33 (latent): with one node per listed zone at creation, a single zone out of GPUs failed the
    pool's creation (the first ``up``). Best-effort provisioning accepts the pool with one node and brings
    up the rest as stock returns; creation-only, so ignored after (no replacement of a running pool)."""
    pool = _one_in_region(run, NODE_POOL, region, "gpu-pool")
    assert pool.plain["bestEffortProvisioning"] == {"enabled": True, "minProvisionNodes": 1}
    assert "bestEffortProvisioning" in pool.ignore_changes
    assert pool.plain["autoscaling"]["locationPolicy"] == "ANY"


def test_default_pool_runs_as_the_node_account(run: StackRun) -> None:
    """Issue 20 item 20: the transient default pool ran as the Compute Engine default service account
    (Editor on the project); it runs as the region's node account, its config ignored once removed."""
    for cluster in run.of_type(CLUSTER):
        region = cluster.plain["location"]
        [node_account] = [
            a
            for a in run.of_type("gcp:serviceaccount/account:Account")
            if a.name == f"region-{region}-node-sa"
        ]
        email = f"{node_account.plain['accountId']}@my-gcp-project.iam.gserviceaccount.com"
        assert cluster.plain["nodeConfig"]["serviceAccount"] == email
        assert cluster.plain["nodeConfig"]["workloadMetadataConfig"]["mode"] == "GKE_METADATA"
        assert "nodeConfig" in cluster.ignore_changes


def test_redis_ca_bundle_holds_every_ca(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 20 item 20: during a CA rotation Memorystore lists two CAs; the runtime trusted only the first
    (``server_ca_certs[0]``) and broke when the server switched. The ConfigMap holds every one."""
    import pulumi_harness

    second = "-----BEGIN CERTIFICATE-----\nTmV3IE1lbW9yeXN0b3JlIENB\n-----END CERTIFICATE-----\n"
    computed = pulumi_harness._computed

    def two_cas(typ: str, name: str, inputs: dict) -> dict:
        out = computed(typ, name, inputs)
        if typ == REDIS:
            out["serverCaCerts"] = [{"cert": pulumi_harness.MOCK_REDIS_CA}, {"cert": second}]
        return out

    monkeypatch.setattr(pulumi_harness, "_computed", two_cas)
    rotated = run_stack(STACK)
    for region in ("us-central1", "europe-west4"):
        [ca] = [
            m
            for m in _manifests(rotated, region)
            if m["kind"] == "ConfigMap" and m["metadata"]["name"] == "redis-ca"
        ]
        assert ca["data"]["ca.pem"] == pulumi_harness.MOCK_REDIS_CA + second


def test_ca_bundle_refuses_what_verifies_nothing() -> None:
    from infra.components.gke_region import ca_bundle

    with pytest.raises(ValueError, match="server_ca_certs is empty"):
        ca_bundle([])
    with pytest.raises(ValueError, match=r"server_ca_certs\[1\] holds no PEM certificate"):
        ca_bundle([{"cert": "-----BEGIN CERTIFICATE-----\nQQ==\n-----END CERTIFICATE-----"}, {"cert": ""}])


def test_maintenance_window_and_gpu_upgrades(run: StackRun) -> None:
    """Issue 20 item 11: GPU pools auto-upgraded whenever GKE chose, by surge (one more A100 80 GB in the
    zone, which quota or stock may not have). Every cluster has the stack's weekly window; GPU pools
    upgrade in place, one node at a time, with no surge node."""
    for cluster in run.of_type(CLUSTER):
        window = cluster.plain["maintenancePolicy"]["recurringWindow"]
        assert window == {
            "startTime": "2025-01-06T02:00:00Z",
            "endTime": "2025-01-06T08:00:00Z",
            "recurrence": "FREQ=WEEKLY;BYDAY=SA,SU",
        }
    for pool in run.of_type(NODE_POOL):
        if pool.name.endswith("gpu-pool"):
            assert pool.plain["upgradeSettings"] == {"strategy": "SURGE", "maxSurge": 0, "maxUnavailable": 1}


def test_maintenance_window_from_the_stack_and_gke_rule() -> None:
    """Issue 20 item 11: the window is stack configuration; one GKE refuses (under 48 h in 32 days) fails
    with the key and the rule."""
    run = run_stack(
        STACK,
        overrides={"duplexops:maintenanceWindow": {"start": "22:30", "hours": 4, "days": ["TU", "MO", "WE"]}},
    )
    window = run.of_type(CLUSTER)[0].plain["maintenancePolicy"]["recurringWindow"]
    assert window["startTime"] == "2025-01-06T22:30:00Z" and window["endTime"] == "2025-01-07T02:30:00Z"
    assert window["recurrence"] == "FREQ=WEEKLY;BYDAY=MO,TU,WE"
    with pytest.raises(StackConfigError) as error:
        run_stack(STACK, overrides={"duplexops:maintenanceWindow": {"hours": 4, "days": ["SU"]}})
    assert "duplexops:maintenanceWindow.hours: 1 day(s) x 4 h gives 16 h in 32 days" in str(error.value)


def test_each_region_pulls_from_its_own_registry(run: StackRun) -> None:
    """Issue 20 item 12: one repository (the first region's) served every region: a pull crossed
    continents and depended on that region. Each region has a repository of its own, its nodes read it, its
    pods run the stack's digest from it (copied there by the program); the ``registries`` output lists
    them."""
    repositories = {r.plain["location"]: r for r in run.of_type("gcp:artifactregistry/repository:Repository")}
    assert set(repositories) == {"us-central1", "europe-west4"}
    digests = set()
    for region in ("us-central1", "europe-west4"):
        registry = f"{region}-docker.pkg.dev/my-gcp-project/duplex-multi-region"
        assert run.outputs["registries"][region] == registry
        [deployment] = [
            m
            for m in _manifests(run, region)
            if m["kind"] == "Deployment" and m["metadata"]["name"] == "duplex-runtime"
        ]
        image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image.startswith(f"{registry}/duplex-runtime@sha256:")
        digests.add(image.split("@")[1])
        [reader] = [
            m
            for m in run.of_type("gcp:artifactregistry/repositoryIamMember:RepositoryIamMember")
            if m.name == f"region-{region}-node-image-reader"
        ]
        assert reader.plain["location"] == region
    assert len(digests) == 1
    # The digest is copied into the second region's repository before its pods pull it.
    [copy] = [c for c in run.of_type("command:local:Command") if c.name == "region-europe-west4-promote"]
    first = "us-central1-docker.pkg.dev/my-gcp-project/duplex-multi-region/duplex-runtime"
    assert copy.plain["environment"]["SOURCE"] == f"{first}@{digests.pop()}"
    assert copy.plain["environment"]["TARGET"].startswith(
        "europe-west4-docker.pkg.dev/my-gcp-project/duplex-multi-region/duplex-runtime:"
    )


def test_https_proxy_refuses_old_tls(run: StackRun) -> None:
    """Issue 20 item 12: without an SSL policy the proxy takes TLS 1.0 (Google's default COMPATIBLE
    profile). It has one: TLS 1.2 or later, RESTRICTED suites."""
    policy = run.one("gcp:compute/sSLPolicy:SSLPolicy").plain
    assert policy["minTlsVersion"] == "TLS_1_2" and policy["profile"] == "RESTRICTED"
    proxy = run.one("gcp:compute/targetHttpsProxy:TargetHttpsProxy").plain
    assert proxy["sslPolicy"] == "global-entry-tls-id"


def test_page_is_served_without_a_public_bucket(run: StackRun) -> None:
    """Issue 20 item 4: the page came from a bucket granting ``allUsers``, which secure-by-default
    organizations (created since May 2024) refuse: the first ``up`` failed there. No IAM member anywhere is
    public, no bucket is left but the model caches; the page's backend service lists every region's page
    NEG (one nginx pod per zone, spread like the runtime) and adds the page's headers."""
    for resource in run.resources:
        text = json.dumps(resource.plain)
        assert '"allUsers"' not in text and '"allAuthenticatedUsers"' not in text, resource.name
    assert all("models" in b.name for b in run.of_type("gcp:storage/bucket:Bucket"))
    assert not run.of_type("gcp:compute/backendBucket:BackendBucket")
    page = run.named("global-entry-page-backend").plain
    assert page["loadBalancingScheme"] == "EXTERNAL_MANAGED" and page["protocol"] == "HTTP"
    groups = sorted(b["group"] for b in page["backends"])
    assert groups == sorted(
        f"projects/my-gcp-project/zones/{zone}/networkEndpointGroups/duplex-multi-region-page"
        for zone in ("us-central1-a", "us-central1-c", "europe-west4-a")
    )
    assert all(b["balancingMode"] == "RATE" for b in page["backends"])
    health = run.named("global-entry-page-health").plain
    assert page["healthChecks"] == "global-entry-page-health-id"
    assert health["httpHealthCheck"]["requestPath"] == "/index.html"
    for region, zones in (
        ("us-central1", ["us-central1-a", "us-central1-c"]),
        ("europe-west4", ["europe-west4-a"]),
    ):
        manifests = _manifests(run, region)
        [deployment] = [
            m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == "duplex-page"
        ]
        assert deployment["spec"]["replicas"] == len(zones)
        [spread] = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert spread["whenUnsatisfiable"] == "DoNotSchedule" and spread["maxSkew"] == 1
        [service] = [
            m for m in manifests if m["kind"] == "Service" and m["metadata"]["name"] == "duplex-page"
        ]
        neg = json.loads(service["metadata"]["annotations"]["cloud.google.com/neg"])
        assert neg == {"exposed_ports": {"8080": {"name": "duplex-multi-region-page"}}, "zones": zones}
    firewall = run.one("gcp:compute/firewall:Firewall").plain
    # the runtime's, the page's and the resume routers' (issue 33)
    assert firewall["allows"] == [{"protocol": "tcp", "ports": ["8998", "8080", "8081"]}]


# --- the policy pack's rules for items 11 and 12 ------------------------------------------------------------

GPU_POOL = {
    "nodeConfig": {
        "machineType": "a2-ultragpu-1g",
        "guestAccelerators": [{"type": "nvidia-a100-80gb", "count": 1.0}],
        "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"}],
    },
}


@pytest.mark.parametrize(
    ("upgrade", "expected"),
    [
        (None, "maxSurge 1 and maxUnavailable 0: each surge node is one more GPU"),  # GKE's default
        ({"strategy": "SURGE", "maxSurge": 1.0, "maxUnavailable": 0.0}, "maxSurge 1 and maxUnavailable 0"),
        ({"strategy": "BLUE_GREEN"}, "upgrades BLUE_GREEN: a second pool of GPUs"),
        ({"strategy": "SURGE", "maxSurge": 0.0, "maxUnavailable": 0.0}, "GKE refuses both 0"),
        ({"strategy": "SURGE", "maxSurge": 0.0, "maxUnavailable": 1.0}, None),
        (
            {"strategy": "SURGE", "maxSurge": "3eeb2bf0-c639-47a8-9e75-3b44932eb421"},
            None,
        ),  # unknown in preview
    ],
)
def test_policy_gpu_pool_upgrades_without_an_extra_gpu(upgrade: dict | None, expected: str | None) -> None:
    """Issue 20 item 11 as a policy rule: a GPU pool's surge (GKE's default) or blue-green upgrade needs
    GPUs beyond the pool's; a CPU pool may surge."""
    from infra.policy.rules import gpu_node_pool_upgrade_needs_no_extra_gpu as rule

    props = {**GPU_POOL, **({"upgradeSettings": upgrade} if upgrade is not None else {})}
    found = rule(NODE_POOL, props)
    if expected is None:
        assert found == []
    else:
        [message] = found
        assert expected in message and "nvidia-a100-80gb" in message
    cpu = {"nodeConfig": {"machineType": "e2-standard-4"}, "upgradeSettings": {"maxSurge": 1.0}}
    assert rule(NODE_POOL, cpu) == []


def test_policy_https_proxy_refuses_old_tls() -> None:
    """Issue 20 item 12 as a policy rule: a proxy without an SSL policy, or a policy from TLS 1.0/1.1."""
    from infra.policy.rules import https_proxy_tls_1_2 as rule

    proxy = "gcp:compute/targetHttpsProxy:TargetHttpsProxy"
    policy = "gcp:compute/sSLPolicy:SSLPolicy"
    [message] = rule(proxy, {"urlMap": "m", "sslCertificates": ["c"]})
    assert "without sslPolicy" in message
    assert rule(proxy, {"sslPolicy": "projects/p/global/sslPolicies/x"}) == []
    assert rule(proxy, {"sslPolicy": "04da6b54-80e4-46f7-96ec-b56ff0331ba9"}) == []  # unknown in preview
    assert "is not set (TLS_1_0)" in rule(policy, {"profile": "MODERN"})[0]
    assert "is TLS_1_1" in rule(policy, {"minTlsVersion": "TLS_1_1"})[0]
    assert rule(policy, {"minTlsVersion": "TLS_1_2", "profile": "RESTRICTED"}) == []


def test_policy_pack_flags_a_surging_gpu_pool_and_a_proxy_without_tls_policy(run: StackRun) -> None:
    broken = []
    for typ, props, name, deps in _policy_inputs(run):
        props = json.loads(json.dumps(props))
        if name == "region-us-central1-gpu-pool":
            props["upgradeSettings"] = {"strategy": "SURGE", "maxSurge": 1, "maxUnavailable": 0}
        if typ == "gcp:compute/targetHttpsProxy:TargetHttpsProxy":
            props.pop("sslPolicy")
        broken.append((typ, props, name, deps))
    violations = check_resources(broken)
    assert len(violations) == 2, violations
    assert any("[gpu-node-pool-upgrade-needs-no-extra-gpu]" in v and "us-central1" in v for v in violations)
    assert any("[https-proxy-tls-1-2]" in v for v in violations)


# --- alerts that reach someone (issue 20, item 8) ----------------------------------------------------------

ALERT_SECRETS = {"alertEmailPassword": "SmtpPasswordForTests-123", "alertPagerdutyRoutingKey": "R" * 32}
ALERT_KEYS = {
    "duplexops:alertWebhookUrl": "https://hooks.example.com/duplex",
    "duplexops:alertEmailTo": "oncall@example.com",
    "duplexops:alertEmailFrom": "duplex@example.com",
    "duplexops:alertEmailSmarthost": "smtp.example.com:587",
}
AM_SECRET = "kubernetes:core/v1:Secret"


def _alertmanager_secrets(run: StackRun) -> list[RecordedResource]:
    return [
        s
        for s in run.of_type(AM_SECRET)
        if s.plain["metadata"]["namespace"] == "gmp-public" and s.plain["metadata"]["name"] == "alertmanager"
    ]


def test_receivers_reach_gmp_managed_alertmanager(tmp_path: Path) -> None:
    """Guards item 8 on GKE: with receivers configured, every region's cluster gets Secret
    gmp-public/alertmanager (GMP's managed Alertmanager reads only its key alertmanager.yaml), holding the
    node's receivers with their secrets inline; amtool accepts it; the value is a Pulumi secret."""
    import shutil
    import subprocess

    from infra.node.monitoring.alertmanager import PAGE_RECEIVER, TICKET_RECEIVER

    run = run_stack(
        STACK,
        overrides=ALERT_KEYS,
        secrets={"hfToken": "hf_FakeTokenForUnitTests0123456789", **ALERT_SECRETS},
    )
    found = _alertmanager_secrets(run)
    assert sorted(s.name.split("-secret-")[0] for s in found) == [
        "runtime-europe-west4",
        "runtime-us-central1",
    ]
    amtool = shutil.which("amtool")
    assert amtool, "amtool missing: make system-deps (prometheus-alertmanager)"
    for secret in found:
        assert secret.is_secret("stringData")
        text = secret.plain["stringData"]["alertmanager.yaml"]
        path = tmp_path / f"{secret.name}.yaml"
        path.write_text(text)
        result = subprocess.run([amtool, "check-config", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        config = yaml.safe_load(text)
        receivers = {r["name"]: r for r in config["receivers"]}
        page, ticket = receivers[PAGE_RECEIVER], receivers[TICKET_RECEIVER]
        assert page["pagerduty_configs"][0]["routing_key"] == ALERT_SECRETS["alertPagerdutyRoutingKey"]
        assert "pagerduty_configs" not in ticket  # a ticket never pages
        assert page["email_configs"][0]["auth_password"] == ALERT_SECRETS["alertEmailPassword"]
        assert ticket["webhook_configs"][0]["url"] == ALERT_KEYS["duplexops:alertWebhookUrl"]
        assert "_file" not in text  # nothing read from a file: GMP mounts only this key
    assert check_resources(_policy_inputs(run)) == []
    for value in ALERT_SECRETS.values():
        assert value not in json.dumps(run.outputs)
        for resource in run.resources:
            if resource.type != AM_SECRET:
                assert value not in json.dumps(resource.plain), resource.name


def test_webhook_only_config_is_still_secret() -> None:
    """The webhook URL may carry a token: the Secret's text is a Pulumi secret without any secret key."""
    run = run_stack(STACK, overrides={"duplexops:alertWebhookUrl": "https://hooks.example.com/T0K3N"})
    found = _alertmanager_secrets(run)
    assert len(found) == 2
    for secret in found:
        assert secret.is_secret("stringData")
        assert "https://hooks.example.com/T0K3N" in secret.plain["stringData"]["alertmanager.yaml"]


def test_without_receivers_no_alertmanager_secret_and_a_warning(
    monkeypatch: pytest.MonkeyPatch, run: StackRun
) -> None:
    """Without receivers the stack declares no managed-Alertmanager Secret and ``up`` warns that alerts
    reach nobody."""
    import pulumi

    from infra.program.multi_region import NO_RECEIVER_WARNING

    assert _alertmanager_secrets(run) == []
    warnings: list[str] = []
    monkeypatch.setattr(pulumi.log, "warn", lambda message, *args, **kwargs: warnings.append(message))
    run_stack(STACK)
    assert NO_RECEIVER_WARNING in warnings and "reach nobody" in NO_RECEIVER_WARNING
    warnings.clear()
    run_stack(STACK, overrides={"duplexops:alertWebhookUrl": "https://hooks.example.com/duplex"})
    assert NO_RECEIVER_WARNING not in warnings


def test_bad_receiver_keys_are_refused_on_multi_region() -> None:
    """The receiver keys are checked on multi-region exactly as on a node."""
    with pytest.raises(StackConfigError) as caught:
        run_stack(STACK, overrides={"duplexops:alertEmailTo": "oncall@example.com"})
    [problem] = caught.value.problems
    assert problem.startswith("duplexops:alertEmailTo: alert receivers rejected: e-mail alerts need")


@pytest.mark.parametrize("region", ["us-central1", "europe-west4"])
def test_each_region_runs_its_turn_gateway(run: StackRun, region: str) -> None:
    """coturn per region (infra.k8s.turn) with the stack's TURN secret, relaying to the region's own pods;
    the runtime names the region's TURN; the output says where to point its DNS name."""
    from infra.k8s.turn import TURN_CONFIG_SECRET, TURN_EGRESS_POLICY, TURN_NAME

    manifests = _manifests(run, region)
    kinds = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    assert {("Deployment", TURN_NAME), ("Service", TURN_NAME), ("Secret", TURN_CONFIG_SECRET)} <= kinds
    # The second fence (issue 34, item 9): coturn's pods send UDP to the runtime pods only.
    [policy] = [m for m in manifests if m["kind"] == "NetworkPolicy"]
    assert policy["metadata"]["name"] == TURN_EGRESS_POLICY
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == TURN_NAME
    assert policy["spec"]["policyTypes"] == ["Egress"]
    [rule] = policy["spec"]["egress"]
    assert rule["to"] == [
        {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "duplex-runtime",
                    "app.kubernetes.io/part-of": "duplexops",
                }
            }
        }
    ]
    assert rule["ports"] == [{"protocol": "UDP"}]
    # Created before the coturn pods: they never run unfenced.
    policy_resource = _one_in_region(run, "kubernetes:networking.k8s.io/v1:NetworkPolicy", region)
    coturn = _one_in_region(run, "kubernetes:apps/v1:Deployment", region, f"-{TURN_NAME}")
    assert policy_resource.urn in run.ordered_after(coturn)
    settings = {"us-central1": 0, "europe-west4": 1}[region]
    [config] = [m for m in manifests if m["kind"] == "Secret" and m["metadata"]["name"] == TURN_CONFIG_SECRET]
    conf = config["stringData"]["turnserver.conf"]
    assert f"allowed-peer-ip=10.{128 + settings}.0.0-10.{128 + settings}.127.255" in conf.splitlines()
    [service] = [m for m in manifests if m["kind"] == "Service" and m["metadata"]["name"] == TURN_NAME]
    # The stack's public source ranges hold for media too (Cloud Armor covers only the HTTPS entry).
    ranges = json.loads(run.config["duplexops:publicSourceRanges"])
    assert service["spec"]["loadBalancerSourceRanges"] == ranges
    turn = run.outputs["regions"][region]["turn"]
    assert turn["host"] == f"turn-{region}.duplex.example.com"
    # The region's reserved address: the Service takes it, the DNS record names it (infra.program.dns).
    address = _one_in_region(run, "gcp:compute/address:Address", region, "turn-address").plain
    assert address["region"] == region and address["addressType"] == "EXTERNAL"
    assert turn["address"] == service["spec"]["loadBalancerIP"] == MOCK_IP
    assert turn["urls"] == [f"turn:turn-{region}.duplex.example.com:3478?transport=udp"]


@pytest.mark.parametrize("region", ["us-central1", "europe-west4"])
def test_the_pods_wait_and_answer_full_before_the_upgrade(run: StackRun, region: str) -> None:
    """Issue 33: no stack turned the waiting room on; a full pod refused after the upgrade, which the URL
    map cannot retry. Defaults: 30 s, as many waiting callers as the pod has slots (a100-80gb: 5)."""
    [runtime] = [
        c
        for m in _manifests(run, region)
        if m["kind"] in ("Deployment", "StatefulSet")
        for c in m["spec"]["template"]["spec"]["containers"]
        if c["name"] == "runtime"
    ]
    env = {e["name"]: e.get("value") for e in runtime["env"]}
    assert env["DUPLEX_WAITING_ROOM_S"] == "30" and env["DUPLEX_WAITING_ROOM_SIZE"] == "5"
    assert env["DUPLEX_FULL_BEFORE_UPGRADE"] == "true"
