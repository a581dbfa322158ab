"""``runtime.engine.resume`` edge by edge: what mutation testing found untested (docs/mutation.md, "Survivors,
judged"). The expiry sweep as a task, the exact boundaries of the liveness probe, of a hold's deadline and of
the memory of spent credentials and ended sessions, the resume gap, the sink route's text and audio, and the
words of each refusal. Over an injected clock and stand-in slot sessions (``tests/test_resume_holds.py``'s
helpers); the whole path over sockets: ``tests/test_resume.py``."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from fake_clock import FakeClock
from test_resume_holds import _holds, _Sink, _slot_session

from runtime.engine.api import RESUME_OFF_MESSAGE, FirstAudioTiming, Refusal, SessionSink
from runtime.engine.resume import ENDED_MEMORY, SinkRoute, SlotHolds, credential_session

_SID = "0123456789abcdef0123456789abcdef"


class _Recorder(SessionSink):
    """Keeps exactly what reached it."""

    def __init__(self) -> None:
        self.outputs: list[tuple[object, str | None]] = []
        self.first_audio: list[FirstAudioTiming] = []

    def on_output(self, pcm: np.ndarray | None, piece: str | None) -> None:
        self.outputs.append((pcm, piece))

    def on_prompt_done(self) -> None:
        pass

    def on_first_audio(self, timing: FirstAudioTiming) -> None:
        self.first_audio.append(timing)


def _open(holds: SlotHolds, sid: str = _SID, clock: FakeClock | None = None) -> str:
    return holds.open(_slot_session(sid, clock), SinkRoute(_Sink()), "meta")


def _refusal(holds: SlotHolds, credential: str) -> Refusal:
    with pytest.raises(Refusal) as caught:
        holds.resume(credential, _Sink())
    return caught.value


def test_credentials_parse_only_when_well_formed() -> None:
    assert credential_session(f"{_SID}.{'a' * 43}") == (_SID, "a" * 43)
    assert credential_session("not-a-credential") is None
    holds, _, _ = _holds()
    refusal = _refusal(holds, "not-a-credential")
    assert refusal.reason == "resume_invalid"
    assert refusal.message == (
        "resume credential malformed: expected <session id>.<secret> as sent in the 0x04 metadata"
    )


def test_the_sink_route_forwards_audio_and_text_and_keeps_text_only_when_asked() -> None:
    sink = _Recorder()
    route = SinkRoute(sink)
    pcm = np.ones(1920, dtype=np.float32)
    route.on_output(pcm, "hello")
    assert sink.outputs == [(pcm, "hello")] and sink.outputs[0][0] is pcm
    assert route.keep_text is False and route.transcript == []  # not resumable: nothing kept
    route.on_output(pcm, None)
    assert route.transcript == []
    route.keep_text = True
    route.on_output(None, "world")
    route.on_output(pcm, None)  # audio alone adds no text
    assert [piece for _, piece in route.transcript] == ["world"]
    timing = FirstAudioTiming(1.0, 2.0, 1, 3.0, 4.0)
    route.on_first_audio(timing)
    assert sink.first_audio == [timing]


def test_a_short_hold_still_issues_credentials_and_resumes() -> None:
    """Any hold above 0 s turns resume on (0.5 s here): a credential is issued and accepted."""
    holds, _, _ = _holds(hold_s=0.5)
    credential = _open(holds)
    assert credential.startswith(_SID + ".") and credential_session(credential) is not None
    assert holds.slot_session(_SID) is not None and holds.slot_session("f" * 32) is None
    assert holds.resume(credential, _Sink()).credential != credential


def test_resume_off_says_so() -> None:
    holds, _, _ = _holds(hold_s=0)
    assert _open(holds) == ""
    refusal = _refusal(holds, f"{_SID}.{'a' * 43}")
    assert (refusal.reason, refusal.message) == ("resume_off", RESUME_OFF_MESSAGE)


async def test_the_sweep_runs_as_one_named_task_and_stops() -> None:
    """``start`` runs the expiry sweep on the loop (a hold expires with nobody calling ``sweep``), once,
    named; ``stop`` ends it before returning, and a later ``start`` starts it again. Resume off: no task."""
    off, _, _ = _holds(hold_s=0)
    off.start()
    assert off._task is None
    holds, clock, released = _holds(hold_s=0.5)
    _open(holds)
    holds.start()
    task = holds._task
    assert task is not None and task.get_name() == "resume-holds"
    holds.start()
    assert holds._task is task  # started once
    holds.detach(_SID)
    clock.advance(1.0)
    async with asyncio.timeout(5):
        while not released:
            await asyncio.sleep(0.01)  # the task sweeps every SWEEP_S
    assert len(holds) == 0
    await holds.stop()
    assert task.done() and holds._task is None
    await holds.stop()  # stopping twice is harmless
    holds.start()
    assert holds._task is not None and not holds._task.done()
    await holds.stop()


def test_a_hold_ends_exactly_at_its_deadline(caplog: pytest.LogCaptureFixture) -> None:
    """Held until just before ``detach`` + ``hold_s``; at the deadline itself it is past (``now >=
    deadline``): the slot is freed and the log says which session and after how long."""
    holds, clock, released = _holds(hold_s=10.0)
    _open(holds)
    holds.detach(_SID)
    deadline = clock.now + 10.0
    clock.now = deadline - 0.001
    assert holds.sweep() == []
    clock.now = deadline
    with caplog.at_level(logging.INFO, logger="runtime.engine.resume"):
        assert holds.sweep() == [_SID]
    assert [s.session_id for s in released] == [_SID]
    assert f"session {_SID}: not resumed within 10 s; its slot freed" in caplog.messages


def test_an_ended_sessions_credentials_say_why_including_a_pending_one() -> None:
    """After ``forget`` (default reason) every credential the session had, the pending one of a resume not
    confirmed yet included, gets ``resume_expired`` with the reason; forgetting an unknown id is harmless."""
    holds, _, _ = _holds()
    first = _open(holds)
    holds.resume(first, _Sink())  # first is now pending (no frame yet)
    holds.forget(_SID)
    refusal = _refusal(holds, first)
    assert refusal.reason == "resume_expired"
    assert refusal.message == f"session {_SID} cannot be resumed: the session has ended"
    holds.forget("f" * 32)  # never held: nothing happens


def test_ended_sessions_are_remembered_up_to_the_limit_oldest_first_forgotten() -> None:
    holds, _, _ = _holds()
    sids = [f"{i:032x}" for i in range(ENDED_MEMORY + 1)]
    credentials = [_open(holds, sid) for sid in sids]
    for sid in sids:
        holds.forget(sid)
    assert _refusal(holds, credentials[0]).reason == "resume_invalid"  # the oldest is forgotten
    assert _refusal(holds, credentials[1]).reason == "resume_expired"  # ENDED_MEMORY remembered
    assert _refusal(holds, credentials[-1]).reason == "resume_expired"


def test_the_last_64_spent_credentials_are_known_as_replays() -> None:
    holds, _, _ = _holds()
    presented = [_open(holds)]
    for _ in range(70):
        presented.append(holds.resume(presented[-1], _Sink()).credential)
        holds.confirm(_SID)  # the resumed connection's first frame: the presented one is spent
    spent = presented[:-1]  # 70 spent, the last one is current
    replay = _refusal(holds, spent[-64])
    assert replay.reason == "resume_replayed"
    assert replay.message == f"this resume credential of session {_SID} was used already"
    assert _refusal(holds, spent[-65]).reason == "resume_invalid"  # older than the kept 64


def test_the_resume_gap_is_from_the_last_frame_on_the_sessions_clock() -> None:
    holds, clock, _ = _holds()
    session = _slot_session(_SID, clock)
    credential = holds.open(session, SinkRoute(_Sink()), "meta")
    first = holds.resume(credential, _Sink())
    assert first.gap_s == 0.0  # no frame yet
    session.last_input_at = clock.now - 1.5
    second = holds.resume(first.credential, _Sink())
    assert second.gap_s == pytest.approx(1.5)
    session.last_input_at = clock.now + 0.25  # a clock read ahead of the slot's (threads): never negative
    assert holds.resume(second.credential, _Sink()).gap_s == 0.0


async def test_an_owner_silent_exactly_silence_s_is_lost() -> None:
    """The probe's boundary: ``silence_s`` after the last frame, to the tick, the owner is taken for lost."""
    holds, clock, _ = _holds(silence_s=0.5, probe_s=2.0)
    session = _slot_session(_SID, clock)
    credential = holds.open(session, SinkRoute(_Sink()), "meta")
    session.last_input_at = clock.now - 0.5
    async with asyncio.timeout(2):
        await holds.probe_owner(credential)  # returns at once: lost


async def test_an_owner_sending_at_the_probes_end_is_live(caplog: pytest.LogCaptureFixture) -> None:
    """The probe's other boundary: at ``probe_s`` to the tick an owner still sending is live."""
    holds, clock, _ = _holds(silence_s=0.5, probe_s=0.0)
    session = _slot_session(_SID, clock)
    credential = holds.open(session, SinkRoute(_Sink()), "meta")
    session.last_input_at = clock.now
    with caplog.at_level(logging.WARNING, logger="runtime.engine.resume"), pytest.raises(Refusal) as caught:
        async with asyncio.timeout(2):
            await holds.probe_owner(credential)
    assert caught.value.reason == "resume_live"
    assert caught.value.message == (
        f"session {_SID} is live on its connection: a resume is accepted only once that connection is lost "
        "(its owner keeps the call and its credential)"
    )
    assert f"session {_SID}: a resume while its owner is connected and sending refused" in caplog.messages
