"""The ``duplexops-policies`` pack: each rule on passing and failing resources, unknown values during
preview, ``check_resources``, and the pack's policies as the Pulumi engine calls them."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.capacity.gcp import GCP_GPUS, MACHINE_TYPES
from infra.policy import rules
from infra.policy.rules import (
    CLUSTER,
    FIREWALL,
    INSTANCE,
    INSTANCE_TEMPLATE,
    NODE_POOL,
    REDIS,
    RULES,
    UNKNOWN,
    check_resources,
    firewall_no_public_monitoring,
    firewall_no_world_ssh,
    gpu_instance_terminates_on_maintenance,
    gpu_node_pool_tainted,
    machine_type_carries_gpu,
    redis_requires_auth,
)

ROOT = Path(__file__).resolve().parents[1]
POLICY_DIR = ROOT / "infra" / "policy"
UNKNOWN_STRING = "04da6b54-80e4-46f7-96ec-b56ff0331ba9"  # the engine's sentinel for an unknown string
UNKNOWN_ARRAY = "6a19a0b0-7e62-4c92-b797-7f8e31da9cc2"
UNKNOWN_BOOL = "1c4a061d-8072-4f0a-a4cb-0ff528b18fe7"


# ------------------------------------------------------------------------------------------------------
# Resource shapes (camelCase, as the engine passes inputs; counts as floats, as they arrive over gRPC)
# ------------------------------------------------------------------------------------------------------


def t4_instance(**overrides: Any) -> dict[str, Any]:
    props: dict[str, Any] = {
        "machineType": "n1-standard-8",
        "zone": "us-central1-a",
        "guestAccelerators": [{"type": "nvidia-tesla-t4", "count": 1.0}],
        "scheduling": {
            "onHostMaintenance": "TERMINATE",
            "automaticRestart": True,
            "gracefulShutdown": {"enabled": True, "maxDuration": {"seconds": 160.0}},
        },
        "bootDisk": {"initializeParams": {"image": "deeplearning-platform-release/common-cu128"}},
        "networkInterfaces": [{"network": "default"}],
    }
    props.update(overrides)
    return props


def a100_instance(**overrides: Any) -> dict[str, Any]:
    props: dict[str, Any] = {
        "machineType": "a2-ultragpu-1g",
        "zone": "us-central1-a",
        "scheduling": {
            "onHostMaintenance": "TERMINATE",
            "gracefulShutdown": {"enabled": True, "maxDuration": {"seconds": 160.0}},
        },
    }
    props.update(overrides)
    return props


def firewall(ports: list[Any] | None, sources: list[str] | None, protocol: str = "tcp", **extra: Any):
    allow: dict[str, Any] = {"protocol": protocol}
    if ports is not None:
        allow["ports"] = ports
    props: dict[str, Any] = {"network": "default", "direction": "INGRESS", "allows": [allow]}
    if sources is not None:
        props["sourceRanges"] = sources
    props.update(extra)
    return props


def gpu_node_pool(**node_config: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "machineType": "g2-standard-8",
        "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"}],
    }
    config.update(node_config)
    return {"cluster": "duplex", "nodeCount": 1.0, "nodeConfig": config}


GOOD_REDIS = {"memorySizeGb": 1.0, "authEnabled": True, "transitEncryptionMode": "SERVER_AUTHENTICATION"}


# ------------------------------------------------------------------------------------------------------
# Rule 1: GPU instances terminate on host maintenance
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "props",
    [
        t4_instance(),
        a100_instance(),
        a100_instance(scheduling={"onHostMaintenance": "terminate"}),  # case as some callers write it
        {"machineType": "e2-standard-4", "zone": "us-central1-a"},  # no GPU: MIGRATE is fine
        {"machineType": "n1-standard-8", "guestAccelerators": [{"type": "nvidia-tesla-t4", "count": 0}]},
        {"machineType": "n1-standard-8", "guestAccelerators": []},
    ],
)
def test_gpu_maintenance_passes(props: dict[str, Any]) -> None:
    assert gpu_instance_terminates_on_maintenance(INSTANCE, props) == []


@pytest.mark.parametrize(
    ("props", "now"),
    [
        (t4_instance(scheduling={"onHostMaintenance": "MIGRATE"}), '"MIGRATE"'),
        (t4_instance(scheduling={"automaticRestart": True}), "is not set"),
        ({k: v for k, v in t4_instance().items() if k != "scheduling"}, "is not set"),
        (a100_instance(scheduling={"onHostMaintenance": "MIGRATE"}), '"MIGRATE"'),
        (a100_instance(scheduling=None), "is not set"),
        ({"machineType": "g2-standard-8"}, "is not set"),
        ({"machineType": "zones/us-central1-a/machineTypes/a3-highgpu-1g"}, "is not set"),
        ({"machine_type": "a2-highgpu-1g", "scheduling": {"on_host_maintenance": "MIGRATE"}}, '"MIGRATE"'),
    ],
)
def test_gpu_maintenance_fails(props: dict[str, Any], now: str) -> None:
    [message] = gpu_instance_terminates_on_maintenance(INSTANCE, props)
    assert "scheduling.onHostMaintenance" in message and now in message
    assert 'set scheduling.onHostMaintenance = "TERMINATE"' in message


def test_gpu_maintenance_names_the_gpu_evidence() -> None:
    [message] = gpu_instance_terminates_on_maintenance(INSTANCE, t4_instance(scheduling=None))
    assert "guestAccelerators nvidia-tesla-t4" in message
    [message] = gpu_instance_terminates_on_maintenance(INSTANCE, a100_instance(scheduling=None))
    assert "machineType a2-ultragpu-1g, whose GPU is built in" in message


def test_gpu_maintenance_polices_instance_templates_only_besides_instances() -> None:
    bad = a100_instance(scheduling=None)
    assert gpu_instance_terminates_on_maintenance(INSTANCE_TEMPLATE, bad)
    assert gpu_instance_terminates_on_maintenance(NODE_POOL, bad) == []
    assert gpu_instance_terminates_on_maintenance(FIREWALL, bad) == []


@pytest.mark.parametrize(
    "props",
    [
        t4_instance(scheduling=UNKNOWN_STRING),  # the whole block computed
        t4_instance(scheduling={"onHostMaintenance": UNKNOWN_STRING}),
        t4_instance(scheduling={"onHostMaintenance": UNKNOWN}),
        {"machineType": UNKNOWN_STRING, "guestAccelerators": UNKNOWN_ARRAY},  # GPU or not: unknown
        {"machineType": UNKNOWN_STRING},
    ],
)
def test_gpu_maintenance_passes_what_it_cannot_know(props: dict[str, Any]) -> None:
    assert gpu_instance_terminates_on_maintenance(INSTANCE, props) == []


def test_gpu_maintenance_judges_known_gpu_despite_unknown_machine_type() -> None:
    props = {"machineType": UNKNOWN_STRING, "guestAccelerators": [{"type": "nvidia-tesla-t4", "count": 1}]}
    assert len(gpu_instance_terminates_on_maintenance(INSTANCE, props)) == 1


# ------------------------------------------------------------------------------------------------------
# Rule 2: no SSH from the whole internet
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "props",
    [
        firewall(["22"], ["35.235.240.0/20"]),  # IAP TCP forwarding
        firewall(["22"], ["10.0.0.0/8", "192.168.1.0/24"]),
        firewall(["22"], ["203.0.113.7/32"]),  # an office address: public, but not the world
        firewall(["443", "80"], ["0.0.0.0/0"]),
        firewall(["23-1024"], ["0.0.0.0/0"]),
        firewall(["22"], ["0.0.0.0/0"], protocol="udp"),  # not SSH
        firewall(None, ["0.0.0.0/0"], protocol="icmp"),
        firewall(["22"], ["0.0.0.0/0"], direction="EGRESS"),
        firewall(["22"], None, sourceTags=["bastion"]),  # from tagged VMs only
        firewall(["22"], None, sourceServiceAccounts=["ci@p.iam.gserviceaccount.com"]),
        {"network": "default", "direction": "INGRESS", "denies": [{"protocol": "all"}]},  # a deny rule
    ],
)
def test_ssh_passes(props: dict[str, Any]) -> None:
    assert firewall_no_world_ssh(FIREWALL, props) == []


@pytest.mark.parametrize(
    ("props", "via", "source"),
    [
        (firewall(["22"], ["0.0.0.0/0"]), 'allows[0].ports[0] "22"', "0.0.0.0/0"),
        (firewall([22], ["0.0.0.0/0"]), "allows[0].ports[0] 22", "0.0.0.0/0"),  # an int port
        (firewall([22.0], ["0.0.0.0/0"]), "allows[0].ports[0] 22.0", "0.0.0.0/0"),  # a float, over gRPC
        (firewall(["80", "20-30"], ["0.0.0.0/0"]), 'allows[0].ports[1] "20-30"', "0.0.0.0/0"),
        (firewall(["0-65535"], ["0.0.0.0/0"]), 'allows[0].ports[0] "0-65535"', "0.0.0.0/0"),
        (firewall(None, ["0.0.0.0/0"]), 'protocol "tcp" without ports', "0.0.0.0/0"),
        (firewall([], ["0.0.0.0/0"]), 'protocol "tcp" without ports', "0.0.0.0/0"),
        (firewall(None, ["0.0.0.0/0"], protocol="all"), 'protocol "all"', "0.0.0.0/0"),
        (firewall(["22"], ["0.0.0.0/0"], protocol="6"), 'allows[0].ports[0] "22"', "0.0.0.0/0"),
        (firewall(["22"], ["0.0.0.0/0"], protocol="TCP"), 'allows[0].ports[0] "22"', "0.0.0.0/0"),
        (firewall(["22"], ["::/0"]), 'allows[0].ports[0] "22"', "::/0"),  # IPv6
        (firewall(["22"], ["10.0.0.0/8", "0.0.0.0/0"]), "sourceRanges[1]", "0.0.0.0/0"),
        (firewall(["22"], None), "the default source", "0.0.0.0/0"),  # no source at all
        (firewall(["22"], []), "the default source", "0.0.0.0/0"),
        (firewall(["22"], ["0.0.0.0/0"], direction=None), 'allows[0].ports[0] "22"', "0.0.0.0/0"),
        (firewall(["22"], ["0.0.0.0/0"], disabled=True), 'allows[0].ports[0] "22"', "0.0.0.0/0"),
        (
            {"direction": "INGRESS", "source_ranges": ["0.0.0.0/0"], "allows": [{"protocol": "tcp"}]},
            "without ports",
            "0.0.0.0/0",
        ),
    ],
)
def test_ssh_fails(props: dict[str, Any], via: str, source: str) -> None:
    messages = firewall_no_world_ssh(FIREWALL, props)
    assert len(messages) == 1, messages
    [message] = messages
    assert "SSH (tcp/22)" in message and via in message and f"to {source}" in message
    assert "sourceRanges" in message and "35.235.240.0/20" in message and "drop port 22" in message


def test_ssh_reports_each_opening_and_world_source() -> None:
    props = firewall(["22", "1-100"], ["0.0.0.0/0", "::/0"])
    assert len(firewall_no_world_ssh(FIREWALL, props)) == 4


@pytest.mark.parametrize(
    "props",
    [
        firewall(["22"], UNKNOWN_ARRAY),
        firewall(["22"], [UNKNOWN_STRING]),
        firewall([UNKNOWN_STRING], ["0.0.0.0/0"]),
        firewall(UNKNOWN_ARRAY, ["0.0.0.0/0"]),
        firewall(["22"], ["0.0.0.0/0"], direction=UNKNOWN_STRING),
        firewall(["22"], None, sourceTags=UNKNOWN_ARRAY),
        {"direction": "INGRESS", "sourceRanges": ["0.0.0.0/0"], "allows": UNKNOWN_ARRAY},
        {"direction": "INGRESS", "sourceRanges": ["0.0.0.0/0"], "allows": [{"protocol": UNKNOWN_STRING}]},
    ],
)
def test_ssh_passes_what_it_cannot_know(props: dict[str, Any]) -> None:
    assert firewall_no_world_ssh(FIREWALL, props) == []


def test_ssh_still_judges_known_values_next_to_unknown_ones() -> None:
    assert len(firewall_no_world_ssh(FIREWALL, firewall(["22"], [UNKNOWN_STRING, "0.0.0.0/0"]))) == 1
    assert len(firewall_no_world_ssh(FIREWALL, firewall([UNKNOWN_STRING, "22"], ["0.0.0.0/0"]))) == 1


# ------------------------------------------------------------------------------------------------------
# Rule 3: no public Prometheus / Grafana
# ------------------------------------------------------------------------------------------------------


def test_monitoring_ports_come_from_the_node_profile() -> None:
    assert (rules.PROMETHEUS_PORT, rules.GRAFANA_PORT) == (9090, 3000)


@pytest.mark.parametrize(
    "props",
    [
        firewall(["9090", "3000"], ["10.0.0.0/8"]),
        firewall(["9090"], ["172.16.0.0/12", "192.168.0.0/16", "10.128.0.0/20"]),
        firewall(["3000"], ["35.235.240.0/20"]),  # IAP
        firewall(["3000"], ["127.0.0.1/32"]),
        firewall(["3000"], ["::1/128"]),
        firewall(None, ["10.0.0.0/8"], protocol="all"),
        firewall(["443", "80"], ["0.0.0.0/0"]),
        firewall(["3001-9089"], ["0.0.0.0/0"]),
        firewall(["9090", "3000"], ["0.0.0.0/0"], protocol="udp"),
        firewall(["9090"], None, sourceTags=["prometheus"]),
        firewall(["9090"], ["0.0.0.0/0"], direction="EGRESS"),
    ],
)
def test_monitoring_passes(props: dict[str, Any]) -> None:
    assert firewall_no_public_monitoring(FIREWALL, props) == []


@pytest.mark.parametrize(
    ("props", "service", "via", "source"),
    [
        (firewall(["3000"], ["0.0.0.0/0"]), "Grafana (tcp/3000)", 'allows[0].ports[0] "3000"', "0.0.0.0/0"),
        (firewall([9090], ["0.0.0.0/0"]), "Prometheus (tcp/9090)", "allows[0].ports[0] 9090", "0.0.0.0/0"),
        (firewall(["3000-3100"], ["0.0.0.0/0"]), "Grafana", '"3000-3100"', "0.0.0.0/0"),
        (firewall(["9000-9999"], ["203.0.113.0/24"]), "Prometheus", '"9000-9999"', "203.0.113.0/24"),
        (firewall(["3000"], ["8.8.8.8"]), "Grafana", '"3000"', "8.8.8.8"),  # a bare address
        (firewall(["3000"], ["100.64.0.0/10"]), "Grafana", '"3000"', "100.64.0.0/10"),  # CGNAT: not RFC1918
        (firewall(["3000"], ["10.0.0.0/7"]), "Grafana", '"3000"', "10.0.0.0/7"),  # wider than 10/8
        (firewall(["3000"], ["35.235.0.0/16"]), "Grafana", '"3000"', "35.235.0.0/16"),  # wider than IAP
        (firewall(["9090"], ["2001:db8::/32"]), "Prometheus", '"9090"', "2001:db8::/32"),  # IPv6
        (firewall(["9090"], ["::/0"]), "Prometheus", '"9090"', "::/0"),
        (firewall(["9090"], None), "Prometheus", '"9090"', "0.0.0.0/0"),  # default source
        (firewall(["9090"], ["10.0.0.0/8", "0.0.0.0/0"]), "Prometheus", '"9090"', "0.0.0.0/0"),
    ],
)
def test_monitoring_fails(props: dict[str, Any], service: str, via: str, source: str) -> None:
    messages = firewall_no_public_monitoring(FIREWALL, props)
    assert len(messages) == 1, messages
    [message] = messages
    assert service in message and via in message and source in message
    assert "limit sourceRanges" in message and "10.0.0.0/8" in message and "35.235.240.0/20" in message


@pytest.mark.parametrize(
    ("props", "expected"),
    [
        (firewall(None, ["0.0.0.0/0"], protocol="all"), 2),  # both services, protocol all
        (firewall(None, ["0.0.0.0/0"]), 2),  # tcp, every port
        (firewall(["1-65535"], ["0.0.0.0/0"]), 2),
        (firewall(["3000", "9090"], ["0.0.0.0/0", "::/0"]), 4),
    ],
)
def test_monitoring_reports_every_service_and_source(props: dict[str, Any], expected: int) -> None:
    messages = firewall_no_public_monitoring(FIREWALL, props)
    assert len(messages) == expected
    assert any("Grafana" in m for m in messages) and any("Prometheus" in m for m in messages)


def test_monitoring_refuses_sources_and_ports_it_cannot_read() -> None:
    [message] = firewall_no_public_monitoring(FIREWALL, firewall(["3000"], ["office"]))
    assert "not a CIDR range" in message and "office" in message
    [message] = firewall_no_public_monitoring(FIREWALL, firewall(["grafana"], ["0.0.0.0/0"]))
    assert 'allows[0].ports[0] = "grafana" is not a port' in message


@pytest.mark.parametrize(
    "props",
    [
        firewall(["3000"], UNKNOWN_ARRAY),
        firewall(["3000"], [UNKNOWN_STRING]),
        firewall([UNKNOWN_STRING], ["0.0.0.0/0"]),
        firewall(["9090"], None, sourceServiceAccounts=UNKNOWN_ARRAY),
    ],
)
def test_monitoring_passes_what_it_cannot_know(props: dict[str, Any]) -> None:
    assert firewall_no_public_monitoring(FIREWALL, props) == []


# ------------------------------------------------------------------------------------------------------
# Rule 4: machine types carry their GPUs (the capacity planner's catalog)
# ------------------------------------------------------------------------------------------------------


def test_accelerator_names_map_onto_the_planners_gpus() -> None:
    assert set(rules.ACCELERATOR_GPUS.values()) == GCP_GPUS
    bundled_series = {m.name.split("-")[0] for m in MACHINE_TYPES.values() if m.bundled}
    assert bundled_series == {"a2", "a3", "g2"} and bundled_series <= rules.BUILT_IN_GPU_SERIES


@pytest.mark.parametrize(
    ("machine_type", "accelerator", "count"),
    [
        ("n1-standard-8", "nvidia-tesla-t4", 1.0),
        ("n1-standard-4", "nvidia-tesla-t4", 4),
        ("n1-standard-32", "nvidia-tesla-t4", 2),  # not in the catalog, but N1 takes T4
        ("n1-highmem-8", "nvidia-tesla-t4", 1),
        ("n1-custom-8-30720", "nvidia-tesla-t4", 1),
        ("a2-ultragpu-1g", "nvidia-a100-80gb", 1),  # matching the built-in GPU is allowed
        ("a2-highgpu-2g", "nvidia-tesla-a100", 2),
        ("a2-highgpu-4g", "nvidia-tesla-a100", 4),  # sibling of a catalog type, count from the name
        ("g2-standard-8", "nvidia-l4", 1),
        ("g2-standard-12", "nvidia-l4", 1),
        ("a3-highgpu-8g", "nvidia-h100-80gb", 8),
        ("a3-ultragpu-8g", "nvidia-h200-141gb", 8),
        (
            "zones/us-central1-a/machineTypes/n1-standard-8",
            "projects/p/zones/z/acceleratorTypes/nvidia-tesla-t4",
            1,
        ),
    ],
)
def test_machine_type_passes(machine_type: str, accelerator: str, count: float) -> None:
    props = {"machineType": machine_type, "guestAccelerators": [{"type": accelerator, "count": count}]}
    assert machine_type_carries_gpu(INSTANCE, props) == []


@pytest.mark.parametrize(
    "props",
    [
        a100_instance(),  # built-in GPU, nothing attached
        {"machineType": "e2-standard-4"},
        {"machineType": "n1-standard-8", "guestAccelerators": [{"type": "nvidia-tesla-a100", "count": 0}]},
    ],
)
def test_machine_type_without_attached_gpu_passes(props: dict[str, Any]) -> None:
    assert machine_type_carries_gpu(INSTANCE, props) == []


@pytest.mark.parametrize(
    ("machine_type", "accelerator", "count", "expected"),
    [
        (
            "n1-standard-8",
            "nvidia-tesla-a100",
            1,
            'A100 40 GB comes only with a2-highgpu-* types; use machineType "a2-highgpu-1g"',
        ),
        (
            "n1-standard-8",
            "nvidia-a100-80gb",
            1,
            'comes only with a2-ultragpu-* types; use machineType "a2-ultragpu-1g"',
        ),
        (
            "n1-standard-8",
            "nvidia-l4",
            1,
            'L4 comes only with g2-standard-* types; use machineType "g2-standard-8"',
        ),
        (
            "a2-ultragpu-1g",
            "nvidia-tesla-t4",
            1,
            'T4 comes only with N1 types (attached); use machineType "n1-standard-8"',
        ),
        ("a2-highgpu-1g", "nvidia-a100-80gb", 1, "comes only with a2-ultragpu-* types"),
        ("g2-standard-8", "nvidia-tesla-t4", 1, "T4 comes only with N1 types"),
        (
            "e2-standard-8",
            "nvidia-tesla-t4",
            1,
            "e2-standard-8 cannot carry t4: on GCP T4 comes only with N1 types",
        ),
        ("n2-standard-8", "nvidia-l4", 1, "n2-standard-8 cannot carry l4"),
        ("n1-standard-8", "nvidia-tesla-t4", 3, "takes 1, 2 or 4 T4 GPUs, not 3"),
        ("a2-highgpu-2g", "nvidia-tesla-a100", 1, "comes with 2 x A100 40 GB built in, not 1"),
        ("a2-highgpu-4g", "nvidia-tesla-a100", 2, "comes with 4 x A100 40 GB built in, not 2"),
        ("a3-megagpu-8g", "nvidia-h100-80gb", 8, "not in the capacity planner's GCP catalog"),
    ],
)
def test_machine_type_fails(machine_type: str, accelerator: str, count: int, expected: str) -> None:
    props = {"machineType": machine_type, "guestAccelerators": [{"type": accelerator, "count": count}]}
    [message] = machine_type_carries_gpu(INSTANCE, props)
    assert f'machineType "{machine_type}" cannot carry guestAccelerators[0]' in message
    assert expected in message


@pytest.mark.parametrize("accelerator", ["nvidia-tesla-v100", "nvidia-tesla-p4", "nvidia-tesla-t4-vws"])
def test_machine_type_refuses_accelerators_the_planner_does_not_know(accelerator: str) -> None:
    props = {"machineType": "n1-standard-8", "guestAccelerators": [{"type": accelerator, "count": 1}]}
    [message] = machine_type_carries_gpu(INSTANCE, props)
    assert f'guestAccelerators[0].type "{accelerator}" is not in the capacity planner' in message
    assert "infra/capacity/gcp.py" in message and "nvidia-tesla-t4" in message


def test_machine_type_checks_node_pools_and_clusters() -> None:
    bad_pool = gpu_node_pool(
        machineType="n1-standard-8", guestAccelerators=[{"type": "nvidia-l4", "count": 1}]
    )
    [message] = machine_type_carries_gpu(NODE_POOL, bad_pool)
    assert message.startswith(
        'nodeConfig.machineType "n1-standard-8" cannot carry nodeConfig.guestAccelerators[0]'
    )
    # A node config without machineType is GKE's e2-medium, which takes no GPU.
    [message] = machine_type_carries_gpu(
        NODE_POOL, {"nodeConfig": {"guestAccelerators": [{"type": "nvidia-tesla-t4", "count": 1}]}}
    )
    assert "e2-medium cannot carry t4" in message
    cluster = {
        "nodeConfig": {
            "machineType": "a2-highgpu-1g",
            "guestAccelerators": [{"type": "nvidia-tesla-t4", "count": 1}],
        },
        "nodePools": [
            {"name": "ok", "nodeConfig": {"machineType": "n1-standard-8"}},
            {
                "name": "bad",
                "nodeConfig": {"machineType": "e2-standard-4", "guestAccelerators": [{"type": "nvidia-l4"}]},
            },
        ],
    }
    messages = machine_type_carries_gpu(CLUSTER, cluster)
    assert [m.split(" cannot carry ")[0] for m in messages] == [
        'nodeConfig.machineType "a2-highgpu-1g"',
        'nodePools[1].nodeConfig.machineType "e2-standard-4"',
    ]
    # The default pool of a cluster that removes it is not judged; the inline pools still are.
    assert len(machine_type_carries_gpu(CLUSTER, {**cluster, "removeDefaultNodePool": True})) == 1


@pytest.mark.parametrize(
    "props",
    [
        {"machineType": UNKNOWN_STRING, "guestAccelerators": [{"type": "nvidia-tesla-a100", "count": 1}]},
        {"machineType": "n1-standard-8", "guestAccelerators": UNKNOWN_ARRAY},
        {"machineType": "n1-standard-8", "guestAccelerators": [{"type": UNKNOWN_STRING, "count": 1}]},
        {"machineType": "n1-standard-8", "guestAccelerators": [UNKNOWN_STRING]},
        # An unknown count is not checked; the type still is (and T4 fits N1).
        {
            "machineType": "n1-standard-8",
            "guestAccelerators": [{"type": "nvidia-tesla-t4", "count": UNKNOWN_STRING}],
        },
    ],
)
def test_machine_type_passes_what_it_cannot_know(props: dict[str, Any]) -> None:
    assert machine_type_carries_gpu(INSTANCE, props) == []


def test_machine_type_judges_a_known_type_with_an_unknown_count() -> None:
    props = {
        "machineType": "n1-standard-8",
        "guestAccelerators": [{"type": "nvidia-l4", "count": UNKNOWN_STRING}],
    }
    [message] = machine_type_carries_gpu(INSTANCE, props)
    assert "(? x nvidia-l4)" in message


# ------------------------------------------------------------------------------------------------------
# Rule 5: Redis requires AUTH over TLS
# ------------------------------------------------------------------------------------------------------


def test_redis_passes() -> None:
    assert redis_requires_auth(REDIS, GOOD_REDIS) == []
    assert (
        redis_requires_auth(REDIS, {"auth_enabled": True, "transit_encryption_mode": "SERVER_AUTHENTICATION"})
        == []
    )
    assert redis_requires_auth(INSTANCE, {}) == []  # a compute instance is not a Redis instance


@pytest.mark.parametrize(
    ("props", "properties"),
    [
        ({}, ["authEnabled is not set", "transitEncryptionMode is not set"]),
        ({**GOOD_REDIS, "authEnabled": False}, ["authEnabled is False"]),
        ({**GOOD_REDIS, "authEnabled": "true"}, ['authEnabled is "true"']),  # a string is not true
        ({**GOOD_REDIS, "transitEncryptionMode": "DISABLED"}, ['transitEncryptionMode is "DISABLED"']),
        ({"authEnabled": True}, ["transitEncryptionMode is not set (default DISABLED)"]),
        ({"transitEncryptionMode": "SERVER_AUTHENTICATION"}, ["authEnabled is not set (default false)"]),
    ],
)
def test_redis_fails(props: dict[str, Any], properties: list[str]) -> None:
    messages = redis_requires_auth(REDIS, props)
    assert len(messages) == len(properties)
    for message, prop in zip(messages, properties, strict=True):
        assert prop in message
    assert all(("Set authEnabled = true" in m) or ('"SERVER_AUTHENTICATION"' in m) for m in messages)


def test_redis_passes_each_unknown_property_on_its_own() -> None:
    assert (
        redis_requires_auth(REDIS, {"authEnabled": UNKNOWN_BOOL, "transitEncryptionMode": UNKNOWN_STRING})
        == []
    )
    [message] = redis_requires_auth(REDIS, {"authEnabled": UNKNOWN_BOOL, "transitEncryptionMode": "DISABLED"})
    assert "transitEncryptionMode" in message


# ------------------------------------------------------------------------------------------------------
# Rule 6: GPU node pools are tainted
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "props",
    [
        gpu_node_pool(),
        gpu_node_pool(
            machineType="n1-standard-8", guestAccelerators=[{"type": "nvidia-tesla-t4", "count": 1}]
        ),
        gpu_node_pool(
            taints=[
                {"key": "dedicated", "value": "duplex", "effect": "NO_EXECUTE"},
                {"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"},
            ]
        ),
        {"cluster": "duplex", "nodeConfig": {"machineType": "e2-standard-4"}},  # CPU pool: no taint needed
        {"cluster": "duplex"},  # no nodeConfig: e2-medium
        gpu_node_pool(taints=UNKNOWN_ARRAY),
        gpu_node_pool(taints=[{"key": UNKNOWN_STRING, "effect": "NO_SCHEDULE"}]),
        {"cluster": "duplex", "nodeConfig": UNKNOWN_STRING},
        {"cluster": "duplex", "nodeConfig": {"machineType": UNKNOWN_STRING}},
    ],
)
def test_node_pool_taint_passes(props: dict[str, Any]) -> None:
    assert gpu_node_pool_tainted(NODE_POOL, props) == []


@pytest.mark.parametrize(
    ("props", "evidence"),
    [
        (gpu_node_pool(taints=None), "machineType g2-standard-8"),
        (gpu_node_pool(taints=[]), "machineType g2-standard-8"),
        (
            gpu_node_pool(
                taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "PREFER_NO_SCHEDULE"}]
            ),
            "g2",
        ),
        (gpu_node_pool(taints=[{"key": "gpu", "value": "present", "effect": "NO_SCHEDULE"}]), "g2"),
        (
            gpu_node_pool(
                machineType="n1-standard-8",
                guestAccelerators=[{"type": "nvidia-tesla-t4", "count": 1}],
                taints=None,
            ),
            "guestAccelerators nvidia-tesla-t4",
        ),
        (gpu_node_pool(machineType="a2-ultragpu-1g", taints=None), "a2-ultragpu-1g"),
    ],
)
def test_node_pool_taint_fails(props: dict[str, Any], evidence: str) -> None:
    [message] = gpu_node_pool_tainted(NODE_POOL, props)
    assert f"GPU node pool (nodeConfig.{evidence}" in message or evidence in message
    assert 'no nodeConfig.taints entry with key "nvidia.com/gpu" and effect "NO_SCHEDULE"' in message
    assert '"effect": "NO_SCHEDULE"} to nodeConfig.taints' in message


def test_node_pool_taint_checks_cluster_default_and_inline_pools() -> None:
    untainted = {"machineType": "g2-standard-8"}
    cluster = {
        "nodeConfig": untainted,
        "nodePools": [{"nodeConfig": untainted}, {"nodeConfig": {"machineType": "e2-medium"}}],
    }
    messages = gpu_node_pool_tainted(CLUSTER, cluster)
    assert len(messages) == 2
    assert "nodePools[0].nodeConfig.taints" in messages[1]
    assert len(gpu_node_pool_tainted(CLUSTER, {**cluster, "removeDefaultNodePool": True})) == 1
    assert len(gpu_node_pool_tainted(CLUSTER, {**cluster, "removeDefaultNodePool": UNKNOWN_BOOL})) == 1
    assert gpu_node_pool_tainted(CLUSTER, {"enableAutopilot": True}) == []


# ------------------------------------------------------------------------------------------------------
# Unknowns, normalisation, check_resources
# ------------------------------------------------------------------------------------------------------


def test_unknown_sentinels_are_the_sdks() -> None:
    proxy = pytest.importorskip("pulumi_policy.proxy")
    sdk = {
        getattr(proxy, name) for name in dir(proxy) if name.startswith("UNKNOWN_") and name.endswith("_VALUE")
    }
    assert sdk == rules.UNKNOWN_SENTINELS
    assert rules.is_unknown(UNKNOWN) and not rules.is_unknown(None) and not rules.is_unknown("")


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_rules_pass_empty_and_foreign_resources(rule: rules.Rule) -> None:
    assert rule.check("gcp:compute/network:Network", {"name": "vpc"}) == []
    for resource_type in rule.resource_types:
        rule.check(resource_type, {})  # no crash on an empty resource
        rule.check(resource_type, {"scheduling": None, "allows": None, "nodeConfig": None, "taints": None})


def test_rules_read_through_secret_wrappers() -> None:
    """Inputs recorded by ``pulumi.runtime.Mocks`` keep the wire format's secret wrapper; the engine
    unwraps it before the pack sees the props. Both read the same."""
    from pulumi.runtime import rpc

    def secret(value: Any) -> dict[str, Any]:
        return {rpc._special_sig_key: rpc._special_secret_sig, "value": value}

    wrapped = firewall(["22"], secret(["0.0.0.0/0"]))
    assert len(firewall_no_world_ssh(FIREWALL, wrapped)) == 1
    assert firewall_no_world_ssh(FIREWALL, firewall(["22"], secret(["35.235.240.0/20"]))) == []
    assert redis_requires_auth(REDIS, {**GOOD_REDIS, "authEnabled": secret(True)}) == []


def test_check_resources_passes_a_compliant_stack() -> None:
    stack = [
        (INSTANCE, t4_instance(), "node"),
        (FIREWALL, firewall(["443", "80"], ["0.0.0.0/0"]), "https"),
        (FIREWALL, firewall(["22"], ["35.235.240.0/20"]), "iap-ssh"),
        (FIREWALL, firewall(["9090", "3000"], ["10.128.0.0/9"]), "monitoring"),
        (
            NODE_POOL,
            {**gpu_node_pool(), "upgradeSettings": {"maxSurge": 0.0, "maxUnavailable": 1.0}},
            "gpu-pool",
        ),
        (REDIS, GOOD_REDIS, "sessions"),
        ("gcp:compute/network:Network", {}, "vpc"),
    ]
    assert check_resources(stack) == []


def test_check_resources_names_policy_type_and_resource() -> None:
    stack = [
        (INSTANCE, a100_instance(scheduling=None), "scale5"),
        (FIREWALL, firewall(None, ["0.0.0.0/0"], protocol="all")),
        (REDIS, {}, "sessions"),
    ]
    violations = check_resources(stack)
    assert violations[0].startswith(f"[gpu-instance-terminate-on-maintenance] {INSTANCE} scale5: ")
    prefixes = sorted({v.split(":")[0] + ":" + v.split(":")[1] for v in violations})
    assert any(v.startswith(f"[firewall-no-world-ssh] {FIREWALL} #1: ") for v in violations)
    assert sum(v.startswith(f"[firewall-no-public-monitoring] {FIREWALL} #1: ") for v in violations) == 2
    assert sum(v.startswith(f"[redis-auth-required] {REDIS} sessions: ") for v in violations) == 2
    assert any(v.startswith(f"[gpu-instance-graceful-shutdown] {INSTANCE} scale5: ") for v in violations)
    assert len(violations) == 7, prefixes


# ------------------------------------------------------------------------------------------------------
# The pack: policies, the engine adapter, __main__ and the project files
# ------------------------------------------------------------------------------------------------------

EXPECTED_POLICIES = [
    "gpu-instance-terminate-on-maintenance",
    "firewall-no-world-ssh",
    "firewall-no-public-monitoring",
    "gpu-machine-type-match",
    "redis-auth-required",
    "gpu-node-pool-tainted",
    "backend-timeout-fits-websockets",
    "gpu-instance-graceful-shutdown",
    "provisioning-model-sold",
    "session-affinity-needs-hash-policy",
    "https-proxy-tls-1-2",
    "gpu-node-pool-upgrade-needs-no-extra-gpu",
    "storage-bucket-private",
    "recordings-bucket-retention",
]
EXPECTED_STACK_POLICIES = ["apis-enabled-for-features"]


def test_pack_builds_one_mandatory_policy_per_rule() -> None:
    policy = pytest.importorskip("pulumi_policy")
    from infra.policy.pack import ENFORCEMENT_LEVEL, PACK_NAME, build_policies

    policies = build_policies()
    resource_policies, stack_policies = policies[: len(RULES)], policies[len(RULES) :]
    assert [p.name for p in resource_policies] == [r.name for r in RULES] == EXPECTED_POLICIES
    assert [p.name for p in stack_policies] == EXPECTED_STACK_POLICIES
    assert all(isinstance(p, policy.ResourceValidationPolicy) for p in resource_policies)
    assert all(isinstance(p, policy.StackValidationPolicy) for p in stack_policies)
    assert all(p.has_validation() for p in resource_policies)
    assert all(callable(p.validate) for p in stack_policies)
    assert all(p.enforcement_level is None for p in policies)  # they take the pack's level
    assert PACK_NAME == "duplexops-policies" and ENFORCEMENT_LEVEL is policy.EnforcementLevel.MANDATORY


def test_main_constructs_the_policy_pack(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PolicyPack`` starts the engine's gRPC server and never returns; a stand-in records its arguments."""
    policy = pytest.importorskip("pulumi_policy")
    built: list[dict[str, Any]] = []
    monkeypatch.setattr(policy, "PolicyPack", lambda **kwargs: built.append(kwargs))
    runpy.run_path(str(POLICY_DIR), run_name="__main__")  # as `python -m pulumi.policy` runs the pack
    [kwargs] = built
    assert kwargs["name"] == "duplexops-policies"
    assert kwargs["enforcement_level"] is policy.EnforcementLevel.MANDATORY
    assert [p.name for p in kwargs["policies"]] == EXPECTED_POLICIES + EXPECTED_STACK_POLICIES


def _validate(resource_type: str, props: dict[str, Any]) -> dict[str, list[str]]:
    """Run the pack's policies on one resource the way the CLI does: an ``AnalyzeRequest`` (props as a
    protobuf Struct, so numbers arrive as floats and unknowns as sentinel strings) into the SDK's analyzer
    servicer, which deserializes them, wraps them in its unknown-checking proxy and collects diagnostics.
    (``_PolicyAnalyzerServicer`` is what ``PolicyPack`` serves over gRPC; private, hence the pinned SDK.)"""
    policy = pytest.importorskip("pulumi_policy")
    from google.protobuf import struct_pb2
    from pulumi.runtime import proto
    from pulumi_policy.policy import _PolicyAnalyzerServicer

    from infra.policy.pack import ENFORCEMENT_LEVEL, PACK_NAME, build_policies

    servicer = _PolicyAnalyzerServicer(PACK_NAME, "0.1.0", build_policies(), ENFORCEMENT_LEVEL)
    struct = struct_pb2.Struct()
    struct.update(props)
    request = proto.AnalyzeRequest(
        type=resource_type, properties=struct, urn=f"urn:{resource_type}::r", name="r"
    )
    found: dict[str, list[str]] = {}
    for diagnostic in servicer.Analyze(request, None).diagnostics:
        assert diagnostic.enforcementLevel == proto.MANDATORY, diagnostic  # never the "can't run" advisory
        description = next(r.description for r in RULES if r.name == diagnostic.policyName)
        assert diagnostic.message.startswith(description + "\n")
        found.setdefault(diagnostic.policyName, []).append(diagnostic.message[len(description) + 1 :])
    assert policy.EnforcementLevel.MANDATORY is ENFORCEMENT_LEVEL
    return found


def test_adapter_reports_violations_through_the_engine_callback() -> None:
    found = _validate(INSTANCE, t4_instance(machineType="a2-ultragpu-1g", scheduling=None))
    assert set(found) == {
        "gpu-instance-terminate-on-maintenance",
        "gpu-machine-type-match",
        "gpu-instance-graceful-shutdown",
    }
    assert _validate(INSTANCE, t4_instance()) == {}
    assert set(_validate(FIREWALL, firewall(None, ["0.0.0.0/0"], protocol="all"))) == {
        "firewall-no-world-ssh",
        "firewall-no-public-monitoring",
    }


def test_adapter_skips_only_the_unknown_values() -> None:
    """The SDK's proxy raises on reading an unknown value; the adapter turns those into rules.UNKNOWN so
    that a rule still judges the known values next to it."""
    assert _validate(FIREWALL, firewall(["22"], UNKNOWN_ARRAY)) == {}
    found = _validate(FIREWALL, firewall(["22"], [UNKNOWN_STRING, "0.0.0.0/0"]))
    assert list(found) == ["firewall-no-world-ssh"]
    found = _validate(REDIS, {"authEnabled": UNKNOWN_BOOL, "transitEncryptionMode": "DISABLED"})
    assert len(found["redis-auth-required"]) == 1
    graceful = {"enabled": True, "maxDuration": {"seconds": 160.0}}
    unknown_maintenance = {"onHostMaintenance": UNKNOWN_STRING, "gracefulShutdown": graceful}
    assert _validate(INSTANCE, t4_instance(scheduling=unknown_maintenance)) == {}


def test_plain_unwraps_the_proxy() -> None:
    pytest.importorskip("pulumi_policy")
    from pulumi_policy.proxy import unknown_checking_proxy

    from infra.policy.pack import plain

    props = {"a": [1, UNKNOWN_STRING, {"b": UNKNOWN_ARRAY}], "c": UNKNOWN_BOOL, "d": "x"}
    assert plain(unknown_checking_proxy(props)) == {"a": [1, UNKNOWN, {"b": UNKNOWN}], "c": UNKNOWN, "d": "x"}


def test_policy_project_files() -> None:
    project = yaml.safe_load((POLICY_DIR / "PulumiPolicy.yaml").read_text())
    assert project["runtime"]["name"] == "python" and project["description"]
    assert project["runtime"]["options"]["virtualenv"] == "venv"
    pins = dict(
        line.split("==")
        for line in (POLICY_DIR / "requirements.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert pins["pulumi-policy"] == "1.21.0" and pins["pulumi"].startswith("3.")
    lock = dict(
        line.split("==") for line in (ROOT / "requirements.lock").read_text().splitlines() if "==" in line
    )
    assert pins["pydantic"] == lock["pydantic"]
    readme = (POLICY_DIR / "README.md").read_text()
    assert "pulumi preview --stack dev --policy-pack infra/policy" in readme
    assert all(name in readme for name in EXPECTED_POLICIES)
    assert all(rule.check.__name__ in readme for rule in RULES)


def test_pack_serves_over_grpc_as_the_cli_runs_it() -> None:
    """The CLI's Python policy host runs ``python -m pulumi.policy <engine> <pack dir>`` and reads the
    analyzer's port from its stdout; here a gRPC client takes the engine's place."""
    pytest.importorskip("pulumi_policy")
    import grpc
    from google.protobuf import empty_pb2, struct_pb2
    from pulumi.runtime import proto
    from pulumi.runtime.proto import analyzer_pb2_grpc

    server = subprocess.Popen(
        [sys.executable, "-u", "-m", "pulumi.policy", "127.0.0.1:1", str(POLICY_DIR)],
        cwd=POLICY_DIR,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = analyzer_pb2_grpc.AnalyzerStub(channel)
            info = stub.GetAnalyzerInfo(empty_pb2.Empty(), timeout=30)
            assert info.name == "duplexops-policies"
            assert [p.name for p in info.policies] == EXPECTED_POLICIES + EXPECTED_STACK_POLICIES
            assert {p.enforcementLevel for p in info.policies} == {proto.MANDATORY}
            props = struct_pb2.Struct()
            props.update(
                {"machineType": "a2-ultragpu-1g", "guestAccelerators": [{"type": "nvidia-tesla-t4"}]}
            )
            request = proto.AnalyzeRequest(type=INSTANCE, properties=props, urn="urn:vm", name="vm")
            response = stub.Analyze(request, timeout=30)
            assert sorted(d.policyName for d in response.diagnostics) == [
                "gpu-instance-graceful-shutdown",
                "gpu-instance-terminate-on-maintenance",
                "gpu-machine-type-match",
            ]
    finally:
        server.terminate()
        server.wait(timeout=10)
