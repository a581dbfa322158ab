"""Kubernetes objects of one region of the multi-region stack, as plain manifests (dicts, camelCase, as
``kubectl apply`` takes them; values from the cloud may be Pulumi Outputs, placed, never inspected);
``infra.components.regional_runtime`` declares them with pulumi-kubernetes. Grouped by what they are:
``base`` (``RegionWorkload`` and what every builder uses), ``workload`` (the runtime), ``prefetch`` (the
weights Job), ``scaling`` (the autoscaler) and ``metrics_adapter`` (its metric source), ``monitoring`` (GMP,
rules, Grafana); ``region`` puts them together in apply order; ``manifest`` writes and validates them.
docs/deploying.md, "Stack multi-region".
"""

from __future__ import annotations

from infra.k8s.base import RegionWorkload, redis_address, redis_url

__all__ = ["RegionWorkload", "redis_address", "redis_url"]
