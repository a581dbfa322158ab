"""What every builder of a region's Kubernetes objects uses: ``RegionWorkload`` (what one region runs,
validated), the names the objects share (namespace, app, service accounts, Secret, mounts), the joins of
values that may be Pulumi Outputs (``lift``, ``redis_url``), labels, metadata, Pod Security ``restricted``
contexts, Workload Identity service accounts and the model bucket's Cloud Storage FUSE volume.
docs/deploying.md, "Stack multi-region".
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from infra.capacity.gcp import ACCELERATOR_TYPES
from infra.names import PROJECT_ID_RE, REGION_RE, ZONE_RE
from infra.node.bundle.compose import RUNTIME_UID
from infra.node.profile.profiles import NodeProfile
from runtime.engine.model_presets import get_preset

__all__ = [
    "APP_NAME",
    "DEFAULT_NAMESPACE",
    "GCSFUSE_ANNOTATIONS",
    "GCSFUSE_CACHE_LIMIT",
    "GCSFUSE_CACHE_MAX_MB",
    "MODELS_MOUNT",
    "PART_OF",
    "REDIS_CA_CONFIGMAP",
    "REDIS_CA_DIR",
    "REDIS_CA_PATH",
    "RUNTIME_SERVICE_ACCOUNT",
    "RUNTIME_UID",
    "SECRETS_DIR",
    "SECRET_KEYS",
    "SECRET_NAME",
    "TOKEN_KEYS_PATH",
    "APP_TOKEN_KEYS_PATH",
    "WEIGHTS_JOB",
    "WEIGHTS_MARKER",
    "WEIGHTS_SERVICE_ACCOUNT",
    "RegionWorkload",
    "cluster_ip_service",
    "container_security",
    "gcsfuse_volume",
    "lift",
    "object_meta",
    "pod_labels",
    "pod_security",
    "quantity",
    "redis_address",
    "redis_url",
    "selector_labels",
    "service_account",
    "standard_labels",
    "weights_dir",
]

DEFAULT_NAMESPACE = "duplex"
"""The runtime's namespace unless ``RegionWorkload.namespace`` says otherwise."""


APP_NAME = "duplex-runtime"
"""Name of the Deployment, its Service, PodDisruptionBudget and HorizontalPodAutoscaler; the
``app.kubernetes.io/name`` label of every runtime object."""


PART_OF = "duplexops"
"""The ``app.kubernetes.io/part-of`` label of every object of the region but the metrics adapter's."""


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
    "app_token_keys": "app_token_keys.json",
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

APP_TOKEN_KEYS_PATH = f"{SECRETS_DIR}/app_token_keys.json"
"""``DUPLEX_APP_TOKEN_KEYS_FILE`` in the runtime container: the sessions API's signing keys (issue 34)."""


MODELS_MOUNT = "/models"
"""Where the model bucket is mounted (read-write in the Job, read-only in the runtime)."""


WEIGHTS_MARKER = ".duplex-complete"
"""File the Job writes in the model's directory once every file of the repository is in the bucket."""


WEIGHTS_JOB = "duplex-weights"
"""Name of the weights-prefetch Job."""


GCSFUSE_CACHE_LIMIT = "40Gi"


GCSFUSE_CACHE_MAX_MB = 36 * 1024
"""The runtime pod's Cloud Storage FUSE file cache: an emptyDir ``gke-gcsfuse-cache`` of at most 40 GiB on
the node's boot disk (GKE's GPU pool: 200 GB, ``infra.components.gke_region``), of which gcsfuse uses at
most 36 GiB (``file-cache:max-size-mb``; below the emptyDir's limit, which gcsfuse cannot see, so the pod
is never evicted for it). The whole checkpoint fits twice (personaplex-7b: 15.6 GiB LM + Mimi +
tokenizer)."""


_ACCELERATORS = frozenset(ACCELERATOR_TYPES.values())


_CLUSTER_RE = re.compile(r"^[a-z]([a-z0-9-]{0,38}[a-z0-9])?$")


_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


_GCE_NAME_RE = re.compile(r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$")


_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")


_EMAIL_RE = re.compile(r"^[a-z0-9-]+@[a-z0-9.-]+\.iam\.gserviceaccount\.com$")


_DIGEST_RE = re.compile(r"^[^\s@]+@sha256:[0-9a-f]{64}$")


_RESERVED_NAMESPACES = frozenset(
    {"default", "kube-system", "kube-public", "kube-node-lease", "custom-metrics", "gmp-system", "gmp-public"}
)


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


@dataclass(frozen=True, kw_only=True)
class RegionWorkload:
    """What one region runs. Plain fields are validated when it is built; fields typed ``Any`` may be
    Pulumi Outputs and are validated only when plain.

    Attributes:
        region: GCP region, e.g. ``us-central1``.
        zones: the zones of the region's GPU pool (``us-central1-a``, ...): the runtime pods spread over
            them, at least one in each (``min_replicas`` >= their number), and the runtime Service asks for
            a NEG in each.
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
        app_token_keys_json: the application-token (sessions API) signing keys, the same form, other keys
            (secret); None: the pods' sessions API answers ``api_off``.
        hf_token: Hugging Face token (secret) for gated repositories, or None.
        weights_bucket: the region's model bucket (name).
        runtime_service_account: Google service account (email) of the runtime pods (reads the bucket).
        weights_service_account: Google service account (email) of the weights Job (writes the bucket);
            None: the Job runs as the runtime's, which then needs write access.
        monitoring_service_account: Google service account (email) of the GMP query frontend and the
            Custom Metrics Stackdriver Adapter (``roles/monitoring.viewer``).
        grafana_admin_password: Grafana's admin password (secret).
        alert_secrets: the alert receivers' secrets for ``profile.alerting``, ``{role of
            infra.node.bundle.services.OPTIONAL_SECRET_FILES: value}``: a plain mapping, or a Pulumi Output
            of one
            (secret); None: none (``infra.k8s.alerting``).
        neg_name: the standalone NEG's name (the same in every zone of the region).
        page_neg_name: the browser client's standalone NEG's name (``infra.k8s.page``).
        resume_router_neg_name: the resume router's standalone NEG's name (``infra.k8s.resume_router``), or
            None: no router, no headless Service and no ``resume_url`` (resumes then reach any pod).
        turn_secret: the TURN REST secret (secret) of the region's TURN gateway (``infra.k8s.turn``), or None:
            no gateway, and the runtime gives WebRTC callers no relay.
        turn_peer_ranges: the pod ranges (CIDRs) coturn may relay to: the region's own (the stack).
        recordings_bucket: the region's recordings bucket (name), which the runtime pods mount and record
            into (``infra.k8s.recordings``), or None: the region does not record.
        turn_source_ranges: the callers' addresses the TURN load balancer admits
            (``loadBalancerSourceRanges``: GKE's firewall rule; Cloud Armor does not cover a passthrough load
            balancer); empty: any.
        turn_address: the region's reserved external IPv4 address (``compute.Address``) its TURN load
            balancers take (``loadBalancerIP``: the UDP and the TLS Service share it, and the DNS record
            of ``turn-<region>.<domain>`` stays put across Service re-creations); None: GKE picks an
            ephemeral one.
        turn_secret_previous: the TURN secret being rotated out (secret): coturn still accepts it; None: none.
        carrier_secrets: the phone carriers' secrets by name (``infra.node.bundle.carriers.CARRIER_SECRETS``;
            secret values): each turns its carrier's bridge on in every pod; {}: every bridge off.
        turn_tls_secret: a ``kubernetes.io/tls`` Secret in ``namespace`` holding the certificate of
            ``turn-<region>.<domain>``: coturn serves TURN over TLS with it (``infra.k8s.turn``); None: UDP
            only.
        waiting_room_s, waiting_room_size: the pods' waiting room (``DUPLEX_WAITING_ROOM_S``,
            ``DUPLEX_WAITING_ROOM_SIZE``; issue 33); either 0: none.
        namespace: the runtime's namespace (``duplex``).
        target_slot_utilization: the HPA's target share of slots in use per pod, 0 < u <= 1 (0.8).
    """

    region: str
    zones: tuple[str, ...]
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
    page_neg_name: str
    redis_url: Any = field(default=None, repr=False)
    hf_token: Any = field(default=None, repr=False)
    alert_secrets: Any = field(default=None, repr=False)
    weights_service_account: Any = None
    turn_secret: Any = field(default=None, repr=False)
    turn_peer_ranges: tuple[str, ...] = ()
    turn_source_ranges: tuple[str, ...] = ()
    recordings_bucket: Any = None
    turn_address: Any = None
    turn_secret_previous: Any = field(default=None, repr=False)
    app_token_keys_json: Any = field(default=None, repr=False)
    carrier_secrets: dict[str, Any] = field(default_factory=dict, repr=False)
    turn_tls_secret: str | None = None
    waiting_room_s: int = 0
    waiting_room_size: int = 0
    resume_router_neg_name: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    target_slot_utilization: float = 0.8

    def __post_init__(self) -> None:
        def bad(name: str, value: Any, allowed: str) -> ValueError:
            return ValueError(f"RegionWorkload.{name}: {value!r} is not allowed; {allowed}")

        if not isinstance(self.profile, NodeProfile):
            raise bad("profile", self.profile, "a NodeProfile (infra.node.profile)")
        checks: list[tuple[str, re.Pattern[str], str]] = [
            ("region", REGION_RE, "a GCP region such as 'us-central1'"),
            ("cluster_name", _CLUSTER_RE, "a GKE cluster name: 1-40 lower-case letters, digits, '-'"),
            ("project", PROJECT_ID_RE, "a GCP project id: 6-30 lower-case letters, digits, '-'"),
            ("namespace", _DNS_LABEL_RE, "a DNS label (lower case, digits, '-', at most 63)"),
            ("neg_name", _GCE_NAME_RE, "a GCE resource name: a letter, then letters, digits, '-' (<= 63)"),
            (
                "page_neg_name",
                _GCE_NAME_RE,
                "a GCE resource name: a letter, then letters, digits, '-' (<= 63)",
            ),
        ]
        if self.resume_router_neg_name is not None:
            checks.append(("resume_router_neg_name", _GCE_NAME_RE, "a GCE resource name (<= 63)"))
        if self.turn_tls_secret is not None:
            checks.append(
                ("turn_tls_secret", _DNS_LABEL_RE, "a Secret name (lower case, digits, '-', <= 63)")
            )
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
        zones = self.zones
        if (
            not isinstance(zones, tuple)
            or not zones
            or len(set(zones)) != len(zones)
            or not all(
                isinstance(z, str) and ZONE_RE.match(z) and z.startswith(self.region + "-") for z in zones
            )
        ):
            raise bad("zones", zones, f"must be a non-empty tuple of distinct zones of {self.region}")
        if self.min_replicas < len(zones):
            raise bad(
                "min_replicas",
                self.min_replicas,
                f"must be >= the number of zones ({len(zones)}): one runtime pod in every zone, or GKE "
                "makes no NEG there and the load balancer's backend for that zone is missing",
            )
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
        for name in ("weights_bucket", "recordings_bucket"):
            value = getattr(self, name)
            if isinstance(value, str) and not _BUCKET_RE.match(value):
                raise bad(name, value, "must be a Cloud Storage bucket name")
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


def weights_dir(workload: RegionWorkload) -> str:
    """The model's directory on the mounted bucket: ``/models/<Hugging Face repo id>``
    (``/models/nvidia/personaplex-7b-v1``): ``DUPLEX_WEIGHTS`` of the runtime."""
    return f"{MODELS_MOUNT}/{workload.weights_repo}"


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


def gcsfuse_volume(workload: RegionWorkload, *, read_only: bool) -> dict[str, Any]:
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


GCSFUSE_ANNOTATIONS = {
    "gke-gcsfuse/volumes": "true",
    # The sidecar without CPU, memory or ephemeral-storage limits ("0"): a 15 GiB checkpoint read at start
    # is not throttled (GKE: "Configure resources for the sidecar container").
    "gke-gcsfuse/cpu-limit": "0",
    "gke-gcsfuse/memory-limit": "0",
    "gke-gcsfuse/ephemeral-storage-limit": "0",
}
