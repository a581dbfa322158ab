"""The local node's verdict on its load run (``infra.node.local.bringup``): a session the node cuts is a
problem.

Planted bug this guards: ``_check_load`` looking only at the handshake and the audio count passed a node
that closed a session with 1006 after 72 of its 250 frames (``duplex node up`` printed "node check passed").
"""

from __future__ import annotations

from infra.node.local.bringup import NodeCheck, _check_load
from runtime.tools.loadgen import LoadReport, SessionResult


def _served(**fields: object) -> SessionResult:
    base: dict[str, object] = dict(
        handshake=True, frames_planned=250, frames_sent=250, audio_messages=250, text="hi", close_code=1000
    )
    base.update(fields)
    return SessionResult(**base)  # type: ignore[arg-type]


def _problems(*sessions: SessionResult) -> list[str]:
    check = NodeCheck(load=LoadReport(sessions=list(sessions), wall_s=20.0))
    _check_load(check, sessions=len(sessions))
    return check.problems


def test_sessions_served_to_their_end_are_no_problem() -> None:
    assert _problems(_served(), _served()) == []


def test_a_session_cut_by_the_node_is_a_problem() -> None:
    [problem] = _problems(_served(), _served(frames_sent=72, audio_messages=70, close_code=1006))
    assert problem == "session 1 cut after 72 of 250 frames (close 1006)"


def test_a_session_closed_with_another_code_is_a_problem() -> None:
    [problem] = _problems(_served(close_code=1011, close_reason="engine lost"))
    assert problem == "session 0 ended with close 1011 'engine lost'"


def test_a_session_not_served_is_a_problem() -> None:
    [problem] = _problems(SessionResult(http_status=503, http_body="node full"))
    assert problem.startswith("session 0 not served: "), problem


def _resumed(**fields: object) -> list[str]:
    """The resume step's verdict (``infra.node.local.resume_check._judge``) on a run that went well but for
    ``fields``."""
    from infra.node.local.resume_check import ResumeCheck, _judge

    base: dict[str, object] = dict(
        session_id="a" * 32,
        resumed_session_id="a" * 32,
        slot=2,
        resumed_slot=2,
        handshake_ms=20.0,
        audio_again_ms=60.0,
        audio_before=6,
        audio_after=12,
        close_code=1000,
        state="ended",
    )
    base.update(fields)
    check = ResumeCheck(**base)  # type: ignore[arg-type]
    _judge(check, [])
    return check.problems


def test_the_resume_step_fails_on_anything_but_the_same_session_in_the_same_slot_talking_again() -> None:
    assert _resumed() == []
    for fields, words in (
        ({"resumed_session_id": "b" * 32}, "session id"),
        ({"resumed_slot": 3}, "slot 3 after the resume, 2 before"),
        ({"slot": None}, "slot"),
        ({"audio_after": 0, "audio_again_ms": None}, "no audio after the resume"),
        ({"close_code": 1006}, "closed with 1006"),
        ({"state": "active"}, "state 'active'"),
    ):
        problems = _resumed(**fields)
        assert len(problems) == 1 and words in problems[0], (fields, problems)
