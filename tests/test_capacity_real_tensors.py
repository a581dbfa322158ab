"""The planner's formulas against real moshi modules: streaming-state tensors of the tiny preset at batch B,
and parameter counts of the 7B configs built on the meta device (no weights)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
lm_mod = pytest.importorskip("moshi.models.lm")
loaders = pytest.importorskip("moshi.models.loaders")

from infra.capacity.memory import activation_bytes_per_slot  # noqa: E402
from infra.capacity.models import LM_PARTS, get_model  # noqa: E402
from runtime.engine.model_presets import MIMI, MOSHI_7B_LM, PERSONAPLEX_7B_LM, TINY_LM, TINY_MIMI  # noqa: E402


def _state_tensors(states: dict) -> list[tuple[str, torch.Tensor]]:
    """Every tensor reachable from a dict of moshi streaming states, each once, with its path."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()

    def walk(obj, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen:
                seen.add(id(obj))
                out.append((path, obj))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")
        elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module) and not callable(obj):
            for k, v in vars(obj).items():
                walk(v, f"{path}.{k}")

    for name, st in states.items():
        walk(st, name)
    return out


def _kv_bytes(tensors) -> int:
    return sum(t.nbytes for p, t in tensors if p.endswith("kv_cache.cache"))


@pytest.fixture(scope="module")
def tiny_lm():
    torch.manual_seed(0)
    return lm_mod.LMModel(**TINY_LM).eval()


@pytest.mark.parametrize("batch", [1, 3])
def test_temporal_kv_cache_is_exact(tiny_lm, batch):
    spec = get_model("tiny")
    gen = lm_mod.LMGen(tiny_lm, support_out_of_sync=True)
    with gen.streaming(batch):
        tensors = _state_tensors(tiny_lm.get_streaming_state())
        real = _kv_bytes(tensors)
    # the tiny model is fp32, so its KV cache is fp32
    assert real == batch * spec.temporal_kv_elements_per_slot() * 4
    assert real > 0


def test_kv_cache_doubles_under_cfg(tiny_lm):
    spec = get_model("tiny")
    gen = lm_mod.LMGen(tiny_lm, support_out_of_sync=True, cfg_coef=2.0, cfg_is_no_text=True)
    with gen.streaming(2):
        real = _kv_bytes(_state_tensors(tiny_lm.get_streaming_state()))
    assert real == 2 * 2 * spec.temporal_kv_elements_per_slot() * 4


def test_lmgen_token_cache_is_exact(tiny_lm):
    spec = get_model("tiny")
    gen = lm_mod.LMGen(tiny_lm, support_out_of_sync=True)
    with gen.streaming(3):
        st = gen._streaming_state
        assert st.cache.nbytes == 3 * spec.lmgen_token_elements_per_slot() * 8


def test_depformer_kv_cache_is_exact(tiny_lm):
    spec = get_model("tiny")
    with tiny_lm.depformer.streaming(3):
        real = _kv_bytes(_state_tensors(tiny_lm.depformer.get_streaming_state()))
    assert real == 3 * spec.depformer_kv_elements_per_slot() * 4


def test_kv_cache_half_precision_bytes_match(tiny_lm):
    """At bf16 the ring takes 2 bytes per element: the planner's per-precision figure."""
    spec = get_model("tiny")
    lm16 = lm_mod.LMModel(**TINY_LM, dtype=torch.bfloat16).eval()
    gen = lm_mod.LMGen(lm16, support_out_of_sync=True)
    with gen.streaming(2):
        real = _kv_bytes(_state_tensors(lm16.get_streaming_state()))
    assert real == 2 * spec.temporal_kv_elements_per_slot() * 2


@pytest.mark.parametrize("batch", [1, 4])
def test_mimi_state_is_exact(batch):
    spec = get_model("tiny")
    mimi = loaders.get_mimi(None, TINY_MIMI)
    with mimi.streaming(batch):
        codes = mimi.encode(torch.zeros(batch, 1, 1920))
        mimi.decode(codes)
        tensors = _state_tensors(mimi.get_streaming_state())
    ma = spec.mimi_arith
    kv = _kv_bytes(tensors)
    conv = sum(t.nbytes for p, t in tensors if p.endswith(".previous") or p.endswith(".partial"))
    assert kv == batch * ma.transformer_kv_elements_per_slot * 4
    assert conv == batch * ma.conv_state_elements_per_slot * 4
    bookkeeping = sum(t.nbytes for _, t in tensors) - kv - conv
    assert bookkeeping < 0.01 * (kv + conv)  # masks and offsets: negligible


def test_tiny_parameter_counts_by_module(tiny_lm):
    spec = get_model("tiny")
    for name, child in tiny_lm.named_children():
        expected = spec.lm_params[name].total if name in spec.lm_params else 0  # depformer_norms, extra_heads
        assert sum(p.numel() for p in child.parameters()) == expected, name
    mimi = loaders.get_mimi(None, TINY_MIMI)
    for name, child in mimi.named_children():
        assert sum(p.numel() for p in child.parameters()) == spec.mimi_arith.params_by_module[name], name
    assert sum(b.numel() for b in mimi.buffers()) == spec.mimi_arith.buffer_elements


@pytest.fixture(scope="module")
def meta_7b():
    # Weight initialisation is irrelevant to counting parameters: skip it (it dominates build time on meta).
    orig = lm_mod.LMModel._init_weights
    lm_mod.LMModel._init_weights = lambda self: None
    try:
        yield {
            "moshi-7b": lm_mod.LMModel(**MOSHI_7B_LM, device="meta"),
            # as served: the checkpoint's 16 depformer steps, the agent's 8 built (served_lm_kwargs)
            "personaplex-7b": lm_mod.LMModel(**{**PERSONAPLEX_7B_LM, "dep_q": 8}, device="meta"),
            "personaplex-7b stored": lm_mod.LMModel(**PERSONAPLEX_7B_LM, device="meta"),
        }
    finally:
        lm_mod.LMModel._init_weights = orig


@pytest.mark.parametrize("name", ["moshi-7b", "personaplex-7b"])
def test_7b_parameter_counts_by_part(meta_7b, name):
    lm = meta_7b[name]
    spec = get_model(name)
    children = {n: sum(p.numel() for p in c.parameters()) for n, c in lm.named_children()}
    for child, n in children.items():
        assert n == (spec.lm_params[child].total if child in spec.lm_params else 0), child
    parts = spec.part_params()
    for part, mods in LM_PARTS.items():
        assert parts[part] == sum(children[m] for m in mods)
    assert spec.lm_tally.total == sum(p.numel() for p in lm.parameters())
    linear = sum(m.weight.numel() for m in lm.modules() if isinstance(m, torch.nn.Linear))
    assert spec.lm_tally.linear == linear  # what moshi's INT8 quantises


def test_7b_totals_match_field_notes(meta_7b):
    """Served: PersonaPlex with the agent's 8 depformer steps is the 7B's size; stored: its checkpoint's 16
    steps, 8,371,408,896 parameters (the field notes' figure), counted on the meta device too."""
    assert get_model("moshi-7b").lm_tally.total == 7_687_729_152
    assert get_model("personaplex-7b").lm_tally.total == 7_687_729_152
    assert get_model("personaplex-7b").stored_lm_params == 8_371_408_896
    assert sum(p.numel() for p in meta_7b["personaplex-7b stored"].parameters()) == 8_371_408_896


def test_real_mimi_parameter_counts_on_meta():
    mimi = loaders.get_mimi(None, MIMI, device="meta")
    spec = get_model("moshi-7b")
    for name, child in mimi.named_children():
        assert sum(p.numel() for p in child.parameters()) == spec.mimi_arith.params_by_module[name], name
    assert sum(b.numel() for b in mimi.buffers()) == spec.mimi_arith.buffer_elements
    assert spec.part_params()["mimi"] == sum(p.numel() for p in mimi.parameters())


def test_real_mimi_state_on_meta_matches_field_notes():
    """Mimi state per slot at real size: about 16 MiB (FIELD-NOTES), exact against meta tensors."""
    mimi = loaders.get_mimi(None, MIMI, device="meta")
    ma = get_model("moshi-7b").mimi_arith
    with mimi.streaming(2):
        tensors = _state_tensors(mimi.get_streaming_state())
    kv = _kv_bytes(tensors)
    conv = sum(t.nbytes for p, t in tensors if p.endswith(".previous") or p.endswith(".partial"))
    assert kv == 2 * ma.transformer_kv_elements_per_slot * 4
    assert conv == 2 * ma.conv_state_elements_per_slot * 4
    per_slot = (kv + conv) / 2
    assert 15 * 2**20 < per_slot < 17 * 2**20


def test_activation_bound_is_small_next_to_kv():
    spec = get_model("moshi-7b")
    act = activation_bytes_per_slot(spec, 2)
    assert 0 < act < 0.05 * spec.temporal_kv_elements_per_slot() * 2
