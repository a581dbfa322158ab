"""The weights-prefetch Job of one region: the runtime image downloads the profile's Hugging Face
repository once into the region's model bucket (``scripts/prefetch_weights.py``) and marks it complete;
the runtime pods wait for the marker and mount the bucket read-only. docs/deploying.md, "Stack multi-region".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra.deploy_timeouts import WEIGHTS_JOB_DEADLINE_S
from infra.k8s.base import (
    GCSFUSE_ANNOTATIONS,
    MODELS_MOUNT,
    RUNTIME_UID,
    SECRET_KEYS,
    SECRET_NAME,
    WEIGHTS_JOB,
    WEIGHTS_MARKER,
    WEIGHTS_SERVICE_ACCOUNT,
    RegionWorkload,
    container_security,
    gcsfuse_volume,
    object_meta,
    pod_security,
    service_account,
    standard_labels,
    weights_dir,
)

__all__ = [
    "PREFETCH_SCRIPT",
    "WEIGHTS_APP",
    "weights_job",
    "weights_service_account",
]

WEIGHTS_APP = "weights"
"""The ``app.kubernetes.io/name`` label of the weights Job, its pods and its ServiceAccount."""


def weights_service_account(workload: RegionWorkload) -> dict[str, Any]:
    """The weights Job's ServiceAccount, annotated for Workload Identity with ``weights_service_account``
    (the runtime's account when None)."""
    account = workload.weights_service_account or workload.runtime_service_account
    return service_account(workload, WEIGHTS_SERVICE_ACCOUNT, "weights", account, app=WEIGHTS_APP)


PREFETCH_SCRIPT = (Path(__file__).parent / "scripts" / "prefetch_weights.py").read_text()
"""The weights Job's program, ``scripts/prefetch_weights.py`` as text for ``python -c`` (argv: repo, target
directory, marker name): downloads the whole Hugging Face repository into the bucket
(``huggingface_hub.snapshot_download(local_dir=...)``), then writes the marker (JSON: repo, files,
seconds). Idempotent: exits at once when the marker is there."""


def weights_job(workload: RegionWorkload) -> dict[str, Any]:
    """The weights-prefetch Job: the runtime image runs ``PREFETCH_SCRIPT`` on a CPU node (no GPU toleration:
    the GPU pool's taint keeps it off), writing ``/models/<repo>`` on a read-write Cloud Storage FUSE volume
    of ``weights_bucket`` as ``weights_service_account``, then ``WEIGHTS_MARKER``. ``HF_TOKEN`` from the
    Secret when ``hf_token`` is given (gated repositories such as nvidia/personaplex-7b-v1). 4 retries
    (``backoffLimit``), each a fresh pod; ``WEIGHTS_JOB_DEADLINE_S`` at most (``activeDeadlineSeconds``;
    infra/deploy_timeouts.py). Requests 1 CPU and 1 GiB (memory limit 4 GiB): the download streams to the
    bucket."""
    repo = workload.weights_repo
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": "/tmp/huggingface"},
        {"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if workload.hf_token is not None:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": SECRET_KEYS["hf_token"]}},
            }
        )
    container = {
        "name": "download",
        "image": workload.image,
        "command": ["python", "-c", PREFETCH_SCRIPT, repo, weights_dir(workload), WEIGHTS_MARKER],
        "env": env,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "securityContext": container_security(),
        "volumeMounts": [
            {"name": "models", "mountPath": MODELS_MOUNT},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": object_meta(workload, WEIGHTS_JOB, "weights", app=WEIGHTS_APP),
        "spec": {
            "backoffLimit": 4,
            "activeDeadlineSeconds": WEIGHTS_JOB_DEADLINE_S,
            "template": {
                "metadata": {
                    "labels": standard_labels(WEIGHTS_APP, "weights"),
                    "annotations": dict(GCSFUSE_ANNOTATIONS),
                },
                "spec": {
                    "serviceAccountName": WEIGHTS_SERVICE_ACCOUNT,
                    "restartPolicy": "Never",
                    "securityContext": pod_security(RUNTIME_UID),
                    "containers": [container],
                    "volumes": [
                        gcsfuse_volume(workload, read_only=False),
                        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
                    ],
                },
            },
        },
    }
