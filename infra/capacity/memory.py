"""GPU memory of a node: shared weights (counted once) and per-slot caches, by precision.

``memory_plan`` gives the bytes of each part for a model, GPU, precision and batch size
(``lm_weight_bytes``, ``mimi_weight_bytes``, ``activation_bytes_per_slot`` are its pieces); element counts
come from ``models.py``. CUDA context, allocator overhead and headroom are planning assumptions
(``DEFAULT_*`` below) that a caller may override.

The formula of each part and its sources: docs/capacity.md, "GPU memory"."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from runtime.engine.model_presets import FRAME_SAMPLES

from .gpus import GpuSpec
from .models import ModelSpec, gating_hidden
from .units import BYTES_PER_ELEMENT, GB, GiB

DEFAULT_CUDA_CONTEXT_BYTES = int(0.5 * GiB)
"""CUDA context + cuBLAS/cuDNN workspaces of one PyTorch process (bytes). Assumption: typically 300-600 MiB
on CUDA 12 with lazy module loading."""
DEFAULT_ALLOCATOR_OVERHEAD = 0.05
"""Caching-allocator fragmentation and rounding, as a fraction of tensor bytes. Assumption."""
DEFAULT_HEADROOM = 0.10
"""Fraction of GPU memory kept free (spikes, graphs captured later, monitoring tools). Assumption."""


class MemoryLine(BaseModel):
    """One line of the memory table."""

    model_config = ConfigDict(frozen=True)

    name: str
    bytes: int
    per_slot: bool
    note: str = ""

    @property
    def gb(self) -> float:
        """Size in GB (10**9 bytes)."""
        return self.bytes / GB


class MemoryPlan(BaseModel):
    """Memory of one GPU running ``sessions`` slots.

    All sizes are bytes; ``*_gb`` fields are GB (10**9 bytes).
    """

    model_config = ConfigDict(frozen=True)

    gpu_memory_bytes: int
    headroom_bytes: int
    usable_bytes: int
    cuda_context_bytes: int
    allocator_overhead: float
    shared: list[MemoryLine]
    per_slot: list[MemoryLine]
    shared_bytes: int
    per_slot_bytes: int
    sessions: int
    required_bytes: int
    max_sessions: int
    fits: bool
    shortfall_bytes: int

    @property
    def required_gb(self) -> float:
        """Memory needed at ``sessions`` (GB)."""
        return self.required_bytes / GB


def lm_weight_bytes(model: ModelSpec, precision: str) -> int:
    """Bytes of the LM's weights stored at ``precision`` (see the module docstring for the INT8 split)."""
    t = model.lm_tally
    if precision in ("fp32", "bf16", "fp16"):
        w = BYTES_PER_ELEMENT[precision]
        return int(t.linear * w + t.embedding * w + t.other * w)
    emb_b = 2  # embeddings and norms stay in the model's 16-bit dtype (fp16 under moshi's INT8)
    if precision == "int8":
        lin: float = t.linear * 1 + t.linear_rows * 4
    elif precision == "fp8":
        lin = t.linear * 1
    elif precision == "int4":
        lin = t.linear * 0.5 + t.linear / 128 * 4
    else:
        raise ValueError(f"precision: unknown value {precision!r}")
    return int(lin + t.embedding * emb_b + t.other * emb_b)


def mimi_weight_bytes(model: ModelSpec) -> int:
    """Bytes of Mimi's fp32 parameters and buffers, codebooks counted twice (see module docstring)."""
    ma = model.mimi_arith
    q = model.mimi["quantizer"]
    codebook = q["n_q"] * q["bins"] * q["dimension"]
    return 4 * (ma.params + ma.buffer_elements + codebook)


def activation_bytes_per_slot(model: ModelSpec, act_bytes: float) -> int:
    """Upper bound of one slot's activations during a tick (bytes): see the module docstring."""
    lm = model.lm
    dim, layers, ctx, heads = model.dim, model.layers, model.context, model.heads
    hidden = gating_hidden(dim, int(lm.get("hidden_scale", 4) * dim))
    temporal = layers * ((6 * dim + 3 * hidden) * act_bytes + heads * ctx * 4 + ctx)
    d = lm.get("depformer_dim", 256)
    d_dff = lm.get("depformer_dim_feedforward") or int(lm.get("hidden_scale", 4) * d)
    d_hidden = gating_hidden(d, d_dff)
    dep_layers, dep_heads = lm.get("depformer_num_layers", 2), lm.get("depformer_num_heads", 8)
    depformer = model.dep_q * dep_layers * ((6 * d + 3 * d_hidden) * act_bytes + dep_heads * model.dep_q * 4)
    logits = 4 * (lm["text_card"] + model.dep_q * lm["card"])
    ma = model.mimi_arith
    mimi = 4 * sum(2 * c.c_out * c.t_out for c in ma.encode_convs + ma.decode_convs)  # conv out + ELU
    return int(temporal + depformer + logits + mimi)


def memory_plan(
    model: ModelSpec,
    gpu: GpuSpec,
    precision: str,
    kv_precision: str,
    sessions: int,
    *,
    cfg: bool = False,
    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_BYTES,
    allocator_overhead: float = DEFAULT_ALLOCATOR_OVERHEAD,
    headroom: float = DEFAULT_HEADROOM,
) -> MemoryPlan:
    """Memory table of ``sessions`` slots of ``model`` on ``gpu``, and the largest slot count that fits.

    Required bytes = CUDA context + (shared weights + sessions x per-slot bytes) x (1 + allocator overhead);
    usable bytes = driver-reported GPU memory x (1 - headroom).
    """
    kv_b = BYTES_PER_ELEMENT[kv_precision]
    rows = 2 if cfg else 1
    cfg_note = " x2 (CFG)" if cfg else ""
    shared = [
        MemoryLine(
            name="LM weights",
            bytes=lm_weight_bytes(model, precision),
            per_slot=False,
            note=f"{model.lm_tally.total / 1e9:.2f} B params at {precision}, counted once",
        ),
        MemoryLine(
            name="Mimi weights",
            bytes=mimi_weight_bytes(model),
            per_slot=False,
            note="fp32 params + codebooks (held twice)",
        ),
    ]
    ma = model.mimi_arith
    per_slot = [
        MemoryLine(
            name="KV cache, temporal transformer",
            bytes=int(rows * model.temporal_kv_elements_per_slot() * kv_b),
            per_slot=True,
            note=f"2 x {model.layers} layers x {model.context} x {model.dim} x {kv_b:g} B{cfg_note}",
        ),
        MemoryLine(
            name="KV cache, depformer",
            bytes=int(rows * model.depformer_kv_elements_per_slot() * kv_b),
            per_slot=True,
            note=f"2 x {model.lm.get('depformer_num_layers', 2)} layers x dep_q {model.dep_q} x "
            f"{model.lm.get('depformer_dim', 256)} x {kv_b:g} B{cfg_note}",
        ),
        MemoryLine(
            name="Mimi streaming state",
            bytes=4 * (ma.conv_state_elements_per_slot + ma.transformer_kv_elements_per_slot),
            per_slot=True,
            note="conv buffers + encoder/decoder transformer KV rings, fp32",
        ),
        MemoryLine(
            name="LMGen token cache",
            bytes=8 * model.lmgen_token_elements_per_slot(),
            per_slot=True,
            note="int64 tokens, (n_q+1) x (max delay+2)",
        ),
        MemoryLine(
            name="Activations (upper bound)",
            bytes=rows * activation_bytes_per_slot(model, BYTES_PER_ELEMENT[kv_precision]),
            per_slot=True,
            note="every intermediate of one tick",
        ),
        MemoryLine(
            name="Audio frame buffers",
            bytes=2 * FRAME_SAMPLES * 4,
            per_slot=True,
            note="one 80 ms frame in and out, fp32 PCM",
        ),
    ]
    shared_b = sum(x.bytes for x in shared)
    slot_b = sum(x.bytes for x in per_slot)
    total = gpu.memory_bytes
    head_b = int(total * headroom)
    usable = total - head_b
    k = 1 + allocator_overhead
    required = int(cuda_context_bytes + (shared_b + sessions * slot_b) * k)
    room = usable - cuda_context_bytes - shared_b * k
    max_s = max(0, math.floor(room / (slot_b * k))) if slot_b else 0
    return MemoryPlan(
        gpu_memory_bytes=total,
        headroom_bytes=head_b,
        usable_bytes=usable,
        cuda_context_bytes=cuda_context_bytes,
        allocator_overhead=allocator_overhead,
        shared=shared,
        per_slot=per_slot,
        shared_bytes=shared_b,
        per_slot_bytes=slot_b,
        sessions=sessions,
        required_bytes=required,
        max_sessions=max_s,
        fits=required <= usable,
        shortfall_bytes=max(0, required - usable),
    )
