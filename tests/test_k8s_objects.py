"""The runtime's Kubernetes objects of one region (``infra.k8s.workload``), built from a ``RegionWorkload``
with plain strings where the stack passes Pulumi Outputs: strict validation against the Kubernetes
schemas, the Deployment's GPU placement, probes and drain, the Service's NEG, the PDB, the HPA, where the
secrets go, and the runtime settings the environment carries."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import subprocess
from dataclasses import replace
from typing import Any

import pytest
from k8s_fixtures import IMAGE, SECRETS, make_workload, one

from infra.k8s import base, scaling
from infra.k8s import workload as k8s_workload
from infra.k8s.manifest import validate_manifests
from infra.k8s.region import region_objects, workload_identity_bindings
from infra.node.profile.profiles import PROFILES, get_profile
from runtime.config import RuntimeConfig


def _runtime_container(deployment: dict) -> dict:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


# --- strict validation ------------------------------------------------------------------------------------


def test_every_object_validates_strictly(objects: list[dict]) -> None:
    assert validate_manifests(objects) == []
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Job"} <= kinds
    assert {"PodMonitoring", "ClusterRules", "APIService"} <= kinds


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d["spec"]["template"]["spec"].update(replica=3), "'replica' was unexpected"),
        (
            lambda d: d["spec"]["template"]["spec"].update(terminationGracePeriodSeconds="3660"),
            "is not of type",
        ),
        (
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="8998"),
            "is not of type",
        ),
        (lambda d: d["metadata"].update(labelz={}), "'labelz' was unexpected"),
    ],
)
def test_a_broken_object_fails(objects: list[dict], mutate: Any, expected: str) -> None:
    deployment = copy.deepcopy(one(objects, "Deployment"))
    mutate(deployment)
    problems = validate_manifests([deployment])
    assert len(problems) == 1, problems
    assert problems[0].startswith("Deployment duplex/duplex-runtime: ")
    assert expected in problems[0]


# --- the Deployment ---------------------------------------------------------------------------------------


def test_deployment_runs_one_gpu_pod_per_node_and_has_no_replicas(objects: list[dict]) -> None:
    deployment = one(objects, "Deployment")
    assert "replicas" not in deployment["spec"]  # the HPA owns it
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    pod = deployment["spec"]["template"]["spec"]
    runtime = _runtime_container(deployment)
    assert runtime["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-a100-80gb"}
    assert runtime["image"] == IMAGE and runtime["args"] == ["serve"]
    assert runtime["ports"] == [{"name": "http", "containerPort": 8998, "protocol": "TCP"}]
    assert pod["serviceAccountName"] == base.RUNTIME_SERVICE_ACCOUNT
    assert deployment["spec"]["template"]["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"


def test_probes_and_drain(objects: list[dict], workload: base.RegionWorkload) -> None:
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    runtime = _runtime_container(deployment)
    startup, liveness, readiness = (
        runtime["startupProbe"],
        runtime["livenessProbe"],
        runtime["readinessProbe"],
    )
    assert startup["httpGet"] == {"path": "/readyz", "port": "http"}  # /healthz answers during the load
    assert liveness["httpGet"] == {"path": "/healthz", "port": "http"}
    assert readiness["httpGet"] == {"path": "/readyz", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60  # a 7B model load
    assert startup["periodSeconds"] * startup["failureThreshold"] == k8s_workload.startup_budget_s() == 1800
    max_session_s = workload.profile.limits.max_session_s
    assert pod["terminationGracePeriodSeconds"] >= max_session_s
    assert pod["terminationGracePeriodSeconds"] == max_session_s + k8s_workload.DRAIN_MARGIN_S == 3660
    env = {e["name"]: e for e in runtime["env"]}
    assert env["DUPLEX_DRAIN_GRACE_S"]["value"] == str(max_session_s)  # running sessions finish
    command = runtime["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"] and command[2].startswith("kill -TERM 1;")
    assert "http://127.0.0.1:8998/healthz" in command[2]


def test_init_container_waits_for_the_weights_marker(
    objects: list[dict], workload: base.RegionWorkload
) -> None:
    deployment = one(objects, "Deployment")
    [init] = deployment["spec"]["template"]["spec"]["initContainers"]
    marker = f"/models/nvidia/personaplex-7b-v1/{base.WEIGHTS_MARKER}"
    assert f'[ -f "{marker}" ]' in init["command"][2]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in init["volumeMounts"]
    env = {e["name"]: e.get("value") for e in _runtime_container(deployment)["env"]}
    assert env["DUPLEX_WEIGHTS"] == "/models/nvidia/personaplex-7b-v1" == base.weights_dir(workload)
    assert env["HF_HUB_OFFLINE"] == "1"


@pytest.mark.skipif(shutil.which("sh") is None, reason="no POSIX shell")
def test_shell_commands_parse(objects: list[dict]) -> None:
    deployment = one(objects, "Deployment")
    runtime = _runtime_container(deployment)
    [init] = deployment["spec"]["template"]["spec"]["initContainers"]
    for command in (runtime["lifecycle"]["preStop"]["exec"]["command"], init["command"]):
        assert command[:2] == ["/bin/sh", "-c"]
        result = subprocess.run(["sh", "-n", "-c", command[2]], capture_output=True, text=True, timeout=10)
        assert result.returncode == 0, result.stderr


def test_pod_and_containers_meet_pod_security_restricted(objects: list[dict]) -> None:
    namespace = one(objects, "Namespace", "duplex")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for obj in objects:
        if obj["kind"] not in ("Deployment", "Job") or obj["metadata"]["namespace"] != "duplex":
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"] + pod.get("initContainers", []):
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"] == {"drop": ["ALL"]}
            assert security["readOnlyRootFilesystem"] is True
    runtime_pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert runtime_pod["securityContext"]["runAsUser"] == base.RUNTIME_UID == 10001


def test_environment_names_are_runtime_settings(objects: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every DUPLEX_* variable is a RuntimeConfig field (a typo fails), and the plain values parse."""
    runtime = _runtime_container(one(objects, "Deployment"))
    names = [e["name"] for e in runtime["env"]]
    assert len(names) == len(set(names))
    fields = set(RuntimeConfig.model_fields)
    duplex = [n for n in names if n.startswith("DUPLEX_")]
    assert [n for n in duplex if n.removeprefix("DUPLEX_").lower() not in fields] == []
    assert set(names) - set(duplex) == {"HF_HUB_OFFLINE", "HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"}
    for name in list(os.environ):
        if name.startswith("DUPLEX_"):
            monkeypatch.delenv(name)
    for var in runtime["env"]:
        if var["name"].startswith("DUPLEX_") and "value" in var:
            monkeypatch.setenv(var["name"], var["value"])
        elif "fieldRef" in var.get("valueFrom", {}):  # the downward API: the pod's name or namespace
            monkeypatch.setenv(var["name"], "duplex-runtime-7d9f-abcde")
    config = RuntimeConfig()
    assert config.host == "0.0.0.0" and config.device == "cuda" and config.max_sessions == 5
    assert str(config.token_keys_file) == base.TOKEN_KEYS_PATH
    assert config.drain_grace_s == config.max_session_s == 3600


# --- Service, PDB, HPA -------------------------------------------------------------------------------------


def test_service_has_the_neg_annotation(objects: list[dict], workload: base.RegionWorkload) -> None:
    service = one(objects, "Service")
    neg = json.loads(service["metadata"]["annotations"]["cloud.google.com/neg"])
    assert neg == {
        "exposed_ports": {"8998": {"name": "duplex-multi-region-runtime"}},
        "zones": ["us-central1-a"],
    }
    [port] = service["spec"]["ports"]
    assert port == {"name": "http", "port": 8998, "targetPort": "http", "protocol": "TCP"}
    container_port = _runtime_container(one(objects, "Deployment"))["ports"][0]["containerPort"]
    assert str(container_port) in neg["exposed_ports"]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"] == base.pod_labels(workload)


def test_pdb_allows_one_disruption_of_the_runtime_pods(objects: list[dict]) -> None:
    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["maxUnavailable"] == 1
    pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert selector == one(objects, "Deployment")["spec"]["selector"]["matchLabels"]


def test_hpa_scales_on_active_sessions_per_pod(objects: list[dict]) -> None:
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": base.APP_NAME,
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "prometheus.googleapis.com|duplex_active_sessions|gauge"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "4"}  # 5 slots x 0.8
    behavior = hpa["spec"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 600


@pytest.mark.parametrize(
    ("sessions", "utilization", "expected"),
    [(5, 0.8, "4"), (3, 0.8, "2400m"), (2, 0.75, "1500m"), (1, 0.8, "800m"), (8, 1.0, "8")],
)
def test_hpa_target_is_slots_times_utilization(sessions: int, utilization: float, expected: str) -> None:
    profile = get_profile("a100-80gb", max_sessions=sessions)
    workload = make_workload(profile=profile, target_slot_utilization=utilization)
    assert scaling.hpa_target_average(workload) == expected


# --- secrets and the weights Job ---------------------------------------------------------------------------


def test_secret_values_appear_only_in_secrets_string_data(objects: list[dict]) -> None:
    secrets = [o for o in objects if o["kind"] == "Secret"]
    assert {s["metadata"]["name"] for s in secrets} == {base.SECRET_NAME, "grafana-admin"}
    for obj in objects:
        shown = {k: v for k, v in obj.items() if not (obj["kind"] == "Secret" and k == "stringData")}
        text = json.dumps(shown)
        for name, value in SECRETS.items():
            assert value not in text, f"{obj['kind']} {obj['metadata']['name']} holds {name}"
    runtime_secret = one(objects, "Secret", base.SECRET_NAME)
    assert runtime_secret["type"] == "Opaque"
    data = runtime_secret["stringData"]
    assert data["redis-url"] == (
        "rediss://:redis-pw-0123456789abcdef@10.64.0.3:6378/0"
        "?ssl_ca_certs=/etc/duplex/redis-ca/ca.pem&ssl_check_hostname=false"
    )
    assert data["token_keys.json"] == SECRETS["token_keys_json"]
    assert data["hf-token"] == SECRETS["hf_token"]
    assert (
        "hf-token"
        not in one(region_objects(make_workload(hf_token=None)), "Secret", base.SECRET_NAME)["stringData"]
    )


def test_redis_url_is_what_redis_py_reads() -> None:
    from redis.connection import parse_url

    url = base.redis_url("10.64.0.3", 6378, "p@ss/w:rd")
    parsed = parse_url(url)
    assert parsed["password"] == "p@ss/w:rd"
    assert (parsed["host"], parsed["port"], parsed["db"]) == ("10.64.0.3", 6378, 0)
    assert parsed["ssl_ca_certs"] == base.REDIS_CA_PATH
    assert parsed["ssl_check_hostname"] is False
    assert parsed["connection_class"].__name__ == "SSLConnection"
    with pytest.raises(ValueError, match="port"):
        base.redis_url("10.64.0.3", 70000, "pw")


def test_given_redis_url_is_used_as_is() -> None:
    url = "rediss://:other@10.0.0.9:6378/0?ssl_ca_certs=/etc/duplex/redis-ca/ca.pem&ssl_check_hostname=false"
    secret = one(region_objects(make_workload(redis_url=url)), "Secret", base.SECRET_NAME)
    assert secret["stringData"]["redis-url"] == url


def test_weights_job_downloads_the_presets_repo_on_a_cpu_node(objects: list[dict]) -> None:
    job = one(objects, "Job", base.WEIGHTS_JOB)
    pod = job["spec"]["template"]["spec"]
    assert "tolerations" not in pod and "nodeSelector" not in pod
    assert pod["serviceAccountName"] == base.WEIGHTS_SERVICE_ACCOUNT
    assert job["spec"]["template"]["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
    [container] = pod["containers"]
    assert container["command"][:2] == ["python", "-c"]
    assert container["command"][3:] == [
        "nvidia/personaplex-7b-v1",
        "/models/nvidia/personaplex-7b-v1",
        ".duplex-complete",
    ]
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    [volume] = [v for v in pod["volumes"] if v["name"] == "models"]
    assert volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
    assert volume["csi"]["readOnly"] is False
    assert volume["csi"]["volumeAttributes"]["bucketName"] == "duplex-models-us-central1"
    assert {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": base.SECRET_NAME, "key": "hf-token"}},
    } in (container["env"])
    assert job["spec"]["backoffLimit"] >= 1
    runtime_models = [
        v for v in one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"
    ]
    assert runtime_models[0]["csi"]["readOnly"] is True
    assert "file-cache:max-size-mb" in runtime_models[0]["csi"]["volumeAttributes"]["mountOptions"]


def test_service_accounts_and_workload_identity(objects: list[dict], workload: base.RegionWorkload) -> None:
    emails = {
        "runtime": workload.runtime_service_account,
        "weights": workload.weights_service_account,
        "monitoring": workload.monitoring_service_account,
    }
    for role, namespace, name in workload_identity_bindings(workload.namespace):
        [account] = [
            o
            for o in objects
            if o["kind"] == "ServiceAccount"
            and (o["metadata"]["namespace"], o["metadata"]["name"]) == (namespace, name)
        ]
        expected = emails[role]
        assert account["metadata"]["annotations"] == {"iam.gke.io/gcp-service-account": expected}


# --- RegionWorkload validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"region": "US-Central1"}, "RegionWorkload.region"),
        ({"cluster_name": "x" * 41}, "RegionWorkload.cluster_name"),
        ({"namespace": "kube-system"}, "RegionWorkload.namespace"),
        (
            {"accelerator": "nvidia-l4"},
            "the profile's GPU 'a100-80gb-sxm' is GKE accelerator 'nvidia-a100-80gb'",
        ),
        ({"accelerator": "tpu-v5"}, "RegionWorkload.accelerator"),
        ({"min_replicas": 0}, "RegionWorkload.min_replicas"),
        ({"min_replicas": 3, "max_replicas": 2}, "must be >= min_replicas"),
        ({"target_slot_utilization": 1.5}, "target_slot_utilization"),
        ({"image": "us-docker.pkg.dev/p/r/runtime:latest"}, "digest-pinned"),
        ({"redis_port": 0}, "RegionWorkload.redis_port"),
        ({"neg_name": "Runtime_NEG"}, "RegionWorkload.neg_name"),
        ({"runtime_service_account": "runtime"}, "service account email"),
        ({"token_keys_json": "not json"}, "token_keys_json"),
        ({"profile": PROFILES["local"]}, "must have a GPU"),
    ],
)
def test_bad_fields_are_refused_with_the_field_named(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_workload(**overrides)


def test_secrets_are_hidden_from_repr(workload: base.RegionWorkload) -> None:
    text = repr(workload)
    for value in SECRETS.values():
        assert value not in text


def test_outputs_are_placed_untouched() -> None:
    """Values the stack passes as Outputs are placed as they are (here: marker objects)."""

    class Opaque:
        pass

    image, bucket, ca = Opaque(), Opaque(), Opaque()
    workload = make_workload(image=image, weights_bucket=bucket, redis_ca_certificate=ca, redis_url=Opaque())
    objects = region_objects(workload)
    deployment = one(objects, "Deployment")
    assert _runtime_container(deployment)["image"] is image
    [models] = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]
    assert models["csi"]["volumeAttributes"]["bucketName"] is bucket
    assert one(objects, "ConfigMap", base.REDIS_CA_CONFIGMAP)["data"]["ca.pem"] is ca


def test_lift_joins_outputs_with_output_all() -> None:
    pulumi = pytest.importorskip("pulumi")
    assert base.lift(base.redis_address, "10.0.0.3", 6378) == "rediss://10.0.0.3:6378"
    # A loop of its own: an async test before this one may have closed and unset the thread's loop.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        joined = base.lift(base.redis_address, pulumi.Output.from_input("10.0.0.3"), 6378)
        assert isinstance(joined, pulumi.Output)
        assert loop.run_until_complete(joined.future()) == "rediss://10.0.0.3:6378"
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def test_namespace_changes_every_namespaced_object() -> None:
    objects = region_objects(replace(make_workload(), namespace="voice"))
    namespaced = [
        o for o in objects if o["metadata"].get("namespace") not in (None, "custom-metrics", "kube-system")
    ]
    assert namespaced and all(o["metadata"]["namespace"] == "voice" for o in namespaced)
    assert validate_manifests(objects) == []


# --- the zones and the browser client's page (issue 20 items 2 and 4) ------------------------------------


def test_runtime_pods_spread_over_every_zone() -> None:
    """Issue 20 item 2: a zone's NEG exists only with a pod there; the Deployment spreads its pods over the
    zones as a scheduling rule and the workload refuses fewer pods than zones."""
    two = make_workload(zones=("us-central1-a", "us-central1-c"), min_replicas=2)
    deployment = one(region_objects(two), "Deployment")
    [spread] = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread == {
        "maxSkew": 1,
        "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": base.pod_labels(two)},
    }
    with pytest.raises(
        ValueError, match=r"min_replicas: 1 is not allowed; must be >= the number of zones \(2\)"
    ):
        make_workload(zones=("us-central1-a", "us-central1-c"), min_replicas=1)
    with pytest.raises(ValueError, match="RegionWorkload.zones"):
        make_workload(zones=("europe-west4-a",))


def test_page_objects_validate_and_serve_from_the_system_pool(objects: list[dict]) -> None:
    from infra.k8s.page import PAGE_NAME, PAGE_PORT

    page = [o for o in objects if o["metadata"]["name"] == PAGE_NAME]
    assert sorted(o["kind"] for o in page) == ["ConfigMap", "Deployment", "Service"]
    assert validate_manifests(page) == []
    pod = one(objects, "Deployment", PAGE_NAME)["spec"]["template"]["spec"]
    assert "tolerations" not in pod and "nodeSelector" not in pod  # never on a (tainted) GPU node
    assert pod["securityContext"]["runAsNonRoot"] is True
    [nginx] = pod["containers"]
    assert nginx["securityContext"]["readOnlyRootFilesystem"] is True
    assert nginx["ports"][0]["containerPort"] == PAGE_PORT


def _get(url: str, method: str = "GET") -> tuple[int, str, bytes]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, method=method, data=b"x" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("Content-Type", ""), error.read()


def test_page_nginx_serves_the_client(tmp_path: Any) -> None:
    """Issue 20 item 4: the page pods' nginx configuration, run by the real nginx on loopback: ``/`` is
    ``index.html``, each file has its type, anything else is 404, and only GET is served."""
    import socket
    import tempfile
    import time
    from pathlib import Path

    from infra.k8s.page import page_files, page_nginx_conf

    # nginx's workers run as another user when the tests run as root: a root they may read (tmp_path is 0700).
    root = Path(tempfile.mkdtemp(prefix="duplex-page-"))
    root.chmod(0o755)
    files = page_files()
    for name, content in files.items():
        (root / name).write_text(content)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    conf = page_nginx_conf(root=str(root), port=port, temp_dir=str(tmp_path)).replace(
        f"listen {port};", f"listen 127.0.0.1:{port};"
    )
    (tmp_path / "nginx.conf").write_text(conf)
    server = subprocess.Popen(
        [
            "nginx",
            "-p",
            f"{tmp_path}/",
            "-c",
            str(tmp_path / "nginx.conf"),
            "-e",
            "stderr",
            "-g",
            "daemon off;",
        ],
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(100):  # until it listens (not a timing assertion: at most 100 tries)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None, server.stderr.read() if server.stderr else ""
                time.sleep(0.05)
        status, kind, body = _get(f"http://127.0.0.1:{port}/")
        assert (status, kind, body.decode()) == (200, "text/html", files["index.html"])
        status, kind, _ = _get(f"http://127.0.0.1:{port}/app.js")
        assert (status, kind) == (200, "text/javascript")
        assert _get(f"http://127.0.0.1:{port}/metrics")[0] == 404
        assert _get(f"http://127.0.0.1:{port}/index.html", method="POST")[0] == 403
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(root)
