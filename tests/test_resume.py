"""Resume (issue 23, item 1): a session whose connection drops without a close frame keeps its slot,
paused, for ``DUPLEX_RESUME_S``, and a new connection with its single-use credential takes it over, through
any worker of the node.

Real servers on loopback (``tests/test_server_e2e.py``'s :func:`running_server`: ``--workers 0`` and
``--workers 2``, the engine and two front ends over ZeroMQ on one ``SO_REUSEPORT`` port), the tiny model, real
speech, a real ``redis-server`` where the transcript is read back. A drop is the client's TCP connection
aborted (no close frame). Nothing here depends on the machine's speed: waits are for events (so many audio
messages, a counter), the hold's clock is injected (``LocalSlots.holds.clock``), and a neighbour's audio is
accounted for frame by frame by the server's :class:`FrameLedger` (:func:`assert_healthy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Any

import pytest
import redis.asyncio as aioredis
from fake_clock import FakeClock
from test_server_e2e import (  # noqa: F401 (bundle, speech: fixtures)
    AFTER_FRAMES,
    SLOTS,
    WAIT_S,
    WORKER_MODES,
    LiveClient,
    assert_healthy,
    bundle,
    chat_url,
    local_metrics,
    running_server,
    speech,
    wait_until,
)
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from runtime.engine.resume import NOT_A_CREDENTIAL_MESSAGE, credential_session
from runtime.frontend.server import DuplexServer

pytestmark = pytest.mark.asyncio(loop_scope="module")


def session_of(server: DuplexServer, session_id: str) -> Any:
    """The front end's live ``ChatSession`` of ``session_id`` (None when none is live)."""
    return next((s for s in server.sessions if s.session_id == session_id), None)


async def open_resumable(
    server: DuplexServer, pcm: Any, **params: object
) -> tuple[LiveClient, dict[str, Any]]:
    """An open, streaming client that asked for resume, and its 0x04 metadata (session id, credential)."""
    client = LiveClient(chat_url(server, format="pcm", **params), pcm)
    await client.open()
    assert client.result.handshake, (client.result.errors, client.result.close_code)
    await wait_until(lambda: bool(client.metadata), timeout_s=WAIT_S, what="the 0x04 resume metadata")
    client.start_streaming()
    return client, client.metadata[0]


def resume_url(server: DuplexServer, credential: str) -> str:
    return chat_url(server, format="pcm", resume=credential)


async def refused(server: DuplexServer, credential: str, pcm: Any) -> LiveClient:
    """A resume attempt that the server refuses after the upgrade (a 0x05 error, then a close)."""
    client = LiveClient(resume_url(server, credential), pcm)
    await client.open()
    await client.wait_closed()
    assert not client.result.handshake, "the resume was granted"
    return client


async def detached(server: DuplexServer, count: int = 1) -> None:
    await wait_until(
        lambda: local_metrics(server).value("duplex_sessions_detached_total") >= count,
        timeout_s=WAIT_S,
        what=f"{count} session(s) detached",
    )


# --------------------------------------------------------------------------------------------------
# The whole path, both process modes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", WORKER_MODES)
async def test_a_dropped_session_resumes_in_its_slot_and_the_neighbour_goes_on(
    bundle,  # noqa: F811
    speech,  # noqa: F811
    redis_server,
    workers,
):
    """Drop A's TCP connection mid-session; reconnect with its credential within the hold: the same slot, the
    same session id, the transcript one text in Redis; B (Kyutai's client: no ``resumable``) sees nothing
    new and every one of its frames is accounted for."""
    async with running_server(bundle, redis_url=redis_server.url, workers=workers) as srv:
        a, meta = await open_resumable(srv, speech[0], resumable=1)
        session_id, credential = meta["session_id"], meta["resume"]
        assert credential_session(credential) is not None and credential.startswith(session_id + ".")
        assert meta["resume_s"] == srv.config.resume_s == 10
        slot = session_of(srv, session_id).lease.slot
        b = LiveClient(chat_url(srv, format="pcm"), speech[1])
        await b.open()
        b.start_streaming()
        try:
            await a.wait_audio(AFTER_FRAMES)
            await b.wait_audio(AFTER_FRAMES)
            await wait_until(lambda: bool(a.result.text), timeout_s=WAIT_S, what="some text before the drop")
            text_before = a.result.text

            a.abort()  # no close frame: a lost connection
            await detached(srv)
            assert srv.backend.status().free_slots == SLOTS - 2, "the held slot was given back"
            assert session_of(srv, session_id) is None
            mark = b.mark()
            await b.wait_audio(AFTER_FRAMES, after=mark)  # the tick goes on for the neighbour meanwhile
            paused = srv.backend.holds.slot_session(session_id)  # type: ignore[attr-defined]
            assert paused is not None and paused.paused and not paused.inbox, (
                "a detached slot is frozen, not fed silence"
            )

            a2 = LiveClient(resume_url(srv, credential), speech[0])
            await a2.open()
            try:
                assert a2.result.handshake, (a2.result.errors, a2.result.close_code)
                await wait_until(lambda: bool(a2.metadata), timeout_s=WAIT_S, what="the resumed metadata")
                again = a2.metadata[0]
                assert again["session_id"] == session_id and again["resumed"] is True
                assert again["resume"] != credential and again["resume"].startswith(session_id + ".")
                assert again["gap_ms"] >= 0
                resumed = session_of(srv, session_id)
                assert resumed is not None and resumed.lease.slot == slot
                a2.start_streaming()
                await a2.wait_audio(AFTER_FRAMES)
                assert not paused.paused, "the first frame after the resume unpauses the slot"
                result = await a2.finish(tail_s=0.6)
                assert result.close_code == 1000 and result.errors == [], (result.close_code, result.errors)
            finally:
                await a2.discard()
            await b.finish()
            assert_healthy(b, after=mark, label="the neighbour")
            assert b.metadata == [], "a client that did not ask for resume gets no metadata"
        finally:
            await a.discard()
            await b.discard()

        await wait_until(
            lambda: not srv.sessions and srv.store.backlog == 0 and srv.backend.status().free_slots == SLOTS,
            timeout_s=WAIT_S,
            what="both sessions to end and the store to flush",
        )
        metrics = local_metrics(srv)
        assert metrics.value("duplex_sessions_started_total") == 2
        assert metrics.value("duplex_sessions_resumed_total") == 1
        assert metrics.value("duplex_resume_gap_seconds_count") == 1
        assert metrics.value("duplex_sessions_ended_total", reason="client_closed") == 2
        assert metrics.total("duplex_resume_refused_total") == 0
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        try:
            keys = [key async for key in client.scan_iter(match="duplex:session:*")]
            assert len(keys) == 2, keys  # A is one session, before and after its drop
            record = await srv.store.get_session(session_id)
            assert record is not None and record["state"] == "ended", record
            assert int(record["slot"]) == slot
            transcript = await srv.store.get_transcript(session_id)
            # One text under one id: what A was sent before the drop, then what it was sent after (the
            # tail may hold a piece sent as A2 closed, and the drop may lose a piece in flight).
            assert transcript.startswith(text_before), (text_before, transcript)
            assert a2.result.text and a2.result.text in transcript[len(text_before) :], (
                a2.result.text,
                transcript,
            )
        finally:
            await client.aclose()


@pytest.mark.parametrize("workers", WORKER_MODES)
async def test_after_the_hold_the_slot_is_free_and_the_credential_refused(bundle, speech, workers):  # noqa: F811
    """The hold's clock moves past ``resume_s``: the slot frees, the session ends ``resume_expired``, and its
    credential is refused with a clear reason (1008); a fresh session is admitted as usual."""
    async with running_server(bundle, workers=workers) as srv:
        clock = FakeClock()
        srv.backend.holds.clock = clock  # type: ignore[attr-defined]
        a, meta = await open_resumable(srv, speech[0], resumable=1)
        try:
            await a.wait_audio(AFTER_FRAMES)
            a.abort()
            await detached(srv)
            assert srv.backend.status().free_slots == SLOTS - 1
            clock.advance(srv.config.resume_s - 0.5)
            await asyncio.sleep(0.3)  # a few sweeps: still inside the hold
            assert srv.backend.status().free_slots == SLOTS - 1, "freed before the hold ran out"
            clock.advance(1.0)
            await wait_until(
                lambda: (
                    srv.backend.status().free_slots == SLOTS
                    and local_metrics(srv).value("duplex_sessions_ended_total", reason="resume_expired") == 1
                ),
                timeout_s=WAIT_S,
                what="the slot freed and the session ended resume_expired",
            )
            late = await refused(srv, meta["resume"], speech[0])
            assert late.result.close_code == 1008, late.result.close_code
            assert "cannot be resumed" in late.result.errors[0] and "ran out" in late.result.errors[0]
            metrics = local_metrics(srv)
            assert metrics.value("duplex_resume_refused_total", reason="resume_expired") == 1
            assert metrics.value("duplex_sessions_resumed_total") == 0
            fresh = LiveClient(chat_url(srv, format="pcm"), speech[1])
            await fresh.open()
            fresh.start_streaming()
            await fresh.wait_audio(AFTER_FRAMES)
            await fresh.finish()
            assert_healthy(fresh, label="a new session after the refusal")
        finally:
            await a.discard()


@pytest.mark.parametrize("workers", WORKER_MODES)
async def test_a_resume_cancelled_before_its_first_frame_leaves_the_session_to_a_retry(
    bundle,  # noqa: F811
    speech,  # noqa: F811
    workers,
):
    """The reconnecting client presents its credential, gets the handshake and the next credential, and is
    gone before its first frame: the slot is held again, and its retry with the credential it presented is
    granted (the same slot and session id, audio again). The retry's first frame spends that credential
    (a replay: ``resume_replayed``); the one issued to the cancelled resume is void (``resume_invalid``)."""
    async with running_server(bundle, workers=workers) as srv:
        a, meta = await open_resumable(srv, speech[0], resumable=1)
        sid, credential = meta["session_id"], meta["resume"]
        clients = [a]
        try:
            await a.wait_audio(AFTER_FRAMES)
            slot = session_of(srv, sid).lease.slot
            a.abort()
            await detached(srv)
            gone = LiveClient(resume_url(srv, credential), speech[0])
            clients.append(gone)
            await gone.open()
            assert gone.result.handshake, (gone.result.errors, gone.result.close_code)
            await wait_until(lambda: bool(gone.metadata), timeout_s=WAIT_S, what="the resumed metadata")
            gone.abort()  # no frame sent: the client went away mid-resume
            await detached(srv, 2)
            assert srv.backend.status().free_slots == SLOTS - 1, "the slot was given back"

            retry = LiveClient(resume_url(srv, credential), speech[0])
            clients.append(retry)
            await retry.open()
            assert retry.result.handshake, (retry.result.errors, retry.result.close_code)
            await wait_until(lambda: bool(retry.metadata), timeout_s=WAIT_S, what="the retry's metadata")
            assert retry.metadata[0]["session_id"] == sid and retry.metadata[0]["resumed"] is True
            assert session_of(srv, sid).lease.slot == slot
            retry.start_streaming()
            await retry.wait_audio(AFTER_FRAMES)
            replay = await refused(srv, credential, speech[2])
            assert "used already" in replay.result.errors[0], replay.result.errors
            void = await refused(srv, gone.metadata[0]["resume"], speech[2])
            assert "not a resume credential" in void.result.errors[0], void.result.errors
            result = await retry.finish(tail_s=0.3)
            assert result.close_code == 1000 and result.errors == [], (result.close_code, result.errors)
            metrics = local_metrics(srv)
            assert metrics.value("duplex_sessions_resumed_total") == 2
            assert metrics.value("duplex_sessions_started_total") == 1
            assert metrics.value("duplex_resume_refused_total", reason="resume_replayed") == 1
            assert metrics.value("duplex_resume_refused_total", reason="resume_invalid") == 1
        finally:
            for client in clients:
                await client.discard()
        await wait_until(
            lambda: not srv.sessions and srv.backend.status().free_slots == SLOTS,
            timeout_s=WAIT_S,
            what="every slot free",
        )


# --------------------------------------------------------------------------------------------------
# Bad credentials, replays, no takeover of a live session, a flood
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", WORKER_MODES)
async def test_wrong_replayed_and_foreign_credentials_are_refused_and_harm_nothing(bundle, speech, workers):  # noqa: F811
    """Malformed, unknown, another session's id with this secret, a credential used already: each refused
    (1008, the reason named), and the live sessions go on; a valid credential presented while its session's
    connection is live and streaming is refused ``resume_live`` (issue 34, item 1: no takeover) and the same
    credential resumes the session once that connection is lost."""
    async with running_server(bundle, workers=workers) as srv:
        a, meta_a = await open_resumable(srv, speech[0], resumable=1)
        b, meta_b = await open_resumable(srv, speech[1], resumable="true")
        try:
            sid_a, secret_a = credential_session(meta_a["resume"]) or ("", "")
            sid_b, secret_b = credential_session(meta_b["resume"]) or ("", "")
            cases = {
                "not-a-credential": ("resume_invalid", "malformed"),
                # Issue 34, item 11: an unknown id and a known id with a wrong secret get the same words.
                f"{'0' * 32}.{secret_a}": ("resume_invalid", NOT_A_CREDENTIAL_MESSAGE),
                f"{sid_a}.{secret_b}": ("resume_invalid", NOT_A_CREDENTIAL_MESSAGE),
            }
            for credential, (_reason, words) in cases.items():
                attempt = await refused(srv, credential, speech[2])
                assert attempt.result.close_code == 1008, (credential, attempt.result.close_code)
                assert words in attempt.result.errors[0], (credential, attempt.result.errors)
            assert local_metrics(srv).value("duplex_resume_refused_total", reason="resume_invalid") == 3

            # Issue 34: a valid credential while A is connected and streaming (a takeover) is refused
            # resume_live after the upgrade (1008); the taker gets no handshake, no audio, no text; A keeps
            # its call, on the same connection, and its credential.
            thief = await refused(srv, meta_a["resume"], speech[2])
            assert thief.result.close_code == 1008, thief.result.close_code
            assert "is live on its connection" in thief.result.errors[0], thief.result.errors
            assert thief.result.audio_messages == 0 and thief.result.text == "" and thief.metadata == []
            assert local_metrics(srv).value("duplex_resume_refused_total", reason="resume_live") == 1
            mark = a.mark()
            await a.wait_audio(AFTER_FRAMES, after=mark)
            assert not a.closed.is_set() and session_of(srv, sid_a) is not None

            # A's connection really drops (no close frame): its credential, untouched, resumes it.
            a.abort()
            await detached(srv)
            a2 = LiveClient(resume_url(srv, meta_a["resume"]), speech[0])
            await a2.open()
            try:
                assert a2.result.handshake, a2.result.errors
                await wait_until(lambda: bool(a2.metadata), timeout_s=WAIT_S, what="the resumed metadata")
                assert a2.metadata[0]["resumed"] is True and a2.metadata[0]["session_id"] == sid_a
                a2.start_streaming()
                await a2.wait_audio(AFTER_FRAMES)
                replay = await refused(srv, meta_a["resume"], speech[2])  # the same credential again
                assert replay.result.close_code == 1008
                assert "used already" in replay.result.errors[0], replay.result.errors
                mark = b.mark()
                await b.wait_audio(AFTER_FRAMES, after=mark)
                await a2.wait_audio(AFTER_FRAMES, after=mark)
                assert session_of(srv, sid_a) is not None and session_of(srv, sid_b) is not None
                await a2.finish(tail_s=0.3)
            finally:
                await a2.discard()
            await b.finish(tail_s=0.3)
            assert b.result.errors == [] and b.result.close_code == 1000
            metrics = local_metrics(srv)
            assert metrics.value("duplex_resume_refused_total", reason="resume_replayed") == 1
            assert metrics.total("duplex_admissions_refused_total") == 0, "a resume refusal counted twice"
            assert metrics.value("duplex_sessions_resumed_total") == 1
            assert metrics.value("duplex_sessions_ended_total", reason="client_closed") == 2  # A once, B once
        finally:
            await a.discard()
            await b.discard()
        await wait_until(
            lambda: not srv.sessions and srv.backend.status().free_slots == SLOTS,
            timeout_s=WAIT_S,
            what="every slot free",
        )


async def test_a_resume_flood_from_one_address_is_rate_limited(bundle, speech):  # noqa: F811
    """Resume attempts count against the handshake rate limits like any upgrade: past the burst, 429 before
    any work; the live session streams on, every frame accounted for."""
    async with running_server(bundle, handshake_rate_per_client=0.01, handshake_burst_per_client=4) as srv:
        live_client = LiveClient(chat_url(srv, format="pcm"), speech[0])
        await live_client.open()  # takes one token of the burst
        live_client.start_streaming()
        mark = live_client.mark()
        try:
            statuses = []
            for i in range(12):
                credential = f"{hashlib.md5(str(i).encode()).hexdigest()}.{'x' * 43}"  # noqa: S324 (an id)
                try:
                    async with connect(resume_url(srv, credential), open_timeout=WAIT_S, proxy=None) as ws:
                        with contextlib.suppress(ConnectionClosed):
                            async for _ in ws:
                                pass
                        statuses.append(ws.close_code)
                except InvalidStatus as exc:
                    statuses.append(exc.response.status_code)
            assert statuses[:3] == [1008] * 3 and statuses[3:] == [429] * 9, statuses
            metrics = local_metrics(srv)
            assert metrics.value("duplex_resume_refused_total", reason="resume_invalid") == 3
            # Each refusal counts once, where its connection belongs: resumes in duplex_resume_refused_total.
            assert metrics.value("duplex_resume_refused_total", reason="rate_limited") == 9
            assert metrics.total("duplex_admissions_refused_total") == 0
            await live_client.wait_audio(AFTER_FRAMES, after=mark)
            await live_client.finish()
            assert_healthy(live_client, after=mark, label="the session beside the flood")
        finally:
            await live_client.discard()


async def test_a_resume_while_draining_is_refused_and_counted_once_as_a_resume(bundle, speech):  # noqa: F811
    """The node drains while a session is held: its resume is refused (``draining``, 1013), counted in
    ``duplex_resume_refused_total`` and not in ``duplex_admissions_refused_total`` (each refusal once)."""
    async with running_server(bundle) as srv:
        a, meta = await open_resumable(srv, speech[0], resumable=1)
        b = LiveClient(chat_url(srv, format="pcm"), speech[1])  # keeps the drain in its grace period
        await b.open()
        b.start_streaming()
        try:
            await a.wait_audio(AFTER_FRAMES)
            a.abort()
            await detached(srv)
            drain = asyncio.create_task(srv.drain(grace_s=3600.0))
            await asyncio.sleep(0)  # let the drain begin
            assert srv.draining
            late = await refused(srv, meta["resume"], speech[1])
            assert late.result.close_code == 1013 and "draining" in late.result.errors[0], late.result.errors
            metrics = local_metrics(srv)
            assert metrics.value("duplex_resume_refused_total", reason="draining") == 1
            assert metrics.total("duplex_admissions_refused_total") == 0
            await asyncio.wait_for(srv.drain(grace_s=0.0), WAIT_S)
            assert drain.done()
        finally:
            await a.discard()
            await b.discard()


async def test_resume_off_offers_no_credential_and_refuses_resumes(bundle, speech):  # noqa: F811
    """``DUPLEX_RESUME_S=0``: ``resumable=1`` gets the session id and no credential; a drop ends the session
    at once (slot free); ``resume=`` is refused ``resume_off``."""
    async with running_server(bundle, resume_s=0) as srv:
        a, meta = await open_resumable(srv, speech[0], resumable=1)
        try:
            assert set(meta) == {"session_id", "node", "resume_s"} and meta["resume_s"] == 0, meta
            await a.wait_audio(AFTER_FRAMES)
            a.abort()
            await wait_until(
                lambda: srv.backend.status().free_slots == SLOTS, timeout_s=WAIT_S, what="the slot freed"
            )
            attempt = await refused(srv, f"{meta['session_id']}.{'x' * 43}", speech[0])
            assert attempt.result.close_code == 1008 and "DUPLEX_RESUME_S=0" in attempt.result.errors[0]
            assert local_metrics(srv).value("duplex_sessions_detached_total") == 0
        finally:
            await a.discard()


async def test_a_resume_through_the_other_worker_takes_the_slot_over_through_the_engine(
    bundle,  # noqa: F811
    speech,  # noqa: F811
):
    """``--workers 2``: the kernel spreads connections over the two workers (``SO_REUSEPORT``), so a resume
    lands on either. Drop and resume until one lands on the other worker (each try is itself a drop and a
    resume on the same worker): the engine hands the slot's lease over, the old worker forgets the session,
    the audio flows through the new one."""
    async with running_server(bundle, workers=2) as srv:
        a, meta = await open_resumable(srv, speech[0], resumable=1)
        sid, credential = meta["session_id"], meta["resume"]
        clients = [a]

        def holder() -> int:
            return next(i for i, w in enumerate(srv.workers) if any(s.session_id == sid for s in w.sessions))  # type: ignore[attr-defined]

        try:
            await a.wait_audio(AFTER_FRAMES)
            first = holder()
            same_worker_resumes = 0
            for attempt in range(1, 17):
                clients[-1].abort()
                await detached(srv, attempt)
                nxt = LiveClient(resume_url(srv, credential), speech[0])
                clients.append(nxt)
                await nxt.open()
                assert nxt.result.handshake, (nxt.result.errors, nxt.result.close_code)
                await wait_until(
                    lambda c=nxt: bool(c.metadata), timeout_s=WAIT_S, what="the resumed metadata"
                )
                credential = nxt.metadata[0]["resume"]
                nxt.start_streaming()
                await nxt.wait_audio(AFTER_FRAMES)
                if holder() != first:
                    break
                same_worker_resumes += 1
            else:
                raise AssertionError("16 resumes all landed on the first worker")
            now = holder()
            old_client = srv.workers[first].backend  # type: ignore[attr-defined]
            assert sid not in old_client._sinks, "the old worker still delivers to the session"
            assert sid in srv.workers[now].backend._sinks  # type: ignore[attr-defined]
            assert srv.engine.sessions[sid].worker.startswith(f"worker-{now}:".encode())  # type: ignore[attr-defined]
            mark = clients[-1].mark()
            await clients[-1].wait_audio(AFTER_FRAMES, after=mark)
            result = await clients[-1].finish(tail_s=0.3)
            assert result.close_code == 1000 and result.errors == []
            metrics = local_metrics(srv)
            assert metrics.value("duplex_sessions_resumed_total") == same_worker_resumes + 1
            assert metrics.value("duplex_sessions_started_total") == 1
        finally:
            for client in clients:
                await client.discard()
        await wait_until(
            lambda: not srv.sessions and srv.backend.status().free_slots == SLOTS,
            timeout_s=WAIT_S,
            what="the slot freed",
        )
