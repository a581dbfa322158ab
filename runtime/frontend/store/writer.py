"""The background writer of :class:`~runtime.frontend.store.redis_store.SessionStore`: state and Redis I/O.

:class:`SessionWriter` (the store's base class) holds the local mirror of every tracked session and the
bounded op queue, and its task applies the queue to Redis in ``MULTI``/``EXEC`` batches, or rewrites
everything from the mirror (a resync) after a failure. The key layout and the failure contract are the
store's module doc (the events stream, the timestamped transcript and the session index:
``runtime.frontend.store.events``); operating it: docs/operations.md, "Session store (Redis)".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from runtime.frontend.store import keys
from runtime.frontend.store.aof import PeriodicAofRewrite
from runtime.frontend.store.events import (
    EVENT_INDEX_SLACK_S,
    INDEX_HORIZON_S,
    TRIM_EVERY_S,
    XADD_INDEXED_LUA,
    event_fields,
    persona_fields,
)
from runtime.frontend.store.mirror import SessionRecord, _Op, _Session

__all__ = ["SessionRecord", "SessionWriter"]

logger = logging.getLogger(__name__)

_JOIN_EVERY = 64


def _call_quietly(callback: Callable[[Any], None] | None, argument: Any, name: str) -> None:
    """Call a metrics callback; its failure is logged, never raised into the audio path."""
    if callback is None:
        return
    try:
        callback(argument)
    except Exception:
        logger.exception("session store %s callback failed", name)


class SessionWriter:
    """The mirror, the op queue and the writer task of a
    :class:`~runtime.frontend.store.redis_store.SessionStore`
    (its arguments and errors are documented there)."""

    BATCH_MAX_OPS = 1000
    """Most ops (ops) one ``MULTI``/``EXEC`` batch applies."""

    def __init__(
        self,
        url: str,
        node_id: str,
        *,
        key_prefix: str = "duplex",
        session_ttl_s: int = 86400,
        transcript_ttl_s: int = 86400,
        max_backlog_ops: int = 100_000,
        retry_initial_s: float = 0.2,
        retry_max_s: float = 5.0,
        on_error: Callable[[str], None] | None = None,
        on_backlog: Callable[[int], None] | None = None,
        socket_timeout_s: float = 0.5,
        events_maxlen: int = 100_000,
        writer_id: str = "",
        clock: Callable[[], float] = time.time,
        aof_rewrite_every_s: float = 86400.0,
    ) -> None:
        if events_maxlen < 0:
            raise ValueError("events_maxlen must be >= 0 entries (0: no events stream)")
        if session_ttl_s <= 0 or transcript_ttl_s <= 0:
            raise ValueError("session_ttl_s and transcript_ttl_s must be > 0 s")
        if max_backlog_ops <= 0:
            raise ValueError("max_backlog_ops must be > 0 ops")
        if retry_initial_s <= 0 or retry_max_s < retry_initial_s:
            raise ValueError("need 0 < retry_initial_s <= retry_max_s (s)")
        self.url, self.node_id, self.key_prefix, self.writer_id = url, node_id, key_prefix, writer_id
        self.session_ttl_s = int(session_ttl_s)
        self.transcript_ttl_s = int(transcript_ttl_s)
        self.max_backlog_ops = int(max_backlog_ops)
        self.events_maxlen = int(events_maxlen)
        self.retry_initial_s = float(retry_initial_s)
        self.retry_max_s = float(retry_max_s)
        self._on_error = on_error
        self._on_backlog = on_backlog
        self._clock = clock
        self._next_trim = 0.0  # clock time (unix s) of the next trim of the events stream
        self.aof_rewrite = PeriodicAofRewrite(aof_rewrite_every_s, clock)
        # retries=0: redis-py must not replay a MULTI/EXEC whose reply was lost (that would duplicate
        # APPENDs); the writer retries itself, via a resync.
        self._redis = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._token = secrets.token_hex(8)
        self._marker_ttl_s = max(self.session_ttl_s, self.transcript_ttl_s)

        self._lock = threading.Lock()
        self._queue: deque[_Op] = deque()  # all queued ops in seq order; dropped ones removed lazily
        self._appends: deque[_Op] = deque()  # queued append ops in seq order (overflow victims)
        self._sessions: dict[str, _Session] = {}
        self._live = 0  # queued ops not dropped = backlog
        self._dead = 0  # dropped ops still in _queue
        self._seq = 0
        self._inflight_upto = 0  # ops with seq <= this are part of the attempt in flight
        self._need_resync = True  # the first write sets the writer token and the node set
        self._connected = False
        self._closed = False
        self._failures_in_row = 0

        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread_id: int | None = None
        self._wake: asyncio.Event | None = None

    # ------------------------------------------------------------------ keys

    def session_key(self, session_id: str) -> str:
        """``{prefix}:session:{id}`` (hash)."""
        return keys.session_key(self.key_prefix, session_id)

    def transcript_key(self, session_id: str) -> str:
        """``{prefix}:transcript:{id}`` (string)."""
        return keys.transcript_key(self.key_prefix, session_id)

    def lines_key(self, session_id: str) -> str:
        """``{prefix}:lines:{id}`` (string of JSON lines)."""
        return keys.lines_key(self.key_prefix, session_id)

    def node_sessions_key(self, node_id: str | None = None) -> str:
        """``{prefix}:node:{node}:sessions`` (set); this store's node when ``node_id`` is None."""
        return keys.node_sessions_key(self.key_prefix, node_id or self.node_id)

    def _xadd_event(self, pipe: Any, op: _Op) -> None:
        """Queue the stream entry of ``op`` on ``pipe`` (none for a register op that is not a start, none
        when ``events_maxlen`` is 0)."""
        if not self.events_maxlen:
            return
        rec, extra = op.session.record, dict(op.extra or {})
        kind = {"append": "text", "end": "ended"}.get(op.kind) or op.event_kind or "started"
        if op.kind == "append":
            extra.update(speaker="agent", text=op.piece)
        elif op.kind == "end":
            extra["reason"] = op.reason
        elif op.kind == "register" and op.record is not None:
            r = op.record
            voice, _, digest = persona_fields(r.persona)
            extra.update(persona=voice, **digest)
            extra.update(format=r.audio_format, slot=str(r.slot), recording=str(int(r.recording)))
        node, event_id = rec.node_id or self.node_id, f"{self._token}:{op.seq}"
        fields = event_fields(kind, rec.session_id, node, op.at_unix_s, event_id, extra)
        flat = [item for pair in fields.items() for item in pair]
        stream = keys.events_key(self.key_prefix)
        index = keys.session_events_key(self.key_prefix, rec.session_id)
        index_ttl_s = self.transcript_ttl_s + EVENT_INDEX_SLACK_S
        pipe.eval(XADD_INDEXED_LUA, 2, stream, index, self.events_maxlen, index_ttl_s, *flat)

    async def trim_events(self) -> int:
        """Delete the events stream's entries older than the retention (``transcript_ttl_s`` before the
        clock; ``XTRIM MINID``, exact): the writer calls it every :data:`~runtime.frontend.store.events.
        TRIM_EVERY_S`. Returns the entries deleted (0 with no events stream).

        Raises:
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        if not self.events_maxlen:
            return 0
        oldest_ms = max(0, int((self._clock() - self.transcript_ttl_s) * 1000))
        stream = keys.events_key(self.key_prefix)
        removed = await self._redis.xtrim(stream, minid=str(oldest_ms), approximate=False)
        return int(removed)

    async def _trim_if_due(self) -> None:
        """Trim the events stream when due (see :meth:`trim_events`); a failure is logged and counted
        (``on_error("trim")``) and tried again at the next due time."""
        now = self._clock()
        if now < self._next_trim:
            return
        self._next_trim = now + TRIM_EVERY_S
        try:
            removed = await self.trim_events()
        except Exception as exc:  # RedisError, OSError, timeouts: the next trim catches up
            logger.debug("session store: trimming the events stream failed (%r)", exc)
            self._emit_error("trim")
        else:
            if removed:
                logger.info("session store: %d events past the retention deleted", removed)

    async def rewrite_aof_if_due(self) -> bool:
        """``aof_rewrite.run_if_due`` on this store's Redis (``runtime.frontend.store.aof``); never raises."""
        return await self.aof_rewrite.run_if_due(self._redis)

    def writer_key(self) -> str:
        """``{prefix}:node:{node}:writer[:{writer_id}]`` (string, the writer token): one per writer, so the
        workers of one node (one store each) do not take each other's token for a Redis data loss."""
        return keys.writer_key(self.key_prefix, self.node_id, self.writer_id)

    # ------------------------------------------------------------- internals

    def _push(self, op: _Op) -> list[str]:
        """Enqueue ``op`` (lock held); drop the oldest appends above the bound. Returns error names."""
        self._seq += 1
        op.seq = self._seq
        self._queue.append(op)
        self._live += 1
        if op.kind == "append":
            self._appends.append(op)
            op.session.pending.append(op)
        errors: list[str] = []
        while self._live > self.max_backlog_ops:
            victim = self._oldest_droppable()
            if victim is None:
                break
            victim.dropped = True
            self._live -= 1
            self._dead += 1
            pending = victim.session.pending
            if pending and pending[0] is victim:
                pending.popleft()
            else:  # cannot happen: the victim is the session's oldest unacknowledged append
                with contextlib.suppress(ValueError):
                    pending.remove(victim)
            errors.append("backlog_overflow")
        return errors

    def _oldest_droppable(self) -> _Op | None:
        """Pop and return the oldest queued append not in flight (lock held), or None."""
        appends = self._appends
        while appends and appends[0].dropped:
            appends.popleft()
        if not appends or appends[0].seq <= self._inflight_upto:
            return None
        return appends.popleft()

    def _after_push(self, errors: list[str], backlog: int | None) -> None:
        for name in errors:
            self._emit_error(name)
        if backlog is not None:
            self._emit_backlog(backlog)
            self._notify()

    def _notify(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is None or wake is None:
            return  # not started yet: start() wakes the writer
        if threading.get_ident() == self._loop_thread_id:
            wake.set()
        else:
            with contextlib.suppress(RuntimeError):  # loop closed
                loop.call_soon_threadsafe(wake.set)

    def _emit_error(self, name: str) -> None:
        _call_quietly(self._on_error, name, "on_error")

    def _emit_backlog(self, n: int) -> None:
        _call_quietly(self._on_backlog, n, "on_backlog")

    def _internal_error(self, where: str) -> None:
        try:
            logger.exception("session store %s failed", where)
            self._emit_error("internal")
        except Exception:  # never raise into the audio path
            pass

    def _ack_through(self, upto: int) -> int:
        """Remove ops with seq <= ``upto`` as acknowledged (lock held). Returns the new backlog."""
        queue = self._queue
        while queue and queue[0].seq <= upto:
            op = queue.popleft()
            if op.dropped:
                self._dead -= 1
                continue
            self._live -= 1
            sess = op.session
            if op.kind == "append":
                while self._appends and self._appends[0].seq <= op.seq:
                    self._appends.popleft()
                while sess.pending and sess.pending[0].seq <= op.seq:
                    sess.pending.popleft()
                sess.acked.append(op.piece)
                sess.acked_lines.append(op.line)
                if len(sess.acked) >= _JOIN_EVERY:
                    sess.acked[:] = ["".join(sess.acked)]
            elif op.kind == "end":
                sid = sess.record.session_id
                if self._sessions.get(sid) is sess and sess.ended and sess.gen == op.gen:
                    del self._sessions[sid]
        self._inflight_upto = 0
        return self._live

    def _compact(self) -> None:
        """Drop dead (overflow-dropped) ops from the queue once they are many (lock held)."""
        if self._dead > 1024 and self._dead > self._live // 4:
            self._queue = deque(op for op in self._queue if not op.dropped)
            self._dead = 0

    async def _run(self) -> None:
        """The writer: apply queued ops (or a resync) until cancelled; never raises."""
        assert self._wake is not None
        delay_s = self.retry_initial_s
        while True:
            await self._trim_if_due()
            await self.rewrite_aof_if_due()
            if not self._need_resync and self._live == 0:
                self._wake.clear()
                if not self._need_resync and self._live == 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout=TRIM_EVERY_S)
                continue
            name = "resync" if self._need_resync else "write"
            try:
                if self._need_resync:
                    await self._resync()
                else:
                    await self._write_batch()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # RedisError, OSError, timeouts, anything: retry later
                with self._lock:
                    self._inflight_upto = 0
                    self._need_resync = True
                    self._compact()
                self._connected = False
                self._failures_in_row += 1
                if self._failures_in_row == 1:
                    logger.warning("session store: redis %s failed (%r); retrying, ops kept", name, exc)
                else:
                    logger.debug("session store: redis %s failed again (%r)", name, exc)
                self._emit_error(name)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2.0, self.retry_max_s)
            else:
                if self._failures_in_row:
                    logger.info("session store: redis back after %d failed attempts", self._failures_in_row)
                self._failures_in_row = 0
                self._connected = True
                delay_s = self.retry_initial_s

    async def _write_batch(self) -> None:
        """Apply the oldest queued ops (at most BATCH_MAX_OPS) in one MULTI/EXEC."""
        with self._lock:
            ops: list[_Op] = []
            for op in self._queue:
                if op.dropped:
                    continue
                ops.append(op)
                if len(ops) >= self.BATCH_MAX_OPS:
                    break
            if not ops:  # only dropped ops left (cannot happen: _live counts live ones); heal the count
                self._live = 0
                return
            upto = ops[-1].seq
            self._inflight_upto = upto

        node_key = self.node_sessions_key()
        pipe = self._redis.pipeline(transaction=True)
        pipe.get(self.writer_key())
        texts: dict[str, list[str]] = {}  # transcript key -> pieces, in order (APPEND commutes across keys)
        lines: dict[str, list[str]] = {}  # lines key -> timestamped pieces, in order
        hashes: set[str] = set()
        node_touched = False
        for op in ops:
            sid = op.session.record.session_id
            hkey = self.session_key(sid)
            self._xadd_event(pipe, op)
            if op.kind == "event":
                continue
            if op.kind == "append":
                texts.setdefault(self.transcript_key(sid), []).append(op.piece)
                lines.setdefault(self.lines_key(sid), []).append(op.line)
                hashes.add(hkey)
            elif op.kind == "register":
                assert op.record is not None
                mirror = _Session(record=op.record)
                pipe.hdel(hkey, "end_reason", "ended_at")
                pipe.hset(hkey, mapping=mirror.fields(self.node_id))
                pipe.sadd(node_key, sid)
                self._index(pipe, op.record)
                hashes.add(hkey)
                node_touched = True
                if op.line:  # adopted on a resume: the whole history, whatever its last holder wrote of it
                    tkey, lkey = self.transcript_key(sid), self.lines_key(sid)
                    texts.pop(tkey, None), lines.pop(lkey, None)  # (none: the history holds them anyway)
                    pipe.set(tkey, op.piece, ex=self.transcript_ttl_s)
                    pipe.set(lkey, op.line, ex=self.transcript_ttl_s)
            else:  # end
                pipe.hset(
                    hkey,
                    mapping={"state": "ended", "end_reason": op.reason, "ended_at": repr(op.ended_at_unix_s)},
                )
                pipe.srem(node_key, sid)
                self._index_state(pipe, op.session.record, "ended")
                hashes.add(hkey)
                node_touched = True
        for tkey, pieces in texts.items():
            pipe.append(tkey, "".join(pieces))
            pipe.expire(tkey, self.transcript_ttl_s)
        for lkey, entries in lines.items():
            pipe.append(lkey, "".join(entries))
            pipe.expire(lkey, self.transcript_ttl_s)
        for hkey in hashes:
            pipe.expire(hkey, self.session_ttl_s)
        if node_touched:
            pipe.expire(node_key, self.session_ttl_s)
        pipe.set(self.writer_key(), self._token, ex=self._marker_ttl_s)
        results = await pipe.execute()

        with self._lock:
            backlog = self._ack_through(upto)
            if results[0] != self._token:
                # Redis lost data (or another writer took over the node): rewrite what we track.
                logger.warning("session store: redis lost this node's data; resyncing")
                self._need_resync = True
        self._emit_backlog(backlog)

    def _index(self, pipe: Any, record: SessionRecord) -> None:
        """Queue the session's place in ``{prefix}:sessions`` and ``{prefix}:sessions:active`` (a
        registration), and the trim of ids long expired from the three indexes."""
        horizon = record.started_at_unix_s - self.session_ttl_s - INDEX_HORIZON_S
        pipe.zadd(keys.index_key(self.key_prefix), {record.session_id: float(record.started_at_unix_s)})
        self._index_state(pipe, record, "active")
        for index in (keys.index_key(self.key_prefix), *self._state_indexes()):
            pipe.zremrangebyscore(index, "-inf", f"({horizon!r}")

    def _state_indexes(self) -> tuple[str, ...]:
        return tuple(keys.state_index_key(self.key_prefix, state) for state in keys.STATES)

    def _index_state(self, pipe: Any, record: SessionRecord, state: str) -> None:
        """Queue the move of the session to the index of ``state`` (``active``/``ended``), out of the
        other."""
        for other in keys.STATES:
            index = keys.state_index_key(self.key_prefix, other)
            if other == state:
                pipe.zadd(index, {record.session_id: float(record.started_at_unix_s)})
            else:
                pipe.zrem(index, record.session_id)

    async def _resync(self) -> None:
        """Rewrite every tracked session and its node-set membership from the mirror in one MULTI/EXEC (the
        set is shared by the node's writers, one per worker: others' members are left alone)."""
        await self._redis.ping()  # cheap reachability check before building a large transaction
        node_key = self.node_sessions_key()
        pipe = self._redis.pipeline(transaction=True)
        with self._lock:
            upto = self._seq
            self._inflight_upto = upto
            active: list[str] = []
            for sid, sess in self._sessions.items():
                hkey, tkey, lkey = (
                    self.session_key(sid),
                    self.transcript_key(sid),
                    self.lines_key(sid),
                )
                text = "".join(sess.acked) + "".join(op.piece for op in sess.pending)
                entries = sess.acked_lines + [op.line for op in sess.pending]
                pipe.delete(hkey, tkey, lkey)
                pipe.hset(hkey, mapping=sess.fields(self.node_id))
                pipe.expire(hkey, self.session_ttl_s)
                self._index(pipe, sess.record)
                self._index_state(pipe, sess.record, "ended" if sess.ended else "active")
                if text:
                    pipe.set(tkey, text, ex=self.transcript_ttl_s)
                if entries:
                    pipe.set(lkey, "".join(entries), ex=self.transcript_ttl_s)
                if not sess.ended:
                    active.append(sid)
                else:
                    pipe.srem(node_key, sid)
            if active:
                pipe.sadd(node_key, *active)
                pipe.expire(node_key, self.session_ttl_s)
            # The events of every op this resync acknowledges, in order (again, if the failed attempt's
            # EXEC did apply: at least once, deduplicated by the consumer on the ``event`` field).
            for op in self._queue:
                if op.seq <= upto and not op.dropped:
                    self._xadd_event(pipe, op)
            pipe.set(self.writer_key(), self._token, ex=self._marker_ttl_s)
        await pipe.execute()
        with self._lock:
            backlog = self._ack_through(upto)
            self._need_resync = False
        self._emit_backlog(backlog)
