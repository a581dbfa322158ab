"""What the sessions API reads and erases in Redis: the session store's records, read back for applications.

The store (``runtime.frontend.store.redis_store``) writes; this module only reads, and erases on request. What
it can return is what Redis still holds: every key expires ``transcript_ttl_s`` after its last write (the
retention), so an expired session is unknown here (404), like one never started.

A session as the API returns it (:meth:`SessionRecords.read`)::

    {"id", "node", "state": "active"|"ended", "persona", "format", "slot",
     "started_at": <unix s>, "ended_at": <unix s>|null, "duration_s": <s>|null,
     "outcome": <end reason>|null, "recording": true|false,
     "transcript": {"text": "...", "segments": [{"speaker": "agent", "start_s", "end_s", "text"}]}}

``start_s``/``end_s`` are seconds from the session's start; a segment is the model's text pieces with no
gap longer than :data:`SEGMENT_GAP_S` between them. Lists (:meth:`SessionRecords.list`) leave the
transcript out.
"""

from __future__ import annotations

import json
from typing import Any, cast

import redis.asyncio as redis
import redis.exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from runtime.frontend.store.events import events_key, index_key, lines_key
from runtime.signing_keys import DEFAULT_TENANT

__all__ = ["LIST_MAX", "SEGMENT_GAP_S", "SessionLive", "SessionRecords", "segments"]

SEGMENT_GAP_S = 1.0
"""A pause longer than this (s) between two text pieces starts a new transcript segment."""
LIST_MAX = 1000
"""Most sessions one list call returns (``?limit=``)."""
_ERASE_SCAN = 1000


class SessionLive(Exception):
    """The session is still going on: it cannot be erased (nor its recording read) before it ends."""


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


def _summary(fields: dict[str, str]) -> dict[str, Any]:
    started = float(fields.get("started_at") or 0.0)
    ended = float(fields["ended_at"]) if fields.get("ended_at") else None
    return {
        "id": fields.get("id", ""),
        "node": fields.get("node", ""),
        "state": fields.get("state", ""),
        "persona": fields.get("persona", ""),
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


class SessionRecords:
    """Reads of the session store's keys in Redis (its own connection; ``url`` and ``key_prefix`` as the
    store's). Every method raises ``redis.exceptions.RedisError`` when Redis is unreachable."""

    def __init__(self, url: str, *, key_prefix: str = "duplex", socket_timeout_s: float = 2.0) -> None:
        self.key_prefix = key_prefix
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
        await self._redis.aclose()

    def _hash(self, session_id: str) -> str:
        return f"{self.key_prefix}:session:{session_id}"

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
        default tenant's) when given. Ids whose record has expired are dropped from the index on the
        way."""
        index = index_key(self.key_prefix)
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
                await self._redis.zrem(index, *gone)
                offset -= len(gone)
            for fields in records:
                if fields and (state is None or fields.get("state") == state) and _owned(fields, tenant):
                    found.append(_summary(fields))
        return found[:limit]

    async def read(self, session_id: str, *, tenant: str | None = None) -> dict[str, Any] | None:
        """One session with its transcript, or None when Redis holds no record of it (of ``tenant``,
        when given)."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.hgetall(self._hash(session_id))
        pipe.get(lines_key(self.key_prefix, session_id))
        pipe.get(f"{self.key_prefix}:transcript:{session_id}")
        fields, lines, text = await pipe.execute()
        if not fields or not _owned(fields, tenant):
            return None
        body = _summary(fields)
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
        """Delete the session's record, transcripts and index entry, and its entries of the events
        stream; False when Redis held no record of it (of ``tenant``, when given: another tenant's
        session is left alone).

        Raises:
            SessionLive: the session has not ended (nothing is deleted).
        """
        state = await self.state(session_id, tenant=tenant)
        if state is None:
            return False
        if state != "ended":
            raise SessionLive(session_id)
        prefix = self.key_prefix
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(
            self._hash(session_id), f"{prefix}:transcript:{session_id}", lines_key(prefix, session_id)
        )
        pipe.zrem(index_key(prefix), session_id)
        await pipe.execute()
        await self._erase_events(session_id)
        return True

    async def _erase_events(self, session_id: str) -> int:
        """``XDEL`` the session's entries of the (bounded) events stream, read in pages."""
        stream, start, removed = events_key(self.key_prefix), "-", 0
        while True:
            page = await self._redis.xrange(stream, min=start, max="+", count=_ERASE_SCAN)
            entries = cast(list[tuple[str, dict[str, str]]], page or [])
            mine = [entry_id for entry_id, fields in entries if (fields or {}).get("session") == session_id]
            if mine:
                removed += int(await self._redis.xdel(stream, *mine))
            if len(entries) < _ERASE_SCAN:
                return removed
            start = "(" + str(entries[-1][0])
