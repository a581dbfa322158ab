"""Alertmanager of one node: ``render_alertmanager(profile)`` gives ``alertmanager/alertmanager.yml``, which
delivers the alerts Prometheus sends to the receivers of ``profile.alerting`` (webhook, e-mail, PagerDuty).
Pages go to every receiver, tickets never to PagerDuty; secrets are read from files and never rendered, so
the same profile always gives the same bytes.

Receivers, routing, grouping and checks: docs/operations.md, "Where alerts go (single nodes)"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra.node.bundle.services import OPTIONAL_SECRET_FILES
from infra.node.profile.profiles import NodeProfile
from infra.yaml_text import dump_yaml

__all__ = [
    "ALERTMANAGER_CONFIG",
    "PAGE_RECEIVER",
    "TICKET_RECEIVER",
    "alertmanager_args",
    "alertmanager_config",
    "render_alertmanager",
    "secret_file_path",
]

ALERTMANAGER_CONFIG = "alertmanager/alertmanager.yml"
"""The bundle path of the rendered configuration."""

PAGE_RECEIVER = "duplex-page"
"""Receiver of ``severity: page`` alerts: every configured integration."""
TICKET_RECEIVER = "duplex-ticket"
"""Receiver of every other alert: the webhook and e-mail, not PagerDuty."""

CONTAINER_SECRETS_DIR = "/run/secrets"
"""Where Compose mounts the node's secrets in the Alertmanager container."""

_GROUP_INTERVAL = "5m"
_REPEAT_INTERVAL = {"page": "1h", "ticket": "4h"}


def secret_file_path(profile: NodeProfile, role: str) -> str:
    """Where this node's Alertmanager reads the secret file of ``role`` (``OPTIONAL_SECRET_FILES``): the
    Compose secret's mount in a container, the node-directory-relative path on a ``processes`` node.

    Raises:
        KeyError: ``role`` is not one of ``OPTIONAL_SECRET_FILES`` (the message lists them).
    """
    if role not in OPTIONAL_SECRET_FILES:
        raise KeyError(f"unknown alert secret role {role!r}; allowed: {', '.join(OPTIONAL_SECRET_FILES)}")
    if profile.deployment == "compose":
        return f"{CONTAINER_SECRETS_DIR}/{role}"
    return OPTIONAL_SECRET_FILES[role]


def _integrations(profile: NodeProfile, *, page: bool, inline: Mapping[str, str] | None) -> dict[str, Any]:
    """The receiver's integrations; the secrets as files (``inline`` None) or as values from ``inline``."""
    alerting = profile.alerting
    receiver: dict[str, Any] = {}
    if alerting.webhook_url is not None:
        receiver["webhook_configs"] = [{"url": alerting.webhook_url, "send_resolved": True}]
    if alerting.email:
        email: dict[str, Any] = {
            "to": alerting.email_to,
            "from": alerting.email_from,
            "smarthost": alerting.email_smarthost,
            "require_tls": True,
            "send_resolved": True,
        }
        if alerting.email_password:
            email["auth_username"] = alerting.email_username or alerting.email_from
            if inline is None:
                email["auth_password_file"] = secret_file_path(profile, "alert_email_password")
            else:
                email["auth_password"] = _inline_secret(inline, "alert_email_password")
        receiver["email_configs"] = [email]
    if page and alerting.pagerduty:
        key = "alert_pagerduty_routing_key"
        pagerduty = (
            {"routing_key_file": secret_file_path(profile, key)}
            if inline is None
            else {"routing_key": _inline_secret(inline, key)}
        )
        receiver["pagerduty_configs"] = [{**pagerduty, "send_resolved": True, "severity": "critical"}]
    return receiver


def _inline_secret(inline: Mapping[str, str], role: str) -> str:
    value = inline.get(role)
    if not value:
        raise ValueError(
            f"inline_secrets: the receivers need {role!r} (a non-empty value); given: {sorted(inline)}"
        )
    return value


def alertmanager_config(
    profile: NodeProfile, inline_secrets: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The configuration as a dict (see the module docstring for the routing).

    Args:
        inline_secrets: None (a node): the receivers' secrets are files (``auth_password_file``,
            ``routing_key_file``: ``secret_file_path``). Else ``{role of OPTIONAL_SECRET_FILES: value}``
            and the values go into the configuration itself (``auth_password``, ``routing_key``), for an
            Alertmanager that reads nothing but its configuration (GMP's managed Alertmanager:
            ``infra.k8s.alerting``); the result is then a secret.

    Raises:
        ValueError: ``inline_secrets`` lacks a secret the receivers use.
    """
    group_wait = f"{profile.alerting.group_wait_s}s"
    return {
        "route": {
            "receiver": TICKET_RECEIVER,
            "group_by": ["alertname", "node"],
            "group_wait": group_wait,
            "group_interval": _GROUP_INTERVAL,
            "repeat_interval": _REPEAT_INTERVAL["ticket"],
            "routes": [
                {
                    "receiver": PAGE_RECEIVER,
                    "matchers": ['severity="page"'],
                    "repeat_interval": _REPEAT_INTERVAL["page"],
                }
            ],
        },
        "receivers": [
            {"name": PAGE_RECEIVER, **_integrations(profile, page=True, inline=inline_secrets)},
            {"name": TICKET_RECEIVER, **_integrations(profile, page=False, inline=inline_secrets)},
        ],
    }


def render_alertmanager(profile: NodeProfile) -> dict[str, bytes]:
    """``{"alertmanager/alertmanager.yml": ...}`` for ``profile``; the same profile gives the same bytes."""
    header = (
        f"# Rendered by infra.node.monitoring.alertmanager for profile {profile.name!r}; edit the renderer, "
        "not this file.\n"
    )
    return {ALERTMANAGER_CONFIG: (header + dump_yaml(alertmanager_config(profile))).encode()}


def alertmanager_args(config_path: str, data_dir: str, listen_address: str) -> list[str]:
    """Alertmanager's command-line flags: the configuration, its data (silences, notification log), the
    listen address, and no cluster listener (one Alertmanager per node: the default would gossip on
    0.0.0.0:9094)."""
    return [
        f"--config.file={config_path}",
        f"--storage.path={data_dir}",
        f"--web.listen-address={listen_address}",
        "--cluster.listen-address=",
    ]
