"""Resume over WebRTC (issue 23, item 1, on ``/api/rtc``): a resumable call (``resumable=1``) whose UDP path
is lost (no RTP for ``rtc_media_timeout_s``, no DTLS close, no ``DELETE``) keeps its slot, paused, for
``DUPLEX_RESUME_S``; ``POST /api/rtc?resume=<credential>`` with a fresh offer takes it over, through any
worker; the credential crosses transports both ways (``/api/chat?resume=``); refusals come before the answer
with ``/api/chat``'s reasons and statuses and take no slot; a normal close (``DELETE``, the client's DTLS
close, the DataChannel closed) holds nothing.

Real servers on loopback in both process modes (``tests/test_server_e2e.py``'s :func:`running_server`), a
real aiortc caller (``runtime/tools/rtc_client.py``; aioice skips loopback, so ICE runs over this machine's
other interfaces while the HTTP goes to 127.0.0.1, as in tests/test_rtc.py), the sim model, access control
on (a resume carries no token: the credential is the right). A drop is :meth:`RtcCall.drop`: the caller's ICE
sockets aborted, nothing sent. Waits are for events with a hang guard; the hold's clock is injected.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from fake_clock import FakeClock
from test_access_control import token
from test_rtc import delete_from_another_worker, rtc_settings, url
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

from runtime.engine.resume import credential_session
from runtime.frontend.server import DuplexServer
from runtime.tools.resume_bench_rtc import run_rtc_trial
from runtime.tools.rtc_client import RtcCall, encode_packets

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def packets(speech: list[np.ndarray]) -> list[bytes]:  # noqa: F811
    return encode_packets(speech[0])


@pytest_asyncio.fixture(loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def session_of(server: DuplexServer, session_id: str) -> Any:
    """The front end's live ``ChatSession`` of ``session_id`` (None when none is live)."""
    return next((s for s in server.sessions if s.session_id == session_id), None)


def value(server: DuplexServer, name: str, **labels: str) -> float:
    return local_metrics(server).value(name, **labels)


async def detached(server: DuplexServer, count: int = 1) -> None:
    await wait_until(
        lambda: value(server, "duplex_sessions_detached_total") >= count,
        timeout_s=WAIT_S,
        what=f"{count} session(s) detached",
    )


async def first_frames_taken(server: DuplexServer, session_id: str, frames: int = 2) -> None:
    """The live session ``session_id`` has pushed ``frames`` input frames to its slot: a resume's first frame
    spends the credential it presented (runtime.engine.resume, ``confirm``), so a replay after this is
    refused rather than taken for a retry."""

    def pushed() -> bool:
        return any(s.session_id == session_id and s.frames_in >= frames for s in server.sessions)

    await wait_until(pushed, timeout_s=WAIT_S, what=f"{frames} input frames of session {session_id}")


async def free_slots(server: DuplexServer, count: int) -> None:
    await wait_until(
        lambda: server.backend.status().free_slots == count,
        timeout_s=WAIT_S,
        what=f"{count} free slots",
    )


async def live_call(
    server: DuplexServer, http: aiohttp.ClientSession, packets: list[bytes], query: str
) -> RtcCall:
    """A connected call that has its handshake, its 0x04 metadata (when it asked) and audio back."""
    call = RtcCall(url(server), packets, token=None if "resume=" in query else token(), query=query)
    outcome = await call.start(http)
    assert outcome.status == 201, (outcome.status, outcome.body)
    await asyncio.wait_for(call.handshake.wait(), WAIT_S)
    await asyncio.wait_for(call.audio_arrived.wait(), WAIT_S)
    if "resum" in query:
        await asyncio.wait_for(call.got_metadata.wait(), WAIT_S)
    return call


async def refused(
    server: DuplexServer, http: aiohttp.ClientSession, packets: list[bytes], credential: str
) -> Any:
    """A resume offer that must be refused: no answer, no Location, no slot taken."""
    free = server.backend.status().free_slots
    call = RtcCall(url(server), packets, query=f"resume={credential}")
    outcome = await call.start(http)
    assert outcome.status != 201 and not outcome.answer_sdp and "Location" not in outcome.headers, outcome
    assert server.backend.status().free_slots == free, "a refused resume took a slot"
    return outcome


async def closed(*calls: RtcCall) -> None:
    for call in calls:
        with contextlib.suppress(Exception):
            await call.close()


@pytest.mark.parametrize("workers", WORKER_MODES)
async def test_a_dropped_call_resumes_over_webrtc_in_its_slot_and_the_neighbour_goes_on(
    bundle,  # noqa: F811
    speech,  # noqa: F811
    packets,
    http,
    redis_server,
    workers,
):
    """Drop A's UDP path mid-call; a fresh offer with its credential (no token) within the hold: the same
    slot and session id, a new credential, audio again, one transcript in Redis; B (a WebSocket neighbour)
    has every frame accounted for."""
    settings = rtc_settings(redis_url=redis_server.url)
    async with running_server(bundle, workers=workers, **settings) as srv:
        a = await live_call(srv, http, packets, "resumable=1&seed=3")
        a2: RtcCall | None = None
        b = LiveClient(chat_url(srv, format="pcm"), speech[1], token=token())
        try:
            meta = a.outcome.metadata[0]
            session_id, credential = meta["session_id"], meta["resume"]
            assert credential.startswith(session_id + ".") and meta["resume_s"] == srv.config.resume_s
            assert "resumed" not in meta
            slot = session_of(srv, session_id).lease.slot
            await b.open()
            b.start_streaming()
            await b.wait_audio(AFTER_FRAMES)
            await wait_until(lambda: bool(a.outcome.texts), timeout_s=WAIT_S, what="text before the drop")
            text_before = "".join(a.outcome.texts)

            a.drop()  # the UDP path goes: no DTLS close, no DELETE
            await detached(srv)
            assert srv.backend.status().free_slots == SLOTS - 2, "the held slot was given back"
            assert session_of(srv, session_id) is None
            assert value(srv, "duplex_sessions_ended_total", reason="rtc_media_timeout") == 0
            mark = b.mark()
            await b.wait_audio(AFTER_FRAMES, after=mark)

            a2 = await live_call(srv, http, packets, f"resume={credential}")
            again = a2.outcome.metadata[0]
            assert again["session_id"] == session_id and again["resumed"] is True and again["gap_ms"] >= 0
            assert again["resume"] != credential and again["resume"].startswith(session_id + ".")
            resumed = session_of(srv, session_id)
            assert resumed is not None and resumed.lease.slot == slot
            assert a2.outcome.headers["Location"][0].startswith(f"/api/rtc/{session_id}/")
            count = len(a2.outcome.texts)
            await wait_until(
                lambda: len(a2.outcome.texts) > count, timeout_s=WAIT_S, what="text after resume"
            )
            assert await a2.hang_up(http) == 200
            await b.finish()
            assert_healthy(b, after=mark, label="the neighbour")
        finally:
            await closed(a, *([a2] if a2 else []))
            await b.discard()
        await wait_until(
            lambda: not srv.sessions and srv.store.backlog == 0 and srv.backend.status().free_slots == SLOTS,
            timeout_s=WAIT_S,
            what="every session ended and the store flushed",
        )
        assert value(srv, "duplex_sessions_resumed_total") == 1
        assert value(srv, "duplex_sessions_ended_total", reason="client_closed") == 2  # A once, B once
        assert local_metrics(srv).total("duplex_resume_refused_total") == 0
        record = await srv.store.get_session(session_id)
        assert record is not None and record["state"] == "ended" and int(record["slot"]) == slot, record
        transcript = await srv.store.get_transcript(session_id)
        assert transcript.startswith(text_before), (text_before, transcript)
        after = "".join(a2.outcome.texts)
        assert after and after in transcript[len(text_before) :], (after, transcript)
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        try:
            keys = [key async for key in client.scan_iter(match="duplex:session:*")]
            assert len(keys) == 2, keys  # A is one session before and after its drop
        finally:
            await client.aclose()


@pytest.mark.parametrize("workers", WORKER_MODES)
async def test_the_credential_crosses_transports_both_ways(bundle, speech, packets, http, workers):  # noqa: F811
    """A WebRTC call dropped, resumed on ``/api/chat?resume=``; that WebSocket dropped, resumed on
    ``POST /api/rtc?resume=``: one session id and one slot throughout."""
    async with running_server(bundle, workers=workers, **rtc_settings()) as srv:
        a = await live_call(srv, http, packets, "resumable=1")
        ws: LiveClient | None = None
        a3: RtcCall | None = None
        try:
            meta = a.outcome.metadata[0]
            session_id = meta["session_id"]
            slot = session_of(srv, session_id).lease.slot
            a.drop()
            await detached(srv, 1)

            ws = LiveClient(chat_url(srv, format="pcm", resume=meta["resume"]), speech[0])
            await ws.open()
            assert ws.result.handshake, (ws.result.errors, ws.result.close_code)
            await wait_until(lambda: bool(ws and ws.metadata), timeout_s=WAIT_S, what="the WebSocket's 0x04")
            over_ws = ws.metadata[0]
            assert over_ws["session_id"] == session_id and over_ws["resumed"] is True
            assert session_of(srv, session_id).lease.slot == slot
            ws.start_streaming()
            await ws.wait_audio(AFTER_FRAMES)
            ws.abort()  # the TCP connection cut: no close frame
            await detached(srv, 2)

            a3 = await live_call(srv, http, packets, f"resume={over_ws['resume']}")
            over_rtc = a3.outcome.metadata[0]
            assert over_rtc["session_id"] == session_id and over_rtc["resumed"] is True
            assert over_rtc["resume"] not in (meta["resume"], over_ws["resume"])
            assert session_of(srv, session_id).lease.slot == slot
            # One live session, counted on the transport that carries it now (each transport it left
            # counted it down: its part ended), and on no other.
            await wait_until(
                lambda: active(srv, "websocket") == 0 and active(srv, "webrtc") == 1,
                timeout_s=WAIT_S,
                what="the session active on WebRTC only",
            )
            assert await a3.hang_up(http) == 200
        finally:
            await closed(a, *([a3] if a3 else []))
            if ws is not None:
                await ws.discard()
        await free_slots(srv, SLOTS)
        assert value(srv, "duplex_sessions_resumed_total") == 2
        assert value(srv, "duplex_sessions_started_total") == 1
        await wait_until(
            lambda: active(srv, "websocket") == 0 and active(srv, "webrtc") == 0,
            timeout_s=WAIT_S,
            what="no session active on either transport",
        )


def active(server: DuplexServer, transport: str) -> float:
    """``duplex_transport_sessions_active`` of ``transport`` (0 when never set)."""
    return value(server, "duplex_transport_sessions_active", transport=transport) or 0.0


@pytest.mark.parametrize("workers", WORKER_MODES)
async def test_after_the_hold_a_resume_is_refused_before_the_answer_and_the_slot_is_free(
    bundle,  # noqa: F811
    packets,
    http,
    workers,
):
    async with running_server(bundle, workers=workers, **rtc_settings()) as srv:
        clock = FakeClock()
        srv.backend.holds.clock = clock  # type: ignore[attr-defined]
        a = await live_call(srv, http, packets, "resumable=1")
        try:
            credential = a.outcome.metadata[0]["resume"]
            a.drop()
            await detached(srv)
            assert srv.backend.status().free_slots == SLOTS - 1
            clock.advance(srv.config.resume_s + 0.5)
            await wait_until(
                lambda: (
                    srv.backend.status().free_slots == SLOTS
                    and value(srv, "duplex_sessions_ended_total", reason="resume_expired") == 1
                ),
                timeout_s=WAIT_S,
                what="the slot freed and the session ended resume_expired",
            )
            late = await refused(srv, http, packets, credential)
            assert late.status == 410 and late.body.startswith("resume_expired: "), (late.status, late.body)
            assert value(srv, "duplex_resume_refused_total", reason="resume_expired") == 1
        finally:
            await closed(a)
        assert not srv.sessions


@pytest.mark.parametrize("workers", WORKER_MODES)
async def test_replayed_foreign_and_malformed_credentials_are_refused_and_take_nothing(
    bundle,  # noqa: F811
    packets,
    http,
    workers,
):
    """Each refused before any answer (the WebSocket's reasons and statuses), no slot taken, the live calls
    untouched; a valid credential while A is connected and sending is refused ``resume_live`` (issue 34,
    item 1), and resumes A's call once A's path is lost, before the server noticed the loss."""
    async with running_server(bundle, workers=workers, **rtc_settings()) as srv:
        a = await live_call(srv, http, packets, "resumable=1")
        b = await live_call(srv, http, packets, "resumable=1")
        a2: RtcCall | None = None
        try:
            sid_a, secret_a = credential_session(a.outcome.metadata[0]["resume"]) or ("", "")
            _, secret_b = credential_session(b.outcome.metadata[0]["resume"]) or ("", "")
            for credential, words in (
                (f"{'0' * 32}.{secret_a}", "not a resume credential of a session on this node"),
                (f"{sid_a}.{secret_b}", "not a resume credential of a session on this node"),
            ):
                answer = await refused(srv, http, packets, credential)
                assert answer.status == 403 and answer.body.startswith("resume_invalid: "), answer.body
                assert words in answer.body, answer.body
            malformed = await refused(srv, http, packets, "not-a-credential")
            assert malformed.status in (400, 403) and "credential" in malformed.body, malformed.body

            # Issue 34: a valid credential while A is connected and sending (a takeover) is refused
            # resume_live before any answer; A keeps its call and its credential.
            credential_a = a.outcome.metadata[0]["resume"]
            thief = await refused(srv, http, packets, credential_a)
            assert thief.status == 409 and thief.body.startswith("resume_live: "), (thief.status, thief.body)
            assert value(srv, "duplex_resume_refused_total", reason="resume_live") == 1
            before_a = a.outcome.packets_in
            await wait_until(lambda: a.outcome.packets_in > before_a + 10, timeout_s=WAIT_S, what="A's audio")
            assert session_of(srv, sid_a) is not None

            # A's UDP path goes (no DTLS close, no DELETE) and A resumes at once, before the server's media
            # timeout noticed: its frames stopped, so the liveness probe takes its old call for lost.
            a.drop()
            a2 = await live_call(srv, http, packets, f"resume={credential_a}")
            assert a2.outcome.metadata[0]["session_id"] == sid_a
            await wait_until(
                lambda: srv.backend.status().free_slots == SLOTS - 2, timeout_s=WAIT_S, what="2 slots"
            )
            await first_frames_taken(srv, sid_a)
            replay = await refused(srv, http, packets, a.outcome.metadata[0]["resume"])
            assert replay.status == 403 and replay.body.startswith("resume_replayed: "), replay.body
            before = b.outcome.packets_in
            await wait_until(lambda: b.outcome.packets_in > before + 10, timeout_s=WAIT_S, what="B's audio")
            assert value(srv, "duplex_resume_refused_total", reason="resume_invalid") == 2 + (
                malformed.status == 403
            )
            assert value(srv, "duplex_resume_refused_total", reason="resume_replayed") == 1
            for call in (a2, b):
                assert await call.hang_up(http) == 200
        finally:
            await closed(a, b, *([a2] if a2 else []))
        await free_slots(srv, SLOTS)
        # A's old call was taken for lost by the probe, or detached by the media timeout meanwhile
        assert value(srv, "duplex_sessions_detached_total") in (0, 1)


async def test_normal_closes_hold_nothing_and_a_delete_ends_a_hold(bundle, packets, http):  # noqa: F811
    """``DELETE``, the client's DTLS close and its DataChannel closed end a resumable call at once (no hold,
    the credential refused); a ``DELETE`` of a held call's Location gives its slot back."""
    async with running_server(bundle, workers=0, **rtc_settings()) as srv:
        ended = 0
        for how in ("delete", "dtls_close", "channel_close"):
            call = await live_call(srv, http, packets, "resumable=1")
            try:
                if how == "delete":
                    assert await call.hang_up(http) == 200
                elif how == "dtls_close":  # close_notify alone: the DataChannel is not closed first
                    await call.pc.getTransceivers()[0].receiver.transport.stop()
                else:
                    assert call.channel is not None
                    call.channel.close()
                ended += 1
                await wait_until(
                    lambda ended=ended: (
                        value(srv, "duplex_sessions_ended_total", reason="client_closed") == ended
                    ),
                    timeout_s=WAIT_S,
                    what=f"the call ended by {how}",
                )
                await free_slots(srv, SLOTS)
                answer = await refused(srv, http, packets, call.outcome.metadata[0]["resume"])
                assert answer.status in (403, 410), (how, answer.status, answer.body)
            finally:
                await closed(call)
        assert value(srv, "duplex_sessions_detached_total") == 0

        held = await live_call(srv, http, packets, "resumable=1")
        try:
            held.drop()
            await detached(srv)
            assert srv.backend.status().free_slots == SLOTS - 1
            assert await held.hang_up(http) == 200
            await free_slots(srv, SLOTS)
            await wait_until(
                lambda: value(srv, "duplex_sessions_ended_total", reason="client_closed") == ended + 1,
                timeout_s=WAIT_S,
                what="the held call ended by its DELETE",
            )
        finally:
            await closed(held)


async def test_resume_off_refuses_before_the_answer(bundle, packets, http):  # noqa: F811
    async with running_server(bundle, workers=0, **rtc_settings(resume_s=0)) as srv:
        call = await live_call(srv, http, packets, "resumable=1")
        try:
            assert "resume" not in call.outcome.metadata[0]  # nothing to hold: no credential
            off = await refused(srv, http, packets, f"{'a' * 32}.{'b' * 43}")
            assert off.status == 404 and off.body.startswith("resume_off: "), (off.status, off.body)
            call.drop()
            await free_slots(srv, SLOTS)  # not resumable: a lost call ends at once
            assert value(srv, "duplex_sessions_ended_total", reason="rtc_media_timeout") == 1
        finally:
            await closed(call)


async def test_a_resume_whose_ice_never_connects_is_held_again_with_the_next_credential(
    bundle,  # noqa: F811
    packets,
    http,
):
    """The 201 of a resume carries the next credential (``Duplex-Resume-Credential``); that resume's ICE
    never connects (the answer is never applied): the session is held again, and the next try with the
    header's credential takes it over; once its first frame is in, the one presented first is spent
    (until then it stays valid for a retry: runtime.engine.resume)."""
    async with running_server(bundle, workers=0, **rtc_settings()) as srv:
        a = await live_call(srv, http, packets, "resumable=1")
        stuck = RtcCall(url(srv), packets, query=f"resume={a.outcome.metadata[0]['resume']}")
        stuck.pc.setRemoteDescription = _never  # type: ignore[method-assign]
        a3: RtcCall | None = None
        try:
            session_id = a.outcome.metadata[0]["session_id"]
            a.drop()
            await detached(srv, 1)
            outcome = await stuck.start(http)
            assert outcome.status == 201, outcome.body
            following = outcome.headers["Duplex-Resume-Credential"][0]
            assert following.startswith(session_id + ".") and following != a.outcome.metadata[0]["resume"]
            await detached(srv, 2)  # rtc_connect_timeout_s later: held again, not ended
            assert srv.backend.status().free_slots == SLOTS - 1
            assert value(srv, "duplex_sessions_ended_total", reason="rtc_connect_timeout") == 0
            a3 = await live_call(srv, http, packets, f"resume={following}")
            assert a3.outcome.metadata[0]["session_id"] == session_id
            await first_frames_taken(srv, session_id)
            spent = await refused(srv, http, packets, a.outcome.metadata[0]["resume"])
            assert spent.status == 403 and spent.body.startswith("resume_replayed: "), spent.body
            assert a3.outcome.metadata[0]["resume"] == a3.outcome.headers["Duplex-Resume-Credential"][0]
            assert await a3.hang_up(http) == 200
        finally:
            await closed(a, stuck, *([a3] if a3 else []))
        await free_slots(srv, SLOTS)


async def _never(*_: object) -> None:
    return None


async def test_the_resume_bench_times_a_webrtc_resume(bundle, packets):  # noqa: F811
    """``resume_bench --transport webrtc``'s trial against a node: held (the drop outlasts the media
    timeout), resumed, and its times in order."""
    async with running_server(bundle, workers=0, **rtc_settings(auth_mode="off")) as srv:
        trial = await run_rtc_trial(url(srv), packets, before_s=0.3, drop_s=1.6, after_s=0.3)
        assert value(srv, "duplex_sessions_detached_total") == 1
        assert value(srv, "duplex_sessions_resumed_total") == 1
        await free_slots(srv, SLOTS)
    assert 0 < trial.answer_ms <= trial.connected_ms <= trial.handshake_ms, trial
    assert trial.connected_ms <= trial.first_audio_ms < WAIT_S * 1e3, trial
    assert trial.gap_ms >= 1000 * srv.config.rtc_media_timeout_s, trial


async def test_a_delete_through_the_other_worker_ends_a_held_call(bundle, packets, http):  # noqa: F811
    """``--workers 2``: a held call's ``DELETE`` reaching the worker that does not hold it is forwarded
    through the engine to the one that does: 200, the held slot freed, the session ended ``client_closed``."""
    async with running_server(bundle, workers=2, **rtc_settings()) as srv:
        call = await live_call(srv, http, packets, "resumable=1")
        try:
            call.drop()
            await detached(srv)
            assert srv.backend.status().free_slots == SLOTS - 1
            owner = call.outcome.headers["Server"][0].split()[1]
            assert await delete_from_another_worker(srv, call.outcome.headers["Location"][0], owner) == 200
            await free_slots(srv, SLOTS)
            await wait_until(
                lambda: value(srv, "duplex_sessions_ended_total", reason="client_closed") == 1,
                timeout_s=WAIT_S,
                what="the held call ended by its DELETE",
            )
            gone = await refused(srv, http, packets, call.outcome.metadata[0]["resume"])
            assert gone.status == 410, (gone.status, gone.body)
        finally:
            await closed(call)


async def test_a_webrtc_resume_presents_its_credential_in_a_header_not_the_url(
    bundle,  # noqa: F811
    packets,
    http,
):
    """Issue 34: ``POST /api/rtc`` with ``Duplex-Resume-Credential`` and no query resumes a dropped call
    (the URL, which proxies log, holds nothing); the header and a deprecated ``?resume=`` giving different
    credentials are refused 400 ``bad_request`` naming both places, before any answer or slot."""
    async with running_server(bundle, workers=0, **rtc_settings()) as srv:
        a = await live_call(srv, http, packets, "resumable=1")
        calls = [a]
        try:
            session_id, credential = a.outcome.metadata[0]["session_id"], a.outcome.metadata[0]["resume"]
            a.drop()
            await detached(srv, 1)
            sid, secret = credential_session(credential) or ("", "")
            clash = RtcCall(url(srv), packets, resume=credential, query=f"resume={sid}.{secret[::-1]}")
            calls.append(clash)
            outcome = await clash.start(http)
            assert outcome.status == 400 and not outcome.answer_sdp, (outcome.status, outcome.body)
            assert (
                "the query parameter resume (deprecated) and the Duplex-Resume-Credential header"
                in outcome.body
            )
            assert srv.backend.status().free_slots == SLOTS - 1, (
                "the held slot was given back or another taken"
            )

            a2 = RtcCall(url(srv), packets, resume=credential)
            calls.append(a2)
            assert a2.query == "" and a2.token is None
            outcome = await a2.start(http)
            assert outcome.status == 201, (outcome.status, outcome.body)
            await asyncio.wait_for(a2.got_metadata.wait(), WAIT_S)
            again = a2.outcome.metadata[0]
            assert again["session_id"] == session_id and again["resumed"] is True, again
            assert again["resume"] == outcome.headers["Duplex-Resume-Credential"][0]
            await asyncio.wait_for(a2.audio_arrived.wait(), WAIT_S)
            assert await a2.hang_up(http) == 200
        finally:
            await closed(*calls)
        await free_slots(srv, SLOTS)
        assert value(srv, "duplex_sessions_resumed_total") == 1
        assert value(srv, "duplex_resume_refused_total", reason="bad_request") == 1
