"""The slots' side of resume alone (``runtime.engine.resume.SlotHolds``): single-use credentials that name
their session, the paused hold and its expiry on an injected clock, resume turned off. The whole path over
real sockets in both process modes: ``tests/test_resume.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from fake_clock import FakeClock

from runtime.engine.api import Refusal, SessionSink
from runtime.engine.resume import PROBE_S, SILENCE_S, SinkRoute, SlotHolds, credential_session
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import SlotSession


class _Sink(SessionSink):
    def __init__(self) -> None:
        self.events: list[str] = []

    def on_output(self, pcm: Any, piece: str | None) -> None:
        self.events.append(f"out {piece}")

    def on_prompt_done(self) -> None:
        self.events.append("prompt_done")

    def on_taken_over(self) -> None:
        self.events.append("taken_over")

    def on_hold_expired(self) -> None:
        self.events.append("expired")


def _holds(
    hold_s: float = 10.0, probe_s: float = PROBE_S, silence_s: float = SILENCE_S
) -> tuple[SlotHolds, FakeClock, list[SlotSession]]:
    clock = FakeClock()
    released: list[SlotSession] = []
    holds = SlotHolds(hold_s, released.append, clock=clock, probe_s=probe_s, silence_s=silence_s)
    return holds, clock, released


def _slot_session(sid: str, clock: FakeClock | None = None) -> SlotSession:
    session = SlotSession(sid, SamplingParams(), [], on_output=lambda *_: None, on_prompt_done=lambda: None)
    if clock is not None:
        session.clock = clock
    return session


_FRAME = np.zeros(1920, dtype=np.float32)


async def _probe_while(holds: SlotHolds, credential: str, step: Any) -> None:
    """Run :meth:`SlotHolds.probe_owner` while ``step()`` moves the slot session's clock (and sends frames);
    the probe's own waits are the fake clock's seconds taken as real ones (tens of ms here)."""
    probe = asyncio.ensure_future(holds.probe_owner(credential))
    for _ in range(1000):
        await asyncio.sleep(0.002)
        if probe.done():
            break
        step()
    await probe


def test_a_resume_while_the_owner_sends_is_refused_and_changes_nothing() -> None:
    """Issue 34, item 1: the owner is attached and its frames keep reaching the slot for the whole probe:
    ``resume_live``; the owner keeps its sink and its credential, which resumes the session once the
    transport reports the connection lost."""
    holds, clock, released = _holds(probe_s=0.05, silence_s=0.02)
    owner = _Sink()
    route = SinkRoute(owner)
    session = _slot_session("e" * 32, clock)
    credential = holds.open(session, route, "")

    def sending() -> None:
        clock.advance(0.005)
        session.push_frame(_FRAME)

    with pytest.raises(Refusal) as live:
        asyncio.run(_probe_while(holds, credential, sending))
    assert live.value.reason == "resume_live" and "is live on its connection" in live.value.message
    assert route.sink is owner and owner.events == [] and not released and holds.detached == 0

    assert holds.detach(session.session_id)  # the owner's connection is lost (the transport says so)
    asyncio.run(holds.probe_owner(credential))  # detached: nothing to probe
    got = holds.resume(credential, _Sink())
    assert got.previous is owner and got.slot_session is session


def test_the_transport_reporting_the_loss_ends_the_probe() -> None:
    holds, clock, _ = _holds(probe_s=100.0, silence_s=50.0)
    owner = _Sink()
    session = _slot_session("f" * 32, clock)
    credential = holds.open(session, SinkRoute(owner), "")
    session.push_frame(_FRAME)

    async def attempt() -> None:
        probe = asyncio.ensure_future(holds.probe_owner(credential))
        await asyncio.sleep(0)
        assert not probe.done(), "a resume went on while the owner's last frame was recent"
        holds.detach(session.session_id)  # the old connection's loss is seen meanwhile
        await probe

    asyncio.run(attempt())
    assert holds.resume(credential, _Sink()).previous is owner


def test_an_owner_that_stopped_sending_is_taken_for_lost() -> None:
    """The race the old takeover served: the caller's TCP connection died silently (no close, no reset) and
    it reconnects before the server's heartbeat notices. Its frames stopped: once silent for ``silence_s``
    the resume goes on (the caller then tells the old sink ``on_taken_over``); frames that stopped a
    ``silence_s`` ago already: at once."""
    holds, clock, _ = _holds(probe_s=0.2, silence_s=0.02)
    owner = _Sink()
    session = _slot_session("1" * 32, clock)
    credential = holds.open(session, SinkRoute(owner), "")
    session.push_frame(_FRAME)
    sent = [0]

    def tail_then_silence() -> None:  # a few frames still in flight after the drop, then nothing
        clock.advance(0.005)
        if sent[0] < 3:
            sent[0] += 1
            session.push_frame(_FRAME)

    asyncio.run(_probe_while(holds, credential, tail_then_silence))
    assert sent[0] == 3

    async def at_once() -> None:
        probe = asyncio.ensure_future(holds.probe_owner(credential))
        await asyncio.sleep(0)
        assert probe.done(), "an owner silent for silence_s already was probed again"
        await probe

    asyncio.run(at_once())
    assert holds.resume(credential, _Sink()).previous is owner


def test_a_bad_credential_is_refused_before_any_probe() -> None:
    holds, clock, _ = _holds()
    session = _slot_session("2" * 32, clock)
    holds.open(session, SinkRoute(_Sink()), "")
    session.push_frame(_FRAME)
    with pytest.raises(Refusal) as wrong:
        asyncio.run(holds.probe_owner(f"{session.session_id}.{'A' * 43}"))
    assert wrong.value.reason == "resume_invalid"


def test_credentials_are_single_use_and_name_their_session() -> None:
    holds, clock, released = _holds()
    first = _Sink()
    route = SinkRoute(first)
    sid = "a" * 32
    credential = holds.open(_slot_session(sid), route, "meta")
    assert credential_session(credential) == (sid, credential.split(".")[1])
    route.on_output(None, "hello")
    second = _Sink()
    got = holds.resume(credential, second)
    assert got.previous is first and route.sink is second and got.meta == "meta"
    assert [piece for _, piece in got.transcript] == ["hello"]
    assert got.credential != credential and got.credential.startswith(sid + ".")
    holds.confirm(sid)  # the resumed connection's first frame: the credential it presented is spent
    with pytest.raises(Refusal) as replay:
        holds.resume(credential, _Sink())
    assert replay.value.reason == "resume_replayed"
    with pytest.raises(Refusal) as wrong:
        holds.resume(f"{sid}.{'A' * 43}", _Sink())
    assert wrong.value.reason == "resume_invalid"
    assert route.sink is second and not released, "a refused resume changed the session"


def test_a_resume_cancelled_before_its_first_frame_spends_nothing() -> None:
    """The reconnecting client leaves after its resume was granted (and even after it was sent the next
    credential) but before its first frame: the slot is held again and a retry with the credential it
    presented is granted; the credential issued to the cancelled resume is then void; the retry's first
    frame spends the presented one."""
    holds, clock, released = _holds()
    sid = "e" * 32
    session = _slot_session(sid)
    route = SinkRoute(_Sink())
    first = holds.open(session, route, "")
    assert holds.detach(sid)
    cancelled = holds.resume(first, _Sink())  # granted, then its connection is lost before a frame
    assert holds.detach(sid) and holds.detached == 1
    retry_sink = _Sink()
    retry = holds.resume(first, retry_sink)  # the client never got cancelled.credential
    assert retry.slot_session is session and route.sink is retry_sink and not released
    assert retry.credential not in (first, cancelled.credential)
    with pytest.raises(Refusal) as void:
        holds.resume(cancelled.credential, _Sink())
    assert void.value.reason == "resume_invalid" and route.sink is retry_sink
    holds.confirm(sid)  # the retry's first frame
    with pytest.raises(Refusal) as spent:
        holds.resume(first, _Sink())
    assert spent.value.reason == "resume_replayed" and route.sink is retry_sink
    # The next credential presented while an older one is pending spends the older one.
    assert holds.detach(sid)
    second = holds.resume(retry.credential, _Sink())
    assert holds.detach(sid)
    third = holds.resume(second.credential, _Sink())  # the client had received second.credential
    with pytest.raises(Refusal) as older:
        holds.resume(retry.credential, _Sink())
    assert older.value.reason == "resume_replayed"
    assert holds.resume(second.credential, _Sink()).slot_session is session  # still pending: a retry
    assert third.credential != second.credential and not released


def test_a_detached_hold_expires_on_its_clock_and_frees_the_slot() -> None:
    holds, clock, released = _holds(hold_s=10.0)
    sink = _Sink()
    session = _slot_session("b" * 32)
    credential = holds.open(session, SinkRoute(sink), "")
    assert holds.detach(session.session_id) and session.paused
    clock.advance(9.99)
    assert holds.sweep() == [] and not released
    clock.advance(0.02)
    assert holds.sweep() == [session.session_id] and released == [session] and sink.events == ["expired"]
    with pytest.raises(Refusal) as late:
        holds.resume(credential, _Sink())
    assert late.value.reason == "resume_expired" and "ran out" in late.value.message
    assert len(holds) == 0 and holds.detached == 0


def test_a_prober_cannot_tell_which_ids_are_or_were_sessions() -> None:
    """Issue 34, item 11: a resume attempt told whether a session existed ("no session <id>" for an unknown
    id, "not a resume credential of session <id>" for a held one, ``resume_expired`` for an ended one, any
    secret). Now a secret the session never had gets the same refusal, word for word, for a held, an ended
    and an unknown id; ``resume_expired`` goes to the holder of one of the ended session's credentials."""
    holds, clock, _ = _holds(hold_s=10.0)
    held, ended = _slot_session("d" * 32), _slot_session("e" * 32)
    holds.open(held, SinkRoute(_Sink()), "")
    ended_credential = holds.open(ended, SinkRoute(_Sink()), "")
    holds.forget(ended.session_id)
    wrong = "x" * 43
    answers = []
    for sid in (held.session_id, ended.session_id, "f" * 32):
        with pytest.raises(Refusal) as refused:
            holds.resume(f"{sid}.{wrong}", _Sink())
        answers.append((refused.value.reason, refused.value.message))
    assert answers == [("resume_invalid", "not a resume credential of a session on this node")] * 3
    with pytest.raises(Refusal) as late:
        holds.resume(ended_credential, _Sink())
    assert late.value.reason == "resume_expired" and ended.session_id in late.value.message


def test_resume_off_issues_nothing() -> None:
    holds, _, _ = _holds(hold_s=0)
    session = _slot_session("c" * 32)
    assert holds.open(session, SinkRoute(_Sink()), "") == "" and not holds.detach(session.session_id)
    with pytest.raises(Refusal) as off:
        holds.resume(f"{session.session_id}.{'x' * 43}", _Sink())
    assert off.value.reason == "resume_off"


def test_the_query_asks_for_resume_and_refuses_bad_values() -> None:
    from runtime.frontend.codecs.protocol import ProtocolError
    from runtime.frontend.gate.query import parse_session_query

    assert parse_session_query("resumable=1").resumable is True
    assert parse_session_query("resumable=FALSE").resumable is False
    assert parse_session_query("format=pcm").resumable is None  # Kyutai's clients: nothing asked
    credential = f"{'d' * 32}.{'Ab_-' * 10}xyz"
    assert parse_session_query(f"resume={credential}").resume == credential
    for query, named in (
        ("resumable=yes", "resumable"),
        ("resume=../../etc", "resume"),
        ("resume=" + "a" * 129, "resume"),
    ):
        with pytest.raises(ProtocolError) as bad:
            parse_session_query(query)
        assert bad.value.reason == "bad_query" and f"query parameter {named}=" in str(bad.value)


def test_the_runtime_access_log_keeps_no_query(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 34: a resume credential (or a token) in the query stays out of the runtime's access log."""
    import logging

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from runtime.frontend.server import ACCESS_LOG, AccessLog

    credential = f"{'3' * 32}.{'S' * 43}"
    request = make_mocked_request("GET", f"/api/chat?format=pcm&resume={credential}&token=eyJsecret")
    access = AccessLog(ACCESS_LOG, "")
    with caplog.at_level(logging.DEBUG, logger="runtime.access"):
        assert access.enabled
        access.log(request, web.Response(status=101), 0.25)
    line = caplog.records[-1].getMessage()
    assert '"GET /api/chat" 101' in line, line
    assert credential not in caplog.text and "eyJsecret" not in caplog.text and "resume=" not in caplog.text
