"""libopus through ctypes for WebRTC (runtime/frontend/codecs/opus_rtp.py): mono 20 ms packets out, 24 kHz
in, loss
concealment for a missing packet, clear errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.frontend.codecs.opus_rtp import PACKET_SAMPLES, OpusDecoder, OpusEncoder, OpusError


def tone(frames: int, hz: float = 440.0) -> np.ndarray:
    t = np.arange(frames * 1920) / 24_000
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def test_a_frame_is_four_mono_20_ms_packets_that_decode_back_at_24_khz() -> None:
    encoder, decoder = OpusEncoder(5), OpusDecoder()
    audio = tone(25)
    out = []
    for i in range(25):
        packets = encoder.encode(audio[i * 1920 : (i + 1) * 1920])
        assert len(packets) == 4
        for packet in packets:
            toc = packet[0]
            assert toc & 0x04 == 0, "stereo flag set"  # RFC 6716 3.1: s bit
            assert toc & 0x03 == 0, "one frame per packet"
            assert 20 <= len(packet) <= 200  # ~32 kbps: 80 bytes per 20 ms
            out.append(decoder.decode(packet))
    assert all(len(chunk) == PACKET_SAMPLES for chunk in out)
    decoded = np.concatenate(out).astype(np.float32) / 32768
    steady = decoded[4800:]
    assert 0.3 < np.abs(steady).max() < 0.6  # the tone's level came back (codec delay aside)
    spectrum = np.abs(np.fft.rfft(steady))
    assert abs(np.argmax(spectrum) * 24_000 / len(steady) - 440) < 5


def test_a_missing_packet_is_concealed_from_what_came_before() -> None:
    encoder, decoder = OpusEncoder(5), OpusDecoder()
    for packet in encoder.encode(tone(1)):
        decoder.decode(packet)
    concealed = decoder.decode(None)
    assert len(concealed) == PACKET_SAMPLES and np.abs(concealed).max() > 1000  # not silence: PLC
    assert len(decoder.decode(None, 960)) == 960


def test_bad_input_is_refused_clearly_and_the_codecs_stay_usable() -> None:
    encoder, decoder = OpusEncoder(), OpusDecoder()
    with pytest.raises(OpusError, match="opus_decode: .*libopus error"):
        decoder.decode(b"\xff\xff\xff")
    with pytest.raises(OpusError, match="opus_decode"):
        decoder.decode(None, 7)  # not a multiple of 2.5 ms
    with pytest.raises(ValueError, match="expected one frame of 1920 samples, got 100"):
        encoder.encode(np.zeros(100, dtype=np.float32))
    with pytest.raises(ValueError, match="complexity must be an integer 0..10"):
        OpusEncoder(11)
    assert len(decoder.decode(encoder.encode(tone(1))[0])) == PACKET_SAMPLES
    nan = np.full(1920, np.nan, dtype=np.float32)
    assert len(encoder.encode(nan)) == 4  # NaN becomes silence, not an error
    encoder.close()
    encoder.close()  # idempotent
