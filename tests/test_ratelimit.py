"""The handshake rate limiter's arithmetic (runtime/frontend/ratelimit.py), on an injected clock."""

from __future__ import annotations

import pytest

from runtime.frontend.ratelimit import HandshakeLimiter, TokenBucket


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
