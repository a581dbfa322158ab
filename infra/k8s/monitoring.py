"""Monitoring of one region on Google Managed Prometheus (GMP): ``PodMonitoring`` of the runtime and
redis_exporter (which watches Memorystore over TLS), GPU series from GKE's managed DCGM exporter
(``DCGM_SELECTOR``), the node's alert rules as a ``ClusterRules``
(``infra.node.monitoring.prometheus.alert_rules``,
each query scoped to its cluster), where those alerts go (GMP's managed Alertmanager with the node's
receivers: ``infra.k8s.alerting``), and the tools to look at it: the GMP query frontend and Grafana with the
node's dashboard (reached with ``kubectl port-forward``). docs/deploying.md, "Stack multi-region".
"""

from __future__ import annotations

import posixpath
from typing import Any, TypedDict

from infra.k8s.alerting import alertmanager_secret
from infra.k8s.base import (
    PART_OF,
    REDIS_CA_CONFIGMAP,
    REDIS_CA_DIR,
    REDIS_CA_PATH,
    SECRET_KEYS,
    SECRET_NAME,
    RegionWorkload,
    cluster_ip_service,
    container_security,
    lift,
    object_meta,
    pod_labels,
    pod_security,
    redis_address,
    selector_labels,
    service_account,
    standard_labels,
)
from infra.k8s.turn import TURN_NAME
from infra.node.bundle.compose import GRAFANA_DASHBOARDS_DIR, GRAFANA_PROVISIONING_DIR, GRAFANA_UID, IMAGES
from infra.node.bundle.compose import _grafana as _compose_grafana
from infra.node.monitoring.grafana import dashboard_bytes, datasource_yaml, node_dashboard, provider_yaml
from infra.node.monitoring.prometheus import alert_rules, rules_unit_tests, scrape_interval

__all__ = [
    "AlertSelectors",
    "DCGM_JOB",
    "DCGM_NAMESPACE",
    "DCGM_SELECTOR",
    "FRONTEND_IMAGE",
    "FRONTEND_NAME",
    "GRAFANA_NAME",
    "GRAFANA_SECRET",
    "GRAFANA_SECRET_KEY",
    "REDIS_EXPORTER_NAME",
    "RULE_INTERVAL",
    "RUNTIME_JOB",
    "TARGET_METADATA",
    "alert_rules_unit_tests",
    "alert_selectors",
    "cluster_rules",
    "dashboard_selector",
    "frontend_objects",
    "grafana_objects",
    "monitoring_objects",
    "redis_exporter_objects",
    "rule_groups",
    "runtime_pod_monitoring",
]

RUNTIME_JOB = "runtime"
"""The runtime's PodMonitoring, hence its series' ``job`` label (the node's job name)."""
REDIS_EXPORTER_NAME = "redis-exporter"
"""redis_exporter's Deployment, Service and PodMonitoring (``job`` label), as on the node."""
DCGM_NAMESPACE = "gke-managed-system"
DCGM_JOB = "gke-managed-dcgm-exporter"
DCGM_SELECTOR = f'namespace="{DCGM_NAMESPACE}", job="{DCGM_JOB}"'
"""GKE's managed DCGM exporter's series (cluster ``monitoringConfig`` component ``DCGM``): a DaemonSet in
namespace ``gke-managed-system`` (pods labelled ``app.kubernetes.io/name=gke-managed-dcgm-exporter``)
scraped by GKE's ClusterPodMonitoring ``gke-managed-dcgm-exporter``, hence that namespace and ``job``.
Sources: the code index (public repositories running ``kubectl get clusterpodmonitoring
gke-managed-dcgm-exporter`` and ``kubectl get pods -n gke-managed-system -l
app.kubernetes.io/name=gke-managed-dcgm-exporter`` against GKE clusters); GKE's "Collect and view DCGM
metrics" page says the component installs DCGM-Exporter and a ClusterPodMonitoring."""

TARGET_METADATA = ("pod", "container", "node", "top_level_controller_name", "top_level_controller_type")
"""Pod metadata GMP puts on the PodMonitorings' series: its default (pod, container, top-level controller
name and type; the PodMonitoring CRD) plus ``node`` (the node's alert annotations name it). GMP's managed
collection adds the target labels ``project_id``, ``location``, ``cluster``, ``namespace``, ``job`` (= the
PodMonitoring's name: ``runtime`` and ``redis-exporter``, the node's job names) and ``instance``
(``<pod>:<port>``)."""

RULE_INTERVAL = "30s"
"""Evaluation interval of the ClusterRules groups. Each evaluation is a set of queries against Cloud
Monitoring (quota, cost); 30 s is below every ``for`` of the rules (1 min and more) and keeps a region's
rule load at a few queries per second."""

FRONTEND_NAME = "gmp-frontend"
FRONTEND_IMAGE = "gke.gcr.io/prometheus-engine/frontend:v0.15.3-gke.0"
"""The GMP query frontend's image as GoogleCloudPlatform/prometheus-engine's ``examples/frontend.yaml``
pins it (the version read from the code index)."""
FRONTEND_PORT = 9090

GRAFANA_NAME = "grafana"
GRAFANA_SECRET = "grafana-admin"
GRAFANA_SECRET_KEY = "admin-password"
"""Grafana's Deployment/Service name and the Secret (key) with its admin password."""
_REDIS_EXPORTER_UID = 59000  # the redis_exporter image's user (infra.node.bundle.compose)
_FRONTEND_UID = 1000  # examples/frontend.yaml's runAsUser
# where infra.node.bundle.compose's Grafana environment reads its password file
_SECRETS_MOUNT = "/run/secrets"


class AlertSelectors(TypedDict):
    """``alert_rules``' and ``rules_unit_tests``' selector arguments for a region (``alert_selectors``)."""

    runtime_selector: str
    redis_selector: str
    dcgm_selector: str
    coturn_selector: str | None


def alert_selectors(workload: RegionWorkload) -> AlertSelectors:
    """The label selectors of the node's rules (``alert_rules``/``rules_unit_tests`` keyword arguments):
    ``runtime_selector`` = ``namespace="<ns>", job="runtime"``, ``redis_selector`` =
    ``namespace="<ns>", job="redis-exporter"``, ``dcgm_selector`` = ``DCGM_SELECTOR``, ``coturn_selector`` =
    ``namespace="<ns>", job="coturn"`` (the TURN gateway's PodMonitoring, ``infra.k8s.turn``) where the
    region runs one (a TURN secret), else None (no relay rules). No ``cluster`` matcher: GMP scopes a
    ClusterRules object to its cluster."""
    ns = workload.namespace
    return {
        "runtime_selector": f'namespace="{ns}", job="{RUNTIME_JOB}"',
        "redis_selector": f'namespace="{ns}", job="{REDIS_EXPORTER_NAME}"',
        "dcgm_selector": DCGM_SELECTOR,
        "coturn_selector": f'namespace="{ns}", job="{TURN_NAME}"'
        if workload.turn_secret is not None
        else None,
    }


def dashboard_selector(workload: RegionWorkload) -> str:
    """The Grafana dashboard's selector: this cluster's series (``cluster``, ``location``: the frontend
    queries the whole project, every region) of the runtime's namespace and of GKE's DCGM exporter."""
    return (
        f'cluster="{workload.cluster_name}", location="{workload.region}", '
        f'namespace=~"{workload.namespace}|{DCGM_NAMESPACE}"'
    )


def _monitoring_deployment(
    workload: RegionWorkload,
    name: str,
    *,
    uid: int,
    containers: list[dict[str, Any]],
    volumes: list[dict[str, Any]] | None = None,
    service_account_name: str | None = None,
) -> dict[str, Any]:
    """Deployment ``name`` of a monitoring tool: 1 replica, pods labelled ``standard_labels(name,
    "monitoring")`` (selected on ``selector_labels(name)``), no service links, ``pod_security(uid)`` (the
    image's user), ``containers`` (each with its ``container_security()``), then ``volumes`` and
    ``serviceAccountName`` when given."""
    pod = {
        "serviceAccountName": service_account_name,
        "enableServiceLinks": False,
        "securityContext": pod_security(uid),
        "containers": containers,
        "volumes": volumes,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(workload, name, "monitoring"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector_labels(name)},
            "template": {
                "metadata": {"labels": standard_labels(name, "monitoring")},
                "spec": {key: value for key, value in pod.items() if value is not None},
            },
        },
    }


def _http_probes(path: str, port: str) -> dict[str, Any]:
    """readinessProbe and livenessProbe (3 failures) ``GET path`` on ``port`` every 15 s, 5 s timeout."""
    probe = {"httpGet": {"path": path, "port": port}, "periodSeconds": 15, "timeoutSeconds": 5}
    return {"readinessProbe": probe, "livenessProbe": {**probe, "failureThreshold": 3}}


def _pod_monitoring(
    workload: RegionWorkload, name: str, selector: dict[str, str], port: str
) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.googleapis.com/v1",
        "kind": "PodMonitoring",
        "metadata": object_meta(workload, name, "monitoring"),
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "endpoints": [{"port": port, "path": "/metrics", "interval": scrape_interval(workload.profile)}],
            # GMP's default target labels plus ``node`` (the Kubernetes node), which the node's alert
            # annotations name ("node {{ $labels.node }}").
            "targetLabels": {"metadata": list(TARGET_METADATA)},
        },
    }


def runtime_pod_monitoring(workload: RegionWorkload) -> dict[str, Any]:
    """PodMonitoring ``runtime``: the runtime pods' ``/metrics`` on port ``http``, every
    ``profile.scrape_interval_s`` s."""
    return _pod_monitoring(workload, RUNTIME_JOB, pod_labels(workload), "http")


def redis_exporter_objects(workload: RegionWorkload) -> list[dict[str, Any]]:
    """redis_exporter for Memorystore: Deployment (1 replica, ``IMAGES["redis-exporter"]``, requests 50m CPU
    and 64 MiB, limit 128 MiB; ``REDIS_ADDR`` = ``redis_address(host, port)``, ``REDIS_PASSWORD`` from the
    runtime's Secret, ``REDIS_EXPORTER_TLS_CA_CERT_FILE`` = Memorystore's CA), its ClusterIP Service and
    PodMonitoring ``redis-exporter`` (port ``metrics``, ``profile.ports.redis_exporter``, 9121)."""
    port = workload.profile.ports.redis_exporter
    env = [
        {"name": "REDIS_ADDR", "value": lift(redis_address, workload.redis_host, workload.redis_port)},
        {
            "name": "REDIS_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": SECRET_KEYS["redis_password"]}},
        },
        {"name": "REDIS_EXPORTER_TLS_CA_CERT_FILE", "value": REDIS_CA_PATH},
        {"name": "REDIS_EXPORTER_WEB_LISTEN_ADDRESS", "value": f"0.0.0.0:{port}"},
    ]
    container = {
        "name": "redis-exporter",
        "image": IMAGES["redis-exporter"],
        "env": env,
        "ports": [{"name": "metrics", "containerPort": port, "protocol": "TCP"}],
        **_http_probes("/health", "metrics"),
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "redis-ca", "mountPath": REDIS_CA_DIR, "readOnly": True}],
    }
    return [
        _monitoring_deployment(
            workload,
            REDIS_EXPORTER_NAME,
            uid=_REDIS_EXPORTER_UID,
            containers=[container],
            volumes=[{"name": "redis-ca", "configMap": {"name": REDIS_CA_CONFIGMAP}}],
        ),
        cluster_ip_service(workload, REDIS_EXPORTER_NAME, "monitoring", "metrics", port),
        _pod_monitoring(workload, REDIS_EXPORTER_NAME, selector_labels(REDIS_EXPORTER_NAME), "metrics"),
    ]


def rule_groups(workload: RegionWorkload) -> list[dict[str, Any]]:
    """``alert_rules(profile, **alert_selectors(workload))["groups"]`` with ``interval: RULE_INTERVAL`` on
    every group (GMP's ClusterRules requires it)."""
    groups = alert_rules(workload.profile, **alert_selectors(workload))["groups"]
    return [{"name": g["name"], "interval": RULE_INTERVAL, "rules": g["rules"]} for g in groups]


def cluster_rules(workload: RegionWorkload) -> dict[str, Any]:
    """GMP ``ClusterRules`` ``<namespace>-rules`` (cluster-scoped): the node's recording and alert rules
        (``rule_groups``). GMP's rule-evaluator sends the alerts to the managed Alertmanager, configured with
    the profile's receivers by ``infra.k8s.alerting.alertmanager_secret``."""
    return {
        "apiVersion": "monitoring.googleapis.com/v1",
        "kind": "ClusterRules",
        "metadata": {
            "name": f"{workload.namespace}-rules",
            "labels": {"app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/component": "monitoring"},
        },
        "spec": {"groups": rule_groups(workload)},
    }


def alert_rules_unit_tests(workload: RegionWorkload, rule_file: str = "rules.yml") -> dict[str, Any]:
    """``rules_unit_tests`` (``infra.node.monitoring.prometheus``) for ``alert_selectors(workload)``: a
    ``promtool test
    rules`` document whose ``rule_files`` is ``[rule_file]`` (relative to the test file), to run against
    ``{"groups": rule_groups(workload)}``."""
    return rules_unit_tests(workload.profile, **alert_selectors(workload), rule_file=rule_file)


def frontend_objects(workload: RegionWorkload) -> list[dict[str, Any]]:
    """The GMP query frontend: ServiceAccount ``gmp-frontend`` (Workload Identity:
    ``monitoring_service_account``), Deployment (1 replica, ``FRONTEND_IMAGE``,
    ``--web.listen-address=:9090``, ``--query.project-id=<project>``, probes ``/-/healthy`` and
    ``/-/ready`` as Google's example; requests 50m CPU and 64 MiB, limit 256 MiB) and ClusterIP Service
    ``gmp-frontend:9090``."""
    container = {
        "name": "frontend",
        "image": FRONTEND_IMAGE,
        "args": [f"--web.listen-address=:{FRONTEND_PORT}", f"--query.project-id={workload.project}"],
        "ports": [{"name": "web", "containerPort": FRONTEND_PORT, "protocol": "TCP"}],
        "livenessProbe": {"httpGet": {"path": "/-/healthy", "port": "web"}},
        "readinessProbe": {"httpGet": {"path": "/-/ready", "port": "web"}},
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": container_security(),
    }
    return [
        service_account(workload, FRONTEND_NAME, "monitoring", workload.monitoring_service_account),
        _monitoring_deployment(
            workload,
            FRONTEND_NAME,
            uid=_FRONTEND_UID,
            containers=[container],
            service_account_name=FRONTEND_NAME,
        ),
        cluster_ip_service(workload, FRONTEND_NAME, "monitoring", "web", FRONTEND_PORT),
    ]


def _frontend_url(workload: RegionWorkload) -> str:
    return f"http://{FRONTEND_NAME}.{workload.namespace}.svc:{FRONTEND_PORT}"


def grafana_objects(workload: RegionWorkload) -> list[dict[str, Any]]:
    """Grafana (``IMAGES["grafana"]``, ``GRAFANA_VERSION``): Secret ``grafana-admin`` (the admin password),
    ConfigMap ``grafana-provisioning`` (``datasource_yaml`` with the GMP frontend's URL, ``provider_yaml``),
    ConfigMap ``grafana-dashboards`` (``node_dashboard`` scoped by ``dashboard_selector``, uid
    ``duplex-<region>``), Deployment (1 replica, the Compose node's Grafana environment, data on an emptyDir:
    everything it shows is provisioned; requests 100m CPU and 256 MiB, limit 512 MiB) and ClusterIP
    Service on ``profile.ports.grafana`` (3000)."""
    profile = workload.profile
    port = profile.ports.grafana
    dashboard = node_dashboard(
        profile,
        dashboard_selector(workload),
        uid=f"duplex-{workload.region}",
        title=f"Duplex {workload.region} ({workload.cluster_name})",
        turn_relay=workload.turn_secret is not None,
    )
    environment = dict(_compose_grafana(profile)["environment"])
    environment["GF_LOG_MODE"] = "console"  # the image's default also writes /var/log/grafana (read-only)
    password_file = environment["GF_SECURITY_ADMIN_PASSWORD__FILE"]
    if posixpath.dirname(password_file) != _SECRETS_MOUNT:
        raise AssertionError(f"infra.node.bundle.compose's Grafana reads its password from {password_file}")
    provisioning = "grafana-provisioning"
    container = {
        "name": "grafana",
        "image": IMAGES["grafana"],
        "env": [{"name": k, "value": v} for k, v in environment.items()],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        **_http_probes("/api/health", "http"),
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": container_security(),
        "volumeMounts": [
            {"name": "data", "mountPath": "/var/lib/grafana"},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "admin", "mountPath": _SECRETS_MOUNT, "readOnly": True},
            {"name": "datasources", "mountPath": f"{GRAFANA_PROVISIONING_DIR}/datasources", "readOnly": True},
            {"name": "providers", "mountPath": f"{GRAFANA_PROVISIONING_DIR}/dashboards", "readOnly": True},
            {"name": "dashboards", "mountPath": GRAFANA_DASHBOARDS_DIR, "readOnly": True},
        ],
    }
    volumes = [
        {"name": "data", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}},
        {
            "name": "admin",
            "secret": {
                "secretName": GRAFANA_SECRET,
                "defaultMode": 0o440,
                "items": [{"key": GRAFANA_SECRET_KEY, "path": posixpath.basename(password_file)}],
            },
        },
        {
            "name": "datasources",
            "configMap": {
                "name": provisioning,
                "items": [{"key": "datasources.yml", "path": "prometheus.yml"}],
            },
        },
        {
            "name": "providers",
            "configMap": {
                "name": provisioning,
                "items": [{"key": "dashboards.yml", "path": "duplex.yml"}],
            },
        },
        {"name": "dashboards", "configMap": {"name": "grafana-dashboards"}},
    ]
    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": object_meta(workload, GRAFANA_SECRET, "monitoring"),
            "type": "Opaque",
            "stringData": {GRAFANA_SECRET_KEY: workload.grafana_admin_password},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": object_meta(workload, provisioning, "monitoring"),
            "data": {
                "datasources.yml": datasource_yaml(profile, _frontend_url(workload)).decode(),
                "dashboards.yml": provider_yaml(profile, GRAFANA_DASHBOARDS_DIR).decode(),
            },
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": object_meta(workload, "grafana-dashboards", "monitoring"),
            "data": {"duplex-region.json": dashboard_bytes(dashboard).decode()},
        },
        _monitoring_deployment(
            workload, GRAFANA_NAME, uid=GRAFANA_UID, containers=[container], volumes=volumes
        ),
        cluster_ip_service(workload, GRAFANA_NAME, "monitoring", "http", port),
    ]


def monitoring_objects(workload: RegionWorkload) -> list[dict[str, Any]]:
    """Every monitoring object of the region in apply order: redis_exporter (Deployment, Service,
    PodMonitoring), the GMP frontend, Grafana, the runtime's PodMonitoring, the ClusterRules and, when the
    profile has alert receivers, the managed Alertmanager's configuration (``alertmanager_secret``)."""
    alerting = alertmanager_secret(workload)
    return [
        *redis_exporter_objects(workload),
        *frontend_objects(workload),
        *grafana_objects(workload),
        runtime_pod_monitoring(workload),
        cluster_rules(workload),
        *([alerting] if alerting is not None else []),
    ]
