"""Each carrier's side of a media stream as ``runtime.tools.carrier_client`` plays it: its documented
messages, its signature, and where a call's parameters travel.

- :class:`TwilioSide`: Twilio's "Media Streams - WebSocket Messages" (``connected``, ``start`` with
  ``customParameters``, ``media``, ``dtmf``, ``mark`` echoes, ``stop``); ``X-Twilio-Signature`` over the
  stream URL.
- :class:`PlivoSide`: Plivo's "Audio Streaming Protocol Reference" (``start`` with ``streamId``, ``callId``,
  ``mediaFormat`` and ``extra_headers``, ``media``, ``dtmf``, ``playedStream`` for each ``checkpoint``,
  ``clearedAudio`` for each ``clearAudio``, ``stop``); ``X-Plivo-Signature-V3`` with a nonce over the stream
  URL and its query, which carries the call's parameters (the ``<Stream>`` URL's query string).
- :class:`TelnyxSide`: Telnyx's "Stream call media over WebSocket" (``connected``, ``start`` with
  ``stream_id``, ``call_control_id``, ``custom_parameters`` and ``media_format``, ``media`` with RTP
  payloads, ``dtmf``, ``mark`` echoes, ``stop``); no signature (Telnyx documents none on the stream): the
  node's stream secret in the URL's query (``stream_token``).
- :class:`ExotelSide`: Exotel's voicebot "WebSocket protocol" (Twilio's events in snake_case, 16-bit PCM at
  8000 Hz, here in 20 ms chunks where Exotel sends about 100 ms); Basic auth on the upgrade; the call's
  parameters in the stream URL's query, echoed in ``start.custom_parameters``.
"""

from __future__ import annotations

import base64
import secrets
from urllib.parse import urlencode

from runtime.frontend.gate.carrier_auth import (
    PLIVO_NONCE_HEADER,
    PLIVO_SIGNATURE_HEADER,
    TWILIO_SIGNATURE_HEADER,
    plivo_signature,
    twilio_signature,
)
from runtime.tools.carrier_client import CallIds, CarrierSide, new_id

__all__ = ["SIDES", "ExotelSide", "PlivoSide", "TelnyxSide", "TwilioSide"]


def _body(event: dict[str, object], key: str) -> dict[str, object]:
    value = event.get(key)
    return value if isinstance(value, dict) else {}


class _MediaMarkClearSide(CarrierSide):
    """The node's messages in the shape Twilio, Telnyx and Exotel share: ``media``, ``mark``, ``clear``
    (``runtime.frontend.transports.carriers.dialect.MediaMarkClearDialect`` on the node's side)."""

    def incoming(self, event: dict[str, object]) -> tuple[str, str]:
        kind = event.get("event")
        if kind == "media":
            return "media", str(_body(event, "media").get("payload", ""))
        if kind == "mark":
            return "mark", str(_body(event, "mark").get("name", ""))
        if kind == "clear":
            return "clear", ""
        return "other", ""


class TwilioSide(_MediaMarkClearSide):
    """Twilio's media servers on a bidirectional ``<Connect><Stream>``."""

    name = "twilio"

    def ids(self) -> CallIds:
        return CallIds(new_id("MZ"), new_id("CA"), "AC" + "0" * 32)

    def upgrade(self, secret: str, stream_url: str, parameters: dict[str, str]) -> tuple[str, dict[str, str]]:
        """No query (Twilio drops it; parameters go in ``start``); the signature of the stream URL."""
        return "", {TWILIO_SIGNATURE_HEADER: twilio_signature(secret, stream_url)}

    def opening(
        self, ids: CallIds, parameters: dict[str, str], media_format: dict[str, object] | None
    ) -> list[dict[str, object]]:
        return [
            {"event": "connected", "protocol": "Call", "version": "1.0.0"},
            {
                "event": "start",
                "sequenceNumber": "1",
                "streamSid": ids.stream,
                "start": {
                    "accountSid": ids.account,
                    "streamSid": ids.stream,
                    "callSid": ids.call,
                    "tracks": ["inbound"],
                    "customParameters": parameters,
                    "mediaFormat": media_format
                    or {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                },
            },
        ]

    def media(self, ids: CallIds, index: int, payload: str) -> dict[str, object]:
        return {
            "event": "media",
            "streamSid": ids.stream,
            "media": {
                "track": "inbound",
                "chunk": str(index + 1),
                "timestamp": str(index * 20),
                "payload": payload,
            },
        }

    def dtmf(self, ids: CallIds, digit: str) -> dict[str, object]:
        return {"event": "dtmf", "streamSid": ids.stream, "dtmf": {"track": "inbound_track", "digit": digit}}

    def stop(self, ids: CallIds) -> dict[str, object]:
        return {
            "event": "stop",
            "streamSid": ids.stream,
            "stop": {"accountSid": ids.account, "callSid": ids.call},
        }

    def played(self, ids: CallIds, name: str) -> dict[str, object]:
        return {"event": "mark", "streamSid": ids.stream, "mark": {"name": name}}


class PlivoSide(CarrierSide):
    """Plivo's media servers on a ``<Stream bidirectional="true">`` (μ-law at 8000 Hz by default)."""

    name = "plivo"

    def ids(self) -> CallIds:
        return CallIds(new_id(), new_id(), "MA" + "0" * 18)

    def upgrade(self, secret: str, stream_url: str, parameters: dict[str, str]) -> tuple[str, dict[str, str]]:
        """The parameters as the stream URL's query; its V3 signature with a fresh nonce."""
        query = urlencode(parameters)
        nonce = str(secrets.randbelow(10**20)).zfill(20)  # Plivo's nonces are 20 digits
        signed = plivo_signature(secret, stream_url + (f"?{query}" if query else ""), nonce)
        return query, {PLIVO_SIGNATURE_HEADER: signed, PLIVO_NONCE_HEADER: nonce}

    def opening(
        self, ids: CallIds, parameters: dict[str, str], media_format: dict[str, object] | None
    ) -> list[dict[str, object]]:
        return [
            {
                "event": "start",
                "sequenceNumber": 1,
                "start": {
                    "callId": ids.call,
                    "streamId": ids.stream,
                    "accountId": ids.account,
                    "tracks": ["inbound"],
                    "mediaFormat": media_format or {"encoding": "audio/x-mulaw", "sampleRate": 8000},
                },
                "extra_headers": "",
            }
        ]

    def media(self, ids: CallIds, index: int, payload: str) -> dict[str, object]:
        return {
            "event": "media",
            "sequenceNumber": index + 2,
            "streamId": ids.stream,
            "media": {
                "track": "inbound",
                "timestamp": str(index * 20),
                "chunk": index + 1,
                "payload": payload,
            },
            "extra_headers": "",
        }

    def dtmf(self, ids: CallIds, digit: str) -> dict[str, object]:
        return {"event": "dtmf", "streamId": ids.stream, "dtmf": {"track": "inbound", "digit": digit}}

    def stop(self, ids: CallIds) -> dict[str, object]:
        return {"event": "stop", "streamId": ids.stream}

    def incoming(self, event: dict[str, object]) -> tuple[str, str]:
        kind = event.get("event")
        if kind == "playAudio":
            return "media", str(_body(event, "media").get("payload", ""))
        if kind == "checkpoint":
            return "mark", str(event.get("name", ""))
        if kind == "clearAudio":
            return "clear", ""
        return "other", ""

    def played(self, ids: CallIds, name: str) -> dict[str, object]:
        return {"event": "playedStream", "streamId": ids.stream, "name": name}

    def cleared(self, ids: CallIds) -> dict[str, object] | None:
        return {"sequenceNumber": 0, "event": "clearedAudio", "streamId": ids.stream}


class TelnyxSide(_MediaMarkClearSide):
    """Telnyx's media servers on a bidirectional RTP stream (PCMU at 8000 Hz by default)."""

    name = "telnyx"

    def ids(self) -> CallIds:
        return CallIds(new_id(), "v3:" + new_id(), new_id())

    def upgrade(self, secret: str, stream_url: str, parameters: dict[str, str]) -> tuple[str, dict[str, str]]:
        """The node's stream secret in the query (``stream_token``); no headers. ``stream_url`` is unused
        (nothing is signed)."""
        return urlencode({"stream_token": secret}), {}

    def forged(self, query: str, headers: dict[str, str], signature: str) -> tuple[str, dict[str, str]]:
        """``signature`` as the query's stream secret (``""``: none)."""
        return (urlencode({"stream_token": signature}) if signature else ""), headers

    def opening(
        self, ids: CallIds, parameters: dict[str, str], media_format: dict[str, object] | None
    ) -> list[dict[str, object]]:
        return [
            {"event": "connected", "version": "1.0.0"},
            {
                "event": "start",
                "sequence_number": "1",
                "stream_id": ids.stream,
                "start": {
                    "user_id": ids.account,
                    "call_control_id": ids.call,
                    "call_session_id": new_id(),
                    "from": "+13122010094",
                    "to": "+13122123456",
                    "custom_parameters": parameters,
                    "media_format": media_format or {"encoding": "PCMU", "sample_rate": 8000, "channels": 1},
                },
            },
        ]

    def media(self, ids: CallIds, index: int, payload: str) -> dict[str, object]:
        return {
            "event": "media",
            "sequence_number": str(index + 2),
            "media": {
                "track": "inbound",
                "chunk": str(index + 1),
                "timestamp": str(index * 20),
                "payload": payload,
            },
            "stream_id": ids.stream,
        }

    def dtmf(self, ids: CallIds, digit: str) -> dict[str, object]:
        return {"event": "dtmf", "stream_id": ids.stream, "sequence_number": "0", "dtmf": {"digit": digit}}

    def stop(self, ids: CallIds) -> dict[str, object]:
        return {
            "event": "stop",
            "sequence_number": "0",
            "stop": {"user_id": ids.account, "call_control_id": ids.call},
            "stream_id": ids.stream,
        }

    def played(self, ids: CallIds, name: str) -> dict[str, object]:
        return {"event": "mark", "sequence_number": "0", "stream_id": ids.stream, "mark": {"name": name}}


class ExotelSide(_MediaMarkClearSide):
    """Exotel's media servers on a voicebot (bidirectional) stream: 16-bit PCM at 8000 Hz."""

    name = "exotel"
    encoding = "l16"

    def ids(self) -> CallIds:
        return CallIds(new_id("MZ"), new_id("CA"), new_id("AC"))

    def upgrade(self, secret: str, stream_url: str, parameters: dict[str, str]) -> tuple[str, dict[str, str]]:
        """The parameters as the URL's query; ``secret`` (``<key>:<token>``) as Basic auth."""
        credentials = base64.b64encode(secret.encode()).decode()
        return urlencode(parameters), {"Authorization": f"Basic {credentials}"}

    def opening(
        self, ids: CallIds, parameters: dict[str, str], media_format: dict[str, object] | None
    ) -> list[dict[str, object]]:
        return [
            {"event": "connected"},
            {
                "event": "start",
                "sequence_number": "1",
                "stream_sid": ids.stream,
                "start": {
                    "stream_sid": ids.stream,
                    "call_sid": ids.call,
                    "account_sid": ids.account,
                    "from": "+919876543210",
                    "to": "+918047491899",
                    "custom_parameters": parameters,
                    "media_format": media_format
                    or {"encoding": "audio/x-raw", "sample_rate": "8000", "bit_rate": "16"},
                },
            },
        ]

    def media(self, ids: CallIds, index: int, payload: str) -> dict[str, object]:
        return {
            "event": "media",
            "sequence_number": str(index + 2),
            "stream_sid": ids.stream,
            "media": {"chunk": str(index + 1), "timestamp": str(index * 20), "payload": payload},
        }

    def dtmf(self, ids: CallIds, digit: str) -> dict[str, object]:
        return {
            "event": "dtmf",
            "sequence_number": "0",
            "stream_sid": ids.stream,
            "dtmf": {"digit": digit, "duration": "100"},
        }

    def stop(self, ids: CallIds) -> dict[str, object]:
        return {
            "event": "stop",
            "sequence_number": "0",
            "stream_sid": ids.stream,
            "stop": {"call_sid": ids.call, "account_sid": ids.account, "reason": "callended"},
        }

    def played(self, ids: CallIds, name: str) -> dict[str, object]:
        return {"event": "mark", "sequence_number": "0", "stream_sid": ids.stream, "mark": {"name": name}}


SIDES: dict[str, type[CarrierSide]] = {
    "twilio": TwilioSide,
    "plivo": PlivoSide,
    "telnyx": TelnyxSide,
    "exotel": ExotelSide,
}
"""Each carrier's side by name (``duplex loadgen --transport``)."""
