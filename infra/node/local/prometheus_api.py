"""Prometheus's HTTP query API, as the node's own tools read it (``infra.node.local.node``'s readiness probe,
``infra.node.local.bringup``'s figures): instant queries, standard library only."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request

__all__ = ["PrometheusQueryError", "prometheus_query"]


class PrometheusQueryError(RuntimeError):
    """Prometheus did not answer a query, or answered with an error."""


def prometheus_query(base_url: str, promql: str, *, timeout_s: float = 5.0) -> float | None:
    """Instant query ``promql`` against Prometheus at ``base_url``; the first sample's value, or None
    when the result is empty (or NaN).

    Raises:
        PrometheusQueryError: unreachable, HTTP error, or ``status`` not ``success`` (message has the error).
    """
    url = f"{base_url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (http to our node)
            body = json.loads(response.read())
    except (OSError, ValueError) as exc:
        raise PrometheusQueryError(f"query {promql!r} failed: {exc}") from None
    if body.get("status") != "success":
        raise PrometheusQueryError(f"query {promql!r}: {body.get('errorType')}: {body.get('error')}")
    result = body["data"]["result"]
    if not result:
        return None
    value = float(result[0]["value"][1])
    return None if value != value else value  # NaN: no samples in the window
