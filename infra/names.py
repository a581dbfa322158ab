"""Names of Google Cloud and GKE, one source for the stack configuration (``infra.stack_config``), the
components, the Kubernetes objects (``infra.k8s``) and the policy pack: what a project id, a region and a
zone look like, and the taint GKE puts on GPU nodes. docs/deploying.md.
"""

from __future__ import annotations

import re

__all__ = [
    "GPU_TAINT",
    "GPU_TAINT_KEY",
    "PROJECT_ID_RE",
    "RECORDINGS_LABEL",
    "REGION_RE",
    "SYSTEM_POOL",
    "ZONE_RE",
]

PROJECT_ID_RE = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
"""A Google Cloud project id: 6-30 lower-case letters, digits and '-', starting with a letter, not ending
with '-' (cloud.google.com/resource-manager/docs/creating-managing-projects, "Project ID")."""

REGION_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
"""A region such as ``us-central1`` or ``europe-west4`` (cloud.google.com/compute/docs/regions-zones)."""

ZONE_RE = re.compile(r"^([a-z]+-[a-z]+[0-9]+)-[a-z]$")
"""A zone such as ``us-central1-a``: its region, '-', one letter (group 1 is the region)."""

GPU_TAINT_KEY = "nvidia.com/gpu"
GPU_TAINT = {"key": GPU_TAINT_KEY, "value": "present", "effect": "NO_SCHEDULE"}
"""The taint of GKE GPU nodes (``nvidia.com/gpu=present:NoSchedule``, GKE's API spelling of the effect):
only pods that tolerate it land there (cloud.google.com/kubernetes-engine/docs/how-to/gpus, "GKE adds
taints to GPU nodes"). The GPU pool sets it, the runtime's pods tolerate ``GPU_TAINT_KEY``, the policy
pack requires it."""

SYSTEM_POOL = "system"
"""The name of each region's CPU node pool (``infra.components.gke_parts.RegionNodePools``); GKE labels its
nodes ``cloud.google.com/gke-nodepool=system``. coturn runs there (``infra.k8s.turn``), off the GPU pool."""

RECORDINGS_LABEL = ("duplex-data", "recordings")
"""The label (key, value) of a bucket that holds call recordings (``infra.components.recording_bucket``):
the policy pack's ``recordings-bucket-retention`` finds them by it."""
