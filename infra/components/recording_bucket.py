"""``RegionRecordingBucket``: a region's call recordings bucket (multi-region, ``duplexops:recordings``).

The runtime pods of the region mount it with the Cloud Storage FUSE CSI driver at the directory the runtime
records into (``infra.k8s.recordings``), so every pod of the region sees every finished recording and the
sessions API's download and erase no longer depend on which pod answers. No upload code of ours: gcsfuse
writes, renames and deletes objects as files (docs/sessions-api.md, "Recording").

The bucket: in the region, uniform bucket-level access, public access prevention enforced, no versioning and
no soft delete (an erased recording must be gone, not recoverable for 7 days: soft delete's default,
cloud.google.com/storage/docs/soft-delete), a lifecycle rule deleting objects older than the retention (a
backstop to the runtime's own sweep, which keeps the exact retention in seconds), labelled
``RECORDINGS_LABEL``. The runtime's Google service account gets ``roles/storage.objectUser`` on this bucket
alone (create, read, list, delete objects: what a read-write gcsfuse mount needs; no bucket or IAM admin).
``protect``ed, and not ``force_destroy``ed, with the stack's stateful resources; a stack without deletion
protection (a trial, or one being torn down) deletes its recordings with the bucket.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pulumi
import pulumi_gcp.serviceaccount as serviceaccount
import pulumi_gcp.storage as storage

from infra.components._util import COMPONENT_PACKAGE, child_options
from infra.names import RECORDINGS_LABEL

__all__ = ["RECORDINGS_ROLE", "RegionRecordingBucket", "lifecycle_rules"]

RECORDINGS_ROLE = "roles/storage.objectUser"
"""The runtime's role on its region's recordings bucket: read, create, list and delete objects
(cloud.google.com/storage/docs/access-control/iam-roles); GKE's Cloud Storage FUSE CSI driver asks for it
for read-write mounts (cloud.google.com/kubernetes-engine/docs/how-to/cloud-storage-fuse-csi-driver-setup)."""


def lifecycle_rules(retention_days: int) -> list[storage.BucketLifecycleRuleArgsDict]:
    """The bucket's lifecycle: delete an object ``retention_days`` days after its creation (GCS applies it
    within about a day of the object qualifying: a backstop, never earlier than the runtime's sweep).

    Raises:
        ValueError: ``retention_days`` below 1 (``age`` 0 would delete every object at once).
    """
    if isinstance(retention_days, bool) or not isinstance(retention_days, int) or retention_days < 1:
        raise ValueError(f"retention_days {retention_days!r}: allowed: a whole number of days, 1 or more")
    return [{"action": {"type": "Delete"}, "condition": {"age": retention_days}}]


class RegionRecordingBucket(pulumi.ComponentResource):
    """One region's recordings bucket and the runtime's access to it (see the module doc).

    Args:
        name: the component's name (``region-<region>-recordings``); the bucket is ``<name>-bucket``.
        project: the GCP project.
        region: the bucket's location (the region of the pods that mount it).
        writer: the runtime's Google service account (Workload Identity of its pods).
        retention_days: the lifecycle rule's age (days).
        labels: labels of the bucket (``RECORDINGS_LABEL`` added).
        protect: deletion protection: ``protect`` in Pulumi, no ``force_destroy``.
        depends_on: what the bucket waits for (the Storage API).
    """

    bucket: storage.Bucket
    access: storage.BucketIAMMember

    def __init__(
        self,
        name: str,
        *,
        project: str,
        region: str,
        writer: serviceaccount.Account,
        retention_days: int,
        labels: Mapping[str, str],
        protect: bool,
        depends_on: Sequence[pulumi.Resource] = (),
        opts: pulumi.ResourceOptions | None = None,
    ):
        super().__init__(f"{COMPONENT_PACKAGE}:RegionRecordingBucket", name, None, opts)
        key, value = RECORDINGS_LABEL
        self.bucket = storage.Bucket(
            f"{name}-bucket",
            project=project,
            location=region.upper(),
            uniform_bucket_level_access=True,
            public_access_prevention="enforced",
            versioning={"enabled": False},
            soft_delete_policy={"retention_duration_seconds": 0},
            lifecycle_rules=lifecycle_rules(retention_days),
            force_destroy=not protect,
            labels={**labels, key: value},
            opts=child_options(self, depends_on, protect=protect),
        )
        self.access = storage.BucketIAMMember(
            f"{name}-runtime-object-user",
            bucket=self.bucket.name,
            role=RECORDINGS_ROLE,
            member=writer.member,
            opts=child_options(self, depends_on),
        )
        self.register_outputs({"bucket": self.bucket.name})
