"""The session events stream and the timestamped transcript: what the session store writes for applications.

Written by the store's background writer (``runtime.frontend.store.writer``), in the same ``MULTI``/``EXEC``
as the registry and the transcript, so they share its outage contract: queued while Redis is away, written
when it returns, in order. Key names: ``runtime.frontend.store.keys``.

``{prefix}:events`` (a Redis Stream, one for every node using this Redis)
    One entry per event; its fields (all strings) are a versioned public contract: :data:`EVENTS_VERSION`,
    :data:`EVENT_SCHEMA` and docs/sessions-api.md, "Events" (tests/test_session_events.py holds the code, the
    schema and the document to each other). Trimmed by length (``XADD MAXLEN ~ events_maxlen``) and by time:
    the writer deletes entries older than the retention (``XTRIM MINID``, every :data:`TRIM_EVERY_S`).
``{prefix}:events:{id}`` (a list, TTL retention + :data:`EVENT_INDEX_SLACK_S`)
    The stream ids of the session's entries, pushed by the same script as each entry
    (:data:`XADD_INDEXED_LUA`), so an erase deletes them (``XDEL``) without reading the stream, even after
    the session's record has expired.
``{prefix}:lines:{id}`` (a string, TTL ``transcript_ttl_s``)
    The transcript with timestamps: one line of JSON per text piece, ``{"at": <unix s>, "speaker": "agent",
    "text": "<piece>"}\n``, appended with ``APPEND``: one string, not a list, so a 10-minute transcript reads
    back as one bulk reply (as a list of 7,500 entries it took 2.4 times as long: redis-py parses each
    entry). The plain ``{prefix}:transcript:{id}`` string is kept as before.
``{prefix}:sessions``, ``{prefix}:sessions:active``, ``{prefix}:sessions:ended`` (sorted sets, score = start
time in unix s)
    Every session id written in this Redis, and the ids by state, for listing; ids whose record has expired
    are removed when a list reads them, and ids older than :data:`INDEX_HORIZON_S` past the TTL at every
    registration.

The persona: a session's ``persona`` (``voice=<name> text=<prompt>``, ``runtime.frontend.session.conversation.
persona_label``) is split by :func:`persona_fields`: the events and the listings carry the voice and the text
prompt's SHA-256 and length, never its text; the record keeps the text for ``GET /api/sessions/<id>
?include=persona``.

An example consumer (consumer group, acknowledgement, restart): docs/sessions-api.md, "Events".
"""

from __future__ import annotations

import hashlib
import json

__all__ = [
    "EVENTS_VERSION",
    "EVENT_FIELDS",
    "EVENT_INDEX_SLACK_S",
    "EVENT_KINDS",
    "EVENT_SCHEMA",
    "INDEX_HORIZON_S",
    "SPEAKER_AGENT",
    "TRIM_EVERY_S",
    "XADD_INDEXED_LUA",
    "event_fields",
    "line_entry",
    "persona_fields",
    "prompt_digest",
]

EVENTS_VERSION = "2"
"""The ``v`` field of every entry. Compatibility rule (docs/sessions-api.md, "Events"): a field or an event
kind may be added within a version (consumers ignore what they do not know); removing or renaming a field, or
changing what one means, takes a new version. Entries without ``v`` are version 1 (until this version:
``persona`` held the text prompt, ``prompt_sha256``/``prompt_chars`` did not exist)."""

EVENT_KINDS = ("started", "text", "ended", "resumed")
"""Every ``kind`` of event; ``resumed`` is written by the session resume work (``record_event``)."""

EVENT_FIELDS = ("v", "kind", "session", "node", "at", "event")
"""The fields of every entry."""

_PERSONA = ("persona", "prompt_sha256", "prompt_chars", "format", "slot", "recording")

EVENT_SCHEMA: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "started": (_PERSONA, ()),
    "text": (("speaker", "text"), ()),
    "ended": (("reason",), ()),
    "resumed": (("gap_ms",), _PERSONA),
}
"""Per kind: (the fields it always carries, those it may carry) besides :data:`EVENT_FIELDS`. A ``resumed``
event written with the new registration (``adopt_session``) carries ``started``'s fields too."""

SPEAKER_AGENT = "agent"
"""The speaker of the model's text pieces."""

INDEX_HORIZON_S = 86400
"""Extra age (s) past ``session_ttl_s`` after which an id leaves the session indexes at registration
(a session's record lives ``session_ttl_s`` from its last write, which can be its end: sessions last at
most a day here)."""

TRIM_EVERY_S = 60.0
"""How often (s) the writer deletes the events older than the retention (``XTRIM MINID``): an entry outlives
the retention by at most this."""

EVENT_INDEX_SLACK_S = 2 * int(TRIM_EVERY_S)
"""Extra life (s) of a session's ``{prefix}:events:{id}`` past the retention: it outlives the entries it
names (trimmed within :data:`TRIM_EVERY_S` of the retention), so an erase still finds them."""

XADD_INDEXED_LUA = """
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 3))
redis.call('RPUSH', KEYS[2], id)
redis.call('EXPIRE', KEYS[2], ARGV[2])
return id
"""
"""``XADD`` one entry and push its id on the session's entry index, atomically (the id exists only once
added). KEYS: the stream, the session's index; ARGV: the ``MAXLEN ~`` cap (entries), the index TTL (s), then
the fields as name, value, ..."""

_PROMPT_HASH_HEX = 16


def persona_fields(persona: str) -> tuple[str, str, dict[str, str]]:
    """Split a persona label into the voice part (``voice=<name>`` or ""), the text prompt where the label
    still holds it ("" for every label written since issue 34: ``text_sha256=<16 hex> text_chars=<n>``,
    ``session.conversation.persona_label``), and the prompt's digest (:func:`prompt_digest`'s two fields).
    A label of an older shape (``text=<prompt>``, or anything else) is a text prompt whole, digested here,
    so no prompt text leaks into the voice part."""
    voice, _, rest = persona.partition(" ") if persona.startswith("voice=") else ("", "", persona)
    if rest.startswith("text_sha256="):
        fields = dict(part.partition("=")[::2] for part in rest.split())
        return (
            voice,
            "",
            {"prompt_sha256": fields.get("text_sha256", ""), "prompt_chars": fields.get("text_chars", "0")},
        )
    text = rest[len("text=") :] if rest.startswith("text=") else rest
    return voice, text, prompt_digest(text)


def prompt_digest(text: str) -> dict[str, str]:
    """``prompt_sha256`` (the first 16 hex digits of the UTF-8 text's SHA-256; "" for no prompt) and
    ``prompt_chars`` (its length, characters): what listings and events say of a text prompt."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:_PROMPT_HASH_HEX] if text else ""
    return {"prompt_sha256": digest, "prompt_chars": str(len(text))}


def line_entry(at_unix_s: float, piece: str, speaker: str = SPEAKER_AGENT) -> str:
    """One timestamped transcript piece as appended to ``{prefix}:lines:{id}``: compact JSON and a newline
    (JSON escapes a newline inside the text, so each piece is one line)."""
    entry = {"at": round(at_unix_s, 3), "speaker": speaker, "text": piece}
    return json.dumps(entry, separators=(",", ":")) + "\n"


def event_fields(
    kind: str, session_id: str, node_id: str, at_unix_s: float, event_id: str, extra: dict[str, str]
) -> dict[str, str]:
    """The fields of one stream entry (see the module doc).

    Raises:
        ValueError: ``kind`` not in :data:`EVENT_KINDS`.
    """
    if kind not in EVENT_KINDS:
        raise ValueError(f"unknown event kind {kind!r}; allowed: {', '.join(EVENT_KINDS)}")
    fields = {"v": EVENTS_VERSION, "kind": kind, "session": session_id, "node": node_id}
    fields["at"] = repr(round(at_unix_s, 3))
    fields["event"] = event_id
    fields.update(extra)
    return fields
