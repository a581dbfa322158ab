"""Telephone audio at a carrier's edge: G.711 (μ-law, A-law) or 16-bit linear PCM at the carrier's rate
(8000 Hz) <-> the model's float32 frames at 24000 Hz.

- G.711 is the ``audioop`` module's (CPython's C implementation of ITU-T G.711, in the standard library up
  to Python 3.12 and as the ``audioop-lts`` package from 3.13, the same module name; pipecat's carrier
  serializers use it too). No hand-written tables.
- Resampling is FFmpeg's libswresample through PyAV (``av.AudioResampler``, already the runtime's for
  Opus), one per direction per call, so each chunk continues the filter state of the one before (no click
  at a chunk's edge). Measured on this repository's development machine (PyAV 14, 20 ms chunks in, 80 ms
  frames out; ``tests/test_carrier_twilio.py``'s sweep): a 300-3400 Hz sweep through both directions comes
  back at 93-96 dB SNR in float (56-60 dB against the line's G.711), delayed 2 ms each way (48 samples at
  24 kHz on the first chunk, then 480 out for every 160 in: the output is as smooth as the input), about
  40 µs per 20 ms packet. libsoxr (``soxr.ResampleStream``) was measured too and not kept: ``LQ`` cuts
  the band above about 2.9 kHz (21 dB SNR there), ``MQ`` and ``HQ`` delay 42-44 ms each way and give their
  output in 60 ms bursts, which the load generator counted as lost frames.

Units: a carrier packet is ``rate * 20 ms`` samples (160 at 8000 Hz: 160 bytes of G.711, 320 of L16). The
model's frame is ``[1920]`` float32 in [-1, 1] (80 ms at 24000 Hz).
"""

from __future__ import annotations

import enum
import warnings

import av
import numpy as np

with warnings.catch_warnings():  # deprecated in 3.11-3.12 only because it leaves the standard library
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

from runtime.engine.model_presets import SAMPLE_RATE_HZ

__all__ = ["PACKET_MS", "CarrierEncoding", "PhoneAudioIn", "PhoneAudioOut", "resample"]

PACKET_MS = 20
"""One carrier packet: 20 ms (Twilio, Telnyx, Plivo and Exotel all send 20 ms chunks)."""
_SCALE = 32768.0
"""Int16 full scale: sample k <-> k / 32768."""


class _Resampler:
    """One direction's streaming resampler: float32 mono at ``rate_in`` -> float32 mono at ``rate_out``
    (libswresample's state carried from one chunk to the next)."""

    def __init__(self, rate_in: int, rate_out: int) -> None:
        self.rate_in = rate_in
        self._resampler = av.AudioResampler(format="flt", layout="mono", rate=rate_out)

    def push(self, samples: np.ndarray) -> np.ndarray:
        if samples.size == 0:
            return np.zeros(0, dtype=np.float32)
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = self.rate_in
        out = [f.to_ndarray().reshape(-1) for f in self._resampler.resample(frame)]
        return np.concatenate(out).astype(np.float32, copy=False) if out else np.zeros(0, dtype=np.float32)


def resample(samples: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """A whole clip ``[T]`` float32 at ``rate_in`` -> ``[T * rate_out / rate_in]`` float32 at ``rate_out``
    (libswresample, as the bridges' streams; the load generator's 8 kHz speech)."""
    return _Resampler(rate_in, rate_out).push(np.ascontiguousarray(samples, dtype=np.float32))


class CarrierEncoding(enum.Enum):
    """A carrier stream's audio encoding.

    Values are the names carriers use: ``audio/x-mulaw`` (Twilio's ``mediaFormat.encoding``), ``PCMU``,
    ``PCMA`` (Telnyx's RTP names), ``L16`` (16-bit linear PCM; little-endian here, as Telnyx and Exotel
    send it over WebSocket).
    """

    MULAW = "audio/x-mulaw"
    PCMU = "PCMU"
    PCMA = "PCMA"
    L16 = "L16"

    @classmethod
    def parse(cls, name: str) -> CarrierEncoding:
        """The encoding a carrier names (case-insensitive).

        Raises:
            ValueError: an encoding this bridge does not carry, naming the ones it does.
        """
        for encoding in cls:
            if encoding.value.lower() == name.strip().lower():
                return encoding
        allowed = ", ".join(e.value for e in cls)
        raise ValueError(f"unsupported carrier audio encoding {name!r}; one of {allowed}")

    @property
    def bytes_per_sample(self) -> int:
        """1 for G.711, 2 for L16."""
        return 2 if self is CarrierEncoding.L16 else 1


def _to_linear(payload: bytes, encoding: CarrierEncoding) -> bytes:
    """Carrier bytes -> Int16 little-endian bytes."""
    if encoding is CarrierEncoding.L16:
        return payload[: len(payload) - len(payload) % 2]
    if encoding is CarrierEncoding.PCMA:
        return audioop.alaw2lin(payload, 2)
    return audioop.ulaw2lin(payload, 2)


def _from_linear(pcm: bytes, encoding: CarrierEncoding) -> bytes:
    """Int16 little-endian bytes -> carrier bytes."""
    if encoding is CarrierEncoding.L16:
        return pcm
    if encoding is CarrierEncoding.PCMA:
        return audioop.lin2alaw(pcm, 2)
    return audioop.lin2ulaw(pcm, 2)


def _carrier_rate(rate_hz: int) -> int:
    """``rate_hz`` when a carrier may send it (8000..48000 Hz).

    Raises:
        ValueError: another rate, naming the range.
    """
    if not 8000 <= rate_hz <= 48000:
        raise ValueError(f"carrier sample rate must be 8000..48000 Hz, got {rate_hz}")
    return rate_hz


class PhoneAudioIn:
    """The caller's side: carrier payloads -> float32 samples at 24000 Hz (any count per push; the
    conversation assembles frames).

    Args:
        encoding: the stream's encoding.
        rate_hz: the carrier's sample rate (8000; 16000 where a carrier offers L16 wideband).
    Raises:
        ValueError: a rate outside 8000..48000 Hz.
    """

    def __init__(self, encoding: CarrierEncoding, rate_hz: int = 8000) -> None:
        self.encoding = encoding
        self.rate_hz = _carrier_rate(rate_hz)
        self._resampler = _Resampler(rate_hz, SAMPLE_RATE_HZ)
        self.level_dbfs = -120.0
        """The RMS level of the last payload decoded, in dB relative to full scale (-120: silence)."""

    def decode(self, payload: bytes) -> np.ndarray:
        """One carrier payload -> ``[T]`` float32 at 24000 Hz in [-1, 1) (``T`` varies with the resampler's
        blocks: about 3x the payload's samples on average, 0 for some pushes); sets :attr:`level_dbfs`."""
        linear = np.frombuffer(_to_linear(payload, self.encoding), dtype="<i2")
        samples = linear.astype(np.float32) / np.float32(_SCALE)
        power = float(np.mean(np.square(samples, dtype=np.float64))) if samples.size else 0.0
        self.level_dbfs = 10 * float(np.log10(power)) if power > 0 else -120.0
        return self._resampler.push(samples)


class PhoneAudioOut:
    """The agent's side: float32 frames at 24000 Hz -> carrier packets of :data:`PACKET_MS` each.

    Args:
        encoding: the stream's encoding.
        rate_hz: the carrier's sample rate.
    Raises:
        ValueError: a rate outside 8000..48000 Hz.
    """

    def __init__(self, encoding: CarrierEncoding, rate_hz: int = 8000) -> None:
        self.encoding = encoding
        self.rate_hz = _carrier_rate(rate_hz)
        self.packet_bytes = rate_hz * PACKET_MS // 1000 * encoding.bytes_per_sample
        """Bytes of one 20 ms packet (160 for G.711 at 8000 Hz)."""
        self._resampler = _Resampler(SAMPLE_RATE_HZ, rate_hz)
        self._pending = b""

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        """``[T]`` float32 at 24000 Hz (one ``[1920]`` frame, or the hold tone's samples) -> the whole 20 ms
        carrier packets they complete (the rest waits for the next call). Values are clipped to [-1, 1];
        NaN becomes 0.

        Raises:
            ValueError: ``pcm`` is not one-dimensional.
        """
        samples = np.asarray(pcm, dtype=np.float32)
        if samples.ndim != 1:
            raise ValueError(f"expected mono samples [T], got shape {samples.shape}")
        samples = np.clip(np.nan_to_num(samples, nan=0.0), -1.0, 1.0)
        resampled = self._resampler.push(np.ascontiguousarray(samples))
        linear = np.clip(np.rint(resampled * _SCALE), -32768, 32767).astype("<i2").tobytes()
        data = self._pending + _from_linear(linear, self.encoding)
        whole = len(data) // self.packet_bytes * self.packet_bytes
        self._pending = data[whole:]
        return [data[start : start + self.packet_bytes] for start in range(0, whole, self.packet_bytes)]

    def discard(self) -> None:
        """Forget the part packet not sent yet (a barge-in: the carrier's queue is cleared)."""
        self._pending = b""
