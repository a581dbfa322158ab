"""The deployment rules of the ``duplexops-policies`` pack, as pure functions.

Each rule is ``rule(resource_type, props) -> list[str]``: the violation messages for one resource (empty
when it passes, and for resource types the rule does not police). ``props`` are the resource's inputs as
the Pulumi engine hands them to a policy pack: camelCase keys (``scheduling.onHostMaintenance``,
``guestAccelerators``, ``sourceRanges``), numbers possibly as floats. snake_case keys are accepted too
(they are converted first), so a test may pass either spelling.

No Pulumi import here: ``infra.policy.pack`` wraps these functions into ``ResourceValidationPolicy``
callbacks for the engine, and the stacks' tests call :func:`check_resources` on their mocked resources.

Unknown values
--------------
During ``pulumi preview`` an input computed from another resource's output is not known yet. The engine
marks it with a sentinel string (:data:`UNKNOWN_SENTINELS`); ``infra.policy.pack`` turns the SDK's
proxy errors into :data:`UNKNOWN`. A rule that needs an unknown value to decide passes for that value
(the same policies run again with the real values during ``pulumi up``, before the resource is created).
A key that is *missing* or ``None`` is not unknown: it means "not set", and the rule judges the
provider's default for it (``onHostMaintenance`` MIGRATE, ``authEnabled`` false, an ingress rule without
any source applies to 0.0.0.0/0, ...). Each rule's docstring says which values it can skip.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from infra.capacity.gcp import (
    ACCELERATOR_TYPES,
    DEFAULT_MACHINE_TYPE,
    GPU_LABELS,
    IAP_SOURCE_RANGE,
    MACHINE_TYPES,
    PROVISIONING_MODELS,
    STOP_TIMEOUT_METADATA_KEY,
    MachineType,
    carry_problem,
)
from infra.gcp_apis import SERVICE_TYPE, STEP_0_APIS, required_apis, step_0_command
from infra.names import GPU_TAINT, GPU_TAINT_KEY
from infra.node.profile import NodePorts

__all__ = [
    "ACCELERATOR_GPUS",
    "BACKEND_SERVICE",
    "CLUSTER",
    "MIN_WEBSOCKET_BACKEND_TIMEOUT_S",
    "FIREWALL",
    "INSTANCE",
    "INSTANCE_TEMPLATE",
    "NODE_POOL",
    "REDIS",
    "RULES",
    "UNKNOWN",
    "UNKNOWN_SENTINELS",
    "STACK_RULES",
    "Rule",
    "StackResource",
    "StackRule",
    "apis_enabled_for_features",
    "backend_timeout_fits_websockets",
    "check_resources",
    "gpu_instance_graceful_shutdown",
    "provisioning_model_sold",
    "session_affinity_needs_hash_policy",
    "firewall_no_public_monitoring",
    "firewall_no_world_ssh",
    "gpu_instance_terminates_on_maintenance",
    "gpu_node_pool_tainted",
    "is_unknown",
    "machine_type_carries_gpu",
    "redis_requires_auth",
]

INSTANCE = "gcp:compute/instance:Instance"
INSTANCE_TEMPLATE = "gcp:compute/instanceTemplate:InstanceTemplate"
FIREWALL = "gcp:compute/firewall:Firewall"
NODE_POOL = "gcp:container/nodePool:NodePool"
CLUSTER = "gcp:container/cluster:Cluster"
REDIS = "gcp:redis/instance:Instance"
BACKEND_SERVICE = "gcp:compute/backendService:BackendService"

# --------------------------------------------------------------------------------------------------------
# Unknown values
# --------------------------------------------------------------------------------------------------------

UNKNOWN_SENTINELS: frozenset[str] = frozenset(
    {
        "1c4a061d-8072-4f0a-a4cb-0ff528b18fe7",  # boolean
        "3eeb2bf0-c639-47a8-9e75-3b44932eb421",  # number
        "04da6b54-80e4-46f7-96ec-b56ff0331ba9",  # string (also pulumi.runtime's UNKNOWN in mocks)
        "6a19a0b0-7e62-4c92-b797-7f8e31da9cc2",  # array
        "030794c1-ac77-496b-92df-f27374a8bd58",  # asset
        "e48ece36-62e2-4504-bad9-02848725956a",  # archive
        "dd056dcd-154b-4c76-9bd3-c8f88648b5ff",  # object
    }
)
"""The engine's wire sentinels for values unknown during preview (``pulumi_policy.proxy`` UNKNOWN_*)."""


class _Unknown:
    """Type of :data:`UNKNOWN`."""

    _instance: _Unknown | None = None

    def __new__(cls) -> _Unknown:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<unknown during preview>"


UNKNOWN = _Unknown()
"""A value that cannot be known during preview (what the adapter puts where the SDK raises)."""


def is_unknown(value: object) -> bool:
    """True for :data:`UNKNOWN` and the engine's sentinel strings; False for missing values (None)."""
    return value is UNKNOWN or (isinstance(value, str) and value in UNKNOWN_SENTINELS)


_CAMEL_RE = re.compile(r"_([a-z0-9])")


def _camel(key: str) -> str:
    return key if key.startswith("_") else _CAMEL_RE.sub(lambda m: m.group(1).upper(), key)


_SIG_KEY = "4dabf18193072939515e22adb298388d"  # Pulumi's wire signature key ...
_SECRET_SIG = "1b47061264138c4ac30d75fd1eb44270"  # ... and its value for a secret


def _normalize(value: Any) -> Any:
    """Plain dicts/lists with camelCase keys, unknown sentinels replaced by :data:`UNKNOWN`, secrets
    unwrapped (the engine unwraps them for a policy pack; inputs recorded by mocks still carry the wire
    wrapper ``{SIG: SECRET_SIG, "value": ...}``)."""
    if is_unknown(value):
        return UNKNOWN
    if isinstance(value, Mapping) and value.get(_SIG_KEY) == _SECRET_SIG:
        return _normalize(value.get("value"))
    if isinstance(value, Mapping):
        return {_camel(str(k)): _normalize(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_normalize(v) for v in value]
    return value


def _obj(value: Any) -> dict[str, Any] | _Unknown | None:
    """A nested object: the dict, UNKNOWN, or None when missing (anything else counts as missing)."""
    if value is UNKNOWN:
        return UNKNOWN
    return value if isinstance(value, dict) else None


def _list(value: Any) -> list[Any] | _Unknown:
    """A nested list: the list, UNKNOWN, or [] when missing."""
    if value is UNKNOWN:
        return UNKNOWN
    return value if isinstance(value, list) else []


def _q(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


# --------------------------------------------------------------------------------------------------------
# GPUs and machine types (the capacity planner's GCP catalog)
# --------------------------------------------------------------------------------------------------------

ACCELERATOR_GPUS: dict[str, str] = {name: gpu for gpu, name in ACCELERATOR_TYPES.items()}
"""GCP accelerator type names (``guestAccelerators[].type``) -> the planner's GPU keys
(``infra.capacity.gcp``). Accelerators absent here are not in the planner's catalog."""

BUILT_IN_GPU_SERIES: frozenset[str] = frozenset(
    {m.name.split("-", 1)[0] for m in MACHINE_TYPES.values() if m.bundled} | {"a4", "a4x", "g4"}
)
"""Machine series whose GPUs come with the type: A2, A3, G2 from the planner's catalog, plus A4/A4X (B200,
GB200) and G4 (RTX PRO 6000), which GCP sells the same way but the planner does not model yet."""

_GKE_DEFAULT_MACHINE_TYPE = "e2-medium"  # nodeConfig.machineType when unset (GKE API default)


def _machine_type_name(value: str) -> str:
    """``zones/us-central1-a/machineTypes/n1-standard-8`` -> ``n1-standard-8``."""
    return value.rsplit("/", 1)[-1].strip().lower()


def _has_built_in_gpu(machine_type: str) -> bool:
    return _machine_type_name(machine_type).split("-", 1)[0] in BUILT_IN_GPU_SERIES


def _catalog_entry(machine_type: str) -> MachineType | None:
    """The catalog type ``machine_type`` behaves like: itself, a sibling of the same class
    (``n1-standard-32`` -> an ``n1-standard-*`` entry, ``a2-highgpu-4g`` -> ``a2-highgpu-*``), any N1 type
    for other N1 classes (``n1-highmem-8``, ``n1-custom-8-30720``: every N1 type takes the same GPUs), or
    None when the catalog knows nothing about it."""
    if machine_type in MACHINE_TYPES:
        return MACHINE_TYPES[machine_type]
    parts = machine_type.split("-")
    cls = "-".join(parts[:2])
    for entry in MACHINE_TYPES.values():
        if "-".join(entry.name.split("-")[:2]) == cls:
            return entry
    if parts[0] == "n1":
        return next(m for m in MACHINE_TYPES.values() if m.family == "N1")
    return None


def _gpu_homes(gpu: str) -> str:
    homes = sorted({m.name.rsplit("-", 1)[0] + "-*" for m in MACHINE_TYPES.values() if m.gpu == gpu})
    return "N1 types (attached)" if gpu == "t4" else " / ".join(homes) + " types"


def _carry_problem(machine_type: str, gpu: str, count: int | None) -> str | None:
    """Why ``machine_type`` cannot carry ``count`` x ``gpu`` (planner keys), or None when it can."""
    label = GPU_LABELS.get(gpu, gpu)
    fix = f'use machineType "{DEFAULT_MACHINE_TYPE[gpu]}"' if gpu in DEFAULT_MACHINE_TYPE else ""
    entry = _catalog_entry(machine_type)
    if entry is None:
        if _has_built_in_gpu(machine_type):
            return (
                f"{machine_type} is not in the capacity planner's GCP catalog (infra/capacity/gcp.py) and "
                f"its GPU comes with the type: drop guestAccelerators, or add the type to the catalog"
            )
        return f"{machine_type} cannot carry {gpu}: on GCP {label} comes only with {_gpu_homes(gpu)}; {fix}"
    problem = carry_problem(entry.name, gpu)
    if problem is not None:
        # The planner's message names the catalog entry; name the type the resource asked for instead.
        if problem.startswith(entry.name):
            problem = machine_type + problem[len(entry.name) :]
        return f"{problem}; {fix}" if fix else problem
    if count is None:
        return None
    if entry.bundled:
        expected: tuple[int, ...] = entry.gpu_count
        if entry.name != machine_type:
            match = re.search(r"-(\d+)g$", machine_type)
            expected = (int(match.group(1)),) if match else ()
        if expected and count not in expected:
            return (
                f"{machine_type} comes with {expected[0]} x {label} built in, not {count}: set the count "
                f"to {expected[0]} or drop guestAccelerators (the type brings its GPUs)"
            )
        return None
    if count not in entry.gpu_count:
        counts = [str(n) for n in entry.gpu_count]
        allowed = counts[0] if len(counts) == 1 else ", ".join(counts[:-1]) + " or " + counts[-1]
        return f"{machine_type} ({entry.family}) takes {allowed} {label} GPUs, not {count}; change the count"
    return None


def _accelerators(config: Mapping[str, Any]) -> list[Any] | _Unknown:
    """``guestAccelerators`` entries that attach a GPU (count unknown or > 0), or UNKNOWN."""
    accels = _list(config.get("guestAccelerators"))
    if isinstance(accels, _Unknown):
        return UNKNOWN
    attached: list[Any] = []
    for acc in accels:
        if isinstance(acc, _Unknown):
            attached.append(acc)
            continue
        if not isinstance(acc, dict):
            continue
        count = acc.get("count")
        if isinstance(count, int | float) and not isinstance(count, bool) and count <= 0:
            continue
        attached.append(acc)
    return attached


def _gpu_evidence(
    config: Mapping[str, Any], machine_type_default: str | None = None
) -> str | None | _Unknown:
    """What makes ``config`` (an instance's inputs or a ``nodeConfig``) a GPU host: a short description,
    None when it is not one, UNKNOWN when that cannot be told during preview."""
    accels = _accelerators(config)
    machine_type = config.get("machineType") or machine_type_default
    if isinstance(accels, list) and accels:
        names = []
        for acc in accels:
            kind = acc.get("type") if isinstance(acc, dict) else UNKNOWN
            names.append("an unknown accelerator" if is_unknown(kind) else _machine_type_name(str(kind)))
        return "guestAccelerators " + ", ".join(names)
    if isinstance(machine_type, str) and not is_unknown(machine_type) and _has_built_in_gpu(machine_type):
        return f"machineType {_machine_type_name(machine_type)}, whose GPU is built in"
    if isinstance(accels, _Unknown) or is_unknown(machine_type):
        return UNKNOWN
    return None


# --------------------------------------------------------------------------------------------------------
# Rule 1: GPU instances terminate on host maintenance
# --------------------------------------------------------------------------------------------------------


def _gpu_instance_scheduling(
    resource_type: str, props: Mapping[str, Any]
) -> tuple[str, dict[str, Any], dict[str, Any]] | None:
    """``(GPU evidence, normalised props, scheduling block or {})`` of a GPU instance or template, or None
    when the rules on GPU VMs do not apply: another resource type, no GPU, or the GPU evidence or
    ``scheduling`` unknown during preview."""
    if resource_type not in (INSTANCE, INSTANCE_TEMPLATE):
        return None
    p = _normalize(props)
    evidence = _gpu_evidence(p)
    if evidence is None or evidence is UNKNOWN:
        return None
    scheduling = _obj(p.get("scheduling"))
    if isinstance(scheduling, _Unknown):
        return None
    return str(evidence), p, scheduling or {}


def gpu_instance_terminates_on_maintenance(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A GPU VM (``guestAccelerators`` non-empty, or an A2/A3/A4/G2/G4 machine type whose GPU is built in)
    must set ``scheduling.onHostMaintenance`` to ``"TERMINATE"``: VMs with GPUs cannot live-migrate, and
    the default (MIGRATE) is refused by GCE or leaves the intent implicit.

    Polices ``gcp:compute/instance:Instance`` and ``gcp:compute/instanceTemplate:InstanceTemplate``.
    Passes when the value it needs is unknown during preview: ``scheduling`` or ``onHostMaintenance``
    unknown, or whether the VM has a GPU unknown (``guestAccelerators`` and ``machineType`` both unknown or
    not GPU). A missing ``scheduling`` / ``onHostMaintenance`` is a violation (GCE's default is MIGRATE).
    """
    gpu = _gpu_instance_scheduling(resource_type, props)
    if gpu is None:
        return []
    evidence, _, scheduling = gpu
    value = scheduling.get("onHostMaintenance")
    if is_unknown(value):
        return []
    if isinstance(value, str) and value.upper() == "TERMINATE":
        return []
    now = "is not set (GCE defaults to MIGRATE)" if value is None else f"is {_q(value)}"
    return [
        f"GPU instance ({evidence}): scheduling.onHostMaintenance {now}. GPU VMs cannot live-migrate; "
        f'set scheduling.onHostMaintenance = "TERMINATE" '
        f'(Python: scheduling={{"on_host_maintenance": "TERMINATE", "automatic_restart": True}}).'
    ]


# --------------------------------------------------------------------------------------------------------
# Rules 2 and 3: firewalls
# --------------------------------------------------------------------------------------------------------

_NODE_PORTS = NodePorts.model_validate({})
PROMETHEUS_PORT = _NODE_PORTS.prometheus
GRAFANA_PORT = _NODE_PORTS.grafana

PRIVATE_SOURCE_RANGES: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = (
    ipaddress.ip_network("10.0.0.0/8"),
    ipaddress.ip_network("172.16.0.0/12"),
    ipaddress.ip_network("192.168.0.0/16"),
    ipaddress.ip_network(IAP_SOURCE_RANGE),  # Identity-Aware Proxy TCP forwarding
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
)
"""Sources the monitoring ports may be opened to: RFC 1918, IAP's TCP-forwarding range, loopback."""

_TCP_PROTOCOLS = frozenset({"tcp", "6", "all"})
_ALL_PORTS = (0, 65535)


@dataclass(frozen=True)
class _Source:
    where: str  # "sourceRanges[1]" or the default's explanation
    text: str
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None  # None: not a CIDR range


@dataclass(frozen=True)
class _Opening:
    where: str  # "allows[0].ports[1]"
    text: str  # what it says: '"3000-3100"', 'protocol "all"'
    low: int
    high: int


def _ingress_sources(p: Mapping[str, Any]) -> list[_Source] | None:
    """The source ranges of an enabled-or-not INGRESS rule, None when not ingress or not decidable."""
    direction = p.get("direction")
    if is_unknown(direction):
        return None
    if direction is not None and str(direction).upper() != "INGRESS":
        return None
    ranges = _list(p.get("sourceRanges"))
    if isinstance(ranges, _Unknown):
        return None
    if not ranges:
        # No sourceRanges: the rule applies to the tagged / service-account sources only, and with none of
        # those either GCP applies an ingress rule to 0.0.0.0/0.
        tags = p.get("sourceTags")
        accounts = p.get("sourceServiceAccounts")
        if is_unknown(tags) or is_unknown(accounts):
            return None
        if tags or accounts:
            return []
        default = "the default source: the rule sets no sourceRanges, sourceTags or sourceServiceAccounts"
        return [_Source(default, "0.0.0.0/0", ipaddress.ip_network("0.0.0.0/0"))]
    sources = []
    for i, text in enumerate(ranges):
        if is_unknown(text):
            continue
        try:
            network = ipaddress.ip_network(str(text).strip(), strict=False)
        except ValueError:
            network = None
        sources.append(_Source(f"sourceRanges[{i}]", str(text), network))
    return sources


def _port_range(spec: Any) -> tuple[int, int] | None:
    """``22`` / ``"22"`` / ``22.0`` / ``"20-30"`` -> (low, high); None when it is not a port spec."""
    if isinstance(spec, bool):
        return None
    if isinstance(spec, int | float) and float(spec).is_integer():
        return int(spec), int(spec)
    if isinstance(spec, str):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", spec)
        if match:
            low = int(match.group(1))
            high = int(match.group(2)) if match.group(2) else low
            return (low, high) if low <= high else None
    return None


def _tcp_openings(p: Mapping[str, Any]) -> tuple[list[_Opening], list[str]]:
    """What the ``allows`` blocks open over TCP, and the port specs that could not be read."""
    openings: list[_Opening] = []
    unreadable: list[str] = []
    allows = _list(p.get("allows"))
    if isinstance(allows, _Unknown):
        return openings, unreadable
    for i, block in enumerate(allows):
        if not isinstance(block, dict):
            continue
        protocol = block.get("protocol")
        if is_unknown(protocol) or not isinstance(protocol, str):
            continue
        protocol = protocol.strip().lower()
        if protocol not in _TCP_PROTOCOLS:
            continue
        ports = _list(block.get("ports"))
        if isinstance(ports, _Unknown):
            continue
        if protocol == "all" or not ports:
            what = f'protocol "{protocol}"' if protocol == "all" else f'protocol "{protocol}" without ports'
            openings.append(_Opening(f"allows[{i}]", f"{what} (every port)", *_ALL_PORTS))
            continue
        for j, spec in enumerate(ports):
            if is_unknown(spec):
                continue
            rng = _port_range(spec)
            if rng is None:
                unreadable.append(f"allows[{i}].ports[{j}] = {_q(spec)}")
                continue
            openings.append(_Opening(f"allows[{i}].ports[{j}]", _q(spec), *rng))
    return openings, unreadable


def firewall_no_world_ssh(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """No INGRESS firewall rule opens TCP port 22 to the whole internet (``0.0.0.0/0`` or ``::/0``): a
    port list or range containing 22 (``"22"``, ``22``, ``"1-1024"``), ``tcp`` without ports, or protocol
    ``all``. An ingress rule with no source at all counts as 0.0.0.0/0 (GCP's default). Reach hosts over
    IAP (35.235.240.0/20, ``gcloud compute ssh --tunnel-through-iap``) or a VPN range instead. Disabled
    rules are checked too (one flag away from live).

    Polices ``gcp:compute/firewall:Firewall``. Passes for what is unknown during preview: ``direction``,
    ``sourceRanges`` as a whole (or, with no ranges, ``sourceTags``/``sourceServiceAccounts``), ``allows``,
    and individual unknown ranges, protocols or port entries (the known ones are still judged).
    """
    if resource_type != FIREWALL:
        return []
    p = _normalize(props)
    sources = _ingress_sources(p)
    if not sources:
        return []
    world = [s for s in sources if s.network is not None and s.network.prefixlen == 0]
    if not world:
        return []
    openings, _ = _tcp_openings(p)
    messages = []
    for opening in openings:
        if not opening.low <= 22 <= opening.high:
            continue
        for source in world:
            messages.append(
                f"INGRESS rule opens SSH (tcp/22) via {opening.where} {opening.text} to {source.text} "
                f"({source.where}). Restrict sourceRanges to IAP's {IAP_SOURCE_RANGE} "
                f"(gcloud compute ssh --tunnel-through-iap) or a private/VPN range, or drop port 22 "
                f"from {opening.where.split('.')[0]}."
            )
    return messages


def _is_public(network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    return not any(
        network.version == allowed.version and network.subnet_of(allowed)  # type: ignore[arg-type]
        for allowed in PRIVATE_SOURCE_RANGES
    )


def firewall_no_public_monitoring(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """No INGRESS firewall rule opens Prometheus (9090) or Grafana (3000) (``infra.node.profile.NodePorts``)
    to a public source: any range not inside RFC 1918 (10/8, 172.16/12, 192.168/16), IAP's
    35.235.240.0/20 or loopback. Catches single ports (string or number), ranges such as ``"3000-3100"``,
    ``tcp`` without ports, protocol ``all``, IPv6 sources, and the 0.0.0.0/0 default of a rule without
    sources. A source that is not a CIDR range is refused as well (it cannot be shown to be private).

    Polices ``gcp:compute/firewall:Firewall``. Passes for what is unknown during preview, as
    :func:`firewall_no_world_ssh` does.
    """
    if resource_type != FIREWALL:
        return []
    p = _normalize(props)
    sources = _ingress_sources(p)
    if not sources:
        return []
    public = [s for s in sources if s.network is None or _is_public(s.network)]
    if not public:
        return []
    openings, unreadable = _tcp_openings(p)
    messages = []
    for port, service in ((PROMETHEUS_PORT, "Prometheus"), (GRAFANA_PORT, "Grafana")):
        for opening in openings:
            if not opening.low <= port <= opening.high:
                continue
            for source in public:
                kind = "public range" if source.network is not None else "source that is not a CIDR range"
                messages.append(
                    f"INGRESS rule opens {service} (tcp/{port}) via {opening.where} {opening.text} to "
                    f"{kind} {source.text} ({source.where}). Monitoring stays private: limit sourceRanges "
                    f"to 10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16 or IAP's {IAP_SOURCE_RANGE} (or reach it "
                    f"through an SSH/IAP tunnel), or take tcp/{port} out of {opening.where.split('.')[0]}."
                )
    for spec in unreadable:
        messages.append(
            f'{spec} is not a port or a port range ("3000", "3000-3100") and this rule is open to '
            f"{public[0].text}; write the port as a number or a low-high range."
        )
    return messages


# --------------------------------------------------------------------------------------------------------
# Rule 4: machine types carry their GPUs
# --------------------------------------------------------------------------------------------------------


def _gpu_configs(resource_type: str, p: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], str | None]]:
    """(property path prefix, config, default machine type) for each place a resource declares a host."""
    if resource_type in (INSTANCE, INSTANCE_TEMPLATE):
        return [("", p, None)]
    configs: list[tuple[str, Mapping[str, Any], str | None]] = []
    if resource_type == NODE_POOL:
        node_config = _obj(p.get("nodeConfig"))
        if isinstance(node_config, dict):
            configs.append(("nodeConfig.", node_config, _GKE_DEFAULT_MACHINE_TYPE))
    elif resource_type == CLUSTER:
        removed = p.get("removeDefaultNodePool")
        node_config = _obj(p.get("nodeConfig"))
        # The default pool's config is judged unless the cluster removes that pool (or may: unknown).
        if (removed is False or removed is None) and isinstance(node_config, dict):
            configs.append(("nodeConfig.", node_config, _GKE_DEFAULT_MACHINE_TYPE))
        pools = _list(p.get("nodePools"))
        if isinstance(pools, list):
            for i, pool in enumerate(pools):
                pool_config = _obj(pool.get("nodeConfig")) if isinstance(pool, dict) else None
                if isinstance(pool_config, dict):
                    configs.append((f"nodePools[{i}].nodeConfig.", pool_config, _GKE_DEFAULT_MACHINE_TYPE))
    return configs


def machine_type_carries_gpu(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """Every attached accelerator (``guestAccelerators[].type``) is one the machine type can carry,
    according to the capacity planner's GCP catalog (``infra.capacity.gcp``): T4 only on N1 types (1, 2
    or 4), and on A2/A3/G2 types only the GPU the type brings, in the count the type fixes
    (``nvidia-tesla-a100`` on ``n1-standard-8`` and ``nvidia-tesla-t4`` on an ``a2-*`` type are refused).
    An accelerator the catalog does not know (V100, P4, the ``-vws`` variants, ...) is refused too: the
    planner cannot size a node for it.

    Polices instances and instance templates (top-level ``machineType``/``guestAccelerators``), node pools
    (``nodeConfig``) and clusters (``nodeConfig`` of the default pool unless ``removeDefaultNodePool`` is
    true, and each inline ``nodePools[].nodeConfig``). A node config without ``machineType`` is GKE's
    ``e2-medium``. Passes for what is unknown during preview: ``guestAccelerators``, ``machineType``, an
    accelerator's ``type`` (its ``count``, when unknown, is not checked), ``removeDefaultNodePool``.
    """
    if resource_type not in (INSTANCE, INSTANCE_TEMPLATE, NODE_POOL, CLUSTER):
        return []
    p = _normalize(props)
    messages = []
    for prefix, config, default in _gpu_configs(resource_type, p):
        accels = _accelerators(config)
        if isinstance(accels, _Unknown) or not accels:
            continue
        machine_type = config.get("machineType") or default
        if is_unknown(machine_type):
            continue
        for i, acc in enumerate(accels):
            if not isinstance(acc, dict):
                continue
            where = f"{prefix}guestAccelerators[{i}]"
            kind = acc.get("type")
            if is_unknown(kind):
                continue
            if machine_type is None:
                messages.append(f"{where} attaches {_q(kind)} but {prefix}machineType is not set; set it.")
                continue
            accelerator = _machine_type_name(str(kind))
            gpu = ACCELERATOR_GPUS.get(accelerator)
            if gpu is None:
                known = ", ".join(sorted(ACCELERATOR_GPUS))
                messages.append(
                    f"{where}.type {_q(kind)} is not in the capacity planner's GCP catalog "
                    f"(infra/capacity/gcp.py knows {known}); use one of those or add it to the catalog."
                )
                continue
            raw_count = acc.get("count")
            count = (
                int(raw_count)
                if isinstance(raw_count, int | float) and not isinstance(raw_count, bool)
                else None
            )
            problem = _carry_problem(_machine_type_name(str(machine_type)), gpu, count)
            if problem is not None:
                messages.append(
                    f"{prefix}machineType {_q(machine_type)} cannot carry {where} "
                    f"({count if count is not None else '?'} x {accelerator}): {problem}."
                )
    return messages


# --------------------------------------------------------------------------------------------------------
# Rule 5: Redis requires AUTH (and TLS)
# --------------------------------------------------------------------------------------------------------


def redis_requires_auth(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A Memorystore Redis instance (``gcp:redis/instance:Instance``) has ``authEnabled: true`` and
    ``transitEncryptionMode: "SERVER_AUTHENTICATION"``: the session store holds live conversation state,
    so clients authenticate and the AUTH string never crosses the VPC in clear text.

    Missing values are violations (the defaults are false and DISABLED). Each property passes on its own
    when it is unknown during preview.
    """
    if resource_type != REDIS:
        return []
    p = _normalize(props)
    messages = []
    auth = p.get("authEnabled")
    if not is_unknown(auth) and auth is not True:
        now = "is not set (default false)" if auth is None else f"is {_q(auth)}"
        messages.append(
            f"authEnabled {now}: Redis must require AUTH. Set authEnabled = true (Python: auth_enabled=True) "
            f"and hand the instance's authString to the runtime as a secret."
        )
    mode = p.get("transitEncryptionMode")
    if not is_unknown(mode) and not (isinstance(mode, str) and mode.upper() == "SERVER_AUTHENTICATION"):
        now = "is not set (default DISABLED)" if mode is None else f"is {_q(mode)}"
        messages.append(
            f"transitEncryptionMode {now}: the AUTH string would cross the network in clear text. Set "
            f'transitEncryptionMode = "SERVER_AUTHENTICATION" '
            f'(Python: transit_encryption_mode="SERVER_AUTHENTICATION") and give clients the server CA.'
        )
    return messages


# --------------------------------------------------------------------------------------------------------
# Rule 6: GPU node pools are tainted
# --------------------------------------------------------------------------------------------------------

GPU_TAINT_EFFECT = GPU_TAINT["effect"]


def gpu_node_pool_tainted(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A GKE node pool with GPUs (``nodeConfig.guestAccelerators`` non-empty, or a machine type whose GPU
    is built in) carries the taint ``nvidia.com/gpu`` with effect ``NO_SCHEDULE``, so that only pods that
    tolerate it (the runtime) land on the expensive nodes.

    Polices ``gcp:container/nodePool:NodePool`` and the node configs of ``gcp:container/cluster:Cluster``
    (default pool unless ``removeDefaultNodePool`` is true, inline ``nodePools``). Passes for what is
    unknown during preview: ``nodeConfig``, whether the pool has GPUs, ``taints``, and when no known taint
    matches but some taint's key or effect is unknown.
    """
    if resource_type not in (NODE_POOL, CLUSTER):
        return []
    p = _normalize(props)
    messages = []
    for prefix, config, default in _gpu_configs(resource_type, p):
        evidence = _gpu_evidence(config, default)
        if evidence is None or evidence is UNKNOWN:
            continue
        taints = _list(config.get("taints"))
        if isinstance(taints, _Unknown):
            continue
        undecided = False
        found = False
        for taint in taints:
            if not isinstance(taint, dict):
                undecided = undecided or taint is UNKNOWN
                continue
            key, effect = taint.get("key"), taint.get("effect")
            if is_unknown(key) or is_unknown(effect):
                undecided = True
            elif key == GPU_TAINT_KEY and isinstance(effect, str) and effect.upper() == GPU_TAINT_EFFECT:
                found = True
        if found or undecided:
            continue
        messages.append(
            f"GPU node pool ({prefix}{evidence}) has no {prefix}taints entry with key "
            f'"{GPU_TAINT_KEY}" and effect "{GPU_TAINT_EFFECT}". Add {json.dumps(GPU_TAINT)} to '
            f"{prefix}taints so only pods that tolerate it are scheduled on the GPU nodes."
        )
    return messages


# --------------------------------------------------------------------------------------------------------
# Rule 7: HTTP backend services keep WebSockets open
# --------------------------------------------------------------------------------------------------------

MIN_WEBSOCKET_BACKEND_TIMEOUT_S = 600
"""The shortest backend timeout (s) allowed in front of the runtime: a session lasts minutes."""


def backend_timeout_fits_websockets(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """An HTTP(S) backend service (``gcp:compute/backendService:BackendService``, protocol HTTP, HTTPS or
    HTTP2) has ``timeoutSec`` of at least ``MIN_WEBSOCKET_BACKEND_TIMEOUT_S``: for a WebSocket behind a
    Google Application Load Balancer the backend timeout is the longest the connection may live, and the
    default of 30 s cuts every conversation at 30 s.

    A missing ``timeoutSec`` is a violation (the default 30 s); ``protocol`` missing means HTTP (the
    default). Passes when ``protocol`` or ``timeoutSec`` is unknown during preview.
    """
    if resource_type != BACKEND_SERVICE:
        return []
    p = _normalize(props)
    protocol = p.get("protocol")
    if is_unknown(protocol) or (
        protocol is not None and str(protocol).upper() not in ("HTTP", "HTTPS", "HTTP2")
    ):
        return []
    timeout = p.get("timeoutSec")
    if is_unknown(timeout):
        return []
    if (
        isinstance(timeout, (int, float))
        and not isinstance(timeout, bool)
        and timeout >= MIN_WEBSOCKET_BACKEND_TIMEOUT_S
    ):
        return []
    now = "is not set (default 30 s)" if timeout is None else f"is {_q(timeout)} s"
    return [
        f"timeoutSec {now}: the load balancer closes a WebSocket after the backend timeout. Set timeoutSec "
        f"to at least {MIN_WEBSOCKET_BACKEND_TIMEOUT_S} s, and past the longest session (Python: "
        f"timeout_sec=max_session_s + 60)."
    ]


# --------------------------------------------------------------------------------------------------------
# Rule 8: GPU VMs shut down gracefully for as long as the node's drain
# --------------------------------------------------------------------------------------------------------

MIN_GRACEFUL_SHUTDOWN_S = 60
"""The shortest graceful shutdown allowed on a GPU VM without the node's own figure in its metadata."""


def gpu_instance_graceful_shutdown(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A GPU VM enables GCE graceful shutdown (``scheduling.gracefulShutdown.enabled``) for at least the
    seconds its metadata key ``duplexops-stop-timeout-s`` names (else ``MIN_GRACEFUL_SHUTDOWN_S``).
    GCE's default gives the guest only seconds on stop, delete or replace, which cuts every live
    conversation (cloud.google.com/compute/docs/instances/graceful-shutdown-overview); the maximum is
    3600 s (pulumi-gcp 10.2 ``InstanceSchedulingGracefulShutdownMaxDurationArgs``).

    Polices instances and instance templates; passes when the GPU evidence, ``scheduling``,
    ``gracefulShutdown`` or the duration is unknown during preview."""
    gpu = _gpu_instance_scheduling(resource_type, props)
    if gpu is None:
        return []
    evidence, p, scheduling = gpu
    graceful = _obj(scheduling.get("gracefulShutdown"))
    if isinstance(graceful, _Unknown):
        return []
    metadata = _obj(p.get("metadata"))
    needed = MIN_GRACEFUL_SHUTDOWN_S
    if isinstance(metadata, dict):
        raw = metadata.get(STOP_TIMEOUT_METADATA_KEY)
        if is_unknown(raw):
            return []
        if raw is not None and str(raw).isdigit():
            needed = int(str(raw))
    enabled = None if graceful is None else graceful.get("enabled")
    duration = _obj((graceful or {}).get("maxDuration"))
    if is_unknown(enabled) or isinstance(duration, _Unknown):
        return []
    seconds = None if duration is None else duration.get("seconds")
    if is_unknown(seconds):
        return []
    if enabled is True and isinstance(seconds, (int, float)) and seconds >= needed:
        return []
    now = (
        "is not enabled (GCE gives the guest only seconds)"
        if enabled is not True
        else f"lasts {_q(seconds)} s, less than the {needed} s the node needs to drain"
    )
    return [
        f"GPU instance ({evidence}): scheduling.gracefulShutdown {now}. Live conversations are cut on "
        f"stop, delete or replace; set gracefulShutdown = {{enabled: true, maxDuration: {{seconds: "
        f"{needed}}}}} (at most 3600)."
    ]


# --------------------------------------------------------------------------------------------------------
# Rule 9: the provisioning model is one GCE sells for the machine type
# --------------------------------------------------------------------------------------------------------

_MODEL_KEYS = {gce: key for key, gce in PROVISIONING_MODELS.items()}


def provisioning_model_sold(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A VM's ``scheduling.provisioningModel`` (STANDARD when unset) is one GCE sells its machine type as
    (capacity catalog ``sold_as``: a3-highgpu-1g/2g/4g are Spot or Flex-start only,
    cloud.google.com/compute/docs/accelerator-optimized-machines#a3-high-vms), with the settings the model
    requires (pulumi-gcp 10.2 ``provisioning_model`` docstring): SPOT needs ``preemptible`` true and
    ``automaticRestart`` false; FLEX_START needs ``automaticRestart`` false, ``instanceTerminationAction``
    DELETE and a ``maxRunDuration``.

    Polices instances; passes for machine types outside the catalog and for unknown values."""
    if resource_type != INSTANCE:
        return []
    p = _normalize(props)
    machine_type = p.get("machineType")
    scheduling = _obj(p.get("scheduling"))
    if is_unknown(machine_type) or isinstance(scheduling, _Unknown) or not isinstance(machine_type, str):
        return []
    scheduling = scheduling or {}
    if any(is_unknown(v) for v in scheduling.values()):
        return []
    model = scheduling.get("provisioningModel") or "STANDARD"
    problems = []
    entry = _catalog_entry(machine_type)
    key = _MODEL_KEYS.get(str(model).upper())
    if key is None:
        problems.append(
            f"scheduling.provisioningModel {_q(model)} is not one of "
            f"{', '.join(PROVISIONING_MODELS.values())}"
        )
    elif entry is not None and key not in entry.sold_as:
        sold = " or ".join(PROVISIONING_MODELS[m] for m in entry.sold_as)
        problems.append(
            f"machine type {_q(entry.name)} is sold only as {sold}, not {_q(model)}: GCE refuses to create "
            "the VM. Set scheduling.provisioningModel accordingly (stack config duplexops:provisioningModel)."
        )
    if key == "spot" and (scheduling.get("preemptible") is not True or scheduling.get("automaticRestart")):
        problems.append("SPOT needs scheduling.preemptible = true and scheduling.automaticRestart = false")
    if key == "flex-start" and (
        scheduling.get("automaticRestart")
        or str(scheduling.get("instanceTerminationAction", "")).upper() != "DELETE"
        or not scheduling.get("maxRunDuration")
    ):
        problems.append(
            "FLEX_START needs scheduling.automaticRestart = false, instanceTerminationAction = DELETE and a "
            "maxRunDuration"
        )
    return problems


# --------------------------------------------------------------------------------------------------------
# Rule 10: session affinity only with a hashing locality policy
# --------------------------------------------------------------------------------------------------------

HASH_LOCALITY_POLICIES = ("MAGLEV", "WEIGHTED_MAGLEV", "RING_HASH")
"""Locality policies under which a backend service's session affinity takes effect (pulumi-gcp 10.2
``BackendService.locality_lb_policy`` docstring: "If session_affinity is not NONE, and
locality_lb_policy is not set to MAGLEV, WEIGHTED_MAGLEV, or RING_HASH, session affinity settings will not
take effect")."""


def session_affinity_needs_hash_policy(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A backend service that asks for session affinity (``sessionAffinity`` other than NONE) uses a
    locality policy under which it works (``HASH_LOCALITY_POLICIES``); with ROUND_ROBIN or LEAST_REQUEST
    the affinity is silently off. Passes when either value is unknown during preview."""
    if resource_type != BACKEND_SERVICE:
        return []
    p = _normalize(props)
    affinity, policy = p.get("sessionAffinity"), p.get("localityLbPolicy")
    if is_unknown(affinity) or is_unknown(policy) or affinity in (None, "NONE"):
        return []
    if isinstance(policy, str) and policy.upper() in HASH_LOCALITY_POLICIES:
        return []
    now = "is not set (ROUND_ROBIN)" if policy is None else f"is {_q(policy)}"
    return [
        f"sessionAffinity {_q(affinity)} has no effect: localityLbPolicy {now}. Use "
        f"{' or '.join(HASH_LOCALITY_POLICIES)}, or drop the affinity."
    ]


# --------------------------------------------------------------------------------------------------------
# Stack rule: every API a resource needs is enabled, and the resource waits for it
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StackResource:
    """One resource as a stack rule sees it: type token, inputs, name, and the names (or URNs) of the
    resources it depends on (None when the caller does not know them)."""

    type: str
    props: Mapping[str, Any]
    name: str
    dependencies: tuple[str, ...] | None = None


def apis_enabled_for_features(resources: Sequence[StackResource]) -> list[str]:
    """Every API a declared resource needs (``infra.gcp_apis.required_apis``: its module's API and its
    features', e.g. image streaming -> ``containerfilesystem.googleapis.com``) is enabled by a
    ``gcp:projects/service:Service`` of the stack, and the resource depends on that Service (else GCE/GKE
    may see the request first and answer SERVICE_DISABLED). The step-0 APIs (``infra.gcp_apis.STEP_0_APIS``:
    Cloud Resource Manager and Service Usage, which ``projects.Service`` and ``projects.IAMMember`` call) are
    enabled by hand before any program (terraform-provider-google #6101, #11435): declaring one is a
    violation, needing one is not.

    Applies to stacks that enable APIs themselves (at least one Service declared); a stack built with
    ``enableApis: false`` relies on APIs enabled outside it. Dependencies are checked where known, directly
    or through other resources (a binding that waits for a cluster that waits for the API is fine)."""
    services = {
        str(r.props.get("service")): r.name
        for r in resources
        if r.type == SERVICE_TYPE and isinstance(r.props.get("service"), str)
    }
    if not services:
        return []
    by_name = {r.name: r for r in resources}

    def waits_for(resource: StackResource, target: str) -> bool:
        """Whether ``resource`` depends on ``target`` directly or through other resources."""
        seen: set[str] = set()
        todo = list(resource.dependencies or ())
        while todo:
            dep = todo.pop()
            name = dep.rsplit("::", 1)[-1]
            if name == target:
                return True
            if name in seen or name not in by_name:
                continue
            seen.add(name)
            todo.extend(by_name[name].dependencies or ())
        return False

    problems = [
        f"{SERVICE_TYPE} {name} enables {api}, a step-0 API that no program can enable (enabling an API "
        f"needs it): remove it and run `{step_0_command()}` once per project (step 0)."
        for api, name in sorted(services.items())
        if api in STEP_0_APIS
    ]
    for r in resources:
        for api, why in sorted(required_apis(r.type, _normalize(r.props)).items()):
            if api in STEP_0_APIS:
                continue  # enabled at step 0, before any program runs
            if api not in services:
                problems.append(
                    f"{r.type} {r.name} needs {api} ({why}), which the stack does not enable: add it to the "
                    "APIs the program enables."
                )
            elif r.dependencies is not None and not waits_for(r, services[api]):
                problems.append(
                    f"{r.type} {r.name} needs {api} ({why}) but does not depend on its enablement "
                    f"({services[api]}): pass the APIs' ResourceOptions (depends_on)."
                )
    return problems


# --------------------------------------------------------------------------------------------------------
# The pack's rule list and a helper for the stacks' tests
# --------------------------------------------------------------------------------------------------------

RuleCheck = Callable[[str, Mapping[str, Any]], list[str]]


@dataclass(frozen=True)
class Rule:
    """One policy of the pack: its name (the policy's id), description, the resource types it polices,
    its check and the steps that fix a violation."""

    name: str
    description: str
    resource_types: tuple[str, ...]
    check: RuleCheck
    remediation: str


RULES: tuple[Rule, ...] = (
    Rule(
        "gpu-instance-terminate-on-maintenance",
        "GPU VMs must use scheduling.onHostMaintenance = TERMINATE (GPUs cannot live-migrate).",
        (INSTANCE, INSTANCE_TEMPLATE),
        gpu_instance_terminates_on_maintenance,
        'Set scheduling.onHostMaintenance to "TERMINATE" (and automaticRestart to true).',
    ),
    Rule(
        "firewall-no-world-ssh",
        "No INGRESS firewall rule may open SSH (tcp/22) to 0.0.0.0/0 or ::/0.",
        (FIREWALL,),
        firewall_no_world_ssh,
        f"Limit sourceRanges to IAP's {IAP_SOURCE_RANGE} or a private range, or remove port 22.",
    ),
    Rule(
        "firewall-no-public-monitoring",
        f"No INGRESS firewall rule may open Prometheus (tcp/{PROMETHEUS_PORT}) or Grafana "
        f"(tcp/{GRAFANA_PORT}) to a public source range.",
        (FIREWALL,),
        firewall_no_public_monitoring,
        f"Limit sourceRanges to RFC 1918 ranges or IAP's {IAP_SOURCE_RANGE}, or remove the monitoring ports.",
    ),
    Rule(
        "gpu-machine-type-match",
        "Attached GPUs must be ones the machine type can carry (capacity planner's GCP catalog).",
        (INSTANCE, INSTANCE_TEMPLATE, NODE_POOL, CLUSTER),
        machine_type_carries_gpu,
        "Use the machine type the planner pairs with the GPU (infra/capacity/gcp.py DEFAULT_MACHINE_TYPE).",
    ),
    Rule(
        "redis-auth-required",
        "Memorystore Redis must require AUTH and use transit encryption (SERVER_AUTHENTICATION).",
        (REDIS,),
        redis_requires_auth,
        'Set authEnabled = true and transitEncryptionMode = "SERVER_AUTHENTICATION".',
    ),
    Rule(
        "gpu-node-pool-tainted",
        "GKE node pools with GPUs must carry the taint nvidia.com/gpu with effect NO_SCHEDULE.",
        (NODE_POOL, CLUSTER),
        gpu_node_pool_tainted,
        f"Add {json.dumps(GPU_TAINT)} to nodeConfig.taints.",
    ),
    Rule(
        "backend-timeout-fits-websockets",
        f"HTTP(S) backend services must have timeoutSec >= {MIN_WEBSOCKET_BACKEND_TIMEOUT_S} s (the 30 s "
        "default cuts WebSocket sessions).",
        (BACKEND_SERVICE,),
        backend_timeout_fits_websockets,
        "Set timeoutSec past the longest session (max_session_s + 60).",
    ),
    Rule(
        "gpu-instance-graceful-shutdown",
        "GPU VMs must enable GCE graceful shutdown for as long as the node needs to drain.",
        (INSTANCE, INSTANCE_TEMPLATE),
        gpu_instance_graceful_shutdown,
        "Set scheduling.gracefulShutdown = {enabled: true, maxDuration: {seconds: <node stop timeout>}}.",
    ),
    Rule(
        "provisioning-model-sold",
        "A VM's provisioning model must be one GCE sells for its machine type, with the settings it needs.",
        (INSTANCE,),
        provisioning_model_sold,
        "Set duplexops:provisioningModel to one the machine type is sold as (a3-highgpu-1g: spot or "
        "flex-start).",
    ),
    Rule(
        "session-affinity-needs-hash-policy",
        "Backend services with session affinity must use localityLbPolicy MAGLEV or RING_HASH.",
        (BACKEND_SERVICE,),
        session_affinity_needs_hash_policy,
        "Set localityLbPolicy to RING_HASH (or MAGLEV), or sessionAffinity to NONE.",
    ),
)
"""The pack's resource rules, in the order the pack lists its policies."""


@dataclass(frozen=True)
class StackRule:
    """One stack-wide policy: its name, description, check over every resource, and the fix."""

    name: str
    description: str
    check: Callable[[Sequence[StackResource]], list[str]]
    remediation: str


STACK_RULES: tuple[StackRule, ...] = (
    StackRule(
        "apis-enabled-for-features",
        "Every Google API a resource or feature needs is enabled by the stack, and the resource waits for "
        "it.",
        apis_enabled_for_features,
        "Add the API to the topology's list (infra/program/gce.py GCP_APIS, infra/program/multi_region.py "
        "GKE_APIS) and create the resource after it.",
    ),
)
"""The pack's stack rules (after the resource rules)."""


def check_resources(
    resources: Iterable[
        tuple[str, Mapping[str, Any]]
        | tuple[str, Mapping[str, Any], str]
        | tuple[str, Mapping[str, Any], str, Sequence[str] | None]
    ],
) -> list[str]:
    """Apply every rule to every resource, then every stack rule to all of them; the violations, each
    prefixed ``[policy] type name:`` (stack rules: ``[policy]``).

    ``resources`` are ``(resource_type, props)`` pairs, ``(resource_type, props, name)`` triples, e.g.
    ``(args.typ, args.inputs, args.name)`` collected by a ``pulumi.runtime.Mocks.new_resource``, or
    quadruples adding the names/URNs the resource depends on (the stack rules check them; None or absent:
    not known). An empty result means the stack passes the pack (as far as values known in the mocks go).
    """
    violations = []
    stack: list[StackResource] = []
    for index, item in enumerate(resources):
        resource_type, props = item[0], item[1]
        name = item[2] if len(item) > 2 else f"#{index}"  # type: ignore[misc]
        deps = item[3] if len(item) > 3 else None  # type: ignore[misc]
        stack.append(StackResource(resource_type, props, name, None if deps is None else tuple(deps)))
        for rule in RULES:
            if resource_type not in rule.resource_types:
                continue
            for message in rule.check(resource_type, props):
                violations.append(f"[{rule.name}] {resource_type} {name}: {message}")
    for stack_rule in STACK_RULES:
        violations.extend(f"[{stack_rule.name}] {message}" for message in stack_rule.check(stack))
    return violations
