"""Telnyx media streaming over WebSocket (bidirectional RTP: ``stream_bidirectional_mode: rtp``) on
``/api/carriers/telnyx``: Telnyx's :class:`~runtime.frontend.transports.carriers.dialect.Dialect` (the
call's edge is ``edge.py``'s).

Messages (JSON text frames; Telnyx's "Stream call media over WebSocket" AsyncAPI reference):

- in: ``connected``; ``start`` (``stream_id``, ``start.call_control_id``, ``start.custom_parameters``: a
  TeXML ``<Stream>``'s ``<Parameter>`` elements, ``start.media_format``: ``encoding`` ``PCMU`` or ``PCMA``
  at 8000 Hz, or ``L16`` at 8000 or 16000 Hz, mono); ``media`` (``media.payload``: base64 of an RTP payload,
  20 ms, no RTP header); ``dtmf`` (``dtmf.digit``); ``mark`` (``mark.name``: a mark this side sent, played
  out); ``error`` (logged); ``stop``.
- out: ``media`` (``media.payload``: the same encoding, 20 ms each), ``mark`` after each model frame
  (80 ms), ``clear`` (barge-in): the shapes pipecat's ``TelnyxFrameSerializer`` writes.

The stream's encoding both ways is the ``start`` message's: configure ``stream_bidirectional_codec`` (and
``stream_bidirectional_sampling_rate``) to match the stream's codec.

Admission: Telnyx documents no signature on a stream's upgrade (its webhooks carry Ed25519 signatures; the
stream does not), so the node's gate for this route is a shared secret the node holds,
``DUPLEX_TELNYX_STREAM_TOKEN``, which the stream URL carries (``?stream_token=<secret>``, the URL given as
``stream_url`` in the call-control command or a TeXML ``<Stream url>``) or ``Authorization: Bearer``
carries; compared in constant time, missing or wrong: 403 ``carrier_signature``. The call's parameters
(``token``, ``voice_prompt``, ...) come from ``start.custom_parameters`` and from the stream URL's other
query parameters (the ``start`` message's win). Telnyx does not reconnect a stream: a call is not resumed.
"""

from __future__ import annotations

import hmac
import logging

from aiohttp import web

from runtime.config import RuntimeConfig
from runtime.frontend.codecs.telephony import CarrierEncoding
from runtime.frontend.gate.refusals import SessionRefused
from runtime.frontend.transports.carriers.dialect import CallStart, CarrierEvent, MediaMarkClearDialect

__all__ = ["STREAM_TOKEN_PARAMETER", "TELNYX_PATH", "TelnyxDialect"]

TELNYX_PATH = "/api/carriers/telnyx"
STREAM_TOKEN_PARAMETER = "stream_token"
"""The stream URL's query parameter that carries the node's Telnyx stream secret."""
_FORMATS = {
    ("PCMU", 8000): CarrierEncoding.PCMU,
    ("PCMA", 8000): CarrierEncoding.PCMA,
    ("L16", 8000): CarrierEncoding.L16,
    ("L16", 16000): CarrierEncoding.L16,
}
"""The stream formats this bridge carries (Telnyx also offers G722, OPUS and AMR-WB: not carried here)."""


class TelnyxDialect(MediaMarkClearDialect):
    """Telnyx media streaming's messages (the module doc)."""

    name = "telnyx"
    path = TELNYX_PATH
    log = logging.getLogger(__name__)
    secret_env = "DUPLEX_TELNYX_STREAM_TOKEN"
    stream_key = None

    @classmethod
    def secret(cls, config: RuntimeConfig) -> str | None:
        """``DUPLEX_TELNYX_STREAM_TOKEN(_FILE)``; None (off) without it."""
        return config.telnyx_secret()

    @classmethod
    def signed(cls, config: RuntimeConfig, secret: str, request: web.Request) -> bool:
        """The stream URL's ``stream_token``, or ``Authorization: Bearer``, is the node's secret."""
        given = request.query.get(STREAM_TOKEN_PARAMETER)
        if given is None:
            scheme, _, credential = request.headers.get("Authorization", "").partition(" ")
            given = credential.strip() if scheme.lower() == "bearer" else None
        return bool(given) and hmac.compare_digest(str(given).encode(), secret.encode())

    @classmethod
    def upgrade_parameters(cls, request: web.Request) -> dict[str, str]:
        """The stream URL's query, its ``stream_token`` taken out."""
        return {key: request.query[key] for key in request.query if key != STREAM_TOKEN_PARAMETER}

    @classmethod
    def read_start(cls, event: dict[str, object]) -> CallStart | None:
        """``connected`` is skipped; ``start`` gives the call.

        Raises:
            SessionRefused: ``bad_request``: another event first, custom parameters that are not an
                object, a media format this bridge does not carry (naming the ones it does).
        """
        kind = event.get("event")
        if kind == "connected":
            return None
        start = event.get("start")
        if kind != "start" or not isinstance(start, dict):
            raise SessionRefused("bad_request", f"bad request: expected Telnyx's start message, got {kind!r}")
        media = start.get("media_format")
        media = media if isinstance(media, dict) else {}
        encoding, rate, channels = (
            str(media.get("encoding", "")).upper(),
            media.get("sample_rate"),
            media.get("channels", 1),
        )
        try:
            carried = _FORMATS[(encoding, int(str(rate)))]
            if int(str(channels)) != 1:
                raise ValueError("not mono")
        except (KeyError, ValueError):
            allowed = ", ".join(f"{name} at {hz} Hz" for name, hz in _FORMATS)
            raise SessionRefused(
                "bad_request",
                f"bad request: media format {encoding!r} at {rate!r} Hz, {channels!r} channels; this bridge "
                f"takes {allowed}, mono",
            ) from None
        parameters = start.get("custom_parameters") or {}
        if not isinstance(parameters, dict):
            raise SessionRefused("bad_request", "bad request: custom_parameters is not an object")
        return CallStart(
            stream_id=str(event.get("stream_id", "")),
            call_id=str(start.get("call_control_id", "")),
            parameters={str(k): str(v) for k, v in parameters.items()},
            encoding=carried,
            rate_hz=int(str(rate)),
        )

    def inbound(self, media: dict[str, object]) -> bool:
        """``both_tracks`` streams echo the agent's own audio back as ``outbound``: only ``inbound`` is the
        caller's."""
        return media.get("track", "inbound") == "inbound"

    def other_event(self, kind: str, event: dict[str, object]) -> CarrierEvent | None:
        """``error``: Telnyx reports a problem with what this side sent; logged, the call goes on."""
        if kind != "error":
            return None
        self.log.info(
            "telnyx stream %s: Telnyx reports %s", self.start.stream_id, str(event.get("payload"))[:200]
        )
        return CarrierEvent("ignore")
