"""The capacity planner's memory table for moshi-7b at INT8, pinned to figures worked by hand (issue 25).

The planner's other tests compare it with itself (``memory_plan`` against ``models.py``'s formulas); here
every figure was worked out from the model's configuration (``MOSHI_7B_LM`` and ``MIMI`` in
``runtime/engine/model_presets.py``, moshi 0.2.13 ``loaders.py``), the GPUs' driver-reported memory
(``infra/capacity/gpus.py``: L40S 46068 MiB, A100 80 GB 81920 MiB) and the planner's stated assumptions
(``infra/capacity/memory.py``: CUDA context 0.5 GiB, allocator overhead 5 %, headroom 10 %), then written
here as literals. Units: B = bytes, GB = 10**9 B, GiB = 2**30 B.

LM parameters (moshi-7b: dim 4096, 32 layers, 32 heads, hidden_scale 4.125, SiLU gating, RMS norms; depformer
dim 1024, 6 layers, 16 heads, dff int(4.125 x 1024) = 4224, 8 steps with weights per step, multi-linear
input; n_q 16, dep_q 8, card 2048, text_card 32000; no biases, no layer scale):

- temporal layer: gating hidden = 2 x 16896 // 3 = 11264 (dff 16896 != 4 x 4096, moshi's gating rule);
  linears in_proj 4096 x 12288 + out_proj 4096 x 4096 + gating in 4096 x 22528 + gating out 11264 x 4096
  = 205,520,896; x 32 layers = 6,576,668,672; output rows 32 x 43008 = 1,376,256.
- text head 4096 x 32000 = 131,072,000 (32000 rows); depformer input 8 x 4096 x 1024 = 33,554,432 (8192
  rows); depformer layers 6 x 8 x (1024 x 3072 + 1024 x 1024 + 1024 x 5632 + 2816 x 1024) = 616,562,688
  (gating hidden 2 x 4224 // 3 = 2816; 516,096 rows); output heads 8 x 1024 x 2048 = 16,777,216 (16384 rows).
- linear weights 7,374,635,008, rows 1,948,928; embeddings 16 x 2049 x 4096 + 32001 x 4096 + 7 x 2049 x
  1024 + 32001 x 1024 = 312,815,616; norms 32 x 2 x 4096 + 4096 + 6 x 2 x 1024 = 278,528.
  Total 7,687,729,152 parameters (the "about 7.69 B").

LM weights at INT8 (moshi's LLM.int8: every nn.Linear int8 with one fp32 scale per output row; embeddings
and norms stay 16-bit, fp16): 7,374,635,008 x 1 + 1,948,928 x 4 + (312,815,616 + 278,528) x 2
= 8,008,619,008 B (8.009 GB).

Mimi weights (fp32, as moshi's server runs it; the planner holds the 32 x 2048 x 256 codebooks twice):
params 79,308,609 (SEANet encoder 12,628,256 + decoder 14,724,641 + two transformers 2 x 8 x 3,148,800
+ quantizer projections 524,288 + downsample 512 x 512 x 4 + channel-wise upsample 512 x 4), codebook
buffers 32 x (2048 x 256 + 2048 + 1) = 16,842,784, codebooks again 16,777,216:
4 x 112,928,609 = 451,714,436 B. Shared = 8,460,333,444 B.

Per slot (KV at fp16 under INT8: moshi gives the KV cache the dtype of a QLinear's compute, 2 B):

- temporal KV cache: 2 (K, V) x 32 layers x 3000 context x 4096 x 2 B = 1,572,864,000 B (1.5729 GB,
  1.4648 GiB); doubled under CFG: 3,145,728,000 B.
- depformer KV: 2 x 6 layers x 8 positions x 1024 x 2 B = 196,608 B.
- Mimi streaming state, fp32: conv buffers (encoder 11,526 + decoder 12,672 elements: c_in x (k - stride)
  per convolution, c_out x (k - stride) per transposed one) + encoder and decoder transformer KV rings
  2 x 2 x 8 layers x 250 x 512 = 4,096,000: 4 x 4,120,198 = 16,480,792 B.
- LMGen token cache: int64 (16 + 1) x (1 + 2) = 408 B.
- activations, the planner's upper bound at 2 B: temporal 32 x ((6 x 4096 + 3 x 11264) x 2 + 32 x 3000 x 4
  + 3000) = 16,119,552; depformer 8 x 6 x ((6 x 1024 + 3 x 2816) x 2 + 16 x 8 x 4) = 1,425,408; logits
  4 x (32000 + 8 x 2048) = 193,536; Mimi, each convolution's output and its ELU in fp32, 4 x 2 x the sum of
  c_out x t_out over every convolution for one 1920-sample frame (encoder 546,304 + decoder 547,712)
  = 8,752,128; total 26,490,624 B (doubled under CFG).
- audio frames in and out: 2 x 1920 x 4 = 15,360 B.
- total: 1,616,047,792 B per slot (1.616 GB); 3,215,599,024 B under CFG.

Sessions that fit: usable = memory - int(10 % of memory); room = usable - 0.5 GiB - shared x 1.05;
sessions = floor(room / (per slot x 1.05)).

- L40S: 46068 MiB = 48,305,799,168 B; usable 43,475,219,252; room 34,054,998,223.8; / 1,696,850,181.6
  = 20.07 -> 20 sessions (10.09 -> 10 with CFG). Without the KV cache it would read 751.
- A100 80 GB (SXM4 and PCIe both 81920 MiB = 85,899,345,920 B): usable 77,309,411,328; room
  67,889,190,299.8 / 1,696,850,181.6 = 40.009 -> 40 sessions. Without the KV cache: 1497.
"""

from __future__ import annotations

import pytest

from infra.capacity.memory import lm_weight_bytes, mimi_weight_bytes
from infra.capacity.models import get_model
from infra.capacity.plan import plan
from infra.capacity.units import GiB

LM_INT8_WEIGHT_BYTES = 8_008_619_008
MIMI_WEIGHT_BYTES = 451_714_436
KV_PER_SLOT_BYTES = 1_572_864_000
PER_SLOT_BYTES = 1_616_047_792
PER_SLOT_CFG_BYTES = 3_215_599_024
SLOT_LINES = {
    "KV cache, temporal transformer": KV_PER_SLOT_BYTES,
    "KV cache, depformer": 196_608,
    "Mimi streaming state": 16_480_792,
    "LMGen token cache": 408,
    "Activations (upper bound)": 26_490_624,
    "Audio frame buffers": 15_360,
}


def test_moshi_7b_int8_weights_are_the_hand_worked_bytes() -> None:
    """7,687,729,152 LM parameters; INT8 weights 8,008,619,008 B and Mimi's 451,714,436 B (module
    docstring).

    Planted bug: ``lm_weight_bytes`` storing int8 weights without their fp32 row scales (``t.linear * 1``
    alone) — fails on it (8,000,823,296 B)."""
    spec = get_model("moshi-7b")
    assert spec.lm_tally.total == 7_687_729_152
    assert lm_weight_bytes(spec, "int8") == LM_INT8_WEIGHT_BYTES
    assert mimi_weight_bytes(spec) == MIMI_WEIGHT_BYTES
    shared = plan("moshi-7b", "l40s", "int8").memory
    assert shared.shared_bytes == LM_INT8_WEIGHT_BYTES + MIMI_WEIGHT_BYTES == 8_460_333_444


@pytest.mark.parametrize(
    ("gpu", "usable", "sessions", "required_at_sessions"),
    [
        ("l40s", 43_475_219_252, 20, 43_357_224_660),
        ("a100-80gb-sxm", 77_309_411_328, 40, 77_294_228_292),
        ("a100-80gb-pcie", 77_309_411_328, 40, 77_294_228_292),
    ],
)
def test_per_slot_kv_total_and_sessions_are_the_hand_worked_figures(
    gpu: str, usable: int, sessions: int, required_at_sessions: int
) -> None:
    """moshi-7b INT8 (KV fp16): 1,572,864,000 B of temporal KV cache per slot (1.4648 GiB), 1,616,047,792 B
    per slot in all, and 20 sessions on an L40S, 40 on an A100 80 GB (module docstring); at that many
    sessions the node needs required = 0.5 GiB + (shared + sessions x per slot) x 1.05 B (rounded down),
    and one more session does not fit.

    Planted bug: ``memory_plan`` leaving the KV cache out of the per-slot total (``slot_b`` summed over
    every line but "KV cache, temporal transformer") — fails on it (per slot 43,183,792 B; 751 sessions on
    the L40S)."""
    p = plan("moshi-7b", gpu, "int8", sessions)
    m = p.memory
    assert p.config.kv_precision == "fp16"
    lines = {line.name: line.bytes for line in m.per_slot}
    assert lines == SLOT_LINES
    assert lines["KV cache, temporal transformer"] / GiB == pytest.approx(1.4648, abs=1e-4)
    assert m.per_slot_bytes == PER_SLOT_BYTES
    assert m.usable_bytes == usable
    assert m.max_sessions == sessions
    assert p.verdict.max_sessions_by_memory == sessions
    assert m.required_bytes == pytest.approx(required_at_sessions, abs=1)  # int() of a x1.05 product
    assert m.fits
    over = plan("moshi-7b", gpu, "int8", sessions + 1).memory
    assert not over.fits
    assert over.required_bytes - m.required_bytes == pytest.approx(PER_SLOT_BYTES * 1.05, abs=1)


def test_cfg_doubles_the_kv_cache_and_halves_the_sessions_on_an_l40s() -> None:
    """Under CFG each slot runs two LM rows: temporal KV 3,145,728,000 B, per slot 3,215,599,024 B, 10
    sessions on an L40S (module docstring).

    Planted bug: ``memory_plan`` ignoring CFG for the temporal KV cache (``rows`` left out of its line) —
    fails on it."""
    m = plan("moshi-7b", "l40s", "int8", 1, cfg=True).memory
    lines = {line.name: line.bytes for line in m.per_slot}
    assert lines["KV cache, temporal transformer"] == 2 * KV_PER_SLOT_BYTES == 3_145_728_000
    assert m.per_slot_bytes == PER_SLOT_CFG_BYTES
    assert m.max_sessions == 10
