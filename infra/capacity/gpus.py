"""GPU catalog: memory, memory bandwidth, dense throughput, TDP and native precisions.

Every figure is the vendor's data-sheet value, dense (no 2:4 sparsity), with the source in a comment.
``memory_mib`` is the capacity the driver reports (``nvidia-smi --query-gpu=memory.total``), which is what
PyTorch can use; ``nominal`` is the marketing label ("48 GB"). The two differ: an L40S "48 GB" reports
46068 MiB (48.3 GB, 45.0 GiB), an H100 "80 GB" 81559 MiB (85.5 GB, 79.6 GiB).

Throughput keys are compute precisions: ``fp32`` (CUDA cores, no tensor cores), ``fp16``/``bf16`` (tensor
cores, fp32 accumulate), ``fp8``, ``int8`` (tensor cores), ``int4`` (tensor cores where they exist).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .units import GB, MiB, check_choice


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model.

    Attributes:
        key: catalog key used on the CLI (``l40s``).
        name: vendor name.
        nominal: the data sheet's memory label.
        memory_mib: memory the driver reports (MiB, 2**20 bytes).
        bandwidth_gb_s: peak memory bandwidth (GB/s, 10**9 bytes per second).
        tflops: dense peak throughput by compute precision (TFLOPS, or TOPS for integers).
        tdp_w: board power limit (W).
        native: precisions the tensor cores (or CUDA cores for fp32) execute natively.
        memory_type: GDDR6, HBM2e, ...
        source: where the figures come from.
    """

    key: str
    name: str
    nominal: str
    memory_mib: int
    bandwidth_gb_s: float
    tflops: dict[str, float]
    tdp_w: float
    native: frozenset[str]
    memory_type: str
    source: str
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def memory_bytes(self) -> int:
        """Driver-reported memory (bytes)."""
        return self.memory_mib * MiB

    @property
    def bandwidth_bytes_s(self) -> float:
        """Peak memory bandwidth (bytes per second)."""
        return self.bandwidth_gb_s * GB

    def flops_per_s(self, precision: str) -> float:
        """Dense peak throughput at ``precision`` (operations per second). A precision the GPU lacks (the
        verdict reports it) is timed as if emulated at fp16, or fp32 without fp16 tensor cores."""
        for p in (precision, "fp16", "fp32"):
            if p in self.tflops:
                return self.tflops[p] * 1e12
        raise KeyError(precision)

    def supports(self, precision: str) -> bool:
        """Whether ``precision`` runs natively on this GPU."""
        return precision in self.native


GPUS: dict[str, GpuSpec] = {
    # NVIDIA T4 data sheet (Turing, 2019): 16 GB GDDR6, 320 GB/s, FP32 8.1 TFLOPS, mixed-precision FP16
    # 65 TFLOPS, INT8 130 TOPS, INT4 260 TOPS, 70 W. Turing has no bf16 and no fp8 (FIELD-NOTES: "a T4 has
    # no bf16"). nvidia-smi reports 15360 MiB with ECC on (GCP enables ECC).
    "t4": GpuSpec(
        "t4",
        "NVIDIA T4",
        "16 GB",
        15360,
        320.0,
        {"fp32": 8.1, "fp16": 65.0, "int8": 130.0, "int4": 260.0},
        70.0,
        frozenset({"fp32", "fp16", "int8", "int4"}),
        "GDDR6",
        "NVIDIA T4 Tensor Core GPU data sheet",
    ),
    # NVIDIA L4 data sheet (Ada, 2023): 24 GB GDDR6, 300 GB/s, FP32 30.3 TFLOPS, BF16/FP16 121 TFLOPS dense
    # (242 with sparsity), FP8 242 TFLOPS dense, INT8 242 TOPS dense, 72 W. nvidia-smi: 23034 MiB.
    "l4": GpuSpec(
        "l4",
        "NVIDIA L4",
        "24 GB",
        23034,
        300.0,
        {"fp32": 30.3, "fp16": 121.0, "bf16": 121.0, "fp8": 242.0, "int8": 242.0},
        72.0,
        frozenset({"fp32", "fp16", "bf16", "fp8", "int8", "int4"}),
        "GDDR6",
        "NVIDIA L4 Tensor Core GPU data sheet",
    ),
    # NVIDIA L40S data sheet (Ada, 2023): 48 GB GDDR6 ECC, 864 GB/s, FP32 91.6 TFLOPS, BF16/FP16 362.05 TFLOPS
    # dense (733 with sparsity), FP8 733 TFLOPS dense, INT8 733 TOPS dense, 350 W. nvidia-smi: 46068 MiB.
    # Not offered on GCP (FIELD-NOTES, "GCP GPUs").
    "l40s": GpuSpec(
        "l40s",
        "NVIDIA L40S",
        "48 GB",
        46068,
        864.0,
        {"fp32": 91.6, "fp16": 362.05, "bf16": 362.05, "fp8": 733.0, "int8": 733.0},
        350.0,
        frozenset({"fp32", "fp16", "bf16", "fp8", "int8", "int4"}),
        "GDDR6",
        "NVIDIA L40S GPU data sheet",
    ),
    # NVIDIA A100 data sheet (Ampere, 2020), SXM4 40 GB (the part on GCP a2-highgpu): HBM2 1,555 GB/s,
    # FP32 19.5 TFLOPS, BF16/FP16 312 TFLOPS dense, INT8 624 TOPS, INT4 1,248 TOPS, 400 W. No fp8.
    # nvidia-smi: 40960 MiB.
    "a100-40gb": GpuSpec(
        "a100-40gb",
        "NVIDIA A100 40GB SXM4",
        "40 GB",
        40960,
        1555.0,
        {"fp32": 19.5, "fp16": 312.0, "bf16": 312.0, "int8": 624.0, "int4": 1248.0},
        400.0,
        frozenset({"fp32", "fp16", "bf16", "int8", "int4"}),
        "HBM2",
        "NVIDIA A100 Tensor Core GPU data sheet (SXM4 40GB column)",
    ),
    # NVIDIA A100 data sheet, 80GB PCIe column: HBM2e 1,935 GB/s, 300 W; same tensor throughput as SXM.
    # nvidia-smi: 81920 MiB.
    "a100-80gb-pcie": GpuSpec(
        "a100-80gb-pcie",
        "NVIDIA A100 80GB PCIe",
        "80 GB",
        81920,
        1935.0,
        {"fp32": 19.5, "fp16": 312.0, "bf16": 312.0, "int8": 624.0, "int4": 1248.0},
        300.0,
        frozenset({"fp32", "fp16", "bf16", "int8", "int4"}),
        "HBM2e",
        "NVIDIA A100 Tensor Core GPU data sheet (80GB PCIe column)",
    ),
    # NVIDIA A100 data sheet, 80GB SXM column (the part on GCP a2-ultragpu): HBM2e 2,039 GB/s, 400 W.
    "a100-80gb-sxm": GpuSpec(
        "a100-80gb-sxm",
        "NVIDIA A100 80GB SXM4",
        "80 GB",
        81920,
        2039.0,
        {"fp32": 19.5, "fp16": 312.0, "bf16": 312.0, "int8": 624.0, "int4": 1248.0},
        400.0,
        frozenset({"fp32", "fp16", "bf16", "int8", "int4"}),
        "HBM2e",
        "NVIDIA A100 Tensor Core GPU data sheet (80GB SXM column)",
    ),
    # NVIDIA H100 data sheet (Hopper, 2022), SXM5 80 GB (the part on GCP A3): HBM3 3.35 TB/s, FP32 67 TFLOPS,
    # BF16/FP16 989 TFLOPS dense (1,979 with sparsity), FP8 1,979 TFLOPS dense, INT8 1,979 TOPS dense,
    # up to 700 W. Hopper's tensor cores have no INT4 path. nvidia-smi: 81559 MiB.
    "h100": GpuSpec(
        "h100",
        "NVIDIA H100 80GB SXM5",
        "80 GB",
        81559,
        3350.0,
        {"fp32": 67.0, "fp16": 989.0, "bf16": 989.0, "fp8": 1979.0, "int8": 1979.0},
        700.0,
        frozenset({"fp32", "fp16", "bf16", "fp8", "int8"}),
        "HBM3",
        "NVIDIA H100 Tensor Core GPU data sheet (SXM column)",
    ),
    # NVIDIA H200 data sheet (Hopper, 2024), SXM 141 GB HBM3e, 4.8 TB/s, compute as H100 SXM, up to 700 W.
    # nvidia-smi: 143771 MiB.
    "h200": GpuSpec(
        "h200",
        "NVIDIA H200 SXM",
        "141 GB",
        143771,
        4800.0,
        {"fp32": 67.0, "fp16": 989.0, "bf16": 989.0, "fp8": 1979.0, "int8": 1979.0},
        700.0,
        frozenset({"fp32", "fp16", "bf16", "fp8", "int8"}),
        "HBM3e",
        "NVIDIA H200 Tensor Core GPU data sheet (SXM column)",
    ),
}
"""The GPUs the planner knows, by CLI key."""


def get_gpu(key: str) -> GpuSpec:
    """Return the catalog entry for ``key``; ``ValueError`` naming the allowed keys otherwise."""
    check_choice("gpu", key, sorted(GPUS))
    return GPUS[key]


def compute_precision(weights: str) -> str:
    """The throughput column a step runs at for weights stored at ``weights``.

    moshi's INT8 (bitsandbytes LLM.int8, ``moshi/utils/quantize.py``) multiplies int8 weights on int8 tensor
    cores; fp8 weights use fp8 tensor cores; int4 weights are weight-only (dequantised to fp16 in the kernel);
    fp32 runs on CUDA cores.
    """
    return {"int4": "fp16"}.get(weights, weights)


def activation_precision(weights: str) -> str:
    """Precision of activations (and of moshi's KV cache by default) for weights at ``weights``.

    moshi's ``StreamingMultiheadAttention._init_streaming_state`` gives the KV cache the dtype of the input
    projection's weight, and fp16 for an int8 ``QLinear`` (FIELD-NOTES: "the KV cache becomes fp16").
    fp8 and int4 weight formats are not in moshi 0.2.13; we assume they keep bf16 activations.
    """
    return {"int8": "fp16", "fp8": "bf16", "int4": "bf16"}.get(weights, weights)
