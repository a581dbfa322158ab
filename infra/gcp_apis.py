"""Which Google API each resource and feature of the stacks needs (what a fresh project must enable first).

A resource created before its API is enabled fails with ``SERVICE_DISABLED`` (HTTP 403) on a first
``pulumi up``; mocks accept anything, so the policy pack's ``apis-enabled-for-features`` rule and the
stacks' tests check every declared resource against :func:`required_apis`.

Two APIs come before any program: ``projects.Service`` calls Service Usage, and it and every
``projects.IAMMember`` call Cloud Resource Manager, so neither can be enabled by the program that needs it
(terraform-provider-google #6101, #11435: 403 ``SERVICE_DISABLED`` on a fresh project). They are
:data:`STEP_0_APIS`, enabled once per project by :data:`STEP_0_COMMAND`
(docs/deploying.md, "Step 0 and the bootstrap project"), and a stack must not declare them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "API_BY_TYPE",
    "API_BY_TYPE_PREFIX",
    "FEATURE_APIS",
    "SERVICE_TYPE",
    "STEP_0_APIS",
    "STEP_0_COMMAND",
    "required_apis",
    "step_0_command",
]

SERVICE_TYPE = "gcp:projects/service:Service"
"""The resource that enables an API in a project (``pulumi_gcp.projects.Service``)."""

API_BY_TYPE_PREFIX: dict[str, str] = {
    "gcp:compute/": "compute.googleapis.com",
    "gcp:container/": "container.googleapis.com",
    "gcp:redis/": "redis.googleapis.com",
    "gcp:artifactregistry/": "artifactregistry.googleapis.com",
    "gcp:secretmanager/": "secretmanager.googleapis.com",
    "gcp:serviceaccount/": "iam.googleapis.com",
    "gcp:storage/": "storage.googleapis.com",
    "gcp:projects/": "cloudresourcemanager.googleapis.com",
    "gcp:iam/": "iam.googleapis.com",
    "gcp:cloudscheduler/": "cloudscheduler.googleapis.com",
    "gcp:dns/": "dns.googleapis.com",
    "gcp:monitoring/": "monitoring.googleapis.com",
}
"""The API behind each provider module (the module's REST API: cloud.google.com/<product>/docs/reference).
``gcp:projects/`` (project IAM bindings, services) reads and writes the project's IAM policy through Cloud
Resource Manager (``projects.getIamPolicy``/``setIamPolicy``), a step-0 API; ``gcp:iam/`` (workload
identity pools and providers) is the IAM API's."""

API_BY_TYPE: dict[str, str] = {
    SERVICE_TYPE: "serviceusage.googleapis.com",
}
"""APIs of single resource types beyond their module's: enabling a service is a Service Usage call
(``services.enable``, cloud.google.com/service-usage/docs/reference/rest)."""

STEP_0_APIS: tuple[str, ...] = ("cloudresourcemanager.googleapis.com", "serviceusage.googleapis.com")
"""APIs no program can enable for itself (the calls that enable APIs need them): enabled by hand once per
project (:data:`STEP_0_COMMAND`), never declared as a ``projects.Service``."""

STEP_0_COMMAND = "gcloud services enable " + " ".join(STEP_0_APIS) + " --project {project}"
"""The step-0 command (``{project}``: the project id), run once by a project owner (``gcloud`` needs no
API of the project enabled to make this call)."""


def step_0_command(project: str = "<project>") -> str:
    """The step-0 command for ``project`` (a project id)."""
    return STEP_0_COMMAND.format(project=project)


def _enabled(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("enabled") is True


def _node_configs(props: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    config = props.get("nodeConfig")
    return [config] if isinstance(config, Mapping) else []


def _image_streaming(props: Mapping[str, Any]) -> bool:
    return any(_enabled(c.get("gcfsConfig")) for c in _node_configs(props))


def _managed_prometheus(props: Mapping[str, Any]) -> bool:
    monitoring = props.get("monitoringConfig")
    return isinstance(monitoring, Mapping) and _enabled(monitoring.get("managedPrometheus"))


def _gke_logging(props: Mapping[str, Any]) -> bool:
    return isinstance(props.get("loggingConfig"), Mapping)


FEATURE_APIS: tuple[tuple[str, str, str, Callable[[Mapping[str, Any]], bool]], ...] = (
    (
        "gcp:container/nodePool:NodePool",
        "image streaming (nodeConfig.gcfsConfig)",
        "containerfilesystem.googleapis.com",
        _image_streaming,
    ),
    (
        "gcp:container/cluster:Cluster",
        "Google Managed Prometheus (monitoringConfig.managedPrometheus)",
        "monitoring.googleapis.com",
        _managed_prometheus,
    ),
    ("gcp:container/cluster:Cluster", "GKE logging (loggingConfig)", "logging.googleapis.com", _gke_logging),
)
"""``(resource type, feature, API, whether the resource's inputs use the feature)``: features that need an
API of their own beyond the module's. Image streaming needs the Container File System API
(cloud.google.com/kubernetes-engine/docs/how-to/image-streaming, "Before you begin"); managed collection
writes to Cloud Monitoring and GKE's logs to Cloud Logging
(cloud.google.com/stackdriver/docs/managed-prometheus/setup-managed)."""


def required_apis(resource_type: str, props: Mapping[str, Any]) -> dict[str, str]:
    """The APIs a resource needs, ``{api: why}``, from its type token and camelCase inputs ``props``
    (step-0 APIs included: :data:`STEP_0_APIS` says which of them no program enables).

    >>> required_apis("gcp:container/nodePool:NodePool", {"nodeConfig": {"gcfsConfig": {"enabled": True}}})
    {'container.googleapis.com': 'gcp:container/ resources', 'containerfilesystem.googleapis.com': 'image streaming (nodeConfig.gcfsConfig)'}
    """  # noqa: E501
    needed: dict[str, str] = {}
    for prefix, api in API_BY_TYPE_PREFIX.items():
        if resource_type.startswith(prefix):
            needed[api] = f"{prefix} resources"
    if resource_type in API_BY_TYPE:
        needed.setdefault(API_BY_TYPE[resource_type], resource_type)
    for typ, feature, api, uses_feature in FEATURE_APIS:
        if typ == resource_type and uses_feature(props):
            needed.setdefault(api, feature)
    return needed
