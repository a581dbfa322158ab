"""Replay guards: each session token (its ``jti``) admits one conversation, never a second.

:class:`RedisReplayGuard` shares the ids already used between every runtime on one Redis and across restarts;
:class:`MemoryReplayGuard` keeps them in this process (alone, or as the fallback while Redis does not answer).
The tokens themselves: :mod:`runtime.frontend.gate.tokens`. Operating them: docs/protocol.md, "Access
control".
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

from runtime.engine.api import replayed_message
from runtime.frontend.gate.tokens import TokenClaims, TokenRejected

__all__ = ["MemoryReplayGuard", "RedisReplayGuard", "ReplayGuard"]


class ReplayGuard(Protocol):
    """Remembers the ids of tokens already used; ``spend`` admits each id once."""

    async def spend(self, claims: TokenClaims) -> None:
        """Record ``claims.token_id`` as used.

        Raises:
            TokenRejected: ``replayed`` (seen before), or ``replay_check_unavailable``.
        """
        ...

    async def seen(self, claims: TokenClaims) -> bool:
        """Whether ``claims.token_id`` was already spent, without spending it (the admission preflight).

        Raises:
            TokenRejected: ``replay_check_unavailable`` when the check cannot be made now.
        """
        ...

    async def close(self) -> None: ...


class MemoryReplayGuard:
    """Seen token ids in this process's memory, each kept until its token expires (plus the leeway).

    Lost when the process restarts and not shared between processes: a token used before a restart can be
    used once more after it. Use it alone only without Redis (``DUPLEX_TOKEN_REPLAY_CHECK=memory``).
    """

    def __init__(self, leeway_s: float = 5.0, *, clock: Callable[[], float] = time.time) -> None:
        self.leeway_s = leeway_s
        self._clock = clock
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def remember(self, claims: TokenClaims) -> bool:
        """Record the id; False if it was already there (and has not expired)."""
        now = self._clock()
        with self._lock:
            if len(self._seen) > 1024:
                self._seen = {jti: until for jti, until in self._seen.items() if until > now}
            until = self._seen.get(claims.token_id)
            if until is not None and until > now:
                return False
            self._seen[claims.token_id] = claims.expires_at + self.leeway_s
            return True

    def was_used(self, claims: TokenClaims) -> bool:
        """The id is recorded (and its token has not expired); records nothing."""
        with self._lock:
            until = self._seen.get(claims.token_id)
        return until is not None and until > self._clock()

    async def spend(self, claims: TokenClaims) -> None:
        if not self.remember(claims):
            raise TokenRejected("replayed", replayed_message(claims.token_id))

    async def seen(self, claims: TokenClaims) -> bool:
        return self.was_used(claims)

    async def close(self) -> None:
        return None


class RedisReplayGuard:
    """Seen token ids in Redis: ``SET duplex:token:<jti> NX`` expiring when the token does (plus the
    leeway), so a replay is refused across runtime restarts, and by every runtime sharing the Redis.

    Args:
        url: Redis URL (the node's ``DUPLEX_REDIS_URL``).
        leeway_s: the verifier's leeway: an id is kept until no verifier would still accept its token.
        fallback: None (fail closed): when Redis does not answer, refuse with ``replay_check_unavailable``.
            A :class:`MemoryReplayGuard` (fail open to this process's memory): when Redis does not answer,
            check and record the id there instead; ids admitted through Redis are recorded there too, so
            only a token first used before a restart of this process can be replayed during an outage.
        timeout_s: connect and command timeout (s): how long a handshake may wait on Redis.
        on_error: called once per failed Redis call (metrics).
        key_prefix: first component of the key.
    """

    def __init__(
        self,
        url: str,
        *,
        leeway_s: float = 5.0,
        fallback: MemoryReplayGuard | None = None,
        timeout_s: float = 0.5,
        on_error: Callable[[], None] | None = None,
        key_prefix: str = "duplex",
    ) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self._redis = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._errors: tuple[type[BaseException], ...] = (aioredis.RedisError, OSError, TimeoutError)
        self.leeway_s = leeway_s
        self.fallback = fallback
        self.timeout_s = timeout_s
        self._on_error = on_error
        self.key_prefix = key_prefix

    def key(self, token_id: str) -> str:
        """``duplex:token:<jti>``."""
        return f"{self.key_prefix}:token:{token_id}"

    async def spend(self, claims: TokenClaims) -> None:
        ttl_s = max(1, math.ceil(claims.expires_at + self.leeway_s - time.time()))
        try:
            fresh = await self._redis.set(self.key(claims.token_id), claims.kid, nx=True, ex=ttl_s)
        except self._errors as exc:
            self._redis_failed(exc)
            assert self.fallback is not None
            await self.fallback.spend(claims)
            return
        if not fresh:
            raise TokenRejected("replayed", replayed_message(claims.token_id))
        if self.fallback is not None:
            self.fallback.remember(claims)

    async def seen(self, claims: TokenClaims) -> bool:
        """``EXISTS duplex:token:<jti>``: read only. When Redis does not answer, the fallback's memory
        answers, or (without one) ``replay_check_unavailable`` is raised, as ``spend`` would."""
        try:
            return bool(await self._redis.exists(self.key(claims.token_id)))
        except self._errors as exc:
            self._redis_failed(exc)
            assert self.fallback is not None
            return self.fallback.was_used(claims)

    def _redis_failed(self, exc: BaseException) -> None:
        """Count a Redis failure; without a fallback, refuse (fail closed).

        Raises:
            TokenRejected: ``replay_check_unavailable`` when there is no fallback.
        """
        if self._on_error is not None:
            self._on_error()
        if self.fallback is None:
            raise TokenRejected(
                "replay_check_unavailable",
                f"cannot check the token against those already used (Redis: {type(exc).__name__}); "
                "retry in a moment",
            ) from None

    async def close(self) -> None:
        await self._redis.aclose()
