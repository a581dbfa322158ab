"""The browser client served from each cluster (issue 20 item 4): a small unprivileged nginx Deployment on
the system pool, one pod in each of the region's zones, whose Service GKE exposes as standalone NEGs
(``page_neg_name``) behind the stack's global load balancer, beside the runtime's.

Why not a public bucket: a backend bucket reads its bucket anonymously, so the bucket must grant
``allUsers``, which every organization created since 3 May 2024 refuses (secure-by-default organization
policies: public access prevention, domain-restricted sharing); GCP's backend-bucket guides have no private
bucket. The load balancer adds the page's response headers (``infra.node.bundle.webclient.page_headers``) on
its
page backend service, so this nginx serves files and nothing else. docs/deploying.md, "Stack multi-region".
"""

from __future__ import annotations

from typing import Any

from infra.k8s.base import (
    RegionWorkload,
    cluster_ip_service,
    container_security,
    object_meta,
    pod_security,
    selector_labels,
    standard_labels,
)
from infra.k8s.workload import neg_annotation, zone_spread
from infra.node.bundle.compose import IMAGES
from infra.node.bundle.webclient import WEB_DIR, WEB_TYPES, render_web

__all__ = [
    "PAGE_HEALTH_PATH",
    "PAGE_NAME",
    "PAGE_PORT",
    "PAGE_ROOT",
    "PAGE_UID",
    "page_files",
    "page_nginx_conf",
    "page_objects",
]

PAGE_NAME = "duplex-page"
"""Name of the page's ConfigMap, Deployment and Service; its pods' ``app.kubernetes.io/name``."""

PAGE_PORT = 8080
"""The page's serving port (unprivileged: above 1023), the port of its NEG endpoints."""

PAGE_HEALTH_PATH = "/index.html"
"""What the load balancer's health check of the page asks for."""

PAGE_ROOT = "/usr/share/duplex/web"
"""Where the page's files are mounted in the nginx container."""

PAGE_UID = 101
"""The ``nginx`` user of the official nginx image (``IMAGES["nginx"]``)."""

_CONF_DIR = "/etc/duplex-page"
_CONF_KEY = "nginx.conf"


def page_files() -> dict[str, str]:
    """The browser client's files, ``{file name: text}`` (``infra.node.bundle.webclient.render_web``
    without its
    ``web/`` prefix)."""
    return {
        path.removeprefix(f"{WEB_DIR}/"): content.decode("utf-8") for path, content in render_web().items()
    }


def page_nginx_conf(root: str = PAGE_ROOT, port: int = PAGE_PORT, temp_dir: str = "/tmp") -> str:
    """nginx's whole configuration for the page: one worker, run by an unprivileged user with a read-only
    root filesystem (pid and temporary files in ``temp_dir``), listening on ``port``; ``GET /`` is
    ``index.html``, any other path a file of ``root`` with the type of ``WEB_TYPES`` or 404. No headers
    are added here: the load balancer adds the page's (``GlobalEntry``)."""
    types = " ".join(f"{mime} {ext};" for ext, mime in sorted(WEB_TYPES.items()))
    temps = "\n".join(
        f"    {kind}_temp_path {temp_dir}/{kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""worker_processes 1;
pid {temp_dir}/nginx.pid;
error_log stderr warn;
events {{
    worker_connections 512;
}}
http {{
    access_log off;
    server_tokens off;
{temps}
    types {{ {types} }}
    default_type application/octet-stream;
    server {{
        listen {port};
        root {root};
        location = / {{
            try_files /index.html =404;
        }}
        location / {{
            limit_except GET {{ deny all; }}
            try_files $uri =404;
        }}
    }}
}}
"""


def page_objects(workload: RegionWorkload) -> list[dict[str, Any]]:
    """The page's objects in the runtime's namespace: a ConfigMap (the client's files and
    ``page_nginx_conf``), a Deployment of one nginx pod per zone of ``workload.zones`` (spread as a
    scheduling rule: ``zone_spread``; the system pool has a node in each zone, the GPU pool's taint keeps
    it off GPU nodes), Pod Security ``restricted`` (uid ``PAGE_UID``, read-only root filesystem, an
    emptyDir for ``/tmp``), and its ClusterIP Service with a standalone NEG per zone
    (``workload.page_neg_name``)."""
    return nginx_pods(
        workload,
        name=PAGE_NAME,
        component="page",
        conf=page_nginx_conf(),
        conf_dir=_CONF_DIR,
        port=PAGE_PORT,
        probe={
            "httpGet": {"path": PAGE_HEALTH_PATH, "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 3,
        },
        resources={"requests": {"cpu": "20m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
        neg_name=workload.page_neg_name,
        files=page_files(),
        files_dir=PAGE_ROOT,
    )


def nginx_pods(
    workload: RegionWorkload,
    *,
    name: str,
    component: str,
    conf: str,
    conf_dir: str,
    port: int,
    probe: dict[str, Any],
    resources: dict[str, Any],
    neg_name: str,
    files: dict[str, str] | None = None,
    files_dir: str = "",
) -> list[dict[str, Any]]:
    """An nginx Deployment on the system pool behind a standalone NEG per zone (the page's; a region's
    resume router): a ConfigMap ``name`` holding ``conf`` (mounted at ``conf_dir``) and ``files`` (mounted at
    ``files_dir``, when given), one pod per zone of ``workload.zones`` (``zone_spread``), Pod Security
    ``restricted`` (uid ``PAGE_UID``: the nginx image's own user; read-only root filesystem, an emptyDir for
    ``/tmp``), ``probe`` for readiness and liveness, and the ClusterIP Service on ``port`` whose NEGs are
    ``neg_name``. ``[ConfigMap, Deployment, Service]``."""
    files = files or {}
    labels = selector_labels(name)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(workload, name, component),
        "data": {**files, _CONF_KEY: conf},
    }
    mounts = [{"name": "files", "mountPath": files_dir, "readOnly": True}] if files else []
    nginx = {
        "name": "nginx",
        "image": IMAGES["nginx"],
        "command": ["nginx", "-c", f"{conf_dir}/{_CONF_KEY}", "-g", "daemon off;"],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "resources": resources,
        "readinessProbe": probe,
        "livenessProbe": {**probe, "failureThreshold": 3},
        "securityContext": container_security(),
        "volumeMounts": [
            *mounts,
            {"name": "conf", "mountPath": conf_dir, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }

    def config_volume(volume: str, keys: list[str]) -> dict[str, Any]:
        items = [{"key": key, "path": key} for key in keys]
        return {"name": volume, "configMap": {"name": name, "defaultMode": 0o444, "items": items}}

    volumes = [config_volume("files", sorted(files))] if files else []
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(workload, name, component),
        "spec": {
            "replicas": len(workload.zones),
            "selector": {"matchLabels": labels},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": standard_labels(name, component)},
                "spec": {
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security(PAGE_UID),
                    "topologySpreadConstraints": zone_spread(labels),
                    "containers": [nginx],
                    "volumes": [
                        *volumes,
                        config_volume("conf", [_CONF_KEY]),
                        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
                    ],
                },
            },
        },
    }
    annotations = {"cloud.google.com/neg": neg_annotation(neg_name, port, workload.zones)}
    service = cluster_ip_service(workload, name, component, "http", port, annotations=annotations)
    return [config_map, deployment, service]
