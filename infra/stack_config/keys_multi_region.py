"""The keys of the ``multi-region`` topology: ``MultiRegionKeys`` (one GKE cluster per region behind one
global load balancer: the regions, source ranges, maintenance window, TURN over TLS, recordings, the
waiting room), each region's profile and settings checked item by item. docs/stack-configuration.md.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from infra.names import PROJECT_ID_RE
from infra.node.profile.profiles import PROFILES, get_profile
from infra.stack_config.keys_common import _DNS_ZONE, _check_bundle, _Keys
from infra.stack_config.keys_gcp import _not_on_gcp, _region_settings
from infra.stack_config.keys_regions import MaintenanceWindowKeys, RegionKeys
from infra.stack_config.recordings import RecordingsKeys, retention_days
from infra.stack_config.settings import (
    NAMESPACE,
    PLACEHOLDER_IMAGE,
    MultiRegionSettings,
    RecordingSettings,
    RegionSettings,
)
from infra.stack_config.values import CIDRS, Boolean, CidrList, allowed, json_value, problems, pulumi_key

__all__ = ["WAITING_ROOM_S", "MultiRegionKeys"]


WAITING_ROOM_S = 30
"""``waitingRoomS``'s default (s): how long a multi-region caller waits for a slot when every pod it reaches
is full (issue 33), about one turn of a conversation elsewhere ending; the runtime's own default is 0."""


_TURN_TLS_SECRET_ALLOWED = (
    "the name of a kubernetes.io/tls Secret (lower case letters, digits, '-'; at most 63) in namespace "
    "duplex of every region's cluster, holding the certificate of turn-<region>.<domain> (e.g. a "
    "cert-manager Certificate's secretName: docs/deploying.md, TURN over TLS in the regions); or leave it "
    "unset for TURN over UDP only"
)


_REGIONS_EXAMPLE = (
    '[{"region": "us-central1", "zones": ["us-central1-a"], "minNodes": 1, "maxNodes": 4}, ...]'
)


class MultiRegionKeys(_Keys):
    """``multi-region``: one GKE cluster per region behind one global HTTPS load balancer. Memorystore makes
    each region's Redis AUTH string (no ``redisPassword``); ``domain`` is required (the managed
    certificate is for it)."""

    topology_name: ClassVar[str] = "multi-region"

    domain: str = Field(
        json_schema_extra=allowed("the DNS name of the global endpoint (its managed certificate is for it)")
    )
    gcp_project: str = Field(
        alias="gcp:project",
        pattern=PROJECT_ID_RE.pattern,
        json_schema_extra=allowed("a Google Cloud project id (6-30 lower case letters, digits, '-')"),
    )
    regions: Annotated[tuple[RegionKeys, ...], BeforeValidator(json_value)] = Field(
        min_length=1, json_schema_extra=allowed(f"a list of regions, e.g. {_REGIONS_EXAMPLE}")
    )
    public_source_ranges: CidrList = Field(json_schema_extra=allowed(CIDRS))
    admin_source_ranges: CidrList = Field(json_schema_extra=allowed(CIDRS))
    release_channel: Literal["RAPID", "REGULAR", "STABLE"] = "REGULAR"
    deletion_protection: Boolean = True
    system_machine_type: str = Field(
        "e2-standard-4",
        pattern=r"^[a-z][a-z0-9]*-[a-z]+-[0-9]+$",
        json_schema_extra=allowed("a GCE machine type such as e2-standard-4"),
    )
    enable_apis: Boolean = True
    maintenance_window: Annotated[MaintenanceWindowKeys, BeforeValidator(json_value)] = (
        MaintenanceWindowKeys.model_validate({})  # the defaults: Saturday and Sunday, 02:00-08:00 UTC
    )
    dns_zone: str | None = _DNS_ZONE
    # An existing kubernetes.io/tls Secret in each region's runtime namespace: TURN over TLS (infra.k8s.turn).
    turn_tls_secret: str | None = Field(
        None,
        pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
        json_schema_extra=allowed(_TURN_TLS_SECRET_ALLOWED),
    )
    # Recording with consent into each region's bucket, and the retention of transcripts and recordings.
    recordings: Annotated[RecordingsKeys, BeforeValidator(json_value)] = RecordingsKeys.model_validate({})
    # The pods' waiting room (issue 33): at capacity a caller waits for a slot (a phone caller hears the hold
    # tone) instead of a 503; 0 turns it off. Size: callers that may wait per pod (unset: the pod's slots).
    waiting_room_s: int = Field(
        WAITING_ROOM_S, ge=0, le=3600, json_schema_extra=allowed("seconds, 0-3600 (0: no waiting room)")
    )
    waiting_room_size: int | None = Field(
        None, ge=1, le=4096, json_schema_extra=allowed("callers per pod, 1-4096 (unset: the pod's slots)")
    )

    def _overrides(self) -> dict[str, Any]:
        return {**super()._overrides(), **self.recordings.profile_overrides(PROFILES[self.profile])}

    @field_validator("regions")
    @classmethod
    def _each_once(cls, regions: tuple[RegionKeys, ...]) -> tuple[RegionKeys, ...]:
        found: list[tuple[str, str]] = []
        for what, values in (
            ("region", [r.region for r in regions]),
            (
                "networkIndex",
                [i if r.network_index is None else r.network_index for i, r in enumerate(regions)],
            ),
        ):
            first: dict[Any, int] = {}
            for i, value in enumerate(values):
                if value in first:
                    found.append(
                        (
                            f"[{i}].{what}",
                            f"{value!r} is already used by regions[{first[value]}]; "
                            f"allowed: each {what} once",
                        )
                    )
                first.setdefault(value, i)
        if found:
            raise problems(found)
        return regions

    @model_validator(mode="after")
    def _settings(self, info: ValidationInfo) -> MultiRegionKeys:
        overrides = self._overrides()
        profile = self._profile(overrides)
        regions: list[RegionSettings] = []
        found: list[tuple[str, str]] = []
        if self.turn_tls_secret is not None and not profile.relay.enabled:
            found.append(
                (
                    pulumi_key("turn_tls_secret"),
                    f"set, but profile {profile.name!r} runs no TURN relay (relay.enabled is false); "
                    "allowed: unset it",
                )
            )
        for i, item in enumerate(self.regions):
            where = f"{pulumi_key('regions')}[{i}]"
            region_overrides = {**overrides, **({"gpu": item.gpu} if item.gpu is not None else {})}
            # The GPU first: a profile built for a GPU the region cannot have would only add noise (its
            # first-audio budget checked against a GPU that will never run it).
            if item.gpu is not None and (why := _not_on_gcp(item.gpu)):
                found.append((f"{where}.gpu", why))
                continue
            try:
                region_profile = get_profile(
                    self.profile, **{**region_overrides, "runtime_image": PLACEHOLDER_IMAGE}
                )
            except ValidationError as exc:
                for error in exc.errors():
                    message = str(error.get("msg", error)).removeprefix("Value error, ")
                    found.append((where, f"profile {self.profile!r} is not valid in this region: {message}"))
                continue
            try:
                regions.append(_region_settings(item, i, region_profile))
                _check_bundle(region_profile)
            except PydanticCustomError as error:
                found += [
                    (p if p.startswith(f"{NAMESPACE}:") else f"{pulumi_key('regions')}{p}", m)
                    for p, m in error.context["problems"]  # type: ignore[index]
                ]
        if found:
            raise problems(found)
        settings = MultiRegionSettings(
            project=self.gcp_project,
            regions=tuple(regions),
            public_source_ranges=self.public_source_ranges,
            admin_source_ranges=self.admin_source_ranges,
            release_channel=self.release_channel,
            deletion_protection=self.deletion_protection,
            system_machine_type=self.system_machine_type,
            enable_apis=self.enable_apis,
            maintenance_window=self.maintenance_window.settings(),
            dns_zone=self.dns_zone,
            turn_tls_secret=self.turn_tls_secret,
            waiting_room_s=self.waiting_room_s,
            waiting_room_size=profile.sessions if self.waiting_room_size is None else self.waiting_room_size,
            recordings=RecordingSettings(
                enabled=self.recordings.enabled, retention_days=retention_days(profile)
            ),
        )
        self._result = self._config(info, profile, overrides, multi_region=settings)
        return self
