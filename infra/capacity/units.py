"""Units and numeric precisions shared by the capacity planner.

Units are explicit everywhere in this package: ``*_bytes`` are bytes, ``GB`` is 10**9 bytes (the unit of
NVIDIA's and GCP's data sheets and of the capacity plans we compare with), ``GiB`` is 2**30 bytes (the
unit of ``nvidia-smi`` and of PyTorch's allocator), ``*_ms`` are milliseconds, ``*_w`` watts.
"""

from __future__ import annotations

from typing import Literal, get_args

GB = 10**9
"""One gigabyte (decimal), in bytes."""
GiB = 2**30
"""One gibibyte (binary), in bytes."""
MiB = 2**20
"""One mebibyte, in bytes."""
KiB = 2**10
"""One kibibyte, in bytes."""

Precision = Literal["fp32", "bf16", "fp16", "fp8", "int8", "int4"]
"""Storage precision of weights or of the KV cache."""

PRECISIONS: tuple[str, ...] = get_args(Precision)

BYTES_PER_ELEMENT: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}
"""Bytes per stored element of each precision."""

WEIGHT_PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8", "fp8", "int4")
"""Precisions accepted for the LM weights."""
KV_PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8", "int8")
"""Precisions accepted for the KV cache (int4 KV caches are not a thing moshi or we do)."""


def to_gb(n_bytes: float) -> float:
    """Bytes to GB (10**9 bytes)."""
    return n_bytes / GB


def to_gib(n_bytes: float) -> float:
    """Bytes to GiB (2**30 bytes)."""
    return n_bytes / GiB


def check_choice(field: str, value: str, allowed: tuple[str, ...] | list[str]) -> str:
    """Return ``value`` if it is in ``allowed``, else raise ``ValueError`` naming field and choices."""
    if value not in allowed:
        raise ValueError(f"{field}: unknown value {value!r}; allowed values: {', '.join(allowed)}")
    return value
