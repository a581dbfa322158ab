"""The stacks' public names: A records in a Cloud DNS managed zone when the stack names one (``dnsZone``),
and the regions' reserved TURN addresses they point at. Without a zone the stacks export the addresses and
docs/deploying.md ("DNS records") says which records to make by hand.

A record's TTL is ``RECORD_TTL_S``: the addresses are reserved (a static VM address, the global entry's
address, each region's TURN address), so a record changes only when an operator moves it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pulumi

__all__ = ["RECORD_TTL_S", "a_records", "records_summary", "turn_address"]

RECORD_TTL_S = 300
"""TTL of the stack's A records (s): 5 minutes, Cloud DNS's default for a new record set."""


def a_records(
    project: str,
    zone: str,
    records: Mapping[str, pulumi.Input[str]],
    opts: pulumi.ResourceOptions | None = None,
) -> dict[str, pulumi.CustomResource]:
    """One ``gcp.dns.RecordSet`` (type A, ``RECORD_TTL_S``) per ``{host: IPv4 address}`` in the managed zone
    ``zone`` of ``project``, named ``dns-<host>``; ``{host: record set}``. Cloud DNS refuses a host outside
    the zone's DNS name at ``up`` (the zone is not read here).

    Raises:
        ValueError: a host that is not a lower-case DNS name (it must be the zone's or below it).
    """
    import pulumi_gcp.dns as dns

    made: dict[str, pulumi.CustomResource] = {}
    for host, address in sorted(records.items()):
        if not host or host != host.lower() or host.endswith(".") or " " in host:
            raise ValueError(f"DNS record {host!r}: a lower-case host name without the final dot")
        made[host] = dns.RecordSet(
            f"dns-{host}",
            project=project,
            managed_zone=zone,
            name=f"{host}.",
            type="A",
            ttl=RECORD_TTL_S,
            rrdatas=[address],
            opts=opts,
        )
    return made


def records_summary(zone: str | None, records: Mapping[str, pulumi.Input[str]]) -> dict[str, Any]:
    """The ``dns`` output: ``{"zone": zone or None, "records": {host: address}, "made": by whom}``: the A
    records the stack made in ``zone``, or those the operator must make by hand (no zone)."""
    return {
        "zone": zone,
        "records": {host: address for host, address in sorted(records.items())},
        "made": f"by the stack in Cloud DNS zone {zone}"
        if zone is not None
        else "by hand: an A record per host at its address (duplexops:dnsZone makes them)",
    }


def turn_address(
    name: str, project: str, region: str, labels: Mapping[str, str], opts: pulumi.ResourceOptions | None
) -> pulumi.CustomResource:
    """A region's reserved external IPv4 address for its TURN load balancers (``compute.Address``,
    regional, Premium tier: what a regional external passthrough Network Load Balancer takes); the UDP and
    the TLS Service share it (``loadBalancerIP``), so ``turn-<region>.<domain>`` keeps one A record."""
    import pulumi_gcp.compute as compute

    return compute.Address(
        name,
        project=project,
        region=region,
        address_type="EXTERNAL",
        network_tier="PREMIUM",
        description="duplexops TURN relay (coturn) of this region: UDP 3478 and TLS 5349",
        labels=dict(labels),
        opts=opts,
    )
