"""Personas: a voice prompt and a text role prompt, fed into a slot before its conversation starts.

The sequence follows PersonaPlex's conditioning (NVIDIA/personaplex ``moshi/moshi/models/lm.py``,
``step_system_prompts``): the voice prompt's codes are teacher-forced as the agent's audio while the user
stream carries a 440 Hz sine, then 6 frames of silence, then the text prompt wrapped in ``<system>`` tags
(once: NVIDIA's ``wrap_with_system_tags``), one LM step per text token, then 6 frames of silence. Each frame
is one :class:`PromptStep`; the engine lays its codebooks out with the model's delays as NVIDIA does
(:func:`runtime.engine.batch.prompt_positions`). A voice of NVIDIA's presets (:class:`EmbeddingsVoice`)
is replayed as its stored input embeddings, then its token cache (:func:`embeddings_voice_steps`).
The engine runs these steps in the spare time of each tick (:class:`runtime.engine.batch.BatchEngine`), so the
other slots' audio never waits for a prompt; the handshake is sent when the prompt is done.

Voices come from :class:`runtime.engine.voices.VoiceCatalog`, loaded once at start-up. Clients name a
voice; they never upload audio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sentencepiece
import torch

from runtime.engine.batch import NOT_FORCED, PromptStep
from runtime.engine.model_presets import PERSONAPLEX_7B_LM
from runtime.engine.persona_limits import (
    TEXT_PROMPT_LIMIT,
    TEXT_PROMPT_MAX_TOKENS,
    PersonaError,
)
from runtime.engine.voices import EmbeddingsVoice, VoiceCatalog

TEXT_PADDING_ID = 3
SILENCE_FRAMES = 6
"""Silence after the voice prompt and after the text prompt: 6 frames = 480 ms (NVIDIA's server:
``audio_silence_frame_cnt=int(0.5 * frame_rate)``)."""
SYSTEM_TAG = "<system>"
NVIDIA_CACHE_COLUMNS = 4
"""Columns of the token cache in NVIDIA's ``LMGen`` (``max_delay + 3``); moshi 0.2.13 keeps
``max_delay + 2`` = 3."""
MAX_TEXT_PROMPT_TOKENS = TEXT_PROMPT_MAX_TOKENS
"""The limit stated once in ``runtime.frontend.codecs.protocol`` (``TEXT_PROMPT_LIMIT``): tokens, wrapper
included."""


@dataclass(frozen=True)
class Persona:
    """What a session asked for: a voice preset name and/or a text prompt (both optional)."""

    voice_prompt: str | None = None
    text_prompt: str | None = None

    @property
    def label(self) -> str:
        """Short description for the session registry and logs: the voice's name and the text prompt's
        length, never its words (the prompt may hold what a caller's application told the agent)."""
        parts = []
        if self.voice_prompt:
            parts.append(f"voice={self.voice_prompt}")
        if self.text_prompt:
            parts.append(f"text_chars={len(self.text_prompt)}")
        return " ".join(parts)


def wrap_with_system_tags(text: str) -> str:
    """``text`` between ``<system>`` tags, unless it already is (NVIDIA/personaplex ``moshi/moshi/server.py``
    ``wrap_with_system_tags``): never wrapped twice."""
    cleaned = text.strip()
    if cleaned.startswith(SYSTEM_TAG) and cleaned.endswith(SYSTEM_TAG):
        return cleaned
    return f"{SYSTEM_TAG} {cleaned} {SYSTEM_TAG}"


def with_defaults(
    persona: Persona, voices: VoiceCatalog, *, default_voice: str | None, default_text: str | None
) -> Persona:
    """``persona`` with the node's defaults for what it leaves out, for a model that never runs without a
    voice and a text prompt (``ModelPreset.persona_required``: NVIDIA's server always runs both).

    Raises:
        PersonaError: no voice asked for and no usable default voice (``default_voice`` unset or not in
            the catalog; the message lists the voices there), or no text prompt and no default one.
    """
    voice = persona.voice_prompt or default_voice
    if voice is None or not persona.voice_prompt and default_voice not in voices.names:
        known = ", ".join(voices.names) or "none on this node"
        raise PersonaError(
            f"this model needs a voice_prompt and the node has no default voice (DUPLEX_DEFAULT_VOICE "
            f"{default_voice!r} is not among its voices); name one of: {known}"
        )
    text = persona.text_prompt or default_text
    if not text:
        raise PersonaError("this model needs a text_prompt and the node has no default one")
    return Persona(voice, text)


def embeddings_voice_steps(
    voice: EmbeddingsVoice,
    *,
    sine: torch.Tensor,
    silence: torch.Tensor,
    delays: Sequence[int] = PERSONAPLEX_7B_LM["delays"],
) -> list[PromptStep]:
    """The frames of one of NVIDIA's voice presets: its E stored embeddings as the transformer's input of
    steps 0..E-1, then its token cache mapped onto moshi 0.2.13's layout.

    NVIDIA records a preset from a voice of T frames started at offset 0 (``_step_voice_prompt_core``):
    its first ``step`` only fills the cache, so steps 1..T-1 run the transformer, on positions 0..T-2,
    and each saves ``embed_codes`` of its input: E = T - 1 embeddings. Replaying them
    (``step_embeddings``) runs the same E transformer steps and leaves NVIDIA's offset at T; then the cache
    saved at offset T is copied in. NVIDIA's cache has 4 columns, column ``p % 4`` holding position p; at
    offset T it holds positions T-3..T, of which the following steps read only position T-1 (every row:
    text, agent and user codebook 0 of frame T-1, codebooks 1..7 of frame T-2) and position T's delayed rows
    (codebooks 1..7 of frame T-1; its delay-0 rows are stale, written next by the first silence frame).
    moshi 0.2.13's cache has 3 columns, column ``p % 3`` holding position p. So the mapping is by
    position: ``moshi[:, (T-1) % 3] = nvidia[:, (T-1) % 4]`` and
    ``moshi[delayed rows, T % 3] = nvidia[delayed rows, T % 4]``. The engine writes positions from
    frames (``runtime.engine.batch.prompt_positions``), so the mapping is made by giving frame T-1 its
    delay-0 tokens from NVIDIA's column ``(T-1) % 4`` and its delayed ones from ``T % 4``, and frame T-2
    its delayed ones from ``(T-1) % 4`` (its delay-0 ones from ``(T-2) % 4``, never read: step T-2 takes
    its embedding). The other frames' tokens are never read (their steps take embeddings) and hold the
    prompt's sine and silence.

    Args:
        voice: the preset; ``embeddings`` ``[E, ...]`` (each step ``dim`` values), ``cache`` ``[1, K, 4]``
            or ``[K, 4]`` (K = 1 text + 8 agent + 8 user rows, as NVIDIA's 7B cache).
        sine, silence: ``[8]`` the user's and the agent's prompt frame.
        delays: ``[K]`` the delay of each cache row (PersonaPlex's by default).
    Raises:
        PersonaError: a preset with no embeddings or a cache of another shape.
    """
    cache = voice.cache[0] if voice.cache.dim() == 3 else voice.cache
    rows = len(delays)
    if cache.dim() != 2 or cache.shape[0] != rows or cache.shape[1] != NVIDIA_CACHE_COLUMNS:
        raise PersonaError(
            f"voice preset: token cache must be [1, {rows}, {NVIDIA_CACHE_COLUMNS}], "
            f"got {list(voice.cache.shape)}"
        )
    count = voice.embeddings.shape[0]
    if count < 1:
        raise PersonaError("voice preset: no embeddings")
    total = count + 1  # T frames
    cache = cache.to(torch.int64).cpu()
    agent_rows = len(silence)
    delayed = torch.tensor([d > 0 for d in delays])

    def frame(position_of_delay0: int) -> torch.Tensor:
        """``[K]`` one frame's tokens: delay-0 rows at ``position_of_delay0``, delayed rows one later."""
        now = cache[:, position_of_delay0 % NVIDIA_CACHE_COLUMNS]
        later = cache[:, (position_of_delay0 + 1) % NVIDIA_CACHE_COLUMNS]
        return torch.where(delayed, later, now)

    def tokens_step(j: int, embedding: torch.Tensor | None) -> PromptStep:
        tokens = frame(j)
        return PromptStep(tokens[1 + agent_rows :], int(tokens[0]), tokens[1 : 1 + agent_rows], embedding)

    steps = [
        PromptStep(sine, TEXT_PADDING_ID, silence, embedding=voice.embeddings[j].reshape(-1))
        for j in range(count - 1)
    ]
    steps.append(tokens_step(total - 2, voice.embeddings[count - 1].reshape(-1)))
    steps.append(tokens_step(total - 1, None))
    return steps


def build_prompt(
    persona: Persona,
    voices: VoiceCatalog,
    tokenizer: sentencepiece.SentencePieceProcessor,
    *,
    silence_codes: torch.Tensor,
    sine_codes: torch.Tensor,
    delays: Sequence[int] = PERSONAPLEX_7B_LM["delays"],
) -> list[PromptStep]:
    """The teacher-forced frames of ``persona``; empty when it names neither voice nor text.

    Args:
        silence_codes, sine_codes: ``[K, F]`` Mimi codes of silence and of the 440 Hz user-stream tone;
            frames are cycled (``F = 1``: NVIDIA's constant frames, ``BatchEngine.silence_codes``).
        delays: the model's delays (``lm.delays``), for an embeddings voice's token cache.
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
        preset = voices.get(persona.voice_prompt)
        if isinstance(preset, EmbeddingsVoice):
            steps += embeddings_voice_steps(preset, sine=user(0), silence=silence(0), delays=delays)
        else:
            voice = voices.codes(persona.voice_prompt)
            for t in range(voice.shape[1]):
                steps.append(PromptStep(user(len(steps)), TEXT_PADDING_ID, voice[:, t]))
        for _ in range(SILENCE_FRAMES):
            steps.append(PromptStep(user(len(steps)), TEXT_PADDING_ID, silence(len(steps))))
    if persona.text_prompt:
        tokens = tokenizer.encode(wrap_with_system_tags(persona.text_prompt))
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
