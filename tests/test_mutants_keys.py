"""Tests killing mutants of infra/stack_config/keys_gcp.py's GCP functions that the stack configuration tests
let survive (``make mutation MODULE=infra/stack_config/keys_gcp.py``; docs/mutation.md). Each docstring names
the mutants it kills."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from pydantic_core import PydanticCustomError
from test_stack_config_gpus import _parse, _region

from infra.capacity import gcp as gcp_catalog
from infra.node.profile.profiles import PROFILES, NodeProfile
from infra.stack_config import StackConfigError
from infra.stack_config.keys_gcp import _gcp_profiles, _profile_gpu, _region_settings
from infra.stack_config.keys_regions import RegionKeys
from infra.stack_config.settings import RegionSettings

NOT_ON_GCP = (
    "duplexops:regions[0].gpu: 'l40s' is not offered on GCP (on-premises only); allowed: a100-40gb, "
    "a100-80gb-sxm, h100, h200, l4, t4"
)


@pytest.mark.parametrize("gpu, profile", [("l40s", "t4-int8"), (None, "l40s")])
def test_a_region_whose_gpu_is_not_on_gcp_is_refused_by_name(gpu, profile):
    """Kills ``_region_settings``: the refusal's text (``"XX...XX"``, the ``", "`` join of the GPUs GCP
    offers) and its ``where`` (``[i].gpu``): an L40S, set on the region or coming with the profile, is
    named with the GPUs a region may use."""
    with pytest.raises(StackConfigError) as caught:
        _parse([_region("us-central1", gpu, "n1-standard-8")], profile=profile)
    assert caught.value.problems == [NOT_ON_GCP]


# --- direct calls: the functions alone, minimal inputs (no stack file, no bundle) ------------------------


def _item(**keys: object) -> RegionKeys:
    """A region item, validated as the stack file's would be (camelCase keys)."""
    return RegionKeys.model_validate({"region": "us-central1", "zones": ["us-central1-a"], **keys})


def _profile(gpu: str | None) -> NodeProfile:
    """The t4-int8 profile carrying ``gpu`` (only its GPU is read by ``_region_settings``)."""
    return PROFILES["t4-int8"].model_copy(update={"gpu": gpu})


def _refusal(item: RegionKeys, position: int, gpu: str | None) -> list[tuple[str, str]]:
    """The (where, message) lines ``_region_settings`` raises for ``item`` at ``position``."""
    with pytest.raises(PydanticCustomError) as caught:
        _region_settings(item, position, _profile(gpu))
    context = caught.value.context
    assert context is not None
    return [tuple(p) for p in context["problems"]]


def test_gcp_profiles_are_the_compose_profiles_whose_gpu_gcp_offers() -> None:
    """Kills ``_gcp_profiles__mutmut_1`` (``in`` -> ``not in``: the L40S profile named as a GCP one)."""
    assert _gcp_profiles() == ["a100-80gb", "t4-int8"]


@pytest.mark.parametrize(
    "data, gpu",
    [
        ({"gpu": "l4", "profile": "t4-int8"}, "l4"),  # the override wins over the profile's GPU
        ({"profile": "a100-80gb"}, "a100-80gb-sxm"),  # no override: the profile's own GPU
        ({"gpu": None, "profile": "t4-int8"}, "t4"),  # an explicit None is no override
        ({"profile": "no-such-profile"}, None),  # an unknown profile (refused elsewhere) gives no GPU
        ({}, None),  # neither validated yet
    ],
)
def test_profile_gpu_is_the_override_else_the_profiles_gpu(data: dict[str, object], gpu: str | None) -> None:
    """Kills ``_profile_gpu__mutmut_1..5`` (the override's key, ``is None`` / ``and`` / ``in`` inverted, the
    profile's key replaced): the GPU read from the fields validated so far, override first."""
    assert _profile_gpu(SimpleNamespace(data=data)) == gpu  # type: ignore[arg-type]


def test_a_region_without_a_gpu_is_refused_with_an_empty_name_at_its_own_item() -> None:
    """Kills ``_region_settings``: the missing GPU's stand-in (``or ""`` -> ``or "XXXX"``) and the item's
    position in ``where`` (``[{position}]``): a profile with no GPU is named ``''`` at ``[3].gpu``."""
    allowed = ", ".join(sorted(gcp_catalog.GCP_GPUS))
    message = f"'' is not offered on GCP (on-premises only); allowed: {allowed}"
    assert _refusal(_item(), 3, None) == [("[3].gpu", message)]


def test_an_unknown_machine_type_is_refused_naming_the_types_for_the_regions_gpu() -> None:
    """Kills ``_region_settings``: the unknown machine type's refusal (its text, the ``", "`` join of the
    types that carry the GPU, its ``where`` ``[i].machineType``; ``not in`` inverted)."""
    lines = _refusal(_item(machineType="n9-standard-8"), 2, "l4")
    assert lines == [
        (
            "[2].machineType",
            "unknown machine type 'n9-standard-8'; allowed: g2-standard-4, g2-standard-8, g2-standard-16",
        )
    ]


def test_a_type_that_cannot_carry_the_gpu_is_refused_naming_the_types_that_can() -> None:
    """Kills ``_region_settings``: the carry refusal's ``allowed`` list (its ``", "`` join) and ``where``:
    a T4 on g2-standard-8 (G2 carries only its L4)."""
    [(where, message)] = _refusal(_item(machineType="g2-standard-8"), 1, "t4")
    assert where == "[1].machineType"
    assert message.endswith("; allowed: n1-standard-4, n1-standard-8, n1-standard-16")
    assert message.startswith(gcp_catalog.carry_problem("g2-standard-8", "t4") or "<none>")


@pytest.mark.parametrize(
    "gpu, machine_type, count, singles",
    [("a100-40gb", "a2-highgpu-2g", 2, "a2-highgpu-1g"), ("h100", "a3-highgpu-8g", 8, "a3-highgpu-1g")],
)
def test_a_type_with_several_gpus_is_refused_naming_the_one_gpu_types(
    gpu: str, machine_type: str, count: int, singles: str
) -> None:
    """Kills ``_region_settings``: the several-GPU refusal (``gpu_count[0] != 1`` inverted or its index
    changed, the text, the GPU count, the one-GPU types offered (``== 1`` inverted: the several-GPU ones
    named instead), ``where``): one runtime pod per GPU node."""
    assert _refusal(_item(machineType=machine_type), 0, gpu) == [
        (
            "[0].machineType",
            f"{machine_type!r} has {count} GPUs; allowed: a one-GPU type (one runtime pod per GPU node): "
            f"{singles}",
        )
    ]


def test_a_regions_settings_are_derived_field_by_field() -> None:
    """Kills ``_region_settings``: every derived setting of a region (machine type, accelerator type and
    count 1, node bounds, Redis size, network index given, serving, price and its source from the catalog);
    a machine type with several GPU counts (n1: 1, 2, 4) whose first is 1 is accepted."""
    item = _item(machineType="n1-standard-16", minNodes=2, maxNodes=7, redisMemoryGb=5, networkIndex=9)
    settings = _region_settings(item.model_copy(update={"serving": False}), 4, _profile("t4"))
    price = gcp_catalog.MACHINE_TYPES["n1-standard-16"].price
    assert price is not None
    assert settings == RegionSettings(
        region="us-central1",
        zones=("us-central1-a",),
        profile=_profile("t4"),
        machine_type="n1-standard-16",
        accelerator_type="nvidia-tesla-t4",
        accelerator_count=1,
        min_nodes=2,
        max_nodes=7,
        redis_memory_gb=5,
        network_index=9,
        serving=False,
        usd_per_hour=price.usd_per_hour,
        price_source=price.source,
    )
    assert (settings.usd_per_hour, settings.accelerator_count) == (1.11, 1)


def test_a_regions_default_machine_type_and_network_index_come_from_the_gpu_and_position() -> None:
    """Kills ``_region_settings``: the GPU's default machine type (no ``machineType``) and the network
    index taken from the item's position when none is given (``is None`` inverted)."""
    settings = _region_settings(_item(), 6, _profile("a100-80gb-sxm"))
    assert (settings.machine_type, settings.accelerator_type, settings.network_index) == (
        "a2-ultragpu-1g",
        "nvidia-a100-80gb",
        6,
    )
    assert (settings.usd_per_hour, settings.serving) == (5.07, True)


def test_a_machine_type_without_a_price_gives_a_region_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kills ``_region_settings``: a catalog type without a price gives ``usd_per_hour`` and
    ``price_source`` None (``if machine.price`` inverted reads ``None.usd_per_hour``)."""
    unpriced = dataclasses.replace(gcp_catalog.MACHINE_TYPES["n1-standard-8"], price=None)
    monkeypatch.setitem(gcp_catalog.MACHINE_TYPES, "n1-standard-8", unpriced)
    settings = _region_settings(_item(), 0, _profile("t4"))
    assert (settings.machine_type, settings.usd_per_hour, settings.price_source) == (
        "n1-standard-8",
        None,
        None,
    )


def test_the_one_gpu_types_offered_are_each_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kills ``_region_settings__mutmut_47`` (the one-GPU types joined with ``"XX, XX"``): the catalog has
    one one-GPU type per GPU that also has several-GPU types, so a join of one cannot tell; with a second
    one-GPU A2 type (a copy of a2-highgpu-1g under another name) both are named, ``", "``-separated."""
    twin = dataclasses.replace(gcp_catalog.MACHINE_TYPES["a2-highgpu-1g"], name="a2-highgpu-1g-twin")
    monkeypatch.setitem(gcp_catalog.MACHINE_TYPES, twin.name, twin)
    [(_, message)] = _refusal(_item(machineType="a2-highgpu-2g"), 0, "a100-40gb")
    assert message.endswith("(one runtime pod per GPU node): a2-highgpu-1g, a2-highgpu-1g-twin")
