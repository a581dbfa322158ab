"""The published repos load as published (issue 30, items 1 and 2).

Each repo's layout is rebuilt in ``tmp_path`` with its real file names and its real ``config.json`` (or none),
at the tiny preset's dimensions, and loaded through the code a user runs: ``RuntimeConfig`` ->
``load_model_bundle`` (what ``duplex serve --model M --weights DIR`` and the engine process call), once from
a directory and once by repo id with ``huggingface_hub.hf_hub_download`` stubbed to serve the same files.

- ``nvidia/personaplex-7b-v1``: ``model.safetensors`` with a 16-step depformer, the Mimi and SentencePiece
  files, ``voices.tgz``, and ``config.json`` = ``{"model_type": "personaplex", "version": "7b-v1"}``.
- ``kyutai/moshiko-pytorch-bf16`` and ``kyutai/moshika-pytorch-bf16``: the same three files, no
  ``config.json`` (moshi 0.2.13 ``loaders.MOSHI_NAME``, ``MIMI_NAME``, ``TEXT_TOKENIZER_NAME``).
- ``kyutai/moshiko-pytorch-q8`` and ``moshika``: ``model.q8.safetensors`` as Kyutai's February 2025 export
  stored it (every linear an int8 ``weight`` + fp32 ``weight_scb``, attention projections stacked:
  kyutai-labs/moshi ba92f01 ``quantize_transformer``), and a ``config.json`` of that time: the LM keywords of
  ``loaders._lm_kwargs`` at ba92f01/fbd6cdd, ``"depformer_causal": true`` among them, the file names and
  ``"quantize": true`` (``scripts/export_quantized.py`` at fbd6cdd/10dca86). The exact published file could
  not be read here; this is the closest reconstruction from Kyutai's history (the ``hf://`` variant of the
  names, which the fbd6cdd export writes, is taken too).

Dimensions are the tiny preset's: the 7B presets are replaced, for the test, by copies with tiny widths.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from moshi.models.lm import LMModel
from safetensors.torch import load_file, save_file

from runtime.config import RuntimeConfig
from runtime.engine import models
from runtime.engine.model_presets import PRESETS, TINY_LM, TINY_MIMI, ModelPreset
from runtime.engine.models import (
    LM_Q8_WEIGHTS_FILE,
    LM_WEIGHTS_FILE,
    MIMI_WEIGHTS_FILE,
    TEXT_TOKENIZER_FILE,
    ModelBundle,
    QuantizationError,
    _seed_parameters,
    _stack_attention_projections,
    build_tiny,
)

PERSONAPLEX_REPO = "nvidia/personaplex-7b-v1"
MOSHIKO_REPO = "kyutai/moshiko-pytorch-bf16"
MOSHIKA_REPO = "kyutai/moshika-pytorch-bf16"
MOSHIKO_Q8_REPO = "kyutai/moshiko-pytorch-q8"
MOSHIKA_Q8_REPO = "kyutai/moshika-pytorch-q8"

PERSONAPLEX_CONFIG = {"model_type": "personaplex", "version": "7b-v1"}
"""``nvidia/personaplex-7b-v1/config.json`` as published (issue 30, item 1)."""

KYUTAI_Q8_CONFIG_2025_02: dict[str, Any] = {
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
    "depformer_dim_feedforward": 4224,
    "depformer_num_heads": 16,
    "depformer_num_layers": 6,
    "depformer_causal": True,
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_context": 8,
    "depformer_max_period": 10000,
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "delays": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
    "moshi_name": LM_Q8_WEIGHTS_FILE,
    "mimi_name": MIMI_WEIGHTS_FILE,
    "tokenizer_name": TEXT_TOKENIZER_FILE,
    "quantize": True,
}
"""The ``-q8`` repos' ``config.json`` as reconstructed from kyutai-labs/moshi (``loaders._lm_kwargs`` at
ba92f01, key order kept; the export script's ``moshi_name`` and ``"quantize": true``)."""

_TINY_DIMENSIONS = ("text_card", "dim", "num_heads", "num_layers", "context", "depformer_dim")
_TINY_DIMENSIONS += ("depformer_dim_feedforward", "depformer_num_heads", "depformer_num_layers")


def _tiny(config: dict[str, Any]) -> dict[str, Any]:
    """A published config with the tiny preset's widths, depths and context; other values as published."""
    return {**config, **{k: TINY_LM[k] for k in _TINY_DIMENSIONS}}


@pytest.fixture
def tiny_7b_presets(monkeypatch: pytest.MonkeyPatch) -> None:
    """``moshi-7b`` and ``personaplex-7b`` with tiny widths (same names, repos and step counts)."""
    for name, steps in (("moshi-7b", 8), ("personaplex-7b", 16)):
        real = PRESETS[name]
        tiny = ModelPreset(
            name,
            {**TINY_LM, "dep_q": steps},
            TINY_MIMI,
            real.default_source,
            real.checkpoint_dep_q,
            real.description,
            gated=real.gated,
        )
        monkeypatch.setitem(PRESETS, name, tiny)


@pytest.fixture(scope="module")
def tiny_bundle() -> ModelBundle:
    return build_tiny(seed=3)


def _lm(steps: int, seed: int) -> LMModel:
    lm = LMModel(**{**TINY_LM, "dep_q": steps}).eval()
    _seed_parameters(lm, seed)
    return lm


def _write_common(bundle: ModelBundle, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in bundle.mimi.state_dict().items()}, str(directory / MIMI_WEIGHTS_FILE)
    )
    (directory / TEXT_TOKENIZER_FILE).write_bytes(bundle.text_tokenizer.serialized_model_proto())


def _write_float_lm(lm: LMModel, directory: Path) -> None:
    state = {k: v.detach().contiguous() for k, v in lm.state_dict().items()}
    save_file(_stack_attention_projections(state), str(directory / LM_WEIGHTS_FILE))


def _voices_tgz(directory: Path) -> None:
    """A ``voices.tgz`` of ``<NAME>.pt`` files as NVIDIA ships it (contents not the loader's business)."""
    with tarfile.open(directory / "voices.tgz", "w:gz") as tar:
        data = b"not read by the model loader"
        info = tarfile.TarInfo("voices/NATF2.pt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def personaplex_repo(bundle: ModelBundle, directory: Path, config: Any = PERSONAPLEX_CONFIG) -> LMModel:
    """``nvidia/personaplex-7b-v1``: 16-step LM, Mimi, tokenizer, ``voices.tgz``, metadata ``config.json``."""
    lm = _lm(16, seed=11)
    _write_common(bundle, directory)
    _write_float_lm(lm, directory)
    _voices_tgz(directory)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return lm


def kyutai_bf16_repo(bundle: ModelBundle, directory: Path, seed: int) -> LMModel:
    """``kyutai/moshi{ko,ka}-pytorch-bf16``: 8-step LM, Mimi, tokenizer; no ``config.json``."""
    lm = _lm(8, seed=seed)
    _write_common(bundle, directory)
    _write_float_lm(lm, directory)
    return lm


def kyutai_q8_repo(int8: ModelBundle, directory: Path, config: dict[str, Any]) -> None:
    """``kyutai/moshi{ko,ka}-pytorch-q8``: ``model.q8.safetensors`` stacked as the February 2025 export
    stored it, Mimi, tokenizer, the ``config.json`` of that time."""
    _write_common(int8, directory)
    state = {k: v.detach().cpu().contiguous() for k, v in int8.lm.state_dict().items()}
    save_file(_stack_attention_projections(state), str(directory / LM_Q8_WEIGHTS_FILE))
    (directory / "config.json").write_text(json.dumps(config, indent=2))


class StubHub:
    """``huggingface_hub.hf_hub_download`` serving ``{repo id: directory}``; records what was fetched."""

    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = repos
        self.fetched: list[tuple[str, str]] = []

    def __call__(self, repo_id: str, filename: str, **_: Any) -> str:
        from huggingface_hub.errors import EntryNotFoundError

        self.fetched.append((repo_id, filename))
        path = self.repos[repo_id] / filename
        if not path.is_file():
            raise EntryNotFoundError(f"404 Client Error: Entry Not Found for url: {repo_id}/{filename}")
        return str(path)

    def names(self, repo_id: str) -> list[str]:
        return [name for repo, name in self.fetched if repo == repo_id]


def _served(repos: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> StubHub:
    hub = StubHub(repos)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", hub)
    return hub


def _load(**settings: Any) -> ModelBundle:
    """What ``duplex serve`` and the engine process do with the settings (``--model``, ``--weights``)."""
    return RuntimeConfig(**settings).load_model_bundle()


def _assert_agent_steps_of(loaded: ModelBundle, stored: LMModel) -> None:
    """The loaded LM is the stored one, cut to the 8 agent steps."""
    assert loaded.lm.dep_q == 8
    got, want = loaded.lm.state_dict(), stored.state_dict()
    for key in ("text_emb.weight", "transformer.layers.0.self_attn.in_projs.0.weight", "linears.7.weight"):
        assert torch.equal(got[key], want[key]), key
    for step in (0, 7):
        key = f"depformer.layers.0.self_attn.in_projs.{step}.weight"
        assert torch.equal(got[key], want[key]), key
    assert "linears.8.weight" not in got


# --- the layouts, from a directory and by repo id ---------------------------------------------------------


def test_personaplex_layout_loads_from_a_directory(tiny_7b_presets, tiny_bundle, tmp_path) -> None:
    stored = personaplex_repo(tiny_bundle, tmp_path / "personaplex")
    loaded = _load(model="personaplex-7b", weights=str(tmp_path / "personaplex"))
    _assert_agent_steps_of(loaded, stored)
    assert loaded.text_tokenizer.encode("hello") == tiny_bundle.text_tokenizer.encode("hello")
    assert loaded.mimi.num_codebooks == 8


def test_personaplex_layout_loads_by_repo_id_fetching_only_the_model_files(
    tiny_7b_presets, tiny_bundle, tmp_path, monkeypatch
) -> None:
    stored = personaplex_repo(tiny_bundle, tmp_path / "personaplex")
    hub = _served({PERSONAPLEX_REPO: tmp_path / "personaplex"}, monkeypatch)
    loaded = _load(model="personaplex-7b")  # the preset's default repo
    _assert_agent_steps_of(loaded, stored)
    assert hub.names(PERSONAPLEX_REPO) == [
        "config.json",
        LM_WEIGHTS_FILE,
        MIMI_WEIGHTS_FILE,
        TEXT_TOKENIZER_FILE,
    ]


@pytest.mark.parametrize(
    "repo, preset, seed", [(MOSHIKO_REPO, "moshi-7b", 21), (MOSHIKA_REPO, "moshi-7b", 22)]
)
def test_kyutai_bf16_layout_without_config_loads_by_repo_id(
    tiny_7b_presets, tiny_bundle, tmp_path, monkeypatch, repo, preset, seed
) -> None:
    stored = kyutai_bf16_repo(tiny_bundle, tmp_path / "repo", seed)
    hub = _served({repo: tmp_path / "repo"}, monkeypatch)
    loaded = _load(model=preset, weights=repo)
    _assert_agent_steps_of(loaded, stored)
    assert hub.names(repo) == ["config.json", LM_WEIGHTS_FILE, MIMI_WEIGHTS_FILE, TEXT_TOKENIZER_FILE]


def test_kyutai_bf16_layout_without_config_loads_from_a_directory(
    tiny_7b_presets, tiny_bundle, tmp_path
) -> None:
    stored = kyutai_bf16_repo(tiny_bundle, tmp_path / "moshiko", 21)
    loaded = _load(model="moshi-7b", weights=str(tmp_path / "moshiko"))
    _assert_agent_steps_of(loaded, stored)


@pytest.fixture(scope="module")
def tiny_int8() -> ModelBundle:
    pytest.importorskip("bitsandbytes")
    return build_tiny(seed=4, quantize="int8")


def _q8_config(names_in: str | None) -> dict[str, Any]:
    config = _tiny(KYUTAI_Q8_CONFIG_2025_02)
    if names_in is not None:  # fbd6cdd's export: Mimi and tokenizer named in the bf16 repo
        config["mimi_name"] = f"hf://{names_in}/{MIMI_WEIGHTS_FILE}"
        config["tokenizer_name"] = f"hf://{names_in}/{TEXT_TOKENIZER_FILE}"
    return config


@pytest.mark.parametrize("repo", [MOSHIKO_Q8_REPO, MOSHIKA_Q8_REPO])
def test_kyutai_q8_layout_with_its_2025_config_loads_as_int8_from_a_directory(
    tiny_7b_presets, tiny_int8, tmp_path, repo
) -> None:
    kyutai_q8_repo(tiny_int8, tmp_path / "q8", _q8_config(None))
    loaded = _load(model="moshi-7b", weights=str(tmp_path / "q8"), quantize="int8")
    assert loaded.quantize == "int8"
    want = tiny_int8.lm.state_dict()
    got = loaded.lm.state_dict()
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


def test_kyutai_q8_layout_loads_by_repo_id_with_mimi_from_the_bf16_repo(
    tiny_7b_presets, tiny_int8, tmp_path, monkeypatch
) -> None:
    kyutai_q8_repo(tiny_int8, tmp_path / "q8", _q8_config(MOSHIKO_REPO))
    hub = _served({MOSHIKO_Q8_REPO: tmp_path / "q8", MOSHIKO_REPO: tmp_path / "q8"}, monkeypatch)
    loaded = _load(model="moshi-7b", weights=MOSHIKO_Q8_REPO, quantize="int8")
    assert loaded.quantize == "int8"
    assert hub.names(MOSHIKO_Q8_REPO) == ["config.json", LM_Q8_WEIGHTS_FILE]
    assert hub.names(MOSHIKO_REPO) == [MIMI_WEIGHTS_FILE, TEXT_TOKENIZER_FILE]


def test_kyutai_q8_without_int8_is_refused_before_the_weights_are_fetched(
    tiny_7b_presets, tiny_int8, tmp_path, monkeypatch
) -> None:
    kyutai_q8_repo(tiny_int8, tmp_path / "q8", _q8_config(None))
    hub = _served({MOSHIKO_Q8_REPO: tmp_path / "q8"}, monkeypatch)
    with pytest.raises(QuantizationError, match="holds INT8 weights.*DUPLEX_QUANTIZE=int8"):
        _load(model="moshi-7b", weights=MOSHIKO_Q8_REPO)
    assert hub.names(MOSHIKO_Q8_REPO) == ["config.json"]
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # a machine without bitsandbytes
    with pytest.raises(QuantizationError, match="not installed"):
        _load(model="moshi-7b", weights=MOSHIKO_Q8_REPO, quantize="int8")
    assert LM_Q8_WEIGHTS_FILE not in hub.names(MOSHIKO_Q8_REPO)


def test_keys_moshi_drops_are_dropped_as_moshi_drops_them(tiny_7b_presets, tiny_bundle, tmp_path) -> None:
    """moshi 0.2.13 ``get_moshi_lm``: ``depformer_causal`` dropped, ``lora*`` popped, ``demux_second_stream``
    renamed; the checkpoint then loads."""
    config = {
        **PERSONAPLEX_CONFIG,
        "depformer_causal": True,
        "lora": False,
        "lora_rank": 128,
        "lora_scaling": 2.0,
        "demux_second_stream": False,
        "lm_gen_config": {"temp": 0.7},
    }
    stored = personaplex_repo(tiny_bundle, tmp_path / "p", config=config)
    _assert_agent_steps_of(_load(model="personaplex-7b", weights=str(tmp_path / "p")), stored)


# --- configs that cannot be used: refused by name, before a weight is fetched -----------------------------

BAD_CONFIGS = [
    ({**PERSONAPLEX_CONFIG, "dim": "4096"}, r"'dim' is '4096' \(str\); allowed: an integer"),
    (
        {**PERSONAPLEX_CONFIG, "voice_prompt": "NATF2.pt"},
        r"unknown key 'voice_prompt'; allowed: the LMModel keys",
    ),
    ({"lora": True, "lora_name": "lora.safetensors"}, r"'lora' is True: the runtime applies no LoRA adapter"),
    ({"n_q": 8}, r"'n_q' is 8, but the personaplex-7b preset has n_q=16.*allowed: 16"),
    ({"delays": [0, 1, 1]}, r"LMModel cannot be built.*expected 17 delays, got 3"),
    ({"quantize": "yes"}, r"'quantize' is 'yes' \(str\); allowed: true"),
    (["model_type", "personaplex"], r"expected a JSON object, got list"),
]


@pytest.mark.parametrize("config, message", BAD_CONFIGS)
def test_a_config_that_cannot_be_used_fails_before_the_lm_weights_are_fetched(
    tiny_7b_presets, tiny_bundle, tmp_path, monkeypatch, config, message
) -> None:
    personaplex_repo(tiny_bundle, tmp_path / "p", config=config)
    hub = _served({PERSONAPLEX_REPO: tmp_path / "p"}, monkeypatch)
    with pytest.raises(ValueError, match=message) as raised:
        _load(model="personaplex-7b")
    assert type(raised.value).__name__ == "CheckpointConfigError"
    assert str(raised.value).startswith(f"{PERSONAPLEX_REPO} config.json: ")
    assert hub.names(PERSONAPLEX_REPO) == ["config.json"]


def test_a_bad_config_in_a_directory_reads_no_weight_file(
    tiny_7b_presets, tiny_bundle, tmp_path, monkeypatch
) -> None:
    personaplex_repo(tiny_bundle, tmp_path / "p", config={**PERSONAPLEX_CONFIG, "dim": 4096.5})
    read: list[str] = []

    def recording_load_file(path: str, **kwargs: Any) -> dict[str, torch.Tensor]:
        read.append(Path(path).name)
        return load_file(path, **kwargs)

    monkeypatch.setattr(models, "load_file", recording_load_file)
    with pytest.raises(ValueError, match=r"'dim' is 4096.5 \(float\)"):
        _load(model="personaplex-7b", weights=str(tmp_path / "p"))
    assert read == []
