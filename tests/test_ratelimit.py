"""The handshake rate limiter's arithmetic (runtime/frontend/gate/ratelimit.py), on an injected clock."""

from __future__ import annotations

import pytest

from runtime.frontend.gate.ratelimit import HandshakeLimiter, TokenBucket


def test_token_bucket_refills_at_its_rate():
    bucket = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.5)
    assert bucket.take(0.5) == 0.0
    assert bucket.take(0.5) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="rate > 0"):
        TokenBucket(rate=0, burst=1, now=0.0)


def test_handshake_limiter_limits_each_client_then_the_whole_node():
    now = [0.0]
    limiter = HandshakeLimiter(
        per_client_rate=1.0, per_client_burst=2, global_rate=10.0, global_burst=3, clock=lambda: now[0]
    )
    assert limiter.check("a") is None and limiter.check("a") is None
    refused = limiter.check("a")
    assert refused is not None and refused.scope == "client" and refused.retry_after_header == "1"
    assert limiter.check("b") is None  # another client: its own bucket; the global bucket had 3
    refused = limiter.check("c")
    assert refused is not None and refused.scope == "global"
    now[0] = 1.0
    assert limiter.check("a") is None
    off = HandshakeLimiter(per_client_rate=0, per_client_burst=1, global_rate=0, global_burst=1)
    assert all(off.check("a") is None for _ in range(1000))


def test_handshake_limiter_forgets_idle_clients_past_its_size():
    now = [0.0]
    limiter = HandshakeLimiter(
        per_client_rate=1.0,
        per_client_burst=1,
        global_rate=0,
        global_burst=1,
        max_clients=4,
        clock=lambda: now[0],
    )
    for i in range(4):
        limiter.check(f"10.0.0.{i}")
    now[0] = 10.0
    limiter.check("10.0.0.99")
    assert len(limiter) == 1


def _limiter(now: list[float], *, burst: float, max_clients: int) -> HandshakeLimiter:
    """Per-client buckets of 1 handshake/s and ``burst``, no global bucket, ``max_clients``, clock ``now``."""
    return HandshakeLimiter(
        per_client_rate=1.0,
        per_client_burst=burst,
        global_rate=0,
        global_burst=1,
        max_clients=max_clients,
        clock=lambda: now[0],
    )


def test_eviction_keeps_a_throttled_client_throttled_and_forgets_the_idle_ones():
    """A full table forgets the idle clients (full buckets) for a newcomer, and only them: a client that
    emptied its bucket is refused again right after the eviction, not handed a fresh bucket.

    Planted bug: ``_forget_idle`` forgetting non-full buckets too (a scan of new addresses would reset
    every throttled client's bucket) — fails on it: the throttled client's next handshake is allowed."""
    now = [0.0]
    limiter = _limiter(now, burst=2, max_clients=4)
    for i in range(3):
        assert limiter.check(f"idle-{i}") is None  # 1 of 2 tokens left: full again at t=1
    now[0] = 0.9
    assert limiter.check("flood") is None and limiter.check("flood") is None
    assert limiter.check("flood") is not None  # throttled: 0 tokens at t=0.9, 0.1 at t=1
    assert len(limiter) == 4
    now[0] = 1.0
    assert limiter.check("newcomer") is None  # the table is full: eviction runs
    refused = limiter.check("flood")
    assert refused is not None and refused.scope == "client", "the throttled client got a fresh bucket"
    assert refused.retry_after_s == pytest.approx(0.9)
    assert len(limiter) == 2  # the three idle clients went; the throttled one and the newcomer stayed


def test_eviction_forgets_idle_clients_first_then_the_least_recently_seen():
    """The docstring's order: past ``max_clients`` the idle clients (full buckets) go first, and only when
    none is idle the client seen longest ago; a client seen since keeps its place.

    Planted bug: evicting the oldest client before (or instead of) the idle ones — fails on it: "early",
    older than the idle client but with a half-spent bucket, comes back with a fresh bucket."""
    now = [0.0]
    limiter = _limiter(now, burst=10, max_clients=3)
    for _ in range(10):
        assert limiter.check("early") is None  # empty at t=0: 1.5 tokens at t=1.5, not full
    now[0] = 0.5
    assert limiter.check("idle") is None  # 9 tokens at t=0.5: full (10) at t=1.5
    for _ in range(10):
        assert limiter.check("late") is None  # empty at t=0.5: 1 token at t=1.5
    now[0] = 1.5
    assert limiter.check("new-1") is None  # full table: the idle client goes, "early" (oldest) stays
    assert limiter.check("early") is None  # its 1.5 tokens: one handshake, then refused
    assert limiter.check("early") is not None, "the oldest client was evicted before the idle one"
    assert len(limiter) == 3
    # Least recently seen first now: "late", "new-1", "early". None is idle: the next newcomer evicts "late".
    assert limiter.check("new-2") is None
    assert len(limiter) == 3
    assert limiter.check("early") is not None  # seen since: kept, still throttled
    assert all(limiter.check("late") is None for _ in range(10))  # forgotten: a fresh, full bucket
