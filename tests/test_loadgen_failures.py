"""The load generator reports sessions the node cut (runtime/tools/loadgen.py, ``duplex loadgen``).

Guards issue 21: sessions cut by the server (close 1006 after 72 of 250 frames) were reported as served
with 0 frames lost and ``duplex loadgen`` exited 0. A fake node on loopback (websockets, in a thread of its
own) sends the handshake, echoes one audio frame per frame received, and cuts the session after a number
of frames: by dropping the TCP connection (the client sees 1006) or with a close frame (1011).
"""

from __future__ import annotations

import asyncio
import re
import threading
import wave
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner
from websockets.asyncio.server import ServerConnection, serve

from runtime.engine.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.tools.cli import app as runtime_app
from runtime.tools.loadgen import (
    STARTUP_FRAMES,
    SessionResult,
    check_load_args,
    gather_sessions,
    run_load,
    run_session,
    session_url,
)

FRAMES = 20


@contextmanager
def fake_node(cut_after: int | None = None, how: str = "abort") -> Iterator[str]:
    """A node that echoes one PCM frame per frame received; after ``cut_after`` frames it drops the
    connection (``how="abort"``: 1006 on the client) or closes it with 1011 (``how="1011"``). Yields
    ``ws://127.0.0.1:<port>``."""
    ready = threading.Event()
    stop: asyncio.Future[None] | None = None
    port: list[int] = []
    loop = asyncio.new_event_loop()

    async def handler(ws: ServerConnection) -> None:
        await ws.send(b"\x00")
        received = 0
        async for _ in ws:
            received += 1
            await ws.send(b"\x01" + bytes(FRAME_SAMPLES * 2))
            if received == cut_after:
                if how == "abort":
                    ws.transport.abort()
                else:
                    await ws.close(1011, "engine unreachable")
                return

    async def main() -> None:
        nonlocal stop
        stop = loop.create_future()
        async with serve(handler, "127.0.0.1", 0, compression=None) as server:
            port.append(server.sockets[0].getsockname()[1])
            ready.set()
            await stop

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the fake node did not start"
    try:
        yield f"ws://127.0.0.1:{port[0]}"
    finally:
        loop.call_soon_threadsafe(lambda: stop is not None and stop.set_result(None))
        thread.join(30)
        loop.close()


def _clip(frames: int = FRAMES) -> np.ndarray:
    t = np.arange(frames * FRAME_SAMPLES, dtype=np.float32) / SAMPLE_RATE_HZ
    return (0.2 * np.sin(2 * np.pi * 300.0 * t)).astype(np.float32)


async def test_a_session_the_node_lets_finish_is_whole() -> None:
    """The control: every frame echoed, closed with 1000 by the client: no loss, no failure."""
    with fake_node() as base:
        result = await run_session(session_url(base), _clip(), tail_s=0.1)
    assert result.frames_planned == result.frames_sent == FRAMES and result.audio_messages == FRAMES
    assert result.close_code == 1000 and not result.ended_early and result.failure == ""
    assert result.frames_lost() == 0


@pytest.mark.parametrize("how", ["abort", "1011"])
async def test_a_cut_session_is_a_failure_and_its_missing_frames_are_lost(how: str) -> None:
    with fake_node(cut_after=6, how=how) as base:
        report = await run_load(session_url(base), [_clip()], sessions=2)
    summary = report.summary()
    assert summary["served"] == 2 and summary["cut"] == 2, report.session_rows()
    for result in report.sessions:
        assert result.audio_messages == 6 and result.ended_early
        assert result.close_code == (1006 if how == "abort" else 1011)
        assert result.frames_lost() == FRAMES - STARTUP_FRAMES - 6  # the frames that never came
        # The client may have sent a frame or two more before it saw the cut.
        assert 6 <= result.frames_sent < FRAMES
        expected = f"cut after {result.frames_sent} of {FRAMES} frames (close {result.close_code}"
        assert result.failure.startswith(expected), result.failure
    assert summary["frames_lost"] == 2 * (FRAMES - STARTUP_FRAMES - 6)
    assert not report.ok and len(report.failures()) == 2
    assert all(row["failure"] for row in report.session_rows())


async def test_a_session_closed_abnormally_after_its_last_frame_is_a_failure() -> None:
    """All frames sent and answered, but the node ended the session with 1011 rather than 1000."""
    with fake_node(cut_after=FRAMES, how="1011") as base:
        result = await run_session(session_url(base), _clip(), tail_s=0.5)
    assert result.frames_sent == FRAMES and result.frames_lost() == 0
    assert result.ended_early and result.failure == "ended with close 1011 'engine unreachable'"


def _wav(path: Path) -> Path:
    pcm = (_clip() * 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE_HZ)
        out.writeframes(pcm.tobytes())
    return path


def test_duplex_loadgen_exits_1_when_the_node_cuts_a_session(tmp_path: Path) -> None:
    wav = _wav(tmp_path / "speech.wav")
    runner = CliRunner()
    with fake_node(cut_after=6) as base:
        cut = runner.invoke(runtime_app, ["loadgen", "--url", base, "--sessions", "1", "--wav", str(wav)])
    assert cut.exit_code == 1, cut.output
    assert "cut 1" in cut.output.replace("\n", " ")
    with fake_node() as base:
        whole = runner.invoke(runtime_app, ["loadgen", "--url", base, "--sessions", "1", "--wav", str(wav)])
    assert whole.exit_code == 0, whole.output


def test_frames_lost_never_exceed_the_frames_planned() -> None:
    """On a starved machine audio comes in bursts after long gaps: the gaps count as lost and the burst
    adds messages, but a session cannot lose more frames than it planned (a bench run reported 16,015
    lost of 16,000)."""
    from runtime.tools.loadgen import SessionResult

    result = SessionResult(handshake=True, frames_planned=10, frames_sent=10, audio_messages=10)
    result.audio_arrival_s = [0.0, 2.0, *(2.0 + 0.001 * i for i in range(1, 9))]  # a 2 s gap, then a burst
    assert result.frames_lost() == 10


async def test_gather_sessions_keeps_order_and_marks_failed_and_cut_sessions() -> None:
    """One result per task in task order: a finished session's own, a raising one's error, and one still
    running at the deadline cancelled and marked cut (the deadline is a hang guard for the others)."""
    never = asyncio.Event()

    async def served() -> SessionResult:
        result = SessionResult()
        result.bytes_received = 7
        return result

    async def broken() -> SessionResult:
        raise ConnectionResetError("gone")

    async def stuck() -> SessionResult:
        await never.wait()
        return SessionResult()

    tasks = [asyncio.create_task(coro) for coro in (stuck(), served(), broken())]
    cut, ok, failed = await gather_sessions(tasks, 2.0, SessionResult)
    assert cut.connect_error == "cut at max_duration_s=2.0" and tasks[0].cancelled()
    assert ok.bytes_received == 7 and not ok.connect_error
    assert failed.connect_error == "ConnectionResetError('gone')"


@pytest.mark.parametrize(
    ("sessions", "speech", "max_duration_s", "token", "words"),
    [
        (0, [_clip()], 5.0, None, "sessions must be between 1 and 256, got 0"),
        (1, [], 5.0, None, "no speech to stream"),
        (1, [_clip()], float("inf"), None, "max_duration_s must be a positive number of seconds, got inf"),
        (2, [_clip()], 5.0, "one-token", "a session token opens one session"),
    ],
)
def test_a_load_run_refuses_bad_arguments_by_name(
    sessions: int, speech: list[np.ndarray], max_duration_s: float, token: str | None, words: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        check_load_args(sessions, speech, max_duration_s, token)
    check_load_args(1, [_clip()], 5.0, token)  # the same token for one session is fine
