"""The services of a node, where each one is reached from inside the node, and the node's secrets.

Every renderer asks ``endpoint(profile, service)`` for a ``host:port`` so that nginx's upstream,
Prometheus's targets and Grafana's datasource agree: in a ``compose`` deployment services find each other
by their Compose service name on the node's bridge network; in a ``processes`` deployment (the local node)
everything listens on ``profile.private_address``.

Secrets never go into the rendered bundle (it is deterministic and may be shown, diffed or stored as plain
stack outputs). They are written next to it, in ``secrets/`` (mode 0700, files 0600), by whoever brings
the node up: ``infra.node.local`` here, cloud-init from Secret Manager on a GCE VM, Pulumi over SSH on an
on-premises host. ``SECRET_FILES`` names them; renderers reference them by these paths.
"""

from __future__ import annotations

import secrets as _stdlib_secrets
from dataclasses import dataclass, field
from typing import Literal

from infra.node.profile import NodeProfile

__all__ = [
    "SECRETS_DIR",
    "SECRET_FILES",
    "SERVICES",
    "NodeSecrets",
    "Service",
    "endpoint",
    "runtime_settings",
    "secret_files",
    "services_of",
]

Service = Literal[
    "nginx", "runtime", "redis", "prometheus", "grafana", "node-exporter", "redis-exporter", "dcgm-exporter"
]
SERVICES: tuple[Service, ...] = (
    "nginx",
    "runtime",
    "redis",
    "prometheus",
    "grafana",
    "node-exporter",
    "redis-exporter",
    "dcgm-exporter",
)

_PORT_FIELD: dict[Service, str] = {
    "nginx": "https",
    "runtime": "runtime",
    "redis": "redis",
    "prometheus": "prometheus",
    "grafana": "grafana",
    "node-exporter": "node_exporter",
    "redis-exporter": "redis_exporter",
    "dcgm-exporter": "dcgm_exporter",
}

SECRETS_DIR = "secrets"
"""Directory, relative to the bundle root, holding the secret files (never rendered, never committed)."""

SECRET_FILES = {
    "redis_password": "secrets/redis_password",
    "redis_auth_conf": "secrets/redis-auth.conf",
    "runtime_env": "secrets/runtime.env",
    "redis_exporter_env": "secrets/redis-exporter.env",
    "grafana_admin_password": "secrets/grafana_admin_password",
}
"""What ``secret_files`` writes, by role: the Redis password alone; ``requirepass`` for redis.conf's
``include``; ``DUPLEX_REDIS_URL`` for the runtime; ``REDIS_PASSWORD`` for redis_exporter; Grafana's admin
password (read through ``GF_SECURITY_ADMIN_PASSWORD__FILE``)."""


def endpoint(profile: NodeProfile, service: Service) -> str:
    """``host:port`` at which other parts of the node reach ``service``.

    Raises:
        ValueError: unknown service (lists the allowed ones), or ``dcgm-exporter`` on a CPU node.
    """
    if service not in _PORT_FIELD:
        raise ValueError(f"unknown service {service!r}; allowed: {', '.join(SERVICES)}")
    if service == "dcgm-exporter" and profile.gpu is None:
        raise ValueError(f"profile {profile.name!r} has no GPU: it runs no dcgm-exporter")
    port = getattr(profile.ports, _PORT_FIELD[service])
    host = service if profile.deployment == "compose" else profile.private_address
    return f"{host}:{port}"


def runtime_settings(profile: NodeProfile) -> dict[str, str]:
    """The runtime's non-secret ``DUPLEX_*`` environment for this node (``runtime/config.py``); the Redis
    URL, which holds the password, comes from ``secrets/runtime.env``. ``DUPLEX_HOST`` is the private
    address for host processes and ``0.0.0.0`` in a container (whose only network is the node's bridge)."""
    settings = {
        "DUPLEX_HOST": profile.private_address if profile.deployment == "processes" else "0.0.0.0",
        "DUPLEX_PORT": str(profile.ports.runtime),
        "DUPLEX_MODEL": profile.model,
        "DUPLEX_DEVICE": profile.device,
        "DUPLEX_MAX_SESSIONS": str(profile.sessions),
        "DUPLEX_NODE_ID": profile.name,
        "DUPLEX_DRAIN_GRACE_S": str(profile.limits.drain_grace_s),
        "DUPLEX_MAX_SESSION_S": str(profile.limits.max_session_s),
        "DUPLEX_TRANSCRIPT_TTL_S": str(profile.retention.transcript_ttl_hours * 3600),
    }
    if profile.runtime_dtype is not None:
        settings["DUPLEX_DTYPE"] = profile.runtime_dtype
    return settings


def services_of(profile: NodeProfile) -> tuple[Service, ...]:
    """The services this node runs (``dcgm-exporter`` only where there is a GPU)."""
    return tuple(s for s in SERVICES if s != "dcgm-exporter" or profile.gpu is not None)


@dataclass(frozen=True)
class NodeSecrets:
    """The node's secrets (hidden from ``repr``). ``generate()`` makes fresh random ones (local node,
    first boot); stacks pass Pulumi secrets or Secret Manager values instead."""

    redis_password: str = field(repr=False)
    grafana_admin_password: str = field(repr=False)

    def __post_init__(self) -> None:
        for name in ("redis_password", "grafana_admin_password"):
            value = getattr(self, name)
            if len(value) < 16 or any(c.isspace() or c in "\"'@:/\\" for c in value):
                raise ValueError(
                    f"{name} must be at least 16 characters with no spaces, quotes, '@', ':', '/' or '\\' "
                    "(it goes into a Redis URL and config files)"
                )

    @classmethod
    def generate(cls) -> NodeSecrets:
        """Fresh random secrets: 32 URL-safe characters each (192 bits)."""
        return cls(
            redis_password=_stdlib_secrets.token_urlsafe(24),
            grafana_admin_password=_stdlib_secrets.token_urlsafe(24),
        )


def secret_files(profile: NodeProfile, node_secrets: NodeSecrets) -> dict[str, bytes]:
    """The files of ``SECRET_FILES`` for this node, as {path relative to the bundle root: content}."""
    redis_host, redis_port = endpoint(profile, "redis").rsplit(":", 1)
    password = node_secrets.redis_password
    return {
        SECRET_FILES["redis_password"]: password.encode(),
        SECRET_FILES["redis_auth_conf"]: f"requirepass {password}\n".encode(),
        SECRET_FILES[
            "runtime_env"
        ]: f"DUPLEX_REDIS_URL=redis://:{password}@{redis_host}:{redis_port}/0\n".encode(),
        SECRET_FILES["redis_exporter_env"]: f"REDIS_PASSWORD={password}\n".encode(),
        SECRET_FILES["grafana_admin_password"]: node_secrets.grafana_admin_password.encode(),
    }
