"""Kyutai's Moshi wire protocol on ``/api/chat``: message kinds, parsing, encoding, session query.

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

Everything here is pure: no sockets, no audio decoding (see :mod:`runtime.frontend.audio_codec`), no torch.
Malformed client input raises :class:`ProtocolError`, whose ``reason`` is a stable snake_case code from
:data:`PROTOCOL_ERROR_REASONS`, safe to use as a Prometheus label.
"""

from __future__ import annotations

import enum
import json
import math
import re
import unicodedata
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.engine.persona_limits import TEXT_PROMPT_LIMIT as TEXT_PROMPT_LIMIT
from runtime.engine.persona_limits import TEXT_PROMPT_MAX_CHARS as TEXT_PROMPT_MAX_CHARS
from runtime.engine.persona_limits import TEXT_PROMPT_MAX_TOKENS as TEXT_PROMPT_MAX_TOKENS
from runtime.engine.persona_limits import VOICE_PROMPT_MAX_CHARS as VOICE_PROMPT_MAX_CHARS
from runtime.engine.persona_limits import VOICE_PROMPT_RE as VOICE_PROMPT_RE

__all__ = [
    "MAX_ERROR_MESSAGE_BYTES",
    "MAX_QUERY_PARAMS",
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
    "SessionRequest",
    "encode_audio",
    "encode_error",
    "encode_handshake",
    "encode_metadata",
    "encode_ping",
    "encode_text",
    "parse_client_message",
    "parse_prompt_metadata",
    "parse_session_query",
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
    }
)
"""Every ``ProtocolError.reason`` this module and :mod:`runtime.frontend.audio_codec` raise (Prometheus
labels)."""

MAX_ERROR_MESSAGE_BYTES = 1023
"""Upper bound (bytes, kind byte included) of a message built by :func:`encode_error`."""

MAX_QUERY_PARAMS = 100
"""Most query parameters accepted on ``/api/chat`` (known and ignored together)."""


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

    The payload is not decoded here; feed it to an assembler from :mod:`runtime.frontend.audio_codec`.
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
# /api/chat query string
# --------------------------------------------------------------------------------------------------


class AudioFormat(str, enum.Enum):
    """Audio payload format of a session, chosen by ``format=`` in the query string."""

    OPUS = "opus"
    """Ogg/Opus pages, 24 kHz mono (Kyutai's default; what every existing client sends)."""
    PCM = "pcm"
    """Raw Int16 little-endian samples, 24 kHz mono, both directions."""


TEXT_PROMPT_IN_METADATA = "metadata"
"""``text_prompt_in=metadata``: the text prompt comes as the client's first WebSocket message, a 0x04
metadata JSON object ``{"text_prompt": "..."}``, instead of in the URL (whose request line nginx and most
servers cap at 8 KB: a long prompt, percent-encoded, does not fit)."""
TEMPERATURE_RANGE = (0.0, 2.0)
AUDIO_TOPK_RANGE = (1, 2048)
TEXT_TOPK_RANGE = (1, 32000)
SEED_RANGE = (0, 2**31 - 1)

_INT_RE = re.compile(r"\+?[0-9]{1,12}")
_FLOAT_RE = re.compile(r"[+-]?(?:[0-9]{1,20}(?:\.[0-9]{0,20})?|\.[0-9]{1,20})(?:[eE][+-]?[0-9]{1,3})?")
_KNOWN_PARAMS = (
    "format",
    "voice_prompt",
    "text_prompt",
    "audio_temperature",
    "text_temperature",
    "audio_topk",
    "text_topk",
    "seed",
    "text_prompt_in",
)


@dataclass(frozen=True)
class SessionRequest:
    """What a client asked for in the ``/api/chat`` query string. None means "server default".

    Attributes:
        format: wire format of audio payloads, both directions.
        voice_prompt: name of a voice preset (``[A-Za-z0-9][A-Za-z0-9_.-]*``, at most 64 characters);
            never a path.
        text_prompt: system/role prompt within :data:`TEXT_PROMPT_LIMIT`.
        text_prompt_in: ``metadata`` when the text prompt follows as a 0x04 metadata message
            (:func:`parse_prompt_metadata`) instead of in the query; None otherwise.
        audio_temperature, text_temperature: sampling temperatures in [0, 2].
        audio_topk: top-k over audio codebook entries, 1..2048.
        text_topk: top-k over text tokens, 1..32000.
        seed: sampling seed, 0..2**31-1.
        ignored_params: sorted names of query parameters this server does not use (e.g. ``pad_mult``,
            ``repetition_penalty``, ``worker_auth_id``); untrusted text, for logging only.
    """

    format: AudioFormat = AudioFormat.OPUS
    voice_prompt: str | None = None
    text_prompt: str | None = None
    audio_temperature: float | None = None
    text_temperature: float | None = None
    audio_topk: int | None = None
    text_topk: int | None = None
    seed: int | None = None
    text_prompt_in: str | None = None
    ignored_params: tuple[str, ...] = field(default=())

    def to_query_params(self) -> dict[str, str]:
        """The query parameters that :func:`parse_session_query` turns back into this request.

        Parameters left at None are omitted; ``ignored_params`` are not included.
        """
        params: dict[str, str] = {"format": self.format.value}
        for name in _KNOWN_PARAMS[1:]:
            value = getattr(self, name)
            if value is not None:
                params[name] = repr(value) if isinstance(value, float) else str(value)
        return params


def _bad_query(name: str, value: str, allowed: str) -> ProtocolError:
    shown = value if len(value) <= 80 else value[:77] + "..."
    return ProtocolError("bad_query", f"query parameter {name}={shown!r} is invalid: {allowed}")


def _parse_float(name: str, value: str, bounds: tuple[float, float]) -> float:
    low, high = bounds
    allowed = f"expected a decimal number in [{low:g}, {high:g}]"
    if not _FLOAT_RE.fullmatch(value):
        raise _bad_query(name, value, allowed)
    number = float(value)
    if not (math.isfinite(number) and low <= number <= high):
        raise _bad_query(name, value, allowed)
    return number


def _parse_int(name: str, value: str, bounds: tuple[int, int]) -> int:
    low, high = bounds
    allowed = f"expected a whole number in [{low}, {high}]"
    if not _INT_RE.fullmatch(value):
        raise _bad_query(name, value, allowed)
    number = int(value)
    if not low <= number <= high:
        raise _bad_query(name, value, allowed)
    return number


def _parse_text_prompt(value: str) -> str:
    if len(value) > TEXT_PROMPT_MAX_CHARS:
        raise _bad_query("text_prompt", value, f"{TEXT_PROMPT_LIMIT}; got {len(value)} characters")
    for char in value:
        if char == "\x00" or unicodedata.category(char) == "Cs":
            raise _bad_query(
                "text_prompt", value, f"NUL and lone surrogate characters are not allowed (found {char!r})"
            )
    return value


def _query_items(query: Mapping[str, str] | str) -> dict[str, str]:
    """Normalise the query to a dict, refusing repeated known parameters and too many parameters."""
    if isinstance(query, str):
        try:
            pairs = urllib.parse.parse_qsl(
                query.removeprefix("?"), keep_blank_values=True, max_num_fields=MAX_QUERY_PARAMS
            )
        except ValueError:
            raise ProtocolError(
                "bad_query", f"the query string has more than {MAX_QUERY_PARAMS} parameters"
            ) from None
        items: dict[str, str] = {}
        for key, value in pairs:
            if key in items and key in _KNOWN_PARAMS:
                raise ProtocolError("bad_query", f"query parameter {key!r} is given more than once")
            items[key] = value
        return items
    if not isinstance(query, Mapping):
        raise TypeError(f"query must be a mapping or a query string, got {type(query).__name__}")
    if len(query) > MAX_QUERY_PARAMS:
        raise ProtocolError("bad_query", f"the query string has more than {MAX_QUERY_PARAMS} parameters")
    items = {}
    for key, value in query.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ProtocolError(
                "bad_query", f"query parameter {key!r} must map a str name to a str value, got {value!r}"
            )
        items[key] = value
    return items


def parse_session_query(query: Mapping[str, str] | str) -> SessionRequest:
    """Validate the ``/api/chat`` query string into a :class:`SessionRequest`.

    Args:
        query: the parsed query (e.g. ``request.query`` of the HTTP upgrade) or the raw query string,
            with or without its leading ``?``. In a raw string each known parameter may appear once.

    Known parameters: ``format`` (``opus`` or ``pcm``, case-insensitive; default ``opus``),
    ``voice_prompt``, ``text_prompt``, ``audio_temperature``, ``text_temperature``, ``audio_topk``,
    ``text_topk``, ``seed``, ``text_prompt_in`` (ranges on :class:`SessionRequest`). An empty value
    (``text_prompt=``) means "not given", as web forms send it. Any other parameter is ignored and listed
    in ``ignored_params``, so Kyutai's and PersonaPlex's clients (``pad_mult``, ``repetition_penalty``,
    ``text_seed``, ...) work.

    Raises:
        ProtocolError: reason ``bad_query``, naming the parameter, the bad value and the allowed range;
            also for more than :data:`MAX_QUERY_PARAMS` parameters or a repeated known parameter.
        TypeError: ``query`` is neither a mapping nor a str.
    """
    items = _query_items(query)
    given = {name: items[name] for name in _KNOWN_PARAMS if items.get(name, "") != ""}

    audio_format = AudioFormat.OPUS
    if "format" in given:
        try:
            audio_format = AudioFormat(given["format"].lower())
        except ValueError:
            raise _bad_query("format", given["format"], "expected 'opus' or 'pcm'") from None

    voice_prompt = given.get("voice_prompt")
    if voice_prompt is not None and not VOICE_PROMPT_RE.fullmatch(voice_prompt):
        raise _bad_query(
            "voice_prompt",
            voice_prompt,
            f"expected a preset name of 1..{VOICE_PROMPT_MAX_CHARS} letters, digits, '-', '_' or '.', "
            "starting with a letter or digit (no path separators)",
        )

    text_prompt = given.get("text_prompt")
    if text_prompt is not None:
        text_prompt = _parse_text_prompt(text_prompt)
    text_prompt_in = given.get("text_prompt_in")
    if text_prompt_in is not None:
        if text_prompt_in not in ("query", TEXT_PROMPT_IN_METADATA):
            raise _bad_query("text_prompt_in", text_prompt_in, "expected 'query' or 'metadata'")
        if text_prompt_in == TEXT_PROMPT_IN_METADATA and text_prompt is not None:
            raise _bad_query(
                "text_prompt_in", text_prompt_in, "a text_prompt in the query cannot also come as metadata"
            )
        text_prompt_in = None if text_prompt_in == "query" else text_prompt_in

    def optional_float(name: str) -> float | None:
        return _parse_float(name, given[name], TEMPERATURE_RANGE) if name in given else None

    def optional_int(name: str, bounds: tuple[int, int]) -> int | None:
        return _parse_int(name, given[name], bounds) if name in given else None

    return SessionRequest(
        format=audio_format,
        voice_prompt=voice_prompt,
        text_prompt=text_prompt,
        audio_temperature=optional_float("audio_temperature"),
        text_temperature=optional_float("text_temperature"),
        audio_topk=optional_int("audio_topk", AUDIO_TOPK_RANGE),
        text_topk=optional_int("text_topk", TEXT_TOPK_RANGE),
        seed=optional_int("seed", SEED_RANGE),
        text_prompt_in=text_prompt_in,
        ignored_params=tuple(sorted(key for key in items if key not in _KNOWN_PARAMS)),
    )


def parse_prompt_metadata(data: Mapping[str, Any]) -> str:
    """The text prompt of a 0x04 metadata message sent with ``text_prompt_in=metadata``: the JSON object
    ``{"text_prompt": "<prompt>"}``, checked as the query's ``text_prompt`` is (:data:`TEXT_PROMPT_LIMIT`).

    Raises:
        ProtocolError: reason ``bad_metadata``: not an object with exactly a string ``text_prompt``, or the
            prompt breaks the limit or holds NUL / lone surrogates.
    """
    if set(data) != {"text_prompt"} or not isinstance(data["text_prompt"], str):
        raise ProtocolError(
            "bad_metadata",
            'with text_prompt_in=metadata the first message must be 0x04 metadata {"text_prompt": "<text>"}, '
            f"got an object with keys {sorted(map(str, data))[:8]}",
        )
    try:
        return _parse_text_prompt(data["text_prompt"])
    except ProtocolError as exc:
        raise ProtocolError("bad_metadata", str(exc).replace("query parameter", "metadata field")) from None
