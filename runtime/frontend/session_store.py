"""Redis session registry and transcript store that never stalls the audio path.

The runtime calls three synchronous, non-blocking, never-raising methods from its 12.5 Hz frame loop
(:meth:`SessionStore.register_session`, :meth:`SessionStore.append_transcript`,
:meth:`SessionStore.end_session`). They only enqueue an op (a few µs); one background writer task
(:meth:`SessionStore.start`) applies the queued ops to Redis in order, pipelined in ``MULTI``/``EXEC``
batches of up to :attr:`SessionStore.BATCH_MAX_OPS` ops.

Key layout (``{prefix}`` is ``key_prefix``, ``duplex`` by default; every write refreshes the TTL of
every key it touches with ``EXPIRE``):

``{prefix}:session:{id}`` (hash, TTL ``session_ttl_s``; also refreshed by transcript appends)
    ``id``, ``node``, ``slot``, ``started_at`` (unix s, float as text), ``persona`` ("" when none),
    ``format`` (audio format), ``state`` (``active`` | ``ended``), and once ended ``end_reason`` and
    ``ended_at`` (unix s).
``{prefix}:transcript:{id}`` (string, TTL ``transcript_ttl_s``)
    The session's text stream; each piece is added with ``APPEND``.
``{prefix}:node:{node}:sessions`` (set, TTL ``session_ttl_s``)
    Ids of the sessions active on that node (``SADD`` at register, ``SREM`` at end).
``{prefix}:node:{node}:writer`` (string, TTL ``max(session_ttl_s, transcript_ttl_s)``)
    A random token of the :class:`SessionStore` instance writing for that node. Every batch reads it
    back inside its transaction; a missing or foreign token means Redis lost data (restart without
    persistence, ``FLUSHALL``, expiry) and triggers a resync.

Failure handling (Redis down must not stop the audio):

- Each failed Redis attempt calls ``on_error(op_name)`` once (``"write"`` for an op batch, ``"resync"``
  for a resync) and the writer retries with capped exponential backoff (``retry_initial_s`` doubling up
  to ``retry_max_s``). The ops stay queued, in order; redis-py's own retries are disabled so that the
  store alone decides what is retried.
- The store keeps a local mirror of every session it still tracks (active, or ended but not yet
  written): the record and the transcript text. After any failed attempt, and whenever the writer token
  shows that Redis lost data, the next write is a *resync*: one transaction that rewrites every tracked
  session's hash and transcript from the mirror (``DEL`` + ``HSET``, ``SET``) and rebuilds this node's
  active set. So when Redis returns, whether it kept its data or came back empty, the registry and the
  transcripts catch up with nothing lost and nothing duplicated (a batch whose ``EXEC`` reply was lost
  is not replayed on top of itself). Sessions whose end was already written are no longer tracked: if
  Redis later loses them, they stay lost.
- The queue is bounded: when more than ``max_backlog_ops`` ops are pending, the oldest queued
  transcript appends are dropped first, each counted with ``on_error("backlog_overflow")`` (their text
  is gone for good). Register and end ops are never dropped, and ops of an attempt in flight cannot be
  dropped, so the bound is soft by at most one batch plus the register/end ops.
- Calls for a session that is not registered (or already ended) are ignored and counted with
  ``on_error("unknown_session")``; calls after :meth:`SessionStore.close` with ``on_error("closed")``;
  any unexpected exception inside a call with ``on_error("internal")``.

Threading: the synchronous methods may be called from the event loop thread that ran :meth:`start`
(the normal case) or from another thread (the writer is woken with ``call_soon_threadsafe``). Session ids
must be unique per store instance (the runtime uses UUIDs).
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
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.typing import EncodableT, FieldT

__all__ = ["SessionRecord", "SessionStore"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionRecord:
    """One session as the registry stores it.

    Attributes:
        session_id: unique id of the session (a UUID in the runtime).
        node_id: the runtime node serving it.
        slot: batch slot index on that node (0-based).
        started_at_unix_s: wall-clock start time (unix s).
        persona: voice/text prompt name, or "" when none.
        audio_format: client audio format (e.g. ``"opus"``, ``"pcm_s16le_24k"``).
    """

    session_id: str
    node_id: str
    slot: int
    started_at_unix_s: float
    persona: str
    audio_format: str


@dataclass(eq=False)
class _Session:
    """Local mirror of one tracked session (the state Redis must end up with)."""

    record: SessionRecord
    gen: int = 0
    ended: bool = False
    end_reason: str = ""
    ended_at_unix_s: float = 0.0
    acked: list[str] = field(default_factory=list)
    """Transcript pieces Redis acknowledged, in order (joined every ``_JOIN_EVERY`` pieces)."""
    pending: deque[_Op] = field(default_factory=deque)
    """Queued (not yet acknowledged, not dropped) append ops of this session, oldest first."""

    def fields(self, node_id: str) -> dict[FieldT, EncodableT]:
        rec = self.record
        out: dict[FieldT, EncodableT] = {
            "id": rec.session_id,
            "node": rec.node_id or node_id,
            "slot": str(rec.slot),
            "started_at": repr(float(rec.started_at_unix_s)),
            "persona": rec.persona,
            "format": rec.audio_format,
            "state": "ended" if self.ended else "active",
        }
        if self.ended:
            out["end_reason"] = self.end_reason
            out["ended_at"] = repr(self.ended_at_unix_s)
        return out


@dataclass(eq=False)
class _Op:
    """One queued write. ``kind`` is ``"register"``, ``"append"`` or ``"end"``."""

    kind: str
    session: _Session
    record: SessionRecord | None = None
    piece: str = ""
    reason: str = ""
    ended_at_unix_s: float = 0.0
    gen: int = 0
    seq: int = 0
    dropped: bool = False


_JOIN_EVERY = 64


def _call_quietly(callback: Callable[[Any], None] | None, argument: Any, name: str) -> None:
    """Call a metrics callback; its failure is logged, never raised into the audio path."""
    if callback is None:
        return
    try:
        callback(argument)
    except Exception:
        logger.exception("session store %s callback failed", name)


class SessionStore:
    """Session registry + transcripts in Redis, written by one background task; see the module doc.

    Args:
        url: Redis URL, e.g. ``redis://127.0.0.1:6379/0``.
        node_id: this runtime node's id (names the node's active-session set).
        key_prefix: first component of every key.
        session_ttl_s: TTL (s) of the session hash and the node set, refreshed at every write.
        transcript_ttl_s: TTL (s) of the transcript string, refreshed at every append.
        max_backlog_ops: pending ops (ops) above which the oldest queued transcript appends are dropped.
        retry_initial_s: first retry delay (s) after a failed attempt; doubles per failure.
        retry_max_s: cap (s) of the retry delay.
        on_error: called with an op name once per failed Redis attempt and per dropped/ignored op
            (``"write"``, ``"resync"``, ``"backlog_overflow"``, ``"unknown_session"``, ``"closed"``,
            ``"internal"``). Must be cheap; exceptions from it are logged and swallowed.
        on_backlog: called with the pending op count (ops) whenever it changes. Same rules.
        socket_timeout_s: connect and per-command socket timeout (s); small, so a dead Redis is noticed
            quickly.

    Raises:
        ValueError: a TTL, ``max_backlog_ops`` or a retry delay is not positive.
    """

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
    ) -> None:
        if session_ttl_s <= 0 or transcript_ttl_s <= 0:
            raise ValueError("session_ttl_s and transcript_ttl_s must be > 0 s")
        if max_backlog_ops <= 0:
            raise ValueError("max_backlog_ops must be > 0 ops")
        if retry_initial_s <= 0 or retry_max_s < retry_initial_s:
            raise ValueError("need 0 < retry_initial_s <= retry_max_s (s)")
        self.node_id = node_id
        self.key_prefix = key_prefix
        self.session_ttl_s = int(session_ttl_s)
        self.transcript_ttl_s = int(transcript_ttl_s)
        self.max_backlog_ops = int(max_backlog_ops)
        self.retry_initial_s = float(retry_initial_s)
        self.retry_max_s = float(retry_max_s)
        self._on_error = on_error
        self._on_backlog = on_backlog
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
        return f"{self.key_prefix}:session:{session_id}"

    def transcript_key(self, session_id: str) -> str:
        """``{prefix}:transcript:{id}`` (string)."""
        return f"{self.key_prefix}:transcript:{session_id}"

    def node_sessions_key(self, node_id: str | None = None) -> str:
        """``{prefix}:node:{node}:sessions`` (set); this store's node when ``node_id`` is None."""
        return f"{self.key_prefix}:node:{node_id or self.node_id}:sessions"

    def writer_key(self) -> str:
        """``{prefix}:node:{node}:writer`` (string, the writer token)."""
        return f"{self.key_prefix}:node:{self.node_id}:writer"

    # ------------------------------------------------------------ properties

    @property
    def connected(self) -> bool:
        """True when the writer's last Redis attempt succeeded (False before the first one)."""
        return self._connected

    @property
    def backlog(self) -> int:
        """Ops (ops) queued and not yet acknowledged by Redis."""
        return self._live

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the background writer task on the running event loop (idempotent).

        Raises:
            RuntimeError: the store was closed.
        """
        if self._closed:
            raise RuntimeError("SessionStore is closed")
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread_id = threading.get_ident()
        self._wake = asyncio.Event()
        self._wake.set()
        self._task = asyncio.create_task(self._run(), name=f"session-store-writer:{self.node_id}")

    async def close(self, flush_timeout_s: float = 2.0) -> int:
        """Stop accepting ops, try to flush for up to ``flush_timeout_s`` (s), stop the writer.

        Returns within about ``flush_timeout_s`` + one socket timeout even when Redis is down.

        Returns:
            The number of ops (ops) left unwritten.
        """
        if self._closed:
            return self._live
        self._closed = True
        task = self._task
        if task is not None:
            deadline = time.monotonic() + max(0.0, flush_timeout_s)
            while (
                not task.done()
                and (self._live > 0 or (self._need_resync and self._sessions))
                and time.monotonic() < deadline
            ):
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)  # never raises; the writer swallows its errors
        left = self._live
        if left:
            logger.warning("session store closed with %d ops unwritten", left)
        try:
            await asyncio.wait_for(self._redis.aclose(), timeout=1.0)
        except Exception:  # best effort
            logger.debug("closing the redis client failed", exc_info=True)
        return left

    # --------------------------------------------- audio path (sync, no raise)

    def register_session(self, record: SessionRecord) -> None:
        """Queue the registration of ``record`` (state ``active``; adds it to the node set).

        Never blocks, never raises. Registering a tracked id again replaces its record and makes it
        active again; its transcript continues.
        """
        try:
            with self._lock:
                if self._closed:
                    errors, backlog = ["closed"], None
                else:
                    sess = self._sessions.get(record.session_id)
                    if sess is None:
                        sess = _Session(record=record)
                        self._sessions[record.session_id] = sess
                    else:
                        sess.record = record
                        sess.gen += 1
                        sess.ended = False
                        sess.end_reason = ""
                        sess.ended_at_unix_s = 0.0
                    errors = self._push(_Op("register", sess, record=record, gen=sess.gen))
                    backlog = self._live
            self._after_push(errors, backlog)
        except Exception:
            self._internal_error("register_session")

    def append_transcript(self, session_id: str, piece: str) -> None:
        """Queue ``piece`` (text) to be appended to the session's transcript.

        Never blocks, never raises. Empty pieces are ignored; a session that is not registered or
        already ended is counted as ``on_error("unknown_session")``.
        """
        try:
            if not piece:
                return
            if not isinstance(piece, str):
                piece = str(piece)
            with self._lock:
                sess, errors = self._live_session(session_id)
                backlog = None
                if sess is not None:
                    errors = self._push(_Op("append", sess, piece=piece))
                    backlog = self._live
            self._after_push(errors, backlog)
        except Exception:
            self._internal_error("append_transcript")

    def end_session(self, session_id: str, reason: str) -> None:
        """Queue the end of a session: state ``ended``, ``end_reason``, ``ended_at`` (now, unix s).

        Never blocks, never raises. Removes the id from the node's active set. Unknown or already
        ended sessions are counted as ``on_error("unknown_session")``.
        """
        try:
            now = time.time()
            with self._lock:
                sess, errors = self._live_session(session_id)
                backlog = None
                if sess is not None:
                    sess.ended = True
                    sess.end_reason = str(reason)
                    sess.ended_at_unix_s = now
                    op = _Op("end", sess, reason=sess.end_reason, ended_at_unix_s=now, gen=sess.gen)
                    errors = self._push(op)
                    backlog = self._live
            self._after_push(errors, backlog)
        except Exception:
            self._internal_error("end_session")

    def _live_session(self, session_id: str) -> tuple[_Session | None, list[str]]:
        """Under ``self._lock``: the session when the store is open and the session started and not ended,
        else None and the error to count (``closed`` or ``unknown_session``)."""
        if self._closed:
            return None, ["closed"]
        sess = self._sessions.get(session_id)
        if sess is None or sess.ended:
            return None, ["unknown_session"]
        return sess, []

    # ------------------------------------------------------------- readers

    async def get_session(self, session_id: str) -> dict[str, str] | None:
        """The session hash as stored in Redis, or None when absent.

        Raises:
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        data = await self._redis.hgetall(self.session_key(session_id))
        return {str(k): str(v) for k, v in data.items()} if data else None

    async def get_transcript(self, session_id: str) -> str:
        """The transcript stored in Redis ("" when absent).

        Raises:
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        text = await self._redis.get(self.transcript_key(session_id))
        return str(text) if text else ""

    async def active_sessions(self) -> set[str]:
        """Ids in this node's active-session set in Redis.

        Raises:
            redis.exceptions.RedisError: Redis unreachable or failing.
        """
        return {str(m) for m in await self._redis.smembers(self.node_sessions_key())}

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
            if not self._need_resync and self._live == 0:
                self._wake.clear()
                if not self._need_resync and self._live == 0:
                    await self._wake.wait()
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
        hashes: set[str] = set()
        node_touched = False
        for op in ops:
            sid = op.session.record.session_id
            hkey = self.session_key(sid)
            if op.kind == "append":
                texts.setdefault(self.transcript_key(sid), []).append(op.piece)
                hashes.add(hkey)
            elif op.kind == "register":
                assert op.record is not None
                mirror = _Session(record=op.record)
                pipe.hdel(hkey, "end_reason", "ended_at")
                pipe.hset(hkey, mapping=mirror.fields(self.node_id))
                pipe.sadd(node_key, sid)
                hashes.add(hkey)
                node_touched = True
            else:  # end
                pipe.hset(
                    hkey,
                    mapping={"state": "ended", "end_reason": op.reason, "ended_at": repr(op.ended_at_unix_s)},
                )
                pipe.srem(node_key, sid)
                hashes.add(hkey)
                node_touched = True
        for tkey, pieces in texts.items():
            pipe.append(tkey, "".join(pieces))
            pipe.expire(tkey, self.transcript_ttl_s)
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

    async def _resync(self) -> None:
        """Rewrite every tracked session and this node's set from the mirror in one MULTI/EXEC."""
        await self._redis.ping()  # cheap reachability check before building a large transaction
        node_key = self.node_sessions_key()
        pipe = self._redis.pipeline(transaction=True)
        with self._lock:
            upto = self._seq
            self._inflight_upto = upto
            pipe.delete(node_key)
            active: list[str] = []
            for sid, sess in self._sessions.items():
                hkey, tkey = self.session_key(sid), self.transcript_key(sid)
                text = "".join(sess.acked) + "".join(op.piece for op in sess.pending)
                pipe.delete(hkey, tkey)
                pipe.hset(hkey, mapping=sess.fields(self.node_id))
                pipe.expire(hkey, self.session_ttl_s)
                if text:
                    pipe.set(tkey, text, ex=self.transcript_ttl_s)
                if not sess.ended:
                    active.append(sid)
            if active:
                pipe.sadd(node_key, *active)
                pipe.expire(node_key, self.session_ttl_s)
            pipe.set(self.writer_key(), self._token, ex=self._marker_ttl_s)
        await pipe.execute()
        with self._lock:
            backlog = self._ack_through(upto)
            self._need_resync = False
        self._emit_backlog(backlog)
