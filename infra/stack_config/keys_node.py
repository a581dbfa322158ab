"""The keys of the single-node topologies: ``_NodeKeys`` (drain grace, sessions per client, the ACME
certificate), ``GceNodeKeys`` (``gce-node``: one GPU VM, its machine type and provisioning model checked
against the capacity planner's catalog) and ``OnPremNodeKeys`` (``onprem-node``: an existing host over SSH,
a digest-pinned image). docs/stack-configuration.md.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from infra.capacity import gcp as gcp_catalog
from infra.names import PROJECT_ID_RE, REGION_RE, ZONE_RE
from infra.node.profile.profiles import PROFILES
from infra.stack_config.keys_common import _DNS_ZONE, _IMAGE_ALLOWED, _IMAGE_RE, _check_bundle, _Keys
from infra.stack_config.keys_gcp import _gcp_profiles, _profile_gpu
from infra.stack_config.settings import GceSettings, OnPremSettings
from infra.stack_config.values import (
    CIDRS,
    Boolean,
    CidrList,
    Secret,
    allowed,
    problem,
    pulumi_key,
    secret_matching,
)

__all__ = ["MAX_NODE_DRAIN_GRACE_S", "NODE_DRAIN_GRACE_S", "GceNodeKeys", "OnPremNodeKeys"]


NODE_DRAIN_GRACE_S = 300
"""Default drain grace of a single node (s): a conversation of up to 5 minutes finishes through a rollout."""
MAX_NODE_DRAIN_GRACE_S = 1700
"""Largest drain grace of a single node (s): nginx's and the runtime's grace periods plus margins and a
minute (``infra.node.bundle.compose.node_stop_timeout_s``) must stay within GCE graceful shutdown's 3600 s."""


_SAFE_DIR_RE = r"^(/[A-Za-z0-9._-]+){2,}$"
_FORBIDDEN_INSTALL_DIRS = frozenset({"/usr/local", "/var/lib", "/var/tmp", "/opt/local", "/home"})
_HOST_RE = re.compile(
    r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$"
)


_HOST_KEY_RE = r"^(ssh-ed25519|ecdsa-sha2-nistp(256|384|521)|ssh-rsa) [A-Za-z0-9+/]+={0,2}( .*)?$"
_HOST_KEY_ALLOWED = (
    "the host's public SSH key line, required: every SSH session (secrets travel over it) checks it; get "
    "it from the host itself (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` there to compare) or with "
    "`ssh-keyscan -t ed25519 <host>`, e.g. 'ssh-ed25519 AAAA...'"
)


_PROMOTED_IMAGE_ALLOWED = (
    f"{_IMAGE_ALLOWED}: the image CI built and promoted for this update (.github/workflows/pulumi-up.yml "
    "sets it; by hand: `pulumi config set --stack <stack> duplexops:runtimeImage <repository>@sha256:...`, "
    "e.g. the `image` output of a GCE stack); never committed in the stack file"
)
_SSH_KEY_RE = r"^-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----\s[\s\S]+-----END [A-Z0-9 ]*PRIVATE KEY-----\s*$"
_SSH_KEY_ALLOWED = (
    "an SSH private key in PEM/OpenSSH form, set with "
    "`pulumi config set --secret onpremSshPrivateKey < ~/.ssh/id_ed25519`"
)


class _NodeKeys(_Keys):
    """Keys of a single-node topology (``gce-node``, ``onprem-node``).

    Certificates (``infra.node.bundle.acme``): with ``domain`` and ``acmeEmail`` the node gets its certificate
    from ``acmeDirectory`` (Let's Encrypt) by HTTP-01; without a domain it serves a self-signed one.
    Alerts: the node's Alertmanager (``infra.node.monitoring.alertmanager``) sends to the receivers of
    ``_Keys``.

    ``drainGraceSeconds``: how long live sessions may go on when the node restarts (a rollout, a stop, a
    replacement) before they are closed with 1001 (the profile's ``limits.drain_grace_s``). Long enough
    for a conversation; at most ``MAX_NODE_DRAIN_GRACE_S`` so that the node's whole stop (nginx and the
    runtime each draining, plus a minute) fits GCE graceful shutdown's 3600 s.

    ``maxSessionsPerClient``: concurrent sessions nginx admits from one client address (the profile's
    ``limits.max_sessions_per_client``, 2 on the GPU profiles). Raise it where many calls come from one
    address by design: a LiveKit agent host, a carrier's media servers, a corporate NAT."""

    redis_password: Secret | None = None
    drain_grace_seconds: int = Field(NODE_DRAIN_GRACE_S, ge=0, le=MAX_NODE_DRAIN_GRACE_S)
    max_sessions_per_client: int | None = Field(None, ge=1, le=4096)
    # --- certificates (issue 20, item 7) ---
    acme_email: str | None = Field(
        None,
        pattern=r"^[^@\s]+@[^@\s]+\.[a-z]{2,63}$",
        json_schema_extra=allowed("the ACME account's contact e-mail address, e.g. ops@example.com"),
    )
    acme_directory: str | None = Field(
        None,
        pattern=r"^https://\S+$",
        json_schema_extra=allowed(
            "an ACME directory URL (Let's Encrypt's by default; its staging for trials)"
        ),
    )

    @model_validator(mode="after")
    def _acme_needs_a_domain(self) -> _NodeKeys:
        if (self.acme_email is not None or self.acme_directory is not None) and self.domain is None:
            raise problem(
                "an ACME certificate is for the node's DNS name; allowed: set duplexops:domain too (its A "
                "record pointing at the node), or leave acmeEmail unset for a self-signed certificate",
                where=pulumi_key("acme_email"),
            )
        return self

    def _overrides(self) -> dict[str, Any]:
        overrides = super()._overrides()
        limits = PROFILES[self.profile].limits.model_dump()
        overrides["limits"] = {**limits, "drain_grace_s": self.drain_grace_seconds}
        if self.max_sessions_per_client is not None:
            overrides["limits"]["max_sessions_per_client"] = self.max_sessions_per_client
        return overrides

    def _node_overrides(self, tls: dict[str, Any] | None = None) -> dict[str, Any]:
        """The profile overrides of the single-node keys: the common ones (``_overrides``: the alert
        receivers among them) and ``tls`` (ACME when a domain is set)."""
        overrides = self._overrides()
        tls = dict(tls or {})
        if self.acme_email is not None:
            tls.update(mode="acme", acme_email=self.acme_email)
            if self.acme_directory is not None:
                tls["acme_directory"] = self.acme_directory
        if tls:
            overrides["tls"] = tls
        return overrides


class GceNodeKeys(_NodeKeys):
    """``gce-node``: one GPU VM on Google Compute Engine. Rules: the GCP GPUs and which machine types carry
    them, and how they are sold, from the capacity planner's catalog (``infra.capacity.gcp``)."""

    topology_name: ClassVar[str] = "gce-node"

    gcp_project: str = Field(
        alias="gcp:project",
        pattern=PROJECT_ID_RE.pattern,
        json_schema_extra=allowed("a Google Cloud project id (6-30 lower case letters, digits, '-')"),
    )
    gcp_region: str = Field(
        alias="gcp:region",
        pattern=REGION_RE.pattern,
        json_schema_extra=allowed("a region such as us-central1"),
    )
    gcp_zone: str = Field(
        alias="gcp:zone", pattern=ZONE_RE.pattern, json_schema_extra=allowed("a zone such as us-central1-a")
    )
    machine_type: str | None = None
    boot_disk_size_gb: int = Field(200, ge=100, le=4096)
    boot_disk_type: Literal["pd-balanced", "pd-ssd"] = "pd-balanced"
    data_disk_size_gb: int = Field(100, ge=50, le=4096)
    public_source_ranges: CidrList = Field(json_schema_extra=allowed(CIDRS))
    subnet_cidr: str = Field(
        "10.64.0.0/24", json_schema_extra=allowed("an RFC 1918 CIDR of /29 or larger, e.g. 10.64.0.0/24")
    )
    enable_apis: Boolean = True
    provisioning_model: Literal[tuple(gcp_catalog.PROVISIONING_MODELS)] = "standard"  # type: ignore[valid-type]
    dns_zone: str | None = _DNS_ZONE

    @model_validator(mode="after")
    def _dns_zone_needs_a_domain(self) -> GceNodeKeys:
        if self.dns_zone is not None and self.domain is None:
            raise problem(
                "the stack makes the A record of duplexops:domain in this zone; allowed: set "
                "duplexops:domain too (a name inside the zone), or leave dnsZone unset",
                where=pulumi_key("dns_zone"),
            )
        return self

    @field_validator("gcp_zone")
    @classmethod
    def _zone_in_region(cls, zone: str, info: ValidationInfo) -> str:
        region = info.data.get("gcp_region")
        if region and not zone.startswith(region + "-"):
            raise problem(f"{zone!r} is not in gcp:region {region!r}; allowed: {region}-a, ...")
        return zone

    @field_validator("machine_type")
    @classmethod
    def _machine_type(cls, name: str | None, info: ValidationInfo) -> str | None:
        gpu = _profile_gpu(info)
        on_gcp = gpu if gpu in gcp_catalog.GCP_GPUS else None
        if name is None:
            return None
        if name not in gcp_catalog.MACHINE_TYPES:
            known = gcp_catalog.machine_types_for(on_gcp) if on_gcp else sorted(gcp_catalog.MACHINE_TYPES)
            raise problem(f"unknown machine type {name!r}; allowed: {', '.join(known)}")
        if on_gcp and (why := gcp_catalog.carry_problem(name, on_gcp)):
            raise problem(
                f"{name!r} cannot carry the GPU of profile {info.data.get('profile', '?')!r}: {why}; "
                f"allowed: {', '.join(gcp_catalog.machine_types_for(on_gcp))}"
            )
        return name

    @field_validator("subnet_cidr")
    @classmethod
    def _private_subnet(cls, subnet: str) -> str:
        try:
            network = ipaddress.IPv4Network(subnet)
            if not network.is_private or network.prefixlen > 29:
                raise ValueError
        except ValueError:
            raise problem(
                f"{subnet!r} is not a private IPv4 network; allowed: an RFC 1918 CIDR of /29 or larger, "
                "e.g. 10.64.0.0/24"
            ) from None
        return subnet

    @model_validator(mode="after")
    def _settings(self, info: ValidationInfo) -> GceNodeKeys:
        overrides = self._node_overrides()
        profile = self._profile(overrides)
        gpu = profile.gpu
        if gpu not in gcp_catalog.GCP_GPUS:
            raise problem(
                f"the profile's GPU {gpu!r} is not offered on GCP (on-premises only); allowed on gce-node: "
                f"GPUs {', '.join(sorted(gcp_catalog.GCP_GPUS))} (profiles: {', '.join(_gcp_profiles())})",
                where=pulumi_key("profile"),
            )
        machine = gcp_catalog.MACHINE_TYPES[self.machine_type or gcp_catalog.DEFAULT_MACHINE_TYPE[gpu]]
        if why := gcp_catalog.provisioning_problem(machine.name, self.provisioning_model):
            # GCE refuses the VM at create time (a3-highgpu-1g: Spot and Flex-start only).
            raise problem(
                f"{self.provisioning_model!r} for machine type {machine.name!r}: {why}; "
                f"allowed: {', '.join(machine.sold_as)}",
                where=pulumi_key("provisioning_model"),
            )
        _check_bundle(profile)
        price = machine.price
        gce = GceSettings(
            project=self.gcp_project,
            region=self.gcp_region,
            zone=self.gcp_zone,
            machine_type=machine.name,
            accelerator_type=None if machine.bundled else gcp_catalog.ACCELERATOR_TYPES[machine.gpu or ""],
            accelerator_count=machine.gpu_count[0],
            boot_disk_gb=self.boot_disk_size_gb,
            boot_disk_type=self.boot_disk_type,
            data_disk_gb=self.data_disk_size_gb,
            public_source_ranges=self.public_source_ranges,
            subnet_cidr=self.subnet_cidr,
            enable_apis=self.enable_apis,
            usd_per_hour=price.usd_per_hour if price else None,
            price_source=price.source if price else None,
            price_read_on=price.read_on if price else None,
            provisioning_model=self.provisioning_model,
            bundled_local_ssd=machine.bundled_local_ssd,
            dns_zone=self.dns_zone,
        )
        self._result = self._config(info, profile, overrides, gce=gce)
        return self


class OnPremNodeKeys(_NodeKeys):
    """``onprem-node``: an existing GPU host reached over SSH, running a digest-pinned image."""

    topology_name: ClassVar[str] = "onprem-node"

    onprem_host: str = Field(
        json_schema_extra=allowed("a host name or an IP address, e.g. gpu01.example.internal")
    )
    onprem_user: str = Field(
        pattern=r"^[a-z_][a-z0-9_-]{0,31}$",
        json_schema_extra=allowed("a Unix user name (root, or a user with passwordless sudo)"),
    )
    onprem_port: int = Field(22, ge=1, le=65535)
    onprem_ssh_private_key: Annotated[Secret, secret_matching(_SSH_KEY_RE, _SSH_KEY_ALLOWED)] = Field(
        json_schema_extra=allowed(_SSH_KEY_ALLOWED)
    )
    onprem_host_key: str = Field(
        pattern=_HOST_KEY_RE,
        json_schema_extra=allowed(_HOST_KEY_ALLOWED),
    )
    install_dir: str = Field(
        "/opt/duplex",
        pattern=_SAFE_DIR_RE,
        json_schema_extra=allowed(
            "an absolute path two levels deep or more of letters, digits, '.', '_', "
            "'-' (destroy removes it), e.g. /opt/duplex"
        ),
    )
    runtime_image: str = Field(pattern=_IMAGE_RE, json_schema_extra=allowed(_PROMOTED_IMAGE_ALLOWED))
    ready_timeout_seconds: int = Field(1800, ge=60, le=7200)

    @field_validator("onprem_host")
    @classmethod
    def _host(cls, host: str) -> str:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not _HOST_RE.match(host):
                raise problem(
                    f"{host!r} is neither a host name nor an IP address; allowed: e.g. "
                    "gpu01.example.internal or 10.0.0.12"
                ) from None
        return host

    @field_validator("runtime_image")
    @classmethod
    def _promoted(cls, image: str) -> str:
        if image.endswith("@sha256:" + "0" * 64):
            raise problem(
                f"{image!r} has a placeholder digest of zeros, no image; allowed: {_PROMOTED_IMAGE_ALLOWED}"
            )
        return image

    @field_validator("onprem_host_key")
    @classmethod
    def _host_key(cls, line: str) -> str:
        import base64
        import binascii

        kind, blob = line.split()[:2]
        try:
            decoded = base64.b64decode(blob, validate=True)
        except (binascii.Error, ValueError):
            decoded = b""
        # The blob starts with its own key type (RFC 4253 section 6.6: string "ssh-ed25519", ...).
        if decoded[4 : 4 + len(kind)] != kind.encode():
            raise problem(f"{line[:40]!r}... is not a public key line; allowed: {_HOST_KEY_ALLOWED}")
        return " ".join(line.split()[:2])

    @field_validator("install_dir")
    @classmethod
    def _own_directory(cls, path: str) -> str:
        if path.rstrip("/") in _FORBIDDEN_INSTALL_DIRS or ".." in path:
            raise problem(
                f"{path!r} is a shared system directory (destroy removes installDir); allowed: a directory "
                "of its own, e.g. /opt/duplex"
            )
        return path.rstrip("/")

    @model_validator(mode="after")
    def _settings(self, info: ValidationInfo) -> OnPremNodeKeys:
        # With acmeEmail the deploy installs certbot's renewal on the host, which must have certbot
        # (infra.components.onprem_node.acme_install_script checks it). Everything the stack installs
        # lives under installDir (destroy removes it): the TLS pair too.
        overrides = self._node_overrides(
            {
                "certificate_path": f"{self.install_dir}/tls/node.crt",
                "private_key_path": f"{self.install_dir}/tls/node.key",
            }
        )
        profile = self._profile(overrides)
        _check_bundle(profile)
        onprem = OnPremSettings(
            host=self.onprem_host,
            user=self.onprem_user,
            port=self.onprem_port,
            ssh_private_key=self.onprem_ssh_private_key,
            host_key=self.onprem_host_key,
            install_dir=self.install_dir,
            runtime_image=self.runtime_image,
            ready_timeout_s=self.ready_timeout_seconds,
        )
        self._result = self._config(info, profile, overrides, onprem=onprem)
        return self
