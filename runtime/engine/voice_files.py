"""Reading the voice files of ``DUPLEX_VOICES_DIR`` (:class:`runtime.engine.voices.VoiceCatalog` uses this):
NVIDIA's ``voices.tgz`` unpacked once, each ``<NAME>.pt`` and ``<name>.wav`` read and checked against the
model. A file that is not a usable voice raises :class:`VoiceFileError` saying what was wrong; the catalog
logs it, counts it and goes on without it.

The file kinds, as NVIDIA/personaplex ``moshi/moshi/models/lm.py`` writes and reads them:

- ``{"embeddings": [T, 1, 1, dim], "cache": [1, K, CT]}``: a PersonaPlex preset. ``_step_voice_prompt_core``
  saves ``torch.stack`` of the ``embed_codes`` output (``[B=1, S=1, dim]``) of each voice step after the
  first, and ``LMGen``'s token cache ``_streaming_state.cache`` (``[B=1, num_codebooks, max_delay + 3]``,
  ``_init_streaming_state``); ``load_voice_prompt_embeddings`` reads both back.
- ``{"codes": [K, T]}`` or a bare ``[K, T]`` tensor: Mimi codes (this project's own form).
- ``.wav``: audio at any rate, mixed to mono, resampled to 24 kHz, normalised to −24 LUFS with pyloudnorm
  (``normalize_audio``), cut to :data:`MAX_VOICE_PROMPT_FRAMES`, the last partial frame zero-padded
  (``_iterate_audio(pad=True)``), then Mimi-encoded; a clip under one frame becomes one zero-padded frame.
"""

from __future__ import annotations

import logging
import os
import shutil
import tarfile
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.engine.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ

log = logging.getLogger(__name__)

MAX_VOICE_PROMPT_FRAMES = 375
"""30 s at 12.5 Hz: longer wav voice prompts are cut (NVIDIA's presets are replayed whole)."""
TARGET_LUFS = -24.0
"""Integrated loudness of a wav voice prompt (ITU-R BS.1770), NVIDIA/personaplex ``lm.py``
``load_voice_prompt``: ``normalize_audio(raw_audio, sample_rate, -24.0)``."""
LOUDNESS_BLOCK_S = 0.4
"""pyloudnorm's gating block (BS.1770's 400 ms): a shorter clip is measured repeated to this length."""
VOICES_ARCHIVE = "voices.tgz"
"""NVIDIA's voice presets as published in ``nvidia/personaplex-7b-v1``: ``voices/NATF0..3.pt, NATM0..3.pt,
VARF0..4.pt, VARM0..4.pt``."""
UNPACKED_SUFFIX = ".unpacked"
"""``voices.tgz`` is unpacked into ``voices.tgz.unpacked/`` beside it."""
_STAMP = ".unpacked-from"
MAX_ARCHIVE_BYTES = 2 * 1024**3
"""Most bytes ``voices.tgz`` may unpack to (NVIDIA's 18 presets are far less): a bound on a bad archive."""
VOICE_SUFFIXES = (".pt", ".wav")


class VoiceFileError(ValueError):
    """A voice file that cannot be used; the message says what was wrong and what is expected."""


@dataclass(frozen=True)
class ModelShape:
    """What a voice file is checked against.

    Attributes:
        dim: the temporal transformer's width (``LMModel.dim``: 4096 for the 7B).
        num_codebooks: rows of ``LMGen``'s token cache (``LMModel.num_codebooks``: 1 text + 16 audio).
        cache_columns: columns of NVIDIA's token cache, ``max(delays) + 3`` (4 for the 7B).
        context: the temporal transformer's context in steps (3000 for the 7B): a longer preset never fits.
        mimi_codebooks, card: Mimi codes' rows (8) and cardinality (2048).
    """

    dim: int
    num_codebooks: int
    cache_columns: int
    context: int
    mimi_codebooks: int
    card: int

    @classmethod
    def of(cls, lm: Any, mimi: Any) -> ModelShape:
        """The shape of moshi's ``LMModel`` ``lm`` and ``MimiModel`` ``mimi``."""
        return cls(
            dim=int(lm.dim),
            num_codebooks=int(lm.num_codebooks),
            cache_columns=max(lm.delays) + 3,
            context=int(lm.context),
            mimi_codebooks=int(mimi.num_codebooks),
            card=int(lm.card),
        )


def unpack_archive(archive: Path) -> Path:
    """Unpack ``archive`` (``voices.tgz``) once into ``<archive>.unpacked/`` beside it; return that folder.

    A folder already unpacked from the same archive (same size and modification time, recorded in it) is
    reused: a second start unpacks nothing. Members are extracted with tarfile's ``"data"`` filter (no
    absolute paths, no ``..``, no links out, no devices), into a temporary folder renamed into place.

    Raises:
        VoiceFileError: an unreadable archive, one over :data:`MAX_ARCHIVE_BYTES`, a member the filter
            refuses, or a folder that cannot be written.
    """
    target = archive.with_name(archive.name + UNPACKED_SUFFIX)
    try:
        info = archive.stat()
    except OSError as exc:
        raise VoiceFileError(f"cannot read {archive.name}: {exc}") from None
    stamp = f"{info.st_size} {info.st_mtime_ns}"
    if (target / _STAMP).is_file() and (target / _STAMP).read_text() == stamp:
        return target
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = tar.getmembers()
            size = sum(m.size for m in members)
            if size > MAX_ARCHIVE_BYTES:
                raise VoiceFileError(
                    f"{archive.name} unpacks to {size} bytes; at most {MAX_ARCHIVE_BYTES} bytes allowed"
                )
            staging = Path(tempfile.mkdtemp(prefix=f".{archive.name}-", dir=archive.parent))
            try:
                tar.extractall(staging, members=members, filter="data")
                (staging / _STAMP).write_text(stamp)
                if target.exists():
                    shutil.rmtree(target)
                os.replace(staging, target)
            finally:
                if staging.exists():
                    shutil.rmtree(staging, ignore_errors=True)
    except VoiceFileError:
        raise
    except (OSError, tarfile.TarError) as exc:
        raise VoiceFileError(f"cannot unpack {archive.name}: {type(exc).__name__}: {exc}") from None
    log.info("voices: unpacked %s into %s", archive, target)
    return target


def voice_files(directory: Path, *, recursive: bool = False) -> list[Path]:
    """The ``*.pt`` and ``*.wav`` files in ``directory`` (and below it when ``recursive``: NVIDIA's
    archive unpacks to a ``voices/`` folder), sorted."""
    found = directory.rglob("*") if recursive else directory.iterdir()
    return sorted(p for p in found if p.suffix in VOICE_SUFFIXES and p.is_file())


def read_pt(path: Path, shape: ModelShape | None) -> dict[str, torch.Tensor]:
    """A ``.pt`` voice file: ``{"embeddings", "cache"}`` (NVIDIA's preset) or ``{"codes"}`` ``[K, T]``
    int64 (a bare ``[K, T]`` tensor is taken as codes). Loaded with ``weights_only=True`` (tensors and
    plain containers only: no code runs), onto the CPU.

    Args:
        shape: the model to check against; None checks the structure only.
    Raises:
        VoiceFileError: unreadable, other keys, or shapes the model cannot replay (the message says which).
    """
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and weights_only errors have no common base
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise VoiceFileError(f"unreadable as a torch file ({type(exc).__name__}: {first[:200]})") from None
    if isinstance(loaded, torch.Tensor):
        loaded = {"codes": loaded}
    if not isinstance(loaded, dict):
        raise VoiceFileError(f"holds a {type(loaded).__name__}; expected a dict or a [K, T] tensor")
    keys = set(loaded)
    if keys == {"embeddings", "cache"}:
        return {
            "embeddings": _check_embeddings(loaded["embeddings"], shape),
            "cache": _check_cache(loaded["cache"], shape),
        }
    if keys == {"codes"}:
        return {"codes": _check_codes(loaded["codes"], shape)}
    raise VoiceFileError(
        f"has keys {sorted(map(str, keys))}; expected {{'embeddings', 'cache'}} (NVIDIA's PersonaPlex "
        "preset) or {'codes'} (Mimi codes [K, T])"
    )


def _check_embeddings(value: object, shape: ModelShape | None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() < 2:
        raise VoiceFileError(f"'embeddings' must be a float tensor [T, 1, 1, dim]; got {_describe(value)}")
    steps, width = value.shape[0], value.shape[-1]
    if steps < 1 or any(d != 1 for d in value.shape[1:-1]):
        raise VoiceFileError(f"'embeddings' must be [T, 1, 1, dim] with T >= 1; got {list(value.shape)}")
    if shape is not None:
        if width != shape.dim:
            raise VoiceFileError(f"'embeddings' are {width} wide; this model's dim is {shape.dim}")
        if steps >= shape.context:
            raise VoiceFileError(f"'embeddings' have {steps} steps; this model's context is {shape.context}")
    if not torch.isfinite(value).all():
        raise VoiceFileError("'embeddings' hold NaN or infinite values")
    return value


def _check_cache(value: object, shape: ModelShape | None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.dim() != 3:
        raise VoiceFileError(f"'cache' must be an integer tensor [1, K, CT]; got {_describe(value)}")
    if value.shape[0] != 1:
        raise VoiceFileError(f"'cache' must hold one row (batch 1); got {list(value.shape)}")
    if shape is not None and tuple(value.shape[1:]) != (shape.num_codebooks, shape.cache_columns):
        raise VoiceFileError(
            f"'cache' is {list(value.shape)}; this model's LMGen cache is [1, {shape.num_codebooks}, "
            f"{shape.cache_columns}] (num_codebooks, max(delays) + 3 as NVIDIA's fork keeps it)"
        )
    return value.long()


def _check_codes(value: object, shape: ModelShape | None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.dim() != 2:
        raise VoiceFileError(
            f"'codes' must be an integer tensor [K, T] of Mimi codes; got {_describe(value)}"
        )
    if value.shape[1] < 1:
        raise VoiceFileError("'codes' hold no frame")
    if shape is not None:
        if value.shape[0] != shape.mimi_codebooks:
            raise VoiceFileError(
                f"'codes' have {value.shape[0]} codebooks; Mimi here has {shape.mimi_codebooks}"
            )
        if value.min() < 0 or value.max() >= shape.card:
            raise VoiceFileError(f"'codes' must lie in [0, {shape.card}); got [{value.min()}, {value.max()}]")
    return value.long()[:, :MAX_VOICE_PROMPT_FRAMES]


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)}"
    return type(value).__name__


def read_wav(path: Path) -> np.ndarray:
    """A wav voice prompt as the encoder gets it: ``[F * 1920]`` float32 mono at 24 kHz, at
    :data:`TARGET_LUFS`, at most :data:`MAX_VOICE_PROMPT_FRAMES` frames, the last one zero-padded.

    Raises:
        VoiceFileError: unreadable, or no samples.
    """
    import sphn

    try:
        pcm, rate = sphn.read(str(path))
    except Exception as exc:  # sphn raises its own (Rust) errors
        raise VoiceFileError(f"unreadable as audio ({type(exc).__name__}: {exc})") from None
    mono = np.asarray(pcm, dtype=np.float32).mean(axis=0)
    if mono.size == 0:
        raise VoiceFileError("holds no samples")
    if rate != SAMPLE_RATE_HZ:
        mono = sphn.resample(mono, src_sample_rate=rate, dst_sample_rate=SAMPLE_RATE_HZ)
    mono = normalize_loudness(np.asarray(mono, dtype=np.float64), SAMPLE_RATE_HZ)
    mono = mono[: MAX_VOICE_PROMPT_FRAMES * FRAME_SAMPLES]
    return pad_to_frames(mono).astype(np.float32)


def normalize_loudness(pcm: np.ndarray, rate: int, target_lufs: float = TARGET_LUFS) -> np.ndarray:
    """``pcm`` ``[N]`` scaled to ``target_lufs`` integrated loudness (pyloudnorm, ITU-R BS.1770), as
    NVIDIA's ``normalize_audio``. A clip under one 400 ms gating block is measured repeated to that length
    (repetition keeps its loudness; pyloudnorm refuses shorter input); a silent clip (below BS.1770's
    −70 LUFS gate) is returned as it is."""
    import pyloudnorm

    block = int(LOUDNESS_BLOCK_S * rate)
    measured = np.resize(pcm, max(len(pcm), block + 1)) if len(pcm) <= block else pcm
    loudness = pyloudnorm.Meter(rate).integrated_loudness(measured)
    if not np.isfinite(loudness):
        return pcm
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        normalized = pyloudnorm.normalize.loudness(pcm, loudness, target_lufs)
    if caught:  # "Possible clipped samples in output": kept as NVIDIA keeps them (Mimi takes any float)
        log.warning("voice prompt at %.1f LUFS -> %.1f LUFS: %s", loudness, target_lufs, caught[0].message)
    return np.asarray(normalized)


def pad_to_frames(pcm: np.ndarray) -> np.ndarray:
    """``pcm`` ``[N]`` zero-padded to whole 1920-sample frames (at least one), as NVIDIA's
    ``_iterate_audio(pad=True)``: the last partial frame is kept, never dropped, nor the clip tiled."""
    frames = max(1, -(-len(pcm) // FRAME_SAMPLES))
    return np.pad(pcm, (0, frames * FRAME_SAMPLES - len(pcm)))
