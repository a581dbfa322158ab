"""Phone carriers on a node: which secret turns each carrier's media-stream bridge on, and the runtime
settings it becomes (docs/deploying.md, "Phone numbers").

A carrier's bridge (``runtime.frontend.transports.carriers``) is off until the node has its secret. The stack
keys (``twilioAuthToken``, ``plivoAuthToken``, ``telnyxStreamToken``, ``exotelApiKey`` with
``exotelApiToken``) reach ``NodeSecrets.carrier_secrets`` under the names of :data:`CARRIER_SECRETS`; a single
node writes them into its runtime's ``secrets/runtime.env`` (:func:`carrier_settings`), a multi-region pod
reads them from its Kubernetes Secret (``infra.k8s.workload``). Twilio and Plivo sign each stream over the URL
the carrier was given, so the runtime also gets that URL (:func:`carrier_stream_url`): the node's
``wss://<domain>`` and the bridge's path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infra.node.profile.profiles import NodeProfile

__all__ = [
    "CARRIER_PATHS",
    "CARRIER_SECRETS",
    "SIGNED_URL_SETTINGS",
    "carrier_settings",
    "carrier_stream_url",
    "carrier_credentials",
    "check_carrier_secrets",
]

CARRIER_PATHS: dict[str, str] = {
    "twilio": "/api/carriers/twilio",
    "plivo": "/api/carriers/plivo",
    "telnyx": "/api/carriers/telnyx",
    "exotel": "/api/carriers/exotel",
}
"""Each carrier's media-stream route on the node: the runtime's dialects' ``path``
(``runtime.frontend.transports.carriers``), written here because the deploy role runs without the runtime's
dependencies (aiohttp: ``tests/test_deploy_role.py``); ``tests/test_public_paths.py`` holds the two equal."""

CARRIER_SECRETS: dict[str, tuple[str, str]] = {
    "twilio_auth_token": ("twilio", "DUPLEX_TWILIO_AUTH_TOKEN"),
    "plivo_auth_token": ("plivo", "DUPLEX_PLIVO_AUTH_TOKEN"),
    "telnyx_stream_token": ("telnyx", "DUPLEX_TELNYX_STREAM_TOKEN"),
    "exotel_api_key": ("exotel", "DUPLEX_EXOTEL_API_KEY"),
    "exotel_api_token": ("exotel", "DUPLEX_EXOTEL_API_TOKEN"),
}
"""A carrier secret's name (as in ``NodeSecrets.carrier_secrets``, the stack key in snake case) -> (the
carrier, the runtime setting it becomes). ``runtime/config.py`` holds each setting's rules."""

SIGNED_URL_SETTINGS: dict[str, str] = {
    "twilio": "DUPLEX_TWILIO_STREAM_URL",
    "plivo": "DUPLEX_PLIVO_STREAM_URL",
}
"""Carriers that sign each stream over its URL (``X-Twilio-Signature``, ``X-Plivo-Signature-V3``): the
runtime setting that tells the bridge the URL the carrier was given."""

_PAIRED = ("exotel_api_key", "exotel_api_token")
"""Secrets that make sense only together (Exotel's Basic auth: key and token)."""


def carrier_stream_url(profile: NodeProfile, carrier: str) -> str:
    """``wss://<domain>[:port]/api/carriers/<carrier>``: what the carrier's stream instruction names (the
    TwiML's ``<Stream url>``, Plivo's ``<Stream>``...) and what Twilio and Plivo sign.

    Raises:
        ValueError: an unknown carrier (the message lists the known ones).
    """
    if carrier not in CARRIER_PATHS:
        raise ValueError(f"unknown carrier {carrier!r}; known: {', '.join(CARRIER_PATHS)}")
    port = "" if profile.ports.https == 443 else f":{profile.ports.https}"
    return f"wss://{profile.domain}{port}{CARRIER_PATHS[carrier]}"


def check_carrier_secrets(secrets: Mapping[str, str | None]) -> dict[str, str]:
    """The carrier secrets that are set, checked: known names, Exotel's key and token both or neither.

    Raises:
        ValueError: an unknown name (the message lists the known ones) or one of Exotel's pair alone.
    """
    given = {name: value for name, value in secrets.items() if value is not None}
    unknown = sorted(set(given) - set(CARRIER_SECRETS))
    if unknown:
        raise ValueError(f"unknown carrier secrets {unknown}; known: {', '.join(CARRIER_SECRETS)}")
    if sum(name in given for name in _PAIRED) == 1:
        raise ValueError(
            "exotel_api_key and exotel_api_token go together (Exotel's Basic auth on the upgrade): set both "
            "(stack keys exotelApiKey and exotelApiToken) or neither"
        )
    return given


def carrier_credentials(secrets: Mapping[str, str | None]) -> dict[str, str]:
    """What the carrier's side of a call presents, by carrier, for the carriers whose secrets are set: the
    auth token Twilio and Plivo sign with, Telnyx's stream secret, Exotel's ``<api key>:<api token>`` (what
    ``runtime.tools.loadgen_phone.run_phone_load`` takes as ``secret``), in :data:`CARRIER_PATHS`' order.

    Raises:
        ValueError: as :func:`check_carrier_secrets`.
    """
    given = check_carrier_secrets(secrets)
    credentials = {
        "twilio": given.get("twilio_auth_token"),
        "plivo": given.get("plivo_auth_token"),
        "telnyx": given.get("telnyx_stream_token"),
        "exotel": f"{given['exotel_api_key']}:{given['exotel_api_token']}"
        if "exotel_api_key" in given
        else None,
    }
    return {carrier: value for carrier, value in credentials.items() if value is not None}


def carrier_settings(profile: NodeProfile, secrets: Mapping[str, str | None]) -> dict[str, str]:
    """The runtime settings of the carriers whose secrets are set: each secret's setting, and for a carrier
    that signs over its URL the URL (``DUPLEX_TWILIO_STREAM_URL``...); ``{}`` with none.

    Raises:
        ValueError: as :func:`check_carrier_secrets`.
    """
    given = check_carrier_secrets(secrets)
    settings: dict[str, str] = {}
    for name, value in given.items():
        carrier, setting = CARRIER_SECRETS[name]
        settings[setting] = value
        if carrier in SIGNED_URL_SETTINGS:
            settings[SIGNED_URL_SETTINGS[carrier]] = carrier_stream_url(profile, carrier)
    return settings
