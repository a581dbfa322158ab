"""Handshake rate limits: token buckets per client and for the whole process, checked before any work.

A WebSocket upgrade on ``/api/chat`` costs a token verification (HMAC), maybe a Redis round trip and a
persona lookup; a flood of them shares the process with the front end's codecs (issue 16: 570
unauthenticated upgrades per second gave a streaming session 0.6 s audio gaps). The runtime therefore
refuses the excess itself, with a 429 and ``Retry-After``, before any of that work: nginx's own limits do
not exist on the multi-region stack, where the load balancer sends callers straight to the pods.

Token bucket: ``rate`` tokens per second refill a bucket of ``burst`` tokens; each handshake takes one.
The clock is injected (``clock``), so tests need no sleeps.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["HandshakeLimiter", "RateLimited", "TokenBucket"]


class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second.

    Args:
        rate: tokens per second (> 0).
        burst: bucket size (>= 1); a full bucket admits ``burst`` calls at once.
        now: the clock's reading at creation (s).
    Raises:
        ValueError: rate <= 0 or burst < 1.
    """

    __slots__ = ("burst", "rate", "_tokens", "_at")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"a token bucket needs rate > 0 and burst >= 1, got rate={rate} burst={burst}")
        self.rate = float(rate)
        self.burst = float(burst)
        self._tokens = float(burst)
        self._at = now

    def take(self, now: float) -> float:
        """Take one token: 0.0 when granted, else the seconds until one is available (nothing taken)."""
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate

    def full_at(self, now: float) -> bool:
        """Whether the bucket would be full at ``now`` (an idle client's bucket can be forgotten)."""
        return self._tokens + (now - self._at) * self.rate >= self.burst


@dataclass(frozen=True)
class RateLimited:
    """A refused handshake: ``scope`` is ``client`` or ``global``; ``retry_after_s`` rounds up to whole s
    for the ``Retry-After`` header (RFC 9110, 10.2.3)."""

    scope: str
    retry_after_s: float

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


class HandshakeLimiter:
    """Per-client and global token buckets for handshakes.

    Args:
        per_client_rate, per_client_burst: each client's bucket (handshakes/s, bucket size); a rate of 0
            switches the per-client limit off.
        global_rate, global_burst: the whole process's bucket; a rate of 0 switches it off.
        max_clients: clients remembered at once; past it the idle ones (full buckets) and then the oldest
            are forgotten, so a scan of many addresses cannot grow the table without bound.
        clock: monotonic seconds (injected in tests).
    """

    def __init__(
        self,
        *,
        per_client_rate: float,
        per_client_burst: float,
        global_rate: float,
        global_burst: float,
        max_clients: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self.per_client_rate = per_client_rate
        self.per_client_burst = per_client_burst
        self.max_clients = max_clients
        self._global = TokenBucket(global_rate, global_burst, clock()) if global_rate > 0 else None
        self._clients: OrderedDict[str, TokenBucket] = OrderedDict()

    def check(self, client: str) -> RateLimited | None:
        """Count one handshake from ``client`` (an address); None when allowed, else why not.

        The client's own bucket is checked first, so one noisy client does not spend the global budget.
        """
        now = self._clock()
        if self.per_client_rate > 0:
            bucket = self._clients.get(client)
            if bucket is None:
                if len(self._clients) >= self.max_clients:
                    self._forget_idle(now)
                bucket = TokenBucket(self.per_client_rate, self.per_client_burst, now)
                self._clients[client] = bucket
            else:
                self._clients.move_to_end(client)
            wait = bucket.take(now)
            if wait:
                return RateLimited("client", wait)
        if self._global is not None:
            wait = self._global.take(now)
            if wait:
                return RateLimited("global", wait)
        return None

    def _forget_idle(self, now: float) -> None:
        for key in [k for k, b in self._clients.items() if b.full_at(now)]:
            del self._clients[key]
        while len(self._clients) >= self.max_clients:
            self._clients.popitem(last=False)

    def __len__(self) -> int:
        """Clients remembered now."""
        return len(self._clients)
