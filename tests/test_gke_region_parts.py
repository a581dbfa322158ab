"""``GkeRegion`` built from its parts (``infra.components.gke_parts``) without replacing anything: every
cloud resource that moved under a part carries an alias to the region component it was declared under,
with its own name and type, so the engine finds it under the URN it had (no delete and create of a
cluster, a Memorystore instance or a bucket on the next ``pulumi up``)."""

from __future__ import annotations

from typing import Any

import pytest
from pulumi.runtime import mocks
from pulumi_harness import StackRun, run_stack

PARTS = (
    "RegionNetwork",
    "RegionAccounts",
    "RegionCluster",
    "RegionNodePools",
    "RegionRedis",
    "RegionModelBucket",
)


def _run_recording(**overrides: Any) -> tuple[StackRun, dict[tuple[str, str], Any]]:
    """The multi-region stack's run (``overrides`` of its configuration), and each resource's registration
    request (its parent, aliases, ``protect``)."""
    requests: dict[tuple[str, str], Any] = {}
    original = mocks.MockMonitor.RegisterResource

    def record(self: mocks.MockMonitor, request: Any) -> Any:
        requests[(request.type, request.name)] = request
        return original(self, request)

    mocks.MockMonitor.RegisterResource = record  # type: ignore[method-assign]
    try:
        run = run_stack("multi-region", overrides=overrides)
    finally:
        mocks.MockMonitor.RegisterResource = original  # type: ignore[method-assign]
    return run, requests


@pytest.fixture(scope="module")
def registered() -> tuple[StackRun, dict[tuple[str, str], Any]]:
    """The multi-region stack's run, and each resource's registration request."""
    return _run_recording()


def test_each_region_has_its_parts(registered: tuple[StackRun, dict]) -> None:
    run, _ = registered
    for region in ("us-central1", "europe-west4"):
        parts = [r for r in run.resources if r.type.rsplit(":", 1)[-1] in PARTS and region in r.name]
        assert sorted(r.type.rsplit(":", 1)[-1] for r in parts) == sorted(PARTS)
        assert all(r.parent_types == ["duplexops:components:GkeRegion"] for r in parts)


def test_every_moved_resource_keeps_the_urn_it_had(registered: tuple[StackRun, dict]) -> None:
    run, requests = registered
    regions = {r.name: r.urn for r in run.of_type("duplexops:components:GkeRegion")}
    moved = [
        r for r in run.resources if r.custom and r.parent_types[-1:] and r.parent_types[-1].endswith(PARTS)
    ]
    assert len(moved) >= 2 * 20, [r.name for r in moved]
    for resource in moved:
        region = next(name for name in regions if resource.name.startswith(name + "-"))
        # pulumi-gcp adds type aliases of its own to some resources (old spellings, parentUrn unset).
        [alias] = [a for a in requests[(resource.type, resource.name)].aliases if a.spec.parentUrn]
        assert alias.spec.parentUrn == regions[region], resource.name
        assert (alias.spec.name, alias.spec.type) == ("", ""), "same name and type as before"
    kinds = {r.type for r in moved}
    assert {
        "gcp:container/cluster:Cluster",
        "gcp:redis/instance:Instance",
        "gcp:storage/bucket:Bucket",
    } <= kinds


def test_resources_left_under_the_region_have_no_alias(registered: tuple[StackRun, dict]) -> None:
    run, requests = registered
    direct = [r for r in run.resources if r.custom and r.parent_types == ["duplexops:components:GkeRegion"]]
    assert {r.type for r in direct} == {
        "pulumi:providers:kubernetes",
        "gcp:serviceaccount/iAMMember:IAMMember",
    }
    assert all(not [a for a in requests[(r.type, r.name)].aliases if a.spec.parentUrn] for r in direct)


PROTECTED = {
    "gcp:redis/instance:Instance": 2,
    "gcp:storage/bucket:Bucket": 2,
    "gcp:artifactregistry/repository:Repository": 1,
    "gcp:compute/globalAddress:GlobalAddress": 1,
    "gcp:compute/address:Address": 2,
}
"""Stateful or global resources ``protect``ed while ``deletionProtection`` is on (the default stack): both
regions' Memorystore and model buckets, the second region's repository (the first is the image
component's), the global IP the domain points at, each region's TURN address (``turn-<region>``'s A
record points at it)."""


def _protected(requests: dict[tuple[str, str], Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for (typ, _), request in requests.items():
        if request.protect:
            counts[typ] = counts.get(typ, 0) + 1
    return counts


def test_stateful_and_global_resources_are_protected(registered: tuple[StackRun, dict]) -> None:
    """Issue 20 item 19: nothing was ``protect``ed: a ``pulumi destroy`` or an accidental replacement
    deleted Memorystore (sessions), the model buckets (16 GB each), the registry and the static IP (the
    domain's A record). With ``deletionProtection`` on they are protected, and nothing else is."""
    _, requests = registered
    assert _protected(requests) == PROTECTED


def test_deletion_protection_off_protects_nothing() -> None:
    """``deletionProtection: false`` (to destroy the stack) lifts the protection too."""
    _, requests = _run_recording(**{"duplexops:deletionProtection": False})
    assert _protected(requests) == {}
