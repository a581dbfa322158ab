"""The node's voice catalog: voice prompts by name, loaded once at start-up from ``DUPLEX_VOICES_DIR``.

A voice is one of two kinds (:data:`Voice`):

- :class:`CodesVoice`: Mimi codes ``[K, T]`` of a recorded voice (``<name>.wav``, encoded by the node's Mimi
  before the engine enters streaming mode), teacher-forced as the agent's audio;
- :class:`EmbeddingsVoice`: one of NVIDIA's PersonaPlex presets (``<NAME>.pt`` from ``voices.tgz``): the
  temporal transformer's input embeddings per prompt step and the ``LMGen`` token cache after them, replayed
  as they are (NVIDIA/personaplex ``moshi/moshi/models/lm.py``, ``load_voice_prompt_embeddings`` and
  ``_step_voice_prompt_core``); Mimi codes cannot be recovered from them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from runtime.engine.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.engine.persona_limits import VOICE_PROMPT_RE, PersonaError

log = logging.getLogger(__name__)

MAX_VOICE_PROMPT_FRAMES = 375
"""30 s at 12.5 Hz: longer voice prompts are cut."""


@dataclass(frozen=True)
class CodesVoice:
    """A voice prompt as Mimi codes.

    Attributes:
        codes: ``[K, T]`` int64, K = Mimi codebooks (8 for the 7B models), T frames at 12.5 Hz.
    """

    codes: torch.Tensor


@dataclass(frozen=True)
class EmbeddingsVoice:
    """A voice prompt as NVIDIA ships it (``voices.tgz`` -> ``voices/<NAME>.pt``).

    Attributes:
        embeddings: ``[T, ...]`` float, the temporal transformer's summed input embeddings of each of the T
            voice-prompt steps, as ``torch.stack`` of NVIDIA's per-step embeddings left them (each step's
            trailing dims end in the model's ``dim``, 4096 for the 7B).
        cache: the ``LMGen`` token cache NVIDIA saved after the voice steps, as saved (``[1, K, CT]`` int64,
            CT = 4 in NVIDIA's fork; moshi 0.2.13 keeps 3 columns).
    """

    embeddings: torch.Tensor
    cache: torch.Tensor


Voice = CodesVoice | EmbeddingsVoice


class VoiceCatalog:
    """Voice prompts by name (:data:`Voice`: Mimi codes or NVIDIA's embedding presets).

    Args:
        voices: name -> voice; a bare tensor is taken as Mimi codes ``[K, T]`` (a :class:`CodesVoice`).
    """

    def __init__(self, voices: Mapping[str, Voice | torch.Tensor] | None = None) -> None:
        self._voices: dict[str, Voice] = {
            name: CodesVoice(v) if isinstance(v, torch.Tensor) else v for name, v in (voices or {}).items()
        }

    @property
    def names(self) -> list[str]:
        return sorted(self._voices)

    def get(self, name: str) -> Voice:
        """The voice called ``name``; NVIDIA's file name (``NATF2.pt``, as its server and LiveKit's
        PersonaPlex plugin send it) names the voice ``NATF2``.

        Raises:
            PersonaError: unknown voice; the message lists the known ones.
        """
        voice = self._voices.get(name)
        if voice is None and name.endswith(".pt"):
            voice = self._voices.get(name[: -len(".pt")])
        if voice is None:
            known = ", ".join(self.names) or "none on this node"
            raise PersonaError(f"unknown voice_prompt {name!r}; voices on this node: {known}")
        return voice

    def codes(self, name: str) -> torch.Tensor:
        """The Mimi codes ``[K, T]`` of voice ``name``.

        Raises:
            PersonaError: unknown voice (the known ones listed), or a voice held as embeddings.
        """
        voice = self.get(name)
        if not isinstance(voice, CodesVoice):
            raise PersonaError(f"voice_prompt {name!r} is a preset of input embeddings, not Mimi codes")
        return voice.codes

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
