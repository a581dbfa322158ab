"""``duplex preflight``: a stack's GPU needs per region and quota metric against the project's quotas,
before ``pulumi up`` (issue 33: a new project has ``GPUS_ALL_REGIONS`` = 0 and nothing checked it).

``needs``: what the stack file asks for (``gpu_needs``); ``quotas``: what the Compute Engine API says the
project has (``ComputeQuotas``, ``compare``); ``cli``: the command. docs/deploying.md, "GPU quota".
"""

from __future__ import annotations

from infra.preflight.needs import (
    ALL_REGIONS,
    PROJECT_METRIC,
    QUOTA_METRICS,
    GpuNeed,
    PreflightError,
    gpu_needs,
    load_stack,
    quota_metrics,
    stack_values,
)
from infra.preflight.quotas import COMPUTE_API, ComputeQuotas, Quota, QuotaRow, access_token, compare

__all__ = [
    "ALL_REGIONS",
    "COMPUTE_API",
    "PROJECT_METRIC",
    "QUOTA_METRICS",
    "ComputeQuotas",
    "GpuNeed",
    "PreflightError",
    "Quota",
    "QuotaRow",
    "access_token",
    "compare",
    "gpu_needs",
    "load_stack",
    "quota_metrics",
    "stack_values",
]
