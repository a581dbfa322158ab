"""Recordings and application tokens, piece by piece: frames encoded to Ogg Opus (decoded by FFmpeg via PyAV),
the local disk store (ids, erase, sweep with an injected clock), the recorder's bounded queue, the token kinds
and scopes, and ``duplex token mint --app`` / ``--recording-consent``. The wire: tests/test_sessions_api.py.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import av
import jwt
import numpy as np
import pytest
from typer.testing import CliRunner

from runtime.engine.model_presets import FRAME_SAMPLES
from runtime.frontend.gate.app_tokens import SCOPE_ERASE, SCOPE_READ, mint_app_token, verify_app_token
from runtime.frontend.gate.tokens import SigningKey, TokenRejected, TokenVerifier, mint_token
from runtime.frontend.store.recordings import LocalRecordings, SessionRecorder
from runtime.metrics import RuntimeMetrics
from runtime.tools.cli import app as cli_app

KEY = SigningKey("k1", "k" * 32)
AUDIENCE = "unit"
SID = "0123456789abcdef0123456789abcdef"


def _seconds(data: bytes, path: Path) -> float:
    path.write_bytes(data)
    with av.open(str(path)) as container:
        return sum(frame.samples for frame in container.decode(container.streams.audio[0])) / 48000


def _frames(seconds: float = 2.0) -> list[np.ndarray]:
    """A tone as [1920] float32 frames (80 ms each)."""
    count = int(round(seconds / 0.08))
    pcm = (0.3 * np.sin(np.arange(count * FRAME_SAMPLES) / 7)).astype(np.float32)
    return list(pcm.reshape(count, FRAME_SAMPLES))


def test_frames_are_encoded_to_ogg_opus_and_a_bad_frame_stops_that_side(tmp_path: Path) -> None:
    metrics = RuntimeMetrics()
    recorder = SessionRecorder(LocalRecordings(tmp_path), SID, metrics)
    frames = _frames(0.96)  # 12 frames
    for frame in frames:
        recorder.caller(frame)
        recorder.agent(frame * 0.5)
    recorder.agent(np.zeros(FRAME_SAMPLES + 1, dtype=np.float32))  # not a frame: the agent side stops
    recorder.agent(_frames(0.08)[0])
    recorder.close()
    assert recorder.join(30)
    path = LocalRecordings(tmp_path).local_path(SID, "caller")
    assert path is not None
    # libopus' own OpusHead: a decoder drops its 312-sample look-ahead (6.5 ms at 48 kHz), not the 80 ms of
    # sphn's pre-skip (3840) that recordings carried before
    seconds = _seconds(path.read_bytes(), tmp_path / "x.opus")
    assert seconds == pytest.approx(0.08 * len(frames) - 312 / 48000, abs=0.002)
    assert LocalRecordings(tmp_path).local_path(SID, "agent") is None  # its .part is left for the sweep
    assert metrics.recording_errors.labels(reason="write")._value.get() == 1


def test_a_recording_keeps_its_first_frame_in_place(tmp_path: Path) -> None:
    """The first 80 ms frame is heard, where it was spoken: a 440 Hz burst in frame 0 then silence decodes
    to the burst in the first 80 ms (libopus' true pre-skip). With sphn's pre-skip of 3840 samples a player
    dropped the whole first frame: the burst was gone and the recording began 80 ms late."""
    t = np.arange(FRAME_SAMPLES, dtype=np.float32) / 24000
    burst = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    silence = np.zeros(FRAME_SAMPLES, dtype=np.float32)
    recorder = SessionRecorder(LocalRecordings(tmp_path), SID, RuntimeMetrics())
    for frame in [burst] + [silence] * 5:
        recorder.caller(frame)
    recorder.close()
    assert recorder.join(30)
    path = LocalRecordings(tmp_path).local_path(SID, "caller")
    assert path is not None
    with av.open(str(path)) as container:
        decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    rate = 48000
    first, later = decoded[: int(0.07 * rate)], decoded[int(0.1 * rate) :]
    assert np.sqrt(np.mean(first**2)) > 0.2  # the burst (RMS 0.35) in the first 70 ms
    assert np.sqrt(np.mean(later**2)) < 0.02  # and silence after it, not the burst shifted late


def test_local_recordings_ids_erase_and_sweep(tmp_path: Path) -> None:
    store = LocalRecordings(tmp_path / "rec")
    for bad in ("../etc/passwd", SID.upper(), SID + "0", ""):
        with pytest.raises(ValueError, match="32 lowercase hex"):
            store.create(bad, "caller")
    with pytest.raises(ValueError, match="caller, agent"):
        store.create(SID, "both")
    handle = store.create(SID, "caller")
    handle.write(b"OggS")
    assert store.local_path(SID, "caller") is None  # in progress: not served
    store.commit(SID, "caller", handle)
    assert store.local_path(SID, "caller") == tmp_path / "rec" / f"{SID}.caller.opus"
    other = "f" * 32
    store.commit(other, "agent", store.create(other, "agent"))
    now = time.time()
    assert store.sweep(3600, now=now) == 0
    assert store.sweep(3600, now=now + 3601) == 2 and store.local_path(SID, "caller") is None
    handle = store.create(SID, "agent")
    assert store.erase(SID) == 1  # the file in progress
    store.commit(SID, "agent", handle)  # erased while written: stays erased
    assert store.local_path(SID, "agent") is None and store.erase(SID) == 0


def test_a_recorder_that_falls_behind_leaves_audio_out_and_never_blocks(tmp_path: Path) -> None:
    metrics = RuntimeMetrics()
    gate = threading.Event()

    class SlowStore(LocalRecordings):
        def create(self, session_id: str, side: str):  # noqa: ANN201
            gate.wait(30)
            return super().create(session_id, side)

    recorder = SessionRecorder(SlowStore(tmp_path), SID, metrics, max_queue=4)
    for frame in _frames(0.8):
        recorder.agent(frame)  # returns at once, the thread stuck
    assert metrics.recording_errors.labels(reason="queue_full")._value.get() >= 5
    gate.set()
    recorder.close()
    assert recorder.join(30)
    assert metrics.recordings.labels(side="agent")._value.get() == 1
    assert metrics.recording_bytes.labels(side="agent")._value.get() == recorder.bytes_written["agent"] > 0


def test_token_kinds_and_scopes() -> None:
    verifier = TokenVerifier([KEY], AUDIENCE)
    app_token = mint_app_token(KEY, ttl_s=60, audience=AUDIENCE, scopes=[SCOPE_READ])
    claims = verify_app_token(verifier, app_token, SCOPE_READ)
    assert claims.scopes == {SCOPE_READ} and claims.kid == "k1"
    with pytest.raises(TokenRejected) as refused:
        verify_app_token(verifier, app_token, SCOPE_ERASE)
    assert refused.value.reason == "insufficient_scope" and refused.value.status == 403
    with pytest.raises(TokenRejected) as refused:
        verifier.verify(app_token)  # an application token opens no session
    assert refused.value.reason == "wrong_token_kind" and refused.value.status == 403
    session = mint_token(KEY, ttl_s=60, personas=["*"], audience=AUDIENCE, recording_consent=True)
    assert verifier.verify(session).recording_consent is True
    assert (
        verifier.verify(mint_token(KEY, ttl_s=60, personas=["*"], audience=AUDIENCE)).recording_consent
        is False
    )
    with pytest.raises(TokenRejected) as refused:
        verify_app_token(verifier, session, SCOPE_READ)
    assert refused.value.reason == "wrong_token_kind"
    with pytest.raises(TokenRejected) as refused:
        verify_app_token(verifier, None, SCOPE_READ)
    assert refused.value.reason == "missing" and refused.value.status == 401
    with pytest.raises(ValueError, match="sessions:read, sessions:erase"):
        mint_app_token(KEY, ttl_s=60, audience=AUDIENCE, scopes=["admin"])
    bad_consent = jwt.encode(
        {**jwt.decode(session, options={"verify_signature": False}), "recording_consent": "yes"},
        KEY.secret,
        algorithm="HS256",
        headers={"kid": "k1"},
    )
    with pytest.raises(TokenRejected, match="recording_consent must be true or false"):
        verifier.verify(bad_consent)


def test_duplex_token_mint_app_and_consent(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({KEY.kid: KEY.secret.decode()}))
    verifier = TokenVerifier([KEY], AUDIENCE)
    base = ["token", "mint", "--key-file", str(keys), "--audience", AUDIENCE]
    result = CliRunner().invoke(cli_app, [*base, "--app", "--scope", SCOPE_READ])
    assert result.exit_code == 0, result.output
    assert verify_app_token(verifier, result.stdout.strip(), SCOPE_READ).scopes == {SCOPE_READ}
    result = CliRunner().invoke(cli_app, [*base, "--recording-consent"])
    assert result.exit_code == 0 and verifier.verify(result.stdout.strip()).recording_consent
    result = CliRunner().invoke(cli_app, [*base, "--app", "--recording-consent"])
    assert result.exit_code == 2 and "--app" in result.output
    result = CliRunner().invoke(cli_app, [*base, "--app", "--scope", "root"])
    assert result.exit_code == 2 and "sessions:read" in result.output


def test_recording_files_are_the_runtimes_alone(tmp_path: Path) -> None:
    """Issue 34, item 11: recording files were created 0644 (any local user could read a caller's voice)."""
    old_umask = os.umask(0o022)
    try:
        store = LocalRecordings(tmp_path / "rec")
        (tmp_path / "rec" / f"{SID}.caller.opus.part").write_bytes(b"stale")  # left by a crash, 0644
        handle = store.create(SID, "caller")
        assert stat.S_IMODE(os.fstat(handle.fileno()).st_mode) == 0o600
        handle.write(b"OggS")
        store.commit(SID, "caller", handle)
        final = store.local_path(SID, "caller")
        assert final is not None and final.read_bytes() == b"OggS"
        assert stat.S_IMODE(final.stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "rec").stat().st_mode) == 0o700
    finally:
        os.umask(old_umask)
