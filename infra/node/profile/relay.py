"""The node's TURN relay, typed: ``RelaySettings`` (a section of ``NodeProfile``) and the figures derived from
it: the relay port range sized to the node's sessions, the TURN URLs callers are given, the public ports a
firewall opens for media. Pure: no sockets, no Pulumi; coturn's configuration is rendered by
``infra.node.bundle.coturn``.

Why a relay at all: the runtime's WebRTC stack (aiortc; its ICE agent, aioice) binds random ephemeral UDP
ports and has no port-range option, so a node cannot open "the media ports" in a firewall. Callers instead
reach the runtime through coturn on two fixed public ports (``port``/udp, ``tls_port``/tcp with TLS); coturn
relays to the runtime's host candidate inside the node. The relay port range is where coturn's allocations
live (one UDP port each); only the runtime, on the same host, sends to them, so the range is never opened
to the internet (docs/node.md, "The TURN relay").
"""

from __future__ import annotations

import ipaddress
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "ALLOCATIONS_PER_SESSION",
    "LINUX_EPHEMERAL_PORTS",
    "MIN_RELAY_PORTS",
    "RelaySettings",
    "media_firewall_allows",
    "relay_port_range",
    "relay_quota",
    "turn_urls",
]

ALLOCATIONS_PER_SESSION = 4
"""TURN allocations one session may hold at once: a browser makes one allocation per TURN URL it is given
(two: ``turn:...?transport=udp`` and ``turns:...?transport=tcp``; W3C WebRTC 1.0 and RFC 8445 gather a relay
candidate per server), and an ICE restart or a reconnect makes two more while the first two are still
alive. coturn's ``user-quota`` (per username: one token's credentials, however many offers it makes) is set
to this."""

MIN_RELAY_PORTS = 32
"""Smallest relay port range (ports): room for a health check and a few callers even on a 1-slot node."""

LINUX_EPHEMERAL_PORTS = (32768, 60999)
"""Linux's default ``net.ipv4.ip_local_port_range``: the ports the kernel hands out to sockets bound to
port 0, such as aioice's (kernel documentation, ip-sysctl). The relay range defaults above it, so the
relay never competes with the runtime's ICE sockets on a host where both share a network namespace."""


class RelaySettings(BaseModel):
    """The node's TURN relay (coturn, ``infra.node.bundle.coturn``).

    Attributes:
        enabled: run coturn and give WebRTC callers TURN credentials (``DUPLEX_TURN_*``).
        port: TURN over UDP (RFC 8656; 3478 is the IANA ``turn`` port). Public.
        tls_port: TURN over TLS on TCP (RFC 8656 section 3.1; 5349 is ``turns``), for callers whose networks
            pass only TCP/443-like traffic; the node's nginx certificate. Public.
        relay_min_port: first port of the relay range (UDP, private: see the module docstring); the range's
            size comes from the node's sessions (``relay_port_range``).
        metrics_port: coturn's Prometheus exporter (``--prometheus-port``; the coturn/coturn image is built
            with it, Debian's package is not), on the node's private network only.
        credential_ttl_s: how long a session's TURN credentials are valid (``DUPLEX_TURN_TTL_S``).
        compose_subnet: the Compose bridge network's subnet (``compose`` nodes), pinned so that coturn's
            peer rule names the runtime's fixed address (``runtime_address``) and nothing else.
        peer_networks: the addresses (CIDRs) coturn may relay to. Empty: the runtime's address on the
            Compose network; a ``processes`` node (the local node) fills in the host's own addresses when
            it starts; a Kubernetes region gives its pod range.

    Raises:
        pydantic.ValidationError: ports out of range, a relay range that would overlap Linux's ephemeral
            ports or run past 65535, a subnet or CIDR that does not parse, a subnet too small.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    port: int = Field(3478, ge=1, le=65535)
    tls_port: int = Field(5349, ge=1, le=65535)
    relay_min_port: int = Field(61000, ge=1024, le=65535)
    metrics_port: int = Field(9641, ge=1, le=65535)
    credential_ttl_s: int = Field(3600, ge=60, le=86400)
    compose_subnet: str = "172.31.254.0/24"
    peer_networks: tuple[str, ...] = ()

    @field_validator("compose_subnet")
    @classmethod
    def _subnet(cls, value: str) -> str:
        try:
            network = ipaddress.IPv4Network(value)
        except ValueError:
            raise ValueError(
                f"compose_subnet {value!r} is not an IPv4 network (e.g. 172.31.254.0/24)"
            ) from None
        if network.prefixlen > 26 or not network.is_private:
            raise ValueError(f"compose_subnet {value!r} must be a private IPv4 network of /26 or larger")
        return value

    @field_validator("peer_networks")
    @classmethod
    def _peers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for cidr in value:
            try:
                network = ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(
                    f"peer_networks: {cidr!r} is not an address or CIDR (e.g. 10.0.0.5)"
                ) from None
            if network.prefixlen == 0:
                raise ValueError(f"peer_networks: {cidr!r} would let the relay reach every address")
        return value

    @model_validator(mode="after")
    def _distinct(self) -> RelaySettings:
        if self.port == self.tls_port:
            raise ValueError(f"relay.port and relay.tls_port are both {self.port}; each needs its own")
        low, high = LINUX_EPHEMERAL_PORTS
        if low <= self.relay_min_port <= high:
            raise ValueError(
                f"relay.relay_min_port {self.relay_min_port} is inside Linux's ephemeral port range "
                f"{low}-{high} (the runtime's ICE sockets): start it at {high + 1} or below {low}"
            )
        return self

    @property
    def runtime_address(self) -> str:
        """The runtime container's fixed address on the Compose network: the subnet's 10th address (Docker
        hands out dynamic ones from the upper half only, ``dynamic_range``)."""
        return str(ipaddress.IPv4Network(self.compose_subnet).network_address + 10)

    @property
    def dynamic_range(self) -> str:
        """The upper half of ``compose_subnet``: where Docker places the other containers (``ip_range``)."""
        network = ipaddress.IPv4Network(self.compose_subnet)
        return str(list(network.subnets())[1])


def relay_port_range(relay: RelaySettings, sessions: int) -> tuple[int, int]:
    """``(min, max)`` of the relay ports (inclusive) for a node of ``sessions`` slots:
    ``max(MIN_RELAY_PORTS, 2 x ALLOCATIONS_PER_SESSION x sessions)`` ports from ``relay.relay_min_port``.

    Why twice the allocations: a caller that vanishes without closing leaves its allocations until their
    lifetime ends (coturn's default 600 s, RFC 8656 section 3.2: the client must refresh), so a node whose
    sessions turn over holds up to about twice its concurrent allocations. 5 sessions: 40 ports.

    Raises:
        ValueError: ``sessions`` < 1, or the range would pass port 65535 (names the largest start).
    """
    if sessions < 1:
        raise ValueError(f"sessions must be >= 1, got {sessions}")
    count = max(MIN_RELAY_PORTS, 2 * ALLOCATIONS_PER_SESSION * sessions)
    high = relay.relay_min_port + count - 1
    if high > 65535:
        raise ValueError(
            f"relay range {relay.relay_min_port}-{high} ({count} ports, {sessions} sessions) passes 65535; "
            f"set relay.relay_min_port to at most {65536 - count}"
        )
    return relay.relay_min_port, high


def relay_quota(sessions: int) -> tuple[int, int]:
    """``(user-quota, total-quota)``: allocations per token's credentials and on the whole relay. The total
    equals the relay range's size, so coturn answers 486 (Allocation Quota Reached) before the range runs
    dry (508, Insufficient Capacity)."""
    return ALLOCATIONS_PER_SESSION, max(MIN_RELAY_PORTS, 2 * ALLOCATIONS_PER_SESSION * sessions)


def turn_urls(relay: RelaySettings, host: str) -> list[str]:
    """The ``DUPLEX_TURN_URLS`` of a node reached at ``host`` (its DNS name: the ``turns:`` URL is checked
    against the certificate): TURN over UDP first (lowest latency), then TURN over TLS (RFC 7065 URIs)."""
    return [f"turn:{host}:{relay.port}?transport=udp", f"turns:{host}:{relay.tls_port}?transport=tcp"]


def media_firewall_allows(relay: RelaySettings) -> list[dict[str, Any]]:
    """What a firewall in front of the node opens for WebRTC media, as GCE ``allows`` entries: the relay's
    UDP port and its TLS port. Nothing else: not the relay range (only the runtime on the node sends to it),
    not the runtime's ephemeral ICE ports (reached through the relay only). Empty when the relay is off."""
    if not relay.enabled:
        return []
    return [
        {"protocol": "udp", "ports": [str(relay.port)]},
        {"protocol": "tcp", "ports": [str(relay.tls_port)]},
    ]
