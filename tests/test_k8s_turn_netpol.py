"""Issue 34, item 9 ("relay peers limited to the runtime pods' ports"): on GKE the TURN relay's pods may send
to the runtime pods only. coturn's ``allowed-peer-ip`` admits the region's whole pod range (kube-dns,
Prometheus, the metrics adapter... were reachable through TURN); the NetworkPolicy ``coturn-egress``
(``infra.k8s.turn.turn_egress_policy``) is the second fence, per pod, enforced by GKE Dataplane V2 on the
clusters (``infra.components.gke_parts``).

The rendered policies are evaluated here as Kubernetes defines NetworkPolicy egress (``egress_allowed``
below, over the rendered dicts: the source and destination pods' labels are read from the rendered
workloads, not restated), on a small table of flows. What only a real cluster shows is whether Dataplane
V2 applies it so (docs/deploying.md, "WebRTC media per stack").
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from k8s_fixtures import make_workload, one

from infra.k8s.base import APP_NAME
from infra.k8s.manifest import validate_manifests
from infra.k8s.monitoring import FRONTEND_NAME
from infra.k8s.region import APPLY_FIRST, region_objects
from infra.k8s.turn import TURN_CONFIG_SECRET, TURN_EGRESS_POLICY, TURN_NAME

TURN_SECRET = "TurnSecretForTheRegions0123456789abcdefghij"
POD_RANGES = ("10.4.0.0/14",)


# --- a NetworkPolicy evaluator (egress), as kubernetes.io/docs/concepts/services-networking/network-policies
# describes it ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """One end of a flow: a pod (``namespace``, ``labels``, its container ``ports`` by name for named
    ports) or, with ``namespace`` None, an address outside the cluster's pods."""

    ip: str
    namespace: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)


def _selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector: ``matchLabels`` and ``matchExpressions`` all hold; an empty selector selects all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        held = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }
        if not held[operator]:
            return False
    return True


def _peer_matches(peer: Mapping[str, Any], policy_namespace: str, to: Endpoint) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        address = ipaddress.ip_address(to.ip)
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(cidr) for cidr in block.get("except") or []
        )
    if to.namespace is None:  # pod and namespace selectors select pods only
        return False
    if "namespaceSelector" in peer:
        namespace_labels = {"kubernetes.io/metadata.name": to.namespace}  # the label every namespace has
        if not _selects(peer["namespaceSelector"], namespace_labels):
            return False
    elif to.namespace != policy_namespace:  # a podSelector alone: the policy's own namespace
        return False
    return _selects(peer.get("podSelector"), to.labels)


def _port_matches(port: Mapping[str, Any], protocol: str, number: int, to: Endpoint) -> bool:
    if port.get("protocol", "TCP") != protocol:
        return False
    if "port" not in port:  # every port of the protocol
        return True
    first = port["port"]
    if isinstance(first, str):  # a named port of the destination pod
        return to.ports.get(first) == number
    return first <= number <= port.get("endPort", first)


def egress_allowed(
    policies: list[Mapping[str, Any]], source: Endpoint, to: Endpoint, protocol: str, port: int
) -> bool:
    """Whether Kubernetes NetworkPolicy lets ``source`` (a pod) open a flow to ``to`` on ``protocol``
    ``port``. A pod no egress policy selects is not isolated: everything goes. An isolated pod may send
    what at least one rule of one selecting policy allows: each rule's ``to`` peers (absent: any) and
    ``ports`` (absent: any) both match."""
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == source.namespace
        and _selects(p["spec"]["podSelector"], source.labels)
        and "Egress"
        in p["spec"].get("policyTypes", ["Ingress"] + (["Egress"] if "egress" in p["spec"] else []))
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("egress") or []:
            peers, ports = rule.get("to") or [], rule.get("ports") or []
            if peers and not any(_peer_matches(p, policy["metadata"]["namespace"], to) for p in peers):
                continue
            if ports and not any(_port_matches(p, protocol, port, to) for p in ports):
                continue
            return True
    return False


def test_the_evaluator_follows_kubernetes_rules() -> None:
    """The evaluator itself on hand-made policies: not isolated without a policy, default deny with an
    empty one, ipBlock with except, namespace selectors, named ports, port ranges."""
    pod = Endpoint("10.0.0.1", "a", {"app": "x"})
    web = Endpoint("10.0.0.2", "b", {"app": "web"}, {"http": 8080})
    outside = Endpoint("203.0.113.9")
    assert egress_allowed([], pod, outside, "TCP", 443)

    def policy(egress: list[dict], selector: dict | None = None) -> dict:
        spec = {"podSelector": selector or {}, "policyTypes": ["Egress"], "egress": egress}
        return {"metadata": {"namespace": "a"}, "spec": spec}

    assert not egress_allowed([policy([])], pod, outside, "TCP", 443)
    assert egress_allowed([policy([])], Endpoint("10.0.0.3", "c"), outside, "TCP", 443)  # other namespace
    assert not egress_allowed([policy([], {"matchLabels": {"app": "y"}})] + [policy([])], pod, web, "TCP", 1)
    block = policy([{"to": [{"ipBlock": {"cidr": "203.0.113.0/24", "except": ["203.0.113.9/32"]}}]}])
    assert egress_allowed([block], pod, Endpoint("203.0.113.8"), "UDP", 53)
    assert not egress_allowed([block], pod, outside, "UDP", 53)
    by_namespace = policy(
        [
            {
                "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "b"}}}],
                "ports": [{"port": "http"}, {"protocol": "UDP", "port": 5000, "endPort": 5010}],
            }
        ]
    )
    assert egress_allowed([by_namespace], pod, web, "TCP", 8080)
    assert not egress_allowed([by_namespace], pod, web, "TCP", 8081)
    assert egress_allowed([by_namespace], pod, web, "UDP", 5010)
    assert not egress_allowed([by_namespace], pod, web, "UDP", 5011)
    same_namespace_only = policy([{"to": [{"podSelector": {}}]}])
    assert not egress_allowed([same_namespace_only], pod, web, "TCP", 8080)
    assert egress_allowed([same_namespace_only], pod, Endpoint("10.0.0.4", "a"), "TCP", 1)
    expressions = policy(
        [{"to": [{"podSelector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]}}]}]
    )
    assert egress_allowed([expressions], pod, Endpoint("10.0.0.5", "a", {"app": "z"}), "TCP", 1)
    assert not egress_allowed([expressions], pod, Endpoint("10.0.0.5", "a", {"role": "z"}), "TCP", 1)


# --- the rendered region ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return region_objects(make_workload(turn_secret=TURN_SECRET, turn_peer_ranges=POD_RANGES))


def _pod(objects: list[dict], kind: str, name: str, ip: str) -> Endpoint:
    """A pod of a rendered workload: its template's labels and container ports, at address ``ip``."""
    workload = one(objects, kind, name)
    template = workload["spec"]["template"]
    ports = {
        p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
    }
    return Endpoint(ip, workload["metadata"]["namespace"], template["metadata"]["labels"], ports)


def test_the_region_renders_the_coturn_egress_policy(objects: list[dict]) -> None:
    policy = one(objects, "NetworkPolicy", TURN_EGRESS_POLICY)
    assert validate_manifests([policy]) == []
    coturn = one(objects, "Deployment", TURN_NAME)
    assert policy["metadata"]["namespace"] == coturn["metadata"]["namespace"]
    assert policy["spec"]["podSelector"] == {"matchLabels": coturn["spec"]["selector"]["matchLabels"]}
    assert policy["spec"]["policyTypes"] == ["Egress"]
    runtime = one(objects, "Deployment", APP_NAME)
    assert policy["spec"]["egress"] == [
        {
            "to": [{"podSelector": {"matchLabels": runtime["spec"]["selector"]["matchLabels"]}}],
            "ports": [{"protocol": "UDP"}],  # every UDP port: aioice binds ephemeral ones
        }
    ]
    # Applied before the coturn pods exist (a foundation kind of the region's apply order).
    assert "NetworkPolicy" in APPLY_FIRST
    order = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert order.index(("NetworkPolicy", TURN_EGRESS_POLICY)) < order.index(("Deployment", TURN_NAME))


def test_no_turn_no_policy() -> None:
    assert not [o for o in region_objects(make_workload()) if o["kind"] == "NetworkPolicy"]


def test_coturn_needs_no_dns(objects: list[dict]) -> None:
    """The policy allows no DNS: the rendered configuration names no host coturn would resolve (no
    database, Redis or alternate server; no listening, relay or external address by name; its peers are
    address ranges)."""
    conf = one(objects, "Secret", TURN_CONFIG_SECRET)["stringData"]["turnserver.conf"].splitlines()
    settings = [line.split("=", 1) for line in conf if "=" in line and not line.startswith("#")]
    keys = {key for key, _ in settings}
    resolving = {"redis-userdb", "redis-statsdb", "psql-userdb", "mysql-userdb", "mongo-userdb", "userdb"}
    assert not keys & (resolving | {"alternate-server", "external-ip", "relay-ip", "listening-ip"})
    peers = [value for key, value in settings if key in ("allowed-peer-ip", "denied-peer-ip")]
    assert peers
    for value in peers:
        for address in value.split("-"):
            ipaddress.ip_address(address)  # addresses, never names


FLOWS = [
    # (what, destination, protocol, port, allowed)
    ("coturn -> runtime pod, the ICE socket", "runtime", "UDP", 40000, True),
    ("coturn -> runtime pod, a low ephemeral port", "runtime", "UDP", 1024, True),
    ("coturn -> runtime pod, its HTTP port", "runtime", "TCP", 8998, False),
    ("coturn -> kube-dns", "kube-dns", "UDP", 53, False),
    ("coturn -> kube-dns over TCP", "kube-dns", "TCP", 53, False),
    ("coturn -> the GMP query frontend (Prometheus API)", "prometheus", "TCP", 9090, False),
    ("coturn -> a GMP collector", "gmp-collector", "TCP", 19090, False),
    ("coturn -> redis_exporter", "redis-exporter", "TCP", 9121, False),
    ("coturn -> Grafana", "grafana", "TCP", 3000, False),
    ("coturn -> the metrics adapter", "metrics-adapter", "TCP", 443, False),
    ("coturn -> another coturn pod", "coturn", "UDP", 61000, False),
    ("coturn -> the metadata server", "metadata", "TCP", 80, False),
    ("coturn -> the metadata server over UDP", "metadata", "UDP", 53, False),
    ("coturn -> Memorystore", "memorystore", "TCP", 6378, False),
    ("coturn -> the internet", "internet", "UDP", 3478, False),
]


def _destinations(objects: list[dict]) -> dict[str, Endpoint]:
    return {
        "runtime": _pod(objects, "Deployment", APP_NAME, "10.4.1.10"),
        "prometheus": _pod(objects, "Deployment", FRONTEND_NAME, "10.4.2.11"),
        "redis-exporter": _pod(objects, "Deployment", "redis-exporter", "10.4.2.12"),
        "grafana": _pod(objects, "Deployment", "grafana", "10.4.2.13"),
        "metrics-adapter": _pod(objects, "Deployment", "custom-metrics-stackdriver-adapter", "10.4.2.14"),
        "coturn": _pod(objects, "Deployment", TURN_NAME, "10.4.1.21"),
        # Pods GKE runs itself, with the labels GKE gives them.
        "kube-dns": Endpoint("10.4.0.5", "kube-system", {"k8s-app": "kube-dns"}, {"dns": 53}),
        "gmp-collector": Endpoint("10.4.0.6", "gmp-system", {"app.kubernetes.io/name": "collector"}),
        # Not pods: no selector names them, only an ipBlock could.
        "metadata": Endpoint("169.254.169.254"),
        "memorystore": Endpoint("10.64.0.3"),
        "internet": Endpoint("198.51.100.7"),
    }


@pytest.mark.parametrize(
    ("what", "destination", "protocol", "port", "allowed"), FLOWS, ids=[f[0] for f in FLOWS]
)
def test_coturn_reaches_the_runtime_pods_only(
    objects: list[dict], what: str, destination: str, protocol: str, port: int, allowed: bool
) -> None:
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    coturn = _pod(objects, "Deployment", TURN_NAME, "10.4.1.20")
    to = _destinations(objects)[destination]
    assert egress_allowed(policies, coturn, to, protocol, port) is allowed, what


def test_other_pods_are_left_alone(objects: list[dict]) -> None:
    """Scope: only the coturn pods are isolated; the runtime still reaches Redis and DNS as before."""
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    destinations = _destinations(objects)
    runtime = destinations["runtime"]
    assert egress_allowed(policies, runtime, destinations["memorystore"], "TCP", 6378)
    assert egress_allowed(policies, runtime, destinations["kube-dns"], "UDP", 53)
