"""The node's Redis users (issue 34, item 8: one Redis password did everything, and the docs handed that URL
to event consumers), against a redis-server started from the rendered configuration and secrets:

- the default user is off: no client logs in without a user name, not even with the admin's password;
- ``runtime`` (``secrets/runtime.env``) does what the runtime does (a real ``SessionStore``,
  ``RedisSessionReader`` with its erase and AOF rewrite, and ``RedisReplayGuard``) and is refused ``CONFIG``,
  ``FLUSHALL``, ``ACL``, ``KEYS``, ``DEBUG`` and keys outside ``duplex:*``;
- ``events`` (``secrets/events-consumer.env``) runs the documented consumer (docs/examples/events_consumer.py)
  and is refused a session's record, a spent-token marker, ``DEL`` and ``XADD``;
- ``exporter`` (``secrets/redis-exporter.env``) reads ``INFO`` and ``CONFIG GET`` and no key;
- the store asks for an AOF rewrite every ``aof_rewrite_every_s`` on its clock, and not before (Redis's
  ``INFO persistence`` ``aof_rewrites`` counts them).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from rendered_redis import RenderedRedis, start_rendered_redis

from infra.node.bundle.redis_acl import role_password
from runtime.frontend.gate.replay import RedisReplayGuard
from runtime.frontend.gate.tokens import TokenClaims, TokenRejected
from runtime.frontend.store.records import RedisSessionReader
from runtime.frontend.store.redis_store import SessionRecord, SessionStore

pytestmark = pytest.mark.timeout(120)

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "events_consumer.py"


@pytest.fixture
def node_redis(tmp_path: Path) -> Iterator[RenderedRedis]:
    server = start_rendered_redis(tmp_path)
    yield server
    server.stop()


def _runtime_url(server: RenderedRedis) -> str:
    return server.env_value("secrets/runtime.env", "DUPLEX_REDIS_URL")


def _events_url(server: RenderedRedis) -> str:
    return server.env_value("secrets/events-consumer.env", "DUPLEX_EVENTS_REDIS_URL")


def _refused(client: redis.Redis, *command: str) -> str:
    """The error Redis answers ``command`` with (fails the test when it is carried out)."""
    with pytest.raises(redis.ResponseError) as refused:
        client.execute_command(*command)
    return str(refused.value)


def _claims(jti: str) -> TokenClaims:
    now = time.time()
    return TokenClaims(jti, "k1", "duplex", ("*",), now, now, now + 300)


async def _wait_flushed(store: SessionStore) -> None:
    deadline = time.monotonic() + 20
    while not (store.connected and store.backlog == 0):
        assert time.monotonic() < deadline, "the store never flushed its ops"
        await asyncio.sleep(0.02)


def test_the_default_user_is_off(node_redis: RenderedRedis) -> None:
    password = node_redis.secrets.redis_password
    for kw in ({}, {"password": password}, {"password": "wrong-password-0000"}):
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=node_redis.port, socket_timeout=2, **kw).ping()  # type: ignore[arg-type]
    assert _runtime_url(node_redis).startswith("redis://runtime:")
    assert password not in _runtime_url(node_redis) + _events_url(node_redis)
    acl = {line.split()[1]: line for line in node_redis.admin().acl_list()}
    assert set(acl) == {"default", "admin", "runtime", "events", "exporter"}
    assert " off " in acl["default"]


def test_the_runtime_user_runs_the_store_the_api_and_the_replay_guard(node_redis: RenderedRedis) -> None:
    url = _runtime_url(node_redis)
    record = SessionRecord(uuid.uuid4().hex, "node-a", 0, time.time(), "voice=NATF2", "opus")

    async def scenario() -> None:
        store = SessionStore(url, "node-a", retry_initial_s=0.05, retry_max_s=0.2)
        reader = RedisSessionReader(url, aof_rewrite_every_s=0.0)
        guard = RedisReplayGuard(url, timeout_s=5.0)
        try:
            await store.start()
            store.register_session(record)
            store.append_transcript(record.session_id, "hello from the runtime user")
            store.end_session(record.session_id, "client_closed")
            await _wait_flushed(store)
            assert await store.trim_events() == 0  # XTRIM MINID
            listed = await reader.list(state="ended")
            assert [s["id"] for s in listed] == [record.session_id]
            read = await reader.read(record.session_id)
            assert read is not None and read["transcript"]["text"] == "hello from the runtime user"
            await guard.spend(_claims("jti-1"))
            with pytest.raises(TokenRejected) as replayed:
                await guard.spend(_claims("jti-1"))
            assert replayed.value.reason == "replayed"
            assert await reader.erase(record.session_id)  # DEL, ZREM, XDEL, then BGREWRITEAOF
            assert reader.rewrites_asked == 1
            assert await reader.read(record.session_id) is None
        finally:
            await store.close()
            await reader.close()
            await guard.close()

    asyncio.run(scenario())
    runtime = redis.Redis.from_url(url, socket_timeout=5)
    assert "no permissions" in _refused(runtime, "CONFIG", "SET", "maxmemory", "0")
    assert "no permissions" in _refused(runtime, "CONFIG", "GET", "*")
    assert "no permissions" in _refused(runtime, "FLUSHALL")
    assert "no permissions" in _refused(runtime, "FLUSHDB")
    assert "no permissions" in _refused(runtime, "ACL", "LIST")
    assert "no permissions" in _refused(runtime, "ACL", "SETUSER", "runtime", "+@all")
    assert "no permissions" in _refused(runtime, "KEYS", "*")
    assert "no permissions" in _refused(runtime, "FUNCTION", "FLUSH")
    assert "no permissions" in _refused(runtime, "CLIENT", "KILL", "TYPE", "normal")
    _refused(runtime, "DEBUG", "SLEEP", "0")  # renamed away, and @dangerous
    assert "no permissions to access one of the keys" in _refused(runtime, "SET", "other:key", "x")
    assert node_redis.admin().dbsize() > 0, "FLUSHALL must not have run"


def test_the_events_user_consumes_the_stream_and_nothing_else(node_redis: RenderedRedis) -> None:
    runtime = redis.Redis.from_url(_runtime_url(node_redis), decode_responses=True)
    for i in range(3):
        runtime.xadd("duplex:events", {"v": "2", "kind": "text", "event": f"e{i}", "session": "s1"})
    runtime.hset("duplex:session:s1", mapping={"id": "s1", "state": "ended"})
    runtime.set("duplex:token:jti-2", "k1", ex=300)
    url = _events_url(node_redis)
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), url, "--group", "app", "--consumer", "a", "--max-events", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert [line.count('"event"') for line in done.stdout.splitlines()] == [1, 1, 1]
    admin = node_redis.admin()
    assert admin.xpending("duplex:events", "app")["pending"] == 0  # XREADGROUP then XACK, as "events"

    events = redis.Redis.from_url(url, decode_responses=True)
    assert events.xlen("duplex:events") == 3
    assert len(events.xrange("duplex:events")) == 3
    assert events.xinfo_stream("duplex:events")["length"] == 3
    assert "no permissions" in _refused(events, "HGETALL", "duplex:session:s1")
    assert "no permissions" in _refused(events, "GET", "duplex:token:jti-2")
    assert "access one of the keys" in _refused(events, "XRANGE", "duplex:events:s1", "-", "+")
    # Pre-spending a token (its replay marker, as RedisReplayGuard writes it) is refused.
    assert "no permissions" in _refused(events, "SET", "duplex:token:jti-3", "k1", "NX", "EX", "300")
    assert "no permissions" in _refused(events, "DEL", "duplex:events")
    assert "no permissions" in _refused(events, "XADD", "duplex:events", "*", "kind", "forged")
    assert "no permissions" in _refused(events, "XDEL", "duplex:events", "0-1")
    assert "no permissions" in _refused(events, "XGROUP", "DESTROY", "duplex:events", "app")
    assert admin.xlen("duplex:events") == 3 and admin.exists("duplex:token:jti-3") == 0


def test_the_exporter_user_reads_metrics_and_no_key(node_redis: RenderedRedis) -> None:
    password = node_redis.env_value("secrets/redis-exporter.env", "REDIS_PASSWORD")
    assert node_redis.env_value("secrets/redis-exporter.env", "REDIS_USER") == "exporter"
    assert password == role_password(node_redis.secrets.redis_password, "exporter")
    exporter = redis.Redis(
        port=node_redis.port, username="exporter", password=password, decode_responses=True
    )
    assert exporter.info("memory")["maxmemory"] == 64 * 1024 * 1024
    assert exporter.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    assert exporter.client_list()
    assert exporter.slowlog_len() >= 0
    assert "no permissions" in _refused(exporter, "CONFIG", "SET", "maxmemory", "0")
    assert "no permissions" in _refused(exporter, "CLIENT", "KILL", "TYPE", "normal")
    assert "no permissions" in _refused(exporter, "GET", "duplex:token:x")


def test_the_store_rewrites_the_aof_once_a_period_on_its_clock(node_redis: RenderedRedis) -> None:
    """Persistence that forgets: keys expired by the retention stay in the AOF until it is rewritten, which
    a quiet node may never do; the store asks every ``aof_rewrite_every_s`` (as the runtime user)."""
    admin = node_redis.admin()
    now = {"t": 1_000_000.0}

    def rewrites() -> int:
        return int(admin.info("persistence")["aof_rewrites"])

    async def settled() -> None:
        deadline = time.monotonic() + 20
        while admin.info("persistence")["aof_rewrite_in_progress"]:
            assert time.monotonic() < deadline, "the AOF rewrite never finished"
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        store = SessionStore(
            _runtime_url(node_redis), "node-a", clock=lambda: now["t"], aof_rewrite_every_s=86400
        )
        try:
            before = rewrites()
            assert not await store.rewrite_aof_if_due()  # the first call starts the period
            now["t"] += 86399.0
            assert not await store.rewrite_aof_if_due()  # not before
            assert rewrites() == before
            now["t"] += 1.0
            assert await store.rewrite_aof_if_due()  # due: asked, and Redis did it
            await settled()
            assert rewrites() == before + 1
            now["t"] += 3600.0
            assert not await store.rewrite_aof_if_due()
            now["t"] += 86400.0 - 3600.0
            await store.start()  # the writer task itself asks when due
            deadline = time.monotonic() + 20
            while store.aof_rewrite.asked < 2:
                assert time.monotonic() < deadline, "the writer did not ask for the due rewrite"
                await asyncio.sleep(0.02)
            await settled()
            assert rewrites() == before + 2
        finally:
            await store.close()

    asyncio.run(scenario())


async def test_a_refused_rewrite_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    class Refusing:
        async def bgrewriteaof(self) -> None:
            raise aioredis.ResponseError("Background append only file rewriting already in progress")

    now = {"t": 0.0}
    store = SessionStore("redis://127.0.0.1:1/0", "node-a", clock=lambda: now["t"], aof_rewrite_every_s=10)
    assert not await store.aof_rewrite.run_if_due(Refusing())
    now["t"] = 10.0
    with caplog.at_level("INFO"):
        assert not await store.aof_rewrite.run_if_due(Refusing())
    assert "refused the periodic AOF rewrite" in caplog.text
    assert [r.levelname for r in caplog.records if "AOF" in r.getMessage()] == ["INFO"]
    with pytest.raises(ValueError, match="aof_rewrite_every_s must be >= 0"):
        SessionStore("redis://127.0.0.1:1/0", "node-a", aof_rewrite_every_s=-1)
