"""The ``/api/chat`` query string: what a client asks for (format, prompts, sampling) and its limits.

:func:`parse_session_query` turns the query into a :class:`SessionRequest` and refuses anything outside
these limits with :class:`~runtime.frontend.codecs.protocol.ProtocolError`; the wire messages themselves are
in
:mod:`runtime.frontend.codecs.protocol`. Pure: no sockets, no torch. The parameters: docs/protocol.md,
"Wire protocol".
"""

from __future__ import annotations

import math
import re
import unicodedata
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.engine.persona_limits import (
    TEXT_PROMPT_LIMIT,
    TEXT_PROMPT_MAX_CHARS,
    VOICE_PROMPT_MAX_CHARS,
    VOICE_PROMPT_RE,
)
from runtime.frontend.codecs.protocol import AudioFormat, ProtocolError

__all__ = [
    "MAX_QUERY_PARAMS",
    "RESUME_HEADER",
    "TEXT_PROMPT_HEADER",
    "RESUME_SUBPROTOCOL_PREFIX",
    "ResumePresented",
    "SessionRequest",
    "parse_prompt_metadata",
    "parse_session_query",
]

MAX_QUERY_PARAMS = 100
"""Most query parameters accepted on ``/api/chat`` (known and ignored together)."""


TEXT_PROMPT_IN_METADATA = "metadata"
"""``text_prompt_in=metadata``: the text prompt comes as the client's first WebSocket message, a 0x04
metadata JSON object ``{"text_prompt": "..."}``, instead of in the URL (whose request line nginx and most
servers cap at 8 KB: a long prompt, percent-encoded, does not fit)."""
TEMPERATURE_RANGE = (0.0, 2.0)
AUDIO_TOPK_MAX = 250
"""The largest ``audio_topk`` a session may ask for, the same on every device: the audio top-k bound
(``runtime.engine.sampling.top_k_bound``) is fixed at moshi's default, 250, and baked into the depformer's
captured CUDA graph on a GPU, where a larger value would silently act as 250."""
AUDIO_TOPK_RANGE = (1, AUDIO_TOPK_MAX)
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
    "resumable",
    "resume",
)
RESUME_CREDENTIAL_MAX_CHARS = 128
_RESUME_RE = re.compile(rf"[A-Za-z0-9._-]{{1,{RESUME_CREDENTIAL_MAX_CHARS}}}")
_BOOLEANS = {"1": True, "true": True, "0": False, "false": False}
_RESUME_ALLOWED = f"1..{RESUME_CREDENTIAL_MAX_CHARS} letters, digits, '.', '_' or '-'"
"""A credential is ``<32 hex digits>.<43 base64url characters>`` (runtime.engine.resume): every character an
RFC 7230 ``tchar``, so it fits a header value and a WebSocket subprotocol name (RFC 6455, 4.1: a token)."""

TEXT_PROMPT_HEADER = "Duplex-Text-Prompt"
"""``POST /api/rtc``'s text prompt as a request header, percent-encoded UTF-8 (``encodeURIComponent``),
instead of ``text_prompt=`` in the URL, which load balancers log (issue 34, item 9); the WebSocket's is the
first message (:data:`TEXT_PROMPT_IN_METADATA`)."""
RESUME_HEADER = "Duplex-Resume-Credential"
"""The request header that presents a resume credential (on ``/api/chat``'s upgrade and ``POST /api/rtc``),
so it stays out of the URL, which proxies and load balancers log (issue 34, item 1). The 201 of a WebRTC
resume answers the next credential in the same header."""
RESUME_SUBPROTOCOL_PREFIX = "duplex.resume."
"""A browser cannot set a header on a WebSocket: it offers the subprotocol ``duplex.resume.<credential>``
(``new WebSocket(url, ["duplex.resume." + credential])``) and the server selects it (RFC 6455, 4.2.2: a
browser fails a handshake whose answer names none of the subprotocols it offered)."""


@dataclass(frozen=True)
class ResumePresented:
    """Where a request presented a resume credential, place by place (issue 34: not in the URL).

    Attributes:
        query: the deprecated ``?resume=`` value ("" when absent; still accepted, never logged).
        header: the :data:`RESUME_HEADER` values, one per header line, stripped.
        subprotocols: the offered ``Sec-WebSocket-Protocol`` names starting :data:`RESUME_SUBPROTOCOL_PREFIX`,
            whole (the one to select is the first).
    """

    query: str = ""
    header: tuple[str, ...] = ()
    subprotocols: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, query: str | None, header_values: Iterable[str], protocol_headers: Iterable[str] = ()
    ) -> ResumePresented:
        """From a request's ``resume`` query value, its :data:`RESUME_HEADER` values and its
        ``Sec-WebSocket-Protocol`` header values (comma-separated lists, RFC 6455 4.1)."""
        offered = (name.strip() for value in protocol_headers for name in value.split(","))
        return cls(
            query=query or "",
            header=tuple(value.strip() for value in header_values if value.strip()),
            subprotocols=tuple(name for name in offered if name.startswith(RESUME_SUBPROTOCOL_PREFIX)),
        )

    @property
    def given(self) -> bool:
        """A credential was presented in at least one place (the request is a resume: no token needed)."""
        return bool(self.query or self.header or self.subprotocols)

    @property
    def subprotocol(self) -> str | None:
        """The offered ``duplex.resume.<credential>`` subprotocol the server selects, or None."""
        return self.subprotocols[0] if self.subprotocols else None

    def credential(self) -> str | None:
        """The one credential presented (None when none was).

        Raises:
            ProtocolError: ``bad_query``: a place holds something that is not a credential (its value is
                not echoed: it may be nearly a secret), one place gives two different ones, or two places
                give different ones (both places named).
        """
        places = (
            ("the query parameter resume (deprecated)", (self.query,) if self.query else ()),
            (f"the {RESUME_HEADER} header", self.header),
            (
                f"the Sec-WebSocket-Protocol {RESUME_SUBPROTOCOL_PREFIX}<credential>",
                tuple(name.removeprefix(RESUME_SUBPROTOCOL_PREFIX) for name in self.subprotocols),
            ),
        )
        found: list[tuple[str, str]] = []
        for place, values in places:
            for value in values:
                if not _RESUME_RE.fullmatch(value):
                    raise ProtocolError(
                        "bad_query",
                        f"{place} is not a resume credential: expected the credential of the 0x04 metadata "
                        f"({_RESUME_ALLOWED}), got {len(value)} characters",
                    )
            if len(set(values)) > 1:
                raise ProtocolError(
                    "bad_query", f"{place} gives {len(set(values))} different resume credentials"
                )
            if values:
                found.append((place, values[0]))
        for place, value in found[1:]:
            if value != found[0][1]:
                raise ProtocolError(
                    "bad_query",
                    f"{found[0][0]} and {place} give different resume credentials: present one, once",
                )
        return found[0][1] if found else None


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
        audio_topk: top-k over audio codebook entries, 1..:data:`AUDIO_TOPK_MAX` (250).
        text_topk: top-k over text tokens, 1..32000.
        seed: sampling seed, 0..2**31-1.
        resumable: ``resumable=1``: the client asks for a resume credential (a 0x04 metadata message right
            after the handshake; docs/protocol.md, "Resume"); None or False: nothing new is sent.
        resume: the credential of the session to resume instead of starting one (every other parameter
            but ``format`` is the session's already and is ignored): from :data:`RESUME_HEADER`, the
            ``duplex.resume.<credential>`` subprotocol or the deprecated ``resume=`` query parameter
            (:class:`ResumePresented`).
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
    resumable: bool | None = None
    resume: str | None = None
    ignored_params: tuple[str, ...] = field(default=())

    def to_query_params(self) -> dict[str, str]:
        """The query parameters that :func:`parse_session_query` turns back into this request.

        Parameters left at None are omitted; ``ignored_params`` are not included.
        """
        params: dict[str, str] = {"format": self.format.value}
        for name in _KNOWN_PARAMS[1:]:
            value = getattr(self, name)
            if isinstance(value, bool):
                params[name] = "1" if value else "0"
            elif value is not None:
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
    if name == "audio_topk":
        allowed += " (the audio top-k bound of the depformer's captured step, the same on every device)"
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
    ``text_topk``, ``seed``, ``text_prompt_in``, ``resumable``, ``resume`` (ranges on
    :class:`SessionRequest`). An empty value
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

    resumable = None
    if "resumable" in given:
        resumable = _BOOLEANS.get(given["resumable"].lower())
        if resumable is None:
            raise _bad_query("resumable", given["resumable"], "expected 1, 0, true or false")
    resume = given.get("resume")
    if resume is not None and not _RESUME_RE.fullmatch(resume):
        raise _bad_query(
            "resume",
            resume,
            f"expected the credential of the 0x04 metadata ({_RESUME_ALLOWED})",
        )

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
        resumable=resumable,
        resume=resume,
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
