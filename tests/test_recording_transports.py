"""Recordings are right whatever the transport (issue 31): a consenting call on ``/api/rtc`` (an aiortc
client) and on ``/api/chat`` (Opus and PCM) records both sides as Ogg Opus that decodes to what the slot
was given (caller) and what the engine produced (agent): correlation over 0.9, the same length within a
frame. Before the fix a WebRTC call's agent side was its float32 bytes read as Int16: noise near full
scale, twice as long.

The server runs in-process (``--workers 0``) with the ``sim`` model, so the test reads the frames on the
way: the slot's input (``backend.push_frame``) and the engine's output (``ChatSession.on_output``)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import av
import numpy as np
import pytest
import pytest_asyncio
from test_access_control import token
from test_rtc import rtc_settings
from test_server_e2e import (  # noqa: F401  (fixtures)
    WAIT_S,
    bundle,
    chat_url,
    running_server,
    speech,
    wait_until,
)

from runtime.engine.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.frontend.codecs.protocol import AudioFormat
from runtime.frontend.server import DuplexServer
from runtime.frontend.session.conversation import ChatSession
from runtime.tools.loadgen import run_session
from runtime.tools.rtc_client import RtcCall, encode_packets

pytestmark = pytest.mark.asyncio(loop_scope="module")


class Taps:
    """The frames each session gave its slot and got from the engine, by session id."""

    def __init__(self) -> None:
        self.caller: dict[str, list[np.ndarray]] = defaultdict(list)
        self.agent: dict[str, list[np.ndarray]] = defaultdict(list)


@pytest.fixture(scope="module")
def taps() -> Iterator[Taps]:
    found = Taps()
    on_output = ChatSession.on_output

    def tapped(self: ChatSession, pcm: np.ndarray | None, piece: str | None) -> None:
        if pcm is not None:
            found.agent[self.session_id].append(np.array(pcm, dtype=np.float32).reshape(-1))
        on_output(self, pcm, piece)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ChatSession, "on_output", tapped)
        yield found


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node(
    bundle,  # noqa: F811
    taps: Taps,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[DuplexServer]:
    settings = rtc_settings(recording_dir=tmp_path_factory.mktemp("recordings"), allowed_origins=[])
    async with running_server(bundle, workers=0, max_sessions=2, **settings) as server:
        push_frame = server.backend.push_frame

        def tapped(lease, frame):  # type: ignore[no-untyped-def]
            taps.caller[lease.session_id].append(np.array(frame, dtype=np.float32).reshape(-1))
            return push_frame(lease, frame)

        server.backend.push_frame = tapped  # type: ignore[method-assign]
        yield server


def decode_recording(path: Path) -> np.ndarray:
    """An Ogg Opus file decoded by FFmpeg's libraries (PyAV), as float32 mono at 24 kHz ``[T]``."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE_HZ)
    chunks = []
    with av.open(str(path)) as container:
        for frame in container.decode(container.streams.audio[0]):
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray().reshape(-1))
    for out in resampler.resample(None):
        chunks.append(out.to_ndarray().reshape(-1))
    return np.concatenate(chunks).astype(np.float32)


def best_correlation(recorded: np.ndarray, reference: np.ndarray, max_lag: int = 2 * FRAME_SAMPLES) -> float:
    """Pearson correlation of ``recorded`` with ``reference`` at the best lag within ``max_lag`` samples
    (the codec's delay and pre-skip shift the decoded audio); the lag found by FFT cross-correlation."""
    size = 1 << int(np.ceil(np.log2(recorded.size + reference.size)))
    cross = np.fft.irfft(np.fft.rfft(recorded, size) * np.conj(np.fft.rfft(reference, size)), size)
    lags = np.r_[np.arange(0, max_lag + 1), np.arange(-max_lag, 0)]
    lag = int(lags[np.argmax(cross[lags])])
    a = recorded[max(0, lag) :]
    b = reference[max(0, -lag) :]
    n = min(a.size, b.size)
    return float(np.corrcoef(a[:n], b[:n])[0, 1])


async def finished_recordings(server: DuplexServer, session_id: str) -> dict[str, Path]:
    directory = Path(str(server.config.recording_dir))
    paths = {side: directory / f"{session_id}.{side}.opus" for side in ("caller", "agent")}
    await wait_until(lambda: all(p.is_file() for p in paths.values()), timeout_s=WAIT_S, what="recordings")
    return paths


def assert_recorded(paths: dict[str, Path], taps: Taps, session_id: str) -> None:
    for side, frames in (("caller", taps.caller[session_id]), ("agent", taps.agent[session_id])):
        assert len(frames) >= 10, (side, len(frames))
        reference = np.concatenate(frames)
        recorded = decode_recording(paths[side])
        peak = float(np.abs(recorded).max())
        assert peak <= 1.2 * float(np.abs(reference).max()) + 0.05, (side, peak)  # not noise at full scale
        assert abs(recorded.size - reference.size) <= FRAME_SAMPLES, (side, recorded.size, reference.size)
        correlation = best_correlation(recorded, reference)
        assert correlation > 0.9, (side, correlation)


async def test_a_consenting_webrtc_call_records_both_sides(node, taps, speech) -> None:  # noqa: F811
    async with aiohttp.ClientSession() as http:
        call = RtcCall(
            f"http://127.0.0.1:{node.port}", encode_packets(speech[0]), token=token(recording_consent=True)
        )
        outcome = await call.start(http)
        assert outcome.status == 201, outcome.body
        session_id = outcome.headers["Location"][0].split("/")[3]
        try:
            await asyncio.wait_for(call.handshake.wait(), WAIT_S)
            await wait_until(lambda: len(taps.agent[session_id]) >= 25, timeout_s=WAIT_S, what="25 frames")
            assert await call.hang_up(http) == 200
        finally:
            await call.close()
    await wait_until(lambda: not node.sessions, timeout_s=WAIT_S, what="the session to end")
    assert_recorded(await finished_recordings(node, session_id), taps, session_id)


@pytest.mark.parametrize("audio_format", [AudioFormat.OPUS, AudioFormat.PCM], ids=["opus", "pcm"])
async def test_a_consenting_websocket_call_records_both_sides(
    node,
    taps,
    speech,  # noqa: F811
    audio_format: AudioFormat,
) -> None:
    before = set(taps.agent)
    result = await run_session(
        chat_url(node, audio_format=audio_format, voice_prompt=None),
        speech[1],
        audio_format=audio_format,
        token=token(recording_consent=True),
    )
    assert result.handshake, (result.errors, result.http_status, result.http_body)
    await wait_until(lambda: not node.sessions, timeout_s=WAIT_S, what="the session to end")
    (session_id,) = set(taps.agent) - before
    assert_recorded(await finished_recordings(node, session_id), taps, session_id)
