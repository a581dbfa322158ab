"""Tests that kill mutants of infra/capacity/memory.py that the capacity tests let survive
(``make mutation MODULE=infra/capacity/memory.py``; docs/mutation.md). Each docstring names its mutants."""

from __future__ import annotations

import dataclasses

import pytest

from infra.capacity.gpus import get_gpu
from infra.capacity.memory import activation_bytes_per_slot, lm_weight_bytes, memory_plan
from infra.capacity.models import get_model

DEFAULTED = ("hidden_scale", "depformer_dim", "depformer_dim_feedforward")


def with_lm(name: str, **lm: object):
    """Preset ``name`` with its LM config changed (a key set to None is removed)."""
    model = get_model(name)
    merged = {**model.lm, **lm}
    return dataclasses.replace(model, lm={k: v for k, v in merged.items() if v is not None})


def test_a_config_without_widths_takes_moshis_defaults():
    """Kills ``activation_bytes_per_slot``: the defaults ``hidden_scale`` 4 (-> None, left out, 5),
    ``depformer_dim`` 256 (-> None, left out, 257), and the feed-forward width's fallback
    ``lm.get("depformer_dim_feedforward") or int(hidden_scale * d)`` (``get(None)``, the key's name changed,
    ``int(None)``, ``/ d``, ``get(None, 4)``, ``get("hidden_scale", None)``, ``get(4)``): every preset sets
    these keys, so only a config without them reaches the defaults."""
    bare = with_lm("tiny", **dict.fromkeys(DEFAULTED))
    explicit = with_lm("tiny", hidden_scale=4, depformer_dim=256, depformer_dim_feedforward=4 * 256)
    assert activation_bytes_per_slot(bare, 2) == activation_bytes_per_slot(explicit, 2)


def test_the_configured_depformer_feedforward_width_counts():
    """Kills ``activation_bytes_per_slot``: ``depformer_dim_feedforward or ...`` -> ``and`` (the configured
    width would be replaced by ``hidden_scale x depformer_dim``)."""
    narrow = with_lm("tiny", depformer_dim_feedforward=128)
    wide = with_lm("tiny", depformer_dim_feedforward=1024)
    assert activation_bytes_per_slot(wide, 2) > activation_bytes_per_slot(narrow, 2)


# ------------------------------------------------------------------------------------------------------
# memory_plan's table, its totals and lm_weight_bytes (survivors of the whole-module run)
# ------------------------------------------------------------------------------------------------------

MOSHI = get_model("moshi-7b")
L40S = get_gpu("l40s")

MOSHI_INT8_TABLE = [
    ("LM weights", 8008619008, False, "7.69 B params at int8, counted once"),
    ("Mimi weights", 451714436, False, "fp32 params + codebooks (held twice)"),
    ("KV cache, temporal transformer", 1572864000, True, "2 x 32 layers x 3000 x 4096 x 2 B"),
    ("KV cache, depformer", 196608, True, "2 x 6 layers x dep_q 8 x 1024 x 2 B"),
    ("Mimi streaming state", 16480792, True, "conv buffers + encoder/decoder transformer KV rings, fp32"),
    ("LMGen token cache", 408, True, "int64 tokens, (n_q+1) x (max delay+2)"),
    ("Activations (upper bound)", 26490624, True, "every intermediate of one tick"),
    ("Audio frame buffers", 15360, True, "one 80 ms frame in and out, fp32 PCM"),
]


def table(plan):
    return [(x.name, x.bytes, x.per_slot, x.note) for x in plan.shared + plan.per_slot]


def test_the_memory_table_of_moshi_int8_is_pinned_line_by_line():
    """Kills ``memory_plan``: every line's name, ``per_slot`` flag and note (the operator reads them in
    ``duplex capacity``), the KV lines' ``rows`` (1 without CFG), ``kv_b``, and the audio buffers (2 x
    1920 samples x 4 B = 15 360 B, worked by hand). The KV line by hand: 2 x 32 layers x 3000 x 4096 x
    2 B = 1 572 864 000 B."""
    assert table(memory_plan(MOSHI, L40S, "int8", "bf16", 4)) == MOSHI_INT8_TABLE


def test_cfg_doubles_the_kv_and_activation_lines_and_says_so():
    """Kills ``rows = 2 if cfg else 1`` (-> 3, ``1 if cfg``), ``cfg_note`` (its text, ``if cfg`` negated)
    and ``rows *`` on the activations: the other lines do not change."""
    plain = table(memory_plan(MOSHI, L40S, "int8", "bf16", 4))
    cfg = table(memory_plan(MOSHI, L40S, "int8", "bf16", 4, cfg=True))
    doubled = {"KV cache, temporal transformer", "KV cache, depformer", "Activations (upper bound)"}
    for (name, size, per_slot, note), line in zip(plain, cfg, strict=True):
        if name in doubled:
            suffix = " x2 (CFG)" if name.startswith("KV") else ""
            assert line == (name, 2 * size, per_slot, note + suffix)
        else:
            assert line == (name, size, per_slot, note)


def test_the_depformer_note_takes_moshis_defaults():
    """Kills the depformer KV note's defaults ``get('depformer_num_layers', 2)`` and ``get('depformer_dim',
    256)`` (-> 3, 257, None, left out)."""
    bare = with_lm("tiny", depformer_num_layers=None, depformer_dim=None)
    note = next(
        x.note for x in memory_plan(bare, L40S, "fp32", "fp32", 1).per_slot if x.name == "KV cache, depformer"
    )
    assert note.startswith("2 x 2 layers x dep_q ") and " x 256 x 4 B" in note


def test_lm_weight_bytes_per_precision_by_hand():
    """Kills ``lm_weight_bytes``: each precision name (``"fp32"``, ``"bf16"``, ``"fp16"``, ``"int8"``,
    ``"fp8"``, ``"int4"``), the 16-bit embeddings under quantisation (``emb_b`` 2), INT8's per-row fp32
    scales (``linear_rows x 4``), INT4's 0.5 B per weight and a 4 B scale per 128 weights, and the refusal's
    text. By hand from the tally (7 374 635 008 linear weights, 1 948 928 linear rows, 312 815 616
    embedding and 278 528 other elements)."""
    t = MOSHI.lm_tally
    assert (t.linear, t.linear_rows, t.embedding, t.other) == (7374635008, 1948928, 312815616, 278528)
    total = t.linear + t.embedding + t.other
    rest16 = (t.embedding + t.other) * 2
    assert lm_weight_bytes(MOSHI, "fp32") == 4 * total
    assert lm_weight_bytes(MOSHI, "bf16") == lm_weight_bytes(MOSHI, "fp16") == 2 * total == 15375458304
    assert lm_weight_bytes(MOSHI, "int8") == t.linear + 4 * t.linear_rows + rest16 == 8008619008
    assert lm_weight_bytes(MOSHI, "fp8") == t.linear + rest16 == 8000823296
    assert lm_weight_bytes(MOSHI, "int4") == int(t.linear / 2 + t.linear / 128 * 4 + rest16) == 4543963136
    with pytest.raises(ValueError) as info:
        lm_weight_bytes(MOSHI, "int3")
    assert str(info.value) == "precision: unknown value 'int3'"


def test_totals_fits_and_shortfall_at_the_largest_batch():
    """Kills ``memory_plan``'s totals: ``required = context + (shared + sessions x per slot) x (1 +
    overhead)``, ``room``, ``max_sessions`` (``floor``, ``max(0, ...)``), ``fits`` (``<=`` -> ``<``),
    ``shortfall_bytes`` (``max(0, required - usable)``), the defaults (0.5 GiB context, 5 % overhead,
    10 % headroom), the byte and GB properties: the largest batch fits, one more does not."""
    plan = memory_plan(MOSHI, L40S, "int8", "bf16", 1)
    total = L40S.memory_bytes
    assert plan.gpu_memory_bytes == total and plan.headroom_bytes == int(total * 0.10)
    assert plan.usable_bytes == total - int(total * 0.10)
    assert plan.cuda_context_bytes == 2**29 and plan.allocator_overhead == 0.05
    shared = sum(x[1] for x in MOSHI_INT8_TABLE if not x[2])
    slot = sum(x[1] for x in MOSHI_INT8_TABLE if x[2])
    assert (plan.shared_bytes, plan.per_slot_bytes) == (shared, slot)
    n = plan.max_sessions
    assert n == 20
    at = memory_plan(MOSHI, L40S, "int8", "bf16", n)
    over = memory_plan(MOSHI, L40S, "int8", "bf16", n + 1)
    assert at.required_bytes == int(2**29 + (shared + n * slot) * 1.05)
    assert at.fits and at.shortfall_bytes == 0 and at.sessions == n
    assert not over.fits and over.shortfall_bytes == over.required_bytes - over.usable_bytes > 0
    assert at.required_gb == at.required_bytes / 1e9
    assert at.shared[0].gb == 8.008619008


def test_a_gpu_too_small_for_the_weights_fits_no_session():
    """Kills ``max(0, floor(room / ...))`` -> ``max(1, ...)`` or ``min``: a 16 GB T4 cannot hold moshi-7b's
    bf16 weights (15.4 GB) with its headroom, so no session fits, not a negative count."""
    plan = memory_plan(MOSHI, get_gpu("t4"), "bf16", "bf16", 1)
    assert plan.max_sessions == 0 and not plan.fits
    assert plan.shortfall_bytes == plan.required_bytes - plan.usable_bytes


def test_the_callers_context_overhead_and_headroom_count():
    """Kills the keyword arguments not passed on: ``cuda_context_bytes``, ``allocator_overhead`` and
    ``headroom`` given by the caller replace the defaults in every total."""
    plan = memory_plan(
        MOSHI, L40S, "int8", "bf16", 2, cuda_context_bytes=10**9, allocator_overhead=0.0, headroom=0.0
    )
    assert plan.headroom_bytes == 0 and plan.usable_bytes == L40S.memory_bytes
    assert plan.required_bytes == 10**9 + plan.shared_bytes + 2 * plan.per_slot_bytes
    room = L40S.memory_bytes - 10**9 - plan.shared_bytes
    assert plan.max_sessions == room // plan.per_slot_bytes


def test_the_depformer_fallbacks_read_hidden_scale_layers_and_heads():
    """Kills ``activation_bytes_per_slot``: the feed-forward fallback's ``hidden_scale`` key (``get(None,
    4)``, renamed: a config with ``hidden_scale`` 2 and no ``depformer_dim_feedforward`` is not read as 4)
    and the defaults ``depformer_num_layers`` 2 and ``depformer_num_heads`` 8 (-> 3, 9, None, left out)."""
    narrow = with_lm("tiny", hidden_scale=2, depformer_dim_feedforward=None)
    assert activation_bytes_per_slot(narrow, 2) == activation_bytes_per_slot(
        with_lm("tiny", hidden_scale=2, depformer_dim_feedforward=2 * narrow.lm["depformer_dim"]), 2
    )
    bare = with_lm("tiny", depformer_num_layers=None, depformer_num_heads=None)
    explicit = with_lm("tiny", depformer_num_layers=2, depformer_num_heads=8)
    assert activation_bytes_per_slot(bare, 2) == activation_bytes_per_slot(explicit, 2)


def test_a_plan_that_exactly_fills_the_gpu_fits():
    """Kills ``fits=required <= usable`` -> ``<``: with no overhead and no headroom, a CUDA context sized so
    that two sessions need exactly the GPU's memory fits, with no shortfall."""
    two = memory_plan(MOSHI, L40S, "int8", "bf16", 2, allocator_overhead=0.0, headroom=0.0)
    context = L40S.memory_bytes - two.shared_bytes - 2 * two.per_slot_bytes
    exact = memory_plan(
        MOSHI, L40S, "int8", "bf16", 2, cuda_context_bytes=context, allocator_overhead=0.0, headroom=0.0
    )
    assert exact.required_bytes == exact.usable_bytes and exact.fits and exact.shortfall_bytes == 0
    assert exact.max_sessions == 2
