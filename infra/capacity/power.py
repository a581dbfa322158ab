"""Power, heat and monthly cost of a fleet of nodes.

- GPU power under load = TDP x load fraction (data-sheet TDP, ``gpus.py``).
- Host power (CPU, memory, NVMe, NIC, fans) is an assumption, default 150 W for a single-socket 1U/2U host
  under load; wall power divides by the PSU efficiency (0.92, 80 PLUS Platinum at half load).
- Heat: 1 W = 3.412 BTU/h.
- Month = 730 hours (GCP's billing convention). Cloud cost = on-demand price of the machine type x 730 x
  nodes; on-premises, only the electricity (assumed $/kWh) is counted, not the hardware.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from .gcp import MachineType
from .gpus import GpuSpec

BTU_PER_H_PER_W = 3.412
HOURS_PER_MONTH = 730.0
DEFAULT_HOST_W = 150.0
DEFAULT_PSU_EFFICIENCY = 0.92
DEFAULT_USD_PER_KWH = 0.12
"""Electricity price for on-premises nodes (USD per kWh): assumption, override it."""


class PowerPlan(BaseModel):
    """Power, heat and cost: per node, then for ``nodes`` nodes (W, BTU/h, USD)."""

    model_config = ConfigDict(frozen=True)

    gpu_w: float
    host_w: float
    node_wall_w: float
    node_btu_h: float
    nodes: int
    fleet_wall_w: float
    fleet_btu_h: float
    fleet_kwh_month: float
    machine_type: str | None
    usd_per_hour_node: float | None
    price_source: str | None
    price_read_on: str | None
    cloud_usd_month: float | None
    electricity_usd_month: float


def power_plan(
    gpu: GpuSpec,
    nodes: int = 1,
    *,
    machine_type: MachineType | None = None,
    gpus_per_node: int = 1,
    gpu_load: float = 1.0,
    host_w: float = DEFAULT_HOST_W,
    psu_efficiency: float = DEFAULT_PSU_EFFICIENCY,
    usd_per_kwh: float = DEFAULT_USD_PER_KWH,
) -> PowerPlan:
    """Power, heat and monthly cost of ``nodes`` nodes with ``gpus_per_node`` x ``gpu`` each."""
    gpu_w = gpu.tdp_w * gpu_load * gpus_per_node
    wall = (gpu_w + host_w) / psu_efficiency
    fleet = wall * nodes
    kwh = fleet * HOURS_PER_MONTH / 1000
    price = machine_type.price if machine_type else None
    return PowerPlan(
        gpu_w=gpu_w,
        host_w=host_w,
        node_wall_w=wall,
        node_btu_h=wall * BTU_PER_H_PER_W,
        nodes=nodes,
        fleet_wall_w=fleet,
        fleet_btu_h=fleet * BTU_PER_H_PER_W,
        fleet_kwh_month=kwh,
        machine_type=machine_type.name if machine_type else None,
        usd_per_hour_node=price.usd_per_hour if price else None,
        price_source=price.source if price else None,
        price_read_on=price.read_on if price else None,
        cloud_usd_month=price.usd_per_hour * HOURS_PER_MONTH * nodes if price else None,
        electricity_usd_month=kwh * usd_per_kwh,
    )
