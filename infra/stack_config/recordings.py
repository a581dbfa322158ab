"""``duplexops:recordings`` of the multi-region stack: whether the runtime records sessions whose callers
consented (into the region's bucket: ``infra.components.recording_bucket``), and how long transcripts and
recordings are kept. docs/deploying.md, "Recordings (multi-region)"; docs/sessions-api.md, "Recording".
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from infra.node.profile.profiles import NodeProfile
from infra.stack_config.values import Boolean, allowed, problem

__all__ = ["MAX_RETENTION_DAYS", "RecordingsKeys", "retention_days"]

MAX_RETENTION_DAYS = 3650
"""The longest retention the key takes (days): ten years, as the profile's Prometheus retention."""


def retention_days(profile: NodeProfile) -> int:
    """The profile's transcript retention (``retention.transcript_ttl_hours``) in whole days, rounded up:
    the age (days) of the recordings bucket's lifecycle rule, which then never deletes a recording before
    the runtime's own sweep would (GCS counts an object's age in days since its creation:
    cloud.google.com/storage/docs/lifecycle, "Age")."""
    return max(1, math.ceil(profile.retention.transcript_ttl_hours / 24))


class RecordingsKeys(BaseModel):
    """``duplexops:recordings``: ``enabled`` (default false) and ``retentionDays`` (1-3650; default: the
    profile's transcript retention). The retention is one for transcripts and recordings: the API cannot
    serve a recording of a session Redis has forgotten, so it sets the profile's
    ``retention.transcript_ttl_hours`` (``DUPLEX_TRANSCRIPT_TTL_S``) and the bucket's lifecycle rule."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel)

    enabled: Boolean = False
    retention_days: int | None = Field(
        None,
        ge=1,
        le=MAX_RETENTION_DAYS,
        strict=True,
        json_schema_extra=allowed(f"a whole number of days, 1-{MAX_RETENTION_DAYS}"),
    )

    @model_validator(mode="after")
    def _retention_needs_recordings(self) -> RecordingsKeys:
        if self.retention_days is not None and not self.enabled:
            raise problem(
                f"{self.retention_days} is set but enabled is not true, so nothing would be recorded; "
                "allowed: enabled: true with it, or leave retentionDays out (transcripts then keep the "
                "profile's retention.transcript_ttl_hours)",
                where=".retentionDays",
            )
        return self

    def profile_overrides(self, base: NodeProfile) -> dict[str, object]:
        """The profile overrides these keys make on ``base``: ``retention`` with ``transcript_ttl_hours`` =
        24 x ``retentionDays`` (the whole section: a nested override replaces it), or none."""
        if self.retention_days is None:
            return {}
        return {
            "retention": {**base.retention.model_dump(), "transcript_ttl_hours": 24 * self.retention_days}
        }
