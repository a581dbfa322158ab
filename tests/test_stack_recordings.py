"""Recordings on the multi-region stack (``duplexops:recordings``) under Pulumi's mocks: one bucket per
region with its settings, the runtime's access scoped to that bucket, the runtime pods mounting it with the
Cloud Storage FUSE CSI driver at ``DUPLEX_RECORDING_DIR`` (manifests validated offline against the
Kubernetes schemas), the retention carried to the runtime and the lifecycle rule, the policy pack, and the
key's errors."""

from __future__ import annotations

import pytest
from pulumi_harness import RecordedResource, StackRun, run_stack

from infra.k8s.recordings import RECORDINGS_MOUNT
from infra.policy.rules import check_resources
from infra.stack_config import StackConfigError

STACK = "multi-region"
BUCKET = "gcp:storage/bucket:Bucket"
BUCKET_MEMBER = "gcp:storage/bucketIAMMember:BucketIAMMember"
PROJECT_MEMBER = "gcp:projects/iAMMember:IAMMember"
ACCOUNT = "gcp:serviceaccount/account:Account"
WI_MEMBER = "gcp:serviceaccount/iAMMember:IAMMember"
REGIONS = ("us-central1", "europe-west4")
RECORDING = {"duplexops:recordings": {"enabled": True, "retentionDays": 30}}


@pytest.fixture(scope="module")
def run() -> StackRun:
    return run_stack(STACK, overrides=RECORDING)


def _recordings_buckets(run: StackRun) -> dict[str, RecordedResource]:
    found = [
        b for b in run.of_type(BUCKET) if (b.plain.get("labels") or {}).get("duplex-data") == "recordings"
    ]
    return {b.plain["labels"]["region"]: b for b in found}


def _bucket_name(bucket: RecordedResource) -> str:
    return str(bucket.state["name"])


def _manifests(run: StackRun, region: str) -> list[dict]:
    from infra.k8s.manifest import to_manifest

    return [
        to_manifest(r.type, r.plain)
        for r in run.resources
        if r.type.startswith("kubernetes:") and r.custom and r.name.startswith(f"runtime-{region}-")
    ]


def _runtime(manifests: list[dict]) -> tuple[dict, dict]:
    [deployment] = [
        m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == "duplex-runtime"
    ]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


def test_each_region_gets_its_own_private_bucket(run: StackRun) -> None:
    buckets = _recordings_buckets(run)
    assert sorted(buckets) == sorted(REGIONS)
    for region, bucket in buckets.items():
        props = bucket.plain
        assert props["location"] == region.upper()
        assert props["uniformBucketLevelAccess"] is True
        assert props["publicAccessPrevention"] == "enforced"
        assert props["versioning"] == {"enabled": False}
        assert props["softDeletePolicy"] == {"retentionDurationSeconds": 0}  # an erase is not restorable
        assert props["lifecycleRules"] == [{"action": {"type": "Delete"}, "condition": {"age": 30}}]
        assert props["forceDestroy"] is False  # deletionProtection: true in the stack file
        # A part of the region's GkeRegion, as its model bucket is.
        assert bucket.parent.endswith(
            f"GkeRegion$duplexops:components:RegionRecordingBucket::region-{region}-recordings"
        )
    assert len({_bucket_name(b) for b in buckets.values()}) == len(REGIONS)


def test_the_runtime_alone_may_use_its_regions_bucket(run: StackRun) -> None:
    """One grant per bucket: ``roles/storage.objectUser`` to that region's runtime service account (the one
    its pods' Kubernetes service account acts as); no project-wide storage role for anyone."""
    buckets = _recordings_buckets(run)
    accounts = {a.plain["accountId"]: a for a in run.of_type(ACCOUNT)}
    for region, bucket in buckets.items():
        grants = [m.plain for m in run.of_type(BUCKET_MEMBER) if m.plain["bucket"] == _bucket_name(bucket)]
        assert len(grants) == 1, grants
        [grant] = grants
        index = REGIONS.index(region)
        runtime = accounts[f"duplex-multi-region-rt-{index}"]
        assert grant["role"] == "roles/storage.objectUser"
        assert grant["member"] == runtime.state["member"]
        # Workload Identity: the runtime pods' Kubernetes service account acts as that account.
        bindings = [
            m.plain
            for m in run.of_type(WI_MEMBER)
            if m.plain["serviceAccountId"] == runtime.state["name"]
            and m.plain["member"].endswith("duplex-runtime]")
        ]
        assert len(bindings) == 1 and bindings[0]["role"] == "roles/iam.workloadIdentityUser"
        [account] = [
            m
            for m in _manifests(run, region)
            if m["kind"] == "ServiceAccount" and m["metadata"]["name"] == "duplex-runtime"
        ]
        assert account["metadata"]["annotations"]["iam.gke.io/gcp-service-account"] == runtime.state["email"]
    assert not [m for m in run.of_type(PROJECT_MEMBER) if "storage" in m.plain["role"]]


@pytest.mark.parametrize("region", REGIONS)
def test_the_pods_start_after_the_grant(run: StackRun, region: str) -> None:
    """The Deployment is created once the runtime may use the bucket: a pod mounting it without the grant
    would fail its mount until IAM caught up."""
    [deployment] = [
        r
        for r in run.of_type("kubernetes:apps/v1:Deployment")
        if r.name == f"runtime-{region}-deployment-duplex-duplex-runtime"
    ]
    [grant] = [
        r for r in run.of_type(BUCKET_MEMBER) if r.name == f"region-{region}-recordings-runtime-object-user"
    ]
    assert grant.urn in run.ordered_after(deployment)


@pytest.mark.parametrize("region", REGIONS)
def test_runtime_pods_mount_the_bucket_where_they_record(run: StackRun, region: str) -> None:
    from infra.k8s.manifest import validate_manifests

    manifests = _manifests(run, region)
    assert validate_manifests(manifests) == []
    deployment, container = _runtime(manifests)
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
    [volume] = [v for v in template["spec"]["volumes"] if v["name"] == "recordings"]
    assert volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io" and volume["csi"]["readOnly"] is False
    attributes = volume["csi"]["volumeAttributes"]
    assert attributes["bucketName"] == _bucket_name(_recordings_buckets(run)[region])
    options = attributes["mountOptions"].split(",")
    assert {"uid=10001", "gid=10001", "file-mode=600", "dir-mode=700"} <= set(options)
    assert "metadata-cache:negative-ttl-secs:0" in options  # another pod's new files are seen at once
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "recordings"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert mount["mountPath"] == env["DUPLEX_RECORDING_DIR"] == RECORDINGS_MOUNT
    assert not mount.get("readOnly")
    assert env["DUPLEX_TRANSCRIPT_TTL_S"] == str(30 * 86400)  # one retention: transcripts and recordings
    assert (
        check_resources([(r.type, r.plain, r.name, r.dependencies) for r in run.resources if r.custom]) == []
    )


def test_outputs_name_each_regions_bucket(run: StackRun) -> None:
    buckets = _recordings_buckets(run)
    for region in REGIONS:
        assert run.outputs["regions"][region]["recordingsBucket"] == _bucket_name(buckets[region])


def test_without_the_key_nothing_is_recorded() -> None:
    """The stack file's default: no recordings bucket, no mount, no DUPLEX_RECORDING_DIR (a token's
    consent then records nothing), the profile's own transcript retention (168 h)."""
    plain = run_stack(STACK)
    assert _recordings_buckets(plain) == {}
    for region in REGIONS:
        deployment, container = _runtime(_manifests(plain, region))
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert "DUPLEX_RECORDING_DIR" not in env and env["DUPLEX_TRANSCRIPT_TTL_S"] == str(168 * 3600)
        assert "recordings" not in {v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert "recordingsBucket" not in plain.outputs["regions"][region]


def test_without_deletion_protection_the_bucket_goes_with_the_stack() -> None:
    """A trial stack (or one being torn down) deletes its recordings with the bucket; the retention
    defaults to the profile's transcript retention, 168 h = 7 days."""
    run = run_stack(
        STACK, overrides={"duplexops:deletionProtection": False, "duplexops:recordings": {"enabled": True}}
    )
    for bucket in _recordings_buckets(run).values():
        assert bucket.plain["forceDestroy"] is True
        assert bucket.plain["lifecycleRules"][0]["condition"]["age"] == 7


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"retentionDays": 30}, "duplexops:recordings.retentionDays: 30 is set but enabled is not true"),
        (
            {"enabled": True, "retentionDays": 0},
            "retentionDays: 0 is not valid; allowed: a whole number of days",
        ),
        (
            {"enabled": True, "retentionDays": 4000},
            "retentionDays: 4000 is not valid; allowed: a whole number",
        ),
        ({"enabled": "maybe"}, "duplexops:recordings.enabled: 'maybe' is not valid; allowed: true, false"),
        (
            {"enabled": True, "days": 3},
            "duplexops:recordings.days: unknown key; allowed keys: enabled, retentionDays",
        ),
    ],
)
def test_recordings_key_errors(value: dict, expected: str) -> None:
    with pytest.raises(StackConfigError) as error:
        run_stack(STACK, overrides={"duplexops:recordings": value})
    assert expected in str(error.value)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        (
            "duplexops:maintenanceWindow",
            {"hour": 5},
            "maintenanceWindow.hour: unknown key; allowed keys: start, hours, days",
        ),
        (
            "duplexops:recordings",
            {"enable": True},
            "recordings.enable: unknown key; allowed keys: enabled, retentionDays",
        ),
        (
            "duplexops:regions",
            [{"region": "us-central1", "zones": ["us-central1-a"], "minNode": 1}],
            "allowed keys: region, zones",
        ),
    ],
)
def test_an_unknown_nested_key_lists_its_own_objects_keys(key: str, value: object, expected: str) -> None:
    """An object key's unknown member names that object's keys (it named the region keys for every object)."""
    import json

    import yaml
    from pulumi_harness import STACKS_DIR

    from infra.stack_config import parse_stack_config

    config = yaml.safe_load((STACKS_DIR / f"Pulumi.{STACK}.yaml").read_text())["config"]
    values = {k: v if isinstance(v, str) else json.dumps(v) for k, v in {**config, key: value}.items()}
    values["duplexops:hfToken"] = "hf_" + "x" * 20
    with pytest.raises(StackConfigError) as error:
        parse_stack_config(values, stack=STACK)
    assert expected in str(error.value)
