"""Rules on ``gcp:compute/firewall:Firewall``: no SSH to the world, no public monitoring ports."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infra.capacity.gcp import (
    IAP_SOURCE_RANGE,
)
from infra.node.profile.profiles import NodePorts
from infra.policy.rules._common import (
    FIREWALL,
    _list,
    _normalize,
    _q,
    _Unknown,
    is_unknown,
)

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
    """No INGRESS firewall rule opens Prometheus (9090) or Grafana (3000)
    (``infra.node.profile.profiles.NodePorts``) to a public source: any range not inside RFC 1918 (10/8,
    172.16/12, 192.168/16), IAP's 35.235.240.0/20 or loopback. Catches single ports (string or number), ranges
    such as ``"3000-3100"``, ``tcp`` without ports, protocol ``all``, IPv6 sources, and the 0.0.0.0/0 default
    of a rule without sources. A source that is not a CIDR range is refused as well (it cannot be shown to be
    private).

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
