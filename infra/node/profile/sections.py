"""The sections of a node profile (``infra.node.profile.profiles.NodeProfile``): its ports, TLS, alert
receivers, limits and retention, each a frozen pydantic model that refuses unknown fields and names what is
allowed. ``infra.node.profile.profiles`` re-exports every public name here."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runtime.engine.model_presets import FRAME_MS

__all__ = [
    "LETSENCRYPT_DIRECTORY",
    "AlertReceivers",
    "NodeLimits",
    "NodePorts",
    "Retention",
    "StrictModel",
    "TlsSettings",
]

LETSENCRYPT_DIRECTORY = "https://acme-v02.api.letsencrypt.org/directory"
"""Let's Encrypt's production ACME v2 directory (letsencrypt.org/docs/acme-protocol-updates); its staging
directory, for trials that must not count against the production rate limits, is
``https://acme-staging-v02.api.letsencrypt.org/directory``."""

_EMAIL_RE = re.compile(r"^[^@\s\"'<>,;]+@([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$", re.IGNORECASE)
_HTTP_URL_RE = re.compile(r"^https?://[^\s\"'{}|\\^`<>]+$")
_SMARTHOST_RE = re.compile(r"^[A-Za-z0-9.-]+:[0-9]{1,5}$")


class StrictModel(BaseModel):
    """A frozen pydantic model that refuses unknown fields (every profile section)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NodePorts(StrictModel):
    """TCP ports of the node's services. ``https``/``http`` are public (nginx); the rest listen on
    ``NodeProfile.private_address`` only."""

    https: int = Field(443, ge=1, le=65535)
    http: int = Field(80, ge=1, le=65535, description="Plain HTTP: redirects to HTTPS")
    runtime: int = Field(8998, ge=1, le=65535, description="The runtime's WebSocket/HTTP port (behind nginx)")
    redis: int = Field(6379, ge=1, le=65535)
    prometheus: int = Field(9090, ge=1, le=65535)
    grafana: int = Field(3000, ge=1, le=65535)
    node_exporter: int = Field(9100, ge=1, le=65535)
    redis_exporter: int = Field(9121, ge=1, le=65535)
    dcgm_exporter: int = Field(9400, ge=1, le=65535)
    alertmanager: int = Field(9093, ge=1, le=65535, description="Alertmanager (private side only)")

    @model_validator(mode="after")
    def _distinct(self) -> NodePorts:
        seen: dict[int, str] = {}
        for name, port in self.model_dump().items():
            if port in seen:
                raise ValueError(f"ports.{name} and ports.{seen[port]} are both {port}; each needs its own")
            seen[port] = name
        return self


class TlsSettings(StrictModel):
    """Where nginx finds its certificate. ``self-signed``: generated at bring-up (``infra.node.bundle.tls``),
    for local nodes and first boots; ``files``: the operator's certificate and key at these paths on the host
    (from a secret store); ``acme``: a certificate for ``NodeProfile.domain`` from an ACME CA (Let's
    Encrypt by default) by HTTP-01 through the node's own nginx (``infra.node.bundle.acme``), written to these
    paths, with a self-signed one there until the first is issued.

    Attributes:
        acme_email: the ACME account's contact address (expiry and incident mail); required for ``acme``.
        acme_directory: the ACME server's directory URL (``LETSENCRYPT_DIRECTORY`` by default).

    Raises:
        pydantic.ValidationError: ``acme`` without an e-mail address, a malformed address or directory URL.
    """

    mode: Literal["self-signed", "files", "acme"] = "self-signed"
    certificate_path: str = Field("/etc/duplex/tls/node.crt", description="PEM chain, path on the node")
    private_key_path: str = Field("/etc/duplex/tls/node.key", description="PEM key, path on the node")
    acme_email: str | None = None
    acme_directory: str = LETSENCRYPT_DIRECTORY

    @field_validator("acme_email")
    @classmethod
    def _email(cls, value: str | None) -> str | None:
        if value is not None and not _EMAIL_RE.match(value):
            raise ValueError(f"acme_email {value!r} is not an e-mail address (e.g. ops@example.com)")
        return value

    @field_validator("acme_directory")
    @classmethod
    def _directory(cls, value: str) -> str:
        if not re.match(r"^https://[^\s]+$", value):
            raise ValueError(
                f"acme_directory {value!r} is not an https:// URL (e.g. {LETSENCRYPT_DIRECTORY})"
            )
        return value

    @model_validator(mode="after")
    def _acme_needs_email(self) -> TlsSettings:
        if self.mode == "acme" and self.acme_email is None:
            raise ValueError(
                "tls.mode 'acme' needs tls.acme_email (the ACME account's contact address); or use "
                "tls.mode 'self-signed'"
            )
        return self


class AlertReceivers(StrictModel):
    """Where the node's Alertmanager sends alerts (``infra.node.monitoring.alertmanager``); every one
    configured gets every alert. Secrets are not here: the e-mail password and the PagerDuty routing key are
    secret files (``infra.node.bundle.services.OPTIONAL_SECRET_FILES``), named by the flags below.

    Attributes:
        webhook_url: an HTTP(S) URL Alertmanager POSTs its webhook JSON to (version 4 payload).
        email_to, email_from, email_smarthost: recipient, sender and SMTP server ``host:port``; all three
            or none. ``email_username``: the SMTP login (``email_from`` when unset) when
            ``email_password`` is true (the password is the secret file ``alert_email_password``).
        pagerduty: send to PagerDuty Events API v2 with the routing key of the secret file
            ``alert_pagerduty_routing_key``.

    Raises:
        pydantic.ValidationError: a malformed URL, address or smarthost; part of the e-mail settings.
    """

    webhook_url: str | None = None
    email_to: str | None = None
    email_from: str | None = None
    email_smarthost: str | None = None
    email_username: str | None = None
    email_password: bool = False
    pagerduty: bool = False
    group_wait_s: int = Field(
        30, ge=0, le=3600, description="How long Alertmanager gathers a new group's alerts before sending"
    )

    @field_validator("webhook_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not _HTTP_URL_RE.match(value):
            raise ValueError(
                f"webhook_url {value!r} is not an http(s) URL (e.g. https://hooks.example.com/x)"
            )
        return value

    @field_validator("email_to", "email_from")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None and not _EMAIL_RE.match(value):
            raise ValueError(f"{value!r} is not an e-mail address (e.g. oncall@example.com)")
        return value

    @field_validator("email_smarthost")
    @classmethod
    def _smarthost(cls, value: str | None) -> str | None:
        if value is not None and not _SMARTHOST_RE.match(value):
            raise ValueError(f"email_smarthost {value!r} is not host:port (e.g. smtp.example.com:587)")
        return value

    @model_validator(mode="after")
    def _email_complete(self) -> AlertReceivers:
        parts = {
            "email_to": self.email_to,
            "email_from": self.email_from,
            "email_smarthost": self.email_smarthost,
        }
        given = [k for k, v in parts.items() if v is not None]
        if given and len(given) != len(parts):
            missing = ", ".join(k for k in parts if k not in given)
            raise ValueError(
                f"e-mail alerts need email_to, email_from and email_smarthost; missing: {missing}"
            )
        if not given and (self.email_password or self.email_username):
            raise ValueError(
                "email_username/email_password given without email_to, email_from, email_smarthost"
            )
        return self

    @property
    def email(self) -> bool:
        """E-mail receivers are configured."""
        return self.email_to is not None

    @property
    def any(self) -> bool:
        """At least one receiver is configured (without one, alerts stay in Alertmanager's UI)."""
        return self.webhook_url is not None or self.email or self.pagerduty


class NodeLimits(StrictModel):
    """What one node admits, and the targets its alerts watch."""

    max_sessions_per_client: int = Field(
        2, ge=1, description="Concurrent WebSocket sessions per client address (nginx limit_conn)"
    )
    max_session_s: int = Field(3600, ge=10, le=86400, description="Longest session; nginx waits longer")
    first_audio_p99_target_ms: float = Field(
        180.0,
        gt=2 * FRAME_MS,
        description="Alert above this p99 first-audio latency (Scale-5: 180 ms); on a GPU node, refused "
        "below what the GPU could reach at its peak and warned below the capacity planner's estimate "
        "(NodeProfile.first_audio_warnings)",
    )
    at_cap_alert_minutes: int = Field(10, ge=1, le=1440, description="Alert when full for this long")
    gpu_memory_alert_fraction: float = Field(0.9, gt=0, lt=1, description="Alert above this GPU memory use")
    drain_grace_s: int = Field(
        30, ge=0, le=86400, description="How long running sessions may go on after SIGTERM"
    )
    handshakes_per_second_per_client: float = Field(
        5.0,
        gt=0,
        le=1000,
        description="Session handshakes (/api/chat requests) per second per client address (nginx "
        "limit_req); whole requests per second or per minute (0.5 = 30 per minute)",
    )
    handshake_burst: int = Field(
        10, ge=0, le=10000, description="Handshakes above the rate let through at once (nginx burst)"
    )

    @field_validator("handshakes_per_second_per_client")
    @classmethod
    def _nginx_rate(cls, value: float) -> float:
        per_minute = value * 60
        if abs(per_minute - round(per_minute)) > 1e-9:
            raise ValueError(
                f"{value:g} handshakes per second is not a whole number per minute (nginx rates are "
                "r/s or r/m); e.g. 5, 0.5 (30/min), 0.25 (15/min)"
            )
        return value

    @property
    def nginx_handshake_rate(self) -> str:
        """``limit_req_zone``'s ``rate=``: ``5r/s``, or ``30r/m`` for 0.5 per second."""
        rate = self.handshakes_per_second_per_client
        return f"{round(rate)}r/s" if rate == round(rate) else f"{round(rate * 60)}r/m"


class Retention(StrictModel):
    """How long the node keeps what it records."""

    prometheus_days: int = Field(15, ge=1, le=3650)
    redis_max_memory_mb: int = Field(
        512, ge=16, description="Redis maxmemory (MB); transcripts beyond it are evicted by TTL"
    )
    transcript_ttl_hours: int = Field(
        24 * 7, ge=1, description="Redis TTL of a finished session's transcript"
    )
