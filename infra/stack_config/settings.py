"""What the program takes from the stack's configuration: ``StackConfig`` and the settings of each
topology (``GceSettings``, ``OnPremSettings``, ``MultiRegionSettings`` with its ``RegionSettings``), the
names of the configuration (namespaces, topologies, secret keys) and ``StackConfigError``. Built by
``infra.stack_config.keys`` and its ``keys_*`` modules; docs/stack-configuration.md.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, SecretStr

from infra.node.profile.profiles import NodeProfile, get_profile

__all__ = [
    "BUILT_TOPOLOGIES",
    "GCP_NAMESPACE",
    "NAMESPACE",
    "PLACEHOLDER_IMAGE",
    "SECRET_KEYS",
    "TOPOLOGIES",
    "GceSettings",
    "MaintenanceWindow",
    "MultiRegionSettings",
    "OnPremSettings",
    "RecordingSettings",
    "RegionSettings",
    "StackConfig",
    "StackConfigError",
    "StackSecretsConfig",
    "Topology",
]

NAMESPACE = "duplexops"
"""The project's configuration namespace (the project name in Pulumi.yaml)."""
GCP_NAMESPACE = "gcp"

Topology = Literal["gce-node", "onprem-node", "multi-region"]
TOPOLOGIES: tuple[str, ...] = get_args(Topology)
"""Every topology name the program knows."""
BUILT_TOPOLOGIES: tuple[str, ...] = TOPOLOGIES
"""The topologies this program can deploy today."""

PLACEHOLDER_IMAGE = "registry.invalid/duplexops/runtime@sha256:" + "0" * 64
"""Image used to validate the profile and the bundle before the real digest is known."""

SECRET_KEYS: frozenset[str] = frozenset(
    {
        "redisPassword",
        "grafanaAdminPassword",
        "tokenSigningKeys",
        "hfToken",
        "onpremSshPrivateKey",
        "alertEmailPassword",
        "alertPagerdutyRoutingKey",
        "turnSecret",
        "turnSecretPrevious",
    }
)
"""Keys whose values are secrets: they must be set with ``pulumi config set --secret``."""


class StackConfigError(ValueError):
    """The stack's configuration is wrong; ``problems`` lists every problem, one line each (the key, the
    bad value and what is allowed)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(
            f"invalid stack configuration ({len(self.problems)} problem"
            f"{'s' if len(self.problems) != 1 else ''}):\n  - " + "\n  - ".join(self.problems)
        )


# --- what the program takes ------------------------------------------------------------------------------


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StackSecretsConfig(_Frozen):
    """Secrets given in the stack's configuration (None: generated, or absent for ``hf_token``)."""

    redis_password: SecretStr | None = None
    grafana_admin_password: SecretStr | None = None
    token_keys: SecretStr | None = None
    """JSON ``{"kid": "secret", ...}``."""
    hf_token: SecretStr | None = None
    alert_email_password: SecretStr | None = None
    """The SMTP password of the e-mail alert receiver (``alertEmailPassword``)."""
    alert_pagerduty_routing_key: SecretStr | None = None
    """The PagerDuty Events API v2 routing key (``alertPagerdutyRoutingKey``)."""
    turn_secret: SecretStr | None = None
    """The TURN REST shared secret (``turnSecret``: coturn's ``static-auth-secret``, the runtime's
    ``DUPLEX_TURN_SECRET``); None: generated."""
    turn_secret_previous: SecretStr | None = None
    """The TURN secret being rotated out (``turnSecretPrevious``): coturn still accepts it; None: none."""
    carrier_secrets: dict[str, SecretStr] = {}
    """The phone carriers' secrets that are set, by name (``infra.node.bundle.carriers.CARRIER_SECRETS``: the
    stack keys ``twilioAuthToken``, ``plivoAuthToken``, ``telnyxStreamToken``, ``exotelApiKey``,
    ``exotelApiToken``); a carrier without its secret has its bridge off."""


class GceSettings(_Frozen):
    """Where and on what a GCE node runs."""

    project: str
    region: str
    zone: str
    machine_type: str
    accelerator_type: str | None
    """GCE accelerator type to attach (N1 types); None when the machine type comes with its GPU."""
    accelerator_count: int
    boot_disk_gb: int
    boot_disk_type: str
    data_disk_gb: int = 100
    """Size of the node's persistent data disk (GB; model cache, Redis, Prometheus, Grafana), kept across
    VM replacements (``infra.node.bundle.rollout``)."""
    public_source_ranges: tuple[str, ...]
    subnet_cidr: str
    enable_apis: bool
    usd_per_hour: float | None
    price_source: str | None
    price_read_on: str | None
    provisioning_model: str = "standard"
    """``standard``, ``spot`` or ``flex-start`` (``infra.capacity.gcp.PROVISIONING_MODELS``), one the machine
    type is sold as."""
    bundled_local_ssd: bool = False
    """GCE attaches Local SSDs to this machine type by itself (A2 Ultra, A3)."""
    dns_zone: str | None = None
    """A Cloud DNS managed zone of ``project`` (``dnsZone``): the stack makes the A record of the node's
    domain (nginx and coturn share that name) in it; None: the operator makes it by hand."""


class OnPremSettings(_Frozen):
    """How to reach and install an existing GPU host."""

    host: str
    user: str
    port: int
    ssh_private_key: SecretStr
    host_key: str
    install_dir: str
    runtime_image: str
    """The digest-pinned image the host runs (``runtimeImage``, promoted by CI)."""
    ready_timeout_s: int


class RegionSettings(_Frozen):
    """One region of the multi-region stack: a GKE cluster, its GPU node pool and its Memorystore.

    Attributes:
        region: GCP region (``us-central1``).
        zones: zones of the GPU node pool (inside ``region``).
        profile: the runtime's profile in this region (its GPU; ``sessions`` = slots per pod, from the
            capacity planner unless ``maxSessions`` is set).
        machine_type: GPU node machine type; accelerator_type: GKE/GCE accelerator name
            (``nvidia-a100-80gb``); accelerator_count: GPUs per node (1: one runtime pod per node).
        min_nodes, max_nodes: autoscaling bounds of the GPU pool (= runtime pods).
        redis_memory_gb: Memorystore capacity (GB).
        network_index: picks the address ranges (``subnet_cidr``, ``pods_cidr``, ``services_cidr``,
            ``master_cidr``); stable across edits.
        serving: False when the region is drained (the global entry gives it no capacity).
        usd_per_hour: on-demand price of one GPU node (catalog, us-central1 list price), or None.
    """

    region: str
    zones: tuple[str, ...]
    profile: NodeProfile
    machine_type: str
    accelerator_type: str
    accelerator_count: int
    min_nodes: int
    max_nodes: int
    redis_memory_gb: int
    network_index: int
    serving: bool
    usd_per_hour: float | None
    price_source: str | None

    @property
    def subnet_cidr(self) -> str:
        """Nodes' primary range: ``10.<64+index>.0.0/20`` (4,096 addresses)."""
        return f"10.{64 + self.network_index}.0.0/20"

    @property
    def pods_cidr(self) -> str:
        """Pods' secondary range: ``10.<128+index>.0.0/17`` (VPC-native; NEG endpoints are pod IPs)."""
        return f"10.{128 + self.network_index}.0.0/17"

    @property
    def services_cidr(self) -> str:
        """Services' secondary range: ``10.<128+index>.128.0/20``."""
        return f"10.{128 + self.network_index}.128.0/20"

    @property
    def master_cidr(self) -> str:
        """The private control plane's /28: ``172.16.<index>.0/28``."""
        return f"172.16.{self.network_index}.0/28"


class MaintenanceWindow(_Frozen):
    """When GKE may upgrade and repair the clusters and their node pools: ``hours`` from ``start`` (UTC,
    ``HH:MM``) on each of ``days`` (RFC 5545 weekdays ``MO``..``SU``), every week. Outside it GKE does no
    non-emergency maintenance (cloud.google.com/kubernetes-engine/docs/concepts/maintenance-windows-and-
    exclusions). The keys check GKE's rule: at least 48 h of window in any 32 days, 4 h or more at a time."""

    start: str
    hours: int
    days: tuple[str, ...]

    ANCHOR_DATE: ClassVar[str] = "2025-01-06"
    """A fixed Monday: the window's first occurrence (only its time of day and length matter to GKE; a fixed
    date keeps the cluster's inputs the same at every ``pulumi up``)."""

    def recurring_window(self) -> dict[str, str]:
        """The cluster's ``maintenance_policy.recurring_window``: ``start_time`` and ``end_time`` (RFC 3339,
        UTC) of the first occurrence and ``recurrence`` (``FREQ=WEEKLY;BYDAY=SA,SU``)."""
        start = datetime.fromisoformat(f"{self.ANCHOR_DATE}T{self.start}:00+00:00")
        end = start + timedelta(hours=self.hours)
        return {
            "start_time": start.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "end_time": end.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "recurrence": f"FREQ=WEEKLY;BYDAY={','.join(self.days)}",
        }


class RecordingSettings(_Frozen):
    """Recordings on the multi-region stack (``duplexops:recordings``): ``enabled``: each region gets a
    recordings bucket its runtime pods mount; ``retention_days``: its lifecycle rule's age, the profile's
    transcript retention rounded up to days (``infra.stack_config.recordings``)."""

    enabled: bool = False
    retention_days: int = 7


class MultiRegionSettings(_Frozen):
    """The multi-region stack: one GKE cluster per region behind one global HTTPS load balancer."""

    project: str
    regions: tuple[RegionSettings, ...]
    public_source_ranges: tuple[str, ...]
    admin_source_ranges: tuple[str, ...]
    release_channel: str
    deletion_protection: bool
    system_machine_type: str
    enable_apis: bool
    maintenance_window: MaintenanceWindow
    recordings: RecordingSettings = RecordingSettings()
    dns_zone: str | None = None
    """A Cloud DNS managed zone of ``project`` (``dnsZone``): the stack makes the A records of ``domain``
    (the global address) and of each region's ``turn-<region>.<domain>`` (its TURN address) in it; None:
    the operator makes them by hand from the outputs."""
    turn_tls_secret: str | None = None
    """The ``kubernetes.io/tls`` Secret (``turnTlsSecret``) in each region's runtime namespace holding the
    certificate of ``turn-<region>.<domain>``: coturn serves TURN over TLS (5349/tcp) with it; None: TURN
    over UDP only."""
    waiting_room_s: int = 0
    """How long (s) a caller may wait in a pod's waiting room for a slot (``waitingRoomS``; 0: none): the
    runtime's ``DUPLEX_WAITING_ROOM_S``."""
    waiting_room_size: int = 0
    """Callers that may wait at once per pod (``waitingRoomSize``; the pod's slots unless set): the
    runtime's ``DUPLEX_WAITING_ROOM_SIZE``."""


class StackConfig(_Frozen):
    """One stack's validated configuration.

    Attributes:
        stack: the stack name; project: the Pulumi project name.
        topology: what to deploy (``gce-node``, ``onprem-node`` or ``multi-region``).
        name_prefix: prefix of cloud resource names (lower case, ``-``).
        profile_name, profile_overrides: the node profile and what the stack changes in it.
        profile: the validated profile (with a placeholder ``runtime_image``: use ``node_profile``).
        domain: the endpoint's DNS name, or None (the endpoint is the IP address).
        runtime_image: the digest-pinned runtime image CI built for this update (``duplexops:runtimeImage``),
            or None (a cloud topology then builds it).
        gce, onprem, multi_region: the topology's settings (the others are None).
        secrets: secrets from the configuration.
    """

    stack: str
    project: str
    topology: Topology
    name_prefix: str
    profile_name: str
    profile_overrides: dict[str, Any]
    profile: NodeProfile
    domain: str | None
    runtime_image: str | None = None
    gce: GceSettings | None = None
    onprem: OnPremSettings | None = None
    multi_region: MultiRegionSettings | None = None
    secrets: StackSecretsConfig = StackSecretsConfig()

    def node_profile(self, runtime_image: str) -> NodeProfile:
        """The node's profile running ``runtime_image`` (validated again: same overrides)."""
        return get_profile(self.profile_name, **{**self.profile_overrides, "runtime_image": runtime_image})
