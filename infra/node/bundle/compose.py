"""The Compose file of a ``compose`` node (GPU hosts, VMs): ``render_compose`` gives ``compose.yaml``, one
project (``duplex``) on one bridge network running every service of ``infra.node.bundle.services`` under its
own name. Only nginx publishes on the public address (Prometheus, Alertmanager and Grafana on the private
one); secrets are never in the file (env files and Compose secrets under ``secrets/``); the host directories
the containers write are listed by ``host_directories``, and ``node_stop_timeout_s`` bounds a stop (nginx,
then the runtime's drain): both in ``infra.node.bundle.compose_host``, re-exported here.

Exposure, secrets and their owners, stopping: docs/node.md, "The bundle"."""

from __future__ import annotations

import posixpath
import re
from typing import Any

from infra.images import NODE_IMAGES
from infra.node.bundle.acme import WEBROOT_CONTAINER, acme_dirs, textfile_dir
from infra.node.bundle.compose_host import (
    CONTAINER_USERS,
    GRAFANA_UID,
    NGINX_STOP_MARGIN_S,
    RUNTIME_STOP_MARGIN_S,
    RUNTIME_UID,
    HostDirectory,
    host_directories,
    nginx_stop_grace_s,
    node_stop_timeout_s,
    runtime_stop_grace_s,
    tls_dirs,
    tls_reload_command,
)
from infra.node.bundle.coturn import CONTAINER_CONFIG_PATH as COTURN_CONFIG_PATH
from infra.node.bundle.coturn import coturn_args
from infra.node.bundle.services import (
    APP_TOKEN_KEYS_CONTAINER_PATH,
    OPTIONAL_SECRET_FILES,
    SECRET_FILES,
    TOKEN_KEYS_CONTAINER_PATH,
    endpoint,
    optional_secret_roles,
    runtime_settings,
)
from infra.node.bundle.webclient import WEB_CONTAINER_ROOT, WEB_DIR
from infra.node.monitoring.alertmanager import ALERTMANAGER_CONFIG, alertmanager_args
from infra.node.monitoring.prometheus import prometheus_args
from infra.node.profile.profiles import NodeProfile
from infra.yaml_text import dump_yaml

__all__ = [
    "COMPOSE_FILE",
    "CONTAINER_READ_SECRETS",
    "GRAFANA_DASHBOARDS_DIR",
    "GRAFANA_PROVISIONING_DIR",
    "GRAFANA_UID",
    "IMAGES",
    "NETWORK",
    "NGINX_STOP_MARGIN_S",
    "PROJECT_NAME",
    "PROMETHEUS_CONFIG",
    "PROMETHEUS_DATA_DIR",
    "PROMETHEUS_RULES_DIR",
    "REDIS_AUTH_CONF",
    "REDIS_CONF",
    "RUNTIME_STOP_MARGIN_S",
    "RUNTIME_UID",
    "ALERTMANAGER_CONFIG_PATH",
    "ALERTMANAGER_DATA_DIR",
    "HostDirectory",
    "host_directories",
    "nginx_stop_grace_s",
    "node_stop_timeout_s",
    "render_compose",
    "runtime_stop_grace_s",
    "tls_reload_command",
]

COMPOSE_FILE = "compose.yaml"
"""The bundle path of the rendered file."""

PROJECT_NAME = "duplex"
"""The Compose project name (containers are ``duplex-<service>-1`` whatever the directory is called)."""

NETWORK = "duplex"
"""The node's one bridge network (also its Docker name)."""

IMAGES: dict[str, str] = {name: image.reference() for name, image in NODE_IMAGES.items()}
"""Every service's image but the runtime's (``profile.runtime_image``), as ``<repository>:<tag>@<digest>``
from ``infra.images.NODE_IMAGES`` (where each digest came from and how to refresh it; the two still unpinned
go by tag). The redis_exporter image is the Alpine variant: the default one is ``FROM scratch`` and has
nothing to run a healthcheck with."""

# Paths inside the containers. redis/redis.conf (infra.node.bundle.redis_conf) includes REDIS_AUTH_CONF;
# prometheus.yml's rule_files (rules/*.yml, relative to it) are under PROMETHEUS_RULES_DIR; Grafana's
# dashboard provider (infra.node.monitoring.grafana.DASHBOARDS_PATH) reads GRAFANA_DASHBOARDS_DIR, mounted
# inside Grafana's data directory.
REDIS_CONF = "/usr/local/etc/redis/redis.conf"
REDIS_AUTH_CONF = "/usr/local/etc/redis/redis-auth.conf"
PROMETHEUS_CONFIG = "/etc/prometheus/prometheus.yml"
PROMETHEUS_RULES_DIR = "/etc/prometheus/rules"
PROMETHEUS_DATA_DIR = "/prometheus"
GRAFANA_PROVISIONING_DIR = "/etc/grafana/provisioning"
GRAFANA_DASHBOARDS_DIR = "/var/lib/grafana/dashboards"
_MODELS_DIR = "/models"
_SECRETS_MOUNT = "/run/secrets"

CONTAINER_READ_SECRETS: frozenset[str] = frozenset(
    {
        "redis_auth_conf",
        "redis_password",
        "grafana_admin_password",
        "token_keys",
        "app_token_keys",
        "turnserver_conf",
    }
)
"""Roles of ``SECRET_FILES`` that a container opens itself (bind-mounted): they must be ``root:root``
mode 0640 on the host (the reading containers run with group 0). The others (``runtime_env``,
``redis_exporter_env``) are read by ``docker compose`` on the host and stay 0600, as does
``events_consumer_env``, which is for the application's events consumer, not for a container of the node."""

_RUNTIME_USER = CONTAINER_USERS["runtime"]
_REDIS_USER = CONTAINER_USERS["redis"]
_PROMETHEUS_USER = CONTAINER_USERS["prometheus"]
_GRAFANA_USER = CONTAINER_USERS["grafana"]
_REDIS_EXPORTER_USER = CONTAINER_USERS["redis-exporter"]
_ALERTMANAGER_USER = CONTAINER_USERS["alertmanager"]
ALERTMANAGER_CONFIG_PATH = "/etc/alertmanager/alertmanager.yml"
ALERTMANAGER_DATA_DIR = "/alertmanager"

_LOGGING = {"driver": "json-file", "options": {"max-size": "20m", "max-file": "5"}}
_HEALTH_TIMING = {"interval": "15s", "timeout": "5s", "retries": 3}

# Compose bind mounts in short syntax split on ':'; interpolation acts on '$'.
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9._/-]*$")


def render_compose(profile: NodeProfile) -> dict[str, bytes]:
    """``{"compose.yaml": ...}`` for a ``compose`` node; the same profile always gives the same bytes.

    Raises:
        ValueError: ``profile.deployment`` is not ``compose`` (the local node runs host processes, see
            ``infra.node.local.node``), or a path field cannot be used in a Compose bind mount.
    """
    if profile.deployment != "compose":
        raise ValueError(
            f"deployment: profile {profile.name!r} has deployment={profile.deployment!r}; compose.yaml is "
            "rendered only for deployment='compose' (GPU hosts and VMs). The local node runs host processes "
            "(infra.node.local.node)."
        )
    for field, value in (
        ("model_cache_dir", profile.model_cache_dir),
        ("data_dir", profile.data_dir),
        ("tls.certificate_path", profile.tls.certificate_path),
        ("tls.private_key_path", profile.tls.private_key_path),
    ):
        if not _SAFE_PATH.match(value):
            raise ValueError(
                f"{field}: {value!r} must be an absolute path of letters, digits, '.', '_', '-' and '/' "
                "(it becomes a Compose bind mount)"
            )

    services: dict[str, Any] = {
        "nginx": _nginx(profile),
        "runtime": _runtime(profile),
        "redis": _redis(profile),
        "prometheus": _prometheus(profile),
        "grafana": _grafana(profile),
        "node-exporter": _node_exporter(profile),
        "redis-exporter": _redis_exporter(profile),
        "alertmanager": _alertmanager(profile),
    }
    if profile.gpu is not None:
        services["dcgm-exporter"] = _dcgm_exporter(profile)
    if profile.relay.enabled:
        services["coturn"] = _coturn(profile)
    for service in services.values():
        service["restart"] = "unless-stopped"
        service["networks"] = [NETWORK]
        service["logging"] = _LOGGING
    # The runtime at a fixed address: coturn's peer rule names it and nothing else (infra.node.bundle.coturn).
    services["runtime"]["networks"] = {NETWORK: {"ipv4_address": profile.relay.runtime_address}}
    subnet = {"subnet": profile.relay.compose_subnet, "ip_range": profile.relay.dynamic_range}

    document = {
        "name": PROJECT_NAME,
        "services": services,
        "networks": {NETWORK: {"name": NETWORK, "driver": "bridge", "ipam": {"config": [subnet]}}},
        "secrets": {
            "grafana_admin_password": {"file": "./" + SECRET_FILES["grafana_admin_password"]},
            "redis_password": {"file": "./" + SECRET_FILES["redis_password"]},
            "token_keys": {"file": "./" + SECRET_FILES["token_keys"]},
            "app_token_keys": {"file": "./" + SECRET_FILES["app_token_keys"]},
            **{role: {"file": "./" + OPTIONAL_SECRET_FILES[role]} for role in optional_secret_roles(profile)},
        },
    }
    header = (
        f"# Rendered by infra.node.bundle.compose for profile {profile.name!r}. Do not edit: re-render.\n"
        "# Run from the bundle root (the directory holding this file and secrets/): docker compose up\n"
    )
    return {COMPOSE_FILE: (header + _dump(document)).encode()}


# --- services -------------------------------------------------------------------------------------------


def _nginx(profile: NodeProfile) -> dict[str, Any]:
    ports = profile.ports
    volumes = ["./nginx/nginx.conf:/etc/nginx/nginx.conf:ro", f"./{WEB_DIR}:{WEB_CONTAINER_ROOT}:ro"]
    volumes += [f"{d}:{d}:ro" for d in tls_dirs(profile)]
    if profile.tls.mode == "acme":  # certbot writes HTTP-01 tokens here on the host (infra.node.bundle.acme)
        volumes.append(f"{acme_dirs(profile).webroot}:{WEBROOT_CONTAINER}:ro")
    return {
        "image": IMAGES["nginx"],
        "depends_on": {"runtime": {"condition": "service_healthy"}},
        "ports": [
            _port(profile.public_address, ports.https),
            _port(profile.public_address, ports.http),
        ],
        "volumes": volumes,
        # The image's stop signal, spelled out: graceful, open WebSocket sessions go on.
        "stop_signal": "SIGQUIT",
        "stop_grace_period": f"{nginx_stop_grace_s(profile)}s",
        # Plain HTTP answers 301 for every path: nginx is up whatever the runtime does.
        "healthcheck": {
            "test": ["CMD", "curl", "-fsS", "-o", "/dev/null", f"http://127.0.0.1:{ports.http}/"],
            **_HEALTH_TIMING,
        },
    }


def _runtime(profile: NodeProfile) -> dict[str, Any]:
    port = profile.ports.runtime
    environment: dict[str, str | None] = dict(runtime_settings(profile))
    # The host may name the node (the VM's systemd unit passes its host name); else the profile's name.
    environment["DUPLEX_NODE_ID"] = f"${{DUPLEX_NODE_ID:-{environment['DUPLEX_NODE_ID']}}}"
    # The host says whether it is a GCE VM whose maintenance notices to watch
    # (runtime/frontend/maintenance.py): the
    # GCE VM's systemd unit sets DUPLEX_MAINTENANCE_WATCH=gce (infra/node/bundle/cloud_init.py); elsewhere
    # (on-premises hosts) it is off.
    environment["DUPLEX_MAINTENANCE_WATCH"] = "${DUPLEX_MAINTENANCE_WATCH:-off}"
    # No value: taken from the environment of `docker compose`, never written to a file.
    environment["HF_TOKEN"] = None
    service: dict[str, Any] = {
        "image": profile.runtime_image,
        "user": _user(_RUNTIME_USER),
        "depends_on": {"redis": {"condition": "service_healthy"}},
        "env_file": ["./" + SECRET_FILES["runtime_env"]],
        "environment": environment,
        # DUPLEX_TOKEN_KEYS_FILE, DUPLEX_APP_TOKEN_KEYS_FILE
        "secrets": [
            posixpath.basename(TOKEN_KEYS_CONTAINER_PATH),
            posixpath.basename(APP_TOKEN_KEYS_CONTAINER_PATH),
        ],
        "volumes": [f"{profile.model_cache_dir}:{_MODELS_DIR}"],
        "stop_signal": "SIGTERM",
        "stop_grace_period": f"{runtime_stop_grace_s(profile)}s",
        # /healthz, not /readyz: readiness is 503 while the model loads and while draining, not failures.
        # The server listens only once the model is loaded and warm: a first boot downloads the weights.
        "healthcheck": {
            "test": ["CMD", "curl", "-fsS", "-o", "/dev/null", f"http://127.0.0.1:{port}/healthz"],
            "interval": "10s",
            "timeout": "5s",
            "retries": 3,
            "start_period": "1800s",
        },
    }
    if profile.gpu is not None:
        service["deploy"] = _gpu_reservation()
    return service


def _redis(profile: NodeProfile) -> dict[str, Any]:
    port = profile.ports.redis
    # $$: a literal $ for the container's shell (Compose interpolates a single $).
    # As the admin user (password: secrets/redis_password): the default user is off
    # (infra.node.bundle.redis_acl).
    ping = (
        f'REDISCLI_AUTH="$$(cat {_SECRETS_MOUNT}/redis_password)" redis-cli --user admin -p {port} ping'
        " | grep -q PONG"
    )
    return {
        "image": IMAGES["redis"],
        "user": _user(_REDIS_USER),
        "command": ["redis-server", REDIS_CONF],
        "volumes": [
            f"./redis/redis.conf:{REDIS_CONF}:ro",
            f"./{SECRET_FILES['redis_auth_conf']}:{REDIS_AUTH_CONF}:ro",
            f"{posixpath.join(profile.data_dir, 'redis')}:/data",
        ],
        "secrets": ["redis_password"],
        "stop_grace_period": "30s",
        "healthcheck": {"test": ["CMD-SHELL", ping], **_HEALTH_TIMING},
    }


def _prometheus(profile: NodeProfile) -> dict[str, Any]:
    port = profile.ports.prometheus
    return {
        "image": IMAGES["prometheus"],
        "user": _user(_PROMETHEUS_USER),
        "command": _prometheus_command(profile),
        "ports": [_port(profile.private_address, port)],
        "volumes": [
            f"./prometheus/prometheus.yml:{PROMETHEUS_CONFIG}:ro",
            f"./prometheus/rules:{PROMETHEUS_RULES_DIR}:ro",
            f"{posixpath.join(profile.data_dir, 'prometheus')}:{PROMETHEUS_DATA_DIR}",
        ],
        "healthcheck": {
            "test": ["CMD", "wget", "-q", "-O", "/dev/null", f"http://127.0.0.1:{port}/-/healthy"],
            **_HEALTH_TIMING,
        },
    }


def _prometheus_command(profile: NodeProfile) -> list[str]:
    listen = f"0.0.0.0:{profile.ports.prometheus}"
    return prometheus_args(profile, PROMETHEUS_CONFIG, PROMETHEUS_DATA_DIR, listen)


def _alertmanager(profile: NodeProfile) -> dict[str, Any]:
    port = profile.ports.alertmanager
    service: dict[str, Any] = {
        "image": IMAGES["alertmanager"],
        "user": _user(_ALERTMANAGER_USER),
        "command": alertmanager_args(ALERTMANAGER_CONFIG_PATH, ALERTMANAGER_DATA_DIR, f"0.0.0.0:{port}"),
        "ports": [_port(profile.private_address, port)],
        "volumes": [
            f"./{ALERTMANAGER_CONFIG}:{ALERTMANAGER_CONFIG_PATH}:ro",
            f"{posixpath.join(profile.data_dir, 'alertmanager')}:{ALERTMANAGER_DATA_DIR}",
        ],
        "healthcheck": {
            "test": ["CMD", "wget", "-q", "-O", "/dev/null", f"http://127.0.0.1:{port}/-/healthy"],
            **_HEALTH_TIMING,
        },
    }
    roles = optional_secret_roles(profile)
    if roles:
        service["secrets"] = list(roles)
    return service


def _grafana(profile: NodeProfile) -> dict[str, Any]:
    port = profile.ports.grafana
    return {
        "image": IMAGES["grafana"],
        "user": _user(_GRAFANA_USER),
        "depends_on": {"prometheus": {"condition": "service_started"}},
        "environment": {
            "GF_SERVER_HTTP_PORT": str(port),
            "GF_SECURITY_ADMIN_USER": "admin",
            "GF_SECURITY_ADMIN_PASSWORD__FILE": f"{_SECRETS_MOUNT}/grafana_admin_password",
            "GF_USERS_ALLOW_SIGN_UP": "false",
            "GF_AUTH_ANONYMOUS_ENABLED": "false",
            "GF_ANALYTICS_REPORTING_ENABLED": "false",
            "GF_ANALYTICS_CHECK_FOR_UPDATES": "false",
            "GF_ANALYTICS_CHECK_FOR_PLUGIN_UPDATES": "false",
        },
        "secrets": ["grafana_admin_password"],
        "ports": [_port(profile.private_address, port)],
        "volumes": [
            f"./grafana/provisioning/datasources:{GRAFANA_PROVISIONING_DIR}/datasources:ro",
            f"./grafana/provisioning/dashboards:{GRAFANA_PROVISIONING_DIR}/dashboards:ro",
            f"./grafana/dashboards:{GRAFANA_DASHBOARDS_DIR}:ro",
            f"{posixpath.join(profile.data_dir, 'grafana')}:/var/lib/grafana",
        ],
        "healthcheck": {
            "test": ["CMD", "curl", "-fsS", "-o", "/dev/null", f"http://127.0.0.1:{port}/api/health"],
            **_HEALTH_TIMING,
        },
    }


def _node_exporter(profile: NodeProfile) -> dict[str, Any]:
    # node_exporter's README: host PID namespace and the host's root read-only at /host. It stays on the
    # bridge network (Prometheus dials node-exporter:PORT), so network-device metrics are the container's.
    # With ACME, the textfile collector reads the renew script's metrics
    # (infra.node.bundle.acme.METRICS_FILE).
    port = profile.ports.node_exporter
    command = ["--path.rootfs=/host", f"--web.listen-address=:{port}"]
    if profile.tls.mode == "acme":
        command.append(f"--collector.textfile.directory=/host{textfile_dir(profile)}")
    return {
        "image": IMAGES["node-exporter"],
        "command": command,
        "pid": "host",
        "volumes": ["/:/host:ro,rslave"],
        "healthcheck": {
            "test": ["CMD", "wget", "-q", "-O", "/dev/null", f"http://127.0.0.1:{port}/"],
            **_HEALTH_TIMING,
        },
    }


def _redis_exporter(profile: NodeProfile) -> dict[str, Any]:
    port = profile.ports.redis_exporter
    return {
        "image": IMAGES["redis-exporter"],
        "user": _user(_REDIS_EXPORTER_USER),
        "depends_on": {"redis": {"condition": "service_healthy"}},
        "env_file": ["./" + SECRET_FILES["redis_exporter_env"]],
        "environment": {
            "REDIS_ADDR": f"redis://{endpoint(profile, 'redis')}",
            "REDIS_EXPORTER_WEB_LISTEN_ADDRESS": f"0.0.0.0:{port}",
        },
        "healthcheck": {
            "test": ["CMD", "wget", "-q", "-O", "/dev/null", f"http://127.0.0.1:{port}/health"],
            **_HEALTH_TIMING,
        },
    }


def _coturn(profile: NodeProfile) -> dict[str, Any]:
    # On the bridge network like the rest: its relay addresses are its own (private) address, which the
    # runtime reaches directly, so only the two listeners are published (docs/node.md, "The TURN relay").
    relay = profile.relay
    volumes = [f"./{SECRET_FILES['turnserver_conf']}:{COTURN_CONFIG_PATH}:ro"]
    volumes += [f"{d}:{d}:ro" for d in tls_dirs(profile)]  # nginx's certificate, renewed in place
    return {
        "image": IMAGES["coturn"],
        # Root without capabilities: reads the root-owned 0600 key and 0640 configuration as their owner,
        # binds unprivileged ports only.
        "user": "0:0",
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true"],
        "read_only": True,
        "tmpfs": ["/tmp", "/var/lib/coturn"],
        "entrypoint": ["turnserver"],
        "command": coturn_args(COTURN_CONFIG_PATH, "/tmp/turnserver.pid"),
        "ports": [
            {
                "target": relay.port,
                "published": str(relay.port),
                "host_ip": profile.public_address,
                "protocol": "udp",
            },
            _port(profile.public_address, relay.tls_port),
        ],
        "volumes": volumes,
        # A STUN Binding request on the UDP listener (the image ships turnutils_stunclient).
        "healthcheck": {
            "test": ["CMD", "turnutils_stunclient", "-p", str(relay.port), "127.0.0.1"],
            **_HEALTH_TIMING,
        },
    }


def _dcgm_exporter(profile: NodeProfile) -> dict[str, Any]:
    port = profile.ports.dcgm_exporter
    return {
        "image": IMAGES["dcgm-exporter"],
        # NVIDIA's instructions: SYS_ADMIN for the profiling (DCP) metrics.
        "cap_add": ["SYS_ADMIN"],
        "environment": {"DCGM_EXPORTER_LISTEN": f":{port}"},
        "deploy": _gpu_reservation(),
        # No curl or wget in the image; bash can open a TCP connection.
        "healthcheck": {
            "test": ["CMD", "bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"],
            **_HEALTH_TIMING,
        },
    }


# --- helpers --------------------------------------------------------------------------------------------


def _gpu_reservation() -> dict[str, Any]:
    device = {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    return {"resources": {"reservations": {"devices": [device]}}}


def _port(host_ip: str, port: int) -> dict[str, Any]:
    return {"target": port, "published": str(port), "host_ip": host_ip, "protocol": "tcp"}


def _user(user: tuple[int, int]) -> str:
    return f"{user[0]}:{user[1]}"


def _dump(document: dict[str, Any]) -> str:
    return dump_yaml(document)  # no aliases: the logging mapping is shared between services
