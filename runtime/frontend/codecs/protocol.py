"""Kyutai's Moshi wire protocol on ``/api/chat``: message kinds, parsing and encoding of the messages.

Every WebSocket message is binary; its first byte is the kind (:class:`MessageKind`) and the rest is the
payload. Existing Moshi clients (Kyutai's web client, ``moshi/client.py``, PersonaPlex's web client) work
unchanged against these rules:

======  ==========  ==================  =============================================================
byte    kind        direction           payload
======  ==========  ==================  =============================================================
0x00    handshake   server -> client    none: the Python moshi server sends exactly ``b"\\x00"``
0x01    audio       both                Ogg/Opus pages (24 kHz mono), or Int16 LE PCM if ``format=pcm``
0x02    text        server -> client    one UTF-8 text piece
0x03    control     client -> server    one byte: 0 start, 1 end turn, 2 pause, 3 restart
0x04    metadata    both                one JSON object, UTF-8
0x05    error       server -> client    UTF-8 reason (our addition on the Python side)
0x06    ping        both                opaque bytes; the server echoes a client's ping unchanged
======  ==========  ==================  =============================================================

Everything here is pure: no sockets, no audio decoding (see :mod:`runtime.frontend.codecs.kyutai_audio`), no
torch.
The query string that opens a session: :mod:`runtime.frontend.gate.query`. Docs: docs/protocol.md,
"Wire protocol".
Malformed client input raises :class:`ProtocolError`, whose ``reason`` is a stable snake_case code from
:data:`PROTOCOL_ERROR_REASONS`, safe to use as a Prometheus label.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_ERROR_MESSAGE_BYTES",
    "PROTOCOL_ERROR_REASONS",
    "AudioFormat",
    "AudioMessage",
    "ClientMessage",
    "ControlAction",
    "ControlMessage",
    "MessageKind",
    "MetadataMessage",
    "PingMessage",
    "ProtocolError",
    "encode_audio",
    "encode_error",
    "encode_handshake",
    "encode_metadata",
    "encode_ping",
    "encode_text",
    "parse_client_message",
]


class MessageKind(enum.IntEnum):
    """First byte of every binary WebSocket message on ``/api/chat``."""

    HANDSHAKE = 0
    AUDIO = 1
    TEXT = 2
    CONTROL = 3
    METADATA = 4
    ERROR = 5
    PING = 6


class ControlAction(enum.IntEnum):
    """The payload byte of a control message (Kyutai's web client ``CONTROL_MESSAGES``)."""

    START = 0
    END_TURN = 1
    PAUSE = 2
    RESTART = 3


_SERVER_ONLY_KINDS = frozenset({MessageKind.HANDSHAKE, MessageKind.TEXT, MessageKind.ERROR})

PROTOCOL_ERROR_REASONS: frozenset[str] = frozenset(
    {
        "text_frame",  # a text (str) WebSocket frame; the protocol is binary only
        "empty_message",  # a binary message of 0 bytes: no kind byte
        "oversized",  # a message longer than the server's max_message_bytes
        "unknown_kind",  # a first byte outside 0x00..0x06
        "server_only_kind",  # handshake/text/error sent by a client
        "bad_control",  # a control message whose payload is not exactly one byte
        "bad_metadata",  # metadata that is not a UTF-8 JSON object
        "bad_pcm",  # a PCM audio payload that is not whole Int16 LE samples
        "bad_opus",  # audio bytes that sphn's Ogg/Opus reader refuses
        "too_fast",  # one audio message carrying more frames than the session may buffer
        "bad_query",  # a bad /api/chat query parameter
        "audio_on_datachannel",  # a 0x01 audio message on /api/rtc's DataChannel (audio travels as RTP there)
    }
)
"""Every ``ProtocolError.reason`` this module and :mod:`runtime.frontend.codecs.kyutai_audio` raise
(Prometheus
labels)."""

MAX_ERROR_MESSAGE_BYTES = 1023
"""Upper bound (bytes, kind byte included) of a message built by :func:`encode_error`."""


class ProtocolError(ValueError):
    """A client broke the wire protocol.

    Attributes:
        reason: short stable snake_case code, one of :data:`PROTOCOL_ERROR_REASONS` (a metrics label).
        message: human sentence naming what was wrong and what is allowed; ``str(error)`` returns it.
    """

    def __init__(self, reason: str, message: str) -> None:
        if reason not in PROTOCOL_ERROR_REASONS:
            raise ValueError(f"unknown ProtocolError reason {reason!r}; add it to PROTOCOL_ERROR_REASONS")
        super().__init__(message)
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"ProtocolError(reason={self.reason!r}, message={self.message!r})"


# --------------------------------------------------------------------------------------------------
# Client -> server messages
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AudioMessage:
    """Kind 0x01 from the client: ``payload`` is Ogg/Opus bytes, or Int16 LE PCM for ``format=pcm``.

    The payload is not decoded here; feed it to an assembler from :mod:`runtime.frontend.codecs.kyutai_audio`.
    """

    payload: bytes


@dataclass(frozen=True)
class PingMessage:
    """Kind 0x06 from the client: opaque ``payload`` bytes (possibly empty)."""

    payload: bytes


@dataclass(frozen=True)
class ControlMessage:
    """Kind 0x03 from the client: ``action`` is the raw payload byte (0..255).

    Kyutai's values are in :class:`ControlAction`; :attr:`known_action` maps the byte to it. Unknown
    values are kept (not refused) so that a newer client does not get its session closed.
    """

    action: int

    @property
    def known_action(self) -> ControlAction | None:
        """The :class:`ControlAction` for :attr:`action`, or None for a value Kyutai does not define."""
        try:
            return ControlAction(self.action)
        except ValueError:
            return None


@dataclass(frozen=True)
class MetadataMessage:
    """Kind 0x04 from the client: ``data`` is the decoded JSON object."""

    data: dict[str, Any]


ClientMessage = AudioMessage | PingMessage | ControlMessage | MetadataMessage
"""What :func:`parse_client_message` returns."""


def _refuse_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_finite_json_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text[:20]} overflows a 64-bit float")
    return number


def parse_client_message(
    data: bytes | bytearray | memoryview | str, *, max_message_bytes: int
) -> ClientMessage:
    """Decode one WebSocket message received from a client.

    Args:
        data: the message as the WebSocket library hands it over: ``bytes`` for a binary frame, ``str``
            for a text frame (always refused).
        max_message_bytes: largest accepted message in bytes, kind byte included (> 0).

    Returns:
        :class:`AudioMessage`, :class:`ControlMessage`, :class:`MetadataMessage` or :class:`PingMessage`.

    Raises:
        ProtocolError: reason ``text_frame`` (a str frame), ``empty_message`` (0 bytes), ``oversized``
            (more than ``max_message_bytes``), ``unknown_kind`` (first byte above 0x06),
            ``server_only_kind`` (handshake 0x00, text 0x02 or error 0x05 from a client),
            ``bad_control`` (control payload not exactly 1 byte), ``bad_metadata`` (payload not a UTF-8
            JSON object).
        ValueError: ``max_message_bytes`` is not positive (a server bug, not the client's).
        TypeError: ``data`` is neither str nor bytes-like.
    """
    if max_message_bytes <= 0:
        raise ValueError(f"max_message_bytes must be > 0, got {max_message_bytes}")
    if isinstance(data, str):
        raise ProtocolError(
            "text_frame",
            f"received a text WebSocket frame ({len(data)} characters); /api/chat accepts binary frames "
            "only, whose first byte is the message kind (0x01 audio, 0x03 control, 0x04 metadata, 0x06 ping)",
        )
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected bytes or str from the WebSocket, got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise ProtocolError(
            "empty_message",
            "received an empty binary message; every message needs at least its kind byte (0x00..0x06)",
        )
    if len(data) > max_message_bytes:
        raise ProtocolError(
            "oversized",
            f"received a {len(data)}-byte message; the limit is {max_message_bytes} bytes per message",
        )
    kind_byte, payload = data[0], data[1:]
    try:
        kind = MessageKind(kind_byte)
    except ValueError:
        raise ProtocolError(
            "unknown_kind",
            f"unknown message kind 0x{kind_byte:02x}; clients may send 0x01 audio, 0x03 control, "
            "0x04 metadata or 0x06 ping",
        ) from None
    if kind in _SERVER_ONLY_KINDS:
        raise ProtocolError(
            "server_only_kind",
            f"message kind 0x{kind_byte:02x} ({kind.name.lower()}) is sent by the server only; clients may "
            "send 0x01 audio, 0x03 control, 0x04 metadata or 0x06 ping",
        )
    if kind is MessageKind.AUDIO:
        return AudioMessage(payload)
    if kind is MessageKind.PING:
        return PingMessage(payload)
    if kind is MessageKind.CONTROL:
        if len(payload) != 1:
            raise ProtocolError(
                "bad_control",
                f"a control message carries exactly 1 payload byte (0 start, 1 end turn, 2 pause, "
                f"3 restart); got {len(payload)} bytes",
            )
        return ControlMessage(payload[0])
    # MessageKind.METADATA: the only kind left.
    try:
        decoded = json.loads(
            payload.decode("utf-8"),
            parse_constant=_refuse_json_constant,
            parse_float=_parse_finite_json_float,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(
            "bad_metadata",
            f"metadata must be one UTF-8 JSON object; the {len(payload)}-byte payload did not parse ({exc})",
        ) from None
    if not isinstance(decoded, dict):
        raise ProtocolError(
            "bad_metadata",
            f"metadata must be a JSON object ({{...}}); got a JSON {type(decoded).__name__}",
        )
    return MetadataMessage(decoded)


# --------------------------------------------------------------------------------------------------
# Server -> client encoders
# --------------------------------------------------------------------------------------------------


def encode_handshake() -> bytes:
    """The handshake the server sends once the session is ready: exactly ``b"\\x00"`` (1 byte).

    Kyutai's web client shows "Waiting for a slot" until it arrives, and only then starts its microphone.
    """
    return bytes([MessageKind.HANDSHAKE])


def encode_audio(payload: bytes) -> bytes:
    """A 0x01 audio message: ``payload`` is Ogg/Opus pages or Int16 LE PCM bytes, passed through as is."""
    return bytes([MessageKind.AUDIO]) + bytes(payload)


def encode_text(piece: str) -> bytes:
    """A 0x02 text message carrying one decoded text piece as UTF-8.

    Raises:
        UnicodeEncodeError: ``piece`` holds a lone surrogate (not encodable as UTF-8).
    """
    return bytes([MessageKind.TEXT]) + piece.encode("utf-8")


def encode_error(reason: str) -> bytes:
    """A 0x05 error message with a human-readable ``reason``, sent before the server closes the socket.

    The UTF-8 payload is cut at a character boundary so that the whole message is at most
    :data:`MAX_ERROR_MESSAGE_BYTES` (1023) bytes; lone surrogates are replaced by ``?``. Never raises.
    """
    encoded = reason.encode("utf-8", errors="replace")
    limit = MAX_ERROR_MESSAGE_BYTES - 1
    if len(encoded) > limit:
        # Dropping an incomplete trailing sequence keeps the payload valid UTF-8.
        encoded = encoded[:limit].decode("utf-8", errors="ignore").encode("utf-8")
    return bytes([MessageKind.ERROR]) + encoded


def encode_metadata(obj: Mapping[str, Any]) -> bytes:
    """A 0x04 metadata message: ``obj`` as compact UTF-8 JSON.

    Raises:
        TypeError: ``obj`` is not a mapping, or holds a value JSON cannot represent.
        ValueError: ``obj`` holds NaN or infinity (not valid JSON).
    """
    if not isinstance(obj, Mapping):
        raise TypeError(f"metadata must be a mapping (a JSON object), got {type(obj).__name__}")
    text = json.dumps(dict(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return bytes([MessageKind.METADATA]) + text.encode("utf-8")


def encode_ping(payload: bytes = b"") -> bytes:
    """A 0x06 ping message carrying opaque ``payload`` bytes (default none)."""
    return bytes([MessageKind.PING]) + bytes(payload)


# --------------------------------------------------------------------------------------------------
# audio payload format
# --------------------------------------------------------------------------------------------------


class AudioFormat(str, enum.Enum):
    """Audio payload format of a session, chosen by ``format=`` in the query string."""

    OPUS = "opus"
    """Ogg/Opus pages, 24 kHz mono (Kyutai's default; what every existing client sends)."""
    PCM = "pcm"
    """Raw Int16 little-endian samples, 24 kHz mono, both directions."""
