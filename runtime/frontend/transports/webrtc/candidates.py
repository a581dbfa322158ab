"""The caller's ICE candidates, filtered before the node's ICE agent sees them (issue 34, item 3).

An offer names the addresses the node's ICE agent sends its connectivity checks to (RFC 8445, 6.1.2: a STUN
Binding request per candidate pair, retransmitted). Unfiltered, a caller could aim the node's UDP anywhere:
an offer listing host candidates at ``169.254.169.254`` (the cloud metadata server), the node's own
``127.0.0.1``, its VPC's private addresses, or ``.local`` names (an mDNS query on the node's network) made
the node send STUN checks there; 254 candidates at one address gave 4.0x the POST's bytes at that address.

What :func:`filter_offer` keeps, per candidate line (``a=candidate:`` of RFC 8839, 5.1):

- a global (public) address: kept;
- never kept: link-local (``169.254.0.0/16``, ``fe80::/10``: the metadata server), multicast, unspecified,
  reserved, and any name instead of an address (``<uuid>.local`` mDNS names of browsers, RFC 8839 and
  draft-ietf-mmusic-mdns-ice-candidates: resolving them would query the node's network);
- any other address (loopback, private ranges, carrier-grade NAT, documentation ranges): kept when inside
  one of ``allowed_nets`` (``DUPLEX_RTC_CANDIDATE_NETS``): a single host or a LAN lists what its callers use,
  a cloud node lists nothing and reaches callers at public addresses or through its TURN relay;
- at most ``max_candidates`` (16) in all, the first ones of the offer: a browser offers a handful.

Pure: text in, text out; ``ipaddress`` from the standard library.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["MAX_CANDIDATES", "CandidateFilter", "FilteredOffer", "filter_offer"]

MAX_CANDIDATES = 16
"""Most caller candidates kept from one offer (a browser offers 2-8: host, srflx and relay per family)."""

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class FilteredOffer:
    """An offer with its candidates filtered.

    Attributes:
        sdp: the offer's text without the dropped ``a=candidate:`` lines (the rest byte for byte).
        kept: how many candidate lines stayed.
        dropped: ``(address, reason)`` of each dropped line; reason one of ``link_local``, ``multicast``,
            ``unspecified``, ``reserved``, ``not_an_address``, ``not_allowed`` (a non-public address outside
            the allowed nets), ``too_many``, ``malformed``.
    """

    sdp: str
    kept: int
    dropped: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class CandidateFilter:
    """The node's candidate rules: ``allowed_nets`` (non-public networks whose addresses may be candidates)
    and ``max_candidates``.

    Raises:
        ValueError: a network that does not parse (names it), or ``max_candidates`` under 1.
    """

    allowed_nets: tuple[IpNetwork, ...] = ()
    max_candidates: int = MAX_CANDIDATES

    @classmethod
    def from_cidrs(cls, cidrs: Sequence[str], max_candidates: int = MAX_CANDIDATES) -> CandidateFilter:
        """From CIDR strings (``DUPLEX_RTC_CANDIDATE_NETS``)."""
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
        nets = []
        for cidr in cidrs:
            try:
                nets.append(ipaddress.ip_network(cidr.strip(), strict=False))
            except ValueError:
                raise ValueError(f"candidate network {cidr!r} is not a CIDR (e.g. 10.0.0.0/8)") from None
        return cls(tuple(nets), max_candidates)

    def reason_to_drop(self, address: str) -> str | None:
        """Why a candidate at ``address`` is dropped, or None when it is kept (the count aside)."""
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return "not_an_address"
        if ip.is_link_local:
            return "link_local"
        if ip.is_multicast:
            return "multicast"
        if ip.is_unspecified:
            return "unspecified"
        if ip.is_global:
            return None
        if any(ip.version == net.version and ip in net for net in self.allowed_nets):
            return None
        if ip.is_reserved:
            return "reserved"
        return "not_allowed"


def filter_offer(sdp: str, rules: CandidateFilter) -> FilteredOffer:
    """``sdp`` without the candidate lines ``rules`` drop (module docstring); every other line unchanged,
    with its own line ending."""
    out: list[str] = []
    dropped: list[tuple[str, str]] = []
    kept = 0
    for line in sdp.splitlines(keepends=True):
        if not line.startswith("a=candidate:"):
            out.append(line)
            continue
        fields = line.split()
        # a=candidate:<foundation> <component> <transport> <priority> <address> <port> typ <type> ...
        if len(fields) < 8 or fields[6] != "typ":
            dropped.append((line.strip()[:80], "malformed"))
            continue
        address = fields[4]
        reason = rules.reason_to_drop(address)
        if reason is None and kept >= rules.max_candidates:
            reason = "too_many"
        if reason is not None:
            dropped.append((address[:80], reason))
            continue
        kept += 1
        out.append(line)
    return FilteredOffer("".join(out), kept, dropped)
