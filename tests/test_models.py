"""Model loading: the tiny preset, the real checkpoint layout, PersonaPlex's 16-step depformer."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime.engine.model_presets import TINY_LM, get_preset
from runtime.engine.models import (
    LM_WEIGHTS_FILE,
    ModelBundle,
    adapt_depformer_steps,
    build_tiny,
    checkpoint_depformer_steps,
    load_checkpoint,
    load_model,
    write_checkpoint,
)


@pytest.fixture(scope="module")
def tiny() -> ModelBundle:
    return build_tiny(seed=0)


def _tiny_with_depformer_steps(steps: int, seed: int = 5) -> ModelBundle:
    """The tiny preset with ``steps`` depformer steps (16 = PersonaPlex's layout)."""
    from moshi.models.lm import LMModel

    bundle = build_tiny(seed=seed)
    lm = LMModel(**{**TINY_LM, "dep_q": steps}).eval()
    torch.manual_seed(seed)
    bundle.lm = lm
    return bundle


def test_tiny_keeps_the_7b_codebook_structure(tiny: ModelBundle) -> None:
    lm = tiny.lm
    assert (lm.n_q, lm.dep_q, lm.card) == (16, 8, 2048)
    assert tiny.mimi.frame_size == 1920
    assert tiny.mimi.sample_rate == 24000
    assert tiny.mimi.frame_rate == 12.5
    assert tiny.mimi.num_codebooks == 8


def test_tiny_weights_are_a_function_of_the_seed(tiny: ModelBundle) -> None:
    same = build_tiny(seed=0).lm.state_dict()
    other = build_tiny(seed=1).lm.state_dict()
    for key, value in tiny.lm.state_dict().items():
        assert torch.equal(value, same[key]), key
    assert any(not torch.equal(v, other[k]) for k, v in tiny.lm.state_dict().items())


def test_checkpoint_round_trip_through_the_real_layout(tiny: ModelBundle, tmp_path: Path) -> None:
    write_checkpoint(tiny, tmp_path)
    stored = load_file(str(tmp_path / LM_WEIGHTS_FILE))
    # Real checkpoints store the depformer attention projections stacked, not per step.
    assert "depformer.layers.0.self_attn.in_proj_weight" in stored
    assert not any(".in_projs." in k for k in stored)
    loaded = load_checkpoint(str(tmp_path), "tiny", dtype=torch.float32)
    original = tiny.lm.state_dict()
    for key, value in loaded.lm.state_dict().items():
        assert torch.equal(value, original[key]), key
    for key, value in loaded.mimi.state_dict().items():
        assert torch.equal(value, tiny.mimi.state_dict()[key]), key
    assert loaded.text_tokenizer.encode("hello world") == tiny.text_tokenizer.encode("hello world")


def test_load_model_reads_a_directory_for_a_named_preset(tiny: ModelBundle, tmp_path: Path) -> None:
    write_checkpoint(tiny, tmp_path)
    bundle = load_model("tiny", weights=str(tmp_path))
    assert bundle.source == str(tmp_path)
    assert bundle.lm.dep_q == 8


def test_missing_file_names_it(tiny: ModelBundle, tmp_path: Path) -> None:
    write_checkpoint(tiny, tmp_path)
    (tmp_path / LM_WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=LM_WEIGHTS_FILE):
        load_checkpoint(str(tmp_path), "tiny")


def test_weights_of_another_shape_are_refused_with_the_keys(tiny: ModelBundle, tmp_path: Path) -> None:
    write_checkpoint(tiny, tmp_path, with_config=False)
    # Without config.json the preset's architecture is expected: the 7B one does not fit tiny weights.
    with pytest.raises(ValueError, match="do not match the moshi-7b configuration"):
        load_checkpoint(str(tmp_path), "moshi-7b", dtype=torch.float32)


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known presets: moshi-7b, personaplex-7b, sim, tiny"):
        get_preset("moshi-13b")


def test_personaplex_checkpoint_is_cut_to_the_agent_codebooks(tmp_path: Path) -> None:
    """A 16-step (PersonaPlex) checkpoint loads as an 8-step depformer: steps 0..7 are the stored ones."""
    sixteen = _tiny_with_depformer_steps(16)
    write_checkpoint(sixteen, tmp_path)
    assert checkpoint_depformer_steps(load_file(str(tmp_path / LM_WEIGHTS_FILE))) == 16
    loaded = load_checkpoint(str(tmp_path), "personaplex-7b", dtype=torch.float32)
    assert loaded.lm.dep_q == 8
    original = sixteen.lm.state_dict()
    got = loaded.lm.state_dict()
    for step in range(8):
        for key in (
            f"depformer_in.{step}.weight",
            f"linears.{step}.weight",
            f"depformer.layers.0.self_attn.in_projs.{step}.weight",
            f"depformer.layers.0.self_attn.out_projs.{step}.weight",
            f"depformer.layers.0.gating.{step}.linear_in.weight",
        ):
            assert torch.equal(got[key], original[key]), key
    assert "linears.8.weight" not in got


def test_eight_step_checkpoint_grows_by_copying_steps(tiny: ModelBundle, tmp_path: Path) -> None:
    """NVIDIA's loader fills steps 8..15 from 0..7 when a checkpoint has 8; so does ours when asked."""
    state = {k: v for k, v in tiny.lm.state_dict().items()}
    from runtime.engine.models import _stack_attention_projections

    grown = adapt_depformer_steps(_stack_attention_projections(state), 16)
    assert checkpoint_depformer_steps(grown) == 16
    assert torch.equal(grown["linears.11.weight"], state["linears.3.weight"])
    stacked = grown["depformer.layers.0.self_attn.in_proj_weight"]
    per_step = stacked.view(16, -1, stacked.shape[-1])
    assert torch.equal(per_step[9], state["depformer.layers.0.self_attn.in_projs.1.weight"])


def test_adapt_refuses_impossible_step_counts(tiny: ModelBundle) -> None:
    state = copy.copy(tiny.lm.state_dict())
    with pytest.raises(ValueError, match=">= 1"):
        adapt_depformer_steps(state, 0)
    with pytest.raises(ValueError, match="at most x2"):
        adapt_depformer_steps(state, 17)
    with pytest.raises(ValueError, match="not a Moshi-architecture"):
        checkpoint_depformer_steps({"foo.weight": torch.zeros(1)})
