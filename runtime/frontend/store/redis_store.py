"""Redis session registry and transcript store that never stalls the audio path.

The runtime calls three synchronous, non-blocking, never-raising methods from its 12.5 Hz frame loop
(:meth:`SessionStore.register_session`, :meth:`SessionStore.append_transcript`,
:meth:`SessionStore.end_session`). They only enqueue an op (a few µs); one background writer task
(:meth:`SessionStore.start`) applies the queued ops to Redis in order, pipelined in ``MULTI``/``EXEC``
batches of up to :attr:`SessionStore.BATCH_MAX_OPS` ops.

Key layout (``{prefix}`` is ``key_prefix``, ``duplex`` by default; every key is built by
``runtime.frontend.store.keys``; every write refreshes the TTL of every key it touches with ``EXPIRE``). The
store is the Redis :class:`~runtime.frontend.store.interface.SessionLog`:

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

``{prefix}:lines:{id}``, ``{prefix}:sessions[:active|:ended]``, ``{prefix}:events``, ``{prefix}:events:{id}``
    The timestamped transcript, the indexes of sessions by start time (all, and by state), the events
    stream (bounded by ``events_maxlen`` and by the retention) and each session's entry ids in it:
    ``runtime.frontend.store.events``. They follow the same failure contract.

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
- A session resumed through another store (another worker; or this one, whose old record is forgotten
  first) moves with its whole history: the new store writes the transcript and lines the slot owner
  kept over what Redis holds (:meth:`SessionStore.adopt_session`), and the old store's queued appends
  become events only (:meth:`SessionStore.forget_session`). So lines the old store could not send (Redis
  down) are written by the new one, once; none is counted as written without being sent. The one window
  left: an attempt of the old store in flight at the hand-over, applied after the new store's rewrite,
  appends its pieces a second time (at most one batch).
- Calls for a session that is not registered (or already ended) are ignored and counted with
  ``on_error("unknown_session")``; calls after :meth:`SessionStore.close` with ``on_error("closed")``;
  any unexpected exception inside a call with ``on_error("internal")``.

Threading: the synchronous methods may be called from the event loop thread that ran :meth:`start`
(the normal case) or from another thread (the writer is woken with ``call_soon_threadsafe``). Session ids
must be unique per store instance (the runtime uses UUIDs).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence

from runtime.frontend.store.events import EVENT_KINDS, SPEAKER_AGENT, line_entry
from runtime.frontend.store.mirror import SessionRecord, _Op, _Session
from runtime.frontend.store.writer import SessionWriter

__all__ = ["SessionRecord", "SessionStore"]

logger = logging.getLogger(__name__)


class SessionStore(SessionWriter):
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
        writer_id: this store among the node's (the worker's id with ``--workers N``: each worker has one
            store): names its writer token, so that one worker's writes are not taken by another for a
            Redis data loss (which would make every write a full resync).
        events_maxlen: approximate length cap (entries) of the events stream; 0: no events.
        clock: unix time (s) of the events stream's time trim (entries older than ``transcript_ttl_s`` before
            it are deleted every ``events.TRIM_EVERY_S``; :meth:`trim_events`) and of the daily AOF rewrite.
        aof_rewrite_every_s: period (s) of the ``BGREWRITEAOF`` the writer asks on ``clock``, the first a
            period after :meth:`start`, so that keys expired by the retention leave Redis's append-only file
            on a quiet node too (:meth:`rewrite_aof_if_due`; ``DUPLEX_AOF_REWRITE_EVERY_S``); 0: never.

    Raises:
        ValueError: a TTL, ``max_backlog_ops`` or a retry delay is not positive, or ``aof_rewrite_every_s``
            is negative.
    """

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

    def register_session(
        self,
        record: SessionRecord,
        event_kind: str = "started",
        extra: dict[str, str] | None = None,
        history: tuple[str, str] = ("", ""),
    ) -> None:
        """Queue the registration of ``record`` (state ``active``; adds it to the node set), published on the
        events stream as ``event_kind`` (``started``; ``resumed`` for a resume, with ``extra`` fields).

        Never blocks, never raises. Registering a tracked id again replaces its record and makes it
        active again; its transcript continues. ``history`` (text, timestamped lines), for an id this
        store does not track: its transcript so far, written over what Redis holds (:meth:`adopt_session`).
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
                        text, lines = history
                        sess.acked, sess.acked_lines = [text] if text else [], [lines] if lines else []
                    else:
                        history = ("", "")
                        sess.record = record
                        sess.gen += 1
                        sess.ended = False
                        sess.end_reason = ""
                        sess.ended_at_unix_s = 0.0
                    op = _Op(
                        "register",
                        sess,
                        record=record,
                        gen=sess.gen,
                        at_unix_s=time.time(),
                        event_kind=event_kind,
                        extra=extra,
                        piece=history[0],
                        line=history[1],
                    )
                    errors = self._push(op)
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
            now = time.time()
            line = line_entry(now, piece)
            with self._lock:
                sess, errors = self._live_session(session_id)
                backlog = None
                if sess is not None:
                    errors = self._push(_Op("append", sess, piece=piece, line=line, at_unix_s=now))
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
                    op = _Op(
                        "end", sess, reason=sess.end_reason, ended_at_unix_s=now, gen=sess.gen, at_unix_s=now
                    )
                    errors = self._push(op)
                    backlog = self._live
            self._after_push(errors, backlog)
        except Exception:
            self._internal_error("end_session")

    def record_event(self, session_id: str, kind: str, fields: dict[str, str] | None = None) -> None:
        """Queue an event of a live session on the events stream alone (``kind`` of
        ``session_events.EVENT_KINDS``: ``resumed`` for the resume work; ``fields``: its extra fields, str
        to str). ``started``, ``text`` and ``ended`` are written by the three calls above.

        Never blocks, never raises: an unknown kind is counted as ``on_error("internal")``, an unknown or
        ended session as ``on_error("unknown_session")``.
        """
        try:
            if kind not in EVENT_KINDS:
                raise ValueError(f"unknown event kind {kind!r}; allowed: {', '.join(EVENT_KINDS)}")
            extra = {str(k): str(v) for k, v in (fields or {}).items()}
            now = time.time()
            with self._lock:
                sess, errors = self._live_session(session_id)
                backlog = None
                if sess is not None:
                    op = _Op("event", sess, event_kind=kind, extra=extra, at_unix_s=now)
                    errors = self._push(op)
                    backlog = self._live
            self._after_push(errors, backlog)
        except Exception:
            self._internal_error("record_event")

    def adopt_session(
        self,
        record: SessionRecord,
        transcript: Sequence[tuple[float, str]],
        extra: dict[str, str] | None = None,
    ) -> None:
        """A session resumed here (``runtime.frontend.session.conversation.ChatSession.resume``): register it
        again,
        published as a ``resumed`` event with ``extra``. When this store does not track it (its last holder
        forgot it: :meth:`forget_session`; or another worker process held it), its whole history so far,
        ``transcript`` (every text piece with when the slot produced it, unix s, from the slot owner), is
        written over what Redis holds with the registration, and starts the mirror: so the pieces its last
        holder had queued and not sent (Redis down) are written, once, whatever that holder does (its
        queued appends became events only), and a resync rewrites the whole transcript. The timestamps of
        the lines are the slot owner's from then on. Never blocks, never raises."""
        try:
            text = "".join(piece for _, piece in transcript)
            lines = "".join(line_entry(at, piece) for at, piece in transcript)
            self.register_session(record, "resumed", extra, history=(text, lines))
        except Exception:
            self._internal_error("adopt_session")

    def forget_session(self, record: SessionRecord) -> None:
        """Stop tracking a session resumed elsewhere (its new holder writes it from now on, its whole
        transcript included: :meth:`adopt_session`). Its queued appends not in flight become events only
        (``text``): their events are still published here, their text and lines are the new holder's to
        write (so none is written twice, none counted as written without being sent). Only when the tracked
        record is ``record`` itself (a resume through this same store registered a new one, which stays).
        Never blocks, never raises."""
        try:
            with self._lock:
                sess = self._sessions.get(record.session_id)
                if sess is not None and sess.record is record:
                    del self._sessions[record.session_id]
                    for op in sess.pending:
                        if op.seq > self._inflight_upto:  # an attempt in flight sends it as it is
                            op.kind, op.event_kind = "event", "text"
                            op.extra = {"speaker": SPEAKER_AGENT, "text": op.piece}
                    sess.pending.clear()
        except Exception:
            self._internal_error("forget_session")

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
