"""The runtime pod's part of the region's recordings bucket (``infra.components.recording_bucket``): the
bucket as a Cloud Storage FUSE CSI ephemeral volume, mounted read-write at ``RECORDINGS_MOUNT`` in the runtime
container, and the runtime settings that record there (``DUPLEX_RECORDING_DIR``). Present only when the
stack records (``RegionWorkload.recordings_bucket``). docs/sessions-api.md, "Recording".

Mount options (GoogleCloudPlatform/gcsfuse semantics.md; GKE, "Mount Cloud Storage buckets as CSI
ephemeral volumes"):

- ``uid``/``gid`` ``RUNTIME_UID``, ``file-mode=600``, ``dir-mode=700``: the runtime (non-root) owns the
  files, as ``LocalRecordings`` makes its folder 0700 on a node's disk.
- ``metadata-cache:negative-ttl-secs:0``: a name looked up before it existed (a recording another pod had
  not finished, an erase marker) is looked up again next time, not answered "missing" from a cache: the
  download and the erase marker (``runtime.frontend.store.recordings``) see another pod's files at once.
- ``metadata-cache:ttl-secs:60`` (gcsfuse's default, written down): positive entries may live a minute, so
  the sweep's ``stat`` of each file is answered from the listing it just made instead of one request per
  object. A file another pod deleted may look present here for that minute: reading it fails, and an
  erased session's files are refused anyway by its marker, looked up afresh.
- no ``implicit-dirs``: recordings are files at the bucket's root; it would add a list call per lookup.
"""

from __future__ import annotations

from typing import Any

from infra.k8s.base import RUNTIME_UID, RegionWorkload

__all__ = [
    "RECORDINGS_MOUNT",
    "RECORDINGS_SWEEP_S",
    "RECORDINGS_VOLUME",
    "recordings_env",
    "recordings_mount_options",
    "recordings_volume",
    "recordings_volume_mounts",
]

RECORDINGS_MOUNT = "/var/lib/duplex/recordings"
"""Where the runtime container mounts the region's recordings bucket: its ``DUPLEX_RECORDING_DIR``."""

RECORDINGS_VOLUME = "recordings"
"""The pod's volume name of the recordings bucket."""

RECORDINGS_SWEEP_S = 3600
"""``DUPLEX_RECORDING_SWEEP_S`` on the bucket (s): every front-end worker of every pod sweeps the whole
bucket, each sweep a listing of it, so hourly instead of the runtime's default 300 s; a recording is then
deleted at most an hour after its retention (and the bucket's lifecycle rule is the backstop)."""


def recordings_mount_options() -> list[str]:
    """The recordings volume's gcsfuse mount options (the module doc says why each)."""
    return [
        f"uid={RUNTIME_UID}",
        f"gid={RUNTIME_UID}",
        "file-mode=600",
        "dir-mode=700",
        "metadata-cache:ttl-secs:60",
        "metadata-cache:negative-ttl-secs:0",
    ]


def recordings_volume(workload: RegionWorkload) -> list[dict[str, Any]]:
    """The pod's volumes for recordings: the bucket as a read-write CSI ephemeral volume (driver
    ``gcsfuse.csi.storage.gke.io``), or none when the region does not record."""
    if workload.recordings_bucket is None:
        return []
    return [
        {
            "name": RECORDINGS_VOLUME,
            "csi": {
                "driver": "gcsfuse.csi.storage.gke.io",
                "readOnly": False,
                "volumeAttributes": {
                    "bucketName": workload.recordings_bucket,
                    "mountOptions": ",".join(recordings_mount_options()),
                },
            },
        }
    ]


def recordings_volume_mounts(workload: RegionWorkload) -> list[dict[str, Any]]:
    """The runtime container's mount of the recordings volume at ``RECORDINGS_MOUNT``, or none."""
    if workload.recordings_bucket is None:
        return []
    return [{"name": RECORDINGS_VOLUME, "mountPath": RECORDINGS_MOUNT}]


def recordings_env(workload: RegionWorkload) -> list[dict[str, Any]]:
    """The runtime's recording settings: ``DUPLEX_RECORDING_DIR`` = ``RECORDINGS_MOUNT`` and
    ``DUPLEX_RECORDING_SWEEP_S`` = ``RECORDINGS_SWEEP_S``; none when the region does not record (the runtime
    then records nothing, whatever a token's consent says)."""
    if workload.recordings_bucket is None:
        return []
    return [
        {"name": "DUPLEX_RECORDING_DIR", "value": RECORDINGS_MOUNT},
        {"name": "DUPLEX_RECORDING_SWEEP_S", "value": str(RECORDINGS_SWEEP_S)},
    ]
