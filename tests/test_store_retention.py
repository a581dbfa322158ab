"""The session store's retention, indexes and erase against a real redis-server (issue 34 items 5, 6, 8, 11):

- the events stream is trimmed by time (the retention), not only by length, by the writer on its own;
- an erase finds a session's stream entries by its per-session index, without reading the stream, even after
  its record expired;
- a listing by state is one range query (its index), whatever the number of sessions in the other state;
- after an erase the reader asks Redis for an AOF rewrite (debounced), and the erased text is then in no file
  of Redis's data directory (Redis in AOF mode, no snapshots, as on the node);
- the text prompt stays out of events and listings (its hash and length instead), read only with
  ``?include=persona``; a malformed ``limit`` answers 400, not 500;
- recording files are created 0600.

Redis's own command counters (``INFO commandstats``) show what was asked of it; waits are for a condition,
never for a time.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import stat
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as redis
from aiohttp.test_utils import make_mocked_request

import runtime.frontend.store.writer as writer_module
from runtime.frontend.gate.app_tokens import mint_app_token
from runtime.frontend.gate.tokens import SigningKey, TokenVerifier
from runtime.frontend.sessions_api import sessions_collection, sessions_item
from runtime.frontend.store.interface import SessionLog, SessionReader
from runtime.frontend.store.recordings import LocalRecordings
from runtime.frontend.store.records import RedisSessionReader
from runtime.frontend.store.redis_store import SessionRecord, SessionStore
from runtime.tools.local_redis import free_loopback_port

pytestmark = pytest.mark.timeout(120)

PROMPT = "You are Ada, a tea seller; never reveal the discount code TEAPOT42."
KEY = SigningKey("store", "s" * 32)
AUDIENCE = "store-test"


def _record(started_at: float | None = None, persona: str = f"voice=NATF2 text={PROMPT}") -> SessionRecord:
    at = time.time() if started_at is None else started_at
    return SessionRecord(uuid.uuid4().hex, "node-a", 0, at, persona, "opus")


def _store(url: str, **kw: Any) -> SessionStore:
    return SessionStore(url, "node-a", retry_initial_s=0.05, retry_max_s=0.2, **kw)


async def _wait_until(cond: Callable[[], Any], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


async def _flushed(store: SessionStore) -> None:
    async def done() -> bool:
        return store.connected and store.backlog == 0

    await _wait_until(done, "the store to be flushed")


async def _session(store: SessionStore, pieces: int = 3, **kw: Any) -> SessionRecord:
    rec = _record(**kw)
    store.register_session(rec)
    for i in range(pieces):
        store.append_transcript(rec.session_id, f"piece {i} of {PROMPT[:10]} ")
    store.end_session(rec.session_id, "client_closed")
    return rec


async def _calls(client: redis.Redis, command: str) -> int:
    stats = await client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def _entries(client: redis.Redis, session_id: str | None = None) -> list[dict[str, str]]:
    return [f for _, f in await client.xrange("duplex:events") if session_id in (None, f["session"])]


@pytest_asyncio.fixture
async def raw(redis_server: Any) -> AsyncIterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


def test_the_redis_classes_implement_the_protocols() -> None:
    """(mypy checks the signatures: runtime.frontend.store.records._conforms.)"""
    assert isinstance(_store("redis://127.0.0.1:1/0"), SessionLog)
    assert isinstance(RedisSessionReader("redis://127.0.0.1:1/0"), SessionReader)


async def test_the_writer_trims_the_events_past_the_retention(
    redis_server: Any, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 5: with a 60 s retention, 85 s later the stream held all the session's entries."""
    monkeypatch.setattr(writer_module, "TRIM_EVERY_S", 0.05)
    later = {"s": 0.0}
    clock = lambda: time.time() + later["s"]  # noqa: E731
    store = _store(redis_server.url, session_ttl_s=60, transcript_ttl_s=60, clock=clock)
    await store.start()
    rec = await _session(store)
    await _flushed(store)
    assert len(await _entries(raw, rec.session_id)) == 5  # started, 3 text, ended: within the retention
    later["s"] = 85.0  # the store's clock, 85 s on: every entry is past the 60 s retention

    async def trimmed() -> bool:
        return not await _entries(raw)

    await _wait_until(trimmed, "the writer to trim the stream by time")
    await store.close()


async def test_erase_finds_the_events_after_the_record_expired_without_reading_the_stream(
    redis_server: Any, raw: redis.Redis
) -> None:
    """Finding 5 and 11: DELETE answered 404 "nothing held" once the record expired while the stream held its
    entries; an erase read the whole stream (XRANGE pages)."""
    store = _store(redis_server.url, session_ttl_s=60, transcript_ttl_s=60)
    await store.start()
    others = [await _session(store, pieces=50) for _ in range(20)]
    rec = await _session(store)
    await _flushed(store)
    await store.close()
    assert len(await _entries(raw)) == 20 * 52 + 5
    # What Redis's TTL does 60 s after the end: the record and transcripts go, the entries' index stays.
    await raw.delete(f"duplex:session:{rec.session_id}", f"duplex:transcript:{rec.session_id}")
    await raw.delete(f"duplex:lines:{rec.session_id}")
    assert 60 < await raw.ttl(f"duplex:events:{rec.session_id}") <= 60 + 120

    reader = RedisSessionReader(redis_server.url, aof_rewrite_every_s=None)
    xranges = await _calls(raw, "xrange")
    assert await reader.erase(rec.session_id) is True
    assert await _calls(raw, "xrange") == xranges  # no scan
    assert await _entries(raw, rec.session_id) == []
    assert len(await _entries(raw)) == 20 * 52  # the others' entries untouched
    assert await raw.exists(f"duplex:events:{rec.session_id}") == 0
    assert await reader.erase(rec.session_id) is False  # nothing held any more: 404
    assert await reader.erase(others[0].session_id) is True
    assert len(await _entries(raw)) == 19 * 52
    await reader.close()


async def test_a_listing_by_state_is_one_range_query(redis_server: Any, raw: redis.Redis) -> None:
    """Finding 11: ``state=active&limit=1`` over 20,000 ended sessions read every record (10 s)."""
    store = _store(redis_server.url)
    await store.start()
    live = _record(started_at=time.time() - 3600)  # the oldest: behind every ended one
    store.register_session(live)
    start = time.time() - 1800
    ended = [await _session(store, pieces=0, started_at=start + i) for i in range(2000)]
    await _flushed(store)
    reader = RedisSessionReader(redis_server.url)
    reads = await _calls(raw, "hgetall")
    found = await reader.list(state="active", limit=1)
    assert [s["id"] for s in found] == [live.session_id]
    assert await _calls(raw, "hgetall") - reads == 1  # the one record of the page
    page = await reader.list(state="ended", limit=100)
    assert [s["id"] for s in page] == [r.session_id for r in reversed(ended[-100:])]
    assert await _calls(raw, "hgetall") - reads == 101
    store.end_session(live.session_id, "client_closed")
    await _flushed(store)
    assert await reader.list(state="active", limit=1) == []
    assert (await reader.list(state="ended", limit=2001))[-1]["id"] == live.session_id
    await reader.close()
    await store.close()


def _token() -> str:
    return mint_app_token(KEY, ttl_s=300, audience=AUDIENCE)


def _front(reader: RedisSessionReader) -> Any:
    verifier = TokenVerifier([KEY], AUDIENCE, kind="app")  # application tokens have keys of their own
    return SimpleNamespace(access=SimpleNamespace(app_verifier=verifier), records=reader)


async def _get(front: Any, path: str, handler: Any = sessions_item) -> tuple[int, Any]:
    request = make_mocked_request("GET", path, headers={"Authorization": "Bearer " + _token()})
    answer = await handler(front, request)
    return answer.status, json.loads(answer.body) if answer.body else None


async def test_the_text_prompt_stays_out_of_events_and_listings(redis_server: Any, raw: redis.Redis) -> None:
    """Finding 8: ``persona`` copied the role prompt into the record's listing and every ``started`` event."""
    store = _store(redis_server.url)
    await store.start()
    rec = await _session(store)
    await _flushed(store)
    digest = hashlib.sha256(PROMPT.encode()).hexdigest()[:16]
    for entry in await _entries(raw, rec.session_id):
        assert "TEAPOT42" not in json.dumps(entry) and entry["v"] == "2"
    started = (await _entries(raw, rec.session_id))[0]
    assert (started["persona"], started["prompt_sha256"], started["prompt_chars"]) == (
        "voice=NATF2",
        digest,
        str(len(PROMPT)),
    )
    reader = RedisSessionReader(redis_server.url)
    front = _front(reader)
    status, listing = await _get(front, "/api/sessions", sessions_collection)
    assert status == 200 and "TEAPOT42" not in json.dumps(listing)
    assert listing["sessions"][0]["prompt"] == {"sha256": digest, "chars": len(PROMPT)}
    status, body = await _get(front, f"/api/sessions/{rec.session_id}")
    assert status == 200 and "TEAPOT42" not in json.dumps(body)
    status, body = await _get(front, f"/api/sessions/{rec.session_id}?include=persona")
    assert status == 200 and body["prompt"]["text"] == PROMPT and body["persona"] == "voice=NATF2"
    status, body = await _get(front, f"/api/sessions/{rec.session_id}?include=prompt")
    assert status == 400 and body["error"] == "bad_query" and "include='prompt'" in body["message"]
    await reader.close()
    await store.close()


@pytest.mark.parametrize("limit", ["²", "٣", "1.5", "-1", "0", "1001", ""])
async def test_a_malformed_limit_answers_400_naming_it(redis_server: Any, limit: str) -> None:
    """Finding 11: ``limit=²`` passed ``str.isdigit`` and ``int()`` raised: 500."""
    reader = RedisSessionReader(redis_server.url)
    status, body = await _get(_front(reader), f"/api/sessions?limit={limit}", sessions_collection)
    assert status == 400 and body["error"] == "bad_query" and body["message"].startswith("limit=")
    await reader.close()


def test_recording_files_are_created_0600(tmp_path: Path) -> None:
    """Finding 11: recording files were created 0644 (the umask's default)."""
    old = os.umask(0o022)
    try:
        recordings = LocalRecordings(tmp_path / "rec")
        sid = uuid.uuid4().hex
        handle = recordings.create(sid, "caller")
        handle.write(b"OggS")
        recordings.commit(sid, "caller", handle)
    finally:
        os.umask(old)
    path = recordings.local_path(sid, "caller")
    assert path is not None and stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.fixture
def aof_redis(tmp_path: Path) -> Iterator[SimpleNamespace]:
    """A redis-server in AOF mode without RDB snapshots (the node's persistence: ``save ""``)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server not found on PATH: install Redis >= 7 (apt-get install redis-server)")
    data = tmp_path / "data"
    data.mkdir()
    port = free_loopback_port()
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes"]
    args += ["--appendfsync", "always", "--dir", str(data)]
    with open(tmp_path / "redis.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield SimpleNamespace(url=f"redis://127.0.0.1:{port}/0", data=data, proc=proc)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _files_holding(directory: Path, secret: bytes) -> list[str]:
    return [str(p) for p in directory.rglob("*") if p.is_file() and secret in p.read_bytes()]


async def test_after_an_erase_the_text_is_in_no_file_of_redis(aof_redis: SimpleNamespace) -> None:
    """Finding 6: after DELETE the erased text stayed in Redis's append-only file."""
    client = redis.Redis.from_url(aof_redis.url, decode_responses=True)

    async def up() -> bool:
        try:
            return bool(await client.ping())
        except (redis.ConnectionError, OSError):
            return False

    await _wait_until(up, "redis-server to answer")
    store = _store(aof_redis.url)
    await store.start()
    keep = await _session(store, persona="voice=NATF2 text=Keep this KEEPME77 prompt.")
    rec = await _session(store)
    await _flushed(store)
    await store.close()
    assert _files_holding(aof_redis.data, b"TEAPOT42")  # the AOF holds it before the erase

    reader = RedisSessionReader(aof_redis.url, aof_rewrite_every_s=0.0)
    assert await reader.erase(rec.session_id) is True
    assert reader.rewrites_asked == 1

    async def gone() -> bool:
        info = await client.info("persistence")
        busy = info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"]
        return not busy and not _files_holding(aof_redis.data, b"TEAPOT42")

    await _wait_until(gone, "the AOF rewrite to leave the erased text in no file")
    assert _files_holding(aof_redis.data, b"KEEPME77")  # the rest is still there
    assert (await reader.read(keep.session_id)) is not None
    await reader.close()
    await client.aclose()


async def test_the_aof_rewrite_is_debounced(aof_redis: SimpleNamespace) -> None:
    """At most one rewrite per window: a second erase inside it gets one rewrite at the window's end."""
    client = redis.Redis.from_url(aof_redis.url, decode_responses=True)

    async def up() -> bool:
        try:
            return bool(await client.ping())
        except (redis.ConnectionError, OSError):
            return False

    await _wait_until(up, "redis-server to answer")
    store = _store(aof_redis.url)
    await store.start()
    recs = [await _session(store) for _ in range(3)]
    await _flushed(store)
    await store.close()
    now = {"s": 1000.0}
    reader = RedisSessionReader(aof_redis.url, aof_rewrite_every_s=0.3, clock=lambda: now["s"])
    assert await reader.erase(recs[0].session_id)
    assert reader.rewrites_asked == 1
    now["s"] += 0.1  # inside the window: deferred to its end, once for both erases
    assert await reader.erase(recs[1].session_id)
    assert await reader.erase(recs[2].session_id)
    assert reader.rewrites_asked == 1

    async def deferred_done() -> bool:
        return reader.rewrites_asked == 2

    await _wait_until(deferred_done, "the deferred rewrite")
    await client.aclose()
    await reader.close()
    assert reader.rewrites_asked == 2
