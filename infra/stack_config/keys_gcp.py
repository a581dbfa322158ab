"""The GCP rules of the stack's keys, read from the capacity planner's catalog (``infra.capacity.gcp``):
which profiles' GPUs GCP offers, the stack's GPU as validated so far, and a multi-region item's GPU and
machine type (one GPU per node) turned into its ``RegionSettings``. Kept apart as the functions
``make mutation`` mutates (docs/mutation.md). docs/stack-configuration.md.
"""

from __future__ import annotations

from pydantic import ValidationInfo

from infra.capacity import gcp as gcp_catalog
from infra.node.profile.profiles import PROFILES, NodeProfile
from infra.stack_config.keys_common import _compose_profiles
from infra.stack_config.keys_regions import RegionKeys
from infra.stack_config.settings import RegionSettings
from infra.stack_config.values import problem


def _gcp_profiles() -> list[str]:
    return [p for p in _compose_profiles() if PROFILES[p].gpu in gcp_catalog.GCP_GPUS]


def _profile_gpu(info: ValidationInfo) -> str | None:
    """The GPU of the stack's profile (its ``gpu`` override first), from the fields validated so far."""
    gpu = info.data.get("gpu")
    if gpu is None and info.data.get("profile") in PROFILES:
        gpu = PROFILES[info.data["profile"]].gpu
    return gpu


def _not_on_gcp(gpu: str) -> str | None:
    """Why ``gpu`` cannot be a region's GPU (it is not offered on GCP), or None."""
    if gpu in gcp_catalog.GCP_GPUS:
        return None
    return f"{gpu!r} is not offered on GCP (on-premises only); allowed: " + ", ".join(
        sorted(gcp_catalog.GCP_GPUS)
    )


def _region_settings(item: RegionKeys, position: int, profile: NodeProfile) -> RegionSettings:
    """The region's settings for ``profile`` (already carrying the region's GPU).

    Raises:
        PydanticCustomError: the GPU is not on GCP, or the machine type cannot carry it alone.
    """
    at = f"[{position}]"
    gpu = profile.gpu or ""
    if why := _not_on_gcp(gpu):
        raise problem(why, where=f"{at}.gpu")
    name = item.machine_type or gcp_catalog.DEFAULT_MACHINE_TYPE[gpu]
    if name not in gcp_catalog.MACHINE_TYPES:
        raise problem(
            f"unknown machine type {name!r}; allowed: " + ", ".join(gcp_catalog.machine_types_for(gpu)),
            where=f"{at}.machineType",
        )
    if why := gcp_catalog.carry_problem(name, gpu):
        raise problem(
            f"{why}; allowed: {', '.join(gcp_catalog.machine_types_for(gpu))}", where=f"{at}.machineType"
        )
    machine = gcp_catalog.MACHINE_TYPES[name]
    if machine.gpu_count[0] != 1:
        singles = [
            m for m in gcp_catalog.machine_types_for(gpu) if gcp_catalog.MACHINE_TYPES[m].gpu_count[0] == 1
        ]
        raise problem(
            f"{name!r} has {machine.gpu_count[0]} GPUs; allowed: a one-GPU type (one runtime pod per GPU "
            f"node): {', '.join(singles)}",
            where=f"{at}.machineType",
        )
    return RegionSettings(
        region=item.region,
        zones=item.zones,
        profile=profile,
        machine_type=machine.name,
        accelerator_type=gcp_catalog.ACCELERATOR_TYPES[gpu],
        accelerator_count=1,
        min_nodes=item.min_nodes,
        max_nodes=item.max_nodes,
        redis_memory_gb=item.redis_memory_gb,
        network_index=position if item.network_index is None else item.network_index,
        serving=item.serving,
        usd_per_hour=machine.price.usd_per_hour if machine.price else None,
        price_source=machine.price.source if machine.price else None,
    )
