"""What the sessions API reads and erases in Redis: :class:`RedisSessionReader`, the Redis
:class:`~runtime.frontend.store.interface.SessionReader`.

The store (``runtime.frontend.store.redis_store``) writes; this module only reads, and erases on request. What
it can return is what Redis still holds: every key expires ``transcript_ttl_s`` after its last write (the
retention), so an expired session is unknown here (404), like one never started; its entries of the events
stream are found by their per-session index (``runtime.frontend.store.keys.session_events_key``) until they
are trimmed, and erased.

A session as the API returns it (:meth:`RedisSessionReader.read`)::

    {"id", "node", "state": "active"|"ended", "persona": "voice=<name>"|"",
     "prompt": {"sha256": <16 hex>|"", "chars": <n>[, "text": <the text prompt>]},
     "format", "slot", "started_at": <unix s>, "ended_at": <unix s>|null, "duration_s": <s>|null,
     "outcome": <end reason>|null, "recording": true|false,
     "transcript": {"text": "...", "segments": [{"speaker": "agent", "start_s", "end_s", "text"}]}}

``prompt.text`` only when asked (``include_persona``: ``?include=persona``). ``start_s``/``end_s`` are
seconds from the session's start; a segment is the model's text pieces with no gap longer than
:data:`SEGMENT_GAP_S` between them. Lists (:meth:`RedisSessionReader.list`) leave the transcript and the
prompt's text out.

After an erase the reader asks Redis to rewrite its append-only file (``BGREWRITEAOF``), at most once per
``aof_rewrite_every_s`` (a later erase in the window gets the rewrite at the window's end), so the erased
text leaves Redis's files too (the node runs Redis with AOF and no RDB snapshots: docs/sessions-api.md,
"Endpoints", Erase and Redis's files).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis.asyncio as redis
import redis.exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from runtime.frontend.store import keys
from runtime.frontend.store.interface import SessionLive, SessionLog, SessionReader
from runtime.signing_keys import DEFAULT_TENANT

if TYPE_CHECKING:
    from runtime.frontend.store.redis_store import SessionStore

__all__ = ["LIST_MAX", "SEGMENT_GAP_S", "RedisSessionReader", "SessionLive", "segments"]

logger = logging.getLogger(__name__)

SEGMENT_GAP_S = 1.0
"""A pause longer than this (s) between two text pieces starts a new transcript segment."""
LIST_MAX = 1000
"""Most sessions one list call returns (``?limit=``)."""
_REWRITE_BUSY_RETRY_S = 10.0
"""Retry delay (s) of an AOF rewrite refused because another one is running (it may predate the erase)."""


def _entries(lines: list[str]) -> list[Any]:
    """The JSON lines parsed in one call (a 10-minute transcript is thousands of lines); one by one, skipping
    the bad ones, only when the whole does not parse."""
    try:
        return list(json.loads("[" + ",".join(lines) + "]"))
    except ValueError:
        parsed = []
        for raw in lines:
            try:
                parsed.append(json.loads(raw))
            except ValueError:
                continue
        return parsed


def segments(lines: list[str], started_at: float) -> list[dict[str, Any]]:
    """Timestamped pieces (``session_events.line_entry`` JSON lines) -> segments (see the module doc). A line
    that is not a valid entry is skipped."""
    out: list[dict[str, Any]] = []
    texts: list[list[str]] = []
    last_at = None
    for entry in _entries(lines):
        try:
            at, speaker, text = float(entry["at"]), str(entry["speaker"]), str(entry["text"])
        except (ValueError, KeyError, TypeError):
            continue
        offset = round(max(0.0, at - started_at), 3)
        if not out or out[-1]["speaker"] != speaker or last_at is None or at - last_at > SEGMENT_GAP_S:
            out.append({"speaker": speaker, "start_s": offset, "end_s": offset, "text": ""})
            texts.append([text])
        else:
            out[-1]["end_s"] = offset
            texts[-1].append(text)
        last_at = at
    for segment, pieces in zip(out, texts, strict=True):
        segment["text"] = "".join(pieces)
    return out


def _summary(fields: dict[str, str], *, include_persona: bool = False) -> dict[str, Any]:
    started = float(fields.get("started_at") or 0.0)
    ended = float(fields["ended_at"]) if fields.get("ended_at") else None
    prompt: dict[str, Any] = {
        "sha256": fields.get("prompt_sha256", ""),
        "chars": int(fields["prompt_chars"]) if fields.get("prompt_chars", "").isdigit() else 0,
    }
    if include_persona:
        prompt["text"] = fields.get("prompt", "")
    return {
        "id": fields.get("id", ""),
        "node": fields.get("node", ""),
        "state": fields.get("state", ""),
        "persona": fields.get("persona", ""),
        "prompt": prompt,
        "format": fields.get("format", ""),
        "slot": int(fields["slot"]) if fields.get("slot", "").isdigit() else None,
        "started_at": started,
        "ended_at": ended,
        "duration_s": None if ended is None else round(ended - started, 3),
        "outcome": fields.get("end_reason") or None,
        "recording": fields.get("recording") == "1",
    }


def _owned(fields: dict[str, str], tenant: str | None) -> bool:
    """The record (its ``tenant`` field; none: the default tenant's) belongs to ``tenant`` (None: any)."""
    return tenant is None or (fields.get("tenant") or DEFAULT_TENANT) == tenant


class RedisSessionReader:
    """The sessions API's reads and erase over the session store's keys in Redis (its own connection; ``url``
    and ``key_prefix`` as the store's). Implements :class:`~runtime.frontend.store.interface.SessionReader`.

    Args:
        url: Redis URL, e.g. ``redis://127.0.0.1:6379/0``.
        key_prefix: first component of every key (``runtime.frontend.store.keys``).
        socket_timeout_s: connect and per-command socket timeout (s).
        aof_rewrite_every_s: least time (s) between two ``BGREWRITEAOF`` asked after erases; None: never
            asked (``DUPLEX_ERASE_AOF_REWRITE_S``).
        clock: unix time (s), for the debounce.

    Every read and erase raises ``redis.exceptions.RedisError`` when Redis is unreachable; the AOF rewrite
    never raises (a refusal, e.g. an ACL without ``BGREWRITEAOF``, is logged).
    """

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "duplex",
        socket_timeout_s: float = 2.0,
        aof_rewrite_every_s: float | None = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if aof_rewrite_every_s is not None and aof_rewrite_every_s < 0:
            raise ValueError(f"aof_rewrite_every_s must be >= 0 s or None (never), not {aof_rewrite_every_s}")
        self.key_prefix = key_prefix
        self.aof_rewrite_every_s = aof_rewrite_every_s
        self._clock = clock
        self._next_rewrite = 0.0  # clock time (unix s) before which no rewrite is asked
        self._deferred: asyncio.Task[None] | None = None
        self.rewrites_asked = 0
        """``BGREWRITEAOF`` commands Redis accepted (for tests and logs)."""
        # Every command here is a read or an idempotent delete: retried once on a dropped connection, so
        # the first request after a Redis restart does not fail on a pooled connection that died with it.
        self._redis = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[redis_errors.ConnectionError],
        )

    async def close(self) -> None:
        """Cancel a deferred AOF rewrite and close the connection."""
        if self._deferred is not None:
            self._deferred.cancel()
            await asyncio.gather(self._deferred, return_exceptions=True)
        await self._redis.aclose()

    def _hash(self, session_id: str) -> str:
        return keys.session_key(self.key_prefix, session_id)

    def _indexes(self) -> tuple[str, ...]:
        prefix = self.key_prefix
        return (keys.index_key(prefix), *(keys.state_index_key(prefix, s) for s in keys.STATES))

    async def list(
        self,
        *,
        state: str | None = None,
        limit: int = 100,
        before: float | None = None,
        tenant: str | None = None,
    ) -> list[dict[str, Any]]:
        """Sessions newest first (by start time), at most ``limit``, started before ``before`` (unix s;
        for paging), in ``state`` (``active``/``ended``) and of ``tenant`` (a record without one is the
        default tenant's) when given: one range query on the index of that state
        (``{prefix}:sessions:{state}``) and one pipeline of the page's records. Ids whose record has expired
        are dropped from the indexes on the way; the prompt's text is left out.

        Raises:
            ValueError: ``state`` is not ``active``/``ended``.
        """
        index = (
            keys.index_key(self.key_prefix) if state is None else keys.state_index_key(self.key_prefix, state)
        )
        top = "+inf" if before is None else f"({before!r}"
        found: list[dict[str, Any]] = []
        offset = 0
        while len(found) < limit:
            ids = [
                str(i)
                for i in await self._redis.zrevrangebyscore(index, top, "-inf", start=offset, num=limit)
            ]
            if not ids:
                break
            offset += len(ids)
            pipe = self._redis.pipeline(transaction=False)
            for sid in ids:
                pipe.hgetall(self._hash(sid))
            records = await pipe.execute()
            gone = [sid for sid, fields in zip(ids, records, strict=True) if not fields]
            if gone:
                pipe = self._redis.pipeline(transaction=False)
                for any_index in self._indexes():
                    pipe.zrem(any_index, *gone)
                await pipe.execute()
                offset -= len(gone)
            for fields in records:
                if fields and (state is None or fields.get("state") == state) and _owned(fields, tenant):
                    found.append(_summary(fields))
        return found[:limit]

    async def read(
        self, session_id: str, *, include_persona: bool = False, tenant: str | None = None
    ) -> dict[str, Any] | None:
        """One session with its transcript (and its text prompt with ``include_persona``), or None when Redis
        holds no record of it (of ``tenant``, when given)."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.hgetall(self._hash(session_id))
        pipe.get(keys.lines_key(self.key_prefix, session_id))
        pipe.get(keys.transcript_key(self.key_prefix, session_id))
        fields, lines, text = await pipe.execute()
        if not fields or not _owned(fields, tenant):
            return None
        body = _summary(fields, include_persona=include_persona)
        pieces = (lines or "").splitlines()
        body["transcript"] = {"text": text or "", "segments": segments(pieces, body["started_at"])}
        return body

    async def state(self, session_id: str, *, tenant: str | None = None) -> str | None:
        """``active``, ``ended``, or None when Redis holds no record of the session (of ``tenant``, when
        given)."""
        state, owner = await self._redis.hmget(self._hash(session_id), ["state", "tenant"])
        if state is None or not _owned({"tenant": str(owner or "")}, tenant):
            return None
        return str(state)

    async def erase(self, session_id: str, *, tenant: str | None = None) -> bool:
        """Delete the session's record, transcripts and index entries, and its entries of the events stream
        (``XDEL`` of the ids its per-session index holds: no scan of the stream), then ask for an AOF rewrite
        (debounced). False when Redis held nothing of it (no record, no event), or when its record is
        another tenant's than ``tenant`` (left alone). After the record has expired only its stream entries
        are left, and nothing says whose they were: they are erased for the default tenant (the operator)
        or ``tenant`` None only, as the sessions API does with recordings past retention.

        Raises:
            SessionLive: the session has not ended (nothing is deleted).
        """
        prefix = self.key_prefix
        entries = keys.session_events_key(prefix, session_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hget(self._hash(session_id), "state")
        pipe.lrange(entries, 0, -1)
        pipe.hget(self._hash(session_id), "tenant")
        state, event_ids, owner = await pipe.execute()
        if state is not None and not _owned({"tenant": str(owner or "")}, tenant):
            return False
        if state is None and tenant not in (None, DEFAULT_TENANT):
            return False  # nothing says whose the leftover entries are: the operator's (default) tenant only
        if state is not None and state != "ended":
            raise SessionLive(session_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(
            self._hash(session_id),
            keys.transcript_key(prefix, session_id),
            keys.lines_key(prefix, session_id),
            entries,
        )
        for index in self._indexes():
            pipe.zrem(index, session_id)
        if event_ids:
            pipe.xdel(keys.events_key(prefix), *event_ids)
        results = await pipe.execute()
        removed_events = int(results[-1]) if event_ids else 0
        existed = state is not None or removed_events > 0
        if existed:
            await self._after_erase()
        return existed

    async def _after_erase(self) -> None:
        """Ask for an AOF rewrite now, or at the end of the debounce window (one deferred rewrite at most)."""
        every = self.aof_rewrite_every_s
        if every is None:
            return
        now = self._clock()
        if now >= self._next_rewrite:
            self._next_rewrite = now + every
            await self._rewrite_aof()
        elif self._deferred is None or self._deferred.done():
            self._deferred = asyncio.create_task(self._rewrite_later(self._next_rewrite - now))

    async def _rewrite_later(self, delay_s: float) -> None:
        await asyncio.sleep(max(0.0, delay_s))
        if self.aof_rewrite_every_s is not None:
            self._next_rewrite = self._clock() + self.aof_rewrite_every_s
        self._deferred = None  # this task is ending: a refusal below may defer a new one
        await self._rewrite_aof()

    async def _rewrite_aof(self) -> None:
        """``BGREWRITEAOF``; never raises. One refused because a rewrite is running (forked, maybe, before
        the erase) is asked again :data:`_REWRITE_BUSY_RETRY_S` later."""
        try:
            await self._redis.bgrewriteaof()
        except redis_errors.ResponseError as exc:
            if "in progress" in str(exc) and (self._deferred is None or self._deferred.done()):
                self._deferred = asyncio.create_task(self._rewrite_later(_REWRITE_BUSY_RETRY_S))
            else:
                logger.warning("sessions API: Redis refused the AOF rewrite after an erase: %s", exc)
        except Exception as exc:  # RedisError, OSError, timeouts: the next erase (or the daily one) rewrites
            logger.warning("sessions API: the AOF rewrite after an erase failed: %r", exc)
        else:
            self.rewrites_asked += 1


def _conforms(store: SessionStore, reader: RedisSessionReader) -> tuple[SessionLog, SessionReader]:
    """Never called: mypy checks here that the Redis classes implement the protocols."""
    return store, reader
