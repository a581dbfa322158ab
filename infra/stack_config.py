"""The stack's configuration, typed and validated before any resource is declared.

``load_stack_config()`` reads the ``duplexops:*`` keys (and ``gcp:project``/``gcp:region``/``gcp:zone`` for
a GCE node) from Pulumi's configuration and returns a ``StackConfig``; ``parse_stack_config`` does the same
from a plain mapping (tests, tools). Every problem found is collected and raised at once as one
``StackConfigError`` whose lines each name the key, the bad value and what is allowed.

Keys (``pulumi config set <key> <value>``; secrets with ``--secret``):

======================  ===================  ==========================================================
key                     topologies           meaning (default)
======================  ===================  ==========================================================
topology                all                  ``gce-node``, ``onprem-node``, ``multi-region``
profile                 all                  node profile (``infra.node.profile``): t4-int8, a100-80gb, l40s
maxSessions             all                  sessions per node (the profile's; planner-checked)
gpu                     all                  override the profile's GPU (capacity-planner key)
domain                  all                  DNS name of the endpoint (none: the IP address)
namePrefix              all                  prefix of cloud resource names (``duplex-<stack>``)
redisPassword           all (secret)         Redis password (generated when absent)
grafanaAdminPassword    all (secret)         Grafana admin password (generated when absent)
tokenSigningKeys        all (secret)         session-token keys, JSON {"kid": "secret"} (one generated)
hfToken                 all (secret)         Hugging Face token for gated weights (none)
machineType             gce-node             GCE machine type (the capacity catalog's for the GPU)
bootDiskSizeGb          gce-node             boot disk size in GB (200)
bootDiskType            gce-node             pd-balanced or pd-ssd (pd-balanced)
publicSourceRanges      gce-node (required)  IPv4 CIDRs allowed to reach 80/443 (no default)
subnetCidr              gce-node             the node's private subnet (10.64.0.0/24)
enableApis              gce-node             enable the Google APIs the stack uses (true)
onpremHost              onprem-node (req.)   host name or IP address of the GPU host
onpremUser              onprem-node (req.)   SSH user (root, or a user with passwordless sudo)
onpremPort              onprem-node          SSH port (22)
onpremSshPrivateKey     onprem-node (secret, required)  the SSH private key
onpremHostKey           onprem-node          the host's public SSH key (pins it; none: not checked)
installDir              onprem-node          where the bundle goes (/opt/duplex; destroy removes it)
runtimeImage            onprem-node (req.)   digest-pinned runtime image (repo@sha256:...)
readyTimeoutSeconds     onprem-node          how long to wait for /readyz (1800)
regions                 multi-region (req.)  list of regions (``RegionSettings``; keys below)
adminSourceRanges       multi-region (req.)  IPv4 CIDRs allowed to reach the GKE control planes
releaseChannel          multi-region         GKE release channel: RAPID, REGULAR, STABLE (REGULAR)
deletionProtection      multi-region         refuse to delete clusters (true; false to destroy)
systemMachineType       multi-region         machine type of the CPU pool for system pods (e2-standard-4)
======================  ===================  ==========================================================

``publicSourceRanges`` (required) and ``enableApis`` also apply to ``multi-region``: the Cloud Armor policy
of the global entry admits only those ranges. ``domain`` is required there (Google-managed certificate).

Each item of ``regions`` (a YAML list of mappings):

================  ==========================================================================================
key               meaning (default)
================  ==========================================================================================
region            GCP region, e.g. ``us-central1`` (required, unique)
zones             zones of the GPU node pool, in the region, e.g. ``[us-central1-a, us-central1-c]`` (req.)
gpu               capacity-planner GPU key (the profile's); the region's slots per pod follow from it
machineType       GPU node machine type (the capacity catalog's default for the GPU)
minNodes          GPU nodes (= runtime pods, one GPU each) kept at least (1)
maxNodes          GPU nodes at most, the autoscaling bound (4)
redisMemoryGb     Memorystore size in GB (1)
networkIndex      0-31, picks the region's address ranges (its position in the list); never change it
serving           false drains the region: the global entry sends it no new callers (true)
================  ==========================================================================================
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, SecretStr, ValidationError

from infra.capacity import gcp as gcp_catalog
from infra.node.profile import PROFILES, NodeProfile, get_profile
from infra.node.services import NodeSecrets
from runtime.tokens import keys_from_mapping

__all__ = [
    "BUILT_TOPOLOGIES",
    "GCP_NAMESPACE",
    "NAMESPACE",
    "SECRET_KEYS",
    "TOPOLOGIES",
    "GceSettings",
    "OnPremSettings",
    "StackConfig",
    "StackConfigError",
    "StackSecretsConfig",
    "load_stack_config",
    "parse_stack_config",
]

NAMESPACE = "duplexops"
"""The project's configuration namespace (the project name in Pulumi.yaml)."""
GCP_NAMESPACE = "gcp"

Topology = Literal["gce-node", "onprem-node", "multi-region"]
TOPOLOGIES: tuple[str, ...] = ("gce-node", "onprem-node", "multi-region")
"""Every topology name the program knows."""
BUILT_TOPOLOGIES: tuple[str, ...] = TOPOLOGIES
"""The topologies this program can deploy today."""

PLACEHOLDER_IMAGE = "registry.invalid/duplexops/runtime@sha256:" + "0" * 64
"""Image used to validate the profile and the bundle before the real digest is known."""

_COMMON_KEYS = (
    "topology",
    "profile",
    "maxSessions",
    "gpu",
    "domain",
    "namePrefix",
    "redisPassword",
    "grafanaAdminPassword",
    "tokenSigningKeys",
    "hfToken",
)
_GCE_KEYS = (
    "machineType",
    "bootDiskSizeGb",
    "bootDiskType",
    "publicSourceRanges",
    "subnetCidr",
    "enableApis",
    "provisioningModel",
)
_ONPREM_KEYS = (
    "onpremHost",
    "onpremUser",
    "onpremPort",
    "onpremSshPrivateKey",
    "onpremHostKey",
    "installDir",
    "runtimeImage",
    "readyTimeoutSeconds",
)
_MULTI_REGION_KEYS = (
    "regions",
    "adminSourceRanges",
    "releaseChannel",
    "deletionProtection",
    "systemMachineType",
)
_MULTI_REGION_SHARED_KEYS = ("publicSourceRanges", "enableApis")
"""gce-node keys that also apply to multi-region."""
KNOWN_KEYS: tuple[str, ...] = _COMMON_KEYS + _GCE_KEYS + _ONPREM_KEYS + _MULTI_REGION_KEYS
SECRET_KEYS: frozenset[str] = frozenset(
    {"redisPassword", "grafanaAdminPassword", "tokenSigningKeys", "hfToken", "onpremSshPrivateKey"}
)
"""Keys whose values are secrets: they must be set with ``pulumi config set --secret``."""
_GCP_KEYS = ("project", "region", "zone")

_BOOT_DISK_TYPES = ("pd-balanced", "pd-ssd")
_BOOT_DISK_GB = (100, 4096)
_READY_TIMEOUT_S = (60, 7200)
_NAME_PREFIX_RE = re.compile(r"^[a-z][a-z0-9-]{1,19}[a-z0-9]$")
_PROJECT_RE = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
_REGION_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
_ZONE_RE = re.compile(r"^([a-z]+-[a-z]+[0-9]+)-[a-z]$")
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_HOST_RE = re.compile(
    r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$"
)
_SAFE_DIR_RE = re.compile(r"^(/[A-Za-z0-9._-]+){2,}$")
_FORBIDDEN_INSTALL_DIRS = frozenset({"/usr/local", "/var/lib", "/var/tmp", "/opt/local", "/home"})
_IMAGE_RE = re.compile(
    r"^[a-z0-9]+([._-][a-z0-9]+)*(\.[a-z0-9-]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?@sha256:[0-9a-f]{64}$"
)


class StackConfigError(ValueError):
    """The stack's configuration is wrong; ``problems`` lists every problem, one line each (the key, the
    bad value and what is allowed)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(
            f"invalid stack configuration ({len(self.problems)} problem"
            f"{'s' if len(self.problems) != 1 else ''}):\n  - " + "\n  - ".join(self.problems)
        )


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StackSecretsConfig(_Frozen):
    """Secrets given in the stack's configuration (None: generated, or absent for ``hf_token``)."""

    redis_password: SecretStr | None = None
    grafana_admin_password: SecretStr | None = None
    token_keys: SecretStr | None = None
    """JSON ``{"kid": "secret", ...}``."""
    hf_token: SecretStr | None = None


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


class OnPremSettings(_Frozen):
    """How to reach and install an existing GPU host."""

    host: str
    user: str
    port: int
    ssh_private_key: SecretStr
    host_key: str | None
    install_dir: str
    runtime_image: str
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


class StackConfig(_Frozen):
    """One stack's validated configuration.

    Attributes:
        stack: the stack name; project: the Pulumi project name.
        topology: what to deploy (``gce-node`` or ``onprem-node``).
        name_prefix: prefix of cloud resource names (lower case, ``-``).
        profile_name, profile_overrides: the node profile and what the stack changes in it.
        profile: the validated profile (with a placeholder ``runtime_image``: use ``node_profile``).
        domain: the endpoint's DNS name, or None (the endpoint is the IP address).
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
    gce: GceSettings | None = None
    onprem: OnPremSettings | None = None
    multi_region: MultiRegionSettings | None = None
    secrets: StackSecretsConfig = StackSecretsConfig()

    def node_profile(self, runtime_image: str) -> NodeProfile:
        """The node's profile running ``runtime_image`` (validated again: same overrides)."""
        return get_profile(self.profile_name, **{**self.profile_overrides, "runtime_image": runtime_image})


# --- reading Pulumi's configuration -----------------------------------------------------------------------


def load_stack_config() -> StackConfig:
    """The current stack's configuration from Pulumi (program start, before any resource).

    Raises:
        StackConfigError: every problem found, one line each.
    """
    import pulumi
    from pulumi.runtime import config as runtime_config

    values: dict[str, str] = {}
    for namespace, keys in ((NAMESPACE, KNOWN_KEYS), (GCP_NAMESPACE, _GCP_KEYS)):
        bag = pulumi.Config(namespace)
        for key in keys:
            value = bag.get(key)
            if value is not None:
                values[f"{namespace}:{key}"] = value
    # Keys set in the stack but unknown here (typos): every key Pulumi passed to the program.
    present: set[str] = set()
    try:
        present |= set(runtime_config.get_config_env())
        present |= set(runtime_config.CONFIG.get())
    except Exception:  # the SDK's internals moved: skip the typo check rather than fail
        present = set()
    secret_keys = set(runtime_config.get_config_secret_keys_env()) | {
        f"{NAMESPACE}:{k}" for k in SECRET_KEYS if runtime_config.is_config_secret(f"{NAMESPACE}:{k}")
    }
    secrets_known = "PULUMI_CONFIG_SECRET_KEYS" in os.environ or bool(secret_keys)
    return parse_stack_config(
        values,
        stack=pulumi.get_stack(),
        project=pulumi.get_project(),
        secret_keys=secret_keys if secrets_known else None,
        present_keys=present,
    )


def parse_stack_config(
    values: Mapping[str, str],
    *,
    stack: str,
    project: str = NAMESPACE,
    secret_keys: set[str] | frozenset[str] | None = None,
    present_keys: set[str] | None = None,
) -> StackConfig:
    """Validate ``values`` (``{"duplexops:topology": "gce-node", "gcp:project": ...}``, strings as Pulumi
    gives them; lists as JSON) for stack ``stack``.

    Args:
        secret_keys: the full keys Pulumi holds as secrets; a secret key outside it is reported as set in
            plain text. None: not known (no check).
        present_keys: every full key of the stack's configuration; unknown ``duplexops:`` keys are
            reported. None: ``values``' own keys.

    Raises:
        StackConfigError: every problem found.
    """
    reader = _Reader(values, secret_keys)
    problems = reader.problems
    for full_key in sorted(set(present_keys or ()) | set(values)):
        namespace, _, key = full_key.partition(":")
        if namespace == NAMESPACE and key not in KNOWN_KEYS:
            problems.append(f"{full_key}: unknown key; allowed keys: {', '.join(KNOWN_KEYS)}")

    topology = reader.choice("topology", TOPOLOGIES, required=True)
    name_prefix = reader.string(
        "namePrefix",
        default=_default_prefix(stack),
        pattern=_NAME_PREFIX_RE,
        allowed="3-21 characters: lower case letters, digits and '-', starting with a letter",
    )

    # Keys of another topology.
    own = {
        "gce-node": _GCE_KEYS,
        "onprem-node": _ONPREM_KEYS,
        "multi-region": _MULTI_REGION_KEYS + _MULTI_REGION_SHARED_KEYS,
    }.get(topology or "", ())
    if topology is not None:
        topology_keys = set(_GCE_KEYS + _ONPREM_KEYS + _MULTI_REGION_KEYS)
        if topology == "multi-region":
            # Memorystore makes its own AUTH string: a configured Redis password would never be used.
            topology_keys.add("redisPassword")
        for key in sorted(topology_keys - set(own)):
            if f"{NAMESPACE}:{key}" in values:
                common = [k for k in _COMMON_KEYS if k not in topology_keys]
                problems.append(
                    f"{NAMESPACE}:{key}: does not apply to topology {topology!r}; remove it "
                    f"(its keys: {', '.join(own)}; common keys: {', '.join(common)})"
                )

    secrets = StackSecretsConfig(
        redis_password=reader.password("redisPassword"),
        grafana_admin_password=reader.password("grafanaAdminPassword"),
        token_keys=reader.token_keys("tokenSigningKeys"),
        hf_token=reader.secret("hfToken", pattern=re.compile(r"^\S{8,512}$"), allowed="a token, no spaces"),
    )

    profile_name = reader.choice("profile", tuple(_compose_profiles()), required=True)
    domain = reader.string("domain")
    overrides: dict[str, Any] = {}
    max_sessions = reader.integer("maxSessions", bounds=(1, 256))
    if max_sessions is not None:
        overrides["max_sessions"] = max_sessions
    gpu = reader.string("gpu")
    if gpu is not None:
        overrides["gpu"] = gpu
    if domain is not None:
        overrides["domain"] = domain

    gce = onprem = multi_region = None
    if topology == "multi-region" and domain is None:
        reader.missing(
            "domain", NAMESPACE, "the DNS name of the global endpoint (its managed certificate is for it)"
        )
    if topology == "onprem-node":
        onprem = _onprem_settings(reader)
        if onprem is not None:
            # Everything the stack installs lives under installDir (destroy removes it): the TLS pair too.
            overrides["tls"] = {
                "certificate_path": f"{onprem.install_dir}/tls/node.crt",
                "private_key_path": f"{onprem.install_dir}/tls/node.key",
            }

    profile = None
    if profile_name is not None:
        profile = _profile(reader, profile_name, overrides)
    if topology == "gce-node":
        gce = _gce_settings(reader, profile)
    if topology == "multi-region" and profile_name is not None:
        multi_region = _multi_region_settings(reader, profile_name, overrides)
    if profile is not None and topology != "multi-region":
        _check_bundle(reader, profile)

    if problems:
        raise StackConfigError(problems)
    assert topology in BUILT_TOPOLOGIES and profile is not None and profile_name is not None
    return StackConfig(
        stack=stack,
        project=project,
        topology=topology,  # type: ignore[arg-type]
        name_prefix=name_prefix or _default_prefix(stack),
        profile_name=profile_name,
        profile_overrides=overrides,
        profile=profile,
        domain=domain,
        gce=gce,
        onprem=onprem,
        multi_region=multi_region,
        secrets=secrets,
    )


# --- the pieces ----------------------------------------------------------------------------------------


def _compose_profiles() -> list[str]:
    """Profiles a stack can deploy: GPU nodes run by Compose (the local CPU node is not one)."""
    return [name for name, p in PROFILES.items() if p.deployment == "compose" and p.gpu is not None]


def _gcp_profiles() -> list[str]:
    return [p for p in _compose_profiles() if PROFILES[p].gpu in gcp_catalog.GCP_GPUS]


def _default_prefix(stack: str) -> str:
    cleaned = re.sub(r"[^a-z0-9-]+", "-", stack.lower()).strip("-")
    prefix = f"duplex-{cleaned}"[:21].rstrip("-")
    return prefix if _NAME_PREFIX_RE.match(prefix) else "duplex"


def _profile(reader: _Reader, profile_name: str, overrides: dict[str, Any]) -> NodeProfile | None:
    try:
        return get_profile(profile_name, **{**overrides, "runtime_image": PLACEHOLDER_IMAGE})
    except ValidationError as exc:
        for error in exc.errors():
            reader.problems.append(_profile_problem(profile_name, overrides, error))
    except (KeyError, ValueError) as exc:
        reader.problems.append(f"{NAMESPACE}:profile: {exc}")
    return None


_FIELD_KEYS = {"max_sessions": "maxSessions", "gpu": "gpu", "domain": "domain"}


def _profile_problem(profile_name: str, overrides: dict[str, Any], error: Any) -> str:
    message = str(error.get("msg", error)).removeprefix("Value error, ")
    loc = tuple(error.get("loc") or ())
    field = str(loc[0]) if loc else ""
    if not field and message.startswith("max_sessions"):
        field = "max_sessions"
    key = _FIELD_KEYS.get(field)
    if key is None:
        return f"{NAMESPACE}:profile: {profile_name!r} is not valid with this stack's settings: {message}"
    return f"{NAMESPACE}:{key}: {overrides.get(field)!r} rejected for profile {profile_name!r}: {message}"


def _gcp_project(reader: _Reader) -> str | None:
    return reader.string(
        "project",
        namespace=GCP_NAMESPACE,
        required=True,
        pattern=_PROJECT_RE,
        allowed="a Google Cloud project id (6-30 lower case letters, digits, '-')",
    )


def _gce_settings(reader: _Reader, profile: NodeProfile | None) -> GceSettings | None:
    problems = reader.problems
    start = len(problems)
    project = _gcp_project(reader)
    region = reader.string(
        "region",
        namespace=GCP_NAMESPACE,
        required=True,
        pattern=_REGION_RE,
        allowed="a region such as us-central1",
    )
    zone = reader.string(
        "zone",
        namespace=GCP_NAMESPACE,
        required=True,
        pattern=_ZONE_RE,
        allowed="a zone such as us-central1-a",
    )
    if region and zone and not zone.startswith(region + "-"):
        problems.append(
            f"{GCP_NAMESPACE}:zone: {zone!r} is not in gcp:region {region!r}; allowed: {region}-a, ..."
        )
    machine_type = reader.string("machineType")
    gpu = profile.gpu if profile is not None else None
    mt = None
    if gpu is not None and gpu not in gcp_catalog.GCP_GPUS:
        problems.append(
            f"{NAMESPACE}:profile: the profile's GPU {gpu!r} is not offered on GCP (on-premises only); "
            f"allowed on gce-node: GPUs {', '.join(sorted(gcp_catalog.GCP_GPUS))} "
            f"(profiles: {', '.join(_gcp_profiles())})"
        )
        gpu = None
    if machine_type is None and gpu is not None:
        machine_type = gcp_catalog.DEFAULT_MACHINE_TYPE[gpu]
    if machine_type is not None:
        if machine_type not in gcp_catalog.MACHINE_TYPES:
            problems.append(
                f"{NAMESPACE}:machineType: unknown machine type {machine_type!r}; allowed: "
                + ", ".join(gcp_catalog.machine_types_for(gpu) if gpu else sorted(gcp_catalog.MACHINE_TYPES))
            )
        else:
            mt = gcp_catalog.MACHINE_TYPES[machine_type]
            if gpu is not None:
                why = gcp_catalog.carry_problem(machine_type, gpu)
                if why:
                    problems.append(
                        f"{NAMESPACE}:machineType: {machine_type!r} cannot carry the GPU of profile "
                        f"{profile.name if profile else '?'!r}: {why}; allowed: "
                        f"{', '.join(gcp_catalog.machine_types_for(gpu))}"
                    )
    boot_disk_gb = reader.integer("bootDiskSizeGb", bounds=_BOOT_DISK_GB, default=200)
    boot_disk_type = reader.choice("bootDiskType", _BOOT_DISK_TYPES, default="pd-balanced")
    ranges = reader.cidr_list("publicSourceRanges", required=True)
    subnet = reader.string("subnetCidr", default="10.64.0.0/24")
    if subnet is not None:
        try:
            network = ipaddress.IPv4Network(subnet)
            if not network.is_private or network.prefixlen > 29:
                raise ValueError
        except ValueError:
            problems.append(
                f"{NAMESPACE}:subnetCidr: {subnet!r} is not a private IPv4 network; allowed: an RFC 1918 "
                "CIDR of /29 or larger, e.g. 10.64.0.0/24"
            )
    enable_apis = reader.boolean("enableApis", default=True)
    provisioning = reader.choice(
        "provisioningModel", tuple(gcp_catalog.PROVISIONING_MODELS), default="standard"
    )
    if provisioning is not None and mt is not None:
        why_not = gcp_catalog.provisioning_problem(mt.name, provisioning)
        if why_not:
            # GCE refuses the VM at create time (a3-highgpu-1g: Spot and Flex-start only).
            problems.append(
                f"{NAMESPACE}:provisioningModel: {provisioning!r} for machine type {mt.name!r}: {why_not}; "
                f"allowed: {', '.join(mt.sold_as)}"
            )
    if len(problems) > start or mt is None:
        return None
    assert project and region and zone and boot_disk_gb and boot_disk_type and subnet
    return GceSettings(
        project=project,
        region=region,
        zone=zone,
        machine_type=mt.name,
        accelerator_type=None if mt.bundled else gcp_catalog.ACCELERATOR_TYPES[mt.gpu or ""],
        accelerator_count=mt.gpu_count[0],
        boot_disk_gb=boot_disk_gb,
        boot_disk_type=boot_disk_type,
        public_source_ranges=tuple(ranges or ()),
        subnet_cidr=subnet,
        enable_apis=bool(enable_apis),
        usd_per_hour=mt.price.usd_per_hour if mt.price else None,
        price_source=mt.price.source if mt.price else None,
        price_read_on=mt.price.read_on if mt.price else None,
        provisioning_model=provisioning or "standard",
        bundled_local_ssd=mt.bundled_local_ssd,
    )


_RELEASE_CHANNELS = ("RAPID", "REGULAR", "STABLE")
_REGION_KEYS = (
    "region",
    "zones",
    "gpu",
    "machineType",
    "minNodes",
    "maxNodes",
    "redisMemoryGb",
    "networkIndex",
    "serving",
)
_NODES_BOUNDS = (0, 100)
_REDIS_GB_BOUNDS = (1, 300)
_NETWORK_INDEX_BOUNDS = (0, 31)


def _multi_region_settings(
    reader: _Reader, profile_name: str, overrides: dict[str, Any]
) -> MultiRegionSettings | None:
    problems = reader.problems
    start = len(problems)
    project = _gcp_project(reader)
    public = reader.cidr_list("publicSourceRanges", required=True)
    admin = reader.cidr_list("adminSourceRanges", required=True)
    channel = reader.choice("releaseChannel", _RELEASE_CHANNELS, default="REGULAR")
    deletion_protection = reader.boolean("deletionProtection", default=True)
    system_machine_type = reader.string(
        "systemMachineType",
        default="e2-standard-4",
        pattern=re.compile(r"^[a-z][a-z0-9]*-[a-z]+-[0-9]+$"),
        allowed="a GCE machine type such as e2-standard-4",
    )
    enable_apis = reader.boolean("enableApis", default=True)
    regions = _regions(reader, profile_name, overrides)
    if len(problems) > start or regions is None:
        return None
    assert project and public and admin and channel and system_machine_type
    return MultiRegionSettings(
        project=project,
        regions=tuple(regions),
        public_source_ranges=tuple(public),
        admin_source_ranges=tuple(admin),
        release_channel=channel,
        deletion_protection=bool(deletion_protection),
        system_machine_type=system_machine_type,
        enable_apis=bool(enable_apis),
    )


def _regions(reader: _Reader, profile_name: str, overrides: dict[str, Any]) -> list[RegionSettings] | None:
    """Parse ``regions`` (a JSON list of mappings), each problem naming ``regions[i].<key>``."""
    key = f"{NAMESPACE}:regions"
    example = '[{"region": "us-central1", "zones": ["us-central1-a"], "minNodes": 1, "maxNodes": 4}, ...]'
    raw = reader.raw("regions")
    if raw is None:
        reader.missing("regions", NAMESPACE, f"a list of regions, e.g. {example}")
        return None
    try:
        items = json.loads(raw)
    except ValueError:
        items = None
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        reader.problems.append(f"{key}: {raw!r} is not valid; allowed: mappings, {example}")
        return None
    regions: list[RegionSettings] = []
    seen_regions: dict[str, int] = {}
    seen_indexes: dict[int, int] = {}
    for i, item in enumerate(items):
        region = _region(reader, f"{key}[{i}]", i, item, profile_name, overrides)
        if region is None:
            continue
        for value, seen, what in (
            (region.region, seen_regions, "region"),
            (region.network_index, seen_indexes, "networkIndex"),
        ):
            if value in seen:
                reader.problems.append(
                    f"{key}[{i}].{what}: {value!r} is already used by regions[{seen[value]}]; allowed: each "
                    f"{what} once"
                )
            seen[value] = i  # type: ignore[index]
        regions.append(region)
    return regions if len(regions) == len(items) else None


def _region(
    reader: _Reader,
    where: str,
    position: int,
    item: dict[str, Any],
    profile_name: str,
    overrides: dict[str, Any],
) -> RegionSettings | None:
    problems = reader.problems
    start = len(problems)
    for unknown in sorted(set(item) - set(_REGION_KEYS)):
        problems.append(f"{where}.{unknown}: unknown key; allowed keys: {', '.join(_REGION_KEYS)}")

    def integer(name: str, default: int, bounds: tuple[int, int]) -> int | None:
        value = item.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not bounds[0] <= value <= bounds[1]:
            problems.append(
                f"{where}.{name}: {value!r} is not valid; allowed: an integer from {bounds[0]} to {bounds[1]}"
            )
            return None
        return value

    region = item.get("region")
    if not isinstance(region, str) or not _REGION_RE.match(region):
        problems.append(f"{where}.region: {region!r} is not valid; allowed: a GCP region such as us-central1")
        region = None
    zones = item.get("zones")
    if not isinstance(zones, list) or not zones or not all(isinstance(z, str) for z in zones):
        problems.append(f"{where}.zones: {zones!r} is not valid; allowed: a non-empty list of zones")
        zones = None
    elif region is not None:
        for zone in zones:
            if not _ZONE_RE.match(zone) or not zone.startswith(region + "-"):
                problems.append(
                    f"{where}.zones: {zone!r} is not a zone of {region}; allowed: {region}-a, {region}-b, ..."
                )
        if len(set(zones)) != len(zones):
            problems.append(f"{where}.zones: {zones!r} names a zone twice; allowed: each zone once")
    min_nodes = integer("minNodes", 1, _NODES_BOUNDS)
    max_nodes = integer("maxNodes", 4, (1, _NODES_BOUNDS[1]))
    if min_nodes is not None and max_nodes is not None and min_nodes > max_nodes:
        problems.append(
            f"{where}.minNodes: {min_nodes} is above maxNodes {max_nodes}; allowed: minNodes <= maxNodes"
        )
    redis_gb = integer("redisMemoryGb", 1, _REDIS_GB_BOUNDS)
    index = integer("networkIndex", position, _NETWORK_INDEX_BOUNDS)
    serving = item.get("serving", True)
    if not isinstance(serving, bool):
        problems.append(f"{where}.serving: {serving!r} is not valid; allowed: true, false")

    gpu = item.get("gpu", overrides.get("gpu"))
    region_overrides = dict(overrides)
    if gpu is not None:
        region_overrides["gpu"] = gpu
    profile = None
    try:
        profile = get_profile(profile_name, **{**region_overrides, "runtime_image": PLACEHOLDER_IMAGE})
    except ValidationError as exc:
        for error in exc.errors():
            message = str(error.get("msg", error)).removeprefix("Value error, ")
            problems.append(f"{where}: profile {profile_name!r} is not valid in this region: {message}")
    except (KeyError, ValueError) as exc:
        problems.append(f"{where}: profile {profile_name!r}: {exc}")
    machine = None
    if profile is not None and profile.gpu is not None:
        if profile.gpu not in gcp_catalog.GCP_GPUS:
            problems.append(
                f"{where}.gpu: {profile.gpu!r} is not offered on GCP (on-premises only); allowed: "
                + ", ".join(sorted(gcp_catalog.GCP_GPUS))
            )
        else:
            name = item.get("machineType", gcp_catalog.DEFAULT_MACHINE_TYPE[profile.gpu])
            if name not in gcp_catalog.MACHINE_TYPES:
                problems.append(
                    f"{where}.machineType: unknown machine type {name!r}; allowed: "
                    + ", ".join(gcp_catalog.machine_types_for(profile.gpu))
                )
            elif why := gcp_catalog.carry_problem(name, profile.gpu):
                carriers = ", ".join(gcp_catalog.machine_types_for(profile.gpu))
                problems.append(f"{where}.machineType: {why}; allowed: {carriers}")
            else:
                machine = gcp_catalog.MACHINE_TYPES[name]
                if machine.gpu_count[0] != 1:
                    problems.append(
                        f"{where}.machineType: {name!r} has {machine.gpu_count[0]} GPUs; allowed: a one-GPU "
                        f"type (one runtime pod per GPU node): "
                        + ", ".join(
                            m
                            for m in gcp_catalog.machine_types_for(profile.gpu)
                            if gcp_catalog.MACHINE_TYPES[m].gpu_count[0] == 1
                        )
                    )
    if profile is not None:
        _check_bundle(reader, profile)
    if len(problems) > start or profile is None or machine is None:
        return None
    assert region and zones and min_nodes is not None and max_nodes and redis_gb and index is not None
    assert profile.gpu is not None
    return RegionSettings(
        region=region,
        zones=tuple(zones),
        profile=profile,
        machine_type=machine.name,
        accelerator_type=gcp_catalog.ACCELERATOR_TYPES[profile.gpu],
        accelerator_count=1,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        redis_memory_gb=redis_gb,
        network_index=index,
        serving=bool(serving),
        usd_per_hour=machine.price.usd_per_hour if machine.price else None,
        price_source=machine.price.source if machine.price else None,
    )


def _onprem_settings(reader: _Reader) -> OnPremSettings | None:
    start = len(reader.problems)
    host = reader.string("onpremHost", required=True, pattern=None)
    if host is not None and not _is_host(host):
        reader.problems.append(
            f"{NAMESPACE}:onpremHost: {host!r} is neither a host name nor an IP address; allowed: e.g. "
            "gpu01.example.internal or 10.0.0.12"
        )
    user = reader.string(
        "onpremUser",
        required=True,
        pattern=_USER_RE,
        allowed="a Unix user name (root, or a user with passwordless sudo)",
    )
    port = reader.integer("onpremPort", bounds=(1, 65535), default=22)
    key = reader.secret(
        "onpremSshPrivateKey",
        required=True,
        pattern=re.compile(
            r"^-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----\s[\s\S]+-----END [A-Z0-9 ]*PRIVATE KEY-----\s*$"
        ),
        allowed="an SSH private key in PEM/OpenSSH form, set with "
        "`pulumi config set --secret onpremSshPrivateKey < ~/.ssh/id_ed25519`",
    )
    host_key = reader.string(
        "onpremHostKey",
        pattern=re.compile(r"^(ssh-|ecdsa-)[a-z0-9-]+ [A-Za-z0-9+/=]+( .*)?$"),
        allowed="the host's public key line, e.g. 'ssh-ed25519 AAAA...'",
    )
    install_dir = reader.string(
        "installDir",
        default="/opt/duplex",
        pattern=_SAFE_DIR_RE,
        allowed="an absolute path two levels deep or more of letters, digits, '.', '_', "
        "'-' (destroy removes it), e.g. /opt/duplex",
    )
    if install_dir is not None and (
        install_dir.rstrip("/") in _FORBIDDEN_INSTALL_DIRS or ".." in install_dir
    ):
        reader.problems.append(
            f"{NAMESPACE}:installDir: {install_dir!r} is a shared system directory (destroy removes "
            "installDir); allowed: a directory of its own, e.g. /opt/duplex"
        )
    image = reader.string(
        "runtimeImage",
        required=True,
        pattern=_IMAGE_RE,
        allowed="a digest-pinned image reference, e.g. ghcr.io/org/duplexops-runtime@sha256:<64 hex digits>",
    )
    timeout = reader.integer("readyTimeoutSeconds", bounds=_READY_TIMEOUT_S, default=1800)
    if len(reader.problems) > start:
        return None
    assert host and user and port and key and install_dir and image and timeout
    return OnPremSettings(
        host=host,
        user=user,
        port=port,
        ssh_private_key=key,
        host_key=host_key,
        install_dir=install_dir.rstrip("/"),
        runtime_image=image,
        ready_timeout_s=timeout,
    )


def _is_host(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return bool(_HOST_RE.match(value))


def _check_bundle(reader: _Reader, profile: NodeProfile) -> None:
    """Render the node's bundle once (and the GCE user-data) so that a renderer's refusal shows here."""
    from infra.node.bundle import render_bundle

    try:
        render_bundle(profile)
    except ValueError as exc:
        reader.problems.append(f"{NAMESPACE}:profile: {profile.name!r} cannot be rendered: {exc}")


# --- typed access to the raw values --------------------------------------------------------------------


class _Reader:
    """Reads and converts raw config strings, collecting problems instead of raising."""

    def __init__(self, values: Mapping[str, str], secret_keys: set[str] | frozenset[str] | None):
        self.values = values
        self.secret_keys = secret_keys
        self.problems: list[str] = []

    def raw(self, key: str, namespace: str = NAMESPACE) -> str | None:
        value = self.values.get(f"{namespace}:{key}")
        if value is None:
            return None
        return value if isinstance(value, str) else json.dumps(value)

    def missing(self, key: str, namespace: str, allowed: str) -> None:
        how = "--secret " if key in SECRET_KEYS and namespace == NAMESPACE else ""
        self.problems.append(
            f"{namespace}:{key}: missing (required for this topology); allowed: {allowed}; "
            f"set it with `pulumi config set {how}{namespace}:{key} <value>`"
        )

    def string(
        self,
        key: str,
        *,
        namespace: str = NAMESPACE,
        required: bool = False,
        default: str | None = None,
        pattern: re.Pattern[str] | None = None,
        allowed: str = "",
    ) -> str | None:
        value = self.raw(key, namespace)
        if value is None or value == "":
            if required:
                self.missing(key, namespace, allowed or "a non-empty string")
            return default
        if pattern is not None and not pattern.match(value):
            self.problems.append(f"{namespace}:{key}: {value!r} is not valid; allowed: {allowed}")
            return None
        return value

    def choice(
        self, key: str, allowed: tuple[str, ...], *, required: bool = False, default: str | None = None
    ) -> str | None:
        value = self.raw(key)
        if value is None:
            if required:
                self.missing(key, NAMESPACE, ", ".join(allowed))
            return default
        if value not in allowed:
            self.problems.append(f"{NAMESPACE}:{key}: unknown value {value!r}; allowed: {', '.join(allowed)}")
            return None
        return value

    def integer(self, key: str, *, bounds: tuple[int, int], default: int | None = None) -> int | None:
        value = self.raw(key)
        if value is None:
            return default
        try:
            number = int(value)
        except ValueError:
            number = None
        if number is None or not bounds[0] <= number <= bounds[1]:
            self.problems.append(
                f"{NAMESPACE}:{key}: {value!r} is not valid; allowed: an integer from {bounds[0]} to "
                f"{bounds[1]}"
            )
            return None
        return number

    def boolean(self, key: str, *, default: bool) -> bool | None:
        value = self.raw(key)
        if value is None:
            return default
        if value.lower() not in ("true", "false"):
            self.problems.append(f"{NAMESPACE}:{key}: {value!r} is not valid; allowed: true, false")
            return None
        return value.lower() == "true"

    def cidr_list(self, key: str, *, required: bool) -> list[str] | None:
        allowed = 'a list of IPv4 CIDRs, e.g. ["203.0.113.0/24"] (["0.0.0.0/0"]: the whole internet)'
        value = self.raw(key)
        if value is None:
            if required:
                self.missing(key, NAMESPACE, allowed)
            return None
        try:
            items = json.loads(value)
        except ValueError:
            items = None
        if not isinstance(items, list) or not items or not all(isinstance(i, str) for i in items):
            self.problems.append(f"{NAMESPACE}:{key}: {value!r} is not valid; allowed: {allowed}")
            return None
        ranges = []
        for item in items:
            try:
                ranges.append(str(ipaddress.IPv4Network(item, strict=True)))
            except ValueError as exc:
                self.problems.append(
                    f"{NAMESPACE}:{key}: {item!r} is not an IPv4 CIDR ({exc}); allowed: {allowed}"
                )
        return ranges

    def secret(
        self,
        key: str,
        *,
        required: bool = False,
        pattern: re.Pattern[str] | None = None,
        allowed: str = "",
    ) -> SecretStr | None:
        value = self.raw(key)
        full_key = f"{NAMESPACE}:{key}"
        if value is None or value == "":
            if required:
                self.missing(key, NAMESPACE, allowed)
            return None
        if self.secret_keys is not None and full_key not in self.secret_keys:
            self.problems.append(
                f"{full_key}: set in plain text (the value is not shown); allowed: a secret value, "
                f"`pulumi config set --secret {key} ...`"
            )
            return None
        if pattern is not None and not pattern.match(value):
            self.problems.append(f"{full_key}: the value (not shown) is not valid; allowed: {allowed}")
            return None
        return SecretStr(value)

    def token_keys(self, key: str) -> SecretStr | None:
        value = self.secret(key)
        if value is None:
            return None
        allowed = (
            'a JSON object {"<kid>": "<secret of 32+ characters>", ...} (`duplex token keygen` makes a key); '
            "or leave it unset to generate one"
        )
        try:
            mapping = json.loads(value.get_secret_value())
        except ValueError:
            self.problems.append(f"{NAMESPACE}:{key}: the value (not shown) is not JSON; allowed: {allowed}")
            return None
        try:
            keys_from_mapping(mapping, source=f"{NAMESPACE}:{key}")
        except ValueError as exc:
            self.problems.append(f"{exc}; allowed: {allowed}")
            return None
        return value

    def password(self, key: str) -> SecretStr | None:
        value = self.secret(key)
        if value is None:
            return None
        try:
            NodeSecrets(
                redis_password=value.get_secret_value(),
                grafana_admin_password=value.get_secret_value(),
                token_keys={"check": "x" * 64},
            )
        except ValueError as exc:
            rule = str(exc).split(" must ", 1)[-1]
            self.problems.append(
                f"{NAMESPACE}:{key}: the value (not shown) is not valid; allowed: a password that must "
                f"{rule}; or leave it unset to generate one"
            )
            return None
        return value
