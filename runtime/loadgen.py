"""A load generator and reference client: real speech streamed at real-time pace over the wire protocol.

Used by the demo (``duplex demo``), by ``duplex loadgen`` against any node, and by the end-to-end tests.
Speech is synthesised with espeak-ng (Debian package ``espeak-ng``) and resampled to 24 kHz.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from runtime.audio_codec import make_codec
from runtime.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.protocol import AudioFormat, MessageKind, encode_audio

DEMO_SENTENCES = (
    "Hello, can you hear me? I would like to book a table for two tonight.",
    "What is the weather going to be like tomorrow morning in Paris?",
    "Please tell me a short story about a robot who learns to sing.",
    "I am calling about my order. It was supposed to arrive yesterday.",
    "How many planets are there in the solar system, and which is the largest?",
)


class SpeechSynthesisError(RuntimeError):
    """espeak-ng is missing or failed."""


def synthesize_speech(text: str, *, voice: str = "en-us", words_per_minute: int = 160) -> np.ndarray:
    """Speak ``text`` with espeak-ng; returns mono float32 PCM at 24 kHz, ``[T]``.

    Raises:
        SpeechSynthesisError: espeak-ng is not installed (``apt-get install espeak-ng``) or failed.
    """
    import sphn

    if shutil.which("espeak-ng") is None:
        raise SpeechSynthesisError("espeak-ng is not installed: apt-get install espeak-ng")
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        result = subprocess.run(
            ["espeak-ng", "-v", voice, "-s", str(words_per_minute), "-w", str(wav), text],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0 or not wav.exists():
            raise SpeechSynthesisError(f"espeak-ng failed ({result.returncode}): {result.stderr.strip()}")
        pcm, rate = sphn.read(str(wav))
    mono = np.asarray(pcm, dtype=np.float32).mean(axis=0)
    if rate != SAMPLE_RATE_HZ:
        mono = sphn.resample(mono, src_sample_rate=rate, dst_sample_rate=SAMPLE_RATE_HZ)
    return np.ascontiguousarray(mono, dtype=np.float32)


@dataclass
class SessionResult:
    """What one client session saw.

    Attributes:
        handshake: the server sent 0x00.
        frames_sent: 80 ms frames streamed.
        audio_messages: 0x01 messages received; ``audio_samples`` the PCM samples they decoded to
            (PCM format only; Opus counts pages).
        text: concatenated 0x02 pieces.
        errors: 0x05 reasons received.
        first_audio_ms: from the first frame sent to the first audio message received.
        close_code: the WebSocket close code (None if the client closed first and got none).
        audio_gaps: longest stretch, in frames, between two audio messages after the first one.
    """

    handshake: bool = False
    frames_sent: int = 0
    audio_messages: int = 0
    audio_samples: int = 0
    text: str = ""
    errors: list[str] = field(default_factory=list)
    first_audio_ms: float | None = None
    close_code: int | None = None
    close_reason: str = ""
    audio_arrival_s: list[float] = field(default_factory=list)

    def max_audio_gap_s(self) -> float:
        """Longest silence between two consecutive audio messages (s); 0 with fewer than 2."""
        arrivals = self.audio_arrival_s
        return max((b - a for a, b in zip(arrivals, arrivals[1:], strict=False)), default=0.0)


def session_url(base: str, *, audio_format: AudioFormat = AudioFormat.PCM, **params: object) -> str:
    """``ws://host:port`` + ``/api/chat?format=...&<params>`` (None values left out)."""
    query = {"format": audio_format.value, **{k: v for k, v in params.items() if v is not None}}
    return f"{base.rstrip('/')}/api/chat?{urlencode(query)}"


async def run_session(
    url: str,
    pcm: np.ndarray,
    *,
    realtime: bool = True,
    tail_s: float = 0.6,
    handshake_timeout_s: float = 30.0,
    audio_format: AudioFormat = AudioFormat.PCM,
    raw_messages: list[bytes] | None = None,
) -> SessionResult:
    """Stream ``pcm`` (float32, 24 kHz) to ``url`` frame by frame and collect what comes back.

    Args:
        realtime: pace frames at 80 ms (else send as fast as possible).
        tail_s: keep listening this long after the last frame before closing.
        raw_messages: extra raw messages to send right after the handshake (for bad-input tests).
    """
    result = SessionResult()
    assembler, encoder = make_codec(audio_format, max_buffered_frames=1000)
    frames = [pcm[i : i + FRAME_SAMPLES] for i in range(0, len(pcm) - FRAME_SAMPLES + 1, FRAME_SAMPLES)]
    started: float | None = None
    done = asyncio.Event()

    async with connect(url, max_size=2**20, compression=None, open_timeout=30) as ws:

        async def receive() -> None:
            nonlocal started
            try:
                async for message in ws:
                    if isinstance(message, str) or not message:
                        continue
                    kind, payload = message[0], message[1:]
                    now = time.monotonic()
                    if kind == MessageKind.HANDSHAKE:
                        result.handshake = True
                        done.set()
                    elif kind == MessageKind.AUDIO:
                        result.audio_messages += 1
                        result.audio_arrival_s.append(now)
                        if audio_format is AudioFormat.PCM:
                            result.audio_samples += len(payload) // 2
                        if result.first_audio_ms is None and started is not None:
                            result.first_audio_ms = (now - started) * 1e3
                    elif kind == MessageKind.TEXT:
                        result.text += payload.decode("utf-8", errors="replace")
                    elif kind == MessageKind.ERROR:
                        result.errors.append(payload.decode("utf-8", errors="replace"))
            except ConnectionClosed:
                pass
            finally:
                done.set()

        receiver = asyncio.create_task(receive())
        try:
            await asyncio.wait_for(done.wait(), handshake_timeout_s)
            if result.handshake:
                for raw in raw_messages or []:
                    await ws.send(raw)
                next_send = time.monotonic()
                for frame in frames:
                    if started is None:
                        started = time.monotonic()
                    await ws.send(encode_audio(encoder.encode(frame)))
                    result.frames_sent += 1
                    if realtime:
                        next_send += FRAME_SAMPLES / SAMPLE_RATE_HZ
                        await asyncio.sleep(max(0.0, next_send - time.monotonic()))
                await asyncio.sleep(tail_s)
                await ws.close()
            await asyncio.wait_for(receiver, 10)
        except ConnectionClosed:
            pass
        finally:
            receiver.cancel()
        result.close_code = ws.close_code
        result.close_reason = ws.close_reason or ""
    del assembler
    return result
