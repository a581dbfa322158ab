"""The stack's configuration keys, declared once: one pydantic model per topology (``GceNodeKeys``,
``OnPremNodeKeys``, ``MultiRegionKeys`` with its ``RegionKeys``) whose aliases are Pulumi's keys
(``duplexops:<camelCase>``, ``gcp:project``...), with the constraints of each key and validators that apply
the GCP rules through the capacity planner (``infra.capacity.gcp``: machine type vs GPU, provisioning
model, zones) and the node profile (sessions vs capacity). A valid model holds the ``StackConfig`` it
built. docs/stack-configuration.md.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from infra.capacity import gcp as gcp_catalog
from infra.names import PROJECT_ID_RE, REGION_RE, ZONE_RE
from infra.node.carriers import CARRIER_SECRETS, check_carrier_secrets
from infra.node.profile import PROFILES, NodeProfile, get_profile
from infra.node.services import NodeSecrets
from infra.stack_config.recordings import RecordingsKeys, retention_days
from infra.stack_config.settings import (
    NAMESPACE,
    PLACEHOLDER_IMAGE,
    GceSettings,
    MaintenanceWindow,
    MultiRegionSettings,
    OnPremSettings,
    RecordingSettings,
    RegionSettings,
    StackConfig,
    StackSecretsConfig,
    Topology,
)
from infra.stack_config.values import (
    CIDRS,
    Boolean,
    CidrList,
    Secret,
    allowed,
    json_value,
    problem,
    problems,
    pulumi_key,
    secret_matching,
)
from runtime.engine.model_presets import get_preset
from runtime.frontend.gate.tokens import keys_from_mapping

__all__ = [
    "KEYS_OF",
    "KNOWN_KEYS",
    "TURN_SECRET_PATTERN",
    "GceNodeKeys",
    "MultiRegionKeys",
    "OnPremNodeKeys",
    "RegionKeys",
]

# --- the keys --------------------------------------------------------------------------------------------


def _compose_profiles() -> tuple[str, ...]:
    """Profiles a stack can deploy: GPU nodes run by Compose (the local CPU node is not one)."""
    return tuple(name for name, p in PROFILES.items() if p.deployment == "compose" and p.gpu is not None)


def _gcp_profiles() -> list[str]:
    return [p for p in _compose_profiles() if PROFILES[p].gpu in gcp_catalog.GCP_GPUS]


NODE_DRAIN_GRACE_S = 300
"""Default drain grace of a single node (s): a conversation of up to 5 minutes finishes through a rollout."""
MAX_NODE_DRAIN_GRACE_S = 1700
"""Largest drain grace of a single node (s): nginx's and the runtime's grace periods plus margins and a
minute (``infra.node.compose.node_stop_timeout_s``) must stay within GCE graceful shutdown's 3600 s."""

WAITING_ROOM_S = 30
"""``waitingRoomS``'s default (s): how long a multi-region caller waits for a slot when every pod it reaches
is full (issue 33), about one turn of a conversation elsewhere ending; the runtime's own default is 0."""
_NAME_PREFIX_RE = r"^[a-z][a-z0-9-]{1,19}[a-z0-9]$"
_SAFE_DIR_RE = r"^(/[A-Za-z0-9._-]+){2,}$"
_FORBIDDEN_INSTALL_DIRS = frozenset({"/usr/local", "/var/lib", "/var/tmp", "/opt/local", "/home"})
_HOST_RE = re.compile(
    r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$"
)
_IMAGE_RE = (
    r"^[a-z0-9]+([._-][a-z0-9]+)*(\.[a-z0-9-]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?@sha256:[0-9a-f]{64}$"
)
_HOST_KEY_RE = r"^(ssh-ed25519|ecdsa-sha2-nistp(256|384|521)|ssh-rsa) [A-Za-z0-9+/]+={0,2}( .*)?$"
_HOST_KEY_ALLOWED = (
    "the host's public SSH key line, required: every SSH session (secrets travel over it) checks it; get "
    "it from the host itself (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` there to compare) or with "
    "`ssh-keyscan -t ed25519 <host>`, e.g. 'ssh-ed25519 AAAA...'"
)
_IMAGE_ALLOWED = "a digest-pinned image reference, e.g. ghcr.io/org/duplexops-runtime@sha256:<64 hex digits>"
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
TURN_SECRET_PATTERN = r"^[A-Za-z0-9_-]{32,256}$"
"""``turnSecret``'s form: what ``infra.node.services.NodeSecrets`` and ``infra.node.coturn`` accept (coturn's
``static-auth-secret`` and the runtime's env file take it unquoted) and at least the runtime's 32 bytes
(``runtime.frontend.transports.webrtc.turn.MIN_SECRET_BYTES``)."""
_TURN_SECRET_ALLOWED = (
    "32 to 256 letters, digits, '_' or '-' (e.g. `python3 -c 'import secrets; "
    "print(secrets.token_urlsafe(32))'`), set with `pulumi config set --secret turnSecret ...`; or leave it "
    "unset to generate one"
)
_DNS_ZONE_ALLOWED = (
    "the name (not the DNS name) of a Cloud DNS managed zone in gcp:project that holds duplexops:domain, "
    "e.g. example-com (`gcloud dns managed-zones list`); or leave it unset and make the records by hand"
)
_DNS_ZONE = Field(
    None,
    pattern=r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$",
    json_schema_extra=allowed(_DNS_ZONE_ALLOWED),
)
_TURN_TLS_SECRET_ALLOWED = (
    "the name of a kubernetes.io/tls Secret (lower case letters, digits, '-'; at most 63) in namespace "
    "duplex of every region's cluster, holding the certificate of turn-<region>.<domain> (e.g. a "
    "cert-manager Certificate's secretName: docs/deploying.md, TURN over TLS in the regions); or leave it "
    "unset for TURN over UDP only"
)
_CARRIER_SECRET_ALLOWED = (
    "printable characters without spaces or quotes (the runtime's env file takes it unquoted)"
)
_CarrierSecret = Annotated[
    Secret, secret_matching(r"^[!#-&(-~]{8,256}$", _CARRIER_SECRET_ALLOWED + ", 8-256")
]
"""A phone carrier's secret (``twilioAuthToken``, ``plivoAuthToken``, ``exotelApiKey``,
``exotelApiToken``)."""
_TOKEN_KEYS_ALLOWED = (
    'a JSON object {"<kid>": "<secret of 32+ characters>", ...} (`duplex token keygen` makes a key); '
    "or leave it unset to generate one"
)


class _Keys(BaseModel):
    """Keys of one topology: each field's alias is its Pulumi key (``duplexops:<camelCase>``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=pulumi_key)
    topology_name: ClassVar[str]
    _result: StackConfig | None = PrivateAttr(None)

    # Common to every topology (declared in the order their rules read them).
    topology: Topology
    profile: Literal[_compose_profiles()]  # type: ignore[valid-type]
    gpu: str | None = None
    max_sessions: int | None = Field(None, ge=1, le=256)
    domain: str | None = None
    name_prefix: str | None = Field(
        None,
        pattern=_NAME_PREFIX_RE,
        json_schema_extra=allowed(
            "3-21 characters: lower case letters, digits and '-', starting with a letter"
        ),
    )
    grafana_admin_password: Secret | None = None
    token_signing_keys: Secret | None = Field(None, json_schema_extra=allowed(_TOKEN_KEYS_ALLOWED))
    hf_token: Annotated[Secret, secret_matching(r"^\S{8,512}$", "a token, no spaces")] | None = None
    # The phone carriers' secrets (docs/deploying.md, "Phone numbers"; infra.node.carriers): each turns its
    # carrier's bridge on in every node (every pod); unset: that bridge is off. Twilio and Plivo sign each
    # stream with their account's auth token; Telnyx's stream secret is the route's own gate (16+ chars);
    # Exotel admits on its API key and token (Basic auth), both or neither.
    twilio_auth_token: _CarrierSecret | None = None
    plivo_auth_token: _CarrierSecret | None = None
    telnyx_stream_token: (
        Annotated[Secret, secret_matching(r"^[!#-&(-~]{16,256}$", _CARRIER_SECRET_ALLOWED + ", at least 16")]
        | None
    ) = None
    exotel_api_key: _CarrierSecret | None = None
    exotel_api_token: _CarrierSecret | None = None
    # The TURN relay's shared secret (coturn's static-auth-secret, DUPLEX_TURN_SECRET); unset: generated.
    turn_secret: Annotated[Secret, secret_matching(TURN_SECRET_PATTERN, _TURN_SECRET_ALLOWED)] | None = None
    # The secret turnSecret replaces, still accepted by coturn during a rotation (docs/deploying.md).
    turn_secret_previous: (
        Annotated[Secret, secret_matching(TURN_SECRET_PATTERN, _TURN_SECRET_ALLOWED)] | None
    ) = None
    # The runtime image CI built once for this push (.github/workflows/pulumi-up.yml sets it for the update),
    # digest-pinned. The GCE and GKE topologies copy it into their own registry (infra/components/image.py);
    # unset there, `pulumi up` builds images/runtime/Dockerfile itself. On-premises requires it.
    runtime_image: str | None = Field(None, pattern=_IMAGE_RE, json_schema_extra=allowed(_IMAGE_ALLOWED))
    # Alert receivers (issue 20, item 8), every topology alike: a node's Alertmanager
    # (infra.node.alertmanager), GMP's managed Alertmanager on multi-region (infra.k8s.alerting).
    alert_webhook_url: str | None = None
    alert_email_to: str | None = None
    alert_email_from: str | None = None
    alert_email_smarthost: str | None = None
    alert_email_username: str | None = None
    alert_email_password: Secret | None = None
    alert_pagerduty_routing_key: (
        Annotated[Secret, secret_matching(r"^[A-Za-z0-9]{32}$", "32 letters or digits")] | None
    ) = None

    @model_validator(mode="after")
    def _exotel_key_and_token_together(self) -> Any:
        try:
            check_carrier_secrets({n: getattr(self, n) for n in CARRIER_SECRETS})
        except ValueError as exc:
            raise problem(
                "exotelApiKey and exotelApiToken go together (Exotel's Basic auth on the upgrade); allowed: "
                "set both, or neither",
                where=pulumi_key("exotel_api_key"),
            ) from exc
        return self

    @field_validator("grafana_admin_password", "redis_password", check_fields=False)
    @classmethod
    def _password(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        try:
            text = value.get_secret_value()
            NodeSecrets(
                redis_password=text,
                grafana_admin_password=text,
                token_keys={"check": "x" * 64},
                app_token_keys={"check-app": "y" * 64},
            )
        except ValueError as exc:
            rule = str(exc).split(" must ", 1)[-1]
            raise problem(
                "the value (not shown) is not valid; allowed: a password that must "
                f"{rule}; or leave it unset to generate one"
            ) from None
        return value

    @field_validator("token_signing_keys")
    @classmethod
    def _token_keys(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        key = pulumi_key("token_signing_keys")
        try:
            mapping = json.loads(value.get_secret_value())
        except ValueError:
            raise problem(f"the value (not shown) is not JSON; allowed: {_TOKEN_KEYS_ALLOWED}") from None
        try:
            keys_from_mapping(mapping, source=key)
        except ValueError as exc:
            reason = str(exc).removeprefix(f"{key}: ")
            raise problem(f"{reason}; allowed: {_TOKEN_KEYS_ALLOWED}") from None
        return value

    # The stack's profile, built once the fields are valid.

    def _overrides(self) -> dict[str, Any]:
        overrides: dict[str, Any] = {}
        if self.max_sessions is not None:
            overrides["max_sessions"] = self.max_sessions
        if self.gpu is not None:
            overrides["gpu"] = self.gpu
        if self.domain is not None:
            overrides["domain"] = self.domain
        receivers = {
            "webhook_url": self.alert_webhook_url,
            "email_to": self.alert_email_to,
            "email_from": self.alert_email_from,
            "email_smarthost": self.alert_email_smarthost,
            "email_username": self.alert_email_username,
        }
        alerting: dict[str, Any] = {key: value for key, value in receivers.items() if value is not None}
        if self.alert_email_password is not None:
            alerting["email_password"] = True
        if self.alert_pagerduty_routing_key is not None:
            alerting["pagerduty"] = True
        if alerting:
            overrides["alerting"] = alerting
        return overrides

    def _profile(self, overrides: dict[str, Any]) -> NodeProfile:
        """The profile with the stack's overrides (the planner checks the sessions fit).

        Raises:
            PydanticCustomError: every problem, under the key that caused it.
        """
        try:
            return get_profile(self.profile, **{**overrides, "runtime_image": PLACEHOLDER_IMAGE})
        except ValidationError as exc:
            raise problems([_profile_problem(self.profile, overrides, e) for e in exc.errors()]) from None
        except (KeyError, ValueError) as exc:
            raise problem(str(exc), where=pulumi_key("profile")) from None

    def _secrets(self) -> StackSecretsConfig:
        return StackSecretsConfig(
            redis_password=getattr(self, "redis_password", None),
            grafana_admin_password=self.grafana_admin_password,
            token_keys=self.token_signing_keys,
            hf_token=self.hf_token,
            alert_email_password=self.alert_email_password,
            alert_pagerduty_routing_key=self.alert_pagerduty_routing_key,
            turn_secret=self.turn_secret,
            turn_secret_previous=self.turn_secret_previous,
            carrier_secrets={
                name: value for name in CARRIER_SECRETS if (value := getattr(self, name)) is not None
            },
        )

    def _config(
        self, info: ValidationInfo, profile: NodeProfile, overrides: dict[str, Any], **settings: Any
    ) -> StackConfig:
        """The ``StackConfig`` of these keys (the stack's name and project from the validation context).

        Raises:
            PydanticCustomError: the profile's model is gated and ``hfToken`` is not set.
        """
        _require_hf_token(profile, self.hf_token)
        _check_turn_rotation(self.turn_secret, self.turn_secret_previous)
        if self.turn_secret is not None and not profile.relay.enabled:
            raise problem(
                f"set, but profile {profile.name!r} runs no TURN relay (relay.enabled is false); allowed: "
                "unset it, or a profile with the relay on",
                where=pulumi_key("turn_secret"),
            )
        context = info.context or {}
        stack = context.get("stack", "stack")
        return StackConfig(
            stack=stack,
            project=context.get("project", NAMESPACE),
            topology=self.topology,
            name_prefix=self.name_prefix or _default_prefix(stack),
            profile_name=self.profile,
            profile_overrides=overrides,
            profile=profile,
            domain=self.domain,
            runtime_image=self.runtime_image,
            secrets=self._secrets(),
            **settings,
        )


def _require_hf_token(profile: NodeProfile, token: SecretStr | None) -> None:
    """A profile whose model's weights are gated on the Hugging Face Hub needs ``hfToken``: without it the
    weights download gets 401 and the node never turns ready (a GCE VM, the multi-region weights Job, an
    on-premises host alike). Gated-ness is the model preset's (``runtime.engine.model_presets``).

    Raises:
        PydanticCustomError: the key, the model and the command that sets it.
    """
    preset = get_preset(profile.model)
    if preset.gated and token is None:
        raise problem(
            f"required: profile {profile.name!r} serves {preset.default_source}, which is gated on the "
            "Hugging Face Hub; accept its licence there with your account, then set a token of that account "
            "with `pulumi config set --secret hfToken hf_...`",
            where=pulumi_key("hf_token"),
        )


def _check_turn_rotation(current: SecretStr | None, previous: SecretStr | None) -> None:
    """``turnSecretPrevious`` makes sense only beside a given ``turnSecret`` that differs from it.

    Raises:
        PydanticCustomError: under ``turnSecretPrevious``; no value shown.
    """
    if previous is None:
        return
    where = pulumi_key("turn_secret_previous")
    if current is None:
        raise problem(
            "set without duplexops:turnSecret; allowed: the secret turnSecret replaces, beside it (a "
            "rotation: docs/deploying.md, The TURN secret and its rotation)",
            where=where,
        )
    if current.get_secret_value() == previous.get_secret_value():
        raise problem(
            "the same value (not shown) as turnSecret; allowed: the old secret, or unset", where=where
        )


def _profile_problem(profile_name: str, overrides: dict[str, Any], error: Any) -> tuple[str, str]:
    message = str(error.get("msg", error)).removeprefix("Value error, ")
    loc = tuple(error.get("loc") or ())
    field = str(loc[0]) if loc else ""
    if not field and message.startswith("max_sessions"):
        field = "max_sessions"
    if field == "tls":  # the ACME keys (see _NodeKeys._node_overrides)
        return (pulumi_key("acme_email"), f"rejected for profile {profile_name!r}: {message}")
    if field == "alerting":
        key = "alert_webhook_url" if "webhook" in message else "alert_email_to"
        return (pulumi_key(key), f"alert receivers rejected: {message}")
    if field not in ("max_sessions", "gpu", "domain"):
        return (
            pulumi_key("profile"),
            f"{profile_name!r} is not valid with this stack's settings: {message}",
        )
    return (
        pulumi_key(field),
        f"{overrides.get(field)!r} rejected for profile {profile_name!r}: {message}",
    )


def _default_prefix(stack: str) -> str:
    cleaned = re.sub(r"[^a-z0-9-]+", "-", stack.lower()).strip("-")
    prefix = f"duplex-{cleaned}"[:21].rstrip("-")
    return prefix if re.match(_NAME_PREFIX_RE, prefix) else "duplex"


def _check_bundle(profile: NodeProfile) -> None:
    """Render the node's bundle once (and the GCE user-data) so that a renderer's refusal shows here."""
    from infra.node.bundle import render_bundle

    try:
        render_bundle(profile)
    except ValueError as exc:
        raise problem(f"{profile.name!r} cannot be rendered: {exc}", where=pulumi_key("profile")) from None


def _profile_gpu(info: ValidationInfo) -> str | None:
    """The GPU of the stack's profile (its ``gpu`` override first), from the fields validated so far."""
    gpu = info.data.get("gpu")
    if gpu is None and info.data.get("profile") in PROFILES:
        gpu = PROFILES[info.data["profile"]].gpu
    return gpu


class _NodeKeys(_Keys):
    """Keys of a single-node topology (``gce-node``, ``onprem-node``).

    Certificates (``infra.node.acme``): with ``domain`` and ``acmeEmail`` the node gets its certificate
    from ``acmeDirectory`` (Let's Encrypt) by HTTP-01; without a domain it serves a self-signed one.
    Alerts: the node's Alertmanager (``infra.node.alertmanager``) sends to the receivers of ``_Keys``.

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


class RegionKeys(BaseModel):
    """One item of ``duplexops:regions`` (camelCase keys: ``region``, ``zones``, ``minNodes``...)."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel)

    region: str = Field(
        pattern=REGION_RE.pattern, json_schema_extra=allowed("a GCP region such as us-central1")
    )
    zones: tuple[str, ...] = Field(min_length=1, json_schema_extra=allowed("a non-empty list of zones"))
    gpu: str | None = None
    machine_type: str | None = None
    min_nodes: int = Field(1, ge=1, le=100)
    max_nodes: int = Field(4, ge=1, le=100)
    redis_memory_gb: int = Field(1, ge=1, le=300)
    network_index: int | None = Field(None, ge=0, le=31)
    """0-31; None: the item's position in the list."""
    serving: bool = Field(True, strict=True)

    @field_validator("zones")
    @classmethod
    def _zones_in_region(cls, zones: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        region = info.data.get("region")
        if region is None:
            return zones
        for zone in zones:
            if not ZONE_RE.match(zone) or not zone.startswith(region + "-"):
                raise problem(f"{zone!r} is not a zone of {region}; allowed: {region}-a, {region}-b, ...")
        if len(set(zones)) != len(zones):
            raise problem(f"{list(zones)!r} names a zone twice; allowed: each zone once")
        return zones

    @model_validator(mode="after")
    def _bounds(self) -> RegionKeys:
        if self.min_nodes > self.max_nodes:
            raise problem(
                f"{self.min_nodes} is above maxNodes {self.max_nodes}; allowed: minNodes <= maxNodes",
                where=".minNodes",
            )
        # GKE's NEG controller makes a zone's NEG only once a runtime pod runs there (kubernetes/ingress-gce
        # issue 1755, PR 3152), and the global backend service lists one NEG per zone: every zone listed
        # must always hold a pod (the runtime spreads over the zones: infra.k8s.workload).
        if self.min_nodes < len(self.zones):
            raise problem(
                f"{self.min_nodes} is below the number of zones ({len(self.zones)}: "
                f"{', '.join(self.zones)}); allowed: minNodes >= the number of zones (one runtime pod in "
                "every zone, so that GKE creates the load balancer's NEG there), or fewer zones",
                where=".minNodes",
            )
        return self


WEEKDAYS = ("MO", "TU", "WE", "TH", "FR", "SA", "SU")
"""RFC 5545 weekdays (the maintenance window's ``days``)."""
MIN_WINDOW_HOURS_PER_32_DAYS = 48
"""GKE's rule for a maintenance window: at least 48 h available in any rolling 32 days, each occurrence 4 h
or more (cloud.google.com/kubernetes-engine/docs/concepts/maintenance-windows-and-exclusions)."""


class MaintenanceWindowKeys(BaseModel):
    """``duplexops:maintenanceWindow``: ``start`` (``HH:MM``, UTC), ``hours`` (4-24), ``days`` (weekdays
    ``MO``..``SU``); weekly. Default: Saturday and Sunday, 02:00-08:00 UTC (54 h or more in 32 days)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: str = Field(
        "02:00", pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$", json_schema_extra=allowed("HH:MM, UTC")
    )
    hours: int = Field(6, ge=4, le=24)
    days: tuple[Literal["MO", "TU", "WE", "TH", "FR", "SA", "SU"], ...] = Field(("SA", "SU"), min_length=1)

    @model_validator(mode="after")
    def _enough(self) -> MaintenanceWindowKeys:
        if len(set(self.days)) != len(self.days):
            raise problem(f"{list(self.days)!r} names a day twice; allowed: each day once", where=".days")
        # A weekday recurs at least 4 times in any 32 days.
        least = 4 * len(self.days) * self.hours
        if least < MIN_WINDOW_HOURS_PER_32_DAYS:
            raise problem(
                f"{len(self.days)} day(s) x {self.hours} h gives {least} h in 32 days; allowed: at least "
                f"{MIN_WINDOW_HOURS_PER_32_DAYS} h (GKE's rule): more days or more hours",
                where=".hours",
            )
        return self

    def settings(self) -> MaintenanceWindow:
        """The validated window."""
        days = tuple(sorted(self.days, key=WEEKDAYS.index))
        return MaintenanceWindow(start=self.start, hours=self.hours, days=days)


def _not_on_gcp(gpu: str) -> str | None:
    """Why ``gpu`` cannot be a region's GPU (it is not offered on GCP), or None."""
    if gpu in gcp_catalog.GCP_GPUS:
        return None
    return f"{gpu!r} is not offered on GCP (on-premises only); allowed: " + ", ".join(
        sorted(gcp_catalog.GCP_GPUS)
    )


def _region_settings(item: RegionKeys, position: int, profile: NodeProfile) -> RegionSettings:
    """The region's settings for ``profile`` (already carrying the region's GPU).

    Raises:
        PydanticCustomError: the GPU is not on GCP, or the machine type cannot carry it alone.
    """
    at = f"[{position}]"
    gpu = profile.gpu or ""
    if why := _not_on_gcp(gpu):
        raise problem(why, where=f"{at}.gpu")
    name = item.machine_type or gcp_catalog.DEFAULT_MACHINE_TYPE[gpu]
    if name not in gcp_catalog.MACHINE_TYPES:
        raise problem(
            f"unknown machine type {name!r}; allowed: " + ", ".join(gcp_catalog.machine_types_for(gpu)),
            where=f"{at}.machineType",
        )
    if why := gcp_catalog.carry_problem(name, gpu):
        raise problem(
            f"{why}; allowed: {', '.join(gcp_catalog.machine_types_for(gpu))}", where=f"{at}.machineType"
        )
    machine = gcp_catalog.MACHINE_TYPES[name]
    if machine.gpu_count[0] != 1:
        singles = [
            m for m in gcp_catalog.machine_types_for(gpu) if gcp_catalog.MACHINE_TYPES[m].gpu_count[0] == 1
        ]
        raise problem(
            f"{name!r} has {machine.gpu_count[0]} GPUs; allowed: a one-GPU type (one runtime pod per GPU "
            f"node): {', '.join(singles)}",
            where=f"{at}.machineType",
        )
    return RegionSettings(
        region=item.region,
        zones=item.zones,
        profile=profile,
        machine_type=machine.name,
        accelerator_type=gcp_catalog.ACCELERATOR_TYPES[gpu],
        accelerator_count=1,
        min_nodes=item.min_nodes,
        max_nodes=item.max_nodes,
        redis_memory_gb=item.redis_memory_gb,
        network_index=position if item.network_index is None else item.network_index,
        serving=item.serving,
        usd_per_hour=machine.price.usd_per_hour if machine.price else None,
        price_source=machine.price.source if machine.price else None,
    )


_REGIONS_EXAMPLE = (
    '[{"region": "us-central1", "zones": ["us-central1-a"], "minNodes": 1, "maxNodes": 4}, ...]'
)


class MultiRegionKeys(_Keys):
    """``multi-region``: one GKE cluster per region behind one global HTTPS load balancer. Memorystore makes
    each region's Redis AUTH string (no ``redisPassword``); ``domain`` is required (the managed
    certificate is for it)."""

    topology_name: ClassVar[str] = "multi-region"

    domain: str = Field(
        json_schema_extra=allowed("the DNS name of the global endpoint (its managed certificate is for it)")
    )
    gcp_project: str = Field(
        alias="gcp:project",
        pattern=PROJECT_ID_RE.pattern,
        json_schema_extra=allowed("a Google Cloud project id (6-30 lower case letters, digits, '-')"),
    )
    regions: Annotated[tuple[RegionKeys, ...], BeforeValidator(json_value)] = Field(
        min_length=1, json_schema_extra=allowed(f"a list of regions, e.g. {_REGIONS_EXAMPLE}")
    )
    public_source_ranges: CidrList = Field(json_schema_extra=allowed(CIDRS))
    admin_source_ranges: CidrList = Field(json_schema_extra=allowed(CIDRS))
    release_channel: Literal["RAPID", "REGULAR", "STABLE"] = "REGULAR"
    deletion_protection: Boolean = True
    system_machine_type: str = Field(
        "e2-standard-4",
        pattern=r"^[a-z][a-z0-9]*-[a-z]+-[0-9]+$",
        json_schema_extra=allowed("a GCE machine type such as e2-standard-4"),
    )
    enable_apis: Boolean = True
    maintenance_window: Annotated[MaintenanceWindowKeys, BeforeValidator(json_value)] = (
        MaintenanceWindowKeys.model_validate({})  # the defaults: Saturday and Sunday, 02:00-08:00 UTC
    )
    dns_zone: str | None = _DNS_ZONE
    # An existing kubernetes.io/tls Secret in each region's runtime namespace: TURN over TLS (infra.k8s.turn).
    turn_tls_secret: str | None = Field(
        None,
        pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
        json_schema_extra=allowed(_TURN_TLS_SECRET_ALLOWED),
    )
    # Recording with consent into each region's bucket, and the retention of transcripts and recordings.
    recordings: Annotated[RecordingsKeys, BeforeValidator(json_value)] = RecordingsKeys.model_validate({})
    # The pods' waiting room (issue 33): at capacity a caller waits for a slot (a phone caller hears the hold
    # tone) instead of a 503; 0 turns it off. Size: callers that may wait per pod (unset: the pod's slots).
    waiting_room_s: int = Field(
        WAITING_ROOM_S, ge=0, le=3600, json_schema_extra=allowed("seconds, 0-3600 (0: no waiting room)")
    )
    waiting_room_size: int | None = Field(
        None, ge=1, le=4096, json_schema_extra=allowed("callers per pod, 1-4096 (unset: the pod's slots)")
    )

    def _overrides(self) -> dict[str, Any]:
        return {**super()._overrides(), **self.recordings.profile_overrides(PROFILES[self.profile])}

    @field_validator("regions")
    @classmethod
    def _each_once(cls, regions: tuple[RegionKeys, ...]) -> tuple[RegionKeys, ...]:
        found: list[tuple[str, str]] = []
        for what, values in (
            ("region", [r.region for r in regions]),
            (
                "networkIndex",
                [i if r.network_index is None else r.network_index for i, r in enumerate(regions)],
            ),
        ):
            first: dict[Any, int] = {}
            for i, value in enumerate(values):
                if value in first:
                    found.append(
                        (
                            f"[{i}].{what}",
                            f"{value!r} is already used by regions[{first[value]}]; "
                            f"allowed: each {what} once",
                        )
                    )
                first.setdefault(value, i)
        if found:
            raise problems(found)
        return regions

    @model_validator(mode="after")
    def _settings(self, info: ValidationInfo) -> MultiRegionKeys:
        overrides = self._overrides()
        profile = self._profile(overrides)
        regions: list[RegionSettings] = []
        found: list[tuple[str, str]] = []
        if self.turn_tls_secret is not None and not profile.relay.enabled:
            found.append(
                (
                    pulumi_key("turn_tls_secret"),
                    f"set, but profile {profile.name!r} runs no TURN relay (relay.enabled is false); "
                    "allowed: unset it",
                )
            )
        for i, item in enumerate(self.regions):
            where = f"{pulumi_key('regions')}[{i}]"
            region_overrides = {**overrides, **({"gpu": item.gpu} if item.gpu is not None else {})}
            # The GPU first: a profile built for a GPU the region cannot have would only add noise (its
            # first-audio budget checked against a GPU that will never run it).
            if item.gpu is not None and (why := _not_on_gcp(item.gpu)):
                found.append((f"{where}.gpu", why))
                continue
            try:
                region_profile = get_profile(
                    self.profile, **{**region_overrides, "runtime_image": PLACEHOLDER_IMAGE}
                )
            except ValidationError as exc:
                for error in exc.errors():
                    message = str(error.get("msg", error)).removeprefix("Value error, ")
                    found.append((where, f"profile {self.profile!r} is not valid in this region: {message}"))
                continue
            try:
                regions.append(_region_settings(item, i, region_profile))
                _check_bundle(region_profile)
            except PydanticCustomError as error:
                found += [
                    (p if p.startswith(f"{NAMESPACE}:") else f"{pulumi_key('regions')}{p}", m)
                    for p, m in error.context["problems"]  # type: ignore[index]
                ]
        if found:
            raise problems(found)
        settings = MultiRegionSettings(
            project=self.gcp_project,
            regions=tuple(regions),
            public_source_ranges=self.public_source_ranges,
            admin_source_ranges=self.admin_source_ranges,
            release_channel=self.release_channel,
            deletion_protection=self.deletion_protection,
            system_machine_type=self.system_machine_type,
            enable_apis=self.enable_apis,
            maintenance_window=self.maintenance_window.settings(),
            dns_zone=self.dns_zone,
            turn_tls_secret=self.turn_tls_secret,
            waiting_room_s=self.waiting_room_s,
            waiting_room_size=profile.sessions if self.waiting_room_size is None else self.waiting_room_size,
            recordings=RecordingSettings(
                enabled=self.recordings.enabled, retention_days=retention_days(profile)
            ),
        )
        self._result = self._config(info, profile, overrides, multi_region=settings)
        return self


KEYS_OF: dict[str, type[_Keys]] = {k.topology_name: k for k in (GceNodeKeys, OnPremNodeKeys, MultiRegionKeys)}
"""The keys model of each topology."""


def _pulumi_keys(model: type[BaseModel]) -> list[str]:
    return [info.alias or name for name, info in model.model_fields.items()]


KNOWN_KEYS: tuple[str, ...] = tuple(
    dict.fromkeys(
        key.partition(":")[2]
        for model in KEYS_OF.values()
        for key in _pulumi_keys(model)
        if key.startswith(f"{NAMESPACE}:")
    )
)
"""Every ``duplexops:`` key some topology reads."""
