"""One region's TURN gateway (docs/deploying.md, "WebRTC media per stack"): coturn as a DaemonSet on the GPU
pool, its configuration in a Secret, and a ``LoadBalancer`` Service that GKE turns into a regional external
passthrough Network Load Balancer (UDP; the caller's address kept), since the global HTTPS load balancer
carries no UDP.

No ``hostNetwork``: the cluster is VPC-native, so a pod's address is routable in the VPC and serves as the
relayed address (no ``external-ip``), exactly as coturn's container address does in a Compose node; the
pods stay under the namespace's Pod Security ``restricted`` level, which forbids host networking. One coturn
per GPU node (a DaemonSet): relay capacity grows with the runtime pods. Peers: the region's own pod range
(``RegionWorkload.turn_peer_ranges``), which GKE's cluster firewall rule already lets reach the pods; a
caller whose offer spilled to another region cannot relay there and falls back to the WebSocket protocol.
TURN over UDP only: TLS would need a certificate for the region's TURN name as a Secret (the global entry's
certificate is Google-managed). Rendered only when the workload has a TURN secret.
"""

from __future__ import annotations

from typing import Any

from infra.k8s.base import (
    SECRET_NAME,
    RegionWorkload,
    container_security,
    lift,
    object_meta,
    pod_security,
    selector_labels,
)
from infra.names import GPU_TAINT_KEY
from infra.node.compose import IMAGES
from infra.node.coturn import CONTAINER_CONFIG_PATH, coturn_args, render_turnserver_conf
from infra.node.relay import turn_urls

__all__ = [
    "TURN_CONFIG_SECRET",
    "TURN_NAME",
    "TURN_SECRET_KEY",
    "turn_env",
    "turn_host",
    "turn_objects",
]

TURN_NAME = "coturn"
"""The DaemonSet's, Service's and PodMonitoring's name (and the pods' ``app.kubernetes.io/name``)."""
TURN_CONFIG_SECRET = "coturn-config"
"""The Secret holding ``turnserver.conf`` (it carries the TURN secret)."""
TURN_SECRET_KEY = "turn-secret"
"""The key of the runtime's Secret (``SECRET_NAME``) holding ``DUPLEX_TURN_SECRET``."""
_COTURN_UID = 65534  # nobody: binds unprivileged ports only


def turn_host(workload: RegionWorkload) -> str:
    """The region's TURN name, ``turn-<region>.<domain>``: an A record at the region's TURN Service
    address (the stack prints it)."""
    return f"turn-{workload.region}.{workload.profile.domain}"


def turn_env(workload: RegionWorkload) -> list[dict[str, Any]]:
    """The runtime container's TURN environment: ``DUPLEX_TURN_URLS`` naming the region's TURN over UDP,
    ``DUPLEX_TURN_TTL_S``, ``DUPLEX_TURN_SECRET`` from the runtime's Secret. Empty without a TURN secret."""
    if workload.turn_secret is None:
        return []
    relay = workload.profile.relay
    return [
        {"name": "DUPLEX_TURN_URLS", "value": turn_urls(relay, turn_host(workload))[0]},
        {"name": "DUPLEX_TURN_TTL_S", "value": str(relay.credential_ttl_s)},
        {
            "name": "DUPLEX_TURN_SECRET",
            "valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": TURN_SECRET_KEY}},
        },
    ]


def _conf(workload: RegionWorkload, secret: str) -> str:
    relay = workload.profile.relay.model_copy(update={"peer_networks": tuple(workload.turn_peer_ranges)})
    return render_turnserver_conf(workload.profile.model_copy(update={"relay": relay}), secret, tls=False)


def turn_objects(workload: RegionWorkload) -> list[dict[str, Any]]:
    """The region's TURN gateway: Secret ``coturn-config``, DaemonSet ``coturn``, Service ``coturn``
    (LoadBalancer, UDP ``relay.port``, ``externalTrafficPolicy: Local``), PodMonitoring ``coturn`` (its
    exporter). Empty when ``workload.turn_secret`` is None.

    Raises:
        ValueError: a TURN secret without ``turn_peer_ranges`` (the relay would reach nothing).
    """
    if workload.turn_secret is None:
        return []
    if not workload.turn_peer_ranges:
        raise ValueError("RegionWorkload.turn_peer_ranges: the pod ranges coturn may relay to are needed")
    relay = workload.profile.relay
    labels = selector_labels(TURN_NAME)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(workload, TURN_CONFIG_SECRET, "turn", app=TURN_NAME),
        "type": "Opaque",
        "stringData": {"turnserver.conf": lift(lambda s: _conf(workload, s), workload.turn_secret)},
    }
    container = {
        "name": TURN_NAME,
        "image": IMAGES["coturn"],
        "command": ["turnserver"],
        "args": coturn_args(CONTAINER_CONFIG_PATH, "/tmp/turnserver.pid"),
        "ports": [
            {"name": "turn-udp", "containerPort": relay.port, "protocol": "UDP"},
            {"name": "metrics", "containerPort": relay.metrics_port, "protocol": "TCP"},
        ],
        # coturn's exporter answers "/" as its health check (README.turnserver, --prometheus).
        "readinessProbe": {"httpGet": {"path": "/", "port": "metrics"}, "periodSeconds": 10},
        "livenessProbe": {
            "httpGet": {"path": "/", "port": "metrics"},
            "periodSeconds": 15,
            "failureThreshold": 3,
        },
        "resources": {"requests": {"cpu": "250m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": container_security(),
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/coturn", "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "state", "mountPath": "/var/lib/coturn"},
        ],
    }
    daemon_set = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": object_meta(workload, TURN_NAME, "turn"),
        "spec": {
            "selector": {"matchLabels": labels},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": {**labels, "app.kubernetes.io/component": "turn"}},
                "spec": {
                    "nodeSelector": {"cloud.google.com/gke-accelerator": workload.accelerator},
                    "tolerations": [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security(_COTURN_UID),
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "config",
                            "secret": {"secretName": TURN_CONFIG_SECRET, "defaultMode": 0o440},
                        },
                        {"name": "tmp", "emptyDir": {}},
                        {"name": "state", "emptyDir": {}},
                    ],
                },
            },
        },
    }
    service: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(
            workload, TURN_NAME, "turn", annotations={"cloud.google.com/l4-rbs": "enabled"}
        ),
        "spec": {
            "type": "LoadBalancer",
            "externalTrafficPolicy": "Local",
            "selector": labels,
            "ports": [{"name": "turn-udp", "port": relay.port, "targetPort": "turn-udp", "protocol": "UDP"}],
        },
    }
    if workload.turn_source_ranges:  # GKE opens the node firewall to these only
        service["spec"]["loadBalancerSourceRanges"] = list(workload.turn_source_ranges)
    monitoring = {
        "apiVersion": "monitoring.googleapis.com/v1",
        "kind": "PodMonitoring",
        "metadata": object_meta(workload, TURN_NAME, "monitoring"),
        "spec": {
            "selector": {"matchLabels": labels},
            "endpoints": [
                {"port": "metrics", "path": "/metrics", "interval": f"{workload.profile.scrape_interval_s}s"}
            ],
        },
    }
    return [secret, daemon_set, service, monitoring]
