"""SessionStore against a real redis-server: round trip, TTLs, order, outages, overflow, close.

No assertion depends on how fast this machine runs (issue 25, item 2). That the audio path's calls never
wait for Redis is shown with a Redis that cannot answer (redis-server paused with SIGSTOP, the store's socket
timeout an hour): a call that waited would never return, and the test's timeout fails it. How long a call
takes is a benchmark's question (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as redis

from runtime.frontend.store.redis_store import SessionRecord, SessionStore

pytestmark = pytest.mark.timeout(60)


def _record(
    slot: int = 0, persona: str = "voice=NATF2 text=You sell tea.", node: str = "node-a"
) -> SessionRecord:
    return SessionRecord(
        session_id=str(uuid.uuid4()),
        node_id=node,
        slot=slot,
        started_at_unix_s=time.time(),
        persona=persona,
        audio_format="opus",
    )


async def _wait_until(cond: Callable[[], bool], timeout_s: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


async def _flushed(store: SessionStore, timeout_s: float = 15.0) -> None:
    await _wait_until(lambda: store.connected and store.backlog == 0, timeout_s, "store flushed")


class _Probe:
    """Collects on_error names and on_backlog values."""

    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()
        self.backlog: list[int] = []

    def on_error(self, name: str) -> None:
        self.errors[name] += 1

    def on_backlog(self, n: int) -> None:
        self.backlog.append(n)


@pytest.fixture
async def raw(redis_server) -> AsyncIterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


def _store(url: str, probe: _Probe, **kw) -> SessionStore:
    kw.setdefault("retry_initial_s", 0.05)
    kw.setdefault("retry_max_s", 0.2)
    return SessionStore(url, "node-a", on_error=probe.on_error, on_backlog=probe.on_backlog, **kw)


NEVER_S = 3600.0
"""A socket timeout no test waits out: with it, a store call that waited for Redis would never return."""


@contextlib.contextmanager
def _paused(redis_server) -> Iterator[None]:  # noqa: ANN001
    """redis-server stopped with SIGSTOP: the kernel still accepts connections and takes requests into the
    socket's buffer, but nothing answers until SIGCONT (on exit)."""
    assert redis_server.proc is not None
    pid = redis_server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        stat = Path(f"/proc/{pid}/stat")
        deadline = time.monotonic() + 10
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":  # until the kernel has stopped it
            assert time.monotonic() < deadline, "redis-server did not stop"
            time.sleep(0.001)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def _writer_stuck(store: SessionStore) -> None:
    """Until the writer has sent a batch and waits for its answer (the ops in flight)."""
    await _wait_until(lambda: store._inflight_upto > 0, what="the writer to send a batch")


async def test_round_trip_keys_and_ttls(redis_server, raw) -> None:
    probe = _Probe()
    store = _store(redis_server.url, probe, session_ttl_s=600, transcript_ttl_s=300)
    await store.start()
    rec = _record(slot=3)
    store.register_session(rec)
    for piece in ["Hello", ", ", "world", "!"]:
        store.append_transcript(rec.session_id, piece)
    await _flushed(store)

    sess = await store.get_session(rec.session_id)
    assert sess == {
        "id": rec.session_id,
        "node": "node-a",
        "slot": "3",
        "started_at": repr(rec.started_at_unix_s),
        "persona": "voice=NATF2",
        "prompt": "You sell tea.",
        "prompt_sha256": hashlib.sha256(b"You sell tea.").hexdigest()[:16],
        "prompt_chars": "13",
        "format": "opus",
        "state": "active",
        "recording": "0",
    }
    assert float(sess["started_at"]) == rec.started_at_unix_s
    assert await store.get_transcript(rec.session_id) == "Hello, world!"
    assert await store.active_sessions() == {rec.session_id}

    ending = time.time()
    store.end_session(rec.session_id, "client_closed")
    await _flushed(store)
    sess = await store.get_session(rec.session_id)
    assert sess is not None
    assert sess["state"] == "ended"
    assert sess["end_reason"] == "client_closed"
    assert ending <= float(sess["ended_at"]) <= time.time()  # the wall clock of the end_session call
    assert await store.active_sessions() == set()
    assert await store.get_transcript("nope") == ""
    assert await store.get_session("nope") is None

    hkey = f"duplex:session:{rec.session_id}"
    tkey = f"duplex:transcript:{rec.session_id}"
    assert 0 < await raw.ttl(hkey) <= 600
    assert 0 < await raw.ttl(tkey) <= 300
    assert await raw.ttl("duplex:node:node-a:writer") > 0
    assert await raw.type(tkey) == "string"
    assert await raw.type(hkey) == "hash"
    # The timestamped transcript (runtime/frontend/store/events.py): one JSON line per piece, same TTL.
    lkey = f"duplex:lines:{rec.session_id}"
    lines = [json.loads(line) for line in (await raw.get(lkey)).splitlines()]
    assert [line["text"] for line in lines] == ["Hello", ", ", "world", "!"]
    assert {line["speaker"] for line in lines} == {"agent"}
    assert rec.started_at_unix_s - 1 <= lines[0]["at"] <= lines[-1]["at"] <= ending
    assert 0 < await raw.ttl(lkey) <= 300

    assert probe.errors == Counter()
    assert probe.backlog[-1] == 0 and max(probe.backlog) >= 1
    assert await store.close() == 0


async def test_node_set_ttl_and_custom_prefix(redis_server, raw) -> None:
    store = _store(redis_server.url, _Probe(), key_prefix="t1", session_ttl_s=120)
    await store.start()
    rec = _record()
    store.register_session(rec)
    await _flushed(store)
    assert await raw.smembers("t1:node:node-a:sessions") == {rec.session_id}
    assert 0 < await raw.ttl("t1:node:node-a:sessions") <= 120
    assert await raw.exists(f"duplex:session:{rec.session_id}") == 0
    await store.close()


async def test_order_preserved_across_sessions_and_batches(redis_server) -> None:
    store = _store(redis_server.url, _Probe())
    await store.start()
    recs = [_record(slot=i) for i in range(3)]
    for rec in recs:
        store.register_session(rec)
    expected: dict[str, list[str]] = {rec.session_id: [] for rec in recs}
    for i in range(2500):  # more than one batch (BATCH_MAX_OPS) of interleaved appends
        rec = recs[i % 3]
        piece = f"<{i}>"
        store.append_transcript(rec.session_id, piece)
        expected[rec.session_id].append(piece)
        if i % 400 == 0:
            await asyncio.sleep(0)  # let the writer run between bursts
    store.end_session(recs[1].session_id, "done")
    await _flushed(store)
    for rec in recs:
        assert await store.get_transcript(rec.session_id) == "".join(expected[rec.session_id])
    assert await store.active_sessions() == {recs[0].session_id, recs[2].session_id}
    await store.close()


@pytest.mark.parametrize("save", [False, True], ids=["restart_empty", "restart_with_data"])
async def test_outage_audio_path_keeps_going_then_catches_up(redis_server, save: bool) -> None:
    probe = _Probe()
    store = _store(redis_server.url, probe)
    await store.start()
    a, b = _record(slot=0), _record(slot=1)
    store.register_session(a)
    pieces = [f"a{i} " for i in range(20)]
    for p in pieces:
        store.append_transcript(a.session_id, p)
    await _flushed(store)
    assert await store.get_transcript(a.session_id) == "".join(pieces)

    redis_server.stop(save=save)  # save=False: Redis comes back empty; True: it reloads its data

    # The audio path keeps calling at frame rate; every call returns and never raises (that no call waits
    # for Redis: test_audio_path_calls_return_while_redis_cannot_answer).
    c = _record(slot=2)
    store.register_session(b)
    store.register_session(c)
    more_a: list[str] = []
    more_b: list[str] = []
    more_c: list[str] = []
    for i in range(60):
        for rec, acc, tag in ((a, more_a, "A"), (b, more_b, "B"), (c, more_c, "C")):
            piece = f"{tag}{i} "
            acc.append(piece)
            store.append_transcript(rec.session_id, piece)
        if i == 30:
            store.end_session(c.session_id, "hangup")
        if i > 30:
            more_c.pop()  # appends after end are ignored (counted as unknown_session)
        await asyncio.sleep(0.005)
    await _wait_until(lambda: probe.errors["write"] + probe.errors["resync"] >= 2, what="failures counted")
    assert not store.connected
    assert store.backlog > 0
    assert probe.errors["unknown_session"] == 29

    redis_server.start()  # same port
    await _flushed(store)

    assert await store.get_transcript(a.session_id) == "".join(pieces + more_a)
    assert await store.get_transcript(b.session_id) == "".join(more_b)
    assert await store.get_transcript(c.session_id) == "".join(more_c)
    assert await store.active_sessions() == {a.session_id, b.session_id}
    for rec in (a, b):
        sess = await store.get_session(rec.session_id)
        assert sess is not None and sess["state"] == "active" and sess["slot"] == str(rec.slot)
    sess_c = await store.get_session(c.session_id)
    assert sess_c is not None and sess_c["state"] == "ended" and sess_c["end_reason"] == "hangup"

    # And the connection pool really reconnected: later writes land too.
    store.append_transcript(a.session_id, "tail")
    store.end_session(a.session_id, "done")
    await _flushed(store)
    assert (await store.get_transcript(a.session_id)).endswith("A59 tail")
    assert await store.active_sessions() == {b.session_id}
    assert probe.errors["backlog_overflow"] == 0
    await store.close()


async def test_audio_path_calls_return_while_redis_cannot_answer(redis_server) -> None:
    """The three audio-path calls never wait for Redis, nor for the writer that does: with redis-server
    paused and the writer inside a batch it sent (a socket timeout of an hour: it never gives up), every call
    returns, from the event loop (where a call that waited would block the loop for good) and from another
    thread; the ops wait in order, nothing counts as failed (Redis is silent, not refusing), and all of it
    lands once Redis answers. Logical, not timed: the test's timeout fails a call that waited."""
    probe = _Probe()
    store = _store(redis_server.url, probe, socket_timeout_s=NEVER_S)
    await store.start()
    a, b, c = _record(slot=0), _record(slot=1), _record(slot=2)
    store.register_session(a)
    store.append_transcript(a.session_id, "before ")
    await _flushed(store)

    from_thread = [f"c{i} " for i in range(200)]

    def other_thread() -> None:
        store.register_session(c)
        for piece in from_thread:
            store.append_transcript(c.session_id, piece)

    with _paused(redis_server):
        store.append_transcript(a.session_id, "stuck ")
        await _writer_stuck(store)  # its batch sent to a Redis that cannot answer
        # On the event loop, no await in between: each call must return by itself.
        store.register_session(b)
        for i in range(60):
            store.append_transcript(a.session_id, f"a{i} ")
            store.append_transcript(b.session_id, f"b{i} ")
        store.end_session(b.session_id, "hangup")
        thread = threading.Thread(target=other_thread)
        thread.start()
        await asyncio.to_thread(thread.join)
        # Every op is queued behind the one in flight; the writer still waits; nothing failed.
        assert store.backlog == 1 + 1 + 120 + 1 + 1 + len(from_thread)
        assert store._inflight_upto > 0 and not probe.errors
    await _flushed(store)
    assert await store.get_transcript(a.session_id) == "before stuck " + "".join(f"a{i} " for i in range(60))
    assert await store.get_transcript(b.session_id) == "".join(f"b{i} " for i in range(60))
    assert await store.get_transcript(c.session_id) == "".join(from_thread)
    assert (await store.get_session(b.session_id) or {}).get("end_reason") == "hangup"
    assert await store.active_sessions() == {a.session_id, c.session_id}
    assert not probe.errors
    await store.close()


async def test_data_loss_without_connection_error_is_detected(redis_server, raw) -> None:
    probe = _Probe()
    store = _store(redis_server.url, probe)
    await store.start()
    rec = _record()
    store.register_session(rec)
    store.append_transcript(rec.session_id, "one ")
    await _flushed(store)
    await raw.flushall()  # Redis loses everything while the store's connection stays up
    store.append_transcript(rec.session_id, "two")
    await _flushed(store)
    await _wait_until(lambda: store.backlog == 0 and not store._need_resync, what="resync")
    assert await store.get_transcript(rec.session_id) == "one two"
    assert (await store.get_session(rec.session_id) or {}).get("state") == "active"
    assert await store.active_sessions() == {rec.session_id}
    assert sum(probe.errors.values()) == 0
    await store.close()


async def test_backlog_overflow_drops_oldest_appends_first(redis_server) -> None:
    probe = _Probe()
    store = _store(redis_server.url, probe, max_backlog_ops=10)
    await store.start()
    rec = _record()
    store.register_session(rec)
    store.append_transcript(rec.session_id, "kept-before ")
    await _flushed(store)
    redis_server.stop()

    other = _record(slot=1)
    store.register_session(other)  # never dropped
    pieces = [f"p{i} " for i in range(50)]
    for p in pieces:  # no await in between: the writer cannot take any of them in flight
        store.append_transcript(rec.session_id, p)
    assert store.backlog == 10
    assert probe.errors["backlog_overflow"] == 41  # 51 ops queued, 10 kept (the register + 9 appends)
    assert probe.backlog[-1] == 10

    redis_server.start()
    await _flushed(store)
    assert await store.get_transcript(rec.session_id) == "kept-before " + "".join(pieces[-9:])
    assert await store.active_sessions() == {rec.session_id, other.session_id}
    assert probe.errors["backlog_overflow"] == 41
    await store.close()


@pytest.mark.parametrize("redis_state", ["stopped", "paused"])
async def test_close_with_redis_down_returns_within_timeout(redis_server, redis_state: str) -> None:
    """``close`` gives up on a Redis that is down after its flush grace: it returns, counting the ops left.
    Stopped: connections refused, the writer retrying. Paused: the writer inside a batch that cannot be
    answered, with a socket timeout of an hour, so only ``close``'s own grace can end the wait. Logical, not
    timed: the wait's timeout only stops a close that would hang."""
    probe = _Probe()
    store = _store(redis_server.url, probe, socket_timeout_s=NEVER_S)
    await store.start()
    rec = _record()
    store.register_session(rec)
    await _flushed(store)
    with contextlib.ExitStack() as outage:
        if redis_state == "stopped":
            redis_server.stop()
        else:
            outage.enter_context(_paused(redis_server))
        for i in range(20):
            store.append_transcript(rec.session_id, f"x{i}")
        if redis_state == "paused":
            await _writer_stuck(store)
        left = await asyncio.wait_for(store.close(flush_timeout_s=0.5), 30)
        assert left == 20
    # After close the audio-path calls are still harmless.
    store.append_transcript(rec.session_id, "late")
    store.end_session(rec.session_id, "late")
    assert probe.errors["closed"] == 2


async def test_close_flushes_pending_ops(redis_server, raw) -> None:
    store = _store(redis_server.url, _Probe())
    await store.start()
    rec = _record()
    store.register_session(rec)
    for i in range(100):
        store.append_transcript(rec.session_id, f"{i},")
    store.end_session(rec.session_id, "shutdown")
    assert await store.close(flush_timeout_s=5.0) == 0
    assert await raw.get(f"duplex:transcript:{rec.session_id}") == "".join(f"{i}," for i in range(100))
    assert await raw.hget(f"duplex:session:{rec.session_id}", "state") == "ended"


async def test_redis_down_from_the_start_then_up(redis_server) -> None:
    probe = _Probe()
    redis_server.stop()
    store = _store(redis_server.url, probe)
    rec = _record()
    store.register_session(rec)  # before start(): queued
    await store.start()
    store.append_transcript(rec.session_id, "early")
    await _wait_until(lambda: probe.errors["resync"] >= 1, what="first failure")
    assert not store.connected
    redis_server.start()
    await _flushed(store)
    assert await store.get_transcript(rec.session_id) == "early"
    assert await store.active_sessions() == {rec.session_id}
    await store.close()


async def test_misuse_never_raises(redis_server) -> None:
    probe = _Probe()

    def bad_callback(_: object) -> None:
        raise RuntimeError("callback bug")

    store = SessionStore(redis_server.url, "node-a", on_error=bad_callback, on_backlog=bad_callback)
    await store.start()
    store.append_transcript("unknown", "x")
    store.end_session("unknown", "x")
    store.append_transcript("unknown", "")
    store.register_session(None)  # type: ignore[arg-type]
    rec = _record()
    store.register_session(rec)
    store.append_transcript(rec.session_id, 42)  # type: ignore[arg-type]
    await _flushed(store)
    assert await store.get_transcript(rec.session_id) == "42"
    await store.close()

    with pytest.raises(ValueError):
        SessionStore(redis_server.url, "n", session_ttl_s=0)
    with pytest.raises(ValueError):
        SessionStore(redis_server.url, "n", max_backlog_ops=0)
    with pytest.raises(RuntimeError):
        await store.start()
    del probe


async def test_redis_server_fixture_restarts_on_same_port(redis_server) -> None:
    async def get_k() -> bytes | str | None:
        client = redis.Redis.from_url(redis_server.url)
        try:
            await client.set("probe", "1")
            return await client.get("k")
        finally:
            await client.aclose()

    port = redis_server.port
    client = redis.Redis.from_url(redis_server.url)
    await client.set("k", "v")
    await client.aclose()
    redis_server.stop(save=True)
    assert not redis_server.running
    redis_server.start()
    assert redis_server.port == port and redis_server.url.endswith(f":{port}/0")
    assert await get_k() == b"v"
    redis_server.stop()
    redis_server.start()
    assert await get_k() is None


async def test_batch_applied_but_reply_lost_is_not_duplicated(redis_server) -> None:
    """EXEC runs on the server, then the connection drops before the reply: no APPEND twice."""
    probe = _Probe()
    store = _store(redis_server.url, probe)
    await store.start()
    rec = _record()
    store.register_session(rec)
    store.append_transcript(rec.session_id, "a")
    await _flushed(store)

    real_pipeline = store._redis.pipeline
    lost: list[object] = []

    def pipeline_losing_one_reply(*args, **kwargs):
        pipe = real_pipeline(*args, **kwargs)
        real_execute = pipe.execute

        async def execute(*a, **k):
            result = await real_execute(*a, **k)
            if not lost:
                lost.append(result)
                raise redis.ConnectionError("reply lost (simulated)")
            return result

        pipe.execute = execute  # type: ignore[method-assign]
        return pipe

    store._redis.pipeline = pipeline_losing_one_reply  # type: ignore[method-assign]
    store.append_transcript(rec.session_id, "b")
    store.append_transcript(rec.session_id, "c")
    await _wait_until(lambda: bool(lost) and store.connected and store.backlog == 0, what="recovery")
    assert probe.errors["write"] == 1
    assert await store.get_transcript(rec.session_id) == "abc"
    await store.close()


async def test_calls_from_another_thread(redis_server) -> None:
    store = _store(redis_server.url, _Probe())
    await store.start()
    rec = _record()
    store.register_session(rec)

    def producer() -> None:
        for i in range(2000):
            store.append_transcript(rec.session_id, f"{i};")

    await asyncio.gather(asyncio.to_thread(producer), asyncio.sleep(0.05))
    await _flushed(store)
    assert await store.get_transcript(rec.session_id) == "".join(f"{i};" for i in range(2000))
    await store.close()


async def test_writers_of_one_node_keep_each_others_sessions(redis_server, raw) -> None:
    """Two workers of one node (a store each, ``--workers 2``) write the same node set: each keeps its own
    writer token, so neither takes the other's writes for a Redis data loss, and neither's resync drops
    the other's sessions from the node set.

    Planted bugs it catches: one writer key per node (every write of one worker then sees the other's
    token and resyncs everything, and each resync deleted the node set, so the other worker's live
    sessions vanished from it until that worker wrote again); a resync that deletes the shared set."""
    first = _store(redis_server.url, _Probe(), writer_id="w0")
    second = _store(redis_server.url, _Probe(), writer_id="w1")
    resyncs = {"w0": 0, "w1": 0}
    for store in (first, second):
        resync = store._resync

        async def counted(store: SessionStore = store, resync=resync) -> None:  # noqa: ANN001
            resyncs[store.writer_id] += 1
            await resync()

        store._resync = counted  # type: ignore[method-assign]
    await first.start()
    one = _record()
    first.register_session(one)
    await _flushed(first)
    await second.start()
    two = _record(slot=1)
    second.register_session(two)
    await _flushed(second)
    for piece in ("a ", "b ", "c"):
        first.append_transcript(one.session_id, piece)
        await _flushed(first)
        second.append_transcript(two.session_id, piece)
        await _flushed(second)
    assert await raw.smembers("duplex:node:node-a:sessions") == {one.session_id, two.session_id}
    assert resyncs == {"w0": 1, "w1": 1}  # each writer's first write only
    assert await first.get_transcript(one.session_id) == "a b c"
    second.end_session(two.session_id, "client_closed")
    await _flushed(second)
    assert await raw.smembers("duplex:node:node-a:sessions") == {one.session_id}
    await first.close()
    await second.close()
