"""Tests that kill mutants of runtime/frontend/gate/replay.py that tests/test_tokens.py let survive
(``make mutation MODULE=runtime/frontend/gate/replay.py``; docs/mutation.md). Each docstring names its
mutants."""

from __future__ import annotations

import socket
import time

import pytest

from runtime.frontend.gate.replay import MemoryReplayGuard, RedisReplayGuard
from runtime.frontend.gate.tokens import TokenClaims, TokenRejected


def claims(token_id: str, expires_at: float = 60.0) -> TokenClaims:
    return TokenClaims(
        token_id=token_id,
        kid="k1",
        audience="aud",
        personas=("*",),
        issued_at=0.0,
        not_before=0.0,
        expires_at=expires_at,
    )


def unused_redis_url() -> str:
    """A Redis URL on a loopback port nothing listens on: every call fails at once (ConnectionError)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def test_memory_guard_default_leeway_is_five_seconds():
    """Kills ``MemoryReplayGuard.__init__``: the default ``leeway_s=5.0`` -> ``6.0``."""
    assert MemoryReplayGuard().leeway_s == 5.0


def test_memory_guard_prunes_expired_ids_once_it_holds_more_than_1024():
    """Kills ``remember``: ``len > 1024`` -> ``>= 1024`` and ``> 1025`` (prunes one id early or late),
    ``self._seen = None`` (the prune never ran in the other tests) and the prune's ``until > now`` ->
    ``>= now`` (an id kept until exactly now is dropped)."""
    now = [0.0]
    guard = MemoryReplayGuard(leeway_s=5, clock=lambda: now[0])
    for i in range(1024):
        assert guard.remember(claims(f"old-{i}", expires_at=60.0))  # kept until 65
    now[0] = 65.0
    assert guard.remember(claims("a", expires_at=1000.0))
    assert len(guard) == 1025  # 1024 held: no prune yet
    assert guard.remember(claims("b", expires_at=1000.0))
    assert len(guard) == 2  # 1025 held: the ids kept until 65 are gone at 65


async def test_memory_guard_forgets_an_id_exactly_at_expiry_plus_leeway():
    """Kills ``remember``: ``until > now`` -> ``until >= now``, and ``was_used``: the same (at exactly
    ``exp + leeway`` no verifier accepts the token any more, so the id is free)."""
    now = [0.0]
    guard = MemoryReplayGuard(leeway_s=5, clock=lambda: now[0])
    token = claims("edge", expires_at=60.0)
    await guard.spend(token)
    now[0] = 65.0
    assert not guard.was_used(token)
    await guard.spend(token)


async def test_memory_guard_replay_refusal_names_the_token():
    """Kills ``MemoryReplayGuard.spend``: the detail ``replayed_message(token_id)`` -> ``None`` and
    ``replayed_message(None)``."""
    guard = MemoryReplayGuard()
    token = claims("twice", expires_at=time.time() + 60)
    await guard.spend(token)
    with pytest.raises(TokenRejected) as info:
        await guard.spend(token)
    assert info.value.detail == "token twice was already used; tokens are single-use"


def test_redis_guard_defaults_and_fail_fast_connection():
    """Kills ``RedisReplayGuard.__init__``: the defaults ``leeway_s=5.0`` -> ``6.0`` and ``timeout_s=0.5`` ->
    ``1.5``, ``self.timeout_s = None``, ``socket_timeout``/``socket_connect_timeout`` -> ``None`` or left out,
    ``Retry(NoBackoff(), 0)`` -> ``None``, left out or ``1`` retry, and ``health_check_interval=0`` -> ``1``:
    a handshake waits on Redis at most ``timeout_s`` per call, once."""
    guard = RedisReplayGuard(unused_redis_url())
    assert guard.leeway_s == 5.0 and guard.timeout_s == 0.5
    kwargs = guard._redis.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 0.5 and kwargs["socket_connect_timeout"] == 0.5
    assert kwargs["retry"]._retries == 0
    assert not kwargs.get("health_check_interval")  # 0, None or absent: no PING before a command


async def test_redis_guard_keeps_a_nearly_expired_id_one_second(redis_server):
    """Kills ``RedisReplayGuard.spend``: ``max(1, ceil(...))`` -> ``max(2, ...)`` (the key of a token already
    past ``exp + leeway`` lives the shortest TTL Redis takes, 1 s)."""
    guard = RedisReplayGuard(redis_server.url, leeway_s=0)
    try:
        token = claims("late", expires_at=time.time() - 10)
        await guard.spend(token)
        ttl_ms = await guard._redis.pttl(guard.key("late"))
        assert 0 < ttl_ms <= 1000
    finally:
        await guard.close()


async def test_redis_guard_replay_refusal_names_the_token_and_records_it_in_the_fallback(redis_server):
    """Kills ``RedisReplayGuard.spend``: the detail -> ``None`` and ``replayed_message(None)``, and
    ``self.fallback.remember(claims)`` -> ``remember(None)`` (an id admitted through Redis is recorded in the
    fallback's memory too)."""
    fallback = MemoryReplayGuard()
    guard = RedisReplayGuard(redis_server.url, fallback=fallback)
    try:
        token = claims("r-twice", expires_at=time.time() + 60)
        await guard.spend(token)
        assert fallback.was_used(token)
        with pytest.raises(TokenRejected) as info:
            await guard.spend(token)
        assert info.value.detail == "token r-twice was already used; tokens are single-use"
    finally:
        await guard.close()


async def test_redis_down_without_fallback_names_the_error():
    """Kills ``spend`` and ``seen``: ``self._redis_failed(exc)`` -> ``(None)``, and ``_redis_failed``: the
    detail -> ``None``, ``type(None).__name__`` and the changed "retry in a moment" text."""
    errors: list[int] = []
    guard = RedisReplayGuard(unused_redis_url(), on_error=lambda: errors.append(1))
    try:
        token = claims("down", expires_at=time.time() + 60)
        for call in (guard.spend, guard.seen):
            with pytest.raises(TokenRejected) as info:
                await call(token)
            assert info.value.reason == "replay_check_unavailable"
            assert info.value.detail == (
                "cannot check the token against those already used (Redis: ConnectionError); "
                "retry in a moment"
            )
        assert errors == [1, 1]
    finally:
        await guard.close()


async def test_redis_down_with_fallback_spends_in_memory():
    """Kills ``RedisReplayGuard.spend``: ``assert self.fallback is not None`` -> ``is None`` and
    ``self.fallback.spend(claims)`` -> ``spend(None)`` (Redis down: the fallback admits once, then
    refuses)."""
    fallback = MemoryReplayGuard()
    guard = RedisReplayGuard(unused_redis_url(), fallback=fallback)
    try:
        token = claims("fallback", expires_at=time.time() + 60)
        await guard.spend(token)
        assert fallback.was_used(token)
        with pytest.raises(TokenRejected, match="^replayed"):
            await guard.spend(token)
    finally:
        await guard.close()
