"""Personas: a voice prompt and a text role prompt, fed into a slot before its conversation starts.

The sequence follows PersonaPlex's conditioning (NVIDIA/personaplex, model card and ``offline.py``): the
voice prompt's codes are teacher-forced as the agent's audio while the user stream carries a 440 Hz sine,
then silence, then the text prompt wrapped in ``<system>`` tags, one LM step per text token, then silence.
The engine runs these steps in the spare time of each tick (:class:`runtime.engine.batch.BatchEngine`), so the
other slots' audio never waits for a prompt; the handshake is sent when the prompt is done.

Voices come from :class:`runtime.engine.voices.VoiceCatalog`, loaded once at start-up. Clients name a
voice; they never upload audio.
"""

from __future__ import annotations

from dataclasses import dataclass

import sentencepiece
import torch

from runtime.engine.batch import NOT_FORCED, PromptStep
from runtime.engine.persona_limits import (
    TEXT_PROMPT_LIMIT,
    TEXT_PROMPT_MAX_TOKENS,
    PersonaError,
)
from runtime.engine.voices import VoiceCatalog

TEXT_PADDING_ID = 3
SILENCE_FRAMES = 6
"""Silence after the voice prompt and after the text prompt: 6 frames = 480 ms."""
MAX_TEXT_PROMPT_TOKENS = TEXT_PROMPT_MAX_TOKENS
"""The limit stated once in ``runtime.frontend.protocol`` (``TEXT_PROMPT_LIMIT``): tokens, wrapper
included."""


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
