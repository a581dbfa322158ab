"""The session store's periodic Redis AOF rewrite (issue 34, "persistence that forgets").

A key that expired (the retention, ``DUPLEX_TRANSCRIPT_TTL_S``) or was deleted is gone from Redis's memory
but stays in its append-only file until the file is rewritten (``BGREWRITEAOF``; the node runs Redis with the
AOF and no RDB snapshots: ``infra.node.bundle.redis_conf``). Redis rewrites on its own only as the file grows
(``auto-aof-rewrite-percentage``), which a quiet node may never do; an erase asks at once (debounced:
``runtime.frontend.store.records``). :class:`PeriodicAofRewrite` asks once every period
(``DUPLEX_AOF_REWRITE_EVERY_S``, a day by default) on an injected clock, so expired transcripts leave the
file within a period. With ``--workers N`` each worker's store asks: a second ask while one rewrite runs is
refused by Redis ("already in progress") and logged at INFO.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis.exceptions as redis_errors

__all__ = ["AOF_REWRITE_RETRY_S", "PeriodicAofRewrite"]

logger = logging.getLogger(__name__)

AOF_REWRITE_RETRY_S = 60.0
"""Delay (s) before the periodic AOF rewrite is asked again when Redis could not be reached at its due time
(a refusal by Redis is not retried: the next ask is a period later)."""


class PeriodicAofRewrite:
    """When to ask Redis for ``BGREWRITEAOF``: a period after the first :meth:`run_if_due` call (the writer's
    start), then a period after each ask.

    Args:
        every_s: the period (s); 0: never.
        clock: unix time (s); injected by tests.

    Raises:
        ValueError: ``every_s`` is negative (allowed: 0, never, or a period in s).
    """

    def __init__(self, every_s: float, clock: Callable[[], float]) -> None:
        if every_s < 0:
            raise ValueError(f"aof_rewrite_every_s must be >= 0 s (0: never), got {every_s!r}")
        self.every_s = float(every_s)
        self._clock = clock
        self._next: float | None = None  # clock time (unix s) of the next ask; None before the first call
        self.asked = 0
        """Rewrites Redis accepted."""

    async def run_if_due(self, client: Any) -> bool:
        """Ask ``client`` (a ``redis.asyncio.Redis``) for ``BGREWRITEAOF`` if due. Never raises: a refusal
        (a rewrite already in progress, ``NOPERM`` for a Redis user without ``BGREWRITEAOF``) is logged at
        INFO and the next ask is a period later; Redis unreachable is logged at INFO and asked again
        :data:`AOF_REWRITE_RETRY_S` later. Returns True when Redis accepted the rewrite."""
        if not self.every_s:
            return False
        now = self._clock()
        if self._next is None:
            self._next = now + self.every_s
        if now < self._next:
            return False
        self._next = now + self.every_s
        try:
            await client.bgrewriteaof()
        except redis_errors.ResponseError as exc:  # "already in progress", NOPERM: Redis said no
            logger.info("session store: Redis refused the periodic AOF rewrite: %s", exc)
            return False
        except Exception as exc:  # RedisError, OSError, timeouts: ask again soon
            self._next = now + AOF_REWRITE_RETRY_S
            logger.info("session store: the periodic AOF rewrite could not be asked (%r); retrying", exc)
            return False
        self.asked += 1
        logger.info("session store: periodic AOF rewrite asked (every %g s)", self.every_s)
        return True
