"""What a checkpoint's ``config.json`` means to the loader: read and checked before any weight is fetched.

The published repos disagree on ``config.json``:

- ``nvidia/personaplex-7b-v1``: ``{"model_type": "personaplex", "version": "7b-v1"}``, metadata only;
  NVIDIA's own loader never reads it and hard-codes ``dep_q = 16`` (NVIDIA/personaplex
  ``moshi/moshi/models/loaders.py``, ``get_moshi_lm``).
- ``kyutai/moshiko-pytorch-bf16``, ``kyutai/moshika-pytorch-bf16``: no ``config.json`` at all (moshi's
  ``CheckpointInfo.from_hf_repo`` then assumes Moshi 7B).
- ``kyutai/moshiko-pytorch-q8``, ``kyutai/moshika-pytorch-q8``: the full LM keyword set of February 2025,
  with ``"depformer_causal": true`` (kyutai-labs/moshi ``moshi/models/loaders.py`` at ba92f01), the file
  names and ``"quantize": true`` (kyutai-labs/moshi ``scripts/export_quantized.py``).

The rule (:func:`resolve_checkpoint_config`): the preset's ``lm_kwargs`` are the starting point; a key of
``config.json`` is merged over them only if moshi 0.2.13's ``LMModel`` accepts it as configuration
(:data:`LM_CONFIG_KEYS`). Keys moshi 0.2.13's own ``loaders.get_moshi_lm`` drops are dropped the same way
(``depformer_causal``; ``lora``/``lora_rank``/``lora_scaling`` when LoRA is off) and a renamed key is renamed
(``demux_second_stream`` -> ``demux_second_text_stream``). File names (``moshi_name``, ``mimi_name``,
``tokenizer_name``, ``mimi_config_name``) and ``quantize`` are read; metadata (:data:`METADATA_KEYS`) is
ignored. Anything else (an unknown key, a value of the wrong type, LoRA or conditioning the runtime cannot
apply, a codebook layout other than the preset's) is a :class:`CheckpointConfigError` naming the key and
what is allowed; finally the merged configuration is built once on the meta device
(:func:`check_lm_kwargs`), so whatever ``LMModel`` itself refuses is refused before a download too.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from moshi.models.lm import LMModel
from moshi.modules.transformer import StreamingTransformer, StreamingTransformerLayer

from runtime.engine.model_presets import ModelPreset

log = logging.getLogger(__name__)

LM_WEIGHTS_FILE = "model.safetensors"
"""moshi ``loaders.MOSHI_NAME``; also NVIDIA's name (``nvidia/personaplex-7b-v1``)."""
MIMI_WEIGHTS_FILE = "tokenizer-e351c8d8-checkpoint125.safetensors"
"""moshi ``loaders.MIMI_NAME``; the same file in Kyutai's and NVIDIA's repos."""
TEXT_TOKENIZER_FILE = "tokenizer_spm_32k_3.model"
"""moshi ``loaders.TEXT_TOKENIZER_NAME``."""

FILE_NAME_KEYS: dict[str, str | None] = {
    "moshi_name": LM_WEIGHTS_FILE,
    "mimi_name": MIMI_WEIGHTS_FILE,
    "tokenizer_name": TEXT_TOKENIZER_FILE,
    "mimi_config_name": None,
}
"""File-name keys of ``config.json`` and their defaults, as moshi 0.2.13's ``CheckpointInfo.from_hf_repo``
reads them (None: no such file; the preset's Mimi configuration)."""

METADATA_KEYS = frozenset({"model_type", "version", "model_id", "lm_gen_config", "tts_config", "stt_config"})
"""Keys that describe a checkpoint but configure nothing the runtime builds; ignored. ``model_type`` and
``version``: NVIDIA's ``config.json``; ``model_id``, ``lm_gen_config`` (sampling defaults; the runtime has its
own), ``tts_config``, ``stt_config``: popped by moshi 0.2.13's ``CheckpointInfo.from_hf_repo``."""

DEPRECATED_KEYS = frozenset({"depformer_causal"})
"""Dropped, whatever their value, as moshi 0.2.13's ``loaders.get_moshi_lm`` drops them ("deprecated
params"): the depformer is causal whenever the LM is."""

RENAMED_KEYS: dict[str, str] = {"demux_second_stream": "demux_second_text_stream"}
"""Old name -> name ``LMModel`` takes now (moshi 0.2.13 ``loaders.get_moshi_lm``, "moved params")."""

LORA_KEYS = frozenset({"lora", "lora_rank", "lora_scaling", "lora_name"})
"""LoRA settings; moshi 0.2.13 pops them before ``LMModel``. The runtime applies no adapter: ``lora`` must be
false and ``lora_name`` empty (fuse the adapter into ``model.safetensors``); ``lora_rank`` and
``lora_scaling`` then mean nothing and are dropped."""

PRESET_FIXED_KEYS = ("n_q", "card")
"""Keys a ``config.json`` may repeat but not change: the runtime's Mimi and its user/agent codebook split are
built for the preset's values (16 codebooks of 2048 entries for every 7B preset)."""

# LMModel keywords that are the loader's to set, never a config's: where and how the model is built.
_LOADER_OWNED = frozenset({"self", "kwargs", "device", "dtype", "quantize", "condition_provider", "fuser"})
# What LMModel itself passes to the temporal transformer (StreamingTransformer) or overrides for the
# depformer; a config key of these names would reach the transformer twice (moshi/models/lm.py).
_MAIN_SET_BY_LM = frozenset(
    {"d_model", "num_heads", "dim_feedforward", "norm", "context", "causal", "checkpointing", "quantize"}
)
_DEP_SET_BY_LM = frozenset(
    {
        "d_model",
        "dim_feedforward",
        "norm",
        "weights_per_step_schedule",
        "causal",
        "quantize",
        "checkpointing",
    }
)
# Set by StreamingTransformer itself for each layer (``rope``) or not configuration at all.
_TRANSFORMER_ONLY = frozenset({"self", "kwargs", "device", "dtype", "layer_class", "rope"})


def _parameters(cls: type) -> set[str]:
    return set(inspect.signature(cls).parameters)


def _lm_config_keys() -> frozenset[str]:
    """LMModel's own keywords, plus the transformer keywords it forwards (``**kwargs``), plus those forwarded
    to the depformer under the ``depformer_`` prefix; minus what the loader or LMModel sets itself."""
    own = _parameters(LMModel) - _LOADER_OWNED
    transformer = (
        _parameters(StreamingTransformer) | _parameters(StreamingTransformerLayer)
    ) - _TRANSFORMER_ONLY
    main = transformer - _MAIN_SET_BY_LM
    depformer = {f"depformer_{k}" for k in transformer - _DEP_SET_BY_LM}
    return frozenset(own | main | depformer)


LM_CONFIG_KEYS: frozenset[str] = _lm_config_keys()
"""Keys of ``config.json`` merged over the preset: what moshi 0.2.13's ``LMModel`` takes as configuration
(its keywords and the transformer keywords it forwards; ``dim``, ``num_layers``, ``context``, ``delays``,
``depformer_num_layers`` ...)."""


class CheckpointConfigError(ValueError):
    """A checkpoint's ``config.json`` cannot be used; raised before any weight file is read or downloaded.
    The message names the file, the key and what is allowed."""


@dataclass
class CheckpointPlan:
    """What to load, decided from the preset and ``config.json`` alone (nothing downloaded but the JSON).

    Attributes:
        names: ``{"moshi_name": ..., "mimi_name": ..., "tokenizer_name": ..., "mimi_config_name": ...}``, a
            file of the checkpoint or ``hf://<owner>/<repo>/<file>`` (``mimi_config_name`` may be None).
        lm_kwargs: ``LMModel`` keywords: the preset's with the accepted keys of ``config.json`` over them;
            ``dep_q`` is the depformer steps the checkpoint stores.
        prequantized: ``"quantize": true``, a Kyutai ``-q8`` checkpoint (int8 weights, fp32 ``weight_scb``).
        taken: keys of ``config.json`` merged into ``lm_kwargs`` (sorted).
        ignored: keys read as metadata or dropped as moshi drops them (sorted).
    """

    names: dict[str, str | None]
    lm_kwargs: dict[str, Any]
    prequantized: bool = False
    taken: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


def _type_error(where: str, key: str, value: Any, allowed: str) -> CheckpointConfigError:
    return CheckpointConfigError(
        f"{where}: {key!r} is {value!r} ({type(value).__name__}); allowed: {allowed}"
    )


def _check_type(where: str, key: str, value: Any, preset_value: Any) -> None:
    """The value's JSON type must be the preset's (ints for floats are fine); keys the preset does not set,
    or sets to None, are left to ``LMModel`` (:func:`check_lm_kwargs`)."""
    if preset_value is None:
        return
    if isinstance(preset_value, bool):
        ok, allowed = isinstance(value, bool), "true or false"
    elif isinstance(preset_value, int):
        ok, allowed = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif isinstance(preset_value, float):
        ok, allowed = isinstance(value, int | float) and not isinstance(value, bool), "a number"
    elif isinstance(preset_value, str):
        ok, allowed = isinstance(value, str), "a string"
    elif isinstance(preset_value, list):
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        allowed = "a list of integers"
    else:
        return
    if not ok:
        raise _type_error(where, key, value, f"{allowed} (the preset has {preset_value!r})")


def resolve_checkpoint_config(
    config: Mapping[str, Any] | None, preset: ModelPreset, *, where: str = "config.json"
) -> CheckpointPlan:
    """Merge a checkpoint's ``config.json`` (None: the repo has none) over ``preset`` by the module's rule.

    Args:
        config: the parsed ``config.json``, or None.
        preset: the preset the runtime was asked for; its ``lm_kwargs`` are the starting point.
        where: how to name the file in errors (e.g. ``"nvidia/personaplex-7b-v1 config.json"``).
    Returns:
        The plan; ``lm_kwargs`` are not yet checked against ``LMModel`` (:func:`check_lm_kwargs`).
    Raises:
        CheckpointConfigError: not a JSON object, an unknown key, a value of the wrong type, LoRA or
            conditioning, or ``n_q``/``card`` other than the preset's.
    """
    names: dict[str, str | None] = dict(FILE_NAME_KEYS)
    lm_kwargs = dict(preset.lm_kwargs)
    plan = CheckpointPlan(names, lm_kwargs)
    if config is None:
        return plan
    if not isinstance(config, Mapping):
        raise CheckpointConfigError(f"{where}: expected a JSON object, got {type(config).__name__}")
    for key in sorted(config):
        value = config[key]
        if key in FILE_NAME_KEYS:
            if not (isinstance(value, str) and value) and not (key == "mimi_config_name" and value is None):
                raise _type_error(
                    where, key, value, "a file name of the checkpoint, or hf://<owner>/<repo>/<file>"
                )
            names[key] = value
        elif key == "quantize":
            if not isinstance(value, bool):
                raise _type_error(where, key, value, 'true (a Kyutai "-q8" checkpoint) or false')
            plan.prequantized = value
        elif key in METADATA_KEYS or key in DEPRECATED_KEYS:
            plan.ignored.append(key)
        elif key in LORA_KEYS:
            if (key == "lora" and value) or (key == "lora_name" and value):
                raise CheckpointConfigError(
                    f"{where}: {key!r} is {value!r}: the runtime applies no LoRA adapter; allowed: "
                    '"lora": false and no "lora_name" (fuse the adapter into the LM weights first)'
                )
            plan.ignored.append(key)
        elif key in ("conditioners", "fuser"):
            if value:
                raise CheckpointConfigError(
                    f"{where}: {key!r} is set: conditioned LMs (moshi's condition_provider/fuser) are not "
                    "served by this runtime; allowed: no conditioners and no fuser"
                )
            plan.ignored.append(key)
        else:
            target = RENAMED_KEYS.get(key, key)
            if target not in LM_CONFIG_KEYS:
                raise CheckpointConfigError(
                    f"{where}: unknown key {key!r}; allowed: the LMModel keys of moshi 0.2.13 "
                    f"({', '.join(sorted(LM_CONFIG_KEYS))}), the file names ({', '.join(FILE_NAME_KEYS)}), "
                    f'"quantize", and the metadata keys ({", ".join(sorted(METADATA_KEYS))})'
                )
            _check_type(where, key, value, preset.lm_kwargs.get(target))
            if target in PRESET_FIXED_KEYS and value != preset.lm_kwargs[target]:
                raise CheckpointConfigError(
                    f"{where}: {key!r} is {value!r}, but the {preset.name} preset has {target}="
                    f"{preset.lm_kwargs[target]!r}; the runtime's Mimi and codebook layout are built for it "
                    f"(allowed: {preset.lm_kwargs[target]!r})"
                )
            lm_kwargs[target] = value
            plan.taken.append(target)
    dep_q = lm_kwargs.get("dep_q")
    if not isinstance(dep_q, int) or isinstance(dep_q, bool) or dep_q < 1:
        raise _type_error(
            where, "dep_q", dep_q, "an integer >= 1 (the depformer steps the checkpoint stores)"
        )
    plan.taken.sort()
    plan.ignored.sort()
    return plan


def check_lm_kwargs(
    lm_kwargs: Mapping[str, Any], *, quantize: bool, dtype: torch.dtype, where: str = "config.json"
) -> LMModel:
    """Build ``LMModel(**lm_kwargs)`` on the meta device (no memory, no download): the skeleton the weights
    are later assigned into.

    Raises:
        CheckpointConfigError: ``LMModel`` refuses the keywords (a value it cannot use, e.g. ``delays`` of
            the wrong length); the message carries moshi's own error.
    """
    try:
        with torch.device("meta"):
            return LMModel(device="meta", dtype=dtype, quantize=quantize, **lm_kwargs)
    except (TypeError, ValueError, AssertionError, KeyError, RuntimeError) as exc:
        raise CheckpointConfigError(
            f"{where}: moshi 0.2.13's LMModel cannot be built from the preset merged with it "
            f"({type(exc).__name__}: {exc})"
        ) from exc
