"""Headless Chromium for a conversation without a person: the espeak-ng speech WAV its fake microphone
plays, the launch flags that feed it and let the page play audio, and where the binary is. Used by the
playout bench (``infra.node.local.playout_bench``) and the browser tests (``tests/browser_fixtures.py``)."""

from __future__ import annotations

import shutil
import wave
from pathlib import Path

import numpy as np

from runtime.tools.loadgen import DEMO_SENTENCES, synthesize_speech

__all__ = ["SPEECH_RATE_HZ", "chromium_args", "chromium_binary", "speech_wav"]

SPEECH_RATE_HZ = 24000
"""The WAV's sample rate (Hz): ``synthesize_speech``'s, the runtime's 24 kHz."""


def chromium_binary() -> str | None:
    """The path of Debian's ``chromium`` (or ``chromium-browser``) on PATH; None when neither is there."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def speech_wav(path: Path) -> Path:
    """Write two sentences of espeak-ng speech (``DEMO_SENTENCES[:2]``) at 24 kHz as a mono 16-bit PCM WAV
    at ``path`` (Chromium's fake capture device reads it and loops it); ``path``. Samples beyond [-1, 1]
    are clipped. Raises OSError when ``path`` cannot be written, and what ``synthesize_speech`` raises
    when espeak-ng is missing."""
    pcm = np.concatenate([synthesize_speech(sentence) for sentence in DEMO_SENTENCES[:2]])
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SPEECH_RATE_HZ)
        out.writeframes((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes())
    return path


def chromium_args(wav: Path) -> list[str]:
    """Chromium's flags for a conversation without a person: the microphone granted without a prompt, fed
    from ``wav`` (looped), and audio allowed to play without a user gesture."""
    return [
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}",
        "--autoplay-policy=no-user-gesture-required",
    ]
