"""INT8 weights through moshi's own path (``moshi/utils/quantize.py``, bitsandbytes LLM.int8) on the CPU with
the tiny preset: what is quantised, the planner's figures against the real tensors, streaming, isolation,
Kyutai's ``-q8`` layout, and the refusals."""

from __future__ import annotations

import copy
import json
import sys

import numpy as np
import pytest
import torch
from moshi.utils.quantize import QLinear
from pydantic import ValidationError
from safetensors import safe_open
from test_engine import FakeClock

from infra.capacity.gpus import activation_precision
from infra.capacity.memory import lm_weight_bytes
from infra.capacity.models import get_model
from infra.capacity.units import BYTES_PER_ELEMENT
from runtime.config import RuntimeConfig
from runtime.engine.batch import UNGENERATED_TOKEN, BatchEngine, SlotPhase
from runtime.engine.models import (
    LM_Q8_WEIGHTS_FILE,
    MIMI_WEIGHTS_FILE,
    TEXT_TOKENIZER_FILE,
    ModelBundle,
    QuantizationError,
    build_tiny,
    check_int8_support,
    load_checkpoint,
    load_model,
    write_checkpoint,
)
from runtime.engine.sampling import SamplingParams

pytest.importorskip("bitsandbytes")

SLOTS = 4
TICKS = 30


@pytest.fixture(scope="module")
def tiny_int8() -> ModelBundle:
    return build_tiny(seed=0, quantize="int8")


def _tokens(bundle: ModelBundle, joins: dict[int, int], leaves: dict[int, int]) -> dict[int, list[tuple]]:
    """Greedy tokens of each slot over TICKS ticks of noise input, slots joining/leaving at given ticks."""
    rng = np.random.default_rng(3)
    audio = (rng.standard_normal((SLOTS, TICKS, 1920)) * 0.1).astype(np.float32)
    engine = BatchEngine(copy.deepcopy(bundle), SLOTS, clock=FakeClock())
    out: dict[int, list[tuple]] = {s: [] for s in range(SLOTS)}
    for t in range(TICKS):
        for slot, at in joins.items():
            if at == t:
                engine.join(slot, SamplingParams.greedy())
        for slot, at in leaves.items():
            if at == t:
                engine.leave(slot)
        pcm = np.zeros((SLOTS, 1920), dtype=np.float32)
        for slot in joins:
            if engine.phase(slot) is SlotPhase.LIVE:
                pcm[slot] = audio[slot, len(out[slot]) % TICKS]
        result = engine.tick(pcm)
        for slot in range(SLOTS):
            if result.text_tokens[slot] != UNGENERATED_TOKEN:
                out[slot].append((int(result.text_tokens[slot]), *map(int, result.audio_tokens[slot])))
    return out


def test_every_linear_layer_is_int8_and_the_rest_fp16_mimi_fp32(tiny_int8) -> None:
    lm = tiny_int8.lm
    assert not any(isinstance(m, torch.nn.Linear) for m in lm.modules())
    qlinears = [m for m in lm.modules() if isinstance(m, QLinear)]
    assert len(qlinears) > 10
    for q in qlinears:
        assert q.weight.dtype == torch.int8 and q.weight_scb.dtype == torch.float32
        assert q.weight_scb.shape == (q.weight.shape[0],)  # one scale per output row
    others = {p.dtype for n, p in lm.named_parameters() if p.dtype != torch.int8 and "weight_scb" not in n}
    assert others == {torch.float16}
    assert {p.dtype for p in tiny_int8.mimi.parameters()} == {torch.float32}
    assert tiny_int8.quantize == "int8"


def test_parameter_bytes_equal_the_planner_figure(tiny_int8) -> None:
    spec = get_model("tiny")
    assert tiny_int8.lm_parameter_bytes() == lm_weight_bytes(spec, "int8")
    float_bytes = sum(p.nbytes for p in build_tiny(seed=0, dtype=torch.float16).lm.parameters())
    assert float_bytes == lm_weight_bytes(spec, "fp16")
    assert tiny_int8.lm_parameter_bytes() < float_bytes  # the tiny LM is mostly (fp16) embeddings


def test_kv_cache_is_fp16_and_sized_as_the_planner_says(tiny_int8) -> None:
    engine = BatchEngine(copy.deepcopy(tiny_int8), SLOTS, clock=FakeClock())
    states = engine.bundle.lm.transformer.get_streaming_state()
    caches = [s.kv_cache.cache for s in states.values() if getattr(s, "kv_cache", None) is not None]
    assert {c.dtype for c in caches} == {torch.float16}
    kv_b = BYTES_PER_ELEMENT[activation_precision("int8")]
    assert sum(c.nbytes for c in caches) == SLOTS * get_model("tiny").temporal_kv_elements_per_slot() * kv_b


def test_int8_streams_and_a_greedy_session_is_identical_alone_and_in_a_busy_batch(tiny_int8) -> None:
    alone = _tokens(tiny_int8, {0: 0}, {})
    busy = _tokens(tiny_int8, {0: 0, 1: 2, 2: 0, 3: 5}, {2: 12, 3: 20})
    assert len(alone[0]) >= TICKS - 3
    assert busy[0] == alone[0]
    assert len(busy[1]) > 10 and busy[1] != busy[0][: len(busy[1])]
    assert len({t[0] for t in alone[0]} | {t[1] for t in alone[0]}) > 2  # not a constant stream


def test_a_float_checkpoint_is_quantised_at_load_as_the_tiny_build_is(tiny_int8, tmp_path) -> None:
    write_checkpoint(build_tiny(seed=0, dtype=torch.float16), tmp_path / "fp16")
    loaded = load_checkpoint(str(tmp_path / "fp16"), "tiny", quantize="int8")
    assert loaded.quantize == "int8"
    reference = tiny_int8.lm.state_dict()
    got = loaded.lm.state_dict()
    assert set(got) == set(reference)
    for key, tensor in reference.items():
        assert torch.equal(got[key], tensor), key


def test_kyutai_q8_layout_is_written_and_loaded(tiny_int8, tmp_path) -> None:
    directory = write_checkpoint(tiny_int8, tmp_path / "q8")
    config = json.loads((directory / "config.json").read_text())
    assert config["quantize"] is True and config["moshi_name"] == LM_Q8_WEIGHTS_FILE
    with safe_open(str(directory / LM_Q8_WEIGHTS_FILE), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("transformer.layers.0.self_attn.in_projs.0.weight").dtype == torch.int8
        assert f.get_tensor("transformer.layers.0.self_attn.in_projs.0.weight_scb").dtype == torch.float32
    assert "depformer.layers.0.self_attn.in_projs.7.weight_scb" in keys  # per-step, as Kyutai's export
    loaded = load_checkpoint(str(directory), "tiny", quantize="int8")
    for key, tensor in tiny_int8.lm.state_dict().items():
        assert torch.equal(loaded.lm.state_dict()[key], tensor), key
    assert _tokens(loaded, {1: 0}, {})[1] == _tokens(tiny_int8, {1: 0}, {})[1]
    with pytest.raises(QuantizationError, match="holds INT8 weights.*DUPLEX_QUANTIZE=int8"):
        load_checkpoint(str(directory), "tiny")


def test_q8_config_pointing_at_the_bf16_repo_for_mimi_and_tokenizer(tiny_int8, tmp_path, monkeypatch) -> None:
    """Kyutai's -q8 config.json names Mimi and the text tokenizer as hf://<bf16 repo>/<file>."""
    directory = write_checkpoint(tiny_int8, tmp_path / "q8")
    bf16 = tmp_path / "bf16-repo"
    bf16.mkdir()
    config = json.loads((directory / "config.json").read_text())
    for key, name in (("mimi_name", MIMI_WEIGHTS_FILE), ("tokenizer_name", TEXT_TOKENIZER_FILE)):
        (directory / name).rename(bf16 / name)
        config[key] = f"hf://kyutai/moshiko-pytorch-bf16/{name}"
    (directory / "config.json").write_text(json.dumps(config))
    asked: list[tuple[str, str]] = []

    def download(repo_id: str, filename: str, **_: object) -> str:
        asked.append((repo_id, filename))
        return str(bf16 / filename)

    monkeypatch.setattr("huggingface_hub.hf_hub_download", download)
    loaded = load_checkpoint(str(directory), "tiny", quantize="int8")
    assert sorted(asked) == sorted(
        [
            ("kyutai/moshiko-pytorch-bf16", MIMI_WEIGHTS_FILE),
            ("kyutai/moshiko-pytorch-bf16", TEXT_TOKENIZER_FILE),
        ]
    )
    assert loaded.quantize == "int8"


def test_refusals_name_what_to_change(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if not installed
    with pytest.raises(QuantizationError, match=r"needs bitsandbytes \(bitsandbytes>=0.45,<0.50"):
        check_int8_support("cpu")
    with pytest.raises(QuantizationError, match="not installed"):
        load_model("tiny", quantize="int8")
    monkeypatch.undo()

    def broken(self, x):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(QLinear, "forward", broken)
    with pytest.raises(QuantizationError, match=r"cannot run LLM.int8 on cpu \(RuntimeError: no kernel"):
        check_int8_support("cpu")
    monkeypatch.undo()
    if not torch.cuda.is_available():
        with pytest.raises(QuantizationError, match="torch sees no CUDA device"):
            check_int8_support("cuda")
    check_int8_support("cpu")  # the real kernels run here


def test_runtime_setting_is_typed_and_checked_against_the_dtype() -> None:
    assert RuntimeConfig(quantize="int8").quantize == "int8"
    assert RuntimeConfig().quantize == "none"
    with pytest.raises(ValidationError, match="none"):
        RuntimeConfig(quantize="int4")
    with pytest.raises(ValidationError, match="DUPLEX_DTYPE=bfloat16 cannot apply"):
        RuntimeConfig(quantize="int8", dtype="bfloat16")
    assert RuntimeConfig(quantize="int8", dtype="float16").dtype == "float16"


@pytest.mark.parametrize("quantize", ["int8", None])
def test_duplex_quantize_reaches_the_model_the_server_serves(quantize, monkeypatch) -> None:
    """``DUPLEX_QUANTIZE=int8`` followed through the path ``duplex serve`` takes: ``cli._config()`` reads the
    environment into a ``RuntimeConfig``, ``cli.build_server`` loads the model through
    ``RuntimeConfig.load_model_bundle`` and wraps it in the slots the server ticks; the LM those slots run
    has moshi ``QLinear`` layers (int8 weights, one fp32 scale per row) and no float ``nn.Linear``. Without
    the variable (quantize ``none``) the same path serves plain ``nn.Linear`` and no ``QLinear``.

    Planted bug: ``RuntimeConfig.load_model_bundle`` passing ``quantize="none"`` to ``load_model`` instead
    of ``quantize=self.quantize`` (a node asked for INT8 silently serves float weights) — fails on it."""
    from runtime.tools.cli import _config, build_server

    monkeypatch.setenv("DUPLEX_AUTH_MODE", "off")  # no signing keys needed to build the server
    monkeypatch.setenv("DUPLEX_MODEL", "tiny")
    monkeypatch.delenv("DUPLEX_DTYPE", raising=False)
    if quantize is None:
        monkeypatch.delenv("DUPLEX_QUANTIZE", raising=False)
    else:
        monkeypatch.setenv("DUPLEX_QUANTIZE", quantize)
    config = _config(max_sessions=2)
    assert config.quantize == (quantize or "none")
    server = build_server(config)
    lm = server.backend.engine.bundle.lm
    qlinears = [m for m in lm.modules() if isinstance(m, QLinear)]
    linears = [m for m in lm.modules() if isinstance(m, torch.nn.Linear)]
    if quantize == "int8":
        assert len(qlinears) > 10, "DUPLEX_QUANTIZE=int8 served an LM without moshi QLinear layers"
        assert linears == [], f"{len(linears)} float nn.Linear layers left in an INT8 LM"
        assert {q.weight.dtype for q in qlinears} == {torch.int8}
        assert server.backend.bundle.quantize == "int8"
    else:
        assert qlinears == []
        assert len(linears) > 10
        assert {m.weight.dtype for m in linears} == {torch.float32}  # the CPU default dtype
        assert server.backend.bundle.quantize == "none"
