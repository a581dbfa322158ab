"""The node's voice catalog: voice prompts by name, loaded once at start-up from ``DUPLEX_VOICES_DIR`` (or,
without it, from the model's ``voices.tgz``: :func:`voices_source`), before Mimi enters streaming mode.

A voice is one of two kinds (:data:`Voice`):

- :class:`CodesVoice`: Mimi codes ``[K, T]`` of a recorded voice (``<name>.wav``, encoded by the node's Mimi
  before the engine enters streaming mode), teacher-forced as the agent's audio;
- :class:`EmbeddingsVoice`: one of NVIDIA's PersonaPlex presets (``<NAME>.pt`` from ``voices.tgz``): the
  temporal transformer's input embeddings per prompt step and the ``LMGen`` token cache after them, replayed
  as they are (NVIDIA/personaplex ``moshi/moshi/models/lm.py``, ``load_voice_prompt_embeddings`` and
  ``_step_voice_prompt_core``); Mimi codes cannot be recovered from them.

A file that is not a usable voice (unreadable, wrong keys, shapes the model cannot replay, a name clients
cannot ask for, a name taken twice) is refused with its name and what was wrong: logged, counted in
:attr:`VoiceCatalog.refused` and skipped; it never stops the node. How each file is read and checked:
:mod:`runtime.engine.voice_files`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.engine.persona_limits import VOICE_PROMPT_RE, PersonaError, voice_name
from runtime.engine.voice_files import (
    MAX_VOICE_PROMPT_FRAMES,
    VOICES_ARCHIVE,
    ModelShape,
    VoiceFileError,
    read_pt,
    read_wav,
    unpack_archive,
    voice_files,
)

__all__ = [
    "MAX_VOICE_PROMPT_FRAMES",
    "CodesVoice",
    "EmbeddingsVoice",
    "RefusedVoice",
    "Voice",
    "VoiceCatalog",
    "voices_source",
]

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class RefusedVoice:
    """A voice file the node refused at start-up.

    Attributes:
        file: its name (``NATF2.pt``; the archive's name when ``voices.tgz`` itself could not be unpacked).
        reason: what was wrong and what is expected.
    """

    file: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.reason}"


class VoiceCatalog:
    """Voice prompts by name (:data:`Voice`: Mimi codes or NVIDIA's embedding presets).

    Args:
        voices: name -> voice; a bare tensor is taken as Mimi codes ``[K, T]`` (a :class:`CodesVoice`).
        refused: the voice files refused at start-up (:meth:`load`).
    """

    def __init__(
        self,
        voices: Mapping[str, Voice | torch.Tensor] | None = None,
        refused: Iterable[RefusedVoice] = (),
    ) -> None:
        self._voices: dict[str, Voice] = {
            name: CodesVoice(v) if isinstance(v, torch.Tensor) else v for name, v in (voices or {}).items()
        }
        self.refused: tuple[RefusedVoice, ...] = tuple(refused)

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
        if voice is None:
            voice = self._voices.get(voice_name(name))
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
    def load(cls, source: Path | None, mimi: Any, *, lm: Any = None) -> VoiceCatalog:
        """Load the voices of ``source``: a directory's ``*.pt`` and ``*.wav`` files and the presets of its
        ``voices.tgz`` (unpacked once beside it), or a ``voices.tgz`` itself. Wav audio is encoded with
        ``mimi``: this must run before ``mimi`` enters streaming mode (the engine's ``streaming_forever``).

        A file that cannot be used is refused (see the module docstring) and listed in :attr:`refused`;
        this never raises for a file's content or name.

        Args:
            source: a directory, a ``voices.tgz``, or None (no voices).
            mimi: moshi ``MimiModel``, not streaming.
            lm: moshi ``LMModel``: presets are checked against its ``dim``, ``num_codebooks``, delays and
                context, Mimi codes against its ``card``; None checks structure only.
        """
        if source is None:
            return cls()
        shape = ModelShape.of(lm, mimi) if lm is not None else None
        source = Path(source)
        voices: dict[str, Voice] = {}
        origin: dict[str, str] = {}
        refused: list[RefusedVoice] = []

        def refuse(file: str, reason: str) -> None:
            log.error("voice file %s refused: %s", file, reason)
            refused.append(RefusedVoice(file, reason))

        files: list[Path] = []
        archive = source if source.is_file() and source.name == VOICES_ARCHIVE else source / VOICES_ARCHIVE
        if source.is_dir():
            files = voice_files(source)
        elif source != archive:
            refuse(str(source), f"DUPLEX_VOICES_DIR is not a directory nor a {VOICES_ARCHIVE}")
        if archive.is_file():
            try:
                files += voice_files(unpack_archive(archive), recursive=True)
            except VoiceFileError as exc:
                refuse(archive.name, str(exc))
        for path in files:
            name = path.stem
            if not VOICE_PROMPT_RE.fullmatch(name):  # the names clients may ask for
                refuse(path.name, f"the name must match {VOICE_PROMPT_RE.pattern}")
                continue
            if name in voices:
                refuse(path.name, f"voice {name!r} is already loaded from {origin[name]}")
                continue
            try:
                voice = cls._read(path, mimi, shape)
            except VoiceFileError as exc:
                refuse(path.name, str(exc))
                continue
            voices[name], origin[name] = voice, path.name
            steps = voice.codes.shape[1] if isinstance(voice, CodesVoice) else voice.embeddings.shape[0]
            log.info("voice %s (%s): %d steps", name, type(voice).__name__, steps)
        if refused:
            log.error("voices: %d file(s) refused, %d loaded", len(refused), len(voices))
        return cls(voices, refused)

    @staticmethod
    def _read(path: Path, mimi: Any, shape: ModelShape | None) -> Voice:
        if path.suffix == ".pt":
            loaded = read_pt(path, shape)
            if "codes" in loaded:
                return CodesVoice(loaded["codes"])
            return EmbeddingsVoice(loaded["embeddings"], loaded["cache"])
        pcm = read_wav(path)
        device = next(mimi.parameters()).device
        codes = mimi.encode(torch.from_numpy(pcm)[None, None].to(device))[0].cpu()
        return CodesVoice(codes.long())


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def voices_source(
    voices_dir: Path | None, model_source: str, *, revision: str | None = None, from_hub: bool = True
) -> Path | None:
    """Where the node's voices come from: ``voices_dir`` (``DUPLEX_VOICES_DIR``) when set; else the
    model's own ``voices.tgz``: in the weights directory, or downloaded from the model's Hugging Face repo
    (``nvidia/personaplex-7b-v1`` publishes one, as NVIDIA's server fetches it, its ``server.py``
    ``_get_voice_prompt_dir``); else None (no voices).

    Args:
        model_source: ``ModelBundle.source``: a directory, a repo id, or ``random(seed=N)``.
        from_hub: ask the Hub for the repo's ``voices.tgz``; the node passes its preset's
            ``persona_required`` (PersonaPlex publishes voices; Kyutai's repos have none, and an offline or
            on-prem node should not make a request that can only fail).
    Never raises: a repo without the archive, or a failed download, is logged and gives None.
    """
    if voices_dir is not None:
        return Path(voices_dir)
    directory = Path(model_source)
    if directory.is_dir():
        archive = directory / VOICES_ARCHIVE
        return archive if archive.is_file() else None
    if not from_hub or not _REPO_ID.fullmatch(model_source):
        return None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(model_source, VOICES_ARCHIVE, revision=revision))
    except Exception as exc:  # EntryNotFoundError (no archive in the repo), network, gated access
        log.info("voices: no %s from %s (%s: %s)", VOICES_ARCHIVE, model_source, type(exc).__name__, exc)
        return None
