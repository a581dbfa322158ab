"""Benchmark of the Opus bindings a front-end worker could use (issue 16, item 2):
``python -m runtime.tools.codec_bench`` encodes and decodes espeak-ng speech frame by frame with sphn (what
:mod:`runtime.frontend.codecs.kyutai_audio` uses) and PyAV's libopus at several complexities, and prints per
binding the ms per 80 ms frame, bit rate, log-spectral distance from the input
(:func:`log_spectral_distance_db`), whether the codec call releases the GIL (one thread against two) and
sessions per core. Figures are printed as a Markdown table, never asserted.

What each row runs, and the figures measured: docs/benchmarks.md, "Opus bindings (issue 16)"."""

from __future__ import annotations

import argparse
import functools
import io
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.engine.model_presets import FRAME_MS, FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.frontend.codecs.kyutai_audio import PYAV_OPUS_BITRATE_BPS, PyavOpusFrameEncoder, split_ogg_pages

__all__ = [
    "CodecFigures",
    "aligned_snr_db",
    "log_spectral_distance_db",
    "ogg_packets",
    "pyav_decode_packets",
    "pyav_encode_ogg",
    "muxer_lag_ms",
    "pyav_encode_packets",
    "runtime_pyav_encode",
    "run",
    "speech_frames",
    "sphn_decode_pages",
    "sphn_decode_pyav_ogg",
    "sphn_encode",
]

PACKET_MS = 40
"""Opus packet duration used by every encoder here: sphn's (960 samples at 24 kHz, one Ogg page each)."""
PACKET_SAMPLES = SAMPLE_RATE_HZ * PACKET_MS // 1000
PYAV_BITRATE_BPS = PYAV_OPUS_BITRATE_BPS
"""Bitrate asked of PyAV's encoder: the runtime's, chosen to match sphn's stream size (see audio_codec)."""


def speech_frames(frame_count: int) -> np.ndarray:
    """``frame_count`` consecutive 80 ms frames of espeak-ng speech, shape [frame_count, 1920] float32.

    The demo sentences of :mod:`runtime.tools.loadgen` back to back, repeated as needed.

    Raises:
        ValueError: ``frame_count`` < 1.
        SpeechSynthesisError: espeak-ng is missing or failed.
    """
    if frame_count < 1:
        raise ValueError(f"frame_count must be >= 1, got {frame_count}")
    from runtime.tools.loadgen import DEMO_SENTENCES, load_speech

    speech = np.concatenate(load_speech(None, len(DEMO_SENTENCES))).astype(np.float32)
    needed = frame_count * FRAME_SAMPLES
    repeated = np.tile(speech, -(-needed // speech.size))[:needed]
    return np.ascontiguousarray(repeated.reshape(frame_count, FRAME_SAMPLES))


def sphn_encode(frames: np.ndarray) -> list[bytes]:
    """Encode [N, 1920] frames with one ``sphn.OpusStreamWriter(24000)``: the Ogg bytes per frame."""
    import sphn

    writer = sphn.OpusStreamWriter(SAMPLE_RATE_HZ)
    return [bytes(writer.append_pcm(frame)) for frame in frames]


def sphn_decode_pages(pages: Sequence[bytes]) -> np.ndarray:
    """Decode Ogg pages with one ``sphn.OpusStreamReader(24000)``, page by page: float32 samples [S]."""
    import sphn

    reader = sphn.OpusStreamReader(SAMPLE_RATE_HZ)
    chunks = [np.asarray(reader.append_bytes(page), dtype=np.float32).reshape(-1) for page in pages]
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)


def ogg_packets(data: bytes) -> list[bytes]:
    """The packets of an Ogg stream (RFC 3533: lacing values of 255 continue a packet), headers included.

    Raises:
        ValueError: ``data`` ends inside a page, or holds bytes that are not Ogg pages.
    """
    pages, rest = split_ogg_pages(data)
    if rest:
        raise ValueError(f"{len(rest)} bytes at the end do not complete an Ogg page")
    packets: list[bytes] = []
    partial = b""
    for page in pages:
        if page[:4] != b"OggS" or len(page) < 27:
            raise ValueError("not an Ogg page (no OggS capture pattern)")
        segment_count = page[26]
        lacing = page[27 : 27 + segment_count]
        pos = 27 + segment_count
        for value in lacing:
            partial += page[pos : pos + value]
            pos += value
            if value < 255:
                packets.append(partial)
                partial = b""
    return packets


def _pyav_encoder(complexity: int, bitrate_bps: int):  # -> av.AudioCodecContext
    import av

    if not 0 <= complexity <= 10:
        raise ValueError(f"libopus complexity must be 0..10, got {complexity}")
    context = av.CodecContext.create("libopus", "w")
    context.sample_rate = SAMPLE_RATE_HZ
    context.layout = "mono"
    context.format = "flt"
    context.bit_rate = bitrate_bps
    context.options = {
        "frame_duration": str(PACKET_MS),
        "application": "voip",
        "compression_level": str(complexity),
    }
    context.open()
    return context


def _audio_frame(frame: np.ndarray, index: int):  # -> av.AudioFrame
    import av

    audio = av.AudioFrame.from_ndarray(frame.reshape(1, -1), format="flt", layout="mono")
    audio.sample_rate = SAMPLE_RATE_HZ
    audio.pts = index * FRAME_SAMPLES
    return audio


def pyav_encode_packets(
    frames: np.ndarray, *, complexity: int = 10, bitrate_bps: int = PYAV_BITRATE_BPS
) -> list[bytes]:
    """Encode [N, 1920] frames with PyAV's libopus into raw 40 ms Opus packets (2 per frame, no Ogg).

    Raises:
        ValueError: ``complexity`` outside 0..10.
    """
    context = _pyav_encoder(complexity, bitrate_bps)
    packets: list[bytes] = []
    for index, frame in enumerate(frames):
        packets.extend(bytes(packet) for packet in context.encode(_audio_frame(frame, index)))
    packets.extend(bytes(packet) for packet in context.encode(None))
    return packets


def pyav_encode_ogg(frames: np.ndarray, *, complexity: int = 10) -> list[bytes]:
    """Encode [N, 1920] frames through FFmpeg's Ogg muxer: the new Ogg bytes after each frame, then the
    bytes the muxer writes when closed as one last element (N + 1 elements in all).

    FFmpeg's muxer holds back each packet until the next one arrives (it must know whether a page ends),
    so a frame's bytes come out one packet (40 ms) late; its OpusHead has FFmpeg's pre-skip (312 at
    48 kHz), sphn's 3840.
    """
    import av

    buffer = io.BytesIO()
    container = av.open(buffer, "w", format="ogg", options={"page_duration": "20000", "flush_packets": "1"})
    stream = container.add_stream("libopus", rate=SAMPLE_RATE_HZ, layout="mono")
    stream.codec_context.bit_rate = PYAV_BITRATE_BPS
    stream.codec_context.options = {
        "frame_duration": str(PACKET_MS),
        "application": "voip",
        "compression_level": str(complexity),
    }
    chunks: list[bytes] = []
    written = 0
    for index, frame in enumerate(frames):
        for packet in stream.encode(_audio_frame(frame, index)):
            container.mux(packet)
        chunks.append(buffer.getvalue()[written:])
        written = buffer.tell()
    for packet in stream.encode(None):
        container.mux(packet)
    container.close()
    chunks.append(buffer.getvalue()[written:])
    return chunks


def pyav_decode_packets(packets: Sequence[bytes], *, decoder: str = "libopus") -> np.ndarray:
    """Decode raw Opus packets (no OpusHead/OpusTags) with PyAV to 24 kHz mono: float32 samples [S].

    FFmpeg's Opus decoders always output 48 kHz (``libopus`` as Int16, ``opus`` as planar float), so each
    decoded frame goes through FFmpeg's resampler to 24 kHz float, as a PyAV backend would have to do; its
    cost is part of the figure, and its buffer keeps back a few ms at the end (not flushed here).

    Args:
        decoder: ``libopus`` (the bundled libopus) or ``opus`` (FFmpeg's own decoder).
    """
    import av

    context: Any = av.CodecContext.create(decoder, "r")  # an AudioCodecContext
    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE_HZ)
    chunks: list[np.ndarray] = []
    for data in packets:
        for frame in context.decode(av.Packet(data)):
            for resampled in resampler.resample(frame):
                chunks.append(resampled.to_ndarray().reshape(-1))
    return np.concatenate(chunks).astype(np.float32, copy=False) if chunks else np.zeros(0, dtype=np.float32)


def aligned_snr_db(reference: np.ndarray, decoded: np.ndarray, *, max_delay: int = 4000) -> tuple[float, int]:
    """SNR in dB of ``decoded`` against ``reference`` (both [S] float), after shifting ``decoded`` earlier by
    the delay in 0..``max_delay`` samples that best correlates them (a codec's look-ahead and pre-skip).

    Returns:
        (snr_db, delay_samples).

    Raises:
        ValueError: fewer than ``max_delay`` + 1 decoded samples, or a silent reference.
    """
    reference = np.asarray(reference, dtype=np.float64).reshape(-1)
    decoded = np.asarray(decoded, dtype=np.float64).reshape(-1)
    if decoded.size <= max_delay or reference.size <= max_delay:
        raise ValueError(f"need more than {max_delay} samples, got {reference.size} and {decoded.size}")
    length = min(reference.size, decoded.size) - max_delay
    head = reference[:length]
    if not np.any(head):
        raise ValueError("the reference is silent: SNR is undefined")
    scores = [float(np.dot(head, decoded[delay : delay + length])) for delay in range(max_delay + 1)]
    delay = int(np.argmax(scores))
    noise = head - decoded[delay : delay + length]
    return 10.0 * float(np.log10(np.dot(head, head) / max(float(np.dot(noise, noise)), 1e-20))), delay


def log_spectral_distance_db(
    reference: np.ndarray, decoded: np.ndarray, *, max_delay: int = 4000, window: int = 512
) -> float:
    """Log-spectral distance in dB (lower is closer; 0 for identical audio) of ``decoded`` against
    ``reference`` (both [S] float at 24 kHz), after the delay alignment of :func:`aligned_snr_db`.

    Short-time power spectra (Hann window of ``window`` samples, hop ``window`` / 2); for each frame of
    the reference within 50 dB of its loudest, the RMS over frequency bins of the difference of the two
    spectra in dB (each floored 80 dB under the reference's peak bin), averaged over those frames. Unlike
    the SNR it ignores phase, which Opus does not try to keep, so it ranks encoder settings by the
    spectrum they deliver.

    Raises:
        ValueError: as :func:`aligned_snr_db`.
    """
    _, delay = aligned_snr_db(reference, decoded, max_delay=max_delay)
    reference = np.asarray(reference, dtype=np.float64).reshape(-1)
    decoded = np.asarray(decoded, dtype=np.float64).reshape(-1)[delay:]
    length = min(reference.size, decoded.size)
    hop = window // 2
    starts = np.arange(0, length - window + 1, hop)
    hann = np.hanning(window)

    def power(signal: np.ndarray) -> np.ndarray:
        frames = np.stack([signal[start : start + window] for start in starts]) * hann
        return np.abs(np.fft.rfft(frames, axis=1)) ** 2

    ref_power, dec_power = power(reference), power(decoded)
    floor = ref_power.max() * 1e-8
    ref_db = 10 * np.log10(np.maximum(ref_power, floor))
    dec_db = 10 * np.log10(np.maximum(dec_power, floor))
    frame_energy = ref_power.sum(axis=1)
    loud = frame_energy >= frame_energy.max() * 1e-5
    per_frame = np.sqrt(np.mean((ref_db[loud] - dec_db[loud]) ** 2, axis=1))
    return float(per_frame.mean())


def _wall_s(job: Callable[[], object]) -> float:
    start = time.perf_counter()
    job()
    return time.perf_counter() - start


def _gil_figures(
    encode: Callable[[np.ndarray], object], frames: np.ndarray, repeats: int
) -> tuple[float, float]:
    """(speedup, cores) of encoding ``frames`` on two threads (half each, own encoder) against one thread:
    the best one-thread wall time over the best two-thread wall time, and the CPU seconds over wall seconds
    of that best two-thread run (best of ``repeats`` each)."""
    one_thread_s = min(_wall_s(lambda: encode(frames)) for _ in range(repeats))
    halves = (frames[: len(frames) // 2], frames[len(frames) // 2 :])
    best: tuple[float, float] = (float("inf"), 0.0)
    for _ in range(repeats):
        threads = [threading.Thread(target=encode, args=(half,)) for half in halves]
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall_s = time.perf_counter() - wall_start
        best = min(best, (wall_s, (time.process_time() - cpu_start) / wall_s))
    return one_thread_s / best[0], best[1]


@dataclass
class CodecFigures:
    """One row of the benchmark: a binding and setting, its costs per 80 ms frame and its GIL behaviour.

    Attributes:
        name: binding and setting.
        encode_ms, decode_ms: wall milliseconds per 80 ms frame, best of the repeats (decode None: not
            measured for this row).
        kbit_s: bytes on the wire per second of audio, Ogg overhead included where the row writes Ogg.
        lsd_db: see :func:`log_spectral_distance_db` (NaN: not measured for this row).
        speedup, cores: see the module docstring (None: not measured).
    """

    name: str
    encode_ms: float
    decode_ms: float | None
    kbit_s: float
    lsd_db: float
    speedup: float | None
    cores: float | None

    @property
    def sessions_per_core(self) -> float:
        """80 ms over encode + decode ms per frame: sessions one core's codec work carries."""
        return FRAME_MS / (self.encode_ms + (self.decode_ms or 0.0))


def _best_ms(job: Callable[[], object], frame_count: int, repeats: int) -> float:
    return min(_wall_s(job) for _ in range(repeats)) / frame_count * 1e3


def run(frame_count: int = 250, repeats: int = 3) -> list[CodecFigures]:
    """Measure every row (see the module docstring) on ``frame_count`` frames of speech, best of ``repeats``.

    Raises:
        ValueError: ``frame_count`` < 10 or ``repeats`` < 1.
        RuntimeError: see :func:`sphn_decode_pyav_ogg`.
    """
    if frame_count < 10 or repeats < 1:
        raise ValueError(f"need frame_count >= 10 and repeats >= 1, got {frame_count} and {repeats}")
    frames = speech_frames(frame_count)
    reference = frames.reshape(-1)
    seconds = frame_count * FRAME_MS / 1e3
    rows: list[CodecFigures] = []

    sphn_bytes = b"".join(sphn_encode(frames))
    pages, _ = split_ogg_pages(sphn_bytes)
    decoded = sphn_decode_pages(pages)
    speedup, cores = _gil_figures(sphn_encode, frames, repeats)
    rows.append(
        CodecFigures(
            "sphn 0.2 (Ogg, libopus defaults)",
            _best_ms(lambda: sphn_encode(frames), frame_count, repeats),
            _best_ms(lambda: sphn_decode_pages(pages), frame_count, repeats),
            len(sphn_bytes) * 8 / seconds / 1e3,
            log_spectral_distance_db(reference, decoded),
            speedup,
            cores,
        )
    )

    for complexity in (10, 5, 0):
        payloads = runtime_pyav_encode(frames, complexity)
        stream_pages, _ = split_ogg_pages(b"".join(payloads))
        encode = functools.partial(runtime_pyav_encode, complexity=complexity)
        speedup, cores = _gil_figures(encode, frames, repeats)
        rows.append(
            CodecFigures(
                f"PyAV libopus, complexity {complexity} (runtime encoder, Ogg pages; sphn decodes)",
                _best_ms(functools.partial(encode, frames), frame_count, repeats),
                _best_ms(functools.partial(sphn_decode_pages, stream_pages), frame_count, repeats),
                len(b"".join(payloads)) * 8 / seconds / 1e3,
                log_spectral_distance_db(reference, sphn_decode_pages(stream_pages)),
                speedup,
                cores,
            )
        )

    packets = pyav_encode_packets(frames)
    rows.append(
        CodecFigures(
            "PyAV libopus, complexity 10, raw packets (no Ogg); decode: FFmpeg libopus + resampler",
            _best_ms(lambda: pyav_encode_packets(frames), frame_count, repeats),
            _best_ms(lambda: pyav_decode_packets(packets), frame_count, repeats),
            sum(map(len, packets)) * 8 / seconds / 1e3,
            float("nan"),
            None,
            None,
        )
    )
    sphn_packets = [packet for packet in ogg_packets(sphn_bytes) if packet[:4] != b"Opus"]
    rows.append(
        CodecFigures(
            "FFmpeg's own 'opus' decoder + resampler, sphn's packets",
            float("nan"),
            _best_ms(lambda: pyav_decode_packets(sphn_packets, decoder="opus"), frame_count, repeats),
            len(sphn_bytes) * 8 / seconds / 1e3,
            float("nan"),
            None,
            None,
        )
    )

    ogg_bytes = b"".join(pyav_encode_ogg(frames))
    speedup, cores = _gil_figures(pyav_encode_ogg, frames, repeats)
    rows.append(
        CodecFigures(
            "PyAV libopus + FFmpeg's Ogg muxer, complexity 10",
            _best_ms(lambda: pyav_encode_ogg(frames), frame_count, repeats),
            None,
            len(ogg_bytes) * 8 / seconds / 1e3,
            log_spectral_distance_db(reference, sphn_decode_pyav_ogg(pyav_encode_ogg(frames))),
            speedup,
            cores,
        )
    )
    return rows


def runtime_pyav_encode(frames: np.ndarray, complexity: int = 10) -> list[bytes]:
    """Encode [N, 1920] frames with the runtime's
    :class:`~runtime.frontend.codecs.kyutai_audio.PyavOpusFrameEncoder`
    (``DUPLEX_OPUS_ENCODER=pyav``): the Ogg bytes per frame."""
    encoder = PyavOpusFrameEncoder(complexity)
    return [encoder.encode(frame) for frame in frames]


def sphn_decode_pyav_ogg(chunks: Sequence[bytes]) -> np.ndarray:
    """Decode the output of :func:`pyav_encode_ogg` with sphn's reader, page by page: float32 [S].

    Raises:
        RuntimeError: sphn did not decode each of the stream's Opus packets to 960 samples (40 ms).
    """
    data = b"".join(chunks)
    decoded = sphn_decode_pages(split_ogg_pages(data)[0])
    audio_packets = [packet for packet in ogg_packets(data) if packet[:4] != b"Opus"]
    if decoded.size != len(audio_packets) * PACKET_SAMPLES:
        raise RuntimeError(
            f"sphn decoded PyAV's Ogg stream to {decoded.size} samples, not {PACKET_SAMPLES} for each of "
            f"its {len(audio_packets)} packets"
        )
    return decoded


def muxer_lag_ms(chunks: Sequence[bytes]) -> float:
    """Audio (ms) that FFmpeg's Ogg muxer still held back after the last frame of :func:`pyav_encode_ogg`:
    the frames' duration minus what sphn decodes from every chunk but the closing one."""
    frame_count = len(chunks) - 1
    decoded = sphn_decode_pages(split_ogg_pages(b"".join(chunks[:-1]))[0])
    return (frame_count * FRAME_SAMPLES - decoded.size) * 1e3 / SAMPLE_RATE_HZ


def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None or value != value else f"{value:.{digits}f}"


def format_table(rows: Sequence[CodecFigures]) -> str:
    """The rows as a Markdown table (ms per 80 ms frame; "-": not measured for that row)."""
    lines = [
        "| binding | encode ms | decode ms | kbit/s | LSD dB | 2 threads: speedup, cores | sessions/core |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        gil = "-" if row.speedup is None else f"{row.speedup:.2f}x, {row.cores:.2f}"
        both = row.decode_ms is not None and row.encode_ms == row.encode_ms
        per_core = f"{row.sessions_per_core:.0f}" if both else "-"
        lines.append(
            f"| {row.name} | {_cell(row.encode_ms, 3)} | {_cell(row.decode_ms, 3)} | {row.kbit_s:.1f} "
            f"| {_cell(row.lsd_db, 2)} | {gil} | {per_core} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m runtime.tools.codec_bench [--frames N] [--repeats R]``: print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=250, help="80 ms frames of speech per run (>= 10)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats; the best is kept (>= 1)")
    args = parser.parse_args(argv)
    try:
        import av  # noqa: F401
    except ImportError:
        parser.error("PyAV is not installed: pip install av (the dev extra carries it)")
    print(format_table(run(args.frames, args.repeats)))
    lag_ms = muxer_lag_ms(pyav_encode_ogg(speech_frames(25)))
    print(f"\nFFmpeg's Ogg muxer holds back {lag_ms:.0f} ms of encoded audio until the next frame arrives.")


if __name__ == "__main__":
    main()
