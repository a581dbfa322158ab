"""The Pulumi program of the three single-node stacks (dev, scale5-gcp, scale5-onprem), run whole under
Pulumi's mocks with each stack's own ``stacks/Pulumi.<stack>.yaml`` (``tests/pulumi_harness.py``): no
CLI, no engine, no cloud. Checked: the resource inventory, the properties that matter (GPU, machine type,
maintenance policy, firewall, service account roles, Shielded VM, the cloud-init user-data, the remote
commands of the on-premises node), that secrets stay secret, and that every configuration error stops
the program before it declares anything, naming the key, the value and what is allowed.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import shutil
import stat
import subprocess
from collections import Counter
from pathlib import Path

import pulumi_harness
import pytest
import yaml
from pulumi_harness import STACKS, StackRun, load_stack_file, run_stack

from infra.capacity import max_sessions, plan
from infra.capacity.gcp import MACHINE_TYPES
from infra.node.bundle.compose import CONTAINER_READ_SECRETS
from infra.node.bundle.redis_acl import redis_url, render_acl_users
from infra.node.bundle.services import SECRET_FILES
from infra.node.profile.profiles import get_profile
from infra.stack_config import StackConfigError

REPO = pulumi_harness.REPO_ROOT
IAP_RANGE = "35.235.240.0/20"


def _onprem():  # noqa: ANN202
    """``infra.components.onprem_node``, imported after the harness set the mocks (as a program would)."""
    from infra.components import onprem_node

    return onprem_node


GCE_STACKS = ("dev", "scale5-gcp")

INSTANCE = "gcp:compute/instance:Instance"
FIREWALL = "gcp:compute/firewall:Firewall"
COMMAND = "command:remote:Command"

GCE_INVENTORY = {
    "gcp:projects/service:Service": 6,  # monitoring: the uptime check
    "duplexops:components:NodeUptimeCheck": 1,
    "gcp:monitoring/uptimeCheckConfig:UptimeCheckConfig": 1,
    "gcp:monitoring/alertPolicy:AlertPolicy": 1,
    "duplexops:components:RuntimeImage": 1,
    "gcp:artifactregistry/repository:Repository": 1,
    "docker-build:index:Image": 1,
    "duplexops:components:StackSecrets": 1,
    "random:index/randomPassword:RandomPassword": 5,  # the application-token key: the 5th
    "gcp:secretmanager/secret:Secret": 10,  # secrets/events-consumer.env: the 9th; app_token_keys.json
    "gcp:secretmanager/secretVersion:SecretVersion": 10,
    "duplexops:components:GceGpuNode": 1,
    "gcp:compute/network:Network": 1,
    "gcp:compute/subnetwork:Subnetwork": 1,
    "gcp:compute/firewall:Firewall": 3,
    "gcp:compute/address:Address": 1,
    "gcp:serviceaccount/account:Account": 1,
    "gcp:projects/iAMMember:IAMMember": 2,
    "gcp:artifactregistry/repositoryIamMember:RepositoryIamMember": 1,
    "gcp:secretmanager/secretIamMember:SecretIamMember": 10,
    "gcp:compute/instance:Instance": 1,
    "gcp:compute/disk:Disk": 1,
}
SPOT_EXTRAS = {
    "gcp:projects/service:Service": 1,  # cloudscheduler
    "gcp:serviceaccount/account:Account": 1,
    "gcp:compute/instanceIAMMember:InstanceIAMMember": 1,
    "gcp:cloudscheduler/job:Job": 1,
}
"""What a Spot node (dev) has more: the job that starts it again after a preemption."""
ONPREM_INVENTORY = {
    "duplexops:components:StackSecrets": 1,
    "random:index/randomPassword:RandomPassword": 5,
    "duplexops:components:OnPremNode": 1,
    "command:remote:Command": 7,
    "command:remote:CopyToRemote": 1,
    "duplexops:components:RegistryPuller": 1,
    # iamcredentials (the puller's token); the puller account and its grants are the bootstrap's.
    "gcp:projects/service:Service": 1,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, StackRun]:
    """Each stack's program, run once with its own stack file (and fake secret config)."""
    return {stack: run_stack(stack, build_dir=tmp_path_factory.mktemp(stack)) for stack in STACKS}


# --- the project and the stack files -------------------------------------------------------------------


def test_pulumi_project_file() -> None:
    project = yaml.safe_load((REPO / "Pulumi.yaml").read_text())
    assert project["name"] == "duplexops"
    assert project["runtime"] == {"name": "python", "options": {"toolchain": "pip", "virtualenv": ".venv"}}
    assert project["main"] == "infra/"
    assert project["stackConfigDir"] == "stacks"
    assert project["description"]
    assert (REPO / "infra" / "__main__.py").is_file()


@pytest.mark.parametrize("stack", STACKS)
def test_stack_files_hold_no_secret(stack: str) -> None:
    text = (REPO / "stacks" / f"Pulumi.{stack}.yaml").read_text()
    config = load_stack_file(stack)
    assert "secure:" not in text
    keys = ["redisPassword", "grafanaAdminPassword", "tokenSigningKeys", "hfToken"]
    if config["duplexops:topology"] == "onprem-node":
        keys.append("onpremSshPrivateKey")
    for key in keys:
        assert f"duplexops:{key}" not in config
        assert f"--secret {key}" in text, f"the comment block shows how to set {key}"


# --- inventory -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_inventory(runs: dict[str, StackRun], stack: str) -> None:
    expected = Counter(ONPREM_INVENTORY if stack == "scale5-onprem" else GCE_INVENTORY)
    if stack == "dev":
        expected.update(SPOT_EXTRAS)
    assert runs[stack].inventory == expected


@pytest.mark.parametrize("stack", STACKS)
def test_children_are_parented_to_their_components(runs: dict[str, StackRun], stack: str) -> None:
    run = runs[stack]
    assert all(r.urn for r in run.resources), "every resource has a URN"
    for r in run.resources:
        if r.type == "gcp:projects/service:Service" or not r.custom:
            assert r.parent_types == [], "project APIs and the components belong to the stack"
        else:
            assert r.parent_types and r.parent_types[0].startswith("duplexops:components:"), r.urn
    [component] = [r for r in run.resources if r.type.endswith(("GceGpuNode", "OnPremNode"))]
    node_children = [r for r in run.resources if r.parent_types[:1] == [component.type]]
    assert len(node_children) >= 7


# --- GCE: the VM -----------------------------------------------------------------------------------------


def test_dev_vm_is_n1_with_one_t4(runs: dict[str, StackRun]) -> None:
    vm = runs["dev"].one(INSTANCE).plain
    assert vm["machineType"] == "n1-standard-8"
    assert vm["guestAccelerators"] == [{"type": "nvidia-tesla-t4", "count": 1}]
    assert vm["zone"] == "us-central1-a" and vm["project"] == "my-gcp-project"


def test_scale5_gcp_vm_is_a2_ultragpu_with_its_builtin_a100(runs: dict[str, StackRun]) -> None:
    vm = runs["scale5-gcp"].one(INSTANCE).plain
    assert vm["machineType"] == "a2-ultragpu-1g"
    # The capacity catalog: A2 types come with their GPU (bundled); attaching one would be refused.
    assert MACHINE_TYPES["a2-ultragpu-1g"].bundled and MACHINE_TYPES["a2-ultragpu-1g"].gpu == "a100-80gb-sxm"
    assert not vm.get("guestAccelerators")


@pytest.mark.parametrize("stack", GCE_STACKS)
def test_vm_scheduling_disk_and_shielded_vm(runs: dict[str, StackRun], stack: str) -> None:
    vm = runs[stack].one(INSTANCE).plain
    assert vm["scheduling"]["onHostMaintenance"] == "TERMINATE"
    # dev runs on Spot (no automatic restart), scale5-gcp on demand (restarts after a host event).
    assert vm["scheduling"]["automaticRestart"] is (stack == "scale5-gcp")
    params = vm["bootDisk"]["initializeParams"]
    from infra.components.gce_node import BOOT_IMAGE

    assert params["image"] == BOOT_IMAGE
    assert params["image"] == (
        "projects/deeplearning-platform-release/global/images/family/common-cu128-ubuntu-2204-nvidia-570"
    )
    assert params["size"] == 200
    # Secure Boot off: the DLVM's DKMS-built NVIDIA modules are unsigned (infra.components.gce_node).
    assert vm["shieldedInstanceConfig"] == {
        "enableSecureBoot": False,
        "enableVtpm": True,
        "enableIntegrityMonitoring": True,
    }
    assert vm["metadata"]["enable-oslogin"] == "TRUE"
    assert vm["networkInterfaces"][0]["accessConfigs"][0]["natIp"] == pulumi_harness.MOCK_IP


@pytest.mark.parametrize("stack", GCE_STACKS)
def test_firewall_opens_only_web_turn_and_iap_ssh(runs: dict[str, StackRun], stack: str) -> None:
    run = runs[stack]
    rules = {r.plain["name"]: r.plain for r in run.of_type(FIREWALL)}
    tag = run.one(INSTANCE).plain["tags"]
    opened: dict[str, set[str]] = {}
    for rule in rules.values():
        assert rule["direction"] == "INGRESS"
        assert rule["targetTags"] == tag
        for allow in rule["allows"]:
            for port in allow["ports"]:
                opened.setdefault(f"{port}/{allow['protocol']}", set()).update(rule["sourceRanges"])
    # Media: the TURN relay's UDP and TLS listeners only; not its relay range, not the runtime's ICE ports.
    assert opened.keys() == {"22/tcp", "80/tcp", "443/tcp", "3478/udp", "5349/tcp"}
    from infra.components.gce_node import IAP_SOURCE_RANGE

    assert opened["22/tcp"] == {IAP_SOURCE_RANGE} == {IAP_RANGE}
    stack_ranges = set(load_stack_file(stack)["duplexops:publicSourceRanges"])
    assert opened["443/tcp"] == opened["80/tcp"] == stack_ranges
    assert opened["3478/udp"] == opened["5349/tcp"] == stack_ranges
    assert "9090/tcp" not in opened and "3000/tcp" not in opened
    # A network of its own: the default network's allow-ssh-from-anywhere rule does not apply.
    assert run.one("gcp:compute/network:Network").plain["autoCreateSubnetworks"] is False


@pytest.mark.parametrize("stack", GCE_STACKS)
def test_service_account_has_least_privilege(runs: dict[str, StackRun], stack: str) -> None:
    run = runs[stack]
    account = run.named("node-service-account").plain
    email = f"{account['accountId']}@my-gcp-project.iam.gserviceaccount.com"
    member = f"serviceAccount:{email}"
    vm = run.one(INSTANCE).plain
    assert vm["serviceAccount"]["email"] == email
    assert vm["serviceAccount"]["scopes"] == ["https://www.googleapis.com/auth/cloud-platform"]

    bindings = [
        r.plain
        for r in run.resources
        if r.type.startswith("gcp:")
        and ("IamMember" in r.type or "IAMMember" in r.type)
        and r.name != "node-restarter-starts-vm"  # the Spot restarter's own account (test_spot_...)
    ]
    roles = Counter(b["role"] for b in bindings)
    assert roles == {
        "roles/logging.logWriter": 1,
        "roles/monitoring.metricWriter": 1,
        "roles/artifactregistry.reader": 1,
        "roles/secretmanager.secretAccessor": len(SECRET_FILES) + 1,
    }
    assert all(b["member"] == member for b in bindings)
    assert not any(re.search(r"editor|owner|admin", b["role"]) for b in bindings)
    [reader] = run.of_type("gcp:artifactregistry/repositoryIamMember:RepositoryIamMember")
    repo = run.one("gcp:artifactregistry/repository:Repository").plain
    assert reader.plain["repository"] == repo["repositoryId"] and reader.plain["location"] == repo["location"]
    # Secret access on the node's own secrets only.
    own = {s.plain["secretId"] for s in run.of_type("gcp:secretmanager/secret:Secret")}
    granted = {b.plain["secretId"] for b in run.of_type("gcp:secretmanager/secretIamMember:SecretIamMember")}
    assert granted == own


# --- GCE: the user-data --------------------------------------------------------------------------------


def _user_data(run: StackRun) -> str:
    return run.one(INSTANCE).plain["metadata"]["user-data"]


def _written_files(user_data: str) -> dict[str, bytes]:
    document = yaml.safe_load(user_data)
    files = {}
    for entry in document["write_files"]:
        content = entry["content"]
        if entry.get("encoding") == "gz+b64":
            files[entry["path"]] = gzip.decompress(base64.b64decode(content))
        else:
            files[entry["path"]] = content.encode()
    return files


@pytest.mark.parametrize("stack", GCE_STACKS)
def test_user_data_installs_the_bundle_running_the_image_digest(
    runs: dict[str, StackRun], stack: str
) -> None:
    run = runs[stack]
    user_data = _user_data(run)
    assert user_data.startswith("#cloud-config\n")
    files = _written_files(user_data)
    for path in ("compose.yaml", "nginx/nginx.conf", "redis/redis.conf", "prometheus/prometheus.yml"):
        assert f"/etc/duplex/{path}" in files, path
    assert "/etc/systemd/system/duplex-node.service" in files
    image = run.outputs["image"]
    assert re.fullmatch(
        r"us-central1-docker\.pkg\.dev/my-gcp-project/[a-z0-9-]+/duplex-runtime@sha256:[0-9a-f]{64}", image
    )
    compose = yaml.safe_load(files["/etc/duplex/compose.yaml"])
    # The digest is not in the user-data (a new one must not replace the VM): the repository with a
    # digest of zeros, and the digest in the rollout metadata key the node's agent follows.
    assert compose["services"]["runtime"]["image"] == image.split("@")[0] + "@sha256:" + "0" * 64
    assert run.one(INSTANCE).plain["metadata"]["duplex-runtime-image"] == image
    assert image.split("@")[1] not in user_data
    profile = load_stack_file(stack)["duplexops:profile"]
    sessions = runs[stack].outputs["capacity"]["sessions_per_node"]
    assert compose["services"]["runtime"]["environment"]["DUPLEX_MAX_SESSIONS"] == str(sessions)
    assert f"for profile {profile!r}" in user_data
    # Secrets named by Secret Manager id, never their values; Docker logs in to the image's registry.
    prepare = files["/usr/local/sbin/duplex-node-prepare"].decode()
    for secret_id in run.outputs["node"]["secretIds"].values():
        assert secret_id in prepare
    assert "docker login --username oauth2accesstoken" in prepare
    for value in run.secret_values:
        assert value not in user_data


@pytest.mark.parametrize("stack", GCE_STACKS)
def test_user_data_passes_cloud_init_schema(runs: dict[str, StackRun], stack: str, tmp_path: Path) -> None:
    binary = shutil.which("cloud-init")
    if binary is None:
        pytest.skip("cloud-init is not installed (apt-get install cloud-init); CI installs it")
    path = tmp_path / "user-data.yaml"
    path.write_text(_user_data(runs[stack]))
    result = subprocess.run(
        [binary, "schema", "--config-file", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- GCE: image and secrets ----------------------------------------------------------------------------


@pytest.mark.parametrize("stack", GCE_STACKS)
def test_image_is_built_from_the_repo_and_pushed(runs: dict[str, StackRun], stack: str) -> None:
    run = runs[stack]
    image = run.one("docker-build:index:Image")
    spec = image.plain
    assert spec["push"] is True
    assert (Path.cwd() / spec["context"]["location"]).resolve() == REPO
    assert (Path.cwd() / spec["dockerfile"]["location"]).resolve() == REPO / "images/runtime/Dockerfile"
    [registry] = spec["registries"]
    assert registry["address"] == "us-central1-docker.pkg.dev"
    assert registry["username"] == "oauth2accesstoken"
    assert registry["password"] == pulumi_harness.MOCK_ACCESS_TOKEN
    assert image.is_secret("registries"), "the registry token is secret"
    repo = run.one("gcp:artifactregistry/repository:Repository").plain
    assert repo["format"] == "DOCKER"
    assert spec["tags"][0].startswith(f"us-central1-docker.pkg.dev/my-gcp-project/{repo['repositoryId']}/")
    assert any(c.token == "gcp:organizations/getClientConfig:getClientConfig" for c in run.calls)


@pytest.mark.parametrize("stack", GCE_STACKS)
def test_secret_manager_holds_the_node_secrets(runs: dict[str, StackRun], stack: str) -> None:
    run = runs[stack]
    secrets = {s.name: s.plain for s in run.of_type("gcp:secretmanager/secret:Secret")}
    assert all(s["replication"] == {"auto": {}} for s in secrets.values())
    roles = {s["labels"]["role"] for s in secrets.values()}
    assert roles == {r.replace("_", "-") for r in [*SECRET_FILES, "hf_token"]}
    versions = run.of_type("gcp:secretmanager/secretVersion:SecretVersion")
    assert all(v.is_secret("secretData") for v in versions)
    payloads = {v.name: v.plain["secretData"] for v in versions}
    [redis_pw] = [
        pulumi_harness._mock_password(r.name)
        for r in run.of_type("random:index/randomPassword:RandomPassword")
        if "redis" in r.name
    ]
    assert payloads["secrets-redis-password-version"] == redis_pw
    assert payloads["secrets-redis-auth-conf-version"] == render_acl_users(redis_pw)  # the users, default off
    # The runtime and coturn share the TURN secret (runtime/frontend/transports/webrtc/turn.py,
    # infra.node.bundle.coturn).
    turn = pulumi_harness._mock_password("secrets-turn-secret")
    assert payloads["secrets-runtime-env-version"] == (
        f"DUPLEX_REDIS_URL={redis_url(redis_pw, 'runtime', 'redis', 6379)}\nDUPLEX_TURN_SECRET={turn}\n"
    )
    assert payloads["secrets-events-consumer-env-version"] == (
        f"DUPLEX_EVENTS_REDIS_URL={redis_url(redis_pw, 'events', 'redis', 6379)}\n"
    )
    assert f"\nstatic-auth-secret={turn}\n" in payloads["secrets-turnserver-conf-version"]
    assert payloads["secrets-hf-token-version"] == pulumi_harness.FAKE_SECRETS["gce-node"]["hfToken"]
    generated = run.of_type("random:index/randomPassword:RandomPassword")
    assert {r.name: r.plain["length"] for r in generated} == {
        "secrets-redis-password": 32,
        "secrets-grafana-admin-password": 32,
        "secrets-token-signing-key": 48,
        "secrets-app-token-signing-key": 48,
        "secrets-turn-secret": 48,
    }
    assert all(r.plain["special"] is False for r in generated)
    token_secret = pulumi_harness._mock_password("secrets-token-signing-key")
    app_secret = pulumi_harness._mock_password("secrets-app-token-signing-key")
    prefix = run.outputs["node"]["instance"].removesuffix("-node")
    assert json.loads(payloads["secrets-token-keys-version"]) == {f"{prefix}-1": token_secret}
    # The sessions API's keys are not the session keys (issue 34, item 8).
    assert json.loads(payloads["secrets-app-token-keys-version"]) == {f"{prefix}-app-1": app_secret}
    assert app_secret != token_secret


def test_configured_passwords_are_used_and_stay_secret(tmp_path: Path) -> None:
    given = {
        "redisPassword": "RedisPasswordFromConfig0123456789",
        "grafanaAdminPassword": "GrafanaPasswordFromConfig0123456",
        "tokenSigningKeys": json.dumps({"backend-2026": "k" * 43}),
        "hfToken": "hf_FromConfig0123456789",
    }
    run = run_stack("dev", secrets=given, build_dir=tmp_path)
    # Only the TURN secret and the application-token key are generated whatever is configured (no stack
    # key for them yet).
    generated = run.of_type("random:index/randomPassword:RandomPassword")
    # Sorted: Pulumi registers resources from Outputs' callbacks, in an order a loaded machine can change
    # (CI run of 2026-11-29 saw the TURN secret first).
    assert sorted(r.name for r in generated) == ["secrets-app-token-signing-key", "secrets-turn-secret"]
    versions = {v.name: v for v in run.of_type("gcp:secretmanager/secretVersion:SecretVersion")}
    assert versions["secrets-redis-password-version"].plain["secretData"] == given["redisPassword"]
    assert (
        versions["secrets-grafana-admin-password-version"].plain["secretData"]
        == given["grafanaAdminPassword"]
    )
    tokens = versions["secrets-token-keys-version"].plain["secretData"]
    assert json.loads(tokens) == {"backend-2026": "k" * 43}
    assert all(v.is_secret("secretData") for v in versions.values())
    dumped = json.dumps(run.outputs)
    assert not any(value in dumped for value in given.values())


# --- GCE: outputs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", GCE_STACKS)
def test_gce_outputs(runs: dict[str, StackRun], stack: str) -> None:
    run = runs[stack]
    out = run.outputs
    instance = run.one(INSTANCE).plain["name"]
    assert out["endpoint"] == f"wss://{pulumi_harness.MOCK_IP}/api/chat"
    assert out["ssh"] == (
        f"gcloud compute ssh {instance} --project my-gcp-project --zone us-central1-a --tunnel-through-iap"
    )
    assert out["grafana"]["url"] == "http://localhost:3000"
    assert out["grafana"]["tunnel"].endswith("--tunnel-through-iap -- -N -L 3000:127.0.0.1:3000")
    assert out["image"].startswith("us-central1-docker.pkg.dev/") and "@sha256:" in out["image"]
    assert out["tokenKeys"].startswith("gcloud secrets versions access latest --secret=")
    assert out["mintToken"].startswith("duplex token mint --key-file token_keys.json")
    assert re.search(r"--audience [a-z0-9.-]+ ", out["mintToken"])
    capacity = out["capacity"]
    machine_type = run.one(INSTANCE).plain["machineType"]
    price = MACHINE_TYPES[machine_type].price
    assert price is not None
    assert capacity["machine_type"] == machine_type
    assert capacity["usd_per_month"] == pytest.approx(price.usd_per_hour * 730, abs=0.01)
    assert capacity["price_source"] == price.source


def test_capacity_outputs_follow_the_planner(runs: dict[str, StackRun]) -> None:
    dev = runs["dev"].outputs["capacity"]
    assert dev["sessions_per_node"] == max_sessions("personaplex-7b", "t4", "int8") >= 1
    assert runs["scale5-gcp"].outputs["capacity"]["sessions_per_node"] == 5
    assert runs["scale5-onprem"].outputs["capacity"]["sessions_per_node"] == 5
    scale5 = plan("personaplex-7b", "a100-80gb-sxm", "bf16", 5, machine_type="a2-ultragpu-1g")
    assert runs["scale5-gcp"].outputs["capacity"]["usd_per_month"] == round(scale5.power.cloud_usd_month, 2)


@pytest.mark.parametrize("stack", STACKS)
def test_no_secret_in_outputs(runs: dict[str, StackRun], stack: str) -> None:
    run = runs[stack]
    assert run.secret_outputs == set(), "outputs are plain: they must not carry secrets"
    dumped = json.dumps(run.outputs)
    assert run.secret_values, "the run handled secrets"
    for value in run.secret_values:
        assert value not in dumped
    assert pulumi_harness.MOCK_ACCESS_TOKEN not in dumped


# --- on-premises -----------------------------------------------------------------------------------------


def _commands(run: StackRun) -> dict[str, dict]:
    return {r.name.removeprefix("node-"): r.plain for r in run.of_type(COMMAND)}


def test_onprem_steps_and_their_order(runs: dict[str, StackRun]) -> None:
    run = runs["scale5-onprem"]
    commands = _commands(run)
    assert set(commands) == {
        "gpu-check",
        "stage",
        "install",
        "secrets",
        "registry-login",
        "compose-up",
        "ready",
    }
    assert "nvidia-smi --query-gpu=name,memory.total --format=csv,noheader" in commands["gpu-check"]["create"]
    assert "L40S" in commands["gpu-check"]["create"]
    up = commands["compose-up"]
    assert "docker compose" in up["create"] and "up -d" in up["create"]
    assert "/opt/duplex/bin/prepare-host.sh" in up["create"]
    assert "docker compose" in up["delete"] and " down" in up["delete"]
    # Destroy removes installDir and nothing else.
    assert re.findall(r"rm -rf (\S+)", up["delete"]) == ["/opt/duplex"]
    ready = commands["ready"]["create"]
    assert "curl -k" in ready and "https://127.0.0.1/readyz" in ready
    assert "1800" in ready
    copy = run.one("command:remote:CopyToRemote")
    assert copy.plain["remotePath"] == "/opt/duplex/.staging"
    # Registration order is the order the steps run in (each depends on the one before).
    order = [r.name for r in run.resources if r.type.startswith("command:remote:")]
    assert order == [
        "node-gpu-check",
        "node-stage",
        "node-bundle",
        "node-install",
        "node-secrets",
        "node-registry-login",
        "node-compose-up",
        "node-ready",
    ]


def test_onprem_steps_rerun_when_the_bundle_changes(runs: dict[str, StackRun], tmp_path: Path) -> None:
    run = runs["scale5-onprem"]
    profile = get_profile(
        "l40s",
        max_sessions=5,
        runtime_image=run.outputs["image"],
        limits={**get_profile("l40s").limits.model_dump(), "drain_grace_s": 300},
        tls={"certificate_path": "/opt/duplex/tls/node.crt", "private_key_path": "/opt/duplex/tls/node.key"},
    )
    digest = _onprem().bundle_digest(_onprem().onprem_bundle(profile, "/opt/duplex"))
    commands = _commands(run)
    for step in ("gpu-check", "stage", "install", "secrets", "ready"):
        assert commands[step]["triggers"] == [digest], step
    assert run.one("command:remote:CopyToRemote").plain["triggers"] == [digest]
    # compose-up re-runs as an update (its environment), so its delete never runs on a change.
    assert commands["compose-up"]["environment"] == {"DUPLEX_BUNDLE_SHA256": digest}
    assert commands["compose-up"]["triggers"] == ["gpu01.example.internal", "22", "/opt/duplex"]
    changed = run_stack("scale5-onprem", overrides={"duplexops:maxSessions": 4}, build_dir=tmp_path)
    assert _commands(changed)["gpu-check"]["triggers"] != [digest]


def test_onprem_bundle_is_written_for_copy(runs: dict[str, StackRun]) -> None:
    run = runs["scale5-onprem"]
    copy = run.one("command:remote:CopyToRemote")
    local = Path(copy.inputs["source"].path)
    assert local == run.build_dir / "scale5-onprem" / "bundle"
    written = {str(p.relative_to(local)) for p in local.rglob("*") if p.is_file()}
    assert "compose.yaml" in written and "bin/prepare-host.sh" in written
    assert not any(p.startswith(("secrets/", "cloud-init/")) for p in written)
    compose = yaml.safe_load((local / "compose.yaml").read_text())
    assert compose["services"]["runtime"]["image"] == run.outputs["image"]
    prepare = (local / "bin/prepare-host.sh").read_text()
    assert "ROOT=/opt/duplex" in prepare and "/opt/duplex/secrets/redis_password" in prepare


def test_onprem_secrets_travel_on_stdin_only(runs: dict[str, StackRun]) -> None:
    run = runs["scale5-onprem"]
    secrets = run.named("node-secrets")
    assert secrets.is_secret("stdin")
    for command in run.of_type(COMMAND):
        assert command.is_secret("connection")
        for value in run.secret_values:
            assert value not in json.dumps(
                {k: v for k, v in command.plain.items() if k != "stdin"}, default=str
            )
    assert run.named("node-gpu-check").plain["connection"]["privateKey"].startswith("-----BEGIN OPENSSH")
    lines = [line.split(" ") for line in secrets.plain["stdin"].strip().splitlines()]
    modes = {path: mode for path, mode, _ in lines}
    expected = {
        path: "0640" if role in CONTAINER_READ_SECRETS else "0600" for role, path in SECRET_FILES.items()
    }
    assert modes == {**expected, "secrets/hf-token.env": "0600"}


def test_onprem_outputs(runs: dict[str, StackRun]) -> None:
    out = runs["scale5-onprem"].outputs
    assert out["endpoint"] == "wss://gpu01.example.internal/api/chat"
    assert out["ssh"] == "ssh deploy@gpu01.example.internal"
    assert out["grafana"]["tunnel"] == "ssh -N -L 3000:127.0.0.1:3000 deploy@gpu01.example.internal"
    assert out["image"] == pulumi_harness.FAKE_PROMOTED["onprem-node"]["duplexops:runtimeImage"]
    assert out["capacity"]["electricity_usd_month"] > 0 and "usd_per_month" not in out["capacity"]


# --- the on-premises scripts, run here ------------------------------------------------------------------


def _fake_bin(tmp_path: Path, name: str, body: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize(
    ("gpus", "ok", "message"),
    [
        ("NVIDIA L40S, 46068 MiB", True, "gpu-check: ok"),
        ("NVIDIA L40S, 46068 MiB\nNVIDIA L40S, 46068 MiB", True, "gpu-check: ok"),
        ("NVIDIA A100-SXM4-80GB, 81920 MiB", False, "profile l40s needs NVIDIA L40S"),
        ("NVIDIA L40S, 20000 MiB", False, "below"),
        ("", False, "no GPU found"),
    ],
)
def test_gpu_check_script(tmp_path: Path, gpus: str, ok: bool, message: str) -> None:
    bin_dir = _fake_bin(tmp_path, "nvidia-smi", f"cat <<'EOF'\n{gpus}\nEOF\n" if gpus else "exit 0\n")
    script = _onprem().gpu_check_script(get_profile("l40s"))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=30)
    assert (result.returncode == 0) is ok, result.stdout + result.stderr
    assert message in result.stdout + result.stderr


def test_gpu_check_script_without_a_driver(tmp_path: Path) -> None:
    script = _onprem().gpu_check_script(get_profile("a100-80gb"))
    env = {**os.environ, "PATH": str(_fake_bin(tmp_path, "true-only", "exit 0\n")) + ":/usr/bin:/bin"}
    if shutil.which("nvidia-smi", path=env["PATH"]):
        pytest.skip("a real nvidia-smi is on PATH")
    result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 1 and "nvidia-smi not found" in result.stderr


def test_secrets_script_writes_files_with_their_modes(tmp_path: Path) -> None:
    root = tmp_path / "duplex"
    files = {path: f"value of {path}\n" for path in SECRET_FILES.values()}
    env = dict(os.environ)
    if os.geteuid() != 0:  # chown/install -o root need root: stand-ins that only create and chmod
        bin_dir = _fake_bin(tmp_path, "chown", "exit 0\n")
        _fake_bin(tmp_path, "install", 'for a; do d="$a"; done; mkdir -p "$d" && chmod 0700 "$d"\n')
        env["PATH"] = f"{bin_dir}:{env['PATH']}"
    result = subprocess.run(
        ["sh", "-c", _onprem().secrets_script(str(root))],
        input=_onprem().secret_stdin(files),
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE((root / "secrets").stat().st_mode) == 0o700
    for role, path in SECRET_FILES.items():
        target = root / path
        assert target.read_text() == files[path]
        assert stat.S_IMODE(target.stat().st_mode) == (0o640 if role in CONTAINER_READ_SECRETS else 0o600)
    for value in files.values():
        assert value not in result.stdout + result.stderr
    bad = subprocess.run(
        ["sh", "-c", _onprem().secrets_script(str(root))],
        input="../../etc/passwd 0600 eA==\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert bad.returncode == 1 and "unexpected path" in bad.stderr


# --- configuration errors: each stops the program before any resource -------------------------------------


def _config_error(stack: str, **kwargs: object) -> str:
    with pytest.raises(StackConfigError) as caught:
        run_stack(stack, **kwargs)  # type: ignore[arg-type]
    mocks = pulumi_harness.LAST_MOCKS
    assert mocks is not None and mocks.resources == [], "nothing may be declared before the error"
    return str(caught.value)


def test_unknown_topology() -> None:
    message = _config_error("dev", overrides={"duplexops:topology": "gke-cluster"})
    assert "duplexops:topology" in message and "'gke-cluster'" in message
    assert "allowed: gce-node, onprem-node, multi-region" in message


def test_switching_a_node_stack_to_multi_region_names_what_to_change() -> None:
    message = _config_error("dev", overrides={"duplexops:topology": "multi-region"})
    assert "duplexops:bootDiskSizeGb: does not apply to topology 'multi-region'" in message
    assert "duplexops:regions: missing" in message and "duplexops:domain: missing" in message


def test_a100_on_an_n1_machine_type() -> None:
    message = _config_error("scale5-gcp", overrides={"duplexops:machineType": "n1-standard-8"})
    assert "duplexops:machineType" in message and "'n1-standard-8'" in message
    assert "cannot carry a100-80gb-sxm" in message
    assert "allowed: a2-ultragpu-1g" in message


def test_sessions_beyond_capacity() -> None:
    fits = max_sessions("personaplex-7b", "t4", "int8")
    message = _config_error("dev", overrides={"duplexops:maxSessions": 12})
    assert "duplexops:maxSessions" in message and "12" in message
    assert f"the capacity planner allows at most {fits}" in message


def test_missing_ssh_key() -> None:
    message = _config_error(
        "scale5-onprem", secrets={"hfToken": pulumi_harness.FAKE_SECRETS["onprem-node"]["hfToken"]}
    )
    assert "duplexops:onpremSshPrivateKey: missing" in message
    assert "SSH private key" in message and "pulumi config set --secret" in message


def test_secret_set_in_plain_text() -> None:
    message = _config_error(
        "scale5-onprem",
        overrides={
            "duplexops:onpremSshPrivateKey": pulumi_harness.FAKE_SECRETS["onprem-node"]["onpremSshPrivateKey"]
        },
        secrets={},
    )
    assert "duplexops:onpremSshPrivateKey: set in plain text" in message
    assert "BEGIN" not in message, "the value is never shown"


def test_missing_public_source_ranges_and_typos_are_reported_together() -> None:
    message = _config_error(
        "dev", overrides={"duplexops:publicSourceRanges": None, "duplexops:maxSesions": 2}
    )
    assert "2 problems" in message
    assert "duplexops:publicSourceRanges: missing" in message and "0.0.0.0/0" in message
    assert "duplexops:maxSesions: unknown key" in message


def test_onprem_keys_are_refused_on_gce() -> None:
    # Not runtimeImage: every topology reads it (the image CI built for the update, tests/test_image.py).
    message = _config_error("dev", overrides={"duplexops:onpremHost": "gpu01.example.internal"})
    assert "duplexops:onpremHost: does not apply to topology 'gce-node'" in message


def test_runtime_image_must_be_pinned() -> None:
    message = _config_error(
        "scale5-onprem", overrides={"duplexops:runtimeImage": "ghcr.io/org/runtime:latest"}
    )
    assert "duplexops:runtimeImage" in message and "'ghcr.io/org/runtime:latest'" in message
    assert "digest-pinned" in message


# --- issue 20: deploys a user does not notice, Spot, Flex-start, on-prem host key and digest -----------


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, bool]]]:
    """``{stack: {resource name: {"protect", "deleteBeforeReplace"}}}``: the options the engine receives
    (the harness's mocks do not keep them), from one more run of each GCE stack."""
    import pulumi.runtime.mocks as mocks

    seen: dict[tuple[str, str], dict[str, bool]] = {}
    original = mocks.MockMonitor.RegisterResource

    def register(self, request):  # noqa: ANN001, ANN202
        seen[(request.type, request.name)] = {
            "protect": bool(request.protect),
            "deleteBeforeReplace": bool(request.deleteBeforeReplace),
        }
        return original(self, request)

    result: dict[str, dict[str, dict[str, bool]]] = {}
    mocks.MockMonitor.RegisterResource = register  # type: ignore[method-assign]
    try:
        for stack in GCE_STACKS:
            seen.clear()
            run_stack(stack, build_dir=tmp_path_factory.mktemp(f"{stack}-options"))
            result[stack] = {name: options for (_, name), options in seen.items()}
    finally:
        mocks.MockMonitor.RegisterResource = original  # type: ignore[method-assign]
    return result


@pytest.mark.parametrize("stack", GCE_STACKS)
def test_model_cache_lives_on_a_protected_data_disk(
    runs: dict[str, StackRun], lifecycle: dict, stack: str
) -> None:
    """Guards item 9 and 19: the model cache was on the boot disk, deleted with every replaced VM (16 GB of
    gated weights downloaded again). Now a data disk of its own, protected (a destroy refuses), attached by
    device name and mounted by cloud-init at the profile's data directory; the static IP is protected."""
    run = runs[stack]
    disk = run.one("gcp:compute/disk:Disk")
    assert disk.plain["size"] == 100 and disk.plain["zone"] == "us-central1-a"
    vm = run.one(INSTANCE).plain
    [attached] = vm["attachedDisks"]
    assert attached["deviceName"] == "duplex-data"
    assert attached["source"] == disk.plain["name"]  # "the name or self_link of the disk"
    assert vm["bootDisk"]["autoDelete"] is True and "autoDelete" not in attached
    document = yaml.safe_load(_user_data(run))
    assert document["mounts"][0][:2] == ["/dev/disk/by-id/google-duplex-data", "/var/lib/duplex"]
    options = lifecycle[stack]
    assert options["node-data"]["protect"] is True
    assert options["node-address"]["protect"] is True
    assert options["node-vm"]["protect"] is False


def test_a_new_image_digest_does_not_replace_the_vm() -> None:
    """Guards item 9: the digest was in the user-data, whose change replaces the VM (delete first). Now two
    digests of one repository give the same user-data; the digest is a metadata key GCE updates in place
    (not in ``replace_on_changes``), which the node's rollout agent follows (tests/test_rollout.py)."""
    from infra.components.gce_node import render_user_data

    profile = get_profile("t4-int8", runtime_image="registry.invalid/x/y@sha256:" + "0" * 64)
    repo = "us-central1-docker.pkg.dev/my-gcp-project/duplex-dev/duplex-runtime"
    ids = {role: f"duplex-dev-{role.replace('_', '-')}" for role in SECRET_FILES}
    first = render_user_data(profile, f"{repo}@sha256:" + "1" * 64, ids, "my-gcp-project")
    second = render_user_data(profile, f"{repo}@sha256:" + "2" * 64, ids, "my-gcp-project")
    assert first == second
    assert "1" * 64 not in first


@pytest.mark.parametrize("stack", GCE_STACKS)
def test_only_the_user_data_replaces_the_vm(runs: dict[str, StackRun], stack: str) -> None:
    vm = runs[stack].one(INSTANCE)
    assert vm.replace_on_changes == ('metadata["user-data"]',)
    assert vm.plain["metadata"]["duplex-runtime-image"] == runs[stack].outputs["image"]


def test_spot_node_is_started_again_after_a_preemption(runs: dict[str, StackRun]) -> None:
    """Guards item 13: a preempted Spot VM stayed stopped until a person acted, and
    ``preemption_notice_duration`` was unused. dev (Spot) gets a metadata notice before the soft off, and a
    Cloud Scheduler job that starts the VM every 5 minutes as an account allowed to start this VM only."""
    run = runs["dev"]
    vm = run.one(INSTANCE).plain
    scheduling = vm["scheduling"]
    assert scheduling["provisioningModel"] == "SPOT" and scheduling["instanceTerminationAction"] == "STOP"
    assert scheduling["preemptionNoticeDuration"] == {"seconds": 30}
    job = run.one("gcp:cloudscheduler/job:Job").plain
    assert job["schedule"] == "*/5 * * * *" and job["region"] == "us-central1"
    target = job["httpTarget"]
    assert target["httpMethod"] == "POST"
    assert target["uri"] == (
        "https://compute.googleapis.com/compute/v1/projects/my-gcp-project/zones/us-central1-a/instances/"
        f"{vm['name']}/start"
    )
    restarter = run.named("node-restarter").plain
    email = f"{restarter['accountId']}@my-gcp-project.iam.gserviceaccount.com"
    assert target["oauthToken"]["serviceAccountEmail"] == email
    grant = run.one("gcp:compute/instanceIAMMember:InstanceIAMMember").plain
    assert grant == {
        "project": "my-gcp-project",
        "zone": "us-central1-a",
        "instanceName": vm["name"],
        "role": "roles/compute.instanceAdmin.v1",
        "member": f"serviceAccount:{email}",
    }
    apis = {s.plain["service"] for s in run.of_type("gcp:projects/service:Service")}
    assert "cloudscheduler.googleapis.com" in apis
    # On demand (scale5-gcp): GCE restarts it itself; no job.
    assert runs["scale5-gcp"].of_type("gcp:cloudscheduler/job:Job") == []


def test_flex_start_is_sold_for_accelerator_optimized_types() -> None:
    """Guards item 16: ``sold_as`` refused Flex-start for types GCE sells it for (every accelerator-optimized
    family but A4X and G4); N1 with a T4 stays Standard and Spot."""
    from infra.capacity.gcp import provisioning_problem

    for machine_type in (
        "a2-ultragpu-1g",
        "a2-highgpu-1g",
        "g2-standard-8",
        "a3-highgpu-8g",
        "a3-ultragpu-8g",
    ):
        assert provisioning_problem(machine_type, "flex-start") is None, machine_type
    assert provisioning_problem("n1-standard-8", "flex-start") == (
        "n1-standard-8 is sold only as standard or spot, not flex-start"
    )
    assert provisioning_problem("a3-highgpu-1g", "standard") is not None


def test_flex_start_vm(tmp_path: Path) -> None:
    """Guards item 16: a Flex-start VM asked for graceful shutdown (GCE excludes it for a limited run time)
    and no reservation affinity; now neither, with DELETE after 7 days and the data disk kept."""
    run = run_stack("scale5-gcp", overrides={"duplexops:provisioningModel": "flex-start"}, build_dir=tmp_path)
    vm = run.one(INSTANCE).plain
    scheduling = vm["scheduling"]
    assert scheduling["provisioningModel"] == "FLEX_START"
    assert "gracefulShutdown" not in scheduling
    assert scheduling["instanceTerminationAction"] == "DELETE"
    assert scheduling["maxRunDuration"] == {"seconds": 7 * 24 * 3600}
    assert scheduling["automaticRestart"] is False
    assert vm["reservationAffinity"] == {"type": "NO_RESERVATION"}
    assert run.of_type("gcp:compute/disk:Disk"), "the data disk outlives the deleted VM"


def test_onprem_host_key_is_required() -> None:
    """Guards item 10: without ``onpremHostKey`` every SSH session (secrets travel over it) accepted any
    host key. Now it is required, and the message says how to get it."""
    message = _config_error("scale5-onprem", overrides={"duplexops:onpremHostKey": None})
    assert "duplexops:onpremHostKey: missing" in message
    assert "ssh-keyscan -t ed25519" in message


@pytest.mark.parametrize(
    "line",
    ["ssh-ed25519 AAAAnotakey", "ssh-ed25519 AAAAB3NzaC1yc2EAAAADAQABAAABAQ==", "gpu01 ssh-ed25519 AAAA"],
)
def test_onprem_host_key_must_be_a_key(line: str) -> None:
    message = _config_error("scale5-onprem", overrides={"duplexops:onpremHostKey": line})
    assert "duplexops:onpremHostKey" in message and "ssh-keyscan" in message


def test_every_ssh_connection_checks_the_host_key(runs: dict[str, StackRun]) -> None:
    run = runs["scale5-onprem"]
    key = load_stack_file("scale5-onprem")["duplexops:onpremHostKey"]
    steps = [*run.of_type(COMMAND), *run.of_type("command:remote:CopyToRemote")]
    assert len(steps) == 8
    for step in steps:
        assert step.plain["connection"]["hostKey"] == key, step.name


def test_onprem_runs_the_promoted_digest() -> None:
    """Guards item 18: the committed on-prem digest was all zeros (every CI deploy failed) and nothing
    promoted the digest CI built. The stack file holds no image; ``duplexops:runtimeImage`` is what CI
    promotes to each update (pulumi-up.yml): missing or a zeros placeholder stop the program saying so."""
    text = (REPO / "stacks" / "Pulumi.scale5-onprem.yaml").read_text()
    assert "0" * 64 not in text and "duplexops:runtimeImage" not in load_stack_file("scale5-onprem")
    message = _config_error("scale5-onprem", overrides={"duplexops:runtimeImage": None})
    assert "duplexops:runtimeImage: missing" in message
    assert "the image CI built and promoted" in message
    assert "pulumi config set --stack <stack> duplexops:runtimeImage <repository>@sha256:" in message
    zeros = "ghcr.io/org/duplexops-runtime@sha256:" + "0" * 64
    message = _config_error("scale5-onprem", overrides={"duplexops:runtimeImage": zeros})
    assert "placeholder digest of zeros" in message


def test_drain_grace_is_configurable_and_fits_graceful_shutdown(tmp_path: Path) -> None:
    """Item 9: the drain a rollout or replacement gives live sessions is the stack's ``drainGraceSeconds``
    (300 s by default: a conversation of up to 5 minutes), and GCE graceful shutdown covers the node's whole
    stop; past what 3600 s allows the configuration refuses it."""
    run = run_stack("scale5-gcp", overrides={"duplexops:drainGraceSeconds": 600}, build_dir=tmp_path)
    vm = run.one(INSTANCE).plain
    compose = yaml.safe_load(_written_files(_user_data(run))["/etc/duplex/compose.yaml"])
    assert compose["services"]["runtime"]["environment"]["DUPLEX_DRAIN_GRACE_S"] == "600"
    assert vm["scheduling"]["gracefulShutdown"]["maxDuration"]["seconds"] >= 2 * 600
    message = _config_error("dev", overrides={"duplexops:drainGraceSeconds": 2000})
    assert "duplexops:drainGraceSeconds" in message and "1700" in message


def test_the_policy_pack_passes_flex_start_and_holds_its_rules(tmp_path: Path) -> None:
    """Guards item 16 in the policy pack: the graceful-shutdown rule demanded graceful shutdown of a
    Flex-start VM (GCE excludes it for a limited run time) and the provisioning rule did not ask for
    ``reservationAffinity`` NO_RESERVATION. The Flex-start stack passes the whole pack; each mistake is
    named."""
    import copy

    from infra.policy.rules import check_resources, gpu_instance_graceful_shutdown, provisioning_model_sold

    run = run_stack("scale5-gcp", overrides={"duplexops:provisioningModel": "flex-start"}, build_dir=tmp_path)
    assert check_resources([(r.type, r.plain, r.name) for r in run.resources if r.custom]) == []
    vm = run.one(INSTANCE).plain
    graceful = copy.deepcopy(vm)
    graceful["scheduling"]["gracefulShutdown"] = {"enabled": True, "maxDuration": {"seconds": 3600}}
    [problem] = gpu_instance_graceful_shutdown(INSTANCE, graceful)
    assert "limited run time" in problem and "remove scheduling.gracefulShutdown" in problem
    reserved = copy.deepcopy(vm)
    reserved["reservationAffinity"] = {"type": "ANY_RESERVATION"}
    [problem] = provisioning_model_sold(INSTANCE, reserved)
    assert "NO_RESERVATION" in problem
    del reserved["reservationAffinity"]
    assert any("NO_RESERVATION" in p for p in provisioning_model_sold(INSTANCE, reserved))


def test_onprem_pulls_with_a_token_of_the_deploy(runs: dict[str, StackRun]) -> None:
    """Guards item 18: the host pulled with a one-off ``docker login`` that expires after 1 h. Each deploy
    now mints a 1-hour token of the bootstrap's read-only puller account (no key: the org policy refuses
    keys) and logs root's Docker in over the pinned SSH session (stdin, secret) right before compose-up
    pulls. Issue 33: the stack makes no IAM grant itself (granting token-creator and minting in one update
    raced IAM's propagation, up to 7 minutes); the bootstrap holds the account and its grants."""
    run = runs["scale5-onprem"]
    assert run.of_type("gcp:serviceaccount/account:Account") == []
    assert run.of_type("gcp:serviceaccount/iAMMember:IAMMember") == []
    assert run.of_type("gcp:artifactregistry/repositoryIamMember:RepositoryIamMember") == []
    email = "duplex-puller@my-gcp-project.iam.gserviceaccount.com"
    [call] = [c for c in run.calls if c.token.endswith("getAccountAccessToken")]
    assert call.args["targetServiceAccount"] == email and call.args["lifetime"] == "3600s"
    login = run.named("node-registry-login")
    assert login.is_secret("stdin") and login.plain["stdin"] == pulumi_harness.MOCK_ACCESS_TOKEN
    assert pulumi_harness.MOCK_ACCESS_TOKEN not in login.plain["create"]
    assert "docker login --username oauth2accesstoken --password-stdin" in login.plain["create"]
    assert "https://us-central1-docker.pkg.dev" in login.plain["create"]
    up = run.named("node-compose-up")
    assert any(d.endswith("::node-registry-login") for d in up.dependencies)
    assert "export DOCKER_CONFIG=/root/.docker" in up.plain["create"]


def test_registry_login_script_logs_docker_in_from_stdin(tmp_path: Path) -> None:
    """The login step, run here with a fake ``docker`` that records its arguments and stdin."""
    log = tmp_path / "docker.log"
    bin_dir = _fake_bin(tmp_path, "docker", f'echo "$*" >{log}; cat >>{log}\n')
    script = _onprem().registry_login_script("us-central1-docker.pkg.dev")
    script = script.replace("install -d -m 0700 -o root -g root /root/.docker", f"mkdir -p {tmp_path}/d")
    done = subprocess.run(
        ["sh", "-c", script],
        input="ya29.token",
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [
        "login --username oauth2accesstoken --password-stdin https://us-central1-docker.pkg.dev",
        "ya29.token",
    ]


def test_the_pack_asks_a_spot_node_for_cloud_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The API rule knows the restart job's API: dev without ``cloudscheduler.googleapis.com`` fails the
    pack naming it (a fresh project has it off)."""
    from infra.policy.rules import check_resources
    from infra.program import gce

    monkeypatch.setattr(gce, "SPOT_APIS", ())
    violations = check_resources([(r.type, r.plain, r.name) for r in run_stack("dev").resources if r.custom])
    assert violations and all("cloudscheduler.googleapis.com" in v for v in violations)


@pytest.mark.parametrize("stack", ["dev", "scale5-onprem"])
def test_a_single_node_without_receivers_warns_that_alerts_reach_nobody(
    stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33: docs/deploying.md says ``up`` warns when no alert receiver is set; only multi-region did."""
    import pulumi

    from infra.program.shared import NODE_NO_RECEIVER_WARNING

    warnings: list[str] = []
    monkeypatch.setattr(pulumi.log, "warn", lambda message, *args, **kwargs: warnings.append(message))
    run_stack(stack)
    assert NODE_NO_RECEIVER_WARNING in warnings and "reach nobody" in NODE_NO_RECEIVER_WARNING
    warnings.clear()
    run_stack(stack, overrides={"duplexops:alertWebhookUrl": "https://hooks.example.com/duplex"})
    assert NODE_NO_RECEIVER_WARNING not in warnings


def test_max_sessions_per_client_reaches_nginx(tmp_path: Path) -> None:
    """A LiveKit agent host (docs/livekit.md) or a carrier's media servers bring many calls from one
    address: ``maxSessionsPerClient`` raises nginx's per-address cap on the session paths (the profile's 2
    otherwise); 0 is refused naming the key and the range."""
    run = run_stack("scale5-gcp", overrides={"duplexops:maxSessionsPerClient": 40}, build_dir=tmp_path)
    nginx = _written_files(_user_data(run))["/etc/duplex/nginx/nginx.conf"].decode()
    assert "limit_conn duplex_client_sessions 40;" in nginx
    assert "limit_conn duplex_client_sessions 2;" not in nginx
    default = run_stack("scale5-gcp", build_dir=tmp_path / "default")
    assert (
        "limit_conn duplex_client_sessions 2;"
        in _written_files(_user_data(default))["/etc/duplex/nginx/nginx.conf"].decode()
    )
    message = _config_error("dev", overrides={"duplexops:maxSessionsPerClient": 0})
    assert "duplexops:maxSessionsPerClient" in message
