"""The Kubernetes objects of resume across pods (issue 33; ``infra.k8s.resume_router``,
``infra.k8s.pod_routes``): the router's Deployment, ConfigMap and NEG Service, the runtime's headless Service,
and the pod settings that make a session's ``resume_url`` name its pod; none of it without a router NEG
name (a region built without one is as before). The router's nginx itself runs in
``tests/test_resume_across_pods.py``."""

from __future__ import annotations

import json

import pytest
from k8s_fixtures import make_workload, one

from infra.k8s.manifest import validate_manifests
from infra.k8s.pod_routes import RUNTIME_PODS_SERVICE
from infra.k8s.region import region_objects
from infra.k8s.resume_router import OFFER_SERVICE, OFFER_TRIES, ROUTER_NAME, ROUTER_PORT, router_nginx_conf
from runtime.config import RuntimeConfig

ROUTED = {"resume_router_neg_name": "duplex-multi-region-resume", "turn_peer_ranges": ("10.8.0.0/14",)}


def _env(objects: list[dict]) -> dict[str, dict]:
    [container] = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return {var["name"]: var for var in container["env"]}


def test_router_objects_validate_and_run_on_the_system_pool() -> None:
    objects = region_objects(
        make_workload(**ROUTED, zones=("us-central1-a", "us-central1-c"), min_replicas=2)
    )
    assert validate_manifests(objects) == []
    deployment = one(objects, "Deployment", ROUTER_NAME)
    assert deployment["spec"]["replicas"] == 2  # one per zone
    pod = deployment["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod  # the GPU pool's taint keeps it off
    assert pod["securityContext"]["runAsNonRoot"] is True
    service = one(objects, "Service", ROUTER_NAME)
    neg = json.loads(service["metadata"]["annotations"]["cloud.google.com/neg"])
    assert neg["exposed_ports"] == {str(ROUTER_PORT): {"name": "duplex-multi-region-resume"}}
    conf = one(objects, "ConfigMap", ROUTER_NAME)["data"]["nginx.conf"]
    assert "resolver kube-dns.kube-system.svc.cluster.local" in conf
    assert f"$pod.{RUNTIME_PODS_SERVICE}.duplex.svc.cluster.local:8998" in conf
    # The regional offer: an upstream of the ready pods, re-resolved, each 503 sent on to the next pod.
    assert "server duplex-runtime-ready.duplex.svc.cluster.local:8998 resolve max_fails=0;" in conf
    assert "proxy_pass http://region_offers/api/rtc$is_args$args;" in conf
    offer = conf.split("location = /r/us-central1/api/rtc {")[1].split("}")[0]
    assert "proxy_next_upstream error timeout http_503 non_idempotent;" in offer
    assert f"proxy_next_upstream_tries {OFFER_TRIES};" in offer and "proxy_request_buffering on;" in offer
    assert "proxy_request_buffering off;" not in offer
    assert '"^/r/us-central1/(?<pod>(?:[0-9]{1,3}-){3}[0-9]{1,3})/api/(?<api>chat|rtc)$"' in conf


def test_headless_service_names_every_pod_full_or_not() -> None:
    objects = region_objects(make_workload(**ROUTED))
    headless = one(objects, "Service", RUNTIME_PODS_SERVICE)["spec"]
    assert headless["clusterIP"] == "None"
    assert headless["publishNotReadyAddresses"] is True  # a full pod (readyz 503) holds the slot to resume
    assert headless["selector"] == one(objects, "Deployment")["spec"]["selector"]["matchLabels"]
    assert one(objects, "Deployment")["kind"] == "Deployment"  # a Deployment still: pod-deletion-cost holds


def test_offers_go_to_a_headless_service_of_ready_pods_only() -> None:
    objects = region_objects(make_workload(**ROUTED))
    assert validate_manifests(objects) == []
    ready = one(objects, "Service", OFFER_SERVICE)["spec"]
    assert ready["clusterIP"] == "None"  # one A record per pod: nginx's upstream holds every pod
    assert ready["publishNotReadyAddresses"] is False  # a loading or draining pod is not offered a call
    assert ready["selector"] == one(objects, "Deployment")["spec"]["selector"]["matchLabels"]
    names = {(o["kind"], o["metadata"]["name"]) for o in region_objects(make_workload())}
    assert ("Service", OFFER_SERVICE) not in names  # without a router, as before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"resolver": None}, "without a resolver, offer_servers must list the pods"),
        ({"offer_servers": []}, "offer_servers is empty"),
    ],
)
def test_router_config_refuses_an_offer_upstream_without_pods(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        router_nginx_conf(
            "us-central1",
            pod_suffix=".x",
            runtime_port=8998,
            region_runtime="duplex-runtime-ready.duplex.svc.cluster.local:8998",
            read_timeout_s=60,
            **kwargs,
        )


def test_pods_are_told_region_public_url_and_their_address() -> None:
    env = _env(region_objects(make_workload(**ROUTED)))
    assert env["DUPLEX_REGION"]["value"] == "us-central1"
    assert env["DUPLEX_PUBLIC_URL"]["value"] == "https://duplex.example.com"
    assert env["DUPLEX_POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # The router passes the load balancer's X-Forwarded-For on: the pods believe the region's pods for it.
    assert env["DUPLEX_TRUSTED_PROXIES"]["value"].split(",") == [
        "35.191.0.0/16",
        "130.211.0.0/22",
        "10.8.0.0/14",
    ]
    # The runtime accepts them (the pod's address as the downward API gives it).
    pod = RuntimeConfig(
        region=env["DUPLEX_REGION"]["value"], public_url=env["DUPLEX_PUBLIC_URL"]["value"], pod_ip="10.8.0.5"
    )
    assert (pod.region, pod.public_url) == ("us-central1", "https://duplex.example.com")


def test_without_a_router_nothing_changes() -> None:
    objects = region_objects(make_workload())
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("Service", RUNTIME_PODS_SERVICE) not in names and ("Deployment", ROUTER_NAME) not in names
    env = _env(objects)
    assert not {"DUPLEX_REGION", "DUPLEX_PUBLIC_URL", "DUPLEX_POD_IP"} & set(env)
    assert env["DUPLEX_TRUSTED_PROXIES"]["value"] == "35.191.0.0/16,130.211.0.0/22"


def test_router_config_refuses_a_pod_map_key_that_is_not_a_dashed_address() -> None:
    with pytest.raises(ValueError, match="not a dashed IPv4 address"):
        router_nginx_conf(
            "us-central1",
            pod_suffix=".x",
            runtime_port=8998,
            region_runtime="127.0.0.1:8998",
            read_timeout_s=60,
            pod_addresses={"duplex-runtime-0": "127.0.0.1:1"},
        )
