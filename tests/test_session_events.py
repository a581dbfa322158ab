"""The session events stream (``{prefix}:events``) and the timestamped transcript against a real redis-server:
order, the bounded length, a Redis outage (the events of the outage written when Redis returns, none lost),
the ``resumed`` kind, and the documented example consumer (docs/examples/events_consumer.py) run as a real
process with a consumer group, stopped and restarted.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis.asyncio as redis

from runtime.frontend.store.events import EVENT_FIELDS, EVENT_KINDS, EVENT_SCHEMA, EVENTS_VERSION
from runtime.frontend.store.records import segments
from runtime.frontend.store.redis_store import SessionRecord, SessionStore

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "events_consumer.py"


def _record(slot: int = 0) -> SessionRecord:
    return SessionRecord(uuid.uuid4().hex, "node-a", slot, time.time(), "voice=NATF2", "opus", recording=True)


async def _wait_until(cond: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


async def _flushed(store: SessionStore) -> None:
    await _wait_until(lambda: store.connected and store.backlog == 0, what="the store to be flushed")


def _store(url: str, **kw: object) -> SessionStore:
    return SessionStore(url, "node-a", retry_initial_s=0.05, retry_max_s=0.2, **kw)  # type: ignore[arg-type]


async def _events(url: str, session_id: str | None = None) -> list[dict[str, str]]:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        entries = await client.xrange("duplex:events")
    finally:
        await client.aclose()
    return [fields for _, fields in entries if session_id is None or fields["session"] == session_id]


async def test_events_in_order_with_their_fields(redis_server) -> None:
    store = _store(redis_server.url)
    await store.start()
    rec = _record(slot=2)
    store.register_session(rec)
    for piece in ("Hello", " there", "."):
        store.append_transcript(rec.session_id, piece)
    store.record_event(rec.session_id, "resumed", {"gap_ms": 850})
    store.record_event(rec.session_id, "bogus")  # refused, counted, nothing written
    store.end_session(rec.session_id, "client_closed")
    await _flushed(store)
    events = await _events(redis_server.url)
    assert [e["kind"] for e in events] == ["started", "text", "text", "text", "resumed", "ended"]
    for event in events:  # the documented contract, version 2: no field outside it, none missing
        assert event["v"] == EVENTS_VERSION == "2"
        always, may = EVENT_SCHEMA[event["kind"]]
        allowed = set(EVENT_FIELDS) | set(always) | set(may)
        assert set(event) <= allowed, (event["kind"], set(event) - allowed)
        assert set(EVENT_FIELDS) | set(always) <= set(event)
    started = events[0]
    assert started["persona"] == "voice=NATF2" and started["slot"] == "2" and started["recording"] == "1"
    assert {e["session"] for e in events} == {rec.session_id} and {e["node"] for e in events} == {"node-a"}
    assert [e["text"] for e in events if e["kind"] == "text"] == ["Hello", " there", "."]
    assert events[4]["gap_ms"] == "850" and events[-1]["reason"] == "client_closed"
    ats = [float(e["at"]) for e in events]
    assert ats == sorted(ats) and rec.started_at_unix_s - 1 <= ats[0]
    assert len({e["event"] for e in events}) == len(events)
    await store.close()


async def test_the_stream_stays_bounded(redis_server) -> None:
    store = _store(redis_server.url, events_maxlen=100)
    await store.start()
    rec = _record()
    store.register_session(rec)
    for i in range(2000):
        store.append_transcript(rec.session_id, f"w{i} ")
    await _flushed(store)
    events = await _events(redis_server.url)
    # MAXLEN ~ trims whole macro nodes (100 entries each by default): within a node's size of the cap.
    assert 100 <= len(events) <= 300
    assert events[-1]["text"] == "w1999 "
    await store.close()
    with pytest.raises(ValueError, match="events_maxlen"):
        _store(redis_server.url, events_maxlen=-1)


@pytest.mark.parametrize("save", [False, True], ids=["restart_empty", "restart_with_data"])
async def test_an_outage_loses_no_event_and_no_transcript_line(redis_server, save: bool) -> None:
    store = _store(redis_server.url)
    await store.start()
    rec = _record()
    store.register_session(rec)
    before = [f"a{i} " for i in range(10)]
    for piece in before:
        store.append_transcript(rec.session_id, piece)
    await _flushed(store)

    redis_server.stop(save=save)
    during = [f"b{i} " for i in range(40)]
    for piece in during:  # the audio path goes on; every call returns at once
        store.append_transcript(rec.session_id, piece)
        await asyncio.sleep(0.005)
    store.end_session(rec.session_id, "client_closed")
    await _wait_until(lambda: not store.connected and store.backlog > 0, what="the outage to be seen")

    redis_server.start()
    await _flushed(store)
    events = await _events(redis_server.url, rec.session_id)
    # Every event of the outage is written, in order, once per event id (a consumer drops a repeated id).
    # Restarted empty, Redis lost the events before the outage (the stream is not in the writer's mirror);
    # restarted from its dump, it kept them.
    unique: dict[str, dict[str, str]] = {}
    for event in events:
        unique.setdefault(event["event"], event)
    texts = [e["text"] for e in unique.values() if e["kind"] == "text"]
    assert texts == (before + during if save else during)
    assert list(unique.values())[-1]["kind"] == "ended"
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        lines = (await client.get(f"duplex:lines:{rec.session_id}")).splitlines()
    finally:
        await client.aclose()
    assert [json.loads(line)["text"] for line in lines] == before + during  # rewritten whole by the resync
    assert "".join(seg["text"] for seg in segments(lines, rec.started_at_unix_s)) == "".join(before + during)
    await store.close()


def test_segments_split_at_pauses() -> None:
    def line(at: float, text: str) -> str:
        return json.dumps({"at": at, "speaker": "agent", "text": text})

    lines = [line(100.0, "Hi"), line(100.5, " there."), line(103.0, " Again"), "not json", line(103.1, "!")]
    assert segments(lines, 99.0) == [
        {"speaker": "agent", "start_s": 1.0, "end_s": 1.5, "text": "Hi there."},
        {"speaker": "agent", "start_s": 4.0, "end_s": 4.1, "text": " Again!"},
    ]


def _consumer(url: str, *extra: str) -> list[dict[str, str]]:
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            url,
            "--group",
            "app",
            "--consumer",
            "c1",
            "--block-ms",
            "500",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [json.loads(line) for line in done.stdout.splitlines()]


async def test_the_documented_consumer_reads_every_event_once_across_a_restart(redis_server) -> None:
    store = _store(redis_server.url)
    await store.start()
    rec = _record()
    store.register_session(rec)
    for piece in ("one", "two", "three"):
        store.append_transcript(rec.session_id, piece)
    await _flushed(store)

    first = await asyncio.to_thread(_consumer, redis_server.url, "--max-events", "2")  # then it stops
    for piece in ("four", "five"):
        store.append_transcript(rec.session_id, piece)
    store.end_session(rec.session_id, "client_closed")
    await _flushed(store)
    second = await asyncio.to_thread(_consumer, redis_server.url)  # resumes where the group left off
    written = await _events(redis_server.url)
    assert [e["event"] for e in first + second] == [e["event"] for e in written]
    assert [e["kind"] for e in first + second] == ["started"] + ["text"] * 5 + ["ended"]
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        pending = await client.xpending("duplex:events", "app")
    finally:
        await client.aclose()
    assert pending["pending"] == 0  # every event acknowledged
    assert await asyncio.to_thread(_consumer, redis_server.url) == []  # nothing read twice
    await store.close()


def test_the_persona_label_keeps_the_role_prompt_out() -> None:
    """Issue 34, item 8: the ``persona`` field of records, events and listings copied the role prompt's
    words (its first 60 characters)."""
    from runtime.frontend.gate.query import parse_session_query
    from runtime.frontend.session.conversation import persona_label
    from runtime.frontend.store.events import persona_fields, prompt_digest

    request = parse_session_query("voice_prompt=NATF2.pt&text_prompt=You+are+Ada%2C+the+bank%27s+fraud+agent")
    label = persona_label(request)
    prompt = request.text_prompt or ""
    digest = prompt_digest(prompt)
    assert label == f"voice=NATF2.pt text_sha256={digest['prompt_sha256']} text_chars={len(prompt)}"
    assert "Ada" not in label and "fraud" not in label
    # What listings and events say of the prompt is the prompt's digest, not the label's: the session
    # registry used to digest "text_chars=43" (found by the LiveKit check: chars 13 for a 71-character
    # prompt).
    assert persona_fields(label) == ("voice=NATF2.pt", "", digest)
    assert persona_fields("voice=NATF2.pt text=hello") == ("voice=NATF2.pt", "hello", prompt_digest("hello"))


def _outside_parentheses(cell: str) -> str:
    """The cell without its parenthesized remarks (nested ones included): the field names only."""
    while True:
        shorter = re.sub(r"\([^()]*\)", "", cell)
        if shorter == cell:
            return cell
        cell = shorter


def _documented_schema() -> dict[str, tuple[set[str], set[str]]]:
    """docs/sessions-api.md's table of the events' fields: kind -> (always, may carry)."""
    text = (ROOT / "docs" / "sessions-api.md").read_text()
    table = text.split("<!-- events-schema -->")[1]
    rows: dict[str, tuple[set[str], set[str]]] = {}
    for line in table.strip().splitlines():
        if not line.startswith("|"):
            break
        if line.startswith("| ---") or line.startswith("| `kind`"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        names = [set(re.findall(r"`([a-z_0-9]+)`", _outside_parentheses(cell))) for cell in cells[1:3]]
        kind = "*" if cells[0] == "every event" else cells[0].strip("`")
        rows[kind] = (names[0], names[1])
    return rows


def test_the_documented_schema_is_the_codes() -> None:
    documented = _documented_schema()
    assert documented.pop("*") == (set(EVENT_FIELDS), set())
    assert documented == {kind: (set(a), set(b)) for kind, (a, b) in EVENT_SCHEMA.items()}
    assert set(EVENT_SCHEMA) == set(EVENT_KINDS)
    assert f"`v` is `{EVENTS_VERSION}`" in (ROOT / "docs" / "sessions-api.md").read_text()


async def test_every_event_written_matches_the_documented_schema(redis_server) -> None:
    """Issue 31: ``duplex:events`` is a public contract; every kind, as the code writes it, against the
    documented schema (fields always carried, fields it may carry, ``v``)."""
    documented = _documented_schema()
    common, _ = documented["*"]
    store = _store(redis_server.url)
    await store.start()
    rec = _record()
    store.register_session(rec)
    store.append_transcript(rec.session_id, "Hi")
    store.record_event(rec.session_id, "resumed", {"gap_ms": "120"})
    store.forget_session(rec)
    store.adopt_session(rec, [(time.time(), "Hi")], {"slot": "1", "gap_ms": "300"})  # as resume.py does
    store.end_session(rec.session_id, "client_closed")
    await _flushed(store)
    events = await _events(redis_server.url)
    assert [e["kind"] for e in events] == ["started", "text", "resumed", "resumed", "ended"]
    for event in events:
        always, may = documented[event["kind"]]
        assert common | always <= set(event) <= common | always | may, event
        assert event["v"] == EVENTS_VERSION
    await store.close()
