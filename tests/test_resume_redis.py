"""Redis stopped during a resume (issue 23, "A Redis outage during a session"): a real ``redis-server`` is
stopped while a dropped session's slot is held, the session is resumed and talks on and ends, then Redis is
started again.

The resume works without Redis (the slot owner checks the credential), and once Redis is back every text
piece the slot produced is in the transcript and the timestamped lines, exactly once and in order (compared
with the slot owner's own record of them, ``SinkRoute.transcript``), and the events stream has the session's
``started``, ``resumed`` and ``ended`` in that order, with one ``text`` event per piece. Both process modes
(``--workers 0``; ``--workers 2``, where the resume may land on either worker). Waits are for events; the
timeouts only stop a hung test.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis as redis_sync
from test_resume import detached, open_resumable, resume_url, session_of
from test_server_e2e import (  # noqa: F401 (bundle, speech: fixtures)
    AFTER_FRAMES,
    SLOTS,
    WAIT_S,
    WORKER_MODES,
    LiveClient,
    bundle,
    running_server,
    speech,
    wait_until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _redis_view(url: str, sid: str) -> tuple[dict[str, str], str, list[str], list[dict[str, str]]]:
    """The session hash, the transcript text, the lines' texts in order and the session's events (deduplicated
    on their ``event`` id: delivery is at least once), in stream order; empty when Redis does not answer."""
    client = redis_sync.Redis.from_url(url, decode_responses=True, socket_timeout=2)
    try:
        fields = client.hgetall(f"duplex:session:{sid}")
        text = client.get(f"duplex:transcript:{sid}") or ""
        raw_lines = client.get(f"duplex:lines:{sid}") or ""
        entries = client.xrange("duplex:events")
    except redis_sync.RedisError:
        return {}, "", [], []
    finally:
        client.close()
    seen: set[str] = set()
    events = []
    for _, entry in entries:
        if entry.get("session") == sid and entry["event"] not in seen:
            seen.add(entry["event"])
            events.append(entry)
    return fields, text, [json.loads(line)["text"] for line in raw_lines.splitlines()], events


def _subsequence(short: list[str], long: list[str]) -> bool:
    rest = iter(long)
    return all(item in rest for item in short)


@pytest.mark.parametrize("workers", WORKER_MODES)
async def test_redis_stopped_while_a_session_is_held_resume_works_and_no_line_is_lost(
    bundle,  # noqa: F811
    speech,  # noqa: F811
    redis_server,
    workers,
):
    async with running_server(bundle, redis_url=redis_server.url, workers=workers) as srv:
        a, meta = await open_resumable(srv, speech[0], resumable=1)
        sid, credential = meta["session_id"], meta["resume"]
        clients: list[LiveClient] = [a]
        try:
            await a.wait_audio(AFTER_FRAMES)
            await wait_until(lambda: bool(a.result.text), timeout_s=WAIT_S, what="some text before the drop")
            produced: list[Any] = srv.backend.holds._held[sid].route.transcript  # type: ignore[attr-defined]
            slot = session_of(srv, sid).lease.slot
            await wait_until(  # the start is in Redis before the outage (the stream's order across workers)
                lambda: "started" in [e["kind"] for e in _redis_view(redis_server.url, sid)[3]],
                timeout_s=WAIT_S,
                what="the started event written",
            )
            a.abort()
            await detached(srv)
            redis_server.stop(save=True)  # while the slot is held

            a2 = LiveClient(resume_url(srv, credential), speech[0])
            clients.append(a2)
            await a2.open()
            assert a2.result.handshake, (a2.result.errors, a2.result.close_code)
            await wait_until(lambda: bool(a2.metadata), timeout_s=WAIT_S, what="the resumed metadata")
            assert a2.metadata[0]["session_id"] == sid and a2.metadata[0]["resumed"] is True
            a2.start_streaming()
            await a2.wait_audio(AFTER_FRAMES)
            await wait_until(lambda: bool(a2.result.text), timeout_s=WAIT_S, what="text after the resume")
            result = await a2.finish(tail_s=0.3)
            assert result.close_code == 1000 and result.errors == [], (result.close_code, result.errors)
            await wait_until(
                lambda: not srv.sessions and srv.backend.status().free_slots == SLOTS,
                timeout_s=WAIT_S,
                what="the session ended and its slot freed",
            )
            pieces = [piece for _, piece in produced]
            said = "".join(pieces)  # what the clients read is in it, in order (the rest was in flight)
            assert said.startswith(a.result.text) and a2.result.text in said[len(a.result.text) :]

            redis_server.start()  # same port, with what it had saved
            store = srv.store  # type: ignore[attr-defined]
            await wait_until(
                lambda: store.connected and store.backlog == 0,
                timeout_s=WAIT_S,
                what="the session store caught up once Redis is back",
            )
            fields, text, lines, events = _redis_view(redis_server.url, sid)
            # Every piece the slot produced up to the end, in order, once: the history the resume took
            # along (the slot may produce one more after the caller's close, which is not the conversation's).
            assert lines == pieces[: len(lines)] and len(lines) >= len(pieces) - 2, (lines, pieces)
            assert said.startswith("".join(lines)) and a2.result.text in "".join(lines)
            assert fields["slot"] == str(slot)
            assert text == "".join(lines), (text, lines)
            kinds = [e["kind"] for e in events]
            lifecycle = [k for k in kinds if k != "text"]
            assert lifecycle == ["started", "resumed", "ended"], kinds
            # One text event per piece sent to a client, in order: every line but those produced while
            # the connection was dying, which no client was sent (at most a few).
            sent = [e["text"] for e in events if e["kind"] == "text"]
            assert _subsequence(sent, lines) and len(sent) >= len(lines) - 3, (sent, lines)
            assert fields["end_reason"] == "client_closed"
        finally:
            for client in clients:
                await client.discard()
