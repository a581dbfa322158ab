"""The items of the multi-region topology's structured keys: ``RegionKeys`` (one item of
``duplexops:regions``: its zones, node bounds, GPU, machine type) and ``MaintenanceWindowKeys``
(``duplexops:maintenanceWindow``, held to GKE's rule). docs/stack-configuration.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from infra.names import REGION_RE, ZONE_RE
from infra.stack_config.settings import MaintenanceWindow
from infra.stack_config.values import allowed, problem

__all__ = ["MIN_WINDOW_HOURS_PER_32_DAYS", "WEEKDAYS", "MaintenanceWindowKeys", "RegionKeys"]


class RegionKeys(BaseModel):
    """One item of ``duplexops:regions`` (camelCase keys: ``region``, ``zones``, ``minNodes``...)."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel)

    region: str = Field(
        pattern=REGION_RE.pattern, json_schema_extra=allowed("a GCP region such as us-central1")
    )
    zones: tuple[str, ...] = Field(min_length=1, json_schema_extra=allowed("a non-empty list of zones"))
    gpu: str | None = None
    machine_type: str | None = None
    min_nodes: int = Field(1, ge=1, le=100)
    max_nodes: int = Field(4, ge=1, le=100)
    redis_memory_gb: int = Field(1, ge=1, le=300)
    network_index: int | None = Field(None, ge=0, le=31)
    """0-31; None: the item's position in the list."""
    serving: bool = Field(True, strict=True)

    @field_validator("zones")
    @classmethod
    def _zones_in_region(cls, zones: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        region = info.data.get("region")
        if region is None:
            return zones
        for zone in zones:
            if not ZONE_RE.match(zone) or not zone.startswith(region + "-"):
                raise problem(f"{zone!r} is not a zone of {region}; allowed: {region}-a, {region}-b, ...")
        if len(set(zones)) != len(zones):
            raise problem(f"{list(zones)!r} names a zone twice; allowed: each zone once")
        return zones

    @model_validator(mode="after")
    def _bounds(self) -> RegionKeys:
        if self.min_nodes > self.max_nodes:
            raise problem(
                f"{self.min_nodes} is above maxNodes {self.max_nodes}; allowed: minNodes <= maxNodes",
                where=".minNodes",
            )
        # GKE's NEG controller makes a zone's NEG only once a runtime pod runs there (kubernetes/ingress-gce
        # issue 1755, PR 3152), and the global backend service lists one NEG per zone: every zone listed
        # must always hold a pod (the runtime spreads over the zones: infra.k8s.workload).
        if self.min_nodes < len(self.zones):
            raise problem(
                f"{self.min_nodes} is below the number of zones ({len(self.zones)}: "
                f"{', '.join(self.zones)}); allowed: minNodes >= the number of zones (one runtime pod in "
                "every zone, so that GKE creates the load balancer's NEG there), or fewer zones",
                where=".minNodes",
            )
        return self


WEEKDAYS = ("MO", "TU", "WE", "TH", "FR", "SA", "SU")
"""RFC 5545 weekdays (the maintenance window's ``days``)."""
MIN_WINDOW_HOURS_PER_32_DAYS = 48
"""GKE's rule for a maintenance window: at least 48 h available in any rolling 32 days, each occurrence 4 h
or more (cloud.google.com/kubernetes-engine/docs/concepts/maintenance-windows-and-exclusions)."""


class MaintenanceWindowKeys(BaseModel):
    """``duplexops:maintenanceWindow``: ``start`` (``HH:MM``, UTC), ``hours`` (4-24), ``days`` (weekdays
    ``MO``..``SU``); weekly. Default: Saturday and Sunday, 02:00-08:00 UTC (54 h or more in 32 days)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: str = Field(
        "02:00", pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$", json_schema_extra=allowed("HH:MM, UTC")
    )
    hours: int = Field(6, ge=4, le=24)
    days: tuple[Literal["MO", "TU", "WE", "TH", "FR", "SA", "SU"], ...] = Field(("SA", "SU"), min_length=1)

    @model_validator(mode="after")
    def _enough(self) -> MaintenanceWindowKeys:
        if len(set(self.days)) != len(self.days):
            raise problem(f"{list(self.days)!r} names a day twice; allowed: each day once", where=".days")
        # A weekday recurs at least 4 times in any 32 days.
        least = 4 * len(self.days) * self.hours
        if least < MIN_WINDOW_HOURS_PER_32_DAYS:
            raise problem(
                f"{len(self.days)} day(s) x {self.hours} h gives {least} h in 32 days; allowed: at least "
                f"{MIN_WINDOW_HOURS_PER_32_DAYS} h (GKE's rule): more days or more hours",
                where=".hours",
            )
        return self

    def settings(self) -> MaintenanceWindow:
        """The validated window."""
        days = tuple(sorted(self.days, key=WEEKDAYS.index))
        return MaintenanceWindow(start=self.start, hours=self.hours, days=days)
