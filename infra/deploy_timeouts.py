"""The deploy's time limits, derived from one figure: how long the model weights may take to download.

A first deploy (or a new model) downloads the gated weights (about 17 GB for PersonaPlex-7B) before any
runtime turns ready, so every wait above that download must outlast it, each by a margin for what it
waits on besides:

    weights Job deadline  <  Pulumi's create/update timeout  <  the CI deploy job's timeout
                              (+ the clusters and pools of a first multi-region up, + CI's setup)

(tests/test_deploy_timeouts.py checks the order, tests/test_workflows.py that the workflows carry these
values). Were they in the wrong order, the outer wait would give up first and report a timeout for a
download that was about to finish (the old 7,200 s Job under Pulumi's 60 min), or leave a half-applied
update in the stack's state (a CI job killed while ``pulumi up`` runs).

Registry credentials are no limit: CI pushes and copies through gcloud's Docker credential helper, which
mints a fresh access token per request from the job's federated credentials, instead of one ``docker
login`` token that expires after an hour (``.github/workflows/pulumi-up.yml``).
"""

from __future__ import annotations

import math

__all__ = [
    "CI_DEPLOY_JOB_TIMEOUT_MIN",
    "CI_IMAGE_JOB_TIMEOUT_MIN",
    "CI_SETUP_MARGIN_S",
    "FIRST_UP_INFRA_S",
    "GKE_CLUSTER_CREATE_TIMEOUT_S",
    "GKE_NODE_POOL_CREATE_TIMEOUT_S",
    "GITHUB_JOB_TIMEOUT_MAX_MIN",
    "PULUMI_CUSTOM_TIMEOUT",
    "PULUMI_RESOURCE_TIMEOUT_S",
    "ROLLOUT_MARGIN_S",
    "WEIGHTS_DOWNLOAD_BUDGET_S",
    "WEIGHTS_JOB_DEADLINE_S",
]

WEIGHTS_DOWNLOAD_BUDGET_S = 7200
"""How long one download of the weights may take, seconds: about 17 GB (PersonaPlex-7B, its tokenizer and
Mimi) at 2.4 MB/s or better; Hugging Face serves far faster, so this is the slow-mirror / throttled case,
not the expected one."""

WEIGHTS_JOB_DEADLINE_S = WEIGHTS_DOWNLOAD_BUDGET_S
"""The GKE weights Job's ``activeDeadlineSeconds`` (infra/k8s/prefetch.py): the whole budget, across its
retries."""

ROLLOUT_MARGIN_S = 15 * 60
"""What Pulumi waits for after the download, seconds: a pod's scheduling and image pull on a fresh GPU
node, loading the weights onto the GPU, and the readiness probe (minutes each)."""

PULUMI_RESOURCE_TIMEOUT_S = WEIGHTS_JOB_DEADLINE_S + ROLLOUT_MARGIN_S
"""Pulumi's create/update timeout of each runtime object (``CustomTimeouts``), seconds: 8,100 s."""

# A rollout of the runtime (``infra.k8s.disruption``: maxSurge 0, maxUnavailable 1) is a series of steps,
# each up to the old pod's drain + ROLLOUT_MARGIN_S + the startup budget (``rollout_step_s``: 6360 s for a
# 1 h longest session), the Deployment's ``progressDeadlineSeconds``. PULUMI_RESOURCE_TIMEOUT_S outlasts one
# step (tests/test_k8s_disruption.py), so pulumi-kubernetes never gives up before the Deployment itself
# would call a step stuck. A whole rollout of a region at peak is up to ``maxNodes`` steps and outlasts any
# CI job (GitHub's 6 h): pulumi then reports the update as timed out while the Deployment controller
# finishes it (docs/deploying.md, "Rollouts and scale-in").

PULUMI_CUSTOM_TIMEOUT = f"{math.ceil(PULUMI_RESOURCE_TIMEOUT_S / 60)}m"
"""``PULUMI_RESOURCE_TIMEOUT_S`` as Pulumi's duration string (``"135m"``)."""

CI_SETUP_MARGIN_S = 30 * 60
"""What a CI deploy job does besides the waits below, seconds: installing the deploy tools,
authenticating, ``pulumi refresh``, the image copy into each region's repository, the policy pack."""

GKE_CLUSTER_CREATE_TIMEOUT_S = 40 * 60
"""How long pulumi-gcp waits for a GKE cluster's creation before failing it, seconds: the provider's
default create timeout of ``container.Cluster`` (terraform-provider-google ``google_container_cluster``,
"Timeouts": create 40 minutes)."""

GKE_NODE_POOL_CREATE_TIMEOUT_S = 30 * 60
"""The same for a node pool (``google_container_node_pool``, "Timeouts": create 30 minutes)."""

FIRST_UP_INFRA_S = GKE_CLUSTER_CREATE_TIMEOUT_S + GKE_NODE_POOL_CREATE_TIMEOUT_S
"""What a first multi-region ``up`` may wait on before the runtime objects' own wait starts, seconds:
the regions' clusters, then their node pools (created after the cluster; the runtime objects after both;
regions and Memorystore in parallel), each up to the provider's own limit: 4,200 s. A single-node stack's
first ``up`` (a VM, its disk) takes minutes and fits the same job."""

CI_DEPLOY_JOB_TIMEOUT_MIN = math.ceil((PULUMI_RESOURCE_TIMEOUT_S + FIRST_UP_INFRA_S + CI_SETUP_MARGIN_S) / 60)
"""``timeout-minutes`` of a stack's deploy job (.github/workflows/pulumi-up-stack.yml): 235. Before, it
left 30 minutes over the runtime objects' wait for everything else, which a first multi-region ``up``
(two clusters and pools before any runtime object) could outrun: CI then killed ``pulumi up`` half way."""

CI_IMAGE_JOB_TIMEOUT_MIN = 60
"""``timeout-minutes`` of the job that builds and pushes the runtime image once per push: a cold build
(the torch layer, about 3 GB of wheels) takes tens of minutes; the registry cache makes later ones short."""

GITHUB_JOB_TIMEOUT_MAX_MIN = 360
"""GitHub-hosted runners end any job after 6 h (docs.github.com, "Usage limits, billing, and
administration"): every job timeout here stays below it."""
