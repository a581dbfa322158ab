"""The region's resume router (issue 33; docs/deploying.md, "Resume across regions"): a small unprivileged
nginx Deployment on the system pool, one pod per zone like the page's (``infra.k8s.page``), behind its own
standalone NEGs (``RegionWorkload.resume_router_neg_name``), to which the global URL map sends
``/r/<region>/*`` (``infra.components.global_entry``).

What it proxies, and nothing else (any other path is 404):

- ``/r/<region>/<a-b-c-d>/api/chat`` and ``.../api/rtc``: a resume (the WebSocket upgrade, or WebRTC's
  ``POST``) to the runtime pod ``<a-b-c-d>`` by its DNS name under the headless Service
  (``infra.k8s.pod_routes``), port 8998. The pattern admits only a dashed IPv4 address, and the cluster's
  DNS answers those names only for the Service's endpoints: the URL cannot aim the router anywhere else.
  A name that does not resolve (the pod is gone, and its slot with it) is answered 410 ``resume_expired``;
  a pod that is there but does not hold the session refuses the credential itself (``resume_invalid``).
- ``/r/<region>/api/rtc``: a WebRTC offer to the region's runtime Service, so that it is answered in the
  region whose ICE servers (TURN relay) the caller was given (``runtime.region_routes.offer_url``).

The load balancer's ``X-Forwarded-For`` passes on untouched (the pods trust the region's pod ranges for it:
``pod_routes.resume_routes_env``); the read timeout is the longest session's, as the node's nginx.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra.k8s.base import (
    APP_NAME,
    RegionWorkload,
    cluster_ip_service,
    container_security,
    object_meta,
    pod_security,
    selector_labels,
    standard_labels,
)
from infra.k8s.page import PAGE_UID
from infra.k8s.pod_routes import pod_dns_suffix, runtime_pods_service
from infra.k8s.workload import neg_annotation, zone_spread
from infra.node.bundle.compose import IMAGES
from infra.node.bundle.nginx import SESSION_TIMEOUT_MARGIN_S

__all__ = [
    "KUBE_DNS",
    "POD_LABEL_PATTERN",
    "ROUTER_HEALTH_PATH",
    "ROUTER_NAME",
    "ROUTER_PORT",
    "router_nginx_conf",
    "router_objects",
]

ROUTER_NAME = "duplex-resume-router"
"""Name of the router's ConfigMap, Deployment and Service; its pods' ``app.kubernetes.io/name``."""

ROUTER_PORT = 8081
"""The router's serving port (unprivileged), the port of its NEG endpoints."""

ROUTER_HEALTH_PATH = "/healthz"
"""What the load balancer's health check of the router asks for (answered by nginx itself)."""

KUBE_DNS = "kube-dns.kube-system.svc.cluster.local"
"""The cluster's DNS Service (GKE's default kube-dns; the stack's clusters do not switch to Cloud DNS):
nginx resolves pod names through it at request time, keeping an answer ``DNS_VALID_S``."""

DNS_VALID_S = 5
"""How long nginx keeps a DNS answer (s): a pod's name lives as long as the pod."""

POD_LABEL_PATTERN = r"(?:[0-9]{1,3}-){3}[0-9]{1,3}"
"""A pod's name in a resume path: a dashed IPv4 address (``runtime.region_routes.pod_label``)."""

GONE = "resume_expired: the pod named in this resume URL is gone, and its slot with it: start a new session"
"""The router's 410 body when a pod's name does not resolve (``<reason>: <sentence>``, as the runtime's)."""

_CONF_DIR = "/etc/duplex-resume-router"
_TEMPS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
_CONF_KEY = "nginx.conf"


def router_nginx_conf(
    region: str,
    *,
    pod_suffix: str,
    runtime_port: int,
    region_runtime: str,
    read_timeout_s: int,
    resolver: str | None = KUBE_DNS,
    pod_addresses: Mapping[str, str] | None = None,
    port: int = ROUTER_PORT,
    temp_dir: str = "/tmp",
) -> str:
    """nginx's whole configuration for ``region``'s router (see the module docstring).

    Args:
        region: the region (the ``/r/<region>/`` prefix it answers).
        pod_suffix: appended to a pod's dashed address to make its DNS name (``pod_dns_suffix``).
        runtime_port: the pods' port (8998).
        region_runtime: ``host:port`` of the region's runtime Service (the regional offer).
        read_timeout_s: proxy read and send timeout (s): the longest session plus a margin.
        resolver: the DNS server for pod names, or None (a test harness: ``pod_addresses`` only).
        pod_addresses: ``{dashed address: host:port}`` answered before DNS (a harness's loopback pods).
        port: the listening port; temp_dir: pid and temporary files (the root filesystem is read-only).

    Raises:
        ValueError: a ``pod_addresses`` key that is not a dashed IPv4 address.
    """
    import re

    entries = ""
    for label, address in sorted((pod_addresses or {}).items()):
        if not re.fullmatch(POD_LABEL_PATTERN, label):
            raise ValueError(f"router_nginx_conf: pod name {label!r} is not a dashed IPv4 address: 10-4-0-12")
        entries += f'        "{label}" {address};\n'
    temps = "\n".join(f"    {kind}_temp_path {temp_dir}/{kind};" for kind in _TEMPS)
    dns = "" if resolver is None else f"    resolver {resolver} valid={DNS_VALID_S}s ipv6=off;\n"
    proxy = f"""            proxy_http_version 1.1;
            proxy_set_header Host $host;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout {read_timeout_s}s;
            proxy_send_timeout {read_timeout_s}s;"""
    return f"""worker_processes 1;
pid {temp_dir}/nginx.pid;
error_log stderr warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
    server_tokens off;
{temps}
{dns}    map $http_upgrade $connection_upgrade {{
        default upgrade;
        "" close;
    }}
    map $pod $pod_upstream {{
        default $pod{pod_suffix}:{runtime_port};
{entries}    }}
    server {{
        listen {port};
        default_type text/plain;
        location = {ROUTER_HEALTH_PATH} {{
            return 200 "ok\\n";
        }}
        location ~ "^/r/{region}/(?<pod>{POD_LABEL_PATTERN})/api/(?<api>chat|rtc)$" {{
            proxy_pass http://$pod_upstream/api/$api$is_args$args;
{proxy}
            error_page 502 504 = @gone;
        }}
        location = /r/{region}/api/rtc {{
            proxy_pass http://{region_runtime}/api/rtc$is_args$args;
{proxy}
        }}
        location @gone {{
            return 410 "{GONE}\\n";
        }}
        location / {{
            return 404 "not_found: only /r/{region}/<pod>/api/(chat|rtc), /r/{region}/api/rtc are routed\\n";
        }}
    }}
}}
"""


def router_objects(workload: RegionWorkload) -> list[dict[str, Any]]:
    """The router's objects in the runtime's namespace, none without ``workload.resume_router_neg_name``:
    a ConfigMap (``router_nginx_conf``), a Deployment of one nginx pod per zone (``zone_spread``; the system
    pool, as the page's: the GPU pool's taint keeps it off), Pod Security ``restricted``, its ClusterIP
    Service with a standalone NEG per zone, and the runtime's headless Service the router resolves pods
    through (``infra.k8s.pod_routes.runtime_pods_service``)."""
    neg_name = workload.resume_router_neg_name
    if neg_name is None:
        return []
    runtime_port = workload.profile.ports.runtime
    conf = router_nginx_conf(
        workload.region,
        pod_suffix=pod_dns_suffix(workload),
        runtime_port=runtime_port,
        region_runtime=f"{APP_NAME}.{workload.namespace}.svc.cluster.local:{runtime_port}",
        read_timeout_s=workload.profile.limits.max_session_s + SESSION_TIMEOUT_MARGIN_S,
    )
    labels = selector_labels(ROUTER_NAME)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(workload, ROUTER_NAME, "resume-router"),
        "data": {_CONF_KEY: conf},
    }
    probe = {"httpGet": {"path": ROUTER_HEALTH_PATH, "port": "http"}, "periodSeconds": 10}
    nginx = {
        "name": "nginx",
        "image": IMAGES["nginx"],
        "command": ["nginx", "-c", f"{_CONF_DIR}/{_CONF_KEY}", "-g", "daemon off;"],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "50m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
        "readinessProbe": probe,
        "livenessProbe": {**probe, "failureThreshold": 3},
        "securityContext": container_security(),
        "volumeMounts": [
            {"name": "conf", "mountPath": _CONF_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(workload, ROUTER_NAME, "resume-router"),
        "spec": {
            "replicas": len(workload.zones),
            "selector": {"matchLabels": labels},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": standard_labels(ROUTER_NAME, "resume-router")},
                "spec": {
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security(PAGE_UID),  # the nginx image's own user, as the page's
                    "topologySpreadConstraints": zone_spread(labels),
                    "containers": [nginx],
                    "volumes": [
                        {
                            "name": "conf",
                            "configMap": {
                                "name": ROUTER_NAME,
                                "defaultMode": 0o444,
                                "items": [{"key": _CONF_KEY, "path": _CONF_KEY}],
                            },
                        },
                        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
                    ],
                },
            },
        },
    }
    service = cluster_ip_service(
        workload,
        ROUTER_NAME,
        "resume-router",
        "http",
        ROUTER_PORT,
        annotations={"cloud.google.com/neg": neg_annotation(neg_name, ROUTER_PORT, workload.zones)},
    )
    return [config_map, deployment, service, runtime_pods_service(workload)]
