"""The Opus binding benchmark (runtime/tools/codec_bench.py): its helpers, and the two bindings' streams read
by
each other (sphn's reader decodes PyAV's Ogg/Opus; PyAV decodes sphn's packets). No timing is asserted."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine.model_presets import FRAME_SAMPLES
from runtime.tools.codec_bench import (
    PACKET_SAMPLES,
    aligned_snr_db,
    format_table,
    log_spectral_distance_db,
    muxer_lag_ms,
    ogg_packets,
    pyav_decode_packets,
    pyav_encode_ogg,
    run,
    speech_frames,
    sphn_decode_pyav_ogg,
    sphn_encode,
)


@pytest.fixture(scope="module")
def frames() -> np.ndarray:
    return speech_frames(20)


def _page(lacing: list[int], body: bytes, sequence: int) -> bytes:
    """An Ogg page with the given segment table (CRC left 0: split_ogg_pages does not check it)."""
    header = b"OggS" + bytes([0, 0]) + bytes(8) + (7).to_bytes(4, "little") + sequence.to_bytes(4, "little")
    return header + bytes(4) + bytes([len(lacing)]) + bytes(lacing) + body


def test_speech_frames_are_speech_in_80_ms_frames(frames: np.ndarray) -> None:
    assert frames.shape == (20, FRAME_SAMPLES)
    assert frames.dtype == np.float32
    assert float(np.sqrt(np.mean(frames**2))) > 0.01  # not silence
    assert np.abs(frames).max() <= 1.0
    with pytest.raises(ValueError, match="frame_count"):
        speech_frames(0)


def test_ogg_packets_follows_lacing_across_segments_and_pages() -> None:
    first = _page([255, 45, 10], bytes([1]) * 300 + bytes([2]) * 10, 0)
    # a 300-byte packet, a 10-byte one, then one that starts with 255 bytes and ends on the next page
    spanning = _page([255], bytes([3]) * 255, 1) + _page([5], bytes([3]) * 5, 2)
    packets = ogg_packets(first + spanning)
    assert [len(packet) for packet in packets] == [300, 10, 260]
    assert packets[0] == bytes([1]) * 300 and packets[2] == bytes([3]) * 260
    with pytest.raises(ValueError, match="do not complete"):
        ogg_packets(first[:-1])


def test_aligned_snr_finds_the_delay_and_refuses_silence() -> None:
    rng = np.random.default_rng(0)
    reference = rng.standard_normal(10_000).astype(np.float32)
    decoded = np.concatenate([np.zeros(123, np.float32), reference + 0.01 * rng.standard_normal(10_000)])
    snr, delay = aligned_snr_db(reference, decoded, max_delay=500)
    assert delay == 123
    assert 35 < snr < 45  # noise at 1 % of the signal's amplitude: 40 dB
    with pytest.raises(ValueError, match="silent"):
        aligned_snr_db(np.zeros(2000), decoded, max_delay=500)


def test_log_spectral_distance_is_zero_for_the_same_audio_and_grows_with_damage(frames: np.ndarray) -> None:
    speech = frames.reshape(-1)
    assert log_spectral_distance_db(speech, speech) == 0.0
    delayed = np.concatenate([np.zeros(300, np.float32), speech])
    assert log_spectral_distance_db(speech, delayed) < 0.01  # the delay is aligned away
    rng = np.random.default_rng(1)
    slight = log_spectral_distance_db(speech, speech + 0.001 * rng.standard_normal(speech.size))
    heavy = log_spectral_distance_db(speech, speech + 0.03 * rng.standard_normal(speech.size))
    assert 0 < slight < heavy


def test_sphn_reads_pyav_ogg_opus_packet_for_packet(frames: np.ndarray) -> None:
    chunks = pyav_encode_ogg(frames)
    audio_packets = [packet for packet in ogg_packets(b"".join(chunks)) if packet[:4] != b"Opus"]
    assert len(audio_packets) == 2 * len(frames) + 1  # two 40 ms packets a frame, one more at the close
    decoded = sphn_decode_pyav_ogg(chunks)
    assert decoded.size == len(audio_packets) * PACKET_SAMPLES
    assert aligned_snr_db(frames.reshape(-1), decoded)[0] > 5.0
    # FFmpeg's muxer keeps the last 40 ms packet until the next frame: the latency it would add live
    assert muxer_lag_ms(chunks) == pytest.approx(40.0)


def test_pyav_reads_sphn_ogg_opus(frames: np.ndarray) -> None:
    packets = ogg_packets(b"".join(sphn_encode(frames)))
    assert packets[0].startswith(b"OpusHead") and packets[1].startswith(b"OpusTags")
    audio_packets = packets[2:]
    assert len(audio_packets) == 2 * len(frames)
    for decoder in ("libopus", "opus"):
        decoded = pyav_decode_packets(audio_packets, decoder=decoder)
        # the 48 kHz -> 24 kHz resampler keeps back a few ms that are never flushed here
        assert len(frames) * FRAME_SAMPLES - 240 <= decoded.size <= len(frames) * FRAME_SAMPLES
        assert aligned_snr_db(frames.reshape(-1), decoded)[0] > 3.0


def test_run_measures_every_row_and_formats_a_table() -> None:
    rows = run(frame_count=10, repeats=1)
    names = [row.name for row in rows]
    assert names[0].startswith("sphn") and len(rows) == 7
    assert [name for name in names if "runtime encoder" in name] == [
        f"PyAV libopus, complexity {c} (runtime encoder, Ogg pages; sphn decodes)" for c in (10, 5, 0)
    ]
    for row in rows:
        assert row.kbit_s > 10
        assert row.decode_ms is None or row.decode_ms > 0
    table = format_table(rows).splitlines()
    assert len(table) == len(rows) + 2 and table[0].startswith("| binding |")
    with pytest.raises(ValueError, match="frame_count"):
        run(frame_count=5)
