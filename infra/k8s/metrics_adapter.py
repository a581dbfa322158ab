"""Google's Custom Metrics Stackdriver Adapter: serves Cloud Monitoring metrics, Google Managed Prometheus's
among them, to the HorizontalPodAutoscaler through the ``custom.metrics.k8s.io`` and
``external.metrics.k8s.io`` APIs.

The objects follow Google's published manifest
``custom-metrics-stackdriver-adapter/deploy/production/adapter_new_resource_model.yaml`` of
GoogleCloudPlatform/k8s-stackdriver (read from the code index at the version that deploys
``custom-metrics-stackdriver-adapter:v0.15.1-gke.0``): the ``custom-metrics`` namespace, the adapter's
ServiceAccount, its RBAC (``system:auth-delegator``, ``extension-apiserver-authentication-reader`` in
kube-system, ``custom-metrics-resource-reader`` on pods, nodes and nodes/stats, ``external-metrics-reader``
for the HPA controller), the Deployment (``/adapter --use-new-resource-model=true
--fallback-for-container-metrics=true``), a Service on 443 and three APIService objects. Changes from the
manifest: the ServiceAccount is annotated for Workload Identity with ``monitoring_service_account``
(``roles/monitoring.viewer``); the image is pulled IfNotPresent (it is pinned); the pod has the RuntimeDefault
seccomp profile; ``metadata.namespace`` is not set on the ClusterRole (cluster-scoped objects have none).
"""

from __future__ import annotations

from typing import Any

from infra.k8s.base import RegionWorkload

__all__ = [
    "ADAPTER_IMAGE",
    "ADAPTER_NAME",
    "ADAPTER_NAMESPACE",
    "adapter_objects",
]

ADAPTER_NAMESPACE = "custom-metrics"
ADAPTER_NAME = "custom-metrics-stackdriver-adapter"
"""The adapter's namespace and name (ServiceAccount, Deployment, Service), as in Google's manifest."""

ADAPTER_IMAGE = "gcr.io/gke-release/custom-metrics-stackdriver-adapter:v0.15.1-gke.0"
"""The image of Google's ``adapter_new_resource_model.yaml`` at the version read (module docstring)."""

_LABELS = {"run": ADAPTER_NAME, "k8s-app": ADAPTER_NAME}
_RBAC = "rbac.authorization.k8s.io"
_ADAPTER_SUBJECT = {"kind": "ServiceAccount", "name": ADAPTER_NAME, "namespace": ADAPTER_NAMESPACE}


def _binding(
    name: str, role: str, *, namespace: str | None = None, subject: dict[str, str] | None = None
) -> dict[str, Any]:
    """ClusterRoleBinding ``name`` of ClusterRole ``role`` or, with ``namespace``, RoleBinding ``name`` there
    of Role ``role``; its one subject is the adapter's ServiceAccount unless ``subject`` says otherwise."""
    metadata = {"name": name} if namespace is None else {"name": name, "namespace": namespace}
    return {
        "apiVersion": f"{_RBAC}/v1",
        "kind": "ClusterRoleBinding" if namespace is None else "RoleBinding",
        "metadata": metadata,
        "roleRef": {"apiGroup": _RBAC, "kind": "ClusterRole" if namespace is None else "Role", "name": role},
        "subjects": [dict(_ADAPTER_SUBJECT if subject is None else subject)],
    }


def _cluster_role(name: str, api_group: str, resources: list[str], verbs: list[str]) -> dict[str, Any]:
    """ClusterRole ``name`` with one rule: ``verbs`` on ``resources`` of ``api_group``."""
    return {
        "apiVersion": f"{_RBAC}/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [{"apiGroups": [api_group], "resources": resources, "verbs": verbs}],
    }


def _api_service(group: str, version: str, version_priority: int) -> dict[str, Any]:
    return {
        "apiVersion": "apiregistration.k8s.io/v1",
        "kind": "APIService",
        "metadata": {"name": f"{version}.{group}"},
        "spec": {
            "insecureSkipTLSVerify": True,
            "group": group,
            "groupPriorityMinimum": 100,
            "versionPriority": version_priority,
            "service": {"name": ADAPTER_NAME, "namespace": ADAPTER_NAMESPACE},
            "version": version,
        },
    }


def adapter_objects(workload: RegionWorkload) -> list[dict[str, Any]]:
    """The adapter's objects in apply order: Namespace, ServiceAccount (Workload Identity:
    ``monitoring_service_account``), ClusterRoleBinding to ``system:auth-delegator``, RoleBinding to
    ``extension-apiserver-authentication-reader`` (kube-system), ClusterRole and ClusterRoleBinding
    ``custom-metrics-resource-reader``, Deployment (1 replica; requests = limits = 250m CPU and 400 MiB, as
    Google's manifest), Service (443), the APIServices ``v1beta1.custom.metrics.k8s.io``,
    ``v1beta2.custom.metrics.k8s.io`` and ``v1beta1.external.metrics.k8s.io``, and ClusterRole and
    ClusterRoleBinding ``external-metrics-reader`` (for the HPA controller's ServiceAccount)."""
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ADAPTER_NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {
                "name": ADAPTER_NAME,
                "namespace": ADAPTER_NAMESPACE,
                "annotations": {"iam.gke.io/gcp-service-account": workload.monitoring_service_account},
            },
        },
        _binding("custom-metrics:system:auth-delegator", "system:auth-delegator"),
        _binding(
            "custom-metrics-auth-reader", "extension-apiserver-authentication-reader", namespace="kube-system"
        ),
        _cluster_role(
            "custom-metrics-resource-reader", "", ["pods", "nodes", "nodes/stats"], ["get", "list", "watch"]
        ),
        _binding("custom-metrics-resource-reader", "custom-metrics-resource-reader"),
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": ADAPTER_NAME, "namespace": ADAPTER_NAMESPACE, "labels": dict(_LABELS)},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": dict(_LABELS)},
                "template": {
                    "metadata": {"labels": {**_LABELS, "kubernetes.io/cluster-service": "true"}},
                    "spec": {
                        "serviceAccountName": ADAPTER_NAME,
                        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                        "containers": [
                            {
                                "name": "pod-custom-metrics-stackdriver-adapter",
                                "image": ADAPTER_IMAGE,
                                "imagePullPolicy": "IfNotPresent",
                                "command": [
                                    "/adapter",
                                    "--use-new-resource-model=true",
                                    "--fallback-for-container-metrics=true",
                                ],
                                "resources": {
                                    "limits": {"cpu": "250m", "memory": "400Mi"},
                                    "requests": {"cpu": "250m", "memory": "400Mi"},
                                },
                            }
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": ADAPTER_NAME,
                "namespace": ADAPTER_NAMESPACE,
                "labels": {
                    **_LABELS,
                    "kubernetes.io/cluster-service": "true",
                    "kubernetes.io/name": "Adapter",
                },
            },
            "spec": {
                "type": "ClusterIP",
                "selector": dict(_LABELS),
                "ports": [{"port": 443, "protocol": "TCP", "targetPort": 443}],
            },
        },
        _api_service("custom.metrics.k8s.io", "v1beta1", 100),
        _api_service("custom.metrics.k8s.io", "v1beta2", 200),
        _api_service("external.metrics.k8s.io", "v1beta1", 100),
        _cluster_role("external-metrics-reader", "external.metrics.k8s.io", ["*"], ["list", "get", "watch"]),
        _binding(
            "external-metrics-reader",
            "external-metrics-reader",
            subject={
                "kind": "ServiceAccount",
                "name": "horizontal-pod-autoscaler",
                "namespace": "kube-system",
            },
        ),
    ]
