"""Plivo Audio Streams (``<Stream bidirectional="true">``) on ``/api/carriers/plivo``: Plivo's
:class:`~runtime.frontend.transports.carriers.dialect.Dialect` (the call's edge is ``edge.py``'s).

Messages (JSON text frames; Plivo's "Audio Streaming Protocol Reference" and its "Stream events to Plivo"
pages):

- in: ``start`` (``start.streamId``, ``start.callId``, ``start.mediaFormat``: ``encoding``
  ``audio/x-mulaw`` at 8000 Hz, or ``audio/x-l16`` at 8000 or 16000 Hz, as the ``<Stream contentType>``
  chose; top-level ``extra_headers``: the ``extraHeaders`` attribute, ``name=value`` pairs separated by
  ``;`` or ``,``); ``media`` (``media.payload``: base64 of 20 ms); ``dtmf`` (``dtmf.digit``);
  ``playedStream`` (``name``: a checkpoint this side sent, played out); ``clearedAudio`` (the
  acknowledgement of a ``clearAudio``); ``stop``.
- out: ``playAudio`` (``media``: ``contentType``, ``sampleRate``, ``payload``), ``checkpoint``
  (``name``) after each model frame (80 ms), ``clearAudio`` (barge-in); each with ``streamId``.

Admission: ``X-Plivo-Signature-V3`` with its nonce on the upgrade (``runtime.frontend.gate.carrier_auth``),
then the token on the ``start`` message. The call's parameters (``token``, ``voice_prompt``,
``text_prompt``, ...) come from the stream URL's query string (the ``<Stream>`` URL, e.g.
``wss://voice.example.com/api/carriers/plivo?token=...&voice_prompt=NATF2.pt``; signed with it) and from
``extraHeaders`` (letters and digits only, 512 bytes: too narrow for a token's ``.``, ``-`` and ``_``, fine
for a voice name); ``extraHeaders`` wins where both name one. Plivo does not reconnect a stream: a call is
not resumed.
"""

from __future__ import annotations

import logging
import re

from aiohttp import web

from runtime.config import RuntimeConfig
from runtime.frontend.codecs.telephony import CarrierEncoding
from runtime.frontend.gate.carrier_auth import (
    PLIVO_NONCE_HEADER,
    PLIVO_SIGNATURE_HEADER,
    plivo_signature_valid,
)
from runtime.frontend.gate.refusals import SessionRefused
from runtime.frontend.transports.carriers.dialect import (
    CallStart,
    CarrierEvent,
    CarrierProtocolError,
    Dialect,
)

__all__ = ["PLIVO_PATH", "PlivoDialect", "extra_headers"]

PLIVO_PATH = "/api/carriers/plivo"
_FORMATS = {
    ("audio/x-mulaw", 8000): CarrierEncoding.MULAW,
    ("audio/x-l16", 8000): CarrierEncoding.L16,
    ("audio/x-l16", 16000): CarrierEncoding.L16,
}
"""The ``<Stream contentType>`` values Plivo allows (its Stream XML reference), as ``start.mediaFormat``
names them."""
_PAIR = re.compile(r"\s*([^=;,\s]+)\s*=\s*([^;,]*?)\s*(?:[;,]|$)")


def extra_headers(text: str) -> dict[str, str]:
    """Plivo's ``extra_headers`` string (``"userId=12345;sessionId=abc"``, or ``,``-separated as the
    ``extraHeaders`` attribute is written) -> ``{name: value}``; pieces without ``=`` are skipped."""
    return {match.group(1): match.group(2) for match in _PAIR.finditer(text or "")}


class PlivoDialect(Dialect):
    """Plivo Audio Streams' messages (the module doc)."""

    name = "plivo"
    path = PLIVO_PATH
    log = logging.getLogger(__name__)
    secret_env = "DUPLEX_PLIVO_AUTH_TOKEN"

    @classmethod
    def secret(cls, config: RuntimeConfig) -> str | None:
        """``DUPLEX_PLIVO_AUTH_TOKEN(_FILE)``; None (off) without it or without the stream URL."""
        if config.plivo_stream_url is None:
            return None
        return config.plivo_secret()

    @classmethod
    def signed(cls, config: RuntimeConfig, secret: str, request: web.Request) -> bool:
        """``X-Plivo-Signature-V3`` signs ``DUPLEX_PLIVO_STREAM_URL`` plus the request's query string with
        ``X-Plivo-Signature-V3-Nonce``."""
        url = config.plivo_stream_url or ""
        if request.query_string:
            url += "?" + request.query_string
        headers = request.headers
        return plivo_signature_valid(
            secret, url, headers.get(PLIVO_NONCE_HEADER), headers.get(PLIVO_SIGNATURE_HEADER)
        )

    @classmethod
    def upgrade_parameters(cls, request: web.Request) -> dict[str, str]:
        """The stream URL's query string: the call's parameters (the token among them)."""
        return {key: request.query[key] for key in request.query}

    @classmethod
    def read_start(cls, event: dict[str, object]) -> CallStart | None:
        """``start`` gives the call (Plivo sends nothing before it).

        Raises:
            SessionRefused: ``bad_request``: another event first, a media format Plivo does not offer.
        """
        kind = event.get("event")
        start = event.get("start")
        if kind != "start" or not isinstance(start, dict):
            raise SessionRefused("bad_request", f"bad request: expected Plivo's start message, got {kind!r}")
        media = start.get("mediaFormat")
        media = media if isinstance(media, dict) else {}
        got = (str(media.get("encoding", "")).lower(), media.get("sampleRate"))
        try:
            encoding = _FORMATS[(got[0], int(str(got[1])))]
        except (KeyError, ValueError):
            allowed = ", ".join(f"{name} at {rate} Hz" for name, rate in _FORMATS)
            raise SessionRefused(
                "bad_request",
                f"bad request: media format {got[0]!r} at {got[1]!r} Hz; this bridge takes {allowed}",
            ) from None
        return CallStart(
            stream_id=str(start.get("streamId", "")),
            call_id=str(start.get("callId", "")),
            parameters=extra_headers(str(event.get("extra_headers") or "")),
            encoding=encoding,
            rate_hz=int(str(got[1])),
        )

    def parse(self, event: dict[str, object]) -> CarrierEvent:
        kind = event.get("event")
        body = event.get(str(kind)) if isinstance(kind, str) else None
        body = body if isinstance(body, dict) else {}
        if kind == "media":
            return CarrierEvent("media", payload=str(body.get("payload", "")))
        if kind == "playedStream":
            return CarrierEvent("played", name=str(event.get("name")))
        if kind == "dtmf":
            return CarrierEvent("dtmf", digit=str(body.get("digit", "")))
        if kind == "clearedAudio":
            return CarrierEvent("ignore")
        if kind in ("stop", "start"):
            return CarrierEvent(kind)  # type: ignore[arg-type]
        raise CarrierProtocolError("unknown_event", f"unknown event {str(kind)[:40]!r}")

    def media(self, payload: str) -> dict[str, object]:
        start = self.start
        content = "audio/x-mulaw" if start.encoding is CarrierEncoding.MULAW else "audio/x-l16"
        return {
            "event": "playAudio",
            "media": {"contentType": content, "sampleRate": start.rate_hz, "payload": payload},
            "streamId": start.stream_id,
        }

    def clear(self) -> dict[str, object]:
        return {"event": "clearAudio", "streamId": self.start.stream_id}

    def checkpoint(self, name: str) -> dict[str, object]:
        return {"event": "checkpoint", "streamId": self.start.stream_id, "name": name}
