"""What every topology's keys share: the ``_Keys`` base (topology, profile, sessions, domain, name prefix,
the secrets, the phone carriers' secrets, the TURN secret, the runtime image, the alert receivers), the
patterns and messages its fields use, and the checks that build a stack's profile and its ``StackConfig``
from them. The topologies' own keys: ``keys_node`` (``gce-node``, ``onprem-node``), ``keys_multi_region``;
``keys`` assembles them. docs/stack-configuration.md.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from infra.node.bundle.carriers import CARRIER_SECRETS, check_carrier_secrets
from infra.node.bundle.services import NodeSecrets
from infra.node.profile.profiles import PROFILES, NodeProfile, get_profile
from infra.stack_config.settings import (
    NAMESPACE,
    PLACEHOLDER_IMAGE,
    StackConfig,
    StackSecretsConfig,
    Topology,
)
from infra.stack_config.values import Secret, allowed, problem, problems, pulumi_key, secret_matching
from runtime.engine.model_presets import get_preset
from runtime.frontend.gate.tokens import keys_from_mapping

__all__ = ["TURN_SECRET_PATTERN"]


def _compose_profiles() -> tuple[str, ...]:
    """Profiles a stack can deploy: GPU nodes run by Compose (the local CPU node is not one)."""
    return tuple(name for name, p in PROFILES.items() if p.deployment == "compose" and p.gpu is not None)


_NAME_PREFIX_RE = r"^[a-z][a-z0-9-]{1,19}[a-z0-9]$"


_IMAGE_RE = (
    r"^[a-z0-9]+([._-][a-z0-9]+)*(\.[a-z0-9-]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?@sha256:[0-9a-f]{64}$"
)


_IMAGE_ALLOWED = "a digest-pinned image reference, e.g. ghcr.io/org/duplexops-runtime@sha256:<64 hex digits>"


TURN_SECRET_PATTERN = r"^[A-Za-z0-9_-]{32,256}$"
"""``turnSecret``'s form: what ``infra.node.bundle.services.NodeSecrets`` and ``infra.node.bundle.coturn``
accept (coturn's ``static-auth-secret`` and the runtime's env file take it unquoted) and at least the
runtime's 32 bytes (``runtime.frontend.transports.webrtc.turn.MIN_SECRET_BYTES``)."""
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
    # The phone carriers' secrets (docs/deploying.md, "Phone numbers"; infra.node.bundle.carriers): each turns
    # its carrier's bridge on in every node (every pod); unset: that bridge is off. Twilio and Plivo sign each
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
    # (infra.node.monitoring.alertmanager), GMP's managed Alertmanager on multi-region (infra.k8s.alerting).
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
    from infra.node.bundle.render import render_bundle

    try:
        render_bundle(profile)
    except ValueError as exc:
        raise problem(f"{profile.name!r} cannot be rendered: {exc}", where=pulumi_key("profile")) from None
