"""One region's Kubernetes objects put together: every object in apply order (``region_objects``), the
Workload Identity bindings they need, and the operator commands the stack prints. It sits above the
builders (``workload``, ``prefetch``, ``scaling``, ``page``, ``metrics_adapter``, ``monitoring``), which
never import it. docs/deploying.md, "Stack multi-region"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra.k8s.base import (
    DEFAULT_NAMESPACE,
    RUNTIME_SERVICE_ACCOUNT,
    SECRET_KEYS,
    SECRET_NAME,
    WEIGHTS_SERVICE_ACCOUNT,
    RegionWorkload,
)
from infra.k8s.disruption import deletion_cost_rbac, with_deletion_cost
from infra.k8s.metrics_adapter import ADAPTER_NAME, ADAPTER_NAMESPACE, adapter_objects
from infra.k8s.monitoring import (
    FRONTEND_NAME,
    GRAFANA_NAME,
    GRAFANA_SECRET,
    GRAFANA_SECRET_KEY,
    monitoring_objects,
)
from infra.k8s.page import page_objects
from infra.k8s.prefetch import weights_job, weights_service_account
from infra.k8s.resume_router import router_objects
from infra.k8s.scaling import horizontal_pod_autoscaler
from infra.k8s.turn import turn_objects
from infra.k8s.workload import (
    namespace,
    pod_disruption_budget,
    redis_ca_configmap,
    runtime_deployment,
    runtime_secret,
    runtime_service,
    runtime_service_account,
)

__all__ = [
    "APPLY_FIRST",
    "apply_rank",
    "grafana_password_command",
    "grafana_port_forward",
    "region_objects",
    "token_keys_command",
    "workload_identity_bindings",
]

APPLY_FIRST = (
    "Namespace",
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "NetworkPolicy",
)
"""Kinds applied before all others, in this order (everything else keeps the builders' order): the one
apply order, of ``region_objects`` and of ``infra.components.regional_runtime`` (where every later object
depends on the objects of these kinds). NetworkPolicy among them: the coturn pods start fenced
(``infra.k8s.turn.turn_egress_policy``), never before their policy exists."""


def apply_rank(obj: Mapping[str, Any]) -> int:
    """Sort key of the apply order: the kind's place in ``APPLY_FIRST``, after them everything else."""
    kind = obj["kind"]
    return APPLY_FIRST.index(kind) if kind in APPLY_FIRST else len(APPLY_FIRST)


def region_objects(workload: RegionWorkload) -> list[dict[str, Any]]:
    """Every Kubernetes object of one region, in apply order: the runtime's (``workload``), the weights
    Job's (``prefetch``), the autoscaler (``scaling``), the browser client's (``page``), the Custom Metrics
    Stackdriver Adapter's (``metrics_adapter``), the monitoring ones (``monitoring``), with a TURN
    secret the TURN gateway's (``turn``) and with a resume router's NEG name the router's and the runtime's
    headless Service (``resume_router``), stably sorted so
    that the kinds of ``APPLY_FIRST`` come first, in that order.

    Raises:
        ValueError: two objects with the same kind, namespace and name.
    """
    objects = [
        namespace(workload),
        runtime_service_account(workload),
        weights_service_account(workload),
        runtime_secret(workload),
        redis_ca_configmap(workload),
        weights_job(workload),
        with_deletion_cost(runtime_deployment(workload)),
        *deletion_cost_rbac(workload),
        runtime_service(workload),
        pod_disruption_budget(workload),
        horizontal_pod_autoscaler(workload),
        *page_objects(workload),
        *adapter_objects(workload),
        *monitoring_objects(workload),
        *turn_objects(workload),
        *router_objects(workload),
    ]
    seen: set[tuple[str, str, str]] = set()
    for obj in objects:
        key = _key(obj)
        if key in seen:
            raise ValueError(f"region_objects: two objects {'/'.join(key)}")
        seen.add(key)
    return sorted(objects, key=apply_rank)


def _key(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    metadata = obj.get("metadata") or {}
    return (str(obj.get("kind")), str(metadata.get("namespace", "")), str(metadata.get("name")))


def workload_identity_bindings(namespace: str = DEFAULT_NAMESPACE) -> tuple[tuple[str, str, str], ...]:
    """The Kubernetes service accounts that act as the region's Google service accounts under Workload
    Identity, as ``(role, namespace, Kubernetes service account)``, role = the Google account
    (``runtime``, ``weights``, ``monitoring``; ``infra.components.gke_region.GkeRegion``). Two share
    ``monitoring``: the GMP query frontend (in ``namespace``) and the Custom Metrics Stackdriver Adapter
    (in ``custom-metrics``)."""

    return (
        ("runtime", namespace, RUNTIME_SERVICE_ACCOUNT),
        ("weights", namespace, WEIGHTS_SERVICE_ACCOUNT),
        ("monitoring", namespace, FRONTEND_NAME),
        ("monitoring", ADAPTER_NAMESPACE, ADAPTER_NAME),
    )


def grafana_port_forward(workload: RegionWorkload) -> str:
    """The command that opens the region's Grafana on http://localhost:3000 (after ``gcloud container
    clusters get-credentials``): ``kubectl -n <ns> port-forward svc/grafana 3000:<port>``."""

    port = workload.profile.ports.grafana
    return f"kubectl -n {workload.namespace} port-forward svc/{GRAFANA_NAME} 3000:{port}"


def grafana_password_command(namespace: str = DEFAULT_NAMESPACE) -> str:
    """The command that prints Grafana's admin password from its Secret (user ``admin``)."""

    return (
        f"kubectl -n {namespace} get secret {GRAFANA_SECRET} "
        f"-o jsonpath='{{.data.{GRAFANA_SECRET_KEY}}}' | base64 -d"
    )


def token_keys_command(namespace: str = DEFAULT_NAMESPACE) -> str:
    """The command that prints the session-token signing keys (JSON) from the runtime's Secret."""
    key = SECRET_KEYS["token_keys"].replace(".", "\\.")
    return f"kubectl -n {namespace} get secret {SECRET_NAME} -o jsonpath='{{.data.{key}}}' | base64 -d"
