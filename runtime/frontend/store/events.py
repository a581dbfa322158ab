"""The session events stream and the timestamped transcript: what the session store writes for applications.

Written by the store's background writer (``runtime.frontend.store.writer``), in the same ``MULTI``/``EXEC``
as the registry and the transcript, so they share its outage contract: queued while Redis is away, written
when it returns, in order.

``{prefix}:events`` (a Redis Stream, one for every node using this Redis, trimmed with ``XADD MAXLEN ~``)
    One entry per event, fields (all strings), version :data:`EVENTS_VERSION` of the contract:

    - ``v``: the contract's version (``1``);
    - ``kind``: ``started``, ``text``, ``ended`` or ``resumed`` (:data:`EVENT_KINDS`);
    - ``session`` (hex uuid), ``node``, ``at`` (unix s of the event, when it happened, not when written);
    - ``event``: ``<writer token>:<sequence>``, unique per event. Delivery is at least once: after a Redis
      failure whose ``EXEC`` reply was lost, the writer writes the events again; a consumer drops an
      ``event`` id it has already seen;
    - ``started``: ``persona``, ``format``, ``slot``, ``recording`` (``1`` when the caller consented);
    - ``text``: ``speaker`` (``agent``: the model's text; Moshi-family models give no text of the
      caller) and ``text`` (one piece, as sent to the client);
    - ``ended``: ``reason`` (the outcome, ``duplex_sessions_ended_total``'s reasons);
    - ``resumed``: whatever the resume work adds (``gap_ms`` suggested).
``{prefix}:lines:{id}`` (a string, TTL ``transcript_ttl_s``)
    The transcript with timestamps: one line of JSON per text piece, ``{"at": <unix s>, "speaker": "agent",
    "text": "<piece>"}\n``, appended with ``APPEND``: one string, not a list, so a 10-minute transcript reads
    back as one bulk reply (as a list of 7,500 entries it took 2.4 times as long: redis-py parses each
    entry). The plain ``{prefix}:transcript:{id}`` string is kept as before.
``{prefix}:sessions`` (a sorted set, score = start time in unix s)
    Every session id written in this Redis, for listing; ids whose record has expired are removed when
    the list is read, and ids older than :data:`INDEX_HORIZON_S` past the TTL at every registration.

An example consumer (consumer group, acknowledgement, restart): docs/sessions-api.md, "Events".
"""

from __future__ import annotations

import json

__all__ = [
    "EVENTS_VERSION",
    "EVENT_FIELDS",
    "EVENT_KINDS",
    "INDEX_HORIZON_S",
    "SPEAKER_AGENT",
    "event_fields",
    "events_key",
    "index_key",
    "line_entry",
    "lines_key",
]

EVENTS_VERSION = "1"
"""The ``v`` field of every entry: the version of the events contract (docs/sessions-api.md, "Events"). Within
one version fields are only ever added (a consumer ignores those it does not know); removing or changing the
meaning of a field, or a kind, makes a new version, announced in the docs before it is written."""

EVENT_FIELDS: dict[str, frozenset[str]] = {
    "*": frozenset({"v", "kind", "session", "node", "at", "event"}),
    "started": frozenset({"persona", "format", "slot", "recording"}),
    "text": frozenset({"speaker", "text"}),
    "ended": frozenset({"reason"}),
    "resumed": frozenset({"persona", "format", "slot", "recording", "gap_ms"}),
}
"""The fields of version 1, every event's (``"*"``) and each kind's own: the documented contract, held to what
the writer writes by tests/test_session_events.py."""

EVENT_KINDS = ("started", "text", "ended", "resumed")
"""Every ``kind`` of event; ``resumed`` is written by the session resume work (``record_event``)."""

SPEAKER_AGENT = "agent"
"""The speaker of the model's text pieces."""

INDEX_HORIZON_S = 86400
"""Extra age (s) past ``session_ttl_s`` after which an id leaves ``{prefix}:sessions`` at registration
(a session's record lives ``session_ttl_s`` from its last write, which can be its end: sessions last at
most a day here)."""


def events_key(prefix: str) -> str:
    """``{prefix}:events`` (stream)."""
    return f"{prefix}:events"


def lines_key(prefix: str, session_id: str) -> str:
    """``{prefix}:lines:{id}`` (string of JSON lines)."""
    return f"{prefix}:lines:{session_id}"


def index_key(prefix: str) -> str:
    """``{prefix}:sessions`` (sorted set by start time)."""
    return f"{prefix}:sessions"


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
