"""The load generator replays pre-encoded Opus (no codec work during the run) and reports its own CPU."""

from __future__ import annotations

import pytest
from test_server_e2e import bundle, chat_url, running_server, speech  # noqa: F401 (fixtures)

import runtime.tools.loadgen as loadgen
from runtime.engine.model_presets import FRAME_SAMPLES
from runtime.frontend.codecs.kyutai_audio import OpusFrameAssembler
from runtime.frontend.codecs.protocol import AudioFormat, MessageKind

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_pre_encoded_messages_are_a_whole_opus_stream(speech):  # noqa: F811
    clip = speech[0][: FRAME_SAMPLES * 20]
    messages = loadgen.encode_messages(clip, AudioFormat.OPUS)
    assert len(messages) == 20 and all(m[0] == MessageKind.AUDIO for m in messages)
    assembler = OpusFrameAssembler(max_buffered_frames=100)
    frames = [f for m in messages for f in assembler.push(m[1:])]
    assert 15 <= len(frames) <= 20  # the encoder holds back its last page or two


async def test_a_load_run_replays_without_encoding_and_reports_its_cpu(bundle, speech, monkeypatch):  # noqa: F811
    async with running_server(bundle, model="sim", sim_step_ms="5", max_sessions=2) as server:
        real_encode = loadgen.encode_messages
        calls = []

        def counted(pcm, audio_format):  # type: ignore[no-untyped-def]
            calls.append(len(pcm))
            return real_encode(pcm, audio_format)

        def no_codec(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("a session encoded audio during the run")

        monkeypatch.setattr(loadgen, "encode_messages", counted)
        monkeypatch.setattr(loadgen, "_LazyMessages", no_codec)  # a session encoding live would fail
        clips = [speech[0][: FRAME_SAMPLES * 12]]
        report = await loadgen.run_load(
            chat_url(server, audio_format=AudioFormat.OPUS), clips, sessions=2, audio_format=AudioFormat.OPUS
        )
        summary = report.summary()
        assert summary["served"] == 2, report.session_rows()
        assert calls == [len(clips[0])]  # one clip, encoded once for both sessions
        assert summary["frames_sent"] == 24
        assert summary["loadgen_cpu_s"] is not None and summary["loadgen_cpu_s"] > 0
        assert summary["loadgen_cpu_percent"] is not None
