"""The session store's side of a resume (``SessionStore.forget_session`` / ``adopt_session``): a session moves
from one store to another (two workers of one node, a store each), against a real redis-server.

The transcript lines the old store still had queued (Redis down, or its writer behind) must be neither lost
nor written twice nor counted as written without being sent: the new store writes the whole history it got
from the slot owner over what Redis holds, and the old store's queued appends become events only.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

import pytest
import redis.asyncio as redis

from runtime.frontend.store.redis_store import SessionRecord, SessionStore

pytestmark = pytest.mark.timeout(60)


def _store(url: str, writer_id: str, errors: list[str]) -> SessionStore:
    return SessionStore(
        url, "node-a", writer_id=writer_id, on_error=errors.append, retry_initial_s=0.05, retry_max_s=0.2
    )


async def _until(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


async def _flushed(*stores: SessionStore) -> None:
    await _until(lambda: all(s.connected and s.backlog == 0 for s in stores), "the stores flushed")


async def _read(url: str, sid: str) -> tuple[str, list[str], list[dict[str, str]]]:
    """The transcript text, the lines' texts in order, and the session's events (deduplicated on their
    ``event`` id: delivery is at least once), in stream order."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        text = await client.get(f"duplex:transcript:{sid}") or ""
        raw_lines = await client.get(f"duplex:lines:{sid}") or ""
        entries = await client.xrange("duplex:events")
    finally:
        await client.aclose()
    lines = [json.loads(line)["text"] for line in raw_lines.splitlines()]
    seen: set[str] = set()
    events = []
    for _, fields in entries:
        if fields.get("session") == sid and fields["event"] not in seen:
            seen.add(fields["event"])
            events.append(fields)
    return text, lines, events


def _record(sid: str) -> SessionRecord:
    return SessionRecord(sid, "node-a", 3, time.time(), "NATF2", "pcm")


async def test_redis_down_during_a_cross_store_resume_loses_and_miscounts_nothing(redis_server) -> None:
    """Redis stops while the old store has lines queued; the session is resumed through the other store,
    which appends more and ends it; Redis restarts: every piece is in the transcript and the lines exactly
    once, in order, and every text event is published once, with one started, one resumed, one ended.

    Planted bug it catches: the adopted history not written over Redis (the old store's resync no longer
    tracks the session and acknowledges its queued lines without sending them: those lines are lost)."""
    errors_1: list[str] = []
    errors_2: list[str] = []
    old, new = _store(redis_server.url, "w0", errors_1), _store(redis_server.url, "w1", errors_2)
    await old.start()
    await new.start()
    sid = uuid.uuid4().hex
    record = _record(sid)
    history: list[tuple[float, str]] = []

    def say(store: SessionStore, piece: str) -> None:
        history.append((time.time(), piece))
        store.append_transcript(sid, piece)

    old.register_session(record)
    for i in range(5):
        say(old, f"a{i} ")
    await _flushed(old, new)
    redis_server.stop(save=True)
    for i in range(5):
        say(old, f"b{i} ")  # queued in the old store: Redis is down
    await _until(lambda: "write" in errors_1 or "resync" in errors_1, "the old store's write failing")
    assert old.backlog == 5

    old.forget_session(record)  # the engine's Moved: resumed through the other worker
    new.adopt_session(replace(record), list(history), {"slot": "3", "gap_ms": "120"})
    for i in range(3):
        say(new, f"c{i} ")
    new.end_session(sid, "client_closed")
    redis_server.start()
    await _flushed(old, new)

    pieces = [piece for _, piece in history]
    text, lines, events = await _read(redis_server.url, sid)
    assert text == "".join(pieces)
    assert lines == pieces
    kinds = [e["kind"] for e in events]
    assert kinds.count("started") == kinds.count("resumed") == kinds.count("ended") == 1, kinds
    assert kinds.index("resumed") < kinds.index("ended")
    assert sorted(e["text"] for e in events if e["kind"] == "text") == sorted(pieces)
    assert "backlog_overflow" not in errors_1 + errors_2 and "internal" not in errors_1 + errors_2
    await old.close()
    await new.close()


async def test_the_old_store_writing_late_writes_no_line_twice(redis_server) -> None:
    """Redis up, the old store's writer behind (its queued lines not yet sent, not in flight) when the session
    moves: the new store writes the history; the old store, catching up, publishes its pieces' events and
    writes none of their text again.

    Planted bug it catches: the old store's queued appends kept as appends (written after the new store's
    history: every one of them twice)."""
    errors: list[str] = []
    old, new = _store(redis_server.url, "w0", errors), _store(redis_server.url, "w1", errors)
    await old.start()
    await new.start()
    sid = uuid.uuid4().hex
    record = _record(sid)
    history: list[tuple[float, str]] = []
    old.register_session(record)
    for i in range(3):
        history.append((time.time(), f"a{i} "))
        old.append_transcript(sid, f"a{i} ")
    await _flushed(old, new)

    gate = asyncio.Event()
    write_batch = old._write_batch

    async def behind() -> None:  # the old store's writer, held before it takes any op
        await gate.wait()
        await write_batch()

    old._write_batch = behind  # type: ignore[method-assign]
    for i in range(3):
        history.append((time.time(), f"b{i} "))
        old.append_transcript(sid, f"b{i} ")
    old.forget_session(record)
    new.adopt_session(replace(record), list(history))
    history.append((time.time(), "c0"))
    new.append_transcript(sid, "c0")
    await _flushed(new)
    gate.set()
    await _flushed(old)

    pieces = [piece for _, piece in history]
    text, lines, events = await _read(redis_server.url, sid)
    assert text == "".join(pieces), text
    assert lines == pieces
    assert sorted(e["text"] for e in events if e["kind"] == "text") == sorted(pieces)
    assert errors == []
    await old.close()
    await new.close()
