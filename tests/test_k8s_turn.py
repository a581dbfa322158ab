"""A region's TURN gateway (``infra.k8s.turn``): rendered only with a TURN secret, strictly valid manifests,
coturn on the GPU pool under Pod Security ``restricted`` (no host network), a passthrough load balancer for
TURN over UDP only, peers the regions' pod ranges, the runtime told the region's TURN name and the secret
kept in Secrets; with a TLS Secret, TURN over TLS from it (a second Service on the same reserved address,
``turns:`` for the runtime, a sidecar that reloads coturn on renewal)."""

from __future__ import annotations

import json

import pytest
from k8s_fixtures import make_workload, one

from infra.k8s.base import SECRET_NAME
from infra.k8s.manifest import validate_manifests
from infra.k8s.region import region_objects
from infra.k8s.turn import (
    TLS_MOUNT,
    TURN_CONFIG_SECRET,
    TURN_NAME,
    TURN_SECRET_KEY,
    TURN_TLS_NAME,
    tls_reload_script,
    turn_host,
)

TURN_SECRET = "TurnSecretForTheRegions0123456789abcdefghij"
POD_RANGES = ("10.4.0.0/14", "10.8.0.0/14")


def _objects() -> list[dict]:
    return region_objects(make_workload(turn_secret=TURN_SECRET, turn_peer_ranges=POD_RANGES))


def _env(objects: list[dict]) -> dict[str, dict]:
    deployment = one(objects, "Deployment")
    (runtime,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "runtime"]
    return {e["name"]: e for e in runtime["env"]}


def test_no_turn_secret_no_gateway_and_no_turn_urls() -> None:
    objects = region_objects(make_workload())
    assert not [o for o in objects if o["metadata"]["name"] in (TURN_NAME, TURN_CONFIG_SECRET)]
    assert not [name for name in _env(objects) if name.startswith("DUPLEX_TURN_")]


def test_gateway_manifests_validate_strictly() -> None:
    objects = _objects()
    assert validate_manifests(objects) == []
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("Secret", TURN_CONFIG_SECRET), ("Deployment", TURN_NAME), ("Service", TURN_NAME)} <= kinds
    assert ("PodMonitoring", TURN_NAME) in kinds


def test_coturn_runs_on_the_system_pool_without_host_network() -> None:
    workload = make_workload(turn_secret=TURN_SECRET, turn_peer_ranges=POD_RANGES)
    spec = one(region_objects(workload), "Deployment", TURN_NAME)["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"cloud.google.com/gke-nodepool": "system"}  # off the GPU pool
    assert "tolerations" not in spec  # the GPU taint keeps it off the GPU nodes
    assert "hostNetwork" not in spec and spec["securityContext"]["runAsNonRoot"] is True
    (container,) = spec["containers"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_load_balancer_carries_turn_over_udp_only() -> None:
    service = one(_objects(), "Service", TURN_NAME)
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["externalTrafficPolicy"] == "Local"  # the caller's address reaches coturn
    assert [(p["port"], p["protocol"]) for p in service["spec"]["ports"]] == [(3478, "UDP")]
    assert service["metadata"]["annotations"] == {"cloud.google.com/l4-rbs": "enabled"}


def test_configuration_allows_only_the_pod_ranges_and_keeps_the_secret_in_secrets() -> None:
    objects = _objects()
    conf = one(objects, "Secret", TURN_CONFIG_SECRET)["stringData"]["turnserver.conf"]
    lines = conf.splitlines()
    assert "use-auth-secret" in lines and f"static-auth-secret={TURN_SECRET}" in lines
    assert [line for line in lines if line.startswith("allowed-peer-ip=")] == [
        "allowed-peer-ip=10.4.0.0-10.7.255.255",
        "allowed-peer-ip=10.8.0.0-10.11.255.255",
    ]
    assert "denied-peer-ip=0.0.0.0-255.255.255.255" in lines
    assert "no-tls" in lines and not [line for line in lines if line.startswith("cert=")]
    assert "prometheus" in lines and "no-cli" in lines
    runtime_secret = one(objects, "Secret", SECRET_NAME)
    assert runtime_secret["stringData"][TURN_SECRET_KEY] == TURN_SECRET
    for obj in objects:
        if obj["kind"] != "Secret":
            assert TURN_SECRET not in json.dumps(obj), (obj["kind"], obj["metadata"]["name"])


def test_runtime_names_the_region_turn_and_reads_the_secret() -> None:
    workload = make_workload(turn_secret=TURN_SECRET, turn_peer_ranges=POD_RANGES)
    env = _env(region_objects(workload))
    assert turn_host(workload) == f"turn-us-central1.{workload.profile.domain}"
    assert env["DUPLEX_TURN_URLS"]["value"] == f"turn:{turn_host(workload)}:3478?transport=udp"
    assert env["DUPLEX_TURN_SECRET"]["valueFrom"] == {
        "secretKeyRef": {"name": SECRET_NAME, "key": TURN_SECRET_KEY}
    }


# --- TURN over TLS and the reserved address (turnTlsSecret, infra.program.dns) ---------------------------

TLS_SECRET = "turn-tls"
ADDRESS = "203.0.113.44"


def _tls_objects(**more: object) -> list[dict]:
    workload = make_workload(
        turn_secret=TURN_SECRET,
        turn_peer_ranges=POD_RANGES,
        turn_tls_secret=TLS_SECRET,
        turn_address=ADDRESS,
        **more,
    )
    return region_objects(workload)


def test_tls_gateway_manifests_validate_strictly() -> None:
    objects = _tls_objects()
    assert validate_manifests(objects) == []
    assert ("Service", TURN_TLS_NAME) in {(o["kind"], o["metadata"]["name"]) for o in objects}


def test_tls_is_served_from_the_mounted_secret() -> None:
    objects = _tls_objects()
    conf = one(objects, "Secret", TURN_CONFIG_SECRET)["stringData"]["turnserver.conf"].splitlines()
    assert "no-tls" not in conf and "tls-listening-port=5349" in conf
    assert f"cert={TLS_MOUNT}/tls.crt" in conf and f"pkey={TLS_MOUNT}/tls.key" in conf
    assert "no-tlsv1" in conf and "no-tlsv1_1" in conf and "no-tcp" in conf  # TLS only, 1.2 and later
    spec = one(objects, "Deployment", TURN_NAME)["spec"]["template"]["spec"]
    [tls_volume] = [v for v in spec["volumes"] if v["name"] == "tls"]
    assert tls_volume["secret"]["secretName"] == TLS_SECRET
    coturn, reload = spec["containers"]
    assert {"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True} in coturn["volumeMounts"]
    assert not [m for m in coturn["volumeMounts"] + reload["volumeMounts"] if "subPath" in m]  # renewals land
    assert {"name": "turn-tls", "containerPort": 5349, "protocol": "TCP"} in coturn["ports"]
    # The sidecar signals coturn: one process namespace, the same unprivileged user, the pid file shared.
    assert spec["shareProcessNamespace"] is True and "hostPID" not in spec
    assert reload["securityContext"] == coturn["securityContext"]
    assert reload["command"][:2] == ["sh", "-c"] and "kill -USR2" in reload["command"][2]
    assert {"name": "tmp", "mountPath": "/tmp"} in reload["volumeMounts"]


def test_tls_load_balancer_shares_the_reserved_address() -> None:
    objects = _tls_objects()
    udp, tls = one(objects, "Service", TURN_NAME), one(objects, "Service", TURN_TLS_NAME)
    assert [(p["port"], p["protocol"]) for p in udp["spec"]["ports"]] == [(3478, "UDP")]
    assert [(p["port"], p["protocol"], p["targetPort"]) for p in tls["spec"]["ports"]] == [
        (5349, "TCP", "turn-tls")
    ]
    for service in (udp, tls):
        assert service["spec"]["loadBalancerIP"] == ADDRESS
        assert service["spec"]["externalTrafficPolicy"] == "Local"
        assert service["metadata"]["annotations"] == {"cloud.google.com/l4-rbs": "enabled"}


def test_runtime_offers_turns_only_with_a_certificate() -> None:
    workload = make_workload(turn_secret=TURN_SECRET, turn_peer_ranges=POD_RANGES, turn_tls_secret=TLS_SECRET)
    host = turn_host(workload)
    assert _env(region_objects(workload))["DUPLEX_TURN_URLS"]["value"] == (
        f"turn:{host}:3478?transport=udp,turns:{host}:5349?transport=tcp"
    )
    # Without one: UDP only, no TLS listener, no TLS Service, no sidecar.
    objects = _objects()
    assert ("Service", TURN_TLS_NAME) not in {(o["kind"], o["metadata"]["name"]) for o in objects}
    spec = one(objects, "Deployment", TURN_NAME)["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["containers"]] == [TURN_NAME] and "shareProcessNamespace" not in spec
    assert "loadBalancerIP" not in one(objects, "Service", TURN_NAME)["spec"]  # no reserved address given


def test_a_bad_tls_secret_name_is_refused() -> None:
    with pytest.raises(ValueError, match=r"RegionWorkload.turn_tls_secret: 'Turn_TLS' is not allowed"):
        make_workload(turn_secret=TURN_SECRET, turn_peer_ranges=POD_RANGES, turn_tls_secret="Turn_TLS")


def test_reload_script_refuses_what_it_cannot_quote() -> None:
    with pytest.raises(ValueError, match="interval_s must be >= 1"):
        tls_reload_script("/etc/coturn/tls/tls.crt", "/tmp/turnserver.pid", 0)
    with pytest.raises(ValueError, match="an absolute path"):
        tls_reload_script("/etc/coturn/tls/$(reboot).crt", "/tmp/turnserver.pid")
