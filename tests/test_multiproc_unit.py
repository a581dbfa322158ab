"""The supervisor's arithmetic (runtime/multiproc.py) and the engine/worker messages (runtime/ipc.py)."""

from __future__ import annotations

import msgspec
import pytest

from runtime import ipc
from runtime.config import RuntimeConfig
from runtime.multiproc import Supervisor, default_workers


def test_default_workers_are_one_per_core_between_1_and_8():
    """Guards issue 21: ``--workers -1`` picked cores - 1 = 1 worker on 2 cores, the worst setting measured
    (64 Opus sessions: 1 worker lost 7.5 % of frames, 2 workers none); now one worker per core."""
    assert default_workers(2) == 2
    assert default_workers(1) == 1 and default_workers(4) == 4 and default_workers(8) == 8
    assert default_workers(16) == 8 and default_workers(64) == 8


def test_messages_round_trip_and_a_foreign_message_is_refused():
    messages = [
        ipc.Hello("worker-0", 12),
        ipc.Admit("s1", "", "be nice", (0.8, 250, 0.7, 25, 42), 8),
        ipc.Admitted("s1", 3),
        ipc.Refused("s1", "node_full", "node full"),
        ipc.Frame("s1", b"\x00" * 7680),
        ipc.Outputs([("s1", b"", "hello")]),
        ipc.Status(4, 1, 0, True, False, ["alice"], 99),
    ]
    for message in messages:
        assert ipc.decode(ipc.encode(message)) == message
    with pytest.raises(msgspec.DecodeError):
        ipc.decode(msgspec.msgpack.encode({"type": "Nope"}))


def test_the_supervisor_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="workers must be >= 1"):
        Supervisor(RuntimeConfig(port=8998), 0)
    with pytest.raises(ValueError, match="not 0"):
        Supervisor(RuntimeConfig(port=0), 2)


def test_the_model_frame_travels_from_the_engine_status_to_the_worker():
    """Issue 31: the frame is the model's, reported through the backend's status, not a constant each side
    assumes. A worker's :class:`EngineClient` builds its ``BackendStatus.frame`` from the engine's message."""
    from runtime.engine.api import MIMI_FRAME, FrameFormat
    from runtime.frontend.engine_client import EngineClient

    client = EngineClient("ipc:///nowhere", "worker-0", slots=4, clock=lambda: 0.1)  # not started: no socket
    client.status_message = ipc.Status(4, 4, 0, True, False, [], 7, [], 16_000, 1280)
    client.status_at = 0.0  # heard 0.1 s ago, as its receive loop records it
    status = client.status()
    assert status.frame == FrameFormat(16_000, 1280) and status.frame.ms == 80.0
    assert status.frame != MIMI_FRAME
    with pytest.raises(ValueError, match="a frame needs a sample rate and a size >= 1, got 0 Hz and 1920"):
        FrameFormat(0, 1920)
