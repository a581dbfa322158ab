"""The node bundle: every configuration file of one node, rendered from its profile.

``render_bundle(profile)`` returns ``{relative path: bytes}``; the same profile gives the same bytes (no
timestamps, no secrets, sorted keys), so a bundle can be diffed, reviewed, shipped as cloud-init user-data
or copied over SSH, and a re-run with an unchanged profile changes nothing.

=================================================  ==========================================
path                                                rendered by
=================================================  ==========================================
``nginx/nginx.conf``                                ``infra.node.bundle.nginx``
``web/`` (the browser client, served at ``/``)      ``infra.node.bundle.webclient``
``redis/redis.conf``                                ``infra.node.bundle.redis_conf``
``prometheus/prometheus.yml``, ``rules/``, ``tests/``  ``infra.node.monitoring.prometheus``
``alertmanager/alertmanager.yml``                    ``infra.node.monitoring.alertmanager``
``grafana/provisioning/...``, ``grafana/dashboards/``  ``infra.node.monitoring.grafana``
``compose.yaml`` (compose nodes)                    ``infra.node.bundle.compose``
``cloud-init/user-data.yaml`` (compose nodes)        ``infra.node.bundle.cloud_init``
=================================================  ==========================================

Secrets are written apart (``write_secrets``) into ``secrets/`` beside the bundle.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from infra.node.bundle.cloud_init import render_cloud_init
from infra.node.bundle.compose import render_compose
from infra.node.bundle.nginx import render_nginx
from infra.node.bundle.redis_conf import render_redis
from infra.node.bundle.services import SECRETS_DIR, NodeSecrets, secret_files
from infra.node.bundle.webclient import render_web
from infra.node.monitoring.alertmanager import render_alertmanager
from infra.node.monitoring.grafana import render_grafana
from infra.node.monitoring.prometheus import render_prometheus
from infra.node.profile.profiles import NodeProfile

__all__ = ["render_bundle", "write_bundle", "write_secrets"]


def render_bundle(profile: NodeProfile) -> dict[str, bytes]:
    """All files of the node's bundle, ``{posix path relative to the bundle root: content}``, sorted.

    Every node gets the browser client nginx serves at ``/`` (``web/``). A ``compose`` node also gets
    ``compose.yaml`` and the cloud-init user-data that installs the rest of the bundle, the client included,
    on a fresh GCE VM (secrets fetched at boot from Secret Manager, see ``infra.node.bundle.cloud_init``).

    Raises:
        ValueError: two renderers produced the same path (a bug), or a path escapes the bundle.
    """
    files: dict[str, bytes] = {}
    parts = [render_nginx(profile), render_redis(profile), render_prometheus(profile)]
    parts.append(render_alertmanager(profile))
    parts.append(render_grafana(profile))
    parts.append(render_web())
    if profile.deployment == "compose":
        parts.append(render_compose(profile))
    for part in parts:
        for path, content in part.items():
            _check_relative(path)
            if path in files:
                raise ValueError(f"two renderers wrote {path}")
            files[path] = content
    if profile.deployment == "compose":
        files.update(render_cloud_init(profile, files))
    return dict(sorted(files.items()))


def write_bundle(files: dict[str, bytes], directory: Path) -> list[Path]:
    """Write ``files`` (from ``render_bundle``) under ``directory``; returns the paths written.

    Files are written atomically (temporary file, then rename) with mode 0644; existing files not in
    ``files`` are left alone (``secrets/``, data directories).

    Raises:
        ValueError: a path is absolute or climbs out of ``directory``.
    """
    written = []
    for path, content in files.items():
        _check_relative(path)
        target = directory / path
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(content)
        tmp.chmod(0o644)
        tmp.replace(target)
        written.append(target)
    return written


def write_secrets(profile: NodeProfile, node_secrets: NodeSecrets, directory: Path) -> list[Path]:
    """Write the node's secret files into ``directory/secrets`` (directory 0700, files 0600)."""
    secrets_dir = directory / SECRETS_DIR
    secrets_dir.mkdir(parents=True, exist_ok=True)
    secrets_dir.chmod(0o700)
    written = []
    for path, content in secret_files(profile, node_secrets).items():
        target = directory / path
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(content)
        written.append(target)
    return written


def _check_relative(path: str) -> None:
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts:
        raise ValueError(f"bundle path {path!r} must be relative and stay inside the bundle")
