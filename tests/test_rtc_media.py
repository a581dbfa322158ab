"""The WebRTC media path's own delays (runtime/frontend/transports/webrtc/media.py), on an injected clock: an
outbound
frame's first packet goes at once (one encode, no wait) and the rest 20 ms apart; an in-order inbound packet
is handed to the session within the RTP hook's own call (no event-loop turn, no jitter-buffer wait); and
the first-audio trace stamps the first packet, the first one taken and the one completing the first frame.
The load generator's first-audio reference (runtime/tools/loadgen_rtc.py) and the join of the node's trace
with the client's stamps (runtime/tools/rtc_trace.py) are checked on made-up stamps.
"""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
from fake_clock import FakeClock

from runtime.frontend.codecs.opus_rtp import OpusDecoder, OpusEncoder
from runtime.frontend.transports.webrtc.media import (
    OUTBOUND_QUEUE_PACKETS,
    FirstAudioTrace,
    OpusPacketTrack,
    RtpInbound,
)
from runtime.metrics import RuntimeMetrics
from runtime.tools import rtc_trace
from runtime.tools.loadgen_rtc import RtcSessionResult, _first_audio
from runtime.tools.rtc_client import PacketReplayTrack
from runtime.tools.rtc_trace import TERMS, join_traces, node_traces, summarize

WAIT_S = 30.0
"""Hang guard for event waits (a loaded 2-core machine)."""


def tone(frames: int = 1) -> np.ndarray:
    t = np.arange(1920 * frames) / 24_000
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


class Sleeps:
    """An injected ``sleep`` that records each wait and moves the fake clock by it."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(round(seconds, 9))
        self.clock.advance(seconds)


async def test_a_frames_first_packet_goes_at_once_after_one_encode_and_the_rest_every_20_ms() -> None:
    clock = FakeClock()
    sleeps = Sleeps(clock)
    trace = FirstAudioTrace()
    track = OpusPacketTrack(5, clock=clock, sleep=sleeps, trace=trace)
    encoded: list[int] = []
    encode_packet = track.encoder.encode_packet
    track.encoder.encode_packet = lambda pcm: encoded.append(len(pcm)) or encode_packet(pcm)  # type: ignore[method-assign,func-returns-value]
    track.put_frame(tone())
    assert encoded == []  # nothing encoded before the sender takes a packet
    first = await track.recv()
    assert sleeps.waits == [] and encoded == [480]  # due at once, one 20 ms encode
    assert trace.audio_put_at == trace.audio_sent_at == 1000.0
    assert trace.terms_ms()["pacing"] == 0.0
    rest = [await track.recv() for _ in range(3)]
    assert sleeps.waits == [0.02, 0.02, 0.02] and clock.now == pytest.approx(1000.06)
    assert [p.pts for p in [first, *rest]] == [0, 960, 1920, 2880]
    decoder = OpusDecoder()
    assert all(len(decoder.decode(bytes(p))) == 480 for p in [first, *rest])
    decoder.close()
    track.stop()


async def test_a_frame_put_late_is_not_delayed_by_the_pacing_of_the_one_before() -> None:
    clock = FakeClock()
    sleeps = Sleeps(clock)
    track = OpusPacketTrack(5, clock=clock, sleep=sleeps)
    track.put_frame(tone())
    for _ in range(4):
        await track.recv()
    clock.advance(0.5)  # the next frame comes late (a slow tick): its first packet goes at once
    track.put_frame(tone())
    sleeps.waits.clear()
    await track.recv()
    assert sleeps.waits == []
    track.stop()


async def test_bad_frames_are_refused_and_a_full_queue_drops_the_oldest() -> None:
    dropped: list[int] = []
    track = OpusPacketTrack(5, clock=FakeClock(), on_dropped=dropped.append)
    with pytest.raises(ValueError, match="expected one frame of 1920 samples, got 100"):
        track.put_frame(np.zeros(100, dtype=np.float32))
    for _ in range(OUTBOUND_QUEUE_PACKETS // 4 + 1):
        track.put_frame(tone())
    assert dropped == [2] and len(track._queue) == OUTBOUND_QUEUE_PACKETS
    track.stop()


def rtp(index: int, payload: bytes, ssrc: int = 7) -> SimpleNamespace:
    """The ``index``-th packet of a stream (20 ms each), its sequence number and timestamp wrapped."""
    seq, timestamp = index % (1 << 16), index * 960 % (1 << 32)
    return SimpleNamespace(
        payload_type=111, ssrc=ssrc, sequence_number=seq, timestamp=timestamp, payload=payload
    )


async def test_an_in_order_packet_reaches_the_session_within_the_hook_and_the_trace_follows_it() -> None:
    clock = FakeClock()
    taken_from = 2  # the session drops the first two packets (before its handshake)
    handed: list[tuple[float, int]] = []

    def on_pcm(pcm: np.ndarray) -> bool:
        handed.append((clock.now, len(pcm)))
        return len(handed) > taken_from

    inbound = RtpInbound(on_pcm, RuntimeMetrics(), clock=clock)
    inbound.attach(SimpleNamespace(), {111})  # type: ignore[arg-type]
    encoder = OpusEncoder(5)
    packets = encoder.encode(tone()) + encoder.encode(tone())
    try:
        for seq, payload in enumerate(packets[:7], start=65_533):  # wraps past 65535
            await inbound._handle_rtp_packet(rtp(seq, payload), 0)
            assert handed[-1] == (clock.now, 480)  # handed on in the hook's own call, at arrival
            clock.advance(0.02)
    finally:
        inbound.close()
        encoder.close()
    trace = inbound.trace
    assert trace.first_rtp_at == 1000.0
    assert trace.taken_arrived_at == trace.taken_at == pytest.approx(1000.04)  # the third packet
    assert trace.frame_arrived_at == trace.frame_at == pytest.approx(1000.10)  # the sixth: 4 taken
    terms = trace.terms_ms()
    assert terms["jitter_hold"] == 0.0 and terms["frame_assembly"] == pytest.approx(60.0)
    assert inbound.buffer.stats.delivered == 7 and inbound.buffer.stats.concealed == 0


async def test_a_missing_packet_is_still_concealed_at_its_deadline() -> None:
    handed: list[int] = []
    inbound = RtpInbound(lambda pcm: handed.append(len(pcm)) or True, RuntimeMetrics())  # type: ignore[func-returns-value]
    inbound.attach(SimpleNamespace(), {111})  # type: ignore[arg-type]
    encoder = OpusEncoder(5)
    packets = encoder.encode(tone())
    try:
        await inbound._handle_rtp_packet(rtp(1, packets[0]), 0)
        await inbound._handle_rtp_packet(rtp(3, packets[2]), 0)  # 2 is missing: held behind the gap
        assert handed == [480] and inbound.buffer.depth == 1
        async with asyncio.timeout(WAIT_S):  # the playout task conceals 2 at its deadline, then plays 3
            while len(handed) < 3:
                await asyncio.sleep(0.01)
        assert inbound.buffer.stats.concealed == 1 and inbound.buffer.stats.delivered == 2
    finally:
        inbound.close()
        encoder.close()


async def test_the_replay_track_sends_nothing_before_its_gate_and_stamps_each_send() -> None:
    track = PacketReplayTrack([b"\x01", b"\x02"], loop=False)
    track.gate = asyncio.Event()
    first = asyncio.create_task(track.recv())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not first.done() and track.sent == 0
    track.gate.set()
    packet = await asyncio.wait_for(first, WAIT_S)
    assert bytes(packet) == b"\x01" and track.sent == 1 and len(track.sent_at) == 1
    await asyncio.wait_for(track.recv(), WAIT_S)
    assert len(track.sent_at) == 2 and track.sent_at[1] - track.sent_at[0] >= 0.0199  # paced 20 ms
    track.stop()


def test_first_audio_counts_from_the_packet_that_completes_the_nodes_first_frame() -> None:
    sent_at = [10.0, 10.02, 10.04, 10.06, 10.08]
    call = SimpleNamespace(
        track=SimpleNamespace(sent_at=sent_at), outcome=SimpleNamespace(handshake_s=0.5), started_at=9.4995
    )
    result = RtcSessionResult()
    _first_audio(result, call, [10.21, 10.23])  # type: ignore[arg-type]
    assert result.first_audio_ms == pytest.approx(150.0)  # from packet 3, like a WebSocket's whole frame
    assert result.first_audio_first_packet_ms == pytest.approx(210.0)
    assert result.stamps == pytest.approx(
        {
            "handshake": 9.9995,
            "packet0": 10.0,
            "packet1": 10.02,
            "packet2": 10.04,
            "packet3": 10.06,
            "first_audio": 10.21,
        }
    )
    short = RtcSessionResult()
    call.track.sent_at = sent_at[:2]
    _first_audio(short, call, [10.21])  # type: ignore[arg-type]
    assert short.first_audio_ms is None and short.first_audio_first_packet_ms == pytest.approx(210.0)


def test_the_trace_joins_the_nodes_log_and_the_clients_report_into_contiguous_terms(tmp_path, capsys) -> None:
    node = {
        "connected_at": 99.9, "spent_at": 99.99, "handshake_at": 100.0, "first_rtp_at": 100.004,
        "taken_arrived_at": 100.004, "taken_at": 100.0041, "frame_arrived_at": 100.065, "frame_at": 100.0655,
        "audio_put_at": 100.2, "audio_sent_at": 100.203,
    }  # fmt: skip
    client = {"handshake": 100.002, "packet0": 100.0025, "packet3": 100.0625, "first_audio": 100.204}
    row = {"session_id": "abc", "stamps": client, "first_audio_ms": (100.204 - 100.0625) * 1e3}
    log = tmp_path / "runtime.log"
    log.write_text(
        "2026-11-27 00:48:59,788 INFO worker-1 runtime.frontend.transports.webrtc.peer: "
        "WebRTC session abc first audio: " + json.dumps(node) + "\nunrelated line\n"
    )
    report = tmp_path / "run.json"
    report.write_text("progress text\n" + json.dumps({"webrtc": {"sessions": [row, {"session_id": "gone"}]}}))
    traces = node_traces(log.read_text().splitlines())
    assert list(traces) == ["abc"]
    (terms,) = join_traces([row, {"session_id": "gone", "stamps": {}}], traces)
    assert terms["handshake_trip"] == pytest.approx(2.0) and terms["first_packet_trip"] == pytest.approx(1.5)
    assert terms["frame_packetisation"] == pytest.approx(60.0) and terms["inbound_transit"] == pytest.approx(
        2.5
    )
    assert terms["jitter_hold"] == pytest.approx(0.5) and terms["engine"] == pytest.approx(134.5)
    parts = [name for name, _, _, part in TERMS if part == "first_audio"]
    assert sum(terms[name] for name in parts) == pytest.approx(terms["first_audio"])  # contiguous, no gap
    assert summarize([terms])["pacing"] == pytest.approx({"p50": 3.0, "p99": 3.0, "mean": 3.0})
    rtc_trace.main(["--log", str(log), "--report", str(report)])
    out = capsys.readouterr().out
    assert out.startswith("1 sessions (ms)") and re.search(r"engine\s+134\.5\s+134\.5\s+134\.5", out)
