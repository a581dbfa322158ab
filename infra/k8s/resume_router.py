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
- ``/r/<region>/api/rtc``: a WebRTC offer, answered in the region whose ICE servers (TURN relay) the caller
  was given (``runtime.region_routes.offer_url``), by a pod with a free slot: the offer goes to an upstream
  of the region's ready pods (the headless Service ``OFFER_SERVICE``, re-resolved through kube-dns by
  nginx's ``server ... resolve``), and a pod's 503 (``node_full``, ``Retry-After``) or a connect error sends
  the same offer (buffered) to the next pod, up to ``OFFER_TRIES`` pods; when all are full the last 503 and
  its ``Retry-After`` reach the caller. Not the region's ClusterIP Service: kube-proxy picks one ready pod
  per connection with no regard for slots, and nginx moves on only between servers of an upstream.

The load balancer's ``X-Forwarded-For`` passes on untouched (the pods trust the region's pod ranges for it:
``pod_routes.resume_routes_env``); the read timeout is the longest session's, as the node's nginx.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from infra.k8s.base import (
    APP_NAME,
    RegionWorkload,
    object_meta,
    pod_labels,
)
from infra.k8s.page import nginx_pods
from infra.k8s.pod_routes import pod_dns_suffix, runtime_pods_service
from infra.node.bundle.nginx import RTC_OFFER_MAX_BYTES, SESSION_TIMEOUT_MARGIN_S

__all__ = [
    "KUBE_DNS",
    "OFFER_CONNECT_TIMEOUT_S",
    "OFFER_SERVICE",
    "OFFER_TRIES",
    "POD_LABEL_PATTERN",
    "ROUTER_HEALTH_PATH",
    "ROUTER_NAME",
    "ROUTER_PORT",
    "router_nginx_conf",
    "router_objects",
    "runtime_offer_service",
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

OFFER_SERVICE = f"{APP_NAME}-ready"
"""The runtime's second headless Service: the ready pods only (no ``publishNotReadyAddresses``), the
servers of the regional offer's upstream (a loading or draining pod is not offered a call)."""

OFFER_TRIES = 4
"""Most pods one regional offer is sent to (``proxy_next_upstream_tries``): nginx tries each server of an
upstream at most once per request, so 4 distinct pods, the global entry's 1 + ``numRetries: 3``
(``infra.components.global_entry``). Past them the last pod's 503 and ``Retry-After`` reach the caller."""

OFFER_CONNECT_TIMEOUT_S = 3
"""Connect timeout (s) of a regional offer's try: a pod gone without a reset is passed over this soon, not
after nginx's default 60 s (the browser's whole ICE budget is ``rtc.js`` ``CONNECT_LIMIT_MS``, 3 s)."""

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
    offer_servers: Sequence[str] | None = None,
    port: int = ROUTER_PORT,
    temp_dir: str = "/tmp",
) -> str:
    """nginx's whole configuration for ``region``'s router (see the module docstring).

    Args:
        region: the region (the ``/r/<region>/`` prefix it answers).
        pod_suffix: appended to a pod's dashed address to make its DNS name (``pod_dns_suffix``).
        runtime_port: the pods' port (8998).
        region_runtime: ``host:port`` of the headless Service of the region's ready pods
            (``OFFER_SERVICE``): the regional offer's upstream, re-resolved at run time (``resolve``; nginx
            >= 1.27.3 open source, the image pins 1.28.0: ``infra.images.NODE_IMAGES``).
        read_timeout_s: proxy read and send timeout (s): the longest session plus a margin.
        resolver: the DNS server for pod names, or None (a test harness: ``pod_addresses`` only).
        pod_addresses: ``{dashed address: host:port}`` answered before DNS (a harness's loopback pods).
        offer_servers: ``host:port`` of each pod, listed as the regional offer's upstream instead of
            resolving ``region_runtime`` (a harness's loopback pods: what ``resolve`` expands the name to).
        port: the listening port; temp_dir: pid and temporary files (the root filesystem is read-only).

    Raises:
        ValueError: a ``pod_addresses`` key that is not a dashed IPv4 address; neither a ``resolver`` nor
            ``offer_servers`` (the offer's upstream would name no pod), or an empty ``offer_servers``.
    """
    import re

    entries = ""
    for label, address in sorted((pod_addresses or {}).items()):
        if not re.fullmatch(POD_LABEL_PATTERN, label):
            raise ValueError(f"router_nginx_conf: pod name {label!r} is not a dashed IPv4 address: 10-4-0-12")
        entries += f'        "{label}" {address};\n'
    if offer_servers is not None and not offer_servers:
        raise ValueError("router_nginx_conf: offer_servers is empty: give at least one host:port, or None")
    if offer_servers is None and resolver is None:
        raise ValueError(
            "router_nginx_conf: without a resolver, offer_servers must list the pods (host:port)"
        )
    # max_fails=0: a full pod's 503 must not mark it down (all full would become 502 "no live upstreams"
    # instead of the last pod's 503 and Retry-After); a gone pod leaves the DNS answer within DNS_VALID_S.
    servers = (
        [f"{region_runtime} resolve max_fails=0"]
        if offer_servers is None
        else [f"{address} max_fails=0" for address in offer_servers]
    )
    offer_upstream = "".join(f"        server {server};\n" for server in servers)
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
    # The offer is buffered whole (at most the runtime's MAX_OFFER_BYTES, in memory) so that it can be sent
    # again; POST is not idempotent, so nginx resends it only with non_idempotent (a refused offer took no
    # slot: runtime/frontend/transports/webrtc/signalling.py). No timeout on the answer: the read timeout is
    # the session's, so "timeout" only ever fires on connect.
    offer_proxy = "\n".join(
        [
            *(line for line in proxy.splitlines() if "proxy_request_buffering" not in line),
            "            proxy_request_buffering on;",
            f"            client_max_body_size {RTC_OFFER_MAX_BYTES};",
            f"            client_body_buffer_size {RTC_OFFER_MAX_BYTES};",
            f"            proxy_connect_timeout {OFFER_CONNECT_TIMEOUT_S}s;",
            "            proxy_next_upstream error timeout http_503 non_idempotent;",
            f"            proxy_next_upstream_tries {OFFER_TRIES};",
        ]
    )
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
    upstream region_offers {{
        zone region_offers 64k;
{offer_upstream}    }}
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
            proxy_pass http://region_offers/api/rtc$is_args$args;
{offer_proxy}
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
    Service with a standalone NEG per zone, the runtime's headless Service the router resolves pods
    through (``infra.k8s.pod_routes.runtime_pods_service``) and the headless Service of its ready pods that
    regional offers go to (``runtime_offer_service``)."""
    neg_name = workload.resume_router_neg_name
    if neg_name is None:
        return []
    runtime_port = workload.profile.ports.runtime
    conf = router_nginx_conf(
        workload.region,
        pod_suffix=pod_dns_suffix(workload),
        runtime_port=runtime_port,
        region_runtime=f"{OFFER_SERVICE}.{workload.namespace}.svc.cluster.local:{runtime_port}",
        read_timeout_s=workload.profile.limits.max_session_s + SESSION_TIMEOUT_MARGIN_S,
    )
    pods = nginx_pods(
        workload,
        name=ROUTER_NAME,
        component="resume-router",
        conf=conf,
        conf_dir=_CONF_DIR,
        port=ROUTER_PORT,
        probe={"httpGet": {"path": ROUTER_HEALTH_PATH, "port": "http"}, "periodSeconds": 10},
        resources={"requests": {"cpu": "50m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
        neg_name=neg_name,
    )
    return [*pods, runtime_pods_service(workload), runtime_offer_service(workload)]


def runtime_offer_service(workload: RegionWorkload) -> dict[str, Any]:
    """The headless Service ``OFFER_SERVICE`` over the runtime pods' ``http`` port, ready pods only: its
    name resolves (kube-dns) to one A record per ready pod, the servers of the router's regional offer
    upstream. A full pod stays ready (docs/deploying.md, "Slot-aware admission") and answers its 503
    ``node_full``, on which the router tries the next pod."""
    port = workload.profile.ports.runtime
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(workload, OFFER_SERVICE, "runtime"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": pod_labels(workload),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
