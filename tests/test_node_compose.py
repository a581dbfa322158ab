"""compose.yaml of a GPU node (``infra.node.bundle.compose``): valid against the Compose specification's JSON
schema, GPUs reserved, only nginx public, drain-aware stop periods, no secret values, agreement with the other
renderers' container paths.

The schema is compose-spec's own ``schema/compose-spec.json`` as vendored by ``check-jsonschema`` (a dev
dependency), validated with ``jsonschema``: no network access.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import posixpath
import re
from typing import Any

import jsonschema
import pytest
import yaml

from infra.node.bundle.compose import (
    COMPOSE_FILE,
    CONTAINER_READ_SECRETS,
    GRAFANA_DASHBOARDS_DIR,
    IMAGES,
    NETWORK,
    PROMETHEUS_RULES_DIR,
    REDIS_AUTH_CONF,
    host_directories,
    nginx_stop_grace_s,
    node_stop_timeout_s,
    render_compose,
    runtime_stop_grace_s,
)
from infra.node.bundle.services import SECRET_FILES, NodeSecrets, runtime_settings, secret_files, services_of
from infra.node.profile.profiles import GRAFANA_VERSION, PROFILES, NodeProfile, get_profile

GPU_PROFILES = sorted(name for name, p in PROFILES.items() if p.deployment == "compose" and p.gpu is not None)


def _compose_schema() -> dict[str, Any]:
    try:
        vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    except ModuleNotFoundError:
        pytest.fail(
            "check-jsonschema is not installed: it ships compose-spec's compose-spec.json "
            "(pip install -e '.[dev]')"
        )
    return json.loads(vendor.joinpath("compose-spec.json").read_bytes())


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = _compose_schema()
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _doc(profile: NodeProfile) -> dict[str, Any]:
    files = render_compose(profile)
    assert list(files) == [COMPOSE_FILE]
    return yaml.safe_load(files[COMPOSE_FILE])


def _seconds(duration: str) -> int:
    match = re.fullmatch(r"(\d+)s", duration)
    assert match, f"expected a duration like '60s', got {duration!r}"
    return int(match.group(1))


def test_gpu_profiles_exist() -> None:
    assert {"l40s", "a100-80gb", "t4-int8"} <= set(GPU_PROFILES)


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_valid_against_compose_spec(name: str, validator: jsonschema.protocols.Validator) -> None:
    errors = sorted(validator.iter_errors(_doc(PROFILES[name])), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_schema_is_the_compose_specification(validator: jsonschema.protocols.Validator) -> None:
    schema = validator.schema
    assert schema["title"] == "Compose Specification"
    assert {"services", "networks", "secrets", "volumes"} <= set(schema["properties"])


@pytest.mark.parametrize(
    "breakage",
    [
        "unknown service key",
        "port as a list",
        "restart as a number",
        "device without capabilities",
        "unknown top-level key",
    ],
)
def test_broken_document_fails_schema(breakage: str, validator: jsonschema.protocols.Validator) -> None:
    doc = copy.deepcopy(_doc(PROFILES["l40s"]))
    runtime = doc["services"]["runtime"]
    if breakage == "unknown service key":
        runtime["healthcheck"]["intervall"] = "10s"
    elif breakage == "port as a list":
        doc["services"]["nginx"]["ports"][0] = [443]
    elif breakage == "restart as a number":
        runtime["restart"] = 3
    elif breakage == "device without capabilities":
        del runtime["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"]
    else:
        doc["servces"] = {}
    assert list(validator.iter_errors(doc)), f"{breakage}: the schema accepted a broken document"
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(doc)


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_gpu_reserved_for_runtime_and_dcgm_exporter(name: str) -> None:
    services = _doc(PROFILES[name])["services"]
    for service in ("runtime", "dcgm-exporter"):
        devices = services[service]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}], service
    for service, spec in services.items():
        if service not in ("runtime", "dcgm-exporter"):
            assert "deploy" not in spec, f"{service} must not reserve a GPU"


def test_cpu_compose_node_has_no_gpu_parts(validator: jsonschema.protocols.Validator) -> None:
    profile = get_profile("local", deployment="compose", tls={})  # default TLS paths: absolute
    doc = _doc(profile)
    validator.validate(doc)
    assert "dcgm-exporter" not in doc["services"]
    assert "deploy" not in doc["services"]["runtime"]
    assert doc["services"]["runtime"]["environment"]["DUPLEX_DEVICE"] == "cpu"
    assert set(doc["services"]) == set(services_of(profile))


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_services_are_the_nodes_services(name: str) -> None:
    doc = _doc(PROFILES[name])
    assert set(doc["services"]) == set(services_of(PROFILES[name]))


@pytest.mark.parametrize(
    "profile",
    [PROFILES["l40s"], get_profile("a100-80gb", public_address="203.0.113.7", private_address="10.0.0.5")],
    ids=["default", "addresses"],
)
def test_only_nginx_public_and_monitoring_private(profile: NodeProfile) -> None:
    services = _doc(profile)["services"]
    published = {name: spec["ports"] for name, spec in services.items() if "ports" in spec}
    assert set(published) == {"nginx", "prometheus", "grafana", "alertmanager", "coturn"}
    # The TURN relay: its UDP and TLS listeners only, never the relay range (infra.node.profile.relay).
    assert {(p["host_ip"], p["target"], p["published"], p["protocol"]) for p in published["coturn"]} == {
        (profile.public_address, profile.relay.port, str(profile.relay.port), "udp"),
        (profile.public_address, profile.relay.tls_port, str(profile.relay.tls_port), "tcp"),
    }
    assert {(p["host_ip"], p["target"], p["published"]) for p in published["nginx"]} == {
        (profile.public_address, profile.ports.https, str(profile.ports.https)),
        (profile.public_address, profile.ports.http, str(profile.ports.http)),
    }
    assert published["prometheus"] == [
        {
            "target": profile.ports.prometheus,
            "published": str(profile.ports.prometheus),
            "host_ip": profile.private_address,
            "protocol": "tcp",
        }
    ]
    assert [(p["host_ip"], p["target"]) for p in published["grafana"]] == [
        (profile.private_address, profile.ports.grafana)
    ]
    assert [(p["host_ip"], p["target"]) for p in published["alertmanager"]] == [
        (profile.private_address, profile.ports.alertmanager)
    ]
    for name, spec in services.items():
        assert "network_mode" not in spec, f"{name} must stay on the bridge network"
        assert "expose" not in spec


@pytest.mark.parametrize(
    "profile",
    [
        PROFILES["l40s"],
        get_profile("t4-int8", limits={"drain_grace_s": 600, "first_audio_p99_target_ms": 250.0}),
    ],
    ids=["default", "long-drain"],
)
def test_stop_grace_periods_cover_the_drain(profile: NodeProfile) -> None:
    services = _doc(profile)["services"]
    drain = profile.limits.drain_grace_s
    runtime = _seconds(services["runtime"]["stop_grace_period"])
    nginx = _seconds(services["nginx"]["stop_grace_period"])
    assert runtime == runtime_stop_grace_s(profile) > drain
    assert nginx == nginx_stop_grace_s(profile) >= drain
    assert services["runtime"]["stop_signal"] == "SIGTERM"
    assert services["nginx"]["stop_signal"] == "SIGQUIT"  # graceful: open sessions go on
    assert services["runtime"]["environment"]["DUPLEX_DRAIN_GRACE_S"] == str(drain)
    assert node_stop_timeout_s(profile) >= nginx + runtime


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_runtime_environment_is_a_valid_runtime_config(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.config import RuntimeConfig

    profile = PROFILES[name]
    runtime = _doc(profile)["services"]["runtime"]
    env = runtime["environment"]
    assert env["HF_TOKEN"] is None  # passed through from docker compose's environment, no value here
    assert env["DUPLEX_NODE_ID"] == f"${{DUPLEX_NODE_ID:-{profile.name}}}"
    # Set by the host (the GCE VM's unit), off elsewhere: on-premises hosts run no maintenance watch.
    assert env["DUPLEX_MAINTENANCE_WATCH"] == "${DUPLEX_MAINTENANCE_WATCH:-off}"
    host_set = {key: env[key] for key in ("DUPLEX_NODE_ID", "DUPLEX_MAINTENANCE_WATCH")}
    expected = {**runtime_settings(profile), **host_set, "HF_TOKEN": None}
    assert env == expected  # the one source of the runtime's settings
    assert runtime["env_file"] == ["./" + SECRET_FILES["runtime_env"]]  # DUPLEX_REDIS_URL
    for key, value in env.items():
        if key.startswith("DUPLEX_"):
            # Compose's ${VAR:-default} with the variable unset gives the default.
            interpolated = re.fullmatch(r"\$\{\w+:-(.*)\}", value)
            monkeypatch.setenv(key, interpolated[1] if interpolated else value)
    config = RuntimeConfig()
    assert (config.host, config.port) == ("0.0.0.0", profile.ports.runtime)
    assert (config.model, config.device, config.dtype) == (profile.model, "cuda", profile.runtime_dtype)
    assert config.quantize == ("int8" if profile.precision == "int8" else "none")
    assert config.max_sessions == profile.sessions
    assert config.drain_grace_s == profile.limits.drain_grace_s
    assert config.maintenance_watch == "off"
    assert config.max_session_s == profile.limits.max_session_s
    assert runtime["volumes"] == [f"{profile.model_cache_dir}:/models"]
    assert runtime["image"] == profile.runtime_image
    assert "/healthz" in runtime["healthcheck"]["test"][-1]


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_no_secret_values_in_the_file(name: str) -> None:
    profile = PROFILES[name]
    node_secrets = NodeSecrets.generate()
    text = render_compose(profile)[COMPOSE_FILE].decode()
    for value in (node_secrets.redis_password, node_secrets.grafana_admin_password):
        assert value not in text
    for path, content in secret_files(profile, node_secrets).items():
        assert content.decode().strip() not in text, path
    assert re.search(r"(?i)password\s*[:=]\s*\S{16,}", text) is None


def test_secrets_come_from_the_secret_files() -> None:
    doc = _doc(PROFILES["l40s"])
    assert doc["secrets"] == {
        "grafana_admin_password": {"file": "./" + SECRET_FILES["grafana_admin_password"]},
        "redis_password": {"file": "./" + SECRET_FILES["redis_password"]},
        "token_keys": {"file": "./" + SECRET_FILES["token_keys"]},
        "app_token_keys": {"file": "./" + SECRET_FILES["app_token_keys"]},
    }
    assert doc["services"]["runtime"]["secrets"] == ["token_keys", "app_token_keys"]
    grafana = doc["services"]["grafana"]
    assert grafana["secrets"] == ["grafana_admin_password"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert doc["services"]["redis-exporter"]["env_file"] == ["./" + SECRET_FILES["redis_exporter_env"]]
    redis = doc["services"]["redis"]
    assert redis["command"] == ["redis-server", "/usr/local/etc/redis/redis.conf"]
    assert f"./{SECRET_FILES['redis_auth_conf']}:{REDIS_AUTH_CONF}:ro" in redis["volumes"]
    ping = redis["healthcheck"]["test"]
    assert (
        ping[0] == "CMD-SHELL"
        and "REDISCLI_AUTH=" in ping[1]
        and "$$(cat /run/secrets/redis_password)" in ping[1]
    )
    assert set(SECRET_FILES) >= CONTAINER_READ_SECRETS
    # Containers reading 0640 root:root secret files run with group 0.
    assert redis["user"].endswith(":0") and grafana["user"].endswith(":0")


def test_local_profile_is_refused() -> None:
    with pytest.raises(ValueError, match=r"deployment.*'local'.*processes"):
        render_compose(PROFILES["local"])


def test_unusable_path_is_refused() -> None:
    profile = get_profile("l40s", model_cache_dir="/var/lib/duplex/my:models")
    with pytest.raises(ValueError, match="model_cache_dir"):
        render_compose(profile)


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_deterministic(name: str) -> None:
    assert render_compose(PROFILES[name]) == render_compose(PROFILES[name])
    assert render_compose(PROFILES[name]) == render_compose(get_profile(name))


def test_images_pinned() -> None:
    services = _doc(PROFILES["l40s"])["services"]
    for name, spec in services.items():
        image = spec["image"]
        if name == "runtime":
            continue
        assert image == IMAGES[name]
        repository, _, tag = image.rpartition(":")
        assert repository and tag and tag != "latest" and re.search(r"\d", tag), image
    assert services["grafana"]["image"].startswith(f"grafana/grafana:{GRAFANA_VERSION}@sha256:")
    assert services["redis"]["image"].startswith("redis:7.")
    assert services["nginx"]["image"].startswith("nginx:")


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_every_service_restarts_logs_bounded_and_has_a_healthcheck(name: str) -> None:
    doc = _doc(PROFILES[name])
    relay = PROFILES[name].relay
    ipam = {"config": [{"subnet": relay.compose_subnet, "ip_range": relay.dynamic_range}]}
    assert doc["networks"] == {NETWORK: {"name": NETWORK, "driver": "bridge", "ipam": ipam}}
    for service, spec in doc["services"].items():
        assert spec["restart"] == "unless-stopped", service
        if service == "runtime":  # at the one address coturn may relay to (infra.node.bundle.coturn)
            assert spec["networks"] == {NETWORK: {"ipv4_address": relay.runtime_address}}
        else:
            assert spec["networks"] == [NETWORK], service
        assert spec["logging"]["driver"] == "json-file"
        assert spec["logging"]["options"]["max-size"] and spec["logging"]["options"]["max-file"]
        test = spec["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL") and len(test) >= 2, service


def test_node_exporter_sees_the_host() -> None:
    exporter = _doc(PROFILES["l40s"])["services"]["node-exporter"]
    assert exporter["pid"] == "host"
    assert exporter["volumes"] == ["/:/host:ro,rslave"]
    assert "--path.rootfs=/host" in exporter["command"]


def test_mounts_agree_with_the_other_renderers() -> None:
    from infra.node.bundle.render import render_bundle
    from infra.node.monitoring.grafana import DASHBOARDS_PATH

    profile = PROFILES["l40s"]
    bundle = render_bundle(profile)
    doc = _doc(profile)
    bundle_dirs = {posixpath.dirname(p) for p in bundle} | set(bundle)
    for name, spec in doc["services"].items():
        for volume in spec.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                relative = source[2:]
                assert relative in bundle_dirs or relative in SECRET_FILES.values(), f"{name}: {volume}"
    # redis.conf includes the auth file where Compose mounts it.
    assert f"include {REDIS_AUTH_CONF}" in bundle["redis/redis.conf"].decode()
    # Grafana's dashboard provider reads where Compose mounts the dashboards.
    assert DASHBOARDS_PATH == GRAFANA_DASHBOARDS_DIR
    assert GRAFANA_DASHBOARDS_DIR in bundle["grafana/provisioning/dashboards/duplex.yml"].decode()
    # prometheus.yml's rule_files (relative to its directory) land in the rules mount.
    rule_files = yaml.safe_load(bundle["prometheus/prometheus.yml"])["rule_files"]
    assert [posixpath.join("/etc/prometheus", r) for r in rule_files] == [f"{PROMETHEUS_RULES_DIR}/*.yml"]
    # nginx's certificate and key are inside the mounted TLS directories.
    nginx_mounts = [v.split(":")[1] for v in doc["services"]["nginx"]["volumes"]]
    for path in (profile.tls.certificate_path, profile.tls.private_key_path):
        assert posixpath.dirname(path) in nginx_mounts
        assert f" {path};" in bundle["nginx/nginx.conf"].decode()


def test_host_directories_cover_the_writable_bind_mounts() -> None:
    profile = PROFILES["a100-80gb"]
    doc = _doc(profile)
    prepared = {d.path for d in host_directories(profile)}
    for name, spec in doc["services"].items():
        for volume in spec.get("volumes", []):
            parts = volume.split(":")
            source, mode = parts[0], parts[2] if len(parts) > 2 else "rw"
            if source.startswith("/") and not mode.startswith("ro"):
                assert source in prepared, f"{name}: {volume} has no prepared host directory"
    assert profile.model_cache_dir in prepared


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_nginx_mounts_the_browser_client_where_its_config_serves_it(name: str) -> None:
    from infra.node.bundle.render import render_bundle
    from infra.node.bundle.webclient import WEB_CONTAINER_ROOT, WEB_DIR

    profile = PROFILES[name]
    volumes = _doc(profile)["services"]["nginx"]["volumes"]
    assert f"./{WEB_DIR}:{WEB_CONTAINER_ROOT}:ro" in volumes  # read-only
    bundle = render_bundle(profile)
    assert f"{WEB_DIR}/index.html" in bundle
    assert f"root {WEB_CONTAINER_ROOT};" in bundle["nginx/nginx.conf"].decode()
