"""The services of a node, where each one is reached from inside the node, and the node's secrets.

Every renderer asks ``endpoint(profile, service)`` for a ``host:port`` so that nginx's upstream,
Prometheus's targets and Grafana's datasource agree: in a ``compose`` deployment services find each other
by their Compose service name on the node's bridge network; in a ``processes`` deployment (the local node)
everything listens on ``profile.private_address``.

Secrets never go into the rendered bundle (it is deterministic and may be shown, diffed or stored as plain
stack outputs). They are written next to it, in ``secrets/`` (mode 0700, files 0600), by whoever brings
the node up: ``infra.node.local.node`` here, cloud-init from Secret Manager on a GCE VM, Pulumi over SSH on an
on-premises host. ``SECRET_FILES`` names them; renderers reference them by these paths.
"""

from __future__ import annotations

import ipaddress
import json
import re
import secrets as _stdlib_secrets
from dataclasses import dataclass, field
from typing import Literal, get_args

from infra.node.bundle.carriers import CARRIER_SECRETS, carrier_settings, check_carrier_secrets
from infra.node.bundle.coturn import render_turnserver_conf
from infra.node.bundle.redis_acl import redis_url, render_acl_users, role_password
from infra.node.profile.profiles import NodeProfile
from infra.node.profile.relay import turn_urls
from runtime.frontend.gate.tokens import SigningKey, generate_signing_key

__all__ = [
    "SECRETS_DIR",
    "SECRET_FILES",
    "SERVICES",
    "TOKEN_KEYS_CONTAINER_PATH",
    "OPTIONAL_SECRET_FILES",
    "NodeSecrets",
    "Service",
    "endpoint",
    "public_origin",
    "rtc_candidate_settings",
    "runtime_settings",
    "secret_files",
    "optional_secret_roles",
    "services_of",
    "token_audience",
]

Service = Literal[
    "nginx",
    "runtime",
    "redis",
    "prometheus",
    "grafana",
    "node-exporter",
    "redis-exporter",
    "dcgm-exporter",
    "alertmanager",
    "coturn",
]
SERVICES: tuple[Service, ...] = get_args(Service)

_PORT_FIELD: dict[Service, str] = {
    "nginx": "https",
    "runtime": "runtime",
    "redis": "redis",
    "prometheus": "prometheus",
    "grafana": "grafana",
    "node-exporter": "node_exporter",
    "redis-exporter": "redis_exporter",
    "dcgm-exporter": "dcgm_exporter",
    "alertmanager": "alertmanager",
    "coturn": "",  # its metrics port is relay.metrics_port
}

SECRETS_DIR = "secrets"
"""Directory, relative to the bundle root, holding the secret files (never rendered, never committed)."""

SECRET_FILES = {
    "redis_password": "secrets/redis_password",
    "redis_auth_conf": "secrets/redis-auth.conf",
    "runtime_env": "secrets/runtime.env",
    "redis_exporter_env": "secrets/redis-exporter.env",
    "events_consumer_env": "secrets/events-consumer.env",
    "grafana_admin_password": "secrets/grafana_admin_password",
    "token_keys": "secrets/token_keys.json",
    "app_token_keys": "secrets/app_token_keys.json",
    "turnserver_conf": "secrets/turnserver.conf",
}
"""What ``secret_files`` writes, by role: the Redis ``admin`` user's password alone; the Redis users
(``user`` lines, ``infra.node.bundle.redis_acl``) for redis.conf's ``include``; ``DUPLEX_REDIS_URL`` for the
runtime (as the ``runtime`` user; with the TURN secret and, where the node has one, the Twilio auth token and
its stream URL); ``REDIS_USER``/``REDIS_PASSWORD`` for redis_exporter (the ``exporter`` user);
``DUPLEX_EVENTS_REDIS_URL`` for the application's events consumer (the ``events`` user, read-only on the
events stream: docs/sessions-api.md, "Events"); Grafana's admin
password (read through ``GF_SECURITY_ADMIN_PASSWORD__FILE``); the session-token signing keys, JSON
``{"kid": "secret", ...}``, which the runtime reads (``DUPLEX_TOKEN_KEYS_FILE``) and the application
backend mints with (``duplex token mint --key-file``, ``runtime.frontend.gate.tokens.mint_token``); the
application-token signing keys, the same JSON form but other keys (``DUPLEX_APP_TOKEN_KEYS_FILE``: the
sessions API's tokens, ``duplex token mint --app --key-file``; issue 34, item 8: what mints caller tokens
cannot mint one that reads or erases every session); coturn's
whole configuration (``infra.node.bundle.coturn``), which holds the TURN secret the runtime also gets in
``runtime.env`` (``DUPLEX_TURN_SECRET``), or a comment where the relay is off."""

OPTIONAL_SECRET_FILES = {
    "alert_email_password": "secrets/alert_email_password",
    "alert_pagerduty_routing_key": "secrets/alert_pagerduty_routing_key",
}
"""Secret files a node has only when its alert receivers need them (``NodeProfile.alerting``): the SMTP
password (``email_password``) and the PagerDuty Events API v2 routing key (``pagerduty``), each the bare
value; Alertmanager reads them itself (``auth_password_file``, ``routing_key_file``)."""

_TURN_SECRET_RE = re.compile(r"[A-Za-z0-9_-]{32,256}")
_ENV_VALUE_RE = re.compile(r"[!#-&(-~]{8,256}")
"""A value that goes unquoted into an env file: printable ASCII without spaces, ``"`` or ``'``."""


TOKEN_KEYS_CONTAINER_PATH = "/run/secrets/token_keys"
"""Where a ``compose`` node's runtime container reads ``secrets/token_keys.json`` (a Compose secret)."""
APP_TOKEN_KEYS_CONTAINER_PATH = "/run/secrets/app_token_keys"
"""Where a ``compose`` node's runtime container reads ``secrets/app_token_keys.json`` (a Compose secret)."""


def endpoint(profile: NodeProfile, service: Service) -> str:
    """``host:port`` at which other parts of the node reach ``service``.

    ``coturn``: its Prometheus exporter (``relay.metrics_port``), which only a ``compose`` node has.

    Raises:
        ValueError: unknown service (lists the allowed ones), ``dcgm-exporter`` on a CPU node, ``coturn``
            where the relay is off or has no exporter (Debian's coturn, the local node).
    """
    if service not in _PORT_FIELD:
        raise ValueError(f"unknown service {service!r}; allowed: {', '.join(SERVICES)}")
    if service == "dcgm-exporter" and profile.gpu is None:
        raise ValueError(f"profile {profile.name!r} has no GPU: it runs no dcgm-exporter")
    if service == "coturn" and not (profile.relay.enabled and profile.deployment == "compose"):
        raise ValueError(
            f"profile {profile.name!r}: coturn's exporter runs only in a compose node with the relay on"
        )
    port = profile.relay.metrics_port if service == "coturn" else getattr(profile.ports, _PORT_FIELD[service])
    host = service if profile.deployment == "compose" else profile.private_address
    return f"{host}:{port}"


def token_audience(profile: NodeProfile) -> str:
    """The ``aud`` claim this node's tokens must carry (``DUPLEX_TOKEN_AUDIENCE``): its public domain, so a
    token minted for one deployment (``duplex.example.com``) does not open sessions on another."""
    return profile.domain


def public_origin(profile: NodeProfile) -> str:
    """``https://<domain>[:port]``: the browser origin of pages served from the node's own name."""
    port = "" if profile.ports.https == 443 else f":{profile.ports.https}"
    return f"https://{profile.domain}{port}"


def rtc_candidate_settings(profile: NodeProfile) -> dict[str, str]:
    """Where a WebRTC caller's ICE candidates may point beyond global addresses
    (``runtime/frontend/transports/webrtc/candidates.py``): the node's own TURN relay's address
    (``DUPLEX_RTC_RELAY_NETS``: coturn's container in the Compose network's dynamic half, or the address
    the host's coturn listens on) and, for host processes, the host's own addresses (``relay.peer_networks``,
    filled in by the local node: a browser on the same host offers them as host candidates)."""
    relay = profile.relay
    if profile.deployment == "compose":
        return {"DUPLEX_RTC_RELAY_NETS": relay.dynamic_range}
    settings = {}
    if not ipaddress.ip_address(profile.public_address).is_unspecified:
        settings["DUPLEX_RTC_RELAY_NETS"] = profile.public_address
    if relay.peer_networks:
        settings["DUPLEX_RTC_ALLOWED_CANDIDATE_NETS"] = ",".join(relay.peer_networks)
    return settings


def runtime_settings(profile: NodeProfile) -> dict[str, str]:
    """The runtime's non-secret ``DUPLEX_*`` environment for this node (``runtime/config.py``); the Redis
    URL, which holds the password, comes from ``secrets/runtime.env``. ``DUPLEX_HOST`` is the private
    address for host processes and ``0.0.0.0`` in a container (whose only network is the node's bridge).

    Access control is on: tokens signed with the keys of ``secrets/token_keys.json`` (read by the runtime
    from the node directory, its working directory, in a ``processes`` deployment; from the Compose secret
    ``TOKEN_KEYS_CONTAINER_PATH`` in a container), for ``token_audience(profile)``, single-use (checked in
    the node's Redis, refusing while Redis is down); browser pages only from ``public_origin(profile)``."""
    local = profile.deployment == "processes"
    keys_file = SECRET_FILES["token_keys"] if local else TOKEN_KEYS_CONTAINER_PATH
    app_keys_file = SECRET_FILES["app_token_keys"] if local else APP_TOKEN_KEYS_CONTAINER_PATH
    settings = {
        "DUPLEX_HOST": profile.private_address if profile.deployment == "processes" else "0.0.0.0",
        "DUPLEX_PORT": str(profile.ports.runtime),
        "DUPLEX_MODEL": profile.model,
        "DUPLEX_DEVICE": profile.device,
        "DUPLEX_MAX_SESSIONS": str(profile.sessions),
        "DUPLEX_NODE_ID": profile.name,
        "DUPLEX_DRAIN_GRACE_S": str(profile.limits.drain_grace_s),
        "DUPLEX_MAX_SESSION_S": str(profile.limits.max_session_s),
        "DUPLEX_TRANSCRIPT_TTL_S": str(profile.retention.transcript_ttl_hours * 3600),
        "DUPLEX_AUTH_MODE": "token",
        "DUPLEX_TOKEN_KEYS_FILE": keys_file,
        "DUPLEX_APP_TOKEN_KEYS_FILE": app_keys_file,
        "DUPLEX_TOKEN_AUDIENCE": token_audience(profile),
        "DUPLEX_TOKEN_REPLAY_CHECK": "redis",
        "DUPLEX_ALLOWED_ORIGINS": public_origin(profile),
        # Engine process + front-end workers on the one port (runtime/multiproc.py).
        "DUPLEX_WORKERS": str(profile.frontend_workers),
    }
    if profile.relay.enabled:  # the secret is in secrets/runtime.env
        # Host processes: the relay listens on the public (loopback) address itself, whatever "localhost"
        # resolves to first (::1 in some clients); a host: its DNS name (the turns: URL's certificate).
        host = profile.public_address if profile.deployment == "processes" else profile.domain
        settings["DUPLEX_TURN_URLS"] = ",".join(turn_urls(profile.relay, host))
        settings["DUPLEX_TURN_TTL_S"] = str(profile.relay.credential_ttl_s)
        settings.update(rtc_candidate_settings(profile))
    if profile.runtime_dtype is not None:
        settings["DUPLEX_DTYPE"] = profile.runtime_dtype
    settings["DUPLEX_QUANTIZE"] = profile.runtime_quantize
    if profile.stagger_groups != 1:  # the runtime's default (1) is not written
        settings["DUPLEX_STAGGER_GROUPS"] = str(profile.stagger_groups)
    return settings


def services_of(profile: NodeProfile) -> tuple[Service, ...]:
    """The services this node runs (``dcgm-exporter`` only where there is a GPU, ``coturn`` where the
    relay is on)."""
    skip = {"dcgm-exporter"} if profile.gpu is None else set()
    if not profile.relay.enabled:
        skip.add("coturn")
    return tuple(s for s in SERVICES if s not in skip)


@dataclass(frozen=True)
class NodeSecrets:
    """The node's secrets (hidden from ``repr``). ``generate()`` makes fresh random ones (local node,
    first boot); stacks pass Pulumi secrets or Secret Manager values instead.

    ``redis_password``: the Redis ``admin`` user's password; the ``runtime``, ``events`` and ``exporter``
    users' passwords are derived from it (``infra.node.bundle.redis_acl.role_password``).

    ``token_keys``: the session-token signing keys, ``{kid: secret}`` (at least one; several during a
    rotation; ``duplex token keygen`` makes one). Required: a node without keys refuses every session.
    ``app_token_keys``: the application-token signing keys (the sessions API's), the same form, none of
    them a session key (a kid or a secret shared with ``token_keys`` is refused). Required too.
    ``alert_email_password``, ``alert_pagerduty_routing_key``: the alert receivers' secrets, where the
    profile's ``alerting`` uses them (``OPTIONAL_SECRET_FILES``).
    ``turn_secret``: the TURN REST shared secret of the relay (coturn's ``static-auth-secret``, the
    runtime's ``DUPLEX_TURN_SECRET``): at least 32 characters of ``[A-Za-z0-9_-]``; required where the
    profile's relay is on. ``turn_secret_previous``: the secret it replaces during a rotation, still
    accepted by coturn (not minted with), or None; the same form.
    """

    redis_password: str = field(repr=False)
    grafana_admin_password: str = field(repr=False)
    token_keys: dict[str, str] = field(default_factory=dict, repr=False)
    app_token_keys: dict[str, str] = field(default_factory=dict, repr=False)
    alert_email_password: str | None = field(default=None, repr=False)
    alert_pagerduty_routing_key: str | None = field(default=None, repr=False)
    turn_secret: str | None = field(default=None, repr=False)
    turn_secret_previous: str | None = field(default=None, repr=False)
    carrier_secrets: dict[str, str] = field(default_factory=dict, repr=False)
    """The phone carriers' secrets by name (``infra.node.bundle.carriers.CARRIER_SECRETS``): each turns its
    carrier's bridge on."""

    def __post_init__(self) -> None:
        for name in ("redis_password", "grafana_admin_password"):
            value = getattr(self, name)
            if len(value) < 16 or any(c.isspace() or c in "\"'@:/\\" for c in value):
                raise ValueError(
                    f"{name} must be at least 16 characters with no spaces, quotes, '@', ':', '/' or '\\' "
                    "(it goes into a Redis URL and config files)"
                )
        if not self.token_keys:
            raise ValueError(
                "token_keys needs at least one session-token signing key {kid: secret} "
                "(`duplex token keygen` makes one)"
            )
        self.signing_keys()  # kids and secret lengths
        if not self.app_token_keys:
            raise ValueError(
                "app_token_keys needs at least one application-token signing key {kid: secret}, other than "
                "the session keys (`duplex token keygen` makes one)"
            )
        self.app_signing_keys()
        shared = set(self.app_token_keys) & set(self.token_keys)
        shared |= {k for k, v in self.app_token_keys.items() if v in self.token_keys.values()}
        if shared:
            raise ValueError(
                f"app_token_keys {sorted(shared)}: an application key must not be a session key (kid or "
                "secret): whatever mints caller tokens could then mint one that reads every session"
            )
        for name in ("turn_secret", "turn_secret_previous"):
            value = getattr(self, name)
            if value is not None and not _TURN_SECRET_RE.fullmatch(value):
                raise ValueError(
                    f"{name} must be at least 32 characters of letters, digits, '_' and '-' (it goes into "
                    "turnserver.conf and an env file unquoted)"
                )

        for name, value in check_carrier_secrets(self.carrier_secrets).items():
            if not _ENV_VALUE_RE.fullmatch(value):
                raise ValueError(
                    f"{name} must be 8 to 256 printable characters without spaces or quotes (it goes into an "
                    "env file unquoted)"
                )

    def signing_keys(self) -> list[SigningKey]:
        """``token_keys`` as ``runtime.frontend.gate.tokens.SigningKey`` objects (the first is the one to mint
        with)."""
        return [SigningKey(kid, secret) for kid, secret in self.token_keys.items()]

    def app_signing_keys(self) -> list[SigningKey]:
        """``app_token_keys`` as ``SigningKey`` objects (the first is the one to mint with)."""
        return [SigningKey(kid, secret) for kid, secret in self.app_token_keys.items()]

    @classmethod
    def generate(cls) -> NodeSecrets:
        """Fresh random secrets: 32 URL-safe characters each (192 bits); one token signing key (256 bits);
        a TURN secret of 43 URL-safe characters (256 bits); stand-in secrets of every phone carrier (the local
        node's check plays each carrier's side of a call with them: ``infra.node.local.bringup``)."""
        key = generate_signing_key()
        app_key = generate_signing_key(f"app-{_stdlib_secrets.token_hex(4)}")
        return cls(
            redis_password=_stdlib_secrets.token_urlsafe(24),
            grafana_admin_password=_stdlib_secrets.token_urlsafe(24),
            token_keys={key.kid: key.secret.decode()},
            app_token_keys={app_key.kid: app_key.secret.decode()},
            turn_secret=_stdlib_secrets.token_urlsafe(32),
            carrier_secrets={name: _stdlib_secrets.token_hex(16) for name in CARRIER_SECRETS},
        )


def optional_secret_roles(profile: NodeProfile) -> tuple[str, ...]:
    """The roles of ``OPTIONAL_SECRET_FILES`` this node's alert receivers need."""
    alerting = profile.alerting
    needed = {
        "alert_email_password": alerting.email_password,
        "alert_pagerduty_routing_key": alerting.pagerduty,
    }
    return tuple(role for role, wanted in needed.items() if wanted)


def secret_files(profile: NodeProfile, node_secrets: NodeSecrets) -> dict[str, bytes]:
    """The files of ``SECRET_FILES`` for this node, and those of ``OPTIONAL_SECRET_FILES`` its alert
    receivers need, as {path relative to the bundle root: content}.

    Raises:
        ValueError: the profile's ``alerting`` needs a secret that ``node_secrets`` lacks, or its relay is on
            and ``node_secrets`` has no ``turn_secret``.
    """
    redis_host, redis_port = endpoint(profile, "redis").rsplit(":", 1)
    password = node_secrets.redis_password
    optional: dict[str, bytes] = {}
    for role in optional_secret_roles(profile):
        value = getattr(node_secrets, role)
        if not value:
            raise ValueError(
                f"{role}: the profile's alerting needs this secret (alerting.email_password or "
                "alerting.pagerduty is set) and none was given"
            )
        optional[OPTIONAL_SECRET_FILES[role]] = value.encode()
    runtime_env = f"DUPLEX_REDIS_URL={redis_url(password, 'runtime', redis_host, redis_port)}\n"
    events_env = f"DUPLEX_EVENTS_REDIS_URL={redis_url(password, 'events', redis_host, redis_port)}\n"
    exporter_env = f"REDIS_USER=exporter\nREDIS_PASSWORD={role_password(password, 'exporter')}\n"
    turnserver_conf = "# relay.enabled is false: this node runs no coturn\n"
    if profile.relay.enabled:
        if node_secrets.turn_secret is None:
            raise ValueError(
                "turn_secret: the profile's relay is on (relay.enabled) and no TURN secret was given"
            )
        runtime_env += f"DUPLEX_TURN_SECRET={node_secrets.turn_secret}\n"
        previous = () if node_secrets.turn_secret_previous is None else (node_secrets.turn_secret_previous,)
        turnserver_conf = render_turnserver_conf(profile, node_secrets.turn_secret, previous_secrets=previous)
    runtime_env += "".join(
        f"{k}={v}\n" for k, v in carrier_settings(profile, node_secrets.carrier_secrets).items()
    )
    files = {
        SECRET_FILES["redis_password"]: password.encode(),
        SECRET_FILES["redis_auth_conf"]: render_acl_users(password).encode(),
        SECRET_FILES["runtime_env"]: runtime_env.encode(),
        SECRET_FILES["redis_exporter_env"]: exporter_env.encode(),
        SECRET_FILES["events_consumer_env"]: events_env.encode(),
        SECRET_FILES["grafana_admin_password"]: node_secrets.grafana_admin_password.encode(),
        SECRET_FILES["token_keys"]: (json.dumps(node_secrets.token_keys, indent=2) + "\n").encode(),
        SECRET_FILES["app_token_keys"]: (json.dumps(node_secrets.app_token_keys, indent=2) + "\n").encode(),
        SECRET_FILES["turnserver_conf"]: turnserver_conf.encode(),
    }
    return files | optional
