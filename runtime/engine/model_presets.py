"""Model configurations the runtime knows by name: the real 7B ones and the CPU-sized ``tiny`` preset.

A preset is the keyword set that moshi's own classes are built from (``moshi.models.lm.LMModel`` and
``moshi.models.loaders.get_mimi``). Nothing here imports torch, so the capacity planner and the CLI can
read these figures without the runtime's heavy dependencies.

Sources:
- ``MOSHI_7B_LM``: ``moshi/models/loaders.py::_lm_kwargs`` in moshi 0.2.13 (Kyutai's Moshi 7B).
- ``PERSONAPLEX_7B_LM``: the same backbone with ``dep_q=16`` (NVIDIA/personaplex ``moshi/models/loaders.py``,
  ``get_moshi_lm`` sets ``lm_kwargs["dep_q"] = 16``).
- ``MIMI``: ``moshi/models/loaders.py::_mimi_config`` in moshi 0.2.13.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

SAMPLE_RATE_HZ = 24_000
"""Mimi's audio sample rate (Hz), both directions."""
FRAME_RATE_HZ = 12.5
"""Model frames per second: one LM step per 80 ms frame."""
FRAME_SAMPLES = 1920
"""PCM samples per frame: 24000 Hz / 12.5 Hz."""
FRAME_MS = 80.0
"""Duration of one frame in milliseconds: the tick budget."""

NVIDIA_SINE_TOKENS = (430, 1268, 381, 1611, 1095, 1495, 56, 472)
"""The user stream's frame at every step of a PersonaPlex persona prompt: Mimi codes of NVIDIA's 440 Hz
tone (NVIDIA/personaplex ``moshi/moshi/models/lm.py`` ``SINE_TOKENS``, line 57)."""
NVIDIA_SILENCE_TOKENS = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)
"""The agent's silence frame in a PersonaPlex persona prompt (NVIDIA/personaplex
``moshi/moshi/models/lm.py`` ``SILENCE_TOKENS``, line 56)."""

DEFAULT_TEXT_PROMPT = (
    "You are a wise and friendly teacher. Answer questions or provide advice in a clear and engaging way."
)
"""NVIDIA's default text prompt (NVIDIA/personaplex ``moshi/moshi/offline.py`` ``--text-prompt`` and its web
client's ``DEFAULT_TEXT_PROMPT``): a PersonaPlex session that gives none gets it
(``DUPLEX_DEFAULT_TEXT_PROMPT``)."""
DEFAULT_VOICE_PROMPT = "NATF2"
"""The default voice of a PersonaPlex node (``DUPLEX_DEFAULT_VOICE``; NVIDIA's README runs ``NATF2.pt``)."""

_DELAYS_7B = [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]

MOSHI_7B_LM: dict[str, Any] = {
    "dim": 4096,
    "text_card": 32000,
    "existing_text_padding_id": 3,
    "n_q": 16,
    "dep_q": 8,
    "card": 2048,
    "num_heads": 32,
    "num_layers": 32,
    "hidden_scale": 4.125,
    "causal": True,
    "layer_scale": None,
    "context": 3000,
    "max_period": 10000,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_dim": 1024,
    "depformer_dim_feedforward": int(4.125 * 1024),
    "depformer_num_heads": 16,
    "depformer_num_layers": 6,
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_context": 8,
    "depformer_max_period": 10000,
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "delays": list(_DELAYS_7B),
}

PERSONAPLEX_7B_LM: dict[str, Any] = {**MOSHI_7B_LM, "dep_q": 16, "delays": list(_DELAYS_7B)}

# The tiny preset keeps the audio codebook structure of the 7B (n_q 16, dep_q 8, card 2048, the same
# delays, weights per depformer step) and shrinks every width, depth and context. Its text vocabulary is
# that of its own tokenizer (256 pieces, trained by runtime.engine.models.train_tiny_text_tokenizer).
TINY_TEXT_VOCAB = 256
TINY_LM: dict[str, Any] = {
    **MOSHI_7B_LM,
    "text_card": TINY_TEXT_VOCAB,
    "dim": 128,
    "num_heads": 4,
    "num_layers": 2,
    "context": 250,
    "depformer_dim": 64,
    "depformer_dim_feedforward": 128,
    "depformer_num_heads": 2,
    "depformer_num_layers": 1,
    "delays": list(_DELAYS_7B),
}

MIMI: dict[str, Any] = {
    "sample_rate": SAMPLE_RATE_HZ,
    "channels": 1,
    "frame_rate": FRAME_RATE_HZ,
    "seanet": {
        "channels": 1,
        "dimension": 512,
        "causal": True,
        "n_filters": 64,
        "n_residual_layers": 1,
        "activation": "ELU",
        "compress": 2,
        "dilation_base": 2,
        "disable_norm_outer_blocks": 0,
        "kernel_size": 7,
        "residual_kernel_size": 3,
        "last_kernel_size": 3,
        "norm": "none",
        "pad_mode": "constant",
        "ratios": [8, 6, 5, 4],
        "true_skip": True,
    },
    "quantizer": {"dimension": 256, "n_q": 32, "bins": 2048, "input_dimension": 512, "output_dimension": 512},
    "transformer": {
        "d_model": 512,
        "num_heads": 8,
        "num_layers": 8,
        "causal": True,
        "layer_scale": 0.01,
        "context": 250,
        "conv_layout": True,
        "max_period": 10000,
        "gating": "none",
        "norm": "layer_norm",
        "positional_embedding": "rope",
        "dim_feedforward": 2048,
        "input_dimension": 512,
        "output_dimensions": [512],
    },
}


def _tiny_mimi() -> dict[str, Any]:
    """Mimi with the real strides (hop 960 at 25 Hz, downsampled to 12.5 Hz: 1920-sample frames),
    tiny widths."""
    cfg = copy.deepcopy(MIMI)
    dim = 32
    cfg["seanet"].update({"dimension": dim, "n_filters": 4})
    cfg["quantizer"].update({"dimension": 16, "n_q": 8, "input_dimension": dim, "output_dimension": dim})
    cfg["transformer"].update(
        {
            "d_model": dim,
            "num_heads": 2,
            "num_layers": 1,
            "dim_feedforward": 64,
            "input_dimension": dim,
            "output_dimensions": [dim],
        }
    )
    return cfg


TINY_MIMI: dict[str, Any] = _tiny_mimi()


@dataclass(frozen=True)
class ModelPreset:
    """A named model configuration.

    Attributes:
        name: preset name used on the CLI and in node profiles.
        lm_kwargs: keyword arguments of ``moshi.models.lm.LMModel``.
        mimi_config: the ``mimi_config`` dict of ``moshi.models.loaders.get_mimi``.
        default_source: Hugging Face repo id holding the real weights, or None when the preset has
            random weights (``tiny``).
        checkpoint_dep_q: depformer steps stored in the preset's checkpoints (16 for PersonaPlex);
            the runtime may build fewer (see ``runtime.engine.models.adapt_depformer_steps``).
        gated: whether ``default_source`` is gated on the Hugging Face Hub (a download needs a token of an
            account that accepted the model's licence; its model card says so).
        nvidia_prompt_frames: persona prompts use NVIDIA's constant frames at every step
            (:data:`NVIDIA_SINE_TOKENS` for the user, :data:`NVIDIA_SILENCE_TOKENS` for agent silence), as
            PersonaPlex was trained and as NVIDIA's server feeds them; False: the engine's own Mimi encoding
            of a 440 Hz sine and of silence, cycled (a model with another codec, where NVIDIA's codes mean
            nothing). True for ``personaplex-7b`` and for ``tiny`` (and ``sim``), which keep its codebook
            structure (8 codebooks of 2048 entries), so that the tests pin NVIDIA's sequence.
        persona_required: a session never goes live without a voice and a text prompt: the node's default
            voice and text prompt fill in what a session leaves out (NVIDIA's server always runs both;
            ``personaplex-7b`` only).
    """

    name: str
    lm_kwargs: dict[str, Any]
    mimi_config: dict[str, Any]
    default_source: str | None
    checkpoint_dep_q: int
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    gated: bool = False
    nvidia_prompt_frames: bool = False
    persona_required: bool = False


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(
        "tiny",
        TINY_LM,
        TINY_MIMI,
        None,
        8,
        "random weights, seeded; 7B codebook structure with small dims; runs on a CPU",
        nvidia_prompt_frames=True,
    ),
    # A simulator for load tests (runtime/engine/sim.py): tiny's models for the tokenizer and voice prompts,
    # and a
    # SimEngine that sleeps the step time (DUPLEX_SIM_STEP_MS) instead of running them. Never a default.
    "sim": ModelPreset(
        "sim",
        TINY_LM,
        TINY_MIMI,
        None,
        8,
        "SIMULATED model for load tests: step time from DUPLEX_SIM_STEP_MS, a tone as audio; not for serving",
        extra={"simulated": True},
        nvidia_prompt_frames=True,
    ),
    "moshi-7b": ModelPreset(
        "moshi-7b", MOSHI_7B_LM, MIMI, "kyutai/moshiko-pytorch-bf16", 8, "Kyutai Moshi 7B (Moshiko voice)"
    ),
    "personaplex-7b": ModelPreset(
        "personaplex-7b",
        PERSONAPLEX_7B_LM,
        MIMI,
        "nvidia/personaplex-7b-v1",
        16,
        "NVIDIA PersonaPlex-7B-v1 (gated on the Hub: accept the licence, set HF_TOKEN)",
        gated=True,
        nvidia_prompt_frames=True,
        persona_required=True,
    ),
}


def check_preset_name(name: str) -> str:
    """Return ``name`` if it is a preset (for config validators).

    Raises:
        ValueError: unknown name; the message lists the allowed ones.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(sorted(PRESETS))}")
    return name


def get_preset(name: str) -> ModelPreset:
    """Return the preset called ``name``.

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
        ) from None


SERVED_DEPFORMER_STEPS = 8
"""Depformer steps the runtime builds at most: the agent's 8 codebooks (Mimi's 8 of the 7B models).
PersonaPlex's checkpoints store 16 (the user's 8 after the agent's); ``load_checkpoint`` keeps the first 8,
which leaves ``n_q - dep_q = 8`` user codebooks reaching the LM from the caller's audio (NVIDIA/personaplex
PR 103 argues the output is unchanged; ``runtime.engine.models.adapt_depformer_steps``)."""


def served_depformer_steps(preset: ModelPreset) -> int:
    """Depformer steps of ``preset`` as ``duplex serve`` builds it: ``min(checkpoint steps, 8)``
    (:data:`SERVED_DEPFORMER_STEPS`); 8 for ``personaplex-7b`` (16 stored), ``moshi-7b`` and ``tiny``."""
    return min(int(preset.lm_kwargs["dep_q"]), SERVED_DEPFORMER_STEPS)


def served_lm_kwargs(preset: ModelPreset) -> dict[str, Any]:
    """``LMModel`` keyword arguments of ``preset`` as served: the preset's, with
    ``dep_q = served_depformer_steps(preset)`` (a copy; the preset is left as is)."""
    return {**copy.deepcopy(preset.lm_kwargs), "dep_q": served_depformer_steps(preset)}
