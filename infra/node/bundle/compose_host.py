"""The host's side of a ``compose`` node: the directories to prepare before ``docker compose up`` (owned by
the fixed users the containers run as), how long stopping may take (nginx, then the runtime's drain), and the
command that makes the TLS servers read a renewed certificate. ``infra.node.bundle.compose`` re-exports every
public name here; cloud-init's unit and the on-premises component use them."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from infra.node.bundle.acme import acme_dirs
from infra.node.profile.profiles import NodeProfile

__all__ = [
    "CONTAINER_USERS",
    "GRAFANA_UID",
    "NGINX_STOP_MARGIN_S",
    "RUNTIME_STOP_MARGIN_S",
    "RUNTIME_UID",
    "HostDirectory",
    "host_directories",
    "nginx_stop_grace_s",
    "node_stop_timeout_s",
    "runtime_stop_grace_s",
    "tls_dirs",
    "tls_reload_command",
]

RUNTIME_UID = 10001
"""The runtime image's user (``images/runtime/Dockerfile``: ``useradd --uid 10001 duplex``): the Compose
node's runtime container and the GKE pods run as it."""
GRAFANA_UID = 472
"""The grafana/grafana image's default user (its Compose container and its GKE pod)."""

CONTAINER_USERS: dict[str, tuple[int, int]] = {
    "runtime": (RUNTIME_UID, 0),  # group 0 reads the token keys
    "redis": (999, 0),  # the image's redis user, group 0 to read the 0640 secrets; skips the gosu step
    "prometheus": (65534, 65534),  # the image's nobody
    "grafana": (GRAFANA_UID, 0),
    "redis-exporter": (59000, 59000),  # the scratch image's user, kept on the Alpine variant
    "alertmanager": (65534, 0),  # the image's nobody, group 0 to read the 0640 receiver secrets
}
"""(uid, gid) each container runs as. Fixed so that host directories can be prepared with matching
owners."""

RUNTIME_STOP_MARGIN_S = 30
"""After the drain grace the runtime closes the remaining sessions (up to 5 s) and flushes Redis."""

NGINX_STOP_MARGIN_S = 10
"""nginx's grace beyond the drain grace, before Docker kills it."""


@dataclass(frozen=True)
class HostDirectory:
    """A directory the node needs on the host before ``docker compose up``: path, owner and mode."""

    path: str
    uid: int
    gid: int
    mode: int
    purpose: str


def runtime_stop_grace_s(profile: NodeProfile) -> int:
    """The runtime's ``stop_grace_period`` (s): the drain grace plus ``RUNTIME_STOP_MARGIN_S``."""
    return profile.limits.drain_grace_s + RUNTIME_STOP_MARGIN_S


def nginx_stop_grace_s(profile: NodeProfile) -> int:
    """nginx's ``stop_grace_period`` (s): SIGQUIT lets open sessions go on for the drain grace."""
    return profile.limits.drain_grace_s + NGINX_STOP_MARGIN_S


def node_stop_timeout_s(profile: NodeProfile) -> int:
    """Upper bound (s) for ``docker compose down``: nginx, then the runtime, each within its grace
    period, plus a minute for the rest (Redis's last save, removing containers and the network)."""
    return nginx_stop_grace_s(profile) + runtime_stop_grace_s(profile) + 60


def host_directories(profile: NodeProfile) -> list[HostDirectory]:
    """Directories to create on the host (with these owners) before the first ``docker compose up``:
    the containers run as fixed non-root users and Docker would create a missing bind source as root."""
    data = profile.data_dir
    dirs = [
        HostDirectory(profile.model_cache_dir, *CONTAINER_USERS["runtime"], 0o750, "model cache (/models)"),
        HostDirectory(posixpath.join(data, "redis"), *CONTAINER_USERS["redis"], 0o750, "Redis data (/data)"),
        HostDirectory(
            posixpath.join(data, "prometheus"), *CONTAINER_USERS["prometheus"], 0o750, "Prometheus TSDB"
        ),
        HostDirectory(posixpath.join(data, "grafana"), *CONTAINER_USERS["grafana"], 0o750, "Grafana data"),
        HostDirectory(
            posixpath.join(data, "alertmanager"),
            *CONTAINER_USERS["alertmanager"],
            0o750,
            "Alertmanager silences, log",
        ),
    ]
    if profile.tls.mode == "acme":
        dirs.append(
            HostDirectory(acme_dirs(profile).webroot, 0, 0, 0o755, "ACME HTTP-01 webroot (nginx, certbot)")
        )
    for tls_dir in tls_dirs(profile):
        dirs.append(HostDirectory(tls_dir, 0, 0, 0o755, "TLS certificate and key (nginx)"))
    return dirs


def tls_reload_command(profile: NodeProfile, compose: str) -> str:
    """The shell command that makes the node's TLS servers read a renewed certificate (ACME deploy hook,
    ``infra.node.bundle.acme``): SIGHUP to nginx and, where the relay runs, SIGUSR2 to coturn (coturn 4.6
    reloads its certificate on SIGUSR2 with its allocations kept: tried here on Debian's 4.6.1). ``compose``
    is the ``docker compose ...`` prefix of the node's project."""
    command = f"{compose} kill --signal HUP nginx"
    if profile.relay.enabled:
        command += f" && {compose} kill --signal USR2 coturn"
    return command


def tls_dirs(profile: NodeProfile) -> list[str]:
    """The host directories of the node's certificate and key (bind-mounted read-only into nginx, coturn)."""
    dirs = [posixpath.dirname(profile.tls.certificate_path), posixpath.dirname(profile.tls.private_key_path)]
    return list(dict.fromkeys(dirs))
