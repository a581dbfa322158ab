"""Which of a caller's ICE candidates the node's ICE agent may send to: the offer's ``a=candidate`` lines
filtered before ``setRemoteDescription`` (issue 34, item 3).

aioice (0.13) sends STUN connectivity checks to every remote candidate it is given, whatever the address
(loopback, 169.254.169.254, private ranges), and resolves ``.local`` names by mDNS: a caller's offer would
otherwise aim the node's UDP at its own loopback services, the cloud metadata server or its private network.
What is kept (:func:`candidate_refusal` returns None):

- an IP literal (never a name: ``.local`` mDNS names and DNS names are dropped), UDP, port 1-65535;
- a globally routable address (``ipaddress``'s ``is_global``; an IPv4-mapped IPv6 address is judged as its
  IPv4 address), or one inside ``DUPLEX_RTC_ALLOWED_CANDIDATE_NETS`` (a deployment's own private nets, the
  local node's loopback), or a ``typ relay`` candidate inside ``DUPLEX_RTC_RELAY_NETS`` (the node's own TURN
  relay's address, private in a Compose node);
- with ``DUPLEX_RTC_RELAY_ONLY``: only ``typ relay`` candidates inside ``DUPLEX_RTC_RELAY_NETS``;
- at most :data:`MAX_CANDIDATES` in the whole offer (the first ones, in the offer's order).

Candidate syntax: RFC 8839 section 5.1 (``a=candidate:<foundation> <component> <transport> <priority>
<address> <port> typ <type> ...``). Pure: no sockets.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.config import RuntimeConfig

__all__ = [
    "MAX_CANDIDATES",
    "CandidatePolicy",
    "DroppedCandidate",
    "FilteredOffer",
    "candidate_refusal",
    "filter_offer_candidates",
]

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_CANDIDATES = 16
"""Most remote candidates kept from one offer. A browser offers one host candidate per interface and
family, one server-reflexive and one or two relay candidates (one per TURN URL): under 10 in practice. Each
kept candidate costs the node STUN checks (aioice: a check, then retransmits at 0.5 s .. 1.6 s), so an offer
of 254 candidates at one address sent 4.0x the POST's bytes at that address (issue 34)."""

_CANDIDATE_PREFIX = "a=candidate:"


@dataclass(frozen=True)
class CandidatePolicy:
    """Where a caller's candidates may point.

    Attributes:
        allowed_nets: networks kept whatever their kind (private, loopback: the operator's choice).
        relay_nets: the node's TURN relay addresses: ``typ relay`` candidates there are kept.
        relay_only: keep only ``typ relay`` candidates inside ``relay_nets``.
        max_candidates: most candidates kept per offer.
    """

    allowed_nets: tuple[IpNetwork, ...] = ()
    relay_nets: tuple[IpNetwork, ...] = ()
    relay_only: bool = False
    max_candidates: int = MAX_CANDIDATES

    @classmethod
    def of(
        cls,
        allowed: Iterable[str] = (),
        relay: Iterable[str] = (),
        *,
        relay_only: bool = False,
        max_candidates: int = MAX_CANDIDATES,
    ) -> CandidatePolicy:
        """The policy from CIDR strings (``"10.0.0.0/8"``, ``"127.0.0.1"``).

        Raises:
            ValueError: a string that is not an address or CIDR; ``relay_only`` without ``relay``;
                ``max_candidates`` < 1.
        """
        if relay_only and not tuple(relay):
            raise ValueError("relay_only needs the relay's addresses (DUPLEX_RTC_RELAY_NETS)")
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
        return cls(parse_nets(allowed), parse_nets(relay), relay_only, max_candidates)

    @classmethod
    def from_config(cls, config: RuntimeConfig) -> CandidatePolicy:
        """The policy of ``DUPLEX_RTC_ALLOWED_CANDIDATE_NETS``, ``DUPLEX_RTC_RELAY_NETS`` and
        ``DUPLEX_RTC_RELAY_ONLY``."""
        return cls.of(
            config.rtc_allowed_candidate_nets, config.rtc_relay_nets, relay_only=config.rtc_relay_only
        )


def parse_nets(cidrs: Iterable[str]) -> tuple[IpNetwork, ...]:
    """``cidrs`` as networks (host bits allowed: ``10.0.0.5/8`` is ``10.0.0.0/8``).

    Raises:
        ValueError: one that is not an address or CIDR (named, with an example).
    """
    nets = []
    for cidr in cidrs:
        try:
            nets.append(ipaddress.ip_network(cidr.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{cidr!r} is not an address or CIDR (e.g. 10.0.0.0/8 or fd00::/8)") from None
    return tuple(nets)


@dataclass(frozen=True)
class DroppedCandidate:
    """A candidate line not given to the ICE agent.

    Attributes:
        address: its connection address as written (an IP literal or a name).
        port: its port as written.
        kind: its ``typ`` (``host``, ``srflx``, ``prflx``, ``relay``), or ``""`` when malformed.
        reason: why: ``malformed``, ``transport``, ``port``, ``mdns``, ``name``, ``loopback``,
            ``link_local``, ``multicast``, ``unspecified``, ``not_global``, ``relay_only``, ``over_limit``.
    """

    address: str
    port: str
    kind: str
    reason: str


@dataclass(frozen=True)
class FilteredOffer:
    """An offer with its candidates filtered.

    Attributes:
        sdp: the offer's text without the dropped ``a=candidate`` lines (every other line as it was).
        kept: candidates kept.
        dropped: the candidates dropped, in the offer's order.
    """

    sdp: str
    kept: int
    dropped: tuple[DroppedCandidate, ...] = field(default=())


def _address_kind(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why ``address`` is no place to send a STUN check, or None when it is globally routable."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # Python 3.11's is_loopback is False for ::ffff:127.0.0.1
    for reason, hit in (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link_local", address.is_link_local),
        ("multicast", address.is_multicast),
    ):
        if hit:
            return reason
    return None if address.is_global else "not_global"


def candidate_refusal(
    address: str, port: str, transport: str, kind: str, policy: CandidatePolicy
) -> str | None:
    """Why a candidate at ``address``:``port`` (``transport``, ``typ kind``) is dropped under ``policy``, or
    None when the ICE agent may send to it (the module docstring's rules; the reasons are
    :class:`DroppedCandidate`'s)."""
    if transport.lower() != "udp":
        return "transport"  # aioice checks UDP candidates only (TCP candidates: RFC 6544, unsupported)
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return "port"
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0] if ":" in address else address)
    except ValueError:
        return "mdns" if address.lower().rstrip(".").endswith(".local") else "name"
    in_relay = kind == "relay" and any(ip in net for net in policy.relay_nets)
    if policy.relay_only:
        return None if in_relay else "relay_only"
    if in_relay or any(ip in net for net in policy.allowed_nets):
        return None
    return _address_kind(ip)


def filter_offer_candidates(sdp: str, policy: CandidatePolicy) -> FilteredOffer:
    """``sdp`` without the candidate lines ``policy`` drops, and past ``policy.max_candidates`` kept ones.

    Every other line (``a=end-of-candidates`` included) is kept byte for byte, line endings too.
    """
    lines = sdp.splitlines(keepends=True)
    out: list[str] = []
    dropped: list[DroppedCandidate] = []
    kept = 0
    for line in lines:
        text = line.rstrip("\r\n")
        if not text.startswith(_CANDIDATE_PREFIX):
            out.append(line)
            continue
        parts = text[len(_CANDIDATE_PREFIX) :].split()
        if len(parts) < 8 or parts[6] != "typ":
            dropped.append(DroppedCandidate(parts[4] if len(parts) > 4 else "", "", "", "malformed"))
            continue
        _foundation, _component, transport, _priority, address, port, _typ, kind = parts[:8]
        reason = candidate_refusal(address, port, transport, kind, policy)
        if reason is None and kept >= policy.max_candidates:
            reason = "over_limit"
        if reason is not None:
            dropped.append(DroppedCandidate(address, port, kind, reason))
            continue
        kept += 1
        out.append(line)
    return FilteredOffer("".join(out), kept, tuple(dropped))
