"""Exotel voicebot streams (the Voicebot applet, AgentStream: bidirectional) on ``/api/carriers/exotel``:
Exotel's :class:`~runtime.frontend.transports.carriers.dialect.Dialect` (the call's edge is ``edge.py``'s).

Messages (JSON text frames; Exotel's "WebSocket protocol" page, developer.exotel.com/docs/agentstream):
Twilio's events with snake_case keys.

- in: ``connected``; ``start`` (``stream_sid``, ``start.call_sid``, ``start.account_sid``,
  ``start.custom_parameters``, ``start.media_format``: ``audio/x-raw``, 16-bit little-endian PCM, at 8000,
  16000 or 24000 Hz as the stream URL's ``sample-rate`` chose); ``media`` (``media.payload``: base64 of PCM,
  Exotel sends about 100 ms); ``dtmf`` (``dtmf.digit``); ``mark`` (``mark.name``: played out); ``stop``.
- out: ``media`` (``stream_sid``, ``media.payload``: 20 ms of the same PCM, a multiple of 320 bytes at
  8 kHz), ``mark`` after each model frame (80 ms), ``clear`` (barge-in): the shapes pipecat's
  ``ExotelFrameSerializer`` writes.

Admission: Basic auth on the upgrade (``wss://<api key>:<api token>@host/...``, Exotel's documented
authentication of a voicebot's URL), checked against ``DUPLEX_EXOTEL_API_KEY`` and
``DUPLEX_EXOTEL_API_TOKEN`` in constant time. An Exotel call carries no session token: its custom parameters
come from the stream URL's query, 3 pairs and 256 characters at most, where a session token does not fit.
So the bridge admits on the account's credential, with a per-carrier persona policy instead of the token's
``personas`` claim: ``DUPLEX_EXOTEL_PERSONAS`` (the voices an Exotel call may name; ``*`` any; empty: the
node's default voice only), refused ``persona_not_allowed`` otherwise. No token is spent and no recording
consent is given (a token's claim). Exotel does not reconnect a stream: a call is not resumed.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging

from aiohttp import web

from runtime.config import RuntimeConfig
from runtime.engine.persona_limits import voice_name
from runtime.frontend.codecs.telephony import CarrierEncoding
from runtime.frontend.gate.refusals import SessionRefused
from runtime.frontend.transports.carriers.dialect import CallStart, MediaMarkClearDialect

__all__ = ["EXOTEL_PATH", "ExotelDialect"]

EXOTEL_PATH = "/api/carriers/exotel"
_RATES = (8000, 16000, 24000)
"""The PCM rates a voicebot stream offers (the URL's ``sample-rate``; Exotel's WebSocket protocol page)."""


def _basic_credentials(header: str | None) -> str | None:
    """``Authorization: Basic <base64(user:password)>`` -> ``user:password``; None: absent, not Basic."""
    scheme, _, encoded = (header or "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        return base64.b64decode(encoded.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


class ExotelDialect(MediaMarkClearDialect):
    """Exotel voicebot streams' messages (the module doc)."""

    name = "exotel"
    path = EXOTEL_PATH
    log = logging.getLogger(__name__)
    secret_env = "DUPLEX_EXOTEL_API_KEY and DUPLEX_EXOTEL_API_TOKEN"
    admits_on_credential = True
    stream_key = "stream_sid"

    @classmethod
    def secret(cls, config: RuntimeConfig) -> str | None:
        """``<key>:<token>`` from the settings; None (off) without them."""
        return config.exotel_secret()

    @classmethod
    def signed(cls, config: RuntimeConfig, secret: str, request: web.Request) -> bool:
        """The upgrade's Basic auth is the account's ``<key>:<token>``."""
        given = _basic_credentials(request.headers.get("Authorization"))
        return given is not None and hmac.compare_digest(given.encode(), secret.encode())

    @classmethod
    def check_persona(cls, config: RuntimeConfig, voice_prompt: str | None) -> str | None:
        """``DUPLEX_EXOTEL_PERSONAS`` allows ``voice_prompt`` (``NATF2`` and ``NATF2.pt`` are one voice)."""
        allowed = config.exotel_personas
        if (
            voice_prompt is None
            or "*" in allowed
            or voice_name(voice_prompt) in {voice_name(v) for v in allowed}
        ):
            return None
        listed = ", ".join(allowed) or "none: the node's default voice only"
        return f"Exotel calls may not use voice {voice_prompt!r}; DUPLEX_EXOTEL_PERSONAS allows {listed}"

    @classmethod
    def upgrade_parameters(cls, request: web.Request) -> dict[str, str]:
        """The stream URL's query (``sample-rate`` taken out: the ``start`` message names the rate)."""
        return {key: request.query[key] for key in request.query if key != "sample-rate"}

    @classmethod
    def read_start(cls, event: dict[str, object]) -> CallStart | None:
        """``connected`` is skipped; ``start`` gives the call.

        Raises:
            SessionRefused: ``bad_request``: another event first, custom parameters that are not an
                object, a media format other than 16-bit PCM at 8000, 16000 or 24000 Hz.
        """
        kind = event.get("event")
        if kind == "connected":
            return None
        start = event.get("start")
        if kind != "start" or not isinstance(start, dict):
            raise SessionRefused("bad_request", f"bad request: expected Exotel's start message, got {kind!r}")
        media = start.get("media_format")
        media = media if isinstance(media, dict) else {}
        encoding, rate, bits = media.get("encoding"), media.get("sample_rate"), media.get("bit_rate", "16")
        try:
            rate_hz = int(str(rate))
            if encoding != "audio/x-raw" or rate_hz not in _RATES or str(bits) != "16":
                raise ValueError(encoding)
        except ValueError:
            raise SessionRefused(
                "bad_request",
                f"bad request: media format {encoding!r} at {rate!r} Hz, {bits!r} bits; this bridge takes "
                f"audio/x-raw (16-bit PCM) at {', '.join(map(str, _RATES))} Hz",
            ) from None
        parameters = start.get("custom_parameters") or {}
        if not isinstance(parameters, dict):
            raise SessionRefused("bad_request", "bad request: custom_parameters is not an object")
        return CallStart(
            stream_id=str(start.get("stream_sid", event.get("stream_sid", ""))),
            call_id=str(start.get("call_sid", "")),
            parameters={str(k): str(v) for k, v in parameters.items()},
            encoding=CarrierEncoding.L16,
            rate_hz=rate_hz,
        )
