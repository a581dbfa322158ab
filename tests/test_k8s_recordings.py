"""The recordings bucket's pieces one by one: the runtime pod's volume, mount and settings
(``infra.k8s.recordings``, validated against the Kubernetes schemas), the bucket's lifecycle rule
(``infra.components.recording_bucket``), the retention the stack key carries (``infra.stack_config``) and the
policy pack's two bucket rules (``infra.policy.rules.storage``)."""

from __future__ import annotations

from typing import Any

import pytest
from k8s_fixtures import make_workload, one

from infra.components.recording_bucket import lifecycle_rules
from infra.k8s.manifest import validate_manifests
from infra.k8s.recordings import RECORDINGS_MOUNT, RECORDINGS_SWEEP_S
from infra.k8s.region import region_objects
from infra.node.profile.profiles import get_profile
from infra.policy.rules import BUCKET, UNKNOWN, bucket_private, check_resources, recordings_bucket_retention
from infra.stack_config.recordings import RecordingsKeys, retention_days
from runtime.config import RuntimeConfig

RECORDINGS_BUCKET = "duplex-recordings-us-central1"


def _runtime(objects: list[dict]) -> tuple[dict, dict]:
    deployment = one(objects, "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return deployment["spec"]["template"]["spec"], container


def test_a_recording_region_mounts_its_bucket_where_the_runtime_records() -> None:
    objects = region_objects(make_workload(recordings_bucket=RECORDINGS_BUCKET))
    assert validate_manifests(objects) == []
    pod, container = _runtime(objects)
    [volume] = [v for v in pod["volumes"] if v["name"] == "recordings"]
    assert volume["csi"]["volumeAttributes"]["bucketName"] == RECORDINGS_BUCKET
    assert volume["csi"]["readOnly"] is False
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DUPLEX_RECORDING_DIR"] == RECORDINGS_MOUNT
    assert [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "recordings"] == [
        RECORDINGS_MOUNT
    ]
    # The runtime takes these settings as they are rendered.
    config = RuntimeConfig(
        recording_dir=env["DUPLEX_RECORDING_DIR"], recording_sweep_s=env["DUPLEX_RECORDING_SWEEP_S"]
    )
    assert str(config.recording_dir) == RECORDINGS_MOUNT and config.recording_sweep_s == RECORDINGS_SWEEP_S
    # Only the runtime container mounts it: the init container and other pods do not.
    assert all(m["name"] != "recordings" for c in pod["initContainers"] for m in c.get("volumeMounts", []))
    others = [
        o for o in objects if o["kind"] in ("Deployment", "Job") and o["metadata"]["name"] != "duplex-runtime"
    ]
    assert others and all(
        "recordings" not in str(o["spec"]["template"]["spec"].get("volumes")) for o in others
    )


def test_a_region_without_recordings_has_neither_volume_nor_setting() -> None:
    pod, container = _runtime(region_objects(make_workload()))
    assert "recordings" not in {v["name"] for v in pod["volumes"]}
    assert "DUPLEX_RECORDING_DIR" not in {e["name"] for e in container["env"]}


@pytest.mark.parametrize("bad", ["Recordings", "a", "gs://duplex-recordings", "x" * 64])
def test_a_bad_bucket_name_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="recordings_bucket.*Cloud Storage bucket name"):
        make_workload(recordings_bucket=bad)


def test_lifecycle_rule_and_retention_days() -> None:
    assert lifecycle_rules(30) == [{"action": {"type": "Delete"}, "condition": {"age": 30}}]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="a whole number of days"):
            lifecycle_rules(bad)  # type: ignore[arg-type]
    # Rounded up, so the backstop never deletes before the runtime's own retention.
    base = get_profile("a100-80gb")
    assert retention_days(base) == 7  # 168 h
    for hours, days in ((1, 1), (24, 1), (25, 2)):
        profile = get_profile(
            "a100-80gb", retention={**base.retention.model_dump(), "transcript_ttl_hours": hours}
        )
        assert retention_days(profile) == days
    keys = RecordingsKeys.model_validate({"enabled": True, "retentionDays": 3})
    assert keys.profile_overrides(base) == {
        "retention": {**base.retention.model_dump(), "transcript_ttl_hours": 72}
    }
    assert RecordingsKeys.model_validate({"enabled": True}).profile_overrides(base) == {}


# --- the policy rules -------------------------------------------------------------------------------------

GOOD = {
    "uniformBucketLevelAccess": True,
    "publicAccessPrevention": "enforced",
    "labels": {"duplex-data": "recordings", "region": "us-central1"},
    "lifecycleRules": [{"action": {"type": "Delete"}, "condition": {"age": 7.0}}],
    "versioning": {"enabled": False},
    "softDeletePolicy": {"retentionDurationSeconds": 0},
}


def test_a_compliant_recordings_bucket_and_a_plain_private_bucket_pass() -> None:
    models = {"uniform_bucket_level_access": True, "public_access_prevention": "enforced", "labels": {}}
    assert check_resources([(BUCKET, GOOD, "recordings"), (BUCKET, models, "models")]) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"uniformBucketLevelAccess": None}, "uniformBucketLevelAccess is not set (default false)"),
        ({"uniformBucketLevelAccess": False}, "uniformBucketLevelAccess is False"),
        ({"publicAccessPrevention": None}, "publicAccessPrevention is not set (default inherited)"),
        ({"publicAccessPrevention": "inherited"}, 'publicAccessPrevention is "inherited"'),
    ],
)
def test_every_bucket_must_be_private(change: dict[str, Any], expected: str) -> None:
    props = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    [message] = bucket_private(BUCKET, props)
    assert message.startswith(expected)
    assert bucket_private(BUCKET, {**props, "labels": {}}) == [message]  # any bucket, not only recordings


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"lifecycleRules": None}, "lifecycleRules has no rule deleting objects by age"),
        (
            {"lifecycleRules": [{"action": {"type": "SetStorageClass"}, "condition": {"age": 7}}]},
            "no rule deleting",
        ),
        (
            {"lifecycleRules": [{"action": {"type": "Delete"}, "condition": {"numNewerVersions": 1}}]},
            "no rule deleting",
        ),
        ({"lifecycleRules": [{"action": {"type": "Delete"}, "condition": {"age": 0}}]}, "no rule deleting"),
        ({"versioning": {"enabled": True}}, "versioning.enabled is true"),
        (
            {"softDeletePolicy": None},
            "softDeletePolicy.retentionDurationSeconds is not set (default 604800 s",
        ),
        ({"softDeletePolicy": {"retentionDurationSeconds": 604800}}, "retentionDurationSeconds is 604800"),
    ],
)
def test_a_recordings_bucket_must_expire_and_forget(change: dict[str, Any], expected: str) -> None:
    props = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    [message] = recordings_bucket_retention(BUCKET, props)
    assert expected in message
    assert recordings_bucket_retention(BUCKET, {**props, "labels": {"duplex-data": "models"}}) == []


def test_unknown_values_pass_until_they_are_known() -> None:
    for key in ("uniformBucketLevelAccess", "publicAccessPrevention"):
        assert bucket_private(BUCKET, {**GOOD, key: UNKNOWN}) == []
    for change in (
        {"labels": UNKNOWN},
        {"lifecycleRules": UNKNOWN},
        {"lifecycleRules": [{"action": {"type": "Delete"}, "condition": {"age": UNKNOWN}}]},
        {"softDeletePolicy": UNKNOWN},
        {"softDeletePolicy": {"retentionDurationSeconds": UNKNOWN}},
    ):
        assert recordings_bucket_retention(BUCKET, {**GOOD, **change}) == [], change
    assert bucket_private("gcp:compute/network:Network", {}) == []
