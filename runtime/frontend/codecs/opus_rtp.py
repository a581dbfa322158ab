"""Raw Opus packets for WebRTC (RTP carries bare Opus packets, RFC 7587; no Ogg): libopus itself through
ctypes, mono, 24 kHz on our side.

Why libopus and not PyAV here: the receive side must conceal a lost packet, and libopus does that when
``opus_decode`` is called with no data (its packet-loss concealment, RFC 6716 section 4.4); FFmpeg, and so
PyAV, reads an empty packet as the end of the stream. The library is the one PyAV's wheel bundles
(``av.libs/libopus-*.so*``), so nothing more is installed; a system ``libopus.so.0`` is used when PyAV's
wheel has none (a distribution build of PyAV). ctypes calls release the GIL while libopus runs.

- :class:`OpusDecoder`: one RTP payload -> int16 samples at 24 kHz (libopus decodes any Opus packet at any
  of its rates: no resampler); ``None`` -> one packet's worth of concealment.
- :class:`OpusEncoder`: ``[1920]`` float32 frames (80 ms at 24 kHz) -> four 20 ms packets, VoIP mode,
  :data:`BITRATE_BPS`, mono: what the RTP sender sends as is (no stereo 96 kbps re-encode in aiortc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os

import numpy as np

from runtime.engine.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ

__all__ = [
    "BITRATE_BPS",
    "PACKET_SAMPLES",
    "OpusDecoder",
    "OpusEncoder",
    "OpusError",
    "libopus",
]

PACKET_SAMPLES = SAMPLE_RATE_HZ * 20 // 1000
"""One 20 ms packet at 24 kHz: 480 samples (four per 80 ms frame)."""
BITRATE_BPS = 32_000
"""Outbound Opus bitrate: 32 kbps, the top of the 24-32 kbps issue 22 asks for (speech, mono, fullband)."""
_MAX_PACKET_SAMPLES = SAMPLE_RATE_HZ * 120 // 1000  # the longest Opus packet: 120 ms
_MAX_PACKET_BYTES = 1500
_APPLICATION_VOIP = 2048
_SET_BITRATE = 4002
_SET_COMPLEXITY = 4010
_SET_INBAND_FEC = 4012
_SET_PACKET_LOSS_PERC = 4014


class OpusError(ValueError):
    """libopus refused: a corrupt packet, a bad setting (the message carries libopus' own words)."""


def _find_library() -> str:
    import av

    bundled = sorted(glob.glob(os.path.join(os.path.dirname(av.__file__) + ".libs", "libopus*.so*")))
    if bundled:
        return bundled[0]
    system = ctypes.util.find_library("opus")
    if system is None:
        raise OSError("libopus not found: neither PyAV's wheel (av.libs) nor the system (libopus0) has it")
    return system


@functools.cache
def libopus() -> ctypes.CDLL:
    """libopus, loaded once, its functions typed.

    Raises:
        OSError: no libopus found.
    """
    lib = ctypes.CDLL(_find_library())
    lib.opus_decoder_create.restype = ctypes.c_void_p
    lib.opus_decoder_create.argtypes = [ctypes.c_int32, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.opus_decode.restype = ctypes.c_int
    lib.opus_decode.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_int32,
        ctypes.POINTER(ctypes.c_int16),
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.opus_decoder_destroy.argtypes = [ctypes.c_void_p]
    lib.opus_encoder_create.restype = ctypes.c_void_p
    lib.opus_encoder_create.argtypes = [
        ctypes.c_int32,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_int),
    ]
    lib.opus_encode_float.restype = ctypes.c_int32
    lib.opus_encode_float.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_float),
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int32,
    ]
    lib.opus_encoder_destroy.argtypes = [ctypes.c_void_p]
    lib.opus_strerror.restype = ctypes.c_char_p
    lib.opus_strerror.argtypes = [ctypes.c_int]
    return lib


def _error(what: str, code: int) -> OpusError:
    return OpusError(f"{what}: {libopus().opus_strerror(code).decode()} (libopus error {code})")


class OpusDecoder:
    """One inbound stream's decoder: Opus packets -> int16 mono samples at 24 kHz.

    Raises:
        OSError: no libopus.
    """

    _handle: int | None = None

    def __init__(self) -> None:
        lib = libopus()
        error = ctypes.c_int(0)
        handle = lib.opus_decoder_create(SAMPLE_RATE_HZ, 1, ctypes.byref(error))
        if not handle or error.value != 0:
            raise _error("opus_decoder_create", error.value)
        self._lib = lib
        self._handle = handle
        self._pcm = (ctypes.c_int16 * _MAX_PACKET_SAMPLES)()

    def decode(self, payload: bytes | None, conceal_samples: int = PACKET_SAMPLES) -> np.ndarray:
        """``payload`` (one Opus packet) as int16 samples (480 for a 20 ms packet); None: ``conceal_samples``
        samples of libopus' loss concealment (a multiple of 2.5 ms: 60 samples at 24 kHz).

        Raises:
            OpusError: a corrupt packet (the decoder stays usable), or a bad ``conceal_samples``.
        """
        assert self._handle is not None, "decoder closed"
        if payload is None:
            count = self._lib.opus_decode(self._handle, None, 0, self._pcm, conceal_samples, 0)
        else:
            count = self._lib.opus_decode(
                self._handle, payload, len(payload), self._pcm, _MAX_PACKET_SAMPLES, 0
            )
        if count < 0:
            raise _error("opus_decode", count)
        return np.ctypeslib.as_array(self._pcm)[:count].copy()

    def close(self) -> None:
        """Free the decoder (idempotent)."""
        if self._handle is not None:
            self._lib.opus_decoder_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()


class OpusEncoder:
    """One outbound stream's encoder: ``[1920]`` float32 frames at 24 kHz -> 20 ms mono Opus packets.

    Args:
        complexity: libopus complexity 0..10 (``DUPLEX_OPUS_COMPLEXITY``; cost measured in
            docs/benchmarks.md).
        bitrate_bps: target bitrate (bits/s).

    Raises:
        ValueError: ``complexity`` outside 0..10.
        OSError: no libopus.
    """

    _handle: int | None = None

    def __init__(self, complexity: int = 10, bitrate_bps: int = BITRATE_BPS) -> None:
        if not 0 <= complexity <= 10:
            raise ValueError(f"libopus complexity must be an integer 0..10, got {complexity!r}")
        lib = libopus()
        error = ctypes.c_int(0)
        handle = lib.opus_encoder_create(SAMPLE_RATE_HZ, 1, _APPLICATION_VOIP, ctypes.byref(error))
        if not handle or error.value != 0:
            raise _error("opus_encoder_create", error.value)
        self._lib = lib
        self._handle = handle
        for request, value in (
            (_SET_BITRATE, bitrate_bps),
            (_SET_COMPLEXITY, complexity),
            (_SET_INBAND_FEC, 1),
            (_SET_PACKET_LOSS_PERC, 5),
        ):
            code = lib.opus_encoder_ctl(ctypes.c_void_p(handle), ctypes.c_int(request), ctypes.c_int(value))
            if code != 0:
                raise _error(f"opus_encoder_ctl({request}, {value})", code)
        self._out = ctypes.create_string_buffer(_MAX_PACKET_BYTES)

    def encode(self, frame: np.ndarray) -> list[bytes]:
        """One ``[1920]`` frame -> four 20 ms packets (clipped to [-1, 1], NaN -> 0).

        Raises:
            ValueError: ``frame`` is not 1920 samples.
        """
        flat = np.asarray(frame, dtype=np.float32).reshape(-1)
        if flat.size != FRAME_SAMPLES:
            raise ValueError(f"expected one frame of {FRAME_SAMPLES} samples, got {flat.size}")
        return [
            self.encode_packet(flat[s : s + PACKET_SAMPLES]) for s in range(0, FRAME_SAMPLES, PACKET_SAMPLES)
        ]

    def encode_packet(self, pcm: np.ndarray) -> bytes:
        """One ``[480]`` float32 slice (20 ms at 24 kHz) -> one Opus packet (clipped to [-1, 1], NaN -> 0).

        Raises:
            ValueError: ``pcm`` is not 480 samples.
            OpusError: libopus refused it.
        """
        assert self._handle is not None, "encoder closed"
        flat = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if flat.size != PACKET_SAMPLES:
            raise ValueError(f"expected one packet of {PACKET_SAMPLES} samples, got {flat.size}")
        samples = np.ascontiguousarray(np.clip(np.nan_to_num(flat), -1.0, 1.0), dtype=np.float32)
        pointer = samples.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        size = self._lib.opus_encode_float(
            self._handle, pointer, PACKET_SAMPLES, self._out, _MAX_PACKET_BYTES
        )
        if size < 0:
            raise _error("opus_encode_float", size)
        return self._out.raw[:size]

    def close(self) -> None:
        """Free the encoder (idempotent)."""
        if self._handle is not None:
            self._lib.opus_encoder_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()
