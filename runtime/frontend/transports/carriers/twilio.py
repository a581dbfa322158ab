"""Twilio Media Streams (bidirectional ``<Connect><Stream>``) on ``/api/carriers/twilio``: Twilio's
:class:`~runtime.frontend.transports.carriers.edge.Dialect` (the call's edge, gate, hold tone, barge-in and
bad input are ``edge.py``'s).

Messages (JSON text frames; Twilio's "Media Streams - WebSocket Messages" reference):

- in: ``connected``; ``start`` (``streamSid``, ``start.callSid``, ``start.customParameters``: the TwiML's
  ``<Parameter>`` elements, ``start.mediaFormat``: ``audio/x-mulaw`` at 8000 Hz mono); ``media``
  (``media.payload``: base64 of 20 ms of μ-law); ``dtmf`` (``dtmf.digit``); ``mark`` (``mark.name``: a mark
  this side sent, played out); ``stop``.
- out: ``media`` (base64 μ-law, 20 ms each), ``mark`` after each model frame (80 ms), ``clear`` (barge-in).

Admission: the ``X-Twilio-Signature`` before the upgrade (``runtime.frontend.gate.carrier_auth``), then the
token on the ``start`` message: Twilio sends no ``Authorization`` header and drops a stream URL's query
string, so the session token, voice and role prompt come as custom parameters (``token``,
``voice_prompt``, ``text_prompt``, and any other ``/api/chat`` query parameter). Twilio does not reconnect
a stream: a call is not resumed.
"""

from __future__ import annotations

import logging

from aiohttp import web

from runtime.config import RuntimeConfig
from runtime.frontend.gate.carrier_auth import TWILIO_SIGNATURE_HEADER, twilio_signature_valid
from runtime.frontend.gate.refusals import SessionRefused
from runtime.frontend.transports.carriers.dialect import CallStart, MediaMarkClearDialect

__all__ = ["TWILIO_PATH", "TwilioDialect"]

TWILIO_PATH = "/api/carriers/twilio"
_MEDIA_FORMAT = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}
"""The only ``start.mediaFormat`` of a bidirectional stream (Twilio's reference: μ-law, 8000 Hz, mono)."""


class TwilioDialect(MediaMarkClearDialect):
    """Twilio Media Streams' messages (the module doc)."""

    name = "twilio"
    path = TWILIO_PATH
    log = logging.getLogger(__name__)
    secret_env = "DUPLEX_TWILIO_AUTH_TOKEN"
    stream_key = "streamSid"

    @classmethod
    def secret(cls, config: RuntimeConfig) -> str | None:
        """``DUPLEX_TWILIO_AUTH_TOKEN(_FILE)``; None (off) without it or without the stream URL."""
        if config.twilio_stream_url is None:
            return None
        return config.twilio_secret()

    @classmethod
    def signed(cls, config: RuntimeConfig, secret: str, request: web.Request) -> bool:
        """``X-Twilio-Signature`` signs ``DUPLEX_TWILIO_STREAM_URL`` (as configured: the node does not
        rebuild it from ``Host`` headers a proxy could rewrite)."""
        url = config.twilio_stream_url or ""
        return twilio_signature_valid(secret, url, request.headers.get(TWILIO_SIGNATURE_HEADER))

    @classmethod
    def read_start(cls, event: dict[str, object]) -> CallStart | None:
        """``connected`` is skipped; ``start`` gives the call.

        Raises:
            SessionRefused: ``bad_request``: another event first, custom parameters that are not an
                object, a media format other than μ-law at 8000 Hz mono.
        """
        kind = event.get("event")
        if kind == "connected":
            return None
        start = event.get("start")
        if kind != "start" or not isinstance(start, dict):
            raise SessionRefused("bad_request", f"bad request: expected Twilio's start message, got {kind!r}")
        media = start.get("mediaFormat") or {}
        got = {key: media.get(key) for key in _MEDIA_FORMAT} if isinstance(media, dict) else {}
        if got != _MEDIA_FORMAT:
            raise SessionRefused(
                "bad_request", f"bad request: media format {got}; this bridge takes {_MEDIA_FORMAT}"
            )
        parameters = start.get("customParameters") or {}
        if not isinstance(parameters, dict):
            raise SessionRefused("bad_request", "bad request: customParameters is not an object")
        return CallStart(
            stream_id=str(start.get("streamSid", event.get("streamSid", ""))),
            call_id=str(start.get("callSid", "")),
            parameters={str(k): str(v) for k, v in parameters.items()},
        )
