"""Every Redis key of the session store, built from the key prefix in one place.

``{prefix}`` is ``key_prefix`` (``duplex`` by default). What each key holds, its type and its TTL: the
store's module doc (``runtime.frontend.store.redis_store``) and ``runtime.frontend.store.events``. No other
module of the store formats a key (tests/test_session_store_keys.py reads their source).

Raises nothing: ids are the caller's to check (session ids are 32 hex digits by the time the sessions API
reaches the store: ``runtime.frontend.store.recordings.SESSION_ID_RE``).
"""

from __future__ import annotations

__all__ = [
    "STATES",
    "events_key",
    "index_key",
    "lines_key",
    "node_sessions_key",
    "session_events_key",
    "session_key",
    "state_index_key",
    "transcript_key",
    "writer_key",
]

STATES = ("active", "ended")
"""A session's ``state`` in its hash, and the two per-state indexes (:func:`state_index_key`)."""


def session_key(prefix: str, session_id: str) -> str:
    """``{prefix}:session:{id}``: the session's hash (its record)."""
    return f"{prefix}:session:{session_id}"


def transcript_key(prefix: str, session_id: str) -> str:
    """``{prefix}:transcript:{id}``: the plain transcript (a string, text pieces appended)."""
    return f"{prefix}:transcript:{session_id}"


def lines_key(prefix: str, session_id: str) -> str:
    """``{prefix}:lines:{id}``: the timestamped transcript (a string of JSON lines)."""
    return f"{prefix}:lines:{session_id}"


def node_sessions_key(prefix: str, node_id: str) -> str:
    """``{prefix}:node:{node}:sessions``: ids of the sessions active on that node (a set)."""
    return f"{prefix}:node:{node_id}:sessions"


def writer_key(prefix: str, node_id: str, writer_id: str = "") -> str:
    """``{prefix}:node:{node}:writer[:{writer_id}]``: one store writer's token (a string)."""
    suffix = f":{writer_id}" if writer_id else ""
    return f"{prefix}:node:{node_id}:writer{suffix}"


def index_key(prefix: str) -> str:
    """``{prefix}:sessions``: every session id, scored by start time (unix s) (a sorted set)."""
    return f"{prefix}:sessions"


def state_index_key(prefix: str, state: str) -> str:
    """``{prefix}:sessions:{state}``: the ids of the sessions in ``state`` (``active`` or ``ended``), scored
    by start time (unix s) (a sorted set): a listing by state is one range query.

    Raises:
        ValueError: ``state`` is not one of :data:`STATES`.
    """
    if state not in STATES:
        raise ValueError(f"unknown session state {state!r}; allowed: {', '.join(STATES)}")
    return f"{prefix}:sessions:{state}"


def events_key(prefix: str) -> str:
    """``{prefix}:events``: the session events stream (a Redis Stream)."""
    return f"{prefix}:events"


def session_events_key(prefix: str, session_id: str) -> str:
    """``{prefix}:events:{id}``: the ids of the session's entries in the events stream (a list), so an erase
    deletes them (``XDEL``) without reading the stream."""
    return f"{prefix}:events:{session_id}"
