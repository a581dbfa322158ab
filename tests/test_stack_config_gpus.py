"""Multi-region stack configuration: each region's machine type must be able to carry that region's GPU
(issue 25). GCP's rules (cloud.google.com/compute/docs/gpus; ``infra/capacity/gcp.py``): a T4 is attached
to N1 types only; an L4 comes with G2 types, an A100 40 GB with ``a2-highgpu-*``, an A100 80 GB with
``a2-ultragpu-*``, an H100 with A3 (``a3-highgpu-*``). The single-node path has its own test
(``tests/test_stacks_single_node.py``); these go through ``duplexops:regions`` and
``infra.stack_config.parse_stack_config``, as the multi-region program does at start."""

from __future__ import annotations

import pytest
from pulumi_harness import stack_config

from infra.stack_config import StackConfigError, parse_stack_config

K = "duplexops:"
STACK = "multi-region"


def _parse(regions: list[dict[str, object]], profile: str = "t4-int8"):  # type: ignore[no-untyped-def]
    """The multi-region stack file with ``regions`` and ``profile`` (t4-int8: personaplex-7b at INT8 with
    the planner's session count, which fits every GCP GPU, so that only the machine types are at stake)."""
    values, secret_keys = stack_config(STACK, overrides={K + "regions": regions, K + "profile": profile})
    return parse_stack_config(values, stack=STACK, secret_keys=set(secret_keys))


def _region(name: str, gpu: str | None, machine_type: str) -> dict[str, object]:
    item: dict[str, object] = {"region": name, "zones": [f"{name}-a"], "machineType": machine_type}
    if gpu is not None:
        item["gpu"] = gpu
    return item


def test_a_region_whose_machine_type_cannot_carry_its_gpu_is_refused_naming_both() -> None:
    """Three regions: us-central1 fine (the profile's T4 on n1-standard-8), europe-west4 an A100 80 GB on
    n1-standard-8 (N1 takes only T4s), asia-southeast1 the profile's T4 on g2-standard-8 (G2 carries only
    its L4). Both bad regions are refused at once, each line naming the region's item, the machine type,
    the GPU and the types that would carry it; the good region draws no line.

    Planted bug: ``_region_settings`` (infra.stack_config.keys_gcp) without its ``carry_problem`` check (the
    multi-region check removed) — fails on it (the configuration is accepted)."""
    regions = [
        _region("us-central1", None, "n1-standard-8"),
        _region("europe-west4", "a100-80gb-sxm", "n1-standard-8"),
        _region("asia-southeast1", None, "g2-standard-8"),
    ]
    with pytest.raises(StackConfigError) as caught:
        _parse(regions)
    assert caught.value.problems == [
        "duplexops:regions[1].machineType: n1-standard-8 (N1) cannot carry a100-80gb-sxm: on GCP A100 80 GB "
        "comes only with a2-ultragpu-* types; allowed: a2-ultragpu-1g",
        "duplexops:regions[2].machineType: g2-standard-8 (G2) cannot carry t4: on GCP T4 comes only with N1 "
        "types (attached); allowed: n1-standard-4, n1-standard-8, n1-standard-16",
    ]


@pytest.mark.parametrize(
    ("gpu", "machine_type", "family"),
    [
        ("l4", "n1-standard-8", "N1"),
        ("a100-40gb", "a2-ultragpu-1g", "A2"),
        ("a100-80gb-sxm", "a2-highgpu-1g", "A2"),
        ("h100", "g2-standard-8", "G2"),
        ("t4", "a3-highgpu-1g", "A3"),
    ],
)
def test_each_wrong_pairing_in_a_second_region_is_refused(gpu: str, machine_type: str, family: str) -> None:
    """A second region (europe-west4) pairing a GPU with a type of another family is refused with a line
    for that region naming the type, its family and the GPU; the first region is fine.

    Planted bug: the multi-region ``carry_problem`` check removed from ``_region_settings`` — fails on it."""
    regions = [_region("us-central1", None, "n1-standard-8"), _region("europe-west4", gpu, machine_type)]
    with pytest.raises(StackConfigError) as caught:
        _parse(regions)
    [line] = caught.value.problems
    assert line.startswith(
        f"duplexops:regions[1].machineType: {machine_type} ({family}) cannot carry {gpu}: "
    )


def test_regions_with_carrying_machine_types_are_accepted() -> None:
    """Every GCP GPU on a type that carries it, one per region: accepted, each region keeping its machine
    type and its GPU's accelerator.

    Planted bug: ``MultiRegionKeys._settings`` dropping a region's ``gpu`` (every region's machine type
    checked against the profile's T4) — fails on it (the good configuration is refused)."""
    pairs = [
        ("us-central1", None, "n1-standard-8", "t4", "nvidia-tesla-t4"),
        ("europe-west4", "l4", "g2-standard-8", "l4", "nvidia-l4"),
        ("us-east4", "a100-40gb", "a2-highgpu-1g", "a100-40gb", "nvidia-tesla-a100"),
        ("us-east5", "a100-80gb-sxm", "a2-ultragpu-1g", "a100-80gb-sxm", "nvidia-a100-80gb"),
        ("asia-southeast1", "h100", "a3-highgpu-1g", "h100", "nvidia-h100-80gb"),
    ]
    config = _parse([_region(name, gpu, machine) for name, gpu, machine, _, _ in pairs])
    assert config.multi_region is not None
    got = [(r.region, r.machine_type, r.profile.gpu, r.accelerator_type) for r in config.multi_region.regions]
    assert got == [(name, machine, gpu, accel) for name, _, machine, gpu, accel in pairs]
