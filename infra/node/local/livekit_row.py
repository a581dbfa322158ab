"""The LiveKit row of ``duplex node up``: LiveKit's PersonaPlex plugin, released and unmodified, drives
sessions through the node's nginx over ``wss://`` with access control on (issue 32, "Done when").

The plugin lives in its own virtualenv (``make livekit-deps``: ``.venv-livekit`` from
``requirements-livekit.lock``; ``make demo`` builds it first), so :func:`run_livekit_load` runs
``runtime/tools/livekit_agent.py``'s ``load`` scenario with that virtualenv's Python as a subprocess: one
plugin ``RealtimeSession`` per session, ``push_audio`` of 20 ms ``rtc.AudioFrame``s of speech, a fresh
single-use session token per connection in ``Authorization: Bearer`` (an aiohttp middleware on the
plugin's ``http_session``, as tests/livekit_driver.py passes them). Whatever goes wrong with the
subprocess (no virtualenv, the plugin's import or run failing, no JSON back, past its time) is a failed
row naming it (:attr:`LiveKitReport.failure`), never an exception: the node check then fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "LIVEKIT_VOICE",
    "VOICES_DIR",
    "write_livekit_voice",
    "LiveKitReport",
    "LiveKitSession",
    "default_livekit_python",
    "run_livekit_load",
]

LIVEKIT_VOICE = "NATF2"
"""The voice the plugin asks for (its default, ``realtime_model.py``: ``voice_prompt=NATF2.pt``); the local
node holds a voice of that name (``infra.node.local.node``, espeak-ng speech: the tiny model has no NVIDIA
presets)."""

VOICES_DIR = "voices"
"""The local node's voices (``DUPLEX_VOICES_DIR``), relative to its directory."""

VOICE_SENTENCE = "Hello, I am the voice of this persona."
"""What the local node's ``NATF2`` voice says (espeak-ng)."""


def write_livekit_voice(voices: Path) -> Path | None:
    """Write ``<voices>/NATF2.wav`` (:data:`LIVEKIT_VOICE`: espeak-ng speech, its own WAV) so that the
    plugin's ``voice_prompt=NATF2.pt`` resolves on the local node (the runtime takes NVIDIA's ``NAME.pt`` as
    ``NAME``: runtime.engine.voices ``VoiceCatalog.get``). Returns the file, or None when espeak-ng is not
    installed (the LiveKit row then reports the node's refusal of the voice)."""
    voices.mkdir(parents=True, exist_ok=True)
    path = voices / f"{LIVEKIT_VOICE}.wav"
    try:
        subprocess.run(["espeak-ng", "-w", str(path), VOICE_SENTENCE], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return path


LIVEKIT_TEXT_PROMPT = "You are a helpful assistant at a restaurant; take the caller's booking."
"""The persona's text prompt the plugin sends (``text_prompt=``)."""

LIVEKIT_SPEECH_S = 6.0
"""Speech each plugin session pushes, in real time (s)."""

AGENT_TIMEOUT_S = 180.0
"""How long the agent subprocess may run (s): the plugin's import (about 5 s on a loaded 2-core machine),
the speech, the audio of its last second back (at most 20 s, ``livekit_agent.HEAR_TIMEOUT_S``)."""

SAMPLE_RATE = 24000
"""Hz: the plugin's (livekit-plugins-nvidia realtime_model.py SAMPLE_RATE) and the node's."""


def default_livekit_python() -> Path:
    """``DUPLEX_LIVEKIT_PYTHON`` when set, else ``.venv-livekit/bin/python`` at the repository's root (where
    ``make livekit-deps`` builds it)."""
    given = os.environ.get("DUPLEX_LIVEKIT_PYTHON")
    if given:
        return Path(given)
    return _repository_root() / ".venv-livekit" / "bin" / "python"


def _agent_script() -> Path:
    """``runtime/tools/livekit_agent.py``, found without importing it (livekit is not in this environment)."""
    spec = importlib.util.find_spec("runtime.tools.livekit_agent")
    if spec is None or spec.origin is None:  # pragma: no cover - the module ships with the package
        raise FileNotFoundError("runtime.tools.livekit_agent is not installed")
    return Path(spec.origin)


def _repository_root() -> Path:
    return _agent_script().parents[2]


@dataclass
class LiveKitSession:
    """What one plugin session saw: 24 kHz samples of audio the plugin delivered, first audio (ms, first
    ``push_audio`` -> first audio frame), and the plugin's ``error`` events (``{"type", "message",
    "recoverable"}``)."""

    samples: int = 0
    first_audio_ms: float | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)

    @property
    def served(self) -> bool:
        """Audio came back and the plugin reported no error."""
        return self.samples > 0 and not self.errors


@dataclass
class LiveKitReport:
    """The LiveKit run: ``planned`` sessions, what each saw, the run's wall time (s), and ``failure``: why
    the agent subprocess gave no result (None when it did)."""

    planned: int
    sessions: list[LiveKitSession] = field(default_factory=list)
    wall_s: float = 0.0
    failure: str | None = None

    @property
    def served(self) -> list[LiveKitSession]:
        return [s for s in self.sessions if s.served]

    def summary(self) -> dict[str, float | int | None]:
        """Totals: sessions (planned), served, failed (planned minus served), first audio p50/p99 (ms, the
        served sessions'), audio received (s, all sessions), frames lost (None: the plugin delivers audio
        without the node's sequence, so a loss cannot be counted on this side)."""
        first = [s.first_audio_ms for s in self.served if s.first_audio_ms is not None]
        return {
            "sessions": self.planned,
            "served": len(self.served),
            "failed": self.planned - len(self.served),
            "first_audio_ms_p50": float(np.percentile(first, 50)) if first else None,
            "first_audio_ms_p99": float(np.percentile(first, 99)) if first else None,
            "audio_s": round(sum(s.samples for s in self.sessions) / SAMPLE_RATE, 2),
            "frames_lost": None,
        }

    def problems(self) -> list[str]:
        """What the node check counts as failed: the subprocess' failure, or each session with an error
        from the plugin or no audio back."""
        if self.failure is not None:
            return [f"LiveKit plugin: {self.failure}"]
        problems: list[str] = []
        for i, session in enumerate(self.sessions):
            if session.errors:  # the plugin's first error says what went wrong
                error = session.errors[0]
                problems.append(f"LiveKit session {i}: {error['type']}: {error['message']}")
            elif not session.samples:
                problems.append(f"LiveKit session {i} got no audio")
        missing = self.planned - len(self.sessions)
        if missing > 0:
            problems.append(f"LiveKit plugin reported {len(self.sessions)} sessions of {self.planned}")
        return problems


Runner = Callable[..., subprocess.CompletedProcess[str]]
"""``subprocess.run``'s shape (tests pass their own)."""


def _last_line(text: str, limit: int | None = 300) -> str:
    """The last non-blank line of ``text`` (its first ``limit`` characters), or ``no output``."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:limit] if lines else "no output"


def run_livekit_load(
    wss_url: str,
    speech: Sequence[np.ndarray],
    *,
    sessions: int,
    token: Callable[[], str],
    cafile: str | None = None,
    python: Path | None = None,
    seconds: float = LIVEKIT_SPEECH_S,
    timeout_s: float = AGENT_TIMEOUT_S,
    run: Runner = subprocess.run,
) -> LiveKitReport:
    """Run ``sessions`` concurrent plugin sessions against ``wss_url`` (the node's base, ``wss://host:port``)
    in the LiveKit virtualenv's ``python`` (default :func:`default_livekit_python`).

    Args:
        speech: float32 clips ``[samples]`` at 24 kHz, joined and looped by each session.
        token: mints one fresh single-use session token per call (one per session).
        cafile: the node's certificate (PEM) for ``wss://`` with a private CA.
        seconds: speech each session pushes (s), > 0.
        timeout_s: the subprocess' time limit (s).

    Returns the report; a failure (no virtualenv, the agent exiting non-zero, no JSON, past ``timeout_s``)
    is :attr:`LiveKitReport.failure`, naming it.

    Raises:
        ValueError: ``sessions`` < 1, ``seconds`` <= 0 or no speech.
    """
    if sessions < 1:
        raise ValueError(f"sessions must be >= 1, got {sessions}")
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if not speech:
        raise ValueError("no speech: pass at least one clip")
    python = python or default_livekit_python()
    report = LiveKitReport(planned=sessions)
    if not python.exists():
        report.failure = f"the LiveKit virtualenv's {python} is missing: run `make livekit-deps`"
        return report
    with tempfile.TemporaryDirectory(prefix="duplex-livekit-") as tmp:
        speech_path = Path(tmp) / "speech.npy"
        np.save(speech_path, np.concatenate([np.asarray(s, dtype=np.float32) for s in speech]))
        plan = {
            "scenario": "load",
            "url": wss_url,
            "cafile": cafile,
            "tokens": [token() for _ in range(sessions)],
            "voice": LIVEKIT_VOICE,
            "text_prompts": [LIVEKIT_TEXT_PROMPT],
            "speech": str(speech_path),
            "seconds": seconds,
            "sessions": sessions,
        }
        plan_path = Path(tmp) / "plan.json"
        plan_path.write_text(json.dumps(plan))
        try:
            done = run(
                [str(python), str(_agent_script()), str(plan_path)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            report.failure = f"the LiveKit agent ran past {timeout_s:g} s"
            return report
        except OSError as exc:
            report.failure = f"the LiveKit agent did not start: {exc}"
            return report
    if done.returncode != 0:
        report.failure = f"the LiveKit agent exited with code {done.returncode}: {_last_line(done.stderr)}"
        return report
    try:
        result = json.loads(_last_line(done.stdout, None))
        report.sessions = [
            LiveKitSession(
                samples=int(s["samples"]), first_audio_ms=s.get("first_audio_ms"), errors=list(s["errors"])
            )
            for s in result["sessions"]
        ]
        report.wall_s = float(result["wall_s"])
    except (ValueError, KeyError, TypeError) as exc:
        report.failure = f"the LiveKit agent's report is unreadable ({exc}): {_last_line(done.stdout)}"
    return report
