"""The runtime of one region on GKE: ``RegionWorkload`` and the Kubernetes objects it is made of.

One region runs one Deployment of the batched runtime, one pod per GPU node (``nvidia.com/gpu: 1``), each
pod serving ``profile.sessions`` slots; a HorizontalPodAutoscaler sizes it on the sessions in use; a
ClusterIP Service with a standalone-NEG annotation gives the global external Application Load Balancer
the pods as endpoints (``cloud.google.com/neg``; the stack builds the load balancer from the NEGs).

Model cache: the weights live once per region in a Cloud Storage bucket (``weights_bucket``). A Job
(``weights_job``) downloads the Hugging Face repository of the profile's model into it through a read-write
Cloud Storage FUSE volume and writes a completion marker (``WEIGHTS_MARKER``); every runtime pod mounts the
bucket read-only (file cache on the node's disk, parallel downloads) and an init container waits for the
marker, so no GPU pod downloads from the Hub (``HF_HUB_OFFLINE=1``) and a new pod starts from the bucket.

Draining (``runtime/server.py``): on SIGTERM the runtime turns ``/readyz`` 503 (the load balancer and the
NEG take it out), refuses new sessions and lets running ones go on for ``DUPLEX_DRAIN_GRACE_S``, here the
longest session (``profile.limits.max_session_s``), so no conversation is cut by a scale-down, a rollout or
a node upgrade; then it closes what is left with 1001 and exits. The pod's preStop hook starts that drain
and waits for it (``prestop_command``); ``terminationGracePeriodSeconds`` covers it
(``termination_grace_s``).

Values that may be Pulumi ``Output`` objects (typed ``Any``): ``image``, ``redis_url``, ``redis_host``,
``redis_port``, ``redis_password``, ``redis_ca_certificate``, ``token_keys_json``, ``hf_token``,
``weights_bucket`` and the service-account emails. They are placed in the objects as they are; the two
strings that join several of them (the Redis URL and address) are built by ``lift``, which calls the
helper directly on plain values and through ``Output.all(...).apply`` otherwise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from infra.capacity.gcp import ACCELERATOR_TYPES
from infra.node.profile import NodeProfile
from infra.node.services import runtime_settings
from runtime.model_presets import get_preset

__all__ = [
    "APP_NAME",
    "DEFAULT_NAMESPACE",
    "DRAIN_MARGIN_S",
    "GCSFUSE_CACHE_LIMIT",
    "GCSFUSE_CACHE_MAX_MB",
    "MODELS_MOUNT",
    "HPA_METRIC",
    "HPA_SCALE_DOWN_WINDOW_S",
    "PART_OF",
    "PREFETCH_SCRIPT",
    "REDIS_CA_CONFIGMAP",
    "REDIS_CA_PATH",
    "RUNTIME_SERVICE_ACCOUNT",
    "RUNTIME_UID",
    "SECRET_KEYS",
    "SECRET_NAME",
    "STARTUP_PROBE_PERIOD_S",
    "STARTUP_PROBE_FAILURES",
    "TOKEN_KEYS_PATH",
    "WEIGHTS_JOB",
    "WEIGHTS_MARKER",
    "WEIGHTS_SERVICE_ACCOUNT",
    "WORKLOAD_IDENTITY_BINDINGS",
    "RegionWorkload",
    "cluster_ip_service",
    "container_security",
    "drain_seconds",
    "grafana_password_command",
    "grafana_port_forward",
    "hpa_target_average",
    "horizontal_pod_autoscaler",
    "lift",
    "namespace",
    "object_meta",
    "pod_disruption_budget",
    "pod_labels",
    "pod_security",
    "prestop_command",
    "quantity",
    "redis_address",
    "redis_ca_configmap",
    "redis_url",
    "region_objects",
    "runtime_deployment",
    "runtime_env",
    "runtime_objects",
    "runtime_secret",
    "runtime_service",
    "runtime_service_account",
    "selector_labels",
    "service_account",
    "standard_labels",
    "startup_budget_s",
    "termination_grace_s",
    "token_keys_command",
    "weights_dir",
    "weights_job",
    "weights_service_account",
    "workload_identity_bindings",
]

DEFAULT_NAMESPACE = "duplex"
"""The runtime's namespace unless ``RegionWorkload.namespace`` says otherwise."""

APP_NAME = "duplex-runtime"
"""Name of the Deployment, its Service, PodDisruptionBudget and HorizontalPodAutoscaler; the
``app.kubernetes.io/name`` label of every runtime object."""

PART_OF = "duplexops"
"""The ``app.kubernetes.io/part-of`` label of every object of the region but the metrics adapter's."""
_WEIGHTS_APP = "weights"
"""The ``app.kubernetes.io/name`` label of the weights Job, its pods and its ServiceAccount."""

RUNTIME_SERVICE_ACCOUNT = "duplex-runtime"
"""Kubernetes service account of the runtime pods (Workload Identity: reads the model bucket)."""
WEIGHTS_SERVICE_ACCOUNT = "duplex-weights"
"""Kubernetes service account of the weights Job (Workload Identity: writes the model bucket)."""

SECRET_NAME = "duplex-secrets"
"""The Secret holding the Redis URL and password, the token signing keys and the Hugging Face token."""
SECRET_KEYS = {
    "redis_url": "redis-url",
    "redis_password": "redis-password",
    "token_keys": "token_keys.json",
    "hf_token": "hf-token",
}
"""Keys of ``SECRET_NAME``'s ``stringData``, by role."""

REDIS_CA_CONFIGMAP = "redis-ca"
"""ConfigMap with Memorystore's server CA (``ca.pem``; public, not a secret)."""
REDIS_CA_DIR = "/etc/duplex/redis-ca"
REDIS_CA_PATH = f"{REDIS_CA_DIR}/ca.pem"
"""Where the runtime and redis_exporter read Memorystore's CA."""

SECRETS_DIR = "/etc/duplex/secrets"
TOKEN_KEYS_PATH = f"{SECRETS_DIR}/token_keys.json"
"""``DUPLEX_TOKEN_KEYS_FILE`` in the runtime container (the Secret's key, mounted as a file)."""

MODELS_MOUNT = "/models"
"""Where the model bucket is mounted (read-write in the Job, read-only in the runtime)."""
WEIGHTS_MARKER = ".duplex-complete"
"""File the Job writes in the model's directory once every file of the repository is in the bucket."""
WEIGHTS_JOB = "duplex-weights"
"""Name of the weights-prefetch Job."""

RUNTIME_UID = 10001
"""The runtime image's user and group (``images/runtime/Dockerfile``: ``useradd --uid 10001 duplex``)."""

DRAIN_MARGIN_S = 60
"""Seconds of ``terminationGracePeriodSeconds`` beyond the drain grace: after the grace the runtime closes
the remaining sessions and waits up to 5 s for them (``ChatServer.drain``), stops its tick thread and
flushes Redis; the preStop hook notices within its 5 s poll. 60 s is twice the Compose node's margin
(``infra.node.compose.RUNTIME_STOP_MARGIN_S``, 30 s), for the slower API-driven teardown."""

STARTUP_PROBE_PERIOD_S = 10
STARTUP_PROBE_FAILURES = 180
"""The startup probe: ``/readyz`` every 10 s, 180 failures allowed: 1800 s (30 min) from the runtime
container's start (after the init container has seen the weights) to a loaded, warm model. ``/readyz``,
not ``/healthz``: the runtime answers ``/healthz`` 200 while it loads (``runtime.server.loading_status``),
so only readiness says the load finished, and a load stuck past the budget gets the container restarted
(a fresh pod cannot be full or draining, the other reasons for a 503). A 7B load from
the bucket is minutes (15.6 GiB of bf16 weights for personaplex-7b, ``infra.capacity.models``, through
Cloud Storage FUSE's parallel downloads); 30 min is the Compose node's ``start_period`` (1800 s), which
also covers a download."""

HPA_SCALE_DOWN_WINDOW_S = 1800
"""The HPA's scale-down stabilization window (s): see ``horizontal_pod_autoscaler``."""

PRESTOP_POLL_S = 5
"""How often the preStop hook asks ``/healthz`` whether the drain is over (s)."""

GCSFUSE_CACHE_LIMIT = "40Gi"
GCSFUSE_CACHE_MAX_MB = 36 * 1024
"""The runtime pod's Cloud Storage FUSE file cache: an emptyDir ``gke-gcsfuse-cache`` of at most 40 GiB on
the node's boot disk (GKE's GPU pool: 200 GB, ``infra.components.gke_region``), of which gcsfuse uses at
most 36 GiB (``file-cache:max-size-mb``; below the emptyDir's limit, which gcsfuse cannot see, so the pod
is never evicted for it). The whole checkpoint fits twice (personaplex-7b: 15.6 GiB LM + Mimi +
tokenizer)."""

_ACCELERATORS = frozenset(ACCELERATOR_TYPES.values())
_REGION_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
_CLUSTER_RE = re.compile(r"^[a-z]([a-z0-9-]{0,38}[a-z0-9])?$")
_PROJECT_RE = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_GCE_NAME_RE = re.compile(r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
_EMAIL_RE = re.compile(r"^[a-z0-9-]+@[a-z0-9.-]+\.iam\.gserviceaccount\.com$")
_DIGEST_RE = re.compile(r"^[^\s@]+@sha256:[0-9a-f]{64}$")
_RESERVED_NAMESPACES = frozenset(
    {"default", "kube-system", "kube-public", "kube-node-lease", "custom-metrics", "gmp-system", "gmp-public"}
)


# --- joining values that may be Outputs -----------------------------------------------------------------


def lift(fn: Callable[..., str], *values: Any) -> Any:
    """``fn(*values)`` when every value is plain (str, int, float); otherwise, for Pulumi ``Output`` values,
    ``pulumi.Output.all(*values).apply(lambda v: fn(*v))`` (secret when any value is). The only place this
    package touches Pulumi, imported here so that the renderers work without it.

    Returns:
        a str, or an ``Output[str]``.
    """
    if all(isinstance(v, str | int | float) for v in values):
        return fn(*values)
    import pulumi  # only when a value is an Output

    return pulumi.Output.all(*values).apply(lambda plain: fn(*plain))


def redis_url(host: str, port: int | str, password: str) -> str:
    """``DUPLEX_REDIS_URL`` for Memorystore with AUTH and TLS, from plain values (call it inside
    ``Output.all(host, port, password).apply`` when they are Outputs, or let ``lift`` do it):
    ``rediss://:<password>@<host>:<port>/0?ssl_ca_certs=<REDIS_CA_PATH>&ssl_check_hostname=false``.

    redis-py (``redis.connection.parse_url``, 8.x) passes the query arguments to its SSL connection: the
    server certificate is verified against Memorystore's CA, mounted at ``REDIS_CA_PATH``; the host name is
    not checked, since Memorystore is reached by IP address. The password is percent-encoded.

    Raises:
        ValueError: an empty host or password, or a port outside 1-65535.
    """
    if not str(host) or not str(password):
        raise ValueError("redis_url: host and password must not be empty")
    port_number = int(port)
    if not 1 <= port_number <= 65535:
        raise ValueError(f"redis_url: port {port} is outside 1-65535")
    secret = quote(str(password), safe="")
    return f"rediss://:{secret}@{host}:{port_number}/0?ssl_ca_certs={REDIS_CA_PATH}&ssl_check_hostname=false"


def redis_address(host: str, port: int | str) -> str:
    """redis_exporter's ``REDIS_ADDR`` for Memorystore over TLS: ``rediss://<host>:<port>`` (no password:
    the exporter reads ``REDIS_PASSWORD`` from the Secret).

    Raises:
        ValueError: an empty host or a port outside 1-65535.
    """
    port_number = int(port)
    if not str(host) or not 1 <= port_number <= 65535:
        raise ValueError(f"redis_address: bad host {host!r} or port {port!r}")
    return f"rediss://{host}:{port_number}"


def quantity(value: float) -> str:
    """A Kubernetes quantity string for ``value``, exact to the milli-unit: ``4`` for 4.0, ``2400m`` for 2.4.

    Raises:
        ValueError: a negative value.
    """
    if value < 0:
        raise ValueError(f"quantity: {value} is negative")
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


# --- the region ----------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RegionWorkload:
    """What one region runs. Plain fields are validated when it is built; fields typed ``Any`` may be
    Pulumi Outputs and are validated only when plain.

    Attributes:
        region: GCP region, e.g. ``us-central1``.
        cluster_name: the region's GKE cluster (GMP's ``cluster`` label; Grafana's queries use it).
        project: GCP project id (the GMP query frontend's ``--query.project-id``).
        profile: the region's node profile: ``sessions`` = slots per pod; ``domain`` = the global domain;
            its model must have a Hugging Face repository (``get_preset(model).default_source``).
        image: the runtime image, digest-pinned (``repo@sha256:<64 hex>``).
        accelerator: GKE accelerator label value of the GPU pool (``nvidia-a100-80gb``, ``nvidia-l4``,
            ``nvidia-tesla-t4``); must be the profile GPU's.
        min_replicas, max_replicas: the HPA's bounds (pods = GPU nodes).
        redis_host, redis_port: Memorystore's address (TLS port 6378).
        redis_password: Memorystore's AUTH string (secret).
        redis_url: ``DUPLEX_REDIS_URL`` built by the caller with ``redis_url(...)`` (secret), or None to
            build it here from host, port and password.
        redis_ca_certificate: Memorystore's server CA (PEM).
        token_keys_json: the session-token signing keys, JSON ``{"kid": "secret"}`` (secret).
        hf_token: Hugging Face token (secret) for gated repositories, or None.
        weights_bucket: the region's model bucket (name).
        runtime_service_account: Google service account (email) of the runtime pods (reads the bucket).
        weights_service_account: Google service account (email) of the weights Job (writes the bucket);
            None: the Job runs as the runtime's, which then needs write access.
        monitoring_service_account: Google service account (email) of the GMP query frontend and the
            Custom Metrics Stackdriver Adapter (``roles/monitoring.viewer``).
        grafana_admin_password: Grafana's admin password (secret).
        neg_name: the standalone NEG's name (the same in every zone of the region).
        namespace: the runtime's namespace (``duplex``).
        target_slot_utilization: the HPA's target share of slots in use per pod, 0 < u <= 1 (0.8).
    """

    region: str
    cluster_name: str
    project: str
    profile: NodeProfile
    image: Any
    accelerator: str
    min_replicas: int
    max_replicas: int
    redis_host: Any
    redis_port: Any
    redis_password: Any = field(repr=False)
    redis_ca_certificate: Any
    token_keys_json: Any = field(repr=False)
    weights_bucket: Any
    runtime_service_account: Any
    monitoring_service_account: Any
    grafana_admin_password: Any = field(repr=False)
    neg_name: str
    redis_url: Any = field(default=None, repr=False)
    hf_token: Any = field(default=None, repr=False)
    weights_service_account: Any = None
    namespace: str = DEFAULT_NAMESPACE
    target_slot_utilization: float = 0.8

    def __post_init__(self) -> None:
        def bad(name: str, value: Any, allowed: str) -> ValueError:
            return ValueError(f"RegionWorkload.{name}: {value!r} is not allowed; {allowed}")

        if not isinstance(self.profile, NodeProfile):
            raise bad("profile", self.profile, "a NodeProfile (infra.node.profile)")
        checks: list[tuple[str, re.Pattern[str], str]] = [
            ("region", _REGION_RE, "a GCP region such as 'us-central1'"),
            ("cluster_name", _CLUSTER_RE, "a GKE cluster name: 1-40 lower-case letters, digits, '-'"),
            ("project", _PROJECT_RE, "a GCP project id: 6-30 lower-case letters, digits, '-'"),
            ("namespace", _DNS_LABEL_RE, "a DNS label (lower case, digits, '-', at most 63)"),
            ("neg_name", _GCE_NAME_RE, "a GCE resource name: a letter, then letters, digits, '-' (<= 63)"),
        ]
        for name, pattern, allowed in checks:
            value = getattr(self, name)
            if not isinstance(value, str) or not pattern.match(value):
                raise bad(name, value, f"must be {allowed}")
        if self.namespace in _RESERVED_NAMESPACES:
            raise bad(
                "namespace", self.namespace, f"must not be one of {', '.join(sorted(_RESERVED_NAMESPACES))}"
            )
        profile = self.profile
        if profile.gpu is None:
            raise bad("profile", profile.name, "the profile must have a GPU (the pool is GPU nodes)")
        if get_preset(profile.model).default_source is None:
            raise bad(
                "profile",
                profile.model,
                "the profile's model must have Hugging Face weights (moshi-7b, personaplex-7b); "
                "the tiny preset has none to cache",
            )
        if self.accelerator not in _ACCELERATORS:
            raise bad("accelerator", self.accelerator, f"allowed: {', '.join(sorted(_ACCELERATORS))}")
        expected = ACCELERATOR_TYPES.get(profile.gpu)
        if expected is not None and self.accelerator != expected:
            raise bad(
                "accelerator",
                self.accelerator,
                f"the profile's GPU {profile.gpu!r} is GKE accelerator {expected!r}",
            )
        for name in ("min_replicas", "max_replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
                raise bad(name, value, "must be an integer from 1 to 1000")
        if self.max_replicas < self.min_replicas:
            raise bad("max_replicas", self.max_replicas, f"must be >= min_replicas ({self.min_replicas})")
        utilization = self.target_slot_utilization
        if (
            isinstance(utilization, bool)
            or not isinstance(utilization, int | float)
            or not 0 < utilization <= 1
        ):
            raise bad("target_slot_utilization", utilization, "must be a number with 0 < u <= 1")
        # Values that may be Outputs: checked when plain.
        if isinstance(self.image, str) and not _DIGEST_RE.match(self.image):
            raise bad("image", self.image, "must be digest-pinned: <repository>@sha256:<64 hex digits>")
        if isinstance(self.redis_port, bool) or (
            isinstance(self.redis_port, int) and not 1 <= self.redis_port <= 65535
        ):
            raise bad("redis_port", self.redis_port, "must be a TCP port, 1-65535 (Memorystore TLS: 6378)")
        if isinstance(self.weights_bucket, str) and not _BUCKET_RE.match(self.weights_bucket):
            raise bad("weights_bucket", self.weights_bucket, "must be a Cloud Storage bucket name")
        for name in ("runtime_service_account", "monitoring_service_account", "weights_service_account"):
            value = getattr(self, name)
            if isinstance(value, str) and not _EMAIL_RE.match(value):
                raise bad(
                    name, value, "must be a service account email (<id>@<project>.iam.gserviceaccount.com)"
                )
        for name in ("redis_password", "grafana_admin_password", "redis_host"):
            value = getattr(self, name)
            if isinstance(value, str) and not value:
                raise bad(name, value, "must not be empty")
        if isinstance(self.token_keys_json, str):
            try:
                keys = json.loads(self.token_keys_json)
            except json.JSONDecodeError:
                keys = None
            if not isinstance(keys, dict) or not keys:
                raise ValueError(
                    'RegionWorkload.token_keys_json: must be JSON {"<kid>": "<secret>", ...} with at least '
                    "one key (`duplex token keygen` makes one); the value is not shown"
                )
        if isinstance(self.redis_ca_certificate, str) and "-----BEGIN CERTIFICATE-----" not in (
            self.redis_ca_certificate
        ):
            raise bad("redis_ca_certificate", "<not PEM>", "must be a PEM certificate (Memorystore's CA)")

    @property
    def slots(self) -> int:
        """Batch slots (concurrent sessions) per pod: ``profile.sessions``."""
        return self.profile.sessions

    @property
    def weights_repo(self) -> str:
        """The Hugging Face repository of the profile's model (``get_preset(model).default_source``)."""
        source = get_preset(self.profile.model).default_source
        assert source is not None  # __post_init__
        return source

    def runtime_redis_url(self) -> Any:
        """``DUPLEX_REDIS_URL``: ``redis_url`` when given, else built from host, port and password."""
        if self.redis_url is not None:
            return self.redis_url
        return lift(redis_url, self.redis_host, self.redis_port, self.redis_password)


# --- figures ---------------------------------------------------------------------------------------------


def drain_seconds(profile: NodeProfile) -> int:
    """How long (s) a pod that is told to stop keeps serving its running sessions:
    ``DUPLEX_DRAIN_GRACE_S`` = the longest session, ``profile.limits.max_session_s`` (3600 s by default).
    The load balancer's connection draining should last as long (GCP allows at most 3600 s)."""
    return profile.limits.max_session_s


def termination_grace_s(profile: NodeProfile) -> int:
    """The runtime pod's ``terminationGracePeriodSeconds`` (s): ``drain_seconds(profile)`` +
    ``DRAIN_MARGIN_S`` (60 s): 3660 s for a 1 h longest session."""
    return drain_seconds(profile) + DRAIN_MARGIN_S


def startup_budget_s() -> int:
    """Seconds the startup probe allows from the runtime container's start to a loaded model:
    ``STARTUP_PROBE_PERIOD_S`` x ``STARTUP_PROBE_FAILURES`` = 1800 s (30 min)."""
    return STARTUP_PROBE_PERIOD_S * STARTUP_PROBE_FAILURES


def hpa_target_average(workload: RegionWorkload) -> str:
    """The HPA's target of active sessions per pod, as a Kubernetes quantity: slots per pod x
    ``target_slot_utilization`` (5 slots x 0.8 = ``4``; 3 x 0.8 = ``2400m``)."""
    return quantity(workload.slots * workload.target_slot_utilization)


def weights_dir(workload: RegionWorkload) -> str:
    """The model's directory on the mounted bucket: ``/models/<Hugging Face repo id>``
    (``/models/nvidia/personaplex-7b-v1``): ``DUPLEX_WEIGHTS`` of the runtime."""
    return f"{MODELS_MOUNT}/{workload.weights_repo}"


def workload_identity_bindings(namespace: str = DEFAULT_NAMESPACE) -> tuple[tuple[str, str, str], ...]:
    """The Kubernetes service accounts that act as the region's Google service accounts under Workload
    Identity, as ``(role, namespace, Kubernetes service account)``, role = the Google account
    (``runtime``, ``weights``, ``monitoring``; ``infra.components.gke_region.GkeRegion``). Two share
    ``monitoring``: the GMP query frontend (in ``namespace``) and the Custom Metrics Stackdriver Adapter
    (in ``custom-metrics``)."""
    from infra.k8s.metrics_adapter import ADAPTER_NAME, ADAPTER_NAMESPACE
    from infra.k8s.monitoring import FRONTEND_NAME

    return (
        ("runtime", namespace, RUNTIME_SERVICE_ACCOUNT),
        ("weights", namespace, WEIGHTS_SERVICE_ACCOUNT),
        ("monitoring", namespace, FRONTEND_NAME),
        ("monitoring", ADAPTER_NAMESPACE, ADAPTER_NAME),
    )


def grafana_port_forward(workload: RegionWorkload) -> str:
    """The command that opens the region's Grafana on http://localhost:3000 (after ``gcloud container
    clusters get-credentials``): ``kubectl -n <ns> port-forward svc/grafana 3000:<port>``."""
    from infra.k8s.monitoring import GRAFANA_NAME

    port = workload.profile.ports.grafana
    return f"kubectl -n {workload.namespace} port-forward svc/{GRAFANA_NAME} 3000:{port}"


def grafana_password_command(namespace: str = DEFAULT_NAMESPACE) -> str:
    """The command that prints Grafana's admin password from its Secret (user ``admin``)."""
    from infra.k8s.monitoring import GRAFANA_SECRET, GRAFANA_SECRET_KEY

    return (
        f"kubectl -n {namespace} get secret {GRAFANA_SECRET} "
        f"-o jsonpath='{{.data.{GRAFANA_SECRET_KEY}}}' | base64 -d"
    )


def token_keys_command(namespace: str = DEFAULT_NAMESPACE) -> str:
    """The command that prints the session-token signing keys (JSON) from the runtime's Secret."""
    key = SECRET_KEYS["token_keys"].replace(".", "\\.")
    return f"kubectl -n {namespace} get secret {SECRET_NAME} -o jsonpath='{{.data.{key}}}' | base64 -d"


# --- objects ---------------------------------------------------------------------------------------------


def selector_labels(app: str) -> dict[str, str]:
    """The labels that a workload's pods carry and its controllers, Services, PodDisruptionBudget and
    PodMonitoring select on: ``app.kubernetes.io/name`` = ``app``, ``app.kubernetes.io/part-of`` =
    ``PART_OF``."""
    return {"app.kubernetes.io/name": app, "app.kubernetes.io/part-of": PART_OF}


def standard_labels(app: str, component: str) -> dict[str, str]:
    """``selector_labels(app)`` plus ``app.kubernetes.io/component`` = ``component`` (``runtime``,
    ``weights``, ``monitoring``): the labels of every namespaced object and of the pod templates."""
    return {**selector_labels(app), "app.kubernetes.io/component": component}


def pod_labels(workload: RegionWorkload) -> dict[str, str]:
    """The runtime pods' labels, which the Deployment, Service, PodDisruptionBudget and PodMonitoring
    select on: ``selector_labels(APP_NAME)``."""
    return selector_labels(APP_NAME)


def object_meta(
    workload: RegionWorkload, name: str, component: str, *, app: str | None = None, **extra: Any
) -> dict[str, Any]:
    """The ``metadata`` of a namespaced object: ``name``, the workload's namespace, the labels
    ``standard_labels(app, component)`` (``app`` defaults to ``name``), then ``extra`` as given
    (``annotations=...``)."""
    labels = standard_labels(name if app is None else app, component)
    return {"name": name, "namespace": workload.namespace, "labels": labels, **extra}


def pod_security(uid: int) -> dict[str, Any]:
    """A pod ``securityContext`` that meets Pod Security ``restricted`` (with ``container_security`` on
    every container): non-root, user, group and ``fsGroup`` ``uid`` (the image's user), seccomp
    RuntimeDefault."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> dict[str, Any]:
    """A container ``securityContext`` that meets Pod Security ``restricted``: no privilege escalation,
    read-only root filesystem, non-root, every capability dropped."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def service_account(
    workload: RegionWorkload, name: str, component: str, gcp_account: Any, *, app: str | None = None
) -> dict[str, Any]:
    """ServiceAccount ``name`` annotated for Workload Identity with the Google service account
    ``gcp_account`` (``iam.gke.io/gcp-service-account``); labels as ``object_meta``."""
    annotations = {"iam.gke.io/gcp-service-account": gcp_account}
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": object_meta(workload, name, component, app=app, annotations=annotations),
    }


def cluster_ip_service(
    workload: RegionWorkload, name: str, component: str, port_name: str, port: int, **extra: Any
) -> dict[str, Any]:
    """ClusterIP Service ``name`` of the pods labelled ``selector_labels(name)``: one TCP port ``port``
    named ``port_name`` to the containers' port of that name; ``extra`` goes to ``object_meta``
    (``annotations=...``)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(workload, name, component, **extra),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}],
        },
    }


def namespace(workload: RegionWorkload) -> dict[str, Any]:
    """The runtime's Namespace, with Pod Security Admission at ``restricted`` (enforce, audit and warn): every
    pod of it runs as non-root without privilege escalation, all capabilities dropped, seccomp
    RuntimeDefault (GKE's Cloud Storage FUSE sidecar follows the same standard)."""
    labels = {"app.kubernetes.io/part-of": PART_OF}
    for mode in ("enforce", "audit", "warn"):
        labels[f"pod-security.kubernetes.io/{mode}"] = "restricted"
        labels[f"pod-security.kubernetes.io/{mode}-version"] = "latest"
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": workload.namespace, "labels": labels},
    }


def runtime_service_account(workload: RegionWorkload) -> dict[str, Any]:
    """The runtime pods' ServiceAccount, annotated for Workload Identity with
    ``runtime_service_account`` (``iam.gke.io/gcp-service-account``)."""
    return service_account(
        workload, RUNTIME_SERVICE_ACCOUNT, "runtime", workload.runtime_service_account, app=APP_NAME
    )


def weights_service_account(workload: RegionWorkload) -> dict[str, Any]:
    """The weights Job's ServiceAccount, annotated for Workload Identity with ``weights_service_account``
    (the runtime's account when None)."""
    account = workload.weights_service_account or workload.runtime_service_account
    return service_account(workload, WEIGHTS_SERVICE_ACCOUNT, "weights", account, app=_WEIGHTS_APP)


def runtime_secret(workload: RegionWorkload) -> dict[str, Any]:
    """The runtime's Secret (type Opaque), ``stringData``: ``redis-url`` (``DUPLEX_REDIS_URL``),
    ``redis-password`` (redis_exporter), ``token_keys.json`` (mounted as ``TOKEN_KEYS_PATH``) and, when
    given, ``hf-token`` (the weights Job's ``HF_TOKEN``). The only object holding those values."""
    data: dict[str, Any] = {
        SECRET_KEYS["redis_url"]: workload.runtime_redis_url(),
        SECRET_KEYS["redis_password"]: workload.redis_password,
        SECRET_KEYS["token_keys"]: workload.token_keys_json,
    }
    if workload.hf_token is not None:
        data[SECRET_KEYS["hf_token"]] = workload.hf_token
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(workload, SECRET_NAME, "runtime", app=APP_NAME),
        "type": "Opaque",
        "stringData": data,
    }


def redis_ca_configmap(workload: RegionWorkload) -> dict[str, Any]:
    """ConfigMap ``redis-ca`` with Memorystore's server CA as ``ca.pem`` (mounted at ``REDIS_CA_DIR`` by the
    runtime and redis_exporter)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(workload, REDIS_CA_CONFIGMAP, "runtime", app=APP_NAME),
        "data": {"ca.pem": workload.redis_ca_certificate},
    }


def _gcsfuse_volume(workload: RegionWorkload, *, read_only: bool) -> dict[str, Any]:
    """The model bucket as a Cloud Storage FUSE CSI ephemeral volume. Mount options (GKE's Cloud Storage
    FUSE performance guide): ``implicit-dirs`` (directories are object prefixes), owner ``RUNTIME_UID``;
    read-only mounts add the file cache on the pod's cache volume with parallel downloads (a checkpoint
    file is read once at start, in large ranges) and cache whole files on range reads."""
    options = ["implicit-dirs", f"uid={RUNTIME_UID}", f"gid={RUNTIME_UID}"]
    if read_only:
        options += [
            f"file-cache:max-size-mb:{GCSFUSE_CACHE_MAX_MB}",
            "file-cache:cache-file-for-range-read:true",
            "file-cache:enable-parallel-downloads:true",
            "metadata-cache:ttl-secs:60",
        ]
    else:
        options += ["file-mode=644", "dir-mode=755"]
    return {
        "name": "models",
        "csi": {
            "driver": "gcsfuse.csi.storage.gke.io",
            "readOnly": read_only,
            "volumeAttributes": {"bucketName": workload.weights_bucket, "mountOptions": ",".join(options)},
        },
    }


_GCSFUSE_ANNOTATIONS = {
    "gke-gcsfuse/volumes": "true",
    # The sidecar without CPU, memory or ephemeral-storage limits ("0"): a 15 GiB checkpoint read at start
    # is not throttled (GKE: "Configure resources for the sidecar container").
    "gke-gcsfuse/cpu-limit": "0",
    "gke-gcsfuse/memory-limit": "0",
    "gke-gcsfuse/ephemeral-storage-limit": "0",
}

PREFETCH_SCRIPT = """\
import json, pathlib, sys, time
from huggingface_hub import snapshot_download

repo, target, marker = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
done = target / marker
if done.is_file():
    print(f"{repo}: already complete in {target}")
    sys.exit(0)
started = time.monotonic()
snapshot_download(repo_id=repo, local_dir=str(target))
files = sorted(
    str(p.relative_to(target)) for p in target.rglob("*") if p.is_file() and ".cache" not in p.parts
)
seconds = round(time.monotonic() - started)
done.write_text(json.dumps({"repo": repo, "files": files, "seconds": seconds}) + "\\n")
print(f"{repo}: {len(files)} files in {target} in {seconds} s")
"""
"""The weights Job's program (``python -c``; argv: repo, target directory, marker name): downloads the whole
Hugging Face repository into the bucket (``huggingface_hub.snapshot_download(local_dir=...)``), then writes
the marker (JSON: repo, files, seconds). Idempotent: exits at once when the marker is there."""


def weights_job(workload: RegionWorkload) -> dict[str, Any]:
    """The weights-prefetch Job: the runtime image runs ``PREFETCH_SCRIPT`` on a CPU node (no GPU toleration:
    the GPU pool's taint keeps it off), writing ``/models/<repo>`` on a read-write Cloud Storage FUSE volume
    of ``weights_bucket`` as ``weights_service_account``, then ``WEIGHTS_MARKER``. ``HF_TOKEN`` from the
    Secret when ``hf_token`` is given (gated repositories such as nvidia/personaplex-7b-v1). 4 retries
    (``backoffLimit``), each a fresh pod; 2 h at most (``activeDeadlineSeconds``: ~17 GB at >= 3 MB/s).
    Requests 1 CPU and 1 GiB (memory limit 4 GiB): the download streams to the bucket."""
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
        "metadata": object_meta(workload, WEIGHTS_JOB, "weights", app=_WEIGHTS_APP),
        "spec": {
            "backoffLimit": 4,
            "activeDeadlineSeconds": 7200,
            "template": {
                "metadata": {
                    "labels": standard_labels(_WEIGHTS_APP, "weights"),
                    "annotations": dict(_GCSFUSE_ANNOTATIONS),
                },
                "spec": {
                    "serviceAccountName": WEIGHTS_SERVICE_ACCOUNT,
                    "restartPolicy": "Never",
                    "securityContext": pod_security(RUNTIME_UID),
                    "containers": [container],
                    "volumes": [
                        _gcsfuse_volume(workload, read_only=False),
                        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
                    ],
                },
            },
        },
    }


RUNTIME_CPU_REQUEST = 4
"""Cores requested for the runtime container: one for the engine's tick, the rest for its front-end workers
(issue 16: about 40 Opus sessions per worker, since sphn's encoder holds the GIL)."""
RUNTIME_FRONTEND_WORKERS = RUNTIME_CPU_REQUEST - 1
"""``DUPLEX_WORKERS`` of the runtime container (``runtime/multiproc.py``)."""


def runtime_env(workload: RegionWorkload) -> list[dict[str, Any]]:
    """The runtime container's environment: ``runtime_settings(profile)`` (``infra.node.services``) adapted to
    Kubernetes: ``DUPLEX_HOST=0.0.0.0``; ``DUPLEX_NODE_ID`` = the pod's name (fieldRef);
    ``DUPLEX_DRAIN_GRACE_S`` = ``drain_seconds(profile)`` (the longest session, so that a drain never cuts
    one); ``DUPLEX_TOKEN_KEYS_FILE`` = ``TOKEN_KEYS_PATH``; ``DUPLEX_WEIGHTS`` = ``weights_dir``;
    ``DUPLEX_WORKERS`` = ``RUNTIME_FRONTEND_WORKERS``;
    ``DUPLEX_REDIS_URL`` from the Secret; then ``HF_HUB_OFFLINE=1`` (the weights are local) and the caches
    (``HF_HOME``, ``XDG_CACHE_HOME``, ``TRITON_CACHE_DIR``) on an emptyDir (the root filesystem is
    read-only)."""
    settings = dict(runtime_settings(workload.profile))
    settings.update(
        {
            "DUPLEX_HOST": "0.0.0.0",
            "DUPLEX_DRAIN_GRACE_S": str(drain_seconds(workload.profile)),
            "DUPLEX_TOKEN_KEYS_FILE": TOKEN_KEYS_PATH,
            "DUPLEX_WEIGHTS": weights_dir(workload),
            # A CPU request is a quota, not a cpuset: the runtime cannot see it, so the worker count is set.
            "DUPLEX_WORKERS": str(RUNTIME_FRONTEND_WORKERS),
        }
    )
    env: list[dict[str, Any]] = []
    for name, value in settings.items():
        if name == "DUPLEX_NODE_ID":
            env.append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
        else:
            env.append({"name": name, "value": value})
    env.append(
        {
            "name": "DUPLEX_REDIS_URL",
            "valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": SECRET_KEYS["redis_url"]}},
        }
    )
    env += [
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "HF_HOME", "value": "/var/cache/duplex/huggingface"},
        {"name": "XDG_CACHE_HOME", "value": "/var/cache/duplex"},
        {"name": "TRITON_CACHE_DIR", "value": "/var/cache/duplex/triton"},
    ]
    return env


def prestop_command(port: int, pid: int = 1) -> list[str]:
    """The runtime's preStop hook: SIGTERM to the runtime (``pid`` 1: the image's exec-form ``ENTRYPOINT
    ["duplex"]``), which starts its drain, then wait while ``/healthz`` still answers (polled every
    ``PRESTOP_POLL_S`` s): the runtime stops listening once the drain is over (``ChatServer.drain`` ->
    ``close``: the listener is closed first), then exits 0. The kubelet sends its own SIGTERM after the
    hook; the runtime is exiting by then."""
    check = f"curl -fsS -o /dev/null --max-time 5 http://127.0.0.1:{port}/healthz"
    return ["/bin/sh", "-c", f"kill -TERM {pid}; while {check}; do sleep {PRESTOP_POLL_S}; done"]


def runtime_deployment(workload: RegionWorkload) -> dict[str, Any]:
    """The runtime's Deployment. No ``replicas`` field: the HorizontalPodAutoscaler owns it (a value here
    would reset the count at every apply).

    - Rolling updates add one pod before removing one (maxSurge 1, maxUnavailable 0): capacity never dips.
    - One GPU per pod (``nvidia.com/gpu: 1``), on the GPU pool (``cloud.google.com/gke-accelerator``),
      tolerating its ``nvidia.com/gpu`` NoSchedule taint.
    - Resources: requests 4 CPU and 20 GiB, memory limit 28 GiB, no CPU limit (CFS throttling would stretch
      the 80 ms tick). Memory: loading personaplex-7b holds its 15.6 GiB bf16 state dict in host memory
      (``runtime.models.load_checkpoint``; ``infra.capacity.models``) plus torch and CUDA (~3 GiB), ~19 GiB;
      20 GiB fits the smallest GPU machine types' allocatable memory (n1-standard-8, 30 GB; g2-standard-8,
      32 GB), the limit lets a dtype conversion's second copy burst above it where the node has it.
    - Probes: startup ``/healthz`` for ``startup_budget_s()`` (1800 s); liveness ``/healthz`` (3 failures
      10 s apart); readiness ``/readyz`` every 5 s, 1 failure: a full or draining pod leaves the NEG at once.
    - Drain: preStop ``prestop_command``; ``terminationGracePeriodSeconds`` = ``termination_grace_s``.
    - An init container waits for the weights Job's marker on the read-only bucket mount (GKE injects the
      Cloud Storage FUSE sidecar as the first init container, so the mount is there).
    - Security: uid/gid 10001, non-root, no privilege escalation, all capabilities dropped, seccomp
      RuntimeDefault, read-only root filesystem with emptyDirs for ``/tmp`` and the caches.
    """
    profile = workload.profile
    port = profile.ports.runtime
    marker = f"{weights_dir(workload)}/{WEIGHTS_MARKER}"
    wait = (
        f'until [ -f "{marker}" ]; do echo "waiting for {marker} (Job {WEIGHTS_JOB})"; sleep 10; done; '
        f'echo "weights ready: {marker}"'
    )
    mounts = [
        {"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True},
        {"name": "secrets", "mountPath": SECRETS_DIR, "readOnly": True},
        {"name": "redis-ca", "mountPath": REDIS_CA_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": "/var/cache/duplex"},
    ]
    runtime = {
        "name": "runtime",
        "image": workload.image,
        "args": ["serve"],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "env": runtime_env(workload),
        "resources": {
            "requests": {"cpu": str(RUNTIME_CPU_REQUEST), "memory": "20Gi", "nvidia.com/gpu": "1"},
            "limits": {"memory": "28Gi", "nvidia.com/gpu": "1"},
        },
        "startupProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": STARTUP_PROBE_PERIOD_S,
            "failureThreshold": STARTUP_PROBE_FAILURES,
            "timeoutSeconds": 5,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
            "timeoutSeconds": 5,
        },
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 1,
            "successThreshold": 1,
            "timeoutSeconds": 3,
        },
        "lifecycle": {"preStop": {"exec": {"command": prestop_command(port)}}},
        "securityContext": container_security(),
        "volumeMounts": mounts,
    }
    wait_for_weights = {
        "name": "wait-for-weights",
        "image": workload.image,
        "command": ["/bin/sh", "-c", wait],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(workload, APP_NAME, "runtime"),
        "spec": {
            "selector": {"matchLabels": pod_labels(workload)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 5,
            # A rollout is stuck only after the weights wait and the whole startup budget.
            "progressDeadlineSeconds": startup_budget_s() + 1800,
            "template": {
                "metadata": {
                    "labels": standard_labels(APP_NAME, "runtime"),
                    "annotations": dict(_GCSFUSE_ANNOTATIONS),
                },
                "spec": {
                    "serviceAccountName": RUNTIME_SERVICE_ACCOUNT,
                    "enableServiceLinks": False,
                    "nodeSelector": {"cloud.google.com/gke-accelerator": workload.accelerator},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "terminationGracePeriodSeconds": termination_grace_s(profile),
                    "securityContext": pod_security(RUNTIME_UID),
                    "initContainers": [wait_for_weights],
                    "containers": [runtime],
                    "volumes": [
                        _gcsfuse_volume(workload, read_only=True),
                        # Cloud Storage FUSE's file cache (the sidecar uses a volume of this name if present).
                        {"name": "gke-gcsfuse-cache", "emptyDir": {"sizeLimit": GCSFUSE_CACHE_LIMIT}},
                        {
                            "name": "secrets",
                            "secret": {
                                "secretName": SECRET_NAME,
                                "defaultMode": 0o440,
                                "items": [{"key": SECRET_KEYS["token_keys"], "path": "token_keys.json"}],
                            },
                        },
                        {"name": "redis-ca", "configMap": {"name": REDIS_CA_CONFIGMAP, "defaultMode": 0o444}},
                        {"name": "tmp", "emptyDir": {"sizeLimit": "2Gi"}},
                        {"name": "cache", "emptyDir": {"sizeLimit": "4Gi"}},
                    ],
                },
            },
        },
    }


def runtime_service(workload: RegionWorkload) -> dict[str, Any]:
    """The runtime's ClusterIP Service, port ``http`` = ``profile.ports.runtime`` (8998), annotated
    ``cloud.google.com/neg: {"exposed_ports": {"8998": {"name": <neg_name>}}}``: GKE's NEG controller
    creates a standalone zonal NEG of that name in every zone with runtime pods, endpoints = ready pod IPs;
    the stack's global load balancer uses them as backends."""
    port = workload.profile.ports.runtime
    neg = json.dumps({"exposed_ports": {str(port): {"name": workload.neg_name}}}, separators=(",", ":"))
    return cluster_ip_service(
        workload, APP_NAME, "runtime", "http", port, annotations={"cloud.google.com/neg": neg}
    )


def pod_disruption_budget(workload: RegionWorkload) -> dict[str, Any]:
    """PodDisruptionBudget (policy/v1): at most one runtime pod evicted at a time (node upgrades, the
    cluster autoscaler). An evicted pod drains like any other (preStop). A pod whose slots are all taken
    answers ``/readyz`` 503 and so counts as unavailable: with the default unhealthy-pod policy
    (IfHealthyBudget) evictions wait while one is full, or take that full pod (which drains)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(workload, APP_NAME, "runtime"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": pod_labels(workload)}},
    }


HPA_METRIC = "prometheus.googleapis.com|duplex_active_sessions|gauge"
"""The runtime's ``duplex_active_sessions`` as the Custom Metrics Stackdriver Adapter serves GMP metrics
(``prometheus.googleapis.com/<name>/<kind>`` with ``/`` as ``|``), per pod."""


def horizontal_pod_autoscaler(workload: RegionWorkload) -> dict[str, Any]:
    """HorizontalPodAutoscaler (autoscaling/v2) of the Deployment, ``min_replicas``-``max_replicas`` pods, on
    the active sessions per pod (``HPA_METRIC``, type Pods) against ``hpa_target_average`` = slots x
    ``target_slot_utilization``: it adds a pod before the region is full.

    Behaviour: scale up at once (no stabilization; +2 pods or +100 % per minute, whichever is more): a new
    pod needs a GPU node and a model load, minutes, before it serves. Scale down slowly: the highest
    recommendation of the last ``HPA_SCALE_DOWN_WINDOW_S`` (30 min) and one pod per 10 min. A pod removed
    by scale-down keeps its GPU while it drains its conversations, for up to the grace period (an hour),
    and a new one costs a node start and a load: removing pods on a short dip and adding them back after
    would cost both. Metrics reach the HPA through GMP and the adapter, a minute or two behind."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": object_meta(workload, APP_NAME, "runtime"),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": APP_NAME},
            "minReplicas": workload.min_replicas,
            "maxReplicas": workload.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": HPA_METRIC},
                        "target": {"type": "AverageValue", "averageValue": hpa_target_average(workload)},
                    },
                }
            ],
            "behavior": {
                "scaleUp": {
                    "stabilizationWindowSeconds": 0,
                    "selectPolicy": "Max",
                    "policies": [
                        {"type": "Pods", "value": 2, "periodSeconds": 60},
                        {"type": "Percent", "value": 100, "periodSeconds": 60},
                    ],
                },
                "scaleDown": {
                    "stabilizationWindowSeconds": HPA_SCALE_DOWN_WINDOW_S,
                    "selectPolicy": "Min",
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 600}],
                },
            },
        },
    }


def runtime_objects(workload: RegionWorkload) -> list[dict[str, Any]]:
    """The runtime's objects in apply order: Namespace, ServiceAccounts, Secret, Redis CA ConfigMap, weights
    Job, Deployment, Service, PodDisruptionBudget, HorizontalPodAutoscaler."""
    return [
        namespace(workload),
        runtime_service_account(workload),
        weights_service_account(workload),
        runtime_secret(workload),
        redis_ca_configmap(workload),
        weights_job(workload),
        runtime_deployment(workload),
        runtime_service(workload),
        pod_disruption_budget(workload),
        horizontal_pod_autoscaler(workload),
    ]


def region_objects(workload: RegionWorkload) -> list[dict[str, Any]]:
    """Every object of the region in apply order (``infra.k8s.manifest.region_objects``, re-exported here)."""
    from infra.k8s.manifest import region_objects as build

    return build(workload)


WORKLOAD_IDENTITY_BINDINGS: tuple[tuple[str, str, str], ...] = (
    ("runtime", DEFAULT_NAMESPACE, RUNTIME_SERVICE_ACCOUNT),
    ("weights", DEFAULT_NAMESPACE, WEIGHTS_SERVICE_ACCOUNT),
    ("monitoring", DEFAULT_NAMESPACE, "gmp-frontend"),
    ("monitoring", "custom-metrics", "custom-metrics-stackdriver-adapter"),
)
"""``workload_identity_bindings()`` for the default namespace, as a constant (a test keeps them equal)."""
