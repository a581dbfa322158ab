"""Personas: a voice prompt and a text role prompt, fed into a slot before its conversation starts.

The sequence follows PersonaPlex's conditioning (NVIDIA/personaplex, model card and ``offline.py``): the
voice prompt's codes are teacher-forced as the agent's audio while the user stream carries a 440 Hz sine,
then silence, then the text prompt wrapped in ``<system>`` tags, one LM step per text token, then silence.
The engine runs these steps in the spare time of each tick (:class:`runtime.engine.batch.BatchEngine`), so the
other slots' audio never waits for a prompt; the handshake is sent when the prompt is done.

Voices are loaded once at start-up from a directory (``<name>.wav`` audio, any rate, resampled to 24 kHz
and mixed to mono; or ``<name>.pt`` holding Mimi codes ``[K, T]``), encoded before the engine starts
streaming. Clients name a voice; they never upload audio.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece
import torch

from runtime.engine.batch import NOT_FORCED, PromptStep
from runtime.engine.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.engine.persona_limits import TEXT_PROMPT_LIMIT, TEXT_PROMPT_MAX_TOKENS, VOICE_PROMPT_RE

log = logging.getLogger(__name__)

TEXT_PADDING_ID = 3
SILENCE_FRAMES = 6
"""Silence after the voice prompt and after the text prompt: 6 frames = 480 ms."""
MAX_VOICE_PROMPT_FRAMES = 375
"""30 s at 12.5 Hz: longer voice prompts are cut."""
MAX_TEXT_PROMPT_TOKENS = TEXT_PROMPT_MAX_TOKENS
"""The limit stated once in ``runtime.frontend.protocol`` (``TEXT_PROMPT_LIMIT``): tokens, wrapper
included."""


class PersonaError(ValueError):
    """A persona the node cannot serve (unknown voice, prompt too long); the message says what is allowed."""


@dataclass(frozen=True)
class Persona:
    """What a session asked for: a voice preset name and/or a text prompt (both optional)."""

    voice_prompt: str | None = None
    text_prompt: str | None = None

    @property
    def label(self) -> str:
        """Short description for the session registry."""
        parts = []
        if self.voice_prompt:
            parts.append(f"voice={self.voice_prompt}")
        if self.text_prompt:
            parts.append(f"text={self.text_prompt[:60]}")
        return " ".join(parts)


class VoiceCatalog:
    """Voice prompts by name, as Mimi codes ``[K, T]`` (int64, K = Mimi codebooks, T frames)."""

    def __init__(self, voices: dict[str, torch.Tensor] | None = None) -> None:
        self._voices = dict(voices or {})

    @property
    def names(self) -> list[str]:
        return sorted(self._voices)

    def codes(self, name: str) -> torch.Tensor:
        """The codes of voice ``name``.

        Raises:
            PersonaError: unknown voice; the message lists the known ones.
        """
        try:
            return self._voices[name]
        except KeyError:
            known = ", ".join(self.names) or "none on this node"
            raise PersonaError(f"unknown voice_prompt {name!r}; voices on this node: {known}") from None

    @classmethod
    @torch.no_grad()
    def load(cls, directory: Path | None, mimi) -> VoiceCatalog:
        """Load every ``*.wav`` and ``*.pt`` in ``directory`` and encode the audio with ``mimi``.

        Must run before ``mimi`` enters streaming mode.

        Raises:
            PersonaError: a file whose name or content is not a usable voice (names the file).
        """
        voices: dict[str, torch.Tensor] = {}
        if directory is None:
            return cls(voices)
        import sphn

        for path in sorted(Path(directory).iterdir()):
            if path.suffix not in (".wav", ".pt"):
                continue
            name = path.stem
            if not VOICE_PROMPT_RE.fullmatch(name):  # the names clients may ask for
                raise PersonaError(f"voice file {path.name}: name must match {VOICE_PROMPT_RE.pattern}")
            if path.suffix == ".pt":
                loaded = torch.load(path, map_location="cpu", weights_only=True)
                codes = loaded["codes"] if isinstance(loaded, dict) else loaded
                if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
                    raise PersonaError(f"voice file {path.name}: expected a [K, T] tensor of Mimi codes")
            else:
                pcm, rate = sphn.read(str(path))
                mono = np.asarray(pcm, dtype=np.float32).mean(axis=0)
                if rate != SAMPLE_RATE_HZ:
                    mono = sphn.resample(mono, src_sample_rate=rate, dst_sample_rate=SAMPLE_RATE_HZ)
                frames = max(1, len(mono) // FRAME_SAMPLES)
                mono = np.resize(mono, frames * FRAME_SAMPLES).astype(np.float32)
                device = next(mimi.parameters()).device
                codes = mimi.encode(torch.from_numpy(mono)[None, None].to(device))[0].cpu()
            voices[name] = codes[:, :MAX_VOICE_PROMPT_FRAMES].long()
            log.info("voice %s: %d frames", name, voices[name].shape[1])
        return cls(voices)


def build_prompt(
    persona: Persona,
    voices: VoiceCatalog,
    tokenizer: sentencepiece.SentencePieceProcessor,
    *,
    silence_codes: torch.Tensor,
    sine_codes: torch.Tensor,
) -> list[PromptStep]:
    """The teacher-forced steps of ``persona``; empty when it names neither voice nor text.

    Args:
        silence_codes, sine_codes: ``[K, F]`` Mimi codes of silence and of the 440 Hz user-stream tone;
            frames are cycled.
    Raises:
        PersonaError: unknown voice, or a text prompt over ``TEXT_PROMPT_MAX_TOKENS`` tokens with its
            ``<system>`` wrapper (the message states ``runtime.engine.persona_limits.TEXT_PROMPT_LIMIT``).
    """
    steps: list[PromptStep] = []
    cycle = sine_codes.shape[1]

    def user(i: int) -> torch.Tensor:
        return sine_codes[:, i % cycle]

    def silence(i: int) -> torch.Tensor:
        return silence_codes[:, i % silence_codes.shape[1]]

    if persona.voice_prompt:
        voice = voices.codes(persona.voice_prompt)
        for t in range(voice.shape[1]):
            steps.append(PromptStep(user(len(steps)), TEXT_PADDING_ID, voice[:, t]))
        for _ in range(SILENCE_FRAMES):
            steps.append(PromptStep(user(len(steps)), TEXT_PADDING_ID, silence(len(steps))))
    if persona.text_prompt:
        tokens = tokenizer.encode(f"<system> {persona.text_prompt.strip()} <system>")
        if len(tokens) > MAX_TEXT_PROMPT_TOKENS:
            raise PersonaError(
                f"text_prompt is invalid: {TEXT_PROMPT_LIMIT}; got {len(tokens)} tokens "
                f"({len(persona.text_prompt)} characters)"
            )
        for token in tokens:
            steps.append(PromptStep(user(len(steps)), int(token), silence(len(steps))))
        for _ in range(SILENCE_FRAMES):
            steps.append(PromptStep(user(len(steps)), TEXT_PADDING_ID, silence(len(steps))))
    assert all(s.text_token != NOT_FORCED for s in steps)
    return steps
