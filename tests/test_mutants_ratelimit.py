"""Tests that kill mutants of runtime/frontend/gate/ratelimit.py that tests/test_ratelimit.py let survive
(``make mutation MODULE=runtime/frontend/gate/ratelimit.py``; docs/mutation.md). Each docstring names its
mutant."""

from __future__ import annotations

import pytest

from runtime.frontend.gate.ratelimit import HandshakeLimiter, TokenBucket


def test_a_bucket_is_full_again_after_burst_over_rate_seconds():
    """Kills ``full_at``: ``(now - at) * rate`` -> ``/ rate`` (an emptied bucket of rate 2 and burst 2 is
    full after 1 s, not after 4 s)."""
    bucket = TokenBucket(rate=2.0, burst=2, now=0.0)
    assert bucket.take(0.0) == 0.0 and bucket.take(0.0) == 0.0
    assert not bucket.full_at(0.5)
    assert bucket.full_at(1.0)


def test_the_default_client_table_holds_65536_clients():
    """Kills ``__init__``: the default ``max_clients=65_536`` -> ``65537``."""
    limiter = HandshakeLimiter(per_client_rate=1.0, per_client_burst=1, global_rate=0, global_burst=1)
    assert limiter.max_clients == 65_536


def test_a_global_rate_below_one_per_second_still_limits():
    """Kills ``__init__``: ``global_rate > 0`` -> ``> 1`` (a global limit of one handshake per 2 s would be
    switched off)."""
    now = [0.0]
    limiter = HandshakeLimiter(
        per_client_rate=0, per_client_burst=1, global_rate=0.5, global_burst=1, clock=lambda: now[0]
    )
    assert limiter.check("a") is None
    refused = limiter.check("b")
    assert refused is not None and refused.scope == "global"


def test_a_global_refusal_says_when_to_retry():
    """Kills ``check``: ``RateLimited("global", wait)`` -> ``RateLimited("global", None)``."""
    now = [0.0]
    limiter = HandshakeLimiter(
        per_client_rate=0, per_client_burst=1, global_rate=0.25, global_burst=1, clock=lambda: now[0]
    )
    assert limiter.check("a") is None
    refused = limiter.check("a")
    assert refused is not None
    assert refused.retry_after_s == pytest.approx(4.0)
    assert refused.retry_after_header == "4"
