"""What lets a resume reach the runtime pod that holds its slot (issue 33; docs/deploying.md, "Resume across
regions"): the runtime's headless Service and the pod settings that make its resume metadata name the pod.

The runtime stays a Deployment (not a StatefulSet): scale-in of a ReplicaSet honours
``controller.kubernetes.io/pod-deletion-cost`` (the idlest pod goes first), a StatefulSet's always removes
the highest ordinal, whatever it serves (kubernetes.io, "Pod deletion cost" and "StatefulSets: Deployment
and Scaling Guarantees"). Per-pod DNS names come instead from a headless Service: for each of its endpoints
CoreDNS (and kube-dns) answers ``<a-b-c-d>.<service>.<namespace>.svc.cluster.local``, the pod's IPv4
address with dashes, and only for those endpoints. ``publishNotReadyAddresses``: a pod whose slots are all
taken answers ``/readyz`` 503, and that is exactly the pod a resume must reach (its slot is held).
"""

from __future__ import annotations

from typing import Any

from infra.k8s.base import APP_NAME, RegionWorkload, object_meta, pod_labels

__all__ = [
    "RUNTIME_PODS_SERVICE",
    "pod_dns_suffix",
    "public_url",
    "resume_routes_env",
    "runtime_pods_service",
]

RUNTIME_PODS_SERVICE = f"{APP_NAME}-pods"
"""The runtime's headless Service: per-pod DNS names for the resume router (``infra.k8s.resume_router``)."""


def pod_dns_suffix(workload: RegionWorkload) -> str:
    """What follows a pod's dashed address in its DNS name: ``.<RUNTIME_PODS_SERVICE>.<namespace>.svc.
    cluster.local`` (GKE's cluster domain is ``cluster.local``)."""
    return f".{RUNTIME_PODS_SERVICE}.{workload.namespace}.svc.cluster.local"


def public_url(workload: RegionWorkload) -> str:
    """``DUPLEX_PUBLIC_URL`` of the region's pods: ``https://<profile.domain>`` (the global entry's name)."""
    return f"https://{workload.profile.domain}"


def runtime_pods_service(workload: RegionWorkload) -> dict[str, Any]:
    """The headless Service ``RUNTIME_PODS_SERVICE`` (``clusterIP: None``) over the runtime pods' ``http``
    port, with ``publishNotReadyAddresses: true`` (a full pod keeps its DNS name). No NEG annotation: the
    load balancer uses the runtime Service's; this one only names pods."""
    port = workload.profile.ports.runtime
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(workload, RUNTIME_PODS_SERVICE, "runtime"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": pod_labels(workload),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def resume_routes_env(workload: RegionWorkload, env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``env`` (the runtime container's, ``infra.k8s.workload.runtime_env``) with the resume routes' settings
    when the region has a resume router (``workload.resume_router_neg_name``): ``DUPLEX_REGION``,
    ``DUPLEX_PUBLIC_URL`` (``public_url``), ``DUPLEX_POD_IP`` (downward API ``status.podIP``), and the
    region's pod ranges (``workload.turn_peer_ranges``) added to ``DUPLEX_TRUSTED_PROXIES``: a resume comes
    through the router, a pod, which passes the load balancer's ``X-Forwarded-For`` on untouched, so the
    caller's address (rate limits, waiting room) is still the one the load balancer saw. Unchanged without
    a router."""
    if workload.resume_router_neg_name is None:
        return env
    extra = ",".join(workload.turn_peer_ranges)
    trusted = "DUPLEX_TRUSTED_PROXIES"
    out = [{**v, "value": f"{v['value']},{extra}"} if v["name"] == trusted and extra else v for v in env]
    return [
        *out,
        {"name": "DUPLEX_REGION", "value": workload.region},
        {"name": "DUPLEX_PUBLIC_URL", "value": public_url(workload)},
        {"name": "DUPLEX_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
