"""Audio payload <-> 1920-sample frame converters: PCM exactness, Opus round trip, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import sphn

from runtime.engine.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.frontend.codecs.kyutai_audio import (
    OpusFrameAssembler,
    OpusFrameEncoder,
    PcmFrameAssembler,
    PcmFrameEncoder,
    PyavOpusFrameEncoder,
    make_codec,
    ogg_crc,
    split_ogg_pages,
)
from runtime.frontend.codecs.protocol import AudioFormat, ProtocolError
from runtime.tools.codec_bench import aligned_snr_db, pyav_encode_ogg, speech_frames

FRAME_BYTES = 2 * FRAME_SAMPLES


def sine(seconds: float, frequency_hz: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLE_RATE_HZ)) / SAMPLE_RATE_HZ
    return (amplitude * np.sin(2 * np.pi * frequency_hz * t)).astype(np.float32)


def frames_of(pcm: np.ndarray) -> list[np.ndarray]:
    whole = pcm.size // FRAME_SAMPLES * FRAME_SAMPLES
    return list(pcm[:whole].reshape(-1, FRAME_SAMPLES))


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


# ------------------------------------------------------------------------------------------------
# PCM
# ------------------------------------------------------------------------------------------------


def test_pcm_round_trip_is_exact_for_every_int16_value() -> None:
    every_int16 = np.arange(-32768, 32768, dtype=np.int64)
    values = np.concatenate([every_int16, np.zeros(35 * FRAME_SAMPLES - every_int16.size, dtype=np.int64)])
    payload = values.astype("<i2").tobytes()
    assembler = PcmFrameAssembler(max_buffered_frames=64)
    frames = assembler.push(payload)
    assert len(frames) == 35 and assembler.pending_samples == 0
    for frame in frames:
        assert frame.shape == (FRAME_SAMPLES,) and frame.dtype == np.float32
    pcm = np.concatenate(frames)
    assert pcm.min() == -1.0 and pcm.max() < 1.0
    encoder = PcmFrameEncoder()
    assert b"".join(encoder.encode(frame) for frame in frames) == payload


def test_pcm_frames_span_messages() -> None:
    samples = (np.arange(3 * FRAME_SAMPLES + 100) % 2000 - 1000).astype("<i2")
    payload = samples.tobytes()
    # Cut at odd sample counts so every frame is built from several messages.
    cuts = [0, 2 * 7, 2 * 1000, 2 * 1921, 2 * 3000, 2 * 5759, 2 * 5760, len(payload)]
    assembler = PcmFrameAssembler(max_buffered_frames=4)
    per_push = [assembler.push(payload[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    assert [len(frames) for frames in per_push] == [0, 0, 1, 0, 1, 1, 0]
    assert assembler.pending_samples == 100
    got = np.concatenate([frame for frames in per_push for frame in frames])
    assert np.array_equal(np.rint(got * 32768).astype(np.int16), samples[: 3 * FRAME_SAMPLES])


def test_pcm_odd_payload_is_bad_pcm_and_keeps_state() -> None:
    assembler = PcmFrameAssembler(max_buffered_frames=4)
    assert assembler.push(b"\x01\x00" * 10) == []
    with pytest.raises(ProtocolError) as info:
        assembler.push(b"\x00\x01\x02")
    assert info.value.reason == "bad_pcm"
    assert "3 bytes" in info.value.message and "Int16 little-endian" in info.value.message
    assert assembler.pending_samples == 10


def test_pcm_too_many_frames_in_one_push_is_too_fast_and_keeps_state() -> None:
    assembler = PcmFrameAssembler(max_buffered_frames=2)
    assert assembler.push(b"\x00\x00" * 100) == []
    with pytest.raises(ProtocolError) as info:
        assembler.push(b"\x00\x00" * (3 * FRAME_SAMPLES))
    assert info.value.reason == "too_fast"
    assert "3 frames" in info.value.message and "at most 2 frames" in info.value.message
    assert assembler.pending_samples == 100
    # Exactly max_buffered_frames frames in one push is fine.
    assert len(assembler.push(b"\x00\x00" * (2 * FRAME_SAMPLES - 100))) == 2


def test_pcm_empty_payload_yields_nothing() -> None:
    assert PcmFrameAssembler(max_buffered_frames=1).push(b"") == []


def test_pcm_encoder_clips_and_cleans() -> None:
    frame = np.zeros(FRAME_SAMPLES, dtype=np.float32)
    frame[:5] = [2.0, -2.0, np.nan, np.inf, -np.inf]
    samples = np.frombuffer(PcmFrameEncoder().encode(frame), dtype="<i2")
    assert samples.size == FRAME_SAMPLES
    assert samples[:5].tolist() == [32767, -32768, 0, 32767, -32768]


@pytest.mark.parametrize(
    "encoder", [PcmFrameEncoder(), OpusFrameEncoder(), PyavOpusFrameEncoder()], ids=["pcm", "opus", "pyav"]
)
@pytest.mark.parametrize(
    "frame",
    [
        np.zeros(FRAME_SAMPLES - 1, np.float32),
        np.zeros((1, FRAME_SAMPLES), np.float32),
        np.array(["a"] * 1920),
    ],
    ids=["short", "2d", "strings"],
)
def test_encoders_refuse_frames_of_wrong_shape(encoder: object, frame: np.ndarray) -> None:
    with pytest.raises(ValueError, match="1920"):
        encoder.encode(frame)  # type: ignore[attr-defined]


def test_max_buffered_frames_must_be_positive() -> None:
    for cls in (PcmFrameAssembler, OpusFrameAssembler):
        with pytest.raises(ValueError):
            cls(max_buffered_frames=0)


# ------------------------------------------------------------------------------------------------
# Opus
# ------------------------------------------------------------------------------------------------


def test_opus_round_trip_of_a_sine_keeps_length_energy_and_pitch() -> None:
    pcm = sine(2.0)
    encoder = OpusFrameEncoder()
    pages = [encoder.encode(frame) for frame in frames_of(pcm)]
    assert pages[0].startswith(b"OggS")
    assembler = OpusFrameAssembler(max_buffered_frames=4)
    decoded = [frame for page in pages if page for frame in assembler.push(page)]
    assert len(decoded) == 25  # 2 s / 80 ms
    for frame in decoded:
        assert frame.shape == (FRAME_SAMPLES,) and frame.dtype == np.float32
    out = np.concatenate(decoded)
    steady_in, steady_out = pcm[SAMPLE_RATE_HZ // 4 :], out[SAMPLE_RATE_HZ // 4 :]
    assert rms(steady_out) == pytest.approx(rms(steady_in), rel=0.15)
    spectrum = np.abs(np.fft.rfft(steady_out))
    peak_hz = np.argmax(spectrum) * SAMPLE_RATE_HZ / steady_out.size
    assert peak_hz == pytest.approx(440.0, abs=5.0)


def test_opus_pages_split_across_messages_decode_the_same() -> None:
    encoder = OpusFrameEncoder()
    stream = b"".join(encoder.encode(frame) for frame in frames_of(sine(0.8)))
    whole = OpusFrameAssembler(max_buffered_frames=20).push(stream)
    assembler = OpusFrameAssembler(max_buffered_frames=20)
    pieces = [stream[i : i + 37] for i in range(0, len(stream), 37)]
    split = [frame for piece in pieces for frame in assembler.push(piece)]
    assert len(whole) == len(split) == 10
    assert np.array_equal(np.concatenate(whole), np.concatenate(split))


def test_opus_too_many_frames_in_one_push_is_too_fast_and_stream_continues() -> None:
    encoder = OpusFrameEncoder()
    pages = [encoder.encode(frame) for frame in frames_of(sine(1.2))]
    assembler = OpusFrameAssembler(max_buffered_frames=3)
    with pytest.raises(ProtocolError) as info:
        assembler.push(b"".join(pages[:8]))
    assert info.value.reason == "too_fast"
    assert not assembler.failed
    assert sum(len(assembler.push(page)) for page in pages[8:]) == len(pages) - 8


@pytest.mark.parametrize(
    "garbage",
    [b"this is not an ogg stream at all, just text", bytes(range(256)) * 4, b"OggS" + b"\xff" * 200],
    ids=["text", "bytes", "bad-ogg-header"],
)
def test_opus_garbage_is_bad_opus_and_the_stream_stays_failed(garbage: bytes) -> None:
    assembler = OpusFrameAssembler(max_buffered_frames=4)
    with pytest.raises(ProtocolError) as info:
        assembler.push(garbage)
    assert info.value.reason == "bad_opus"
    assert "Ogg/Opus" in info.value.message
    assert assembler.failed
    good = OpusFrameEncoder().encode(sine(0.08))
    with pytest.raises(ProtocolError) as again:
        assembler.push(good)
    assert again.value.reason == "bad_opus" and "already failed" in again.value.message


def test_opus_short_garbage_is_reported_on_a_later_push() -> None:
    """sphn buffers fewer bytes than an Ogg page header without looking at them."""
    assembler = OpusFrameAssembler(max_buffered_frames=4)
    assert assembler.push(b"garbage") == []
    with pytest.raises(ProtocolError) as info:
        assembler.push(b"x" * 100)
    assert info.value.reason == "bad_opus"


def test_sphn_behaviour_on_garbage_is_what_the_assembler_expects() -> None:
    """Pin sphn's behaviour: ValueError on non-Ogg bytes, silence on a short prefix."""
    reader = sphn.OpusStreamReader(SAMPLE_RATE_HZ)
    assert reader.append_bytes(b"junk").size == 0
    with pytest.raises(ValueError, match="capture pattern"):
        reader.append_bytes(b"more junk than a page header needs to hold, more junk")


@pytest.mark.parametrize("make_encoder", [OpusFrameEncoder, PyavOpusFrameEncoder], ids=["sphn", "pyav"])
def test_opus_encoder_survives_silence_clipping_and_nan(make_encoder: type) -> None:
    encoder = make_encoder()
    frames = [np.zeros(FRAME_SAMPLES, np.float32), np.full(FRAME_SAMPLES, 3.0, np.float32)]
    frames.append(np.full(FRAME_SAMPLES, np.nan, np.float32))
    stream = b"".join(encoder.encode(frame) for frame in frames)
    decoded = OpusFrameAssembler(max_buffered_frames=4).push(stream)
    assert len(decoded) == 3
    assert all(np.all(np.abs(frame) <= 1.0) for frame in decoded)


# ------------------------------------------------------------------------------------------------
# Factory
# ------------------------------------------------------------------------------------------------


def test_make_codec_picks_the_pair_for_the_format() -> None:
    assembler, encoder = make_codec(AudioFormat.PCM, max_buffered_frames=5)
    assert isinstance(assembler, PcmFrameAssembler) and isinstance(encoder, PcmFrameEncoder)
    assert assembler.max_buffered_frames == 5
    assembler, encoder = make_codec("opus", max_buffered_frames=5)
    assert isinstance(assembler, OpusFrameAssembler) and isinstance(encoder, OpusFrameEncoder)
    with pytest.raises(ValueError):
        make_codec("wav", max_buffered_frames=5)
    _, encoder = make_codec("opus", max_buffered_frames=5, opus_encoder="pyav", opus_complexity=3)
    assert isinstance(encoder, PyavOpusFrameEncoder) and encoder.complexity == 3
    _, encoder = make_codec("pcm", max_buffered_frames=5, opus_encoder="pyav", opus_complexity=3)
    assert isinstance(encoder, PcmFrameEncoder)
    with pytest.raises(ValueError, match="sphn, pyav"):
        make_codec("opus", max_buffered_frames=5, opus_encoder="ffmpeg")
    with pytest.raises(ValueError, match="sphn cannot set libopus complexity"):
        make_codec("opus", max_buffered_frames=5, opus_complexity=5)
    for complexity in (-1, 11, 5.0, True):
        with pytest.raises(ValueError, match="0..10"):
            PyavOpusFrameEncoder(complexity)  # type: ignore[arg-type]


def test_one_long_valid_opus_message_is_too_fast_not_bad_opus() -> None:
    """60 KB of valid Ogg/Opus in one message (about 30 s of speech-rate Opus; here 14 s of a loud sine):
    sphn alone fails on it (``invalid argument``); the assembler decodes page by page, refuses the message
    as ``too_fast`` and the stream goes on."""
    encoder = OpusFrameEncoder()
    tone = sine(40.0)
    stream = b"".join(encoder.encode(tone[i : i + FRAME_SAMPLES]) for i in range(0, tone.size, FRAME_SAMPLES))
    long_message, rest = stream[:60_000], stream[60_000:]
    with pytest.raises(ValueError):
        sphn.OpusStreamReader(SAMPLE_RATE_HZ).append_bytes(long_message)
    assembler = OpusFrameAssembler(max_buffered_frames=8)
    with pytest.raises(ProtocolError) as info:
        assembler.push(long_message)
    assert info.value.reason == "too_fast", info.value
    assert not assembler.failed
    frames = []
    for i in range(0, len(rest), 400):
        frames += assembler.push(rest[i : i + 400])
    assert len(frames) > 100
    assert all(frame.shape == (FRAME_SAMPLES,) for frame in frames)


def test_split_ogg_pages_keeps_an_incomplete_page_for_later() -> None:
    stream = OpusFrameEncoder().encode(sine(0.08)) + OpusFrameEncoder().encode(sine(0.08))
    pages, rest = split_ogg_pages(stream)
    assert rest == b"" and b"".join(pages) == stream and len(pages) >= 2
    pages, rest = split_ogg_pages(stream[:-5])
    assert b"".join(pages) + rest == stream[:-5] and rest
    assert split_ogg_pages(b"Og") == ([], b"Og")
    assert split_ogg_pages(b"not ogg") == ([b"not ogg"], b"")


# ------------------------------------------------------------------------------------------------
# The PyAV encoder against sphn (Kyutai's clients decode with sphn's OpusStreamReader)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    """[30, 1920] float32: 2.4 s of espeak-ng speech."""
    return speech_frames(30)


def _page_fields(page: bytes) -> tuple[int, int, int, int]:
    """(header type, granule position, serial, sequence) of one Ogg page."""
    return (
        page[5],
        int.from_bytes(page[6:14], "little"),
        int.from_bytes(page[14:18], "little"),
        int.from_bytes(page[18:22], "little"),
    )


@pytest.mark.parametrize("complexity", [10, 5, 0])
def test_sphn_decodes_the_pyav_stream_frame_for_frame(speech: np.ndarray, complexity: int) -> None:
    encoder = PyavOpusFrameEncoder(complexity)
    payloads = [encoder.encode(frame) for frame in speech]
    reader = sphn.OpusStreamReader(SAMPLE_RATE_HZ)  # what Kyutai's Python client decodes with
    decoded = [np.asarray(reader.append_bytes(payload)).reshape(-1) for payload in payloads]
    assert [chunk.size for chunk in decoded] == [FRAME_SAMPLES] * len(speech)  # no frame late, none lost
    assert aligned_snr_db(speech.reshape(-1), np.concatenate(decoded))[0] > 5.0  # the speech, not noise
    # our own assembler (sphn inside) gets the same frames back
    assembler, _ = make_codec("opus", max_buffered_frames=2)
    frames = [frame for payload in payloads for frame in assembler.push(payload)]
    assert len(frames) == len(speech)


def test_the_pyav_stream_has_sphns_headers_and_page_layout(speech: np.ndarray) -> None:
    sphn_writer = sphn.OpusStreamWriter(SAMPLE_RATE_HZ)
    sphn_payloads = [bytes(sphn_writer.append_pcm(frame)) for frame in speech]
    encoder = PyavOpusFrameEncoder()
    payloads = [encoder.encode(frame) for frame in speech]
    sphn_pages = [split_ogg_pages(payload)[0] for payload in sphn_payloads]
    pages = [split_ogg_pages(payload)[0] for payload in payloads]
    assert [len(p) for p in pages] == [len(p) for p in sphn_pages] == [4] + [2] * (len(speech) - 1)
    assert pages[0][:2] == sphn_pages[0][:2]  # OpusHead and OpusTags pages, byte for byte
    flat = [page for frame_pages in pages for page in frame_pages]
    sphn_flat = [page for frame_pages in sphn_pages for page in frame_pages]
    assert [_page_fields(page) for page in flat] == [_page_fields(page) for page in sphn_flat]
    for page in flat:  # one packet per page, CRC right
        assert page[26 + page[26]] < 255
        assert ogg_crc(page[:22] + bytes(4) + page[26:]) == int.from_bytes(page[22:26], "little")


def test_ogg_crc_matches_the_pages_sphn_and_ffmpeg_write(speech: np.ndarray) -> None:
    """sphn (Rust ``ogg`` crate) and FFmpeg's Ogg muxer computed these pages' checksums independently."""
    writer = sphn.OpusStreamWriter(SAMPLE_RATE_HZ)
    streams = [b"".join(bytes(writer.append_pcm(frame)) for frame in speech[:5])]
    streams.append(b"".join(pyav_encode_ogg(speech[:5])))
    for stream in streams:
        pages, rest = split_ogg_pages(stream)
        assert not rest and len(pages) > 5
        for page in pages:
            assert ogg_crc(page[:22] + bytes(4) + page[26:]) == int.from_bytes(page[22:26], "little")
    assert ogg_crc(b"") == 0 and ogg_crc(b"OggS") != 0


def _bitwise_ogg_crc(data: bytes) -> int:
    """RFC 3533's checksum one bit at a time: polynomial 0x04C11DB7, MSB first, initial 0, no final XOR."""
    crc = 0
    for byte in data:
        crc ^= byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) if crc & 0x80000000 else crc << 1
            crc &= 0xFFFFFFFF
    return crc


def test_ogg_crc_is_rfc_3533s_checksum() -> None:
    rng = np.random.default_rng(3)
    for size in (1, 2, 3, 27, 255, 1000):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert ogg_crc(data) == _bitwise_ogg_crc(data), size


def _ffmpeg_samples(stream: bytes) -> int:
    """Samples (48 kHz) FFmpeg's own Ogg demuxer and Opus decoder get from a whole stream."""
    import io

    import av

    with av.open(io.BytesIO(stream), format="ogg") as container:
        (audio,) = container.streams.audio
        assert audio.codec_context.name == "opus" and audio.channels == 1
        return sum(frame.samples for frame in container.decode(audio))


def test_ffmpeg_reads_the_pyav_stream_as_it_reads_sphns(speech: np.ndarray) -> None:
    """A second, independent Ogg/Opus reader (FFmpeg's demuxer; Kyutai's web client uses libogg + libopus)
    takes both streams alike: same header, same length after the 3840-sample pre-skip."""
    writer = sphn.OpusStreamWriter(SAMPLE_RATE_HZ)
    sphn_stream = b"".join(bytes(writer.append_pcm(frame)) for frame in speech)
    encoder = PyavOpusFrameEncoder(5)
    pyav_stream = b"".join(encoder.encode(frame) for frame in speech)
    expected = len(speech) * FRAME_SAMPLES * 2 - 3840  # 48 kHz, less OpusHead's pre-skip
    assert _ffmpeg_samples(sphn_stream) == _ffmpeg_samples(pyav_stream) == expected
