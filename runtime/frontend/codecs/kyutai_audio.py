"""Per-session converters between audio payloads on the wire and the model's 80 ms frames.

Inbound, a :class:`FrameAssembler` (:class:`OpusFrameAssembler`, :class:`PcmFrameAssembler`) turns the
payloads of 0x01 audio messages into [1920] float32 frames at 24000 Hz, refusing a push that completes
more than ``max_buffered_frames`` (``too_fast``) and, for good, a stream sphn cannot decode (``bad_opus``).
Outbound, a :class:`FrameEncoder` turns one frame into one message's payload: sphn's Opus, or
(``DUPLEX_OPUS_ENCODER=pyav``) :class:`PyavOpusFrameEncoder`, PyAV's libopus at a chosen complexity in a
stream of sphn's shape. ``make_codec`` picks them. One assembler and one encoder per session: both are
stateful and not thread-safe.

The encoders compared, and the choice: docs/benchmarks.md, "Opus bindings (issue 16)"; the encoder
settings: docs/runtime.md, "Processes: one engine, N front-end workers"."""

from __future__ import annotations

import zlib
from typing import Protocol

import numpy as np
import sphn

from runtime.engine.model_presets import FRAME_MS, FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.frontend.codecs.protocol import AudioFormat, ProtocolError

__all__ = [
    "FrameAssembler",
    "FrameEncoder",
    "OpusFrameAssembler",
    "OpusFrameEncoder",
    "PcmFrameAssembler",
    "OPUS_ENCODERS",
    "PcmFrameEncoder",
    "PyavOpusFrameEncoder",
    "make_codec",
    "ogg_crc",
    "split_ogg_pages",
]

_PCM_SCALE = 32768.0
"""Int16 full scale: sample k <-> float k / 32768, so every Int16 value round-trips exactly."""
_PCM_BYTES_PER_SAMPLE = 2


class FrameAssembler(Protocol):
    """Turns the payloads of inbound 0x01 audio messages (Ogg/Opus pages, or Int16 LE PCM for a ``format=pcm``
    session) into frames of ``FRAME_SAMPLES`` (1920) float32 samples at ``SAMPLE_RATE_HZ`` (24000 Hz),
    keeping whatever does not fill a frame yet for the next message. One per session: stateful, not
    thread-safe.

    Flow-control policy (``max_buffered_frames``): :meth:`push` returns every complete frame at once, so the
    assembler itself only ever keeps less than one frame. A single push whose audio would complete more than
    ``max_buffered_frames`` frames is refused with ``ProtocolError(reason="too_fast")`` and its audio is
    dropped as a whole; the assembler stays usable. Callers that bound their own inbound queue by the same
    figure can therefore never be handed more than they may hold in one go; what they do once their queue is
    full (drop oldest, close) is theirs to decide.
    """

    def push(self, payload: bytes) -> list[np.ndarray]: ...


class FrameEncoder(Protocol):
    """Turns one [1920] float32 frame into the payload of an outbound audio message (maybe b""). One per
    session: stateful, not thread-safe."""

    def encode(self, frame: np.ndarray) -> bytes: ...


def _check_max_buffered_frames(max_buffered_frames: int) -> int:
    if max_buffered_frames < 1:
        raise ValueError(f"max_buffered_frames must be >= 1, got {max_buffered_frames}")
    return int(max_buffered_frames)


def _too_fast(frames: int, max_buffered_frames: int) -> ProtocolError:
    return ProtocolError(
        "too_fast",
        f"one audio message completed {frames} frames ({frames * FRAME_MS:.0f} ms of audio); a session may "
        f"buffer at most {max_buffered_frames} frames ({max_buffered_frames * FRAME_MS:.0f} ms): send audio "
        "in real time, in messages of at most that length",
    )


def _split_frames(samples: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Cut float32 samples into whole [1920] frames and the remainder (fewer than 1920 samples)."""
    whole = (samples.size // FRAME_SAMPLES) * FRAME_SAMPLES
    block = samples[:whole].reshape(-1, FRAME_SAMPLES)
    return list(block), samples[whole:].copy()


def _prepare_frame(frame: np.ndarray) -> np.ndarray:
    """Validate one outbound frame: [1920] real numbers -> contiguous float32 in [-1, 1], NaN -> 0."""
    array = np.asarray(frame)
    if array.shape != (FRAME_SAMPLES,) or not np.issubdtype(array.dtype, np.number):
        raise ValueError(
            f"expected one frame of shape ({FRAME_SAMPLES},) float32 ({FRAME_MS:.0f} ms at "
            f"{SAMPLE_RATE_HZ} Hz), got shape {array.shape} dtype {array.dtype}"
        )
    array = np.nan_to_num(array.astype(np.float32, copy=False), nan=0.0, posinf=1.0, neginf=-1.0)
    return np.ascontiguousarray(np.clip(array, -1.0, 1.0), dtype=np.float32)


class PcmFrameAssembler:
    """Raw PCM (Int16 little-endian, 24000 Hz mono) payloads -> [1920] float32 frames in [-1, 1).

    A frame may span several messages; each message must hold whole samples (an even byte count).

    Args:
        max_buffered_frames: most frames (80 ms each) one :meth:`push` may complete (>= 1).
    """

    def __init__(self, max_buffered_frames: int) -> None:
        self.max_buffered_frames = _check_max_buffered_frames(max_buffered_frames)
        self._pending = b""

    @property
    def pending_samples(self) -> int:
        """Samples received but not yet returned in a frame (0..1919)."""
        return len(self._pending) // _PCM_BYTES_PER_SAMPLE

    def push(self, payload: bytes) -> list[np.ndarray]:
        """Add one audio payload; return the frames it completes, oldest first.

        Args:
            payload: Int16 LE samples, any whole number of them (0 bytes is fine).

        Returns:
            Zero or more arrays of shape [1920], dtype float32, values k / 32768 for Int16 k.

        Raises:
            ProtocolError: ``bad_pcm`` for an odd byte count (the payload is dropped); ``too_fast`` when
                the payload would complete more than ``max_buffered_frames`` frames (the payload is
                dropped, pending samples are kept).
        """
        payload = bytes(payload)
        if len(payload) % _PCM_BYTES_PER_SAMPLE:
            raise ProtocolError(
                "bad_pcm",
                f"a PCM audio payload must hold whole Int16 little-endian samples (an even number of "
                f"bytes, 24000 Hz mono); got {len(payload)} bytes",
            )
        buffered = self._pending + payload
        frame_bytes = FRAME_SAMPLES * _PCM_BYTES_PER_SAMPLE
        frame_count = len(buffered) // frame_bytes
        if frame_count > self.max_buffered_frames:
            raise _too_fast(frame_count, self.max_buffered_frames)
        whole = frame_count * frame_bytes
        self._pending = buffered[whole:]
        if not frame_count:
            return []
        samples = np.frombuffer(buffered, dtype="<i2", count=whole // _PCM_BYTES_PER_SAMPLE)
        block = (samples.astype(np.float32) / np.float32(_PCM_SCALE)).reshape(frame_count, FRAME_SAMPLES)
        return list(block)


class OpusFrameAssembler:
    """Ogg/Opus pages (24000 Hz mono, as Kyutai's clients send them) -> [1920] float32 frames in [-1, 1].

    Decodes with ``sphn.OpusStreamReader(24000)``, one Ogg page per call (:func:`split_ogg_pages`): sphn
    0.2.1 fails with ``opus_decode_float: invalid argument`` when one call holds more than about 4 s of
    audio (tried: 16 KB of 24 kbit/s Opus decode, 30 KB fail), which made one long but valid message look
    like a broken stream. A page or a frame may span several messages.

    What sphn 0.2.1 does with bad Opus input (tried): ``OpusStreamReader.append_bytes`` raises ``ValueError``
    (``unexpected ogg capture pattern [...]`` for bytes that are not an Ogg page, ``opus_decode_float:
    corrupted stream`` for a broken Opus packet). Fewer bytes than an Ogg page header are buffered silently,
    so garbage may only be reported by a later call. After a failure the reader stays broken (every later
    call raises again) and a fresh reader would wait for Opus headers the client will not resend, so this
    assembler refuses every later push with ``bad_opus`` too: the session must end. Decoded samples of a
    damaged but parseable stream can exceed 1.0: they are clipped to [-1, 1].

    Args:
        max_buffered_frames: most frames (80 ms each) one :meth:`push` may complete (>= 1).
    """

    def __init__(self, max_buffered_frames: int) -> None:
        self.max_buffered_frames = _check_max_buffered_frames(max_buffered_frames)
        self._reader = sphn.OpusStreamReader(SAMPLE_RATE_HZ)
        self._pending = np.zeros(0, dtype=np.float32)
        self._partial_page = b""
        self._failure: str | None = None

    @property
    def pending_samples(self) -> int:
        """Decoded samples not yet returned in a frame (0..1919)."""
        return int(self._pending.size)

    @property
    def failed(self) -> bool:
        """True once the stream was refused as bad Opus: every later push raises ``bad_opus``."""
        return self._failure is not None

    def push(self, payload: bytes) -> list[np.ndarray]:
        """Add the bytes of one audio payload; return the frames they complete, oldest first.

        Returns:
            Zero or more arrays of shape [1920], dtype float32, clipped to [-1, 1].

        Raises:
            ProtocolError: ``bad_opus`` when sphn refuses the bytes (not Ogg, corrupted Opus), and for every
                push after that; ``too_fast`` when the payload decodes to more than ``max_buffered_frames``
                frames (that audio is dropped, the stream stays usable).
        """
        if self._failure is not None:
            raise ProtocolError(
                "bad_opus", f"the Ogg/Opus stream already failed earlier and cannot resume ({self._failure})"
            )
        pages, self._partial_page = split_ogg_pages(self._partial_page + bytes(payload))
        chunks: list[np.ndarray] = []
        for page in pages:
            try:
                chunks.append(np.asarray(self._reader.append_bytes(page), dtype=np.float32).reshape(-1))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # ValueError from sphn; BaseException also covers a Rust panic
                self._failure = str(exc)[:200]
                raise ProtocolError(
                    "bad_opus",
                    f"audio payload is not a valid Ogg/Opus stream (24000 Hz mono Opus in Ogg pages, first "
                    f"pages OpusHead and OpusTags): {self._failure}",
                ) from None
        decoded = np.concatenate(chunks) if len(chunks) > 1 else (chunks[0] if chunks else _NO_SAMPLES)
        if not decoded.size:
            return []
        samples = np.concatenate([self._pending, decoded]) if self._pending.size else decoded
        frame_count = samples.size // FRAME_SAMPLES
        if frame_count > self.max_buffered_frames:
            raise _too_fast(frame_count, self.max_buffered_frames)
        frames, self._pending = _split_frames(samples)
        return [np.clip(np.nan_to_num(frame, nan=0.0), -1.0, 1.0) for frame in frames]


_NO_SAMPLES = np.zeros(0, dtype=np.float32)
_OGG_CAPTURE = b"OggS"
_OGG_HEADER_BYTES = 27
"""Fixed part of an Ogg page header (RFC 3533, 6): capture pattern to segment count."""


def split_ogg_pages(data: bytes) -> tuple[list[bytes], bytes]:
    """Cut ``data`` into whole Ogg pages (RFC 3533, section 6) and the incomplete rest.

    A page is a 27-byte header whose last byte is the segment count n, an n-byte segment table, then the
    sum of the segment table's bytes (at most 65,307 bytes in all). Bytes that do not start with the
    ``OggS`` capture pattern and version 0 are not cut: they come back as one last "page" so that the
    decoder refuses them with its own error.

    Returns:
        (pages, rest): the complete pages in order, and the bytes of a page not complete yet (to prepend
        to the next message's bytes).
    """
    pages: list[bytes] = []
    pos = 0
    size = len(data)
    while pos < size:
        if data[pos : pos + 4] != _OGG_CAPTURE[: min(4, size - pos)]:
            pages.append(data[pos:])  # not Ogg: let the decoder name the problem
            return pages, b""
        if size - pos > 4 and data[pos + 4] != 0:  # stream_structure_version: 0 is the only one
            pages.append(data[pos:])
            return pages, b""
        if size - pos < _OGG_HEADER_BYTES:
            break
        segments = data[pos + _OGG_HEADER_BYTES - 1]
        table_end = pos + _OGG_HEADER_BYTES + segments
        if table_end > size:
            break
        end = table_end + sum(data[pos + _OGG_HEADER_BYTES : table_end])
        if end > size:
            break
        pages.append(data[pos:end])
        pos = end
    return pages, data[pos:]


class PcmFrameEncoder:
    """[1920] float32 frames -> raw PCM payloads (Int16 little-endian, 24000 Hz mono, 3840 bytes each)."""

    def encode(self, frame: np.ndarray) -> bytes:
        """Clip ``frame`` to [-1, 1] (NaN -> 0) and return it as 3840 bytes of Int16 LE.

        Sample x maps to round(x * 32768) capped to [-32768, 32767], the inverse of
        :class:`PcmFrameAssembler`'s k / 32768.

        Raises:
            ValueError: ``frame`` is not shape [1920] of numbers.
        """
        samples = _prepare_frame(frame)
        scaled = np.clip(np.rint(samples * np.float32(_PCM_SCALE)), -32768, 32767)
        return scaled.astype("<i2").tobytes()


class OpusFrameEncoder:
    """[1920] float32 frames -> Ogg/Opus bytes (24000 Hz mono) with ``sphn.OpusStreamWriter(24000)``."""

    def __init__(self) -> None:
        self._writer = sphn.OpusStreamWriter(SAMPLE_RATE_HZ)

    def encode(self, frame: np.ndarray) -> bytes:
        """Clip ``frame`` to [-1, 1] (NaN -> 0), encode it, return the Ogg bytes ready so far.

        The first call's bytes start with the OpusHead/OpusTags pages. The result may be ``b""`` while
        the writer accumulates a page: send nothing then.

        Raises:
            ValueError: ``frame`` is not shape [1920] of numbers.
        """
        return bytes(self._writer.append_pcm(_prepare_frame(frame)))


_BIT_REVERSED = bytes(int(f"{byte:08b}"[::-1], 2) for byte in range(256))
"""Byte i -> byte i with its 8 bits in reverse order (a bytes.translate table)."""


def ogg_crc(data: bytes) -> int:
    """Ogg's page checksum (RFC 3533, section 6): CRC-32, polynomial 0x04C11DB7, initial value 0, no bit
    reflection, no final XOR, over the whole page with its checksum field zeroed. Not zlib's CRC-32.

    Computed with zlib's C code: zlib's CRC-32 is the same polynomial bit-reflected, so the Ogg checksum of
    ``data`` is zlib's, with initial value and final XOR cancelled, of ``data`` with each byte's bits
    reversed, read with its 32 bits reversed.
    """
    reflected = zlib.crc32(data.translate(_BIT_REVERSED), 0xFFFFFFFF) ^ 0xFFFFFFFF
    return int(f"{reflected:032b}"[::-1], 2)


_SPHN_SERIAL = 42
"""Bitstream serial number sphn 0.2.1 writes (read from its pages)."""
_SPHN_OPUS_HEAD = b"OpusHead\x01\x01\x00\x0f\x80\xbb\x00\x00\x00\x00\x00"
"""sphn 0.2.1's OpusHead packet, byte for byte (RFC 7845, 5.1): version 1, 1 channel, pre-skip 3840,
input rate 48000, gain 0, mapping family 0."""
_SPHN_OPUS_TAGS = b"OpusTags\x0b\x00\x00\x00KyutaiMoshi\x00\x00\x00\x00"
"""sphn 0.2.1's OpusTags packet, byte for byte (vendor "KyutaiMoshi", no comments)."""
OPUS_PACKET_MS = 40
"""Opus packet duration of both encoders: sphn encodes 960 samples (40 ms at 24 kHz) per packet and writes
each packet on its own Ogg page, two per 80 ms frame."""
PYAV_OPUS_BITRATE_BPS = 30_000
"""Bitrate given to PyAV's libopus (VBR): chosen so that its stream of speech is as large as sphn's,
which leaves libopus on its automatic bitrate (measured by ``python -m runtime.tools.codec_bench`` on
espeak-ng speech: 31.4 kbit/s against sphn's 31.7, Ogg included). FFmpeg would default to 64 kbit/s."""


def _ogg_page(header_type: int, granule: int, sequence: int, packet: bytes) -> bytes:
    """One Ogg page holding one whole packet (at most 255 * 255 - 1 bytes)."""
    lacing = bytes([255] * (len(packet) // 255) + [len(packet) % 255])
    header = (
        _OGG_CAPTURE
        + bytes([0, header_type])
        + granule.to_bytes(8, "little")
        + _SPHN_SERIAL.to_bytes(4, "little")
        + sequence.to_bytes(4, "little")
    )
    page = header + b"\x00\x00\x00\x00" + bytes([len(lacing)]) + lacing + packet
    return page[:22] + ogg_crc(page).to_bytes(4, "little") + page[26:]


class PyavOpusFrameEncoder:
    """[1920] float32 frames -> Ogg/Opus bytes (24000 Hz mono) with PyAV's libopus (``DUPLEX_OPUS_ENCODER
    =pyav``), at a chosen libopus complexity.

    The stream has sphn 0.2.1's shape: the same OpusHead and OpusTags packets and serial number, one
    40 ms Opus packet per Ogg page (two pages per frame), granule positions in 48 kHz samples, every page
    of a frame returned by the :meth:`encode` call that got the frame (no look-ahead delay). libopus
    settings: VoIP application, :data:`PYAV_OPUS_BITRATE_BPS`, complexity as given (sphn leaves libopus'
    default, 10). PyAV releases the GIL while libopus encodes; sphn does not. What lower complexity costs
    and saves is measured by ``python -m runtime.tools.codec_bench`` (docs/benchmarks.md, "The front end under
    load").

    Args:
        complexity: libopus complexity, 0 (cheapest) .. 10 (libopus' default).
        true_pre_skip: write libopus' own OpusHead (FFmpeg's extradata: pre-skip 312 samples at 48 kHz, its
            real look-ahead; input rate 24000) instead of sphn's (pre-skip 3840: a decoder that honours it,
            FFmpeg, browsers, drops the first 80 ms). The wire keeps sphn's header (what Kyutai's client
            gets from ``moshi.server``); recordings, read by ordinary players, take the true one.

    Raises:
        ValueError: ``complexity`` outside 0..10.
        ImportError: PyAV (``av``) is not installed.
    """

    def __init__(self, complexity: int = 10, *, true_pre_skip: bool = False) -> None:
        if isinstance(complexity, bool) or not isinstance(complexity, int) or not 0 <= complexity <= 10:
            raise ValueError(f"libopus complexity must be an integer 0..10, got {complexity!r}")
        import av

        self._av = av
        context = av.CodecContext.create("libopus", "w")
        context.sample_rate = SAMPLE_RATE_HZ
        context.layout = "mono"
        context.format = "flt"
        context.bit_rate = PYAV_OPUS_BITRATE_BPS
        context.options = {
            "frame_duration": str(OPUS_PACKET_MS),
            "application": "voip",
            "compression_level": str(complexity),
        }
        context.open()
        self._context = context
        self._head = bytes(context.extradata or b"") if true_pre_skip else _SPHN_OPUS_HEAD
        if not self._head.startswith(b"OpusHead"):
            raise ValueError(f"libopus gave no OpusHead as its extradata: {self._head[:19]!r}")
        self.complexity = complexity
        self._frames = 0
        self._granule = 0
        self._sequence = 0

    def _page(self, header_type: int, packet: bytes) -> bytes:
        page = _ogg_page(header_type, self._granule, self._sequence, packet)
        self._sequence += 1
        return page

    def encode(self, frame: np.ndarray) -> bytes:
        """Clip ``frame`` to [-1, 1] (NaN -> 0), encode it, return its two Ogg pages (the first call's
        bytes start with the OpusHead and OpusTags pages).

        Raises:
            ValueError: ``frame`` is not shape [1920] of numbers.
        """
        audio = self._av.AudioFrame.from_ndarray(
            _prepare_frame(frame).reshape(1, -1), format="flt", layout="mono"
        )
        audio.sample_rate = SAMPLE_RATE_HZ
        audio.pts = self._frames * FRAME_SAMPLES
        pages = []
        if self._frames == 0:
            pages += [self._page(2, self._head), self._page(0, _SPHN_OPUS_TAGS)]  # 2: first page
        self._frames += 1
        for packet in self._context.encode(audio):
            self._granule += 2 * SAMPLE_RATE_HZ * OPUS_PACKET_MS // 1000  # granules count 48 kHz samples
            pages.append(self._page(0, bytes(packet)))
        return b"".join(pages)


OPUS_ENCODERS = ("sphn", "pyav")
"""Values of ``DUPLEX_OPUS_ENCODER``: sphn (the default) or PyAV's libopus."""


def make_codec(
    fmt: AudioFormat | str, max_buffered_frames: int, *, opus_encoder: str = "sphn", opus_complexity: int = 10
) -> tuple[FrameAssembler, FrameEncoder]:
    """A fresh (assembler, encoder) pair for one session speaking ``fmt`` ("opus" or "pcm").

    Opus is always decoded by sphn; it is encoded by sphn (``opus_encoder="sphn"``, libopus' default
    complexity 10 only) or by PyAV's libopus at ``opus_complexity`` (``"pyav"``).

    Raises:
        ValueError: unknown ``fmt`` or ``opus_encoder``, ``max_buffered_frames`` < 1, or an
            ``opus_complexity`` outside 0..10 or other than 10 with sphn (which cannot set it).
    """
    audio_format = AudioFormat(fmt)
    if opus_encoder not in OPUS_ENCODERS:
        raise ValueError(f"opus_encoder must be one of {', '.join(OPUS_ENCODERS)}, got {opus_encoder!r}")
    if opus_encoder == "sphn" and opus_complexity != 10:
        raise ValueError(
            f"sphn cannot set libopus complexity (it encodes at 10), got {opus_complexity}: "
            "use the pyav encoder"
        )
    if audio_format is AudioFormat.PCM:
        return PcmFrameAssembler(max_buffered_frames), PcmFrameEncoder()
    encoder: FrameEncoder = (
        PyavOpusFrameEncoder(opus_complexity) if opus_encoder == "pyav" else OpusFrameEncoder()
    )
    return OpusFrameAssembler(max_buffered_frames), encoder
