"""Recording rules for the first-audio latency budget's terms (issue 24), and their promtool unit test.

The runtime observes five histograms once per session, at its first audio (``runtime/metrics.py``;
docs/benchmarks.md, "First-audio latency budget"): ingress, phase wait, tick compute and egress in seconds,
and the ticks until first audio as a count. For each term the node's Prometheus records, per runtime target,
over ``window``:

- ``duplex:first_audio_<term>:mean_<window>``: ``rate(_sum) / rate(_count)``, exact (the means add up to
  the mean first audio, ticks counted at 80 ms each);
- ``duplex:first_audio_<term>:p99_<window>``: ``histogram_quantile(0.99, rate(_bucket))``, an estimate
  within a bucket (the ticks' buckets sit at k + 0.5, so it lands within half a tick).

``infra.node.monitoring.prometheus`` puts these in its recording group and the test group in its promtool test
file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

BUDGET_TERMS = ("ingress", "phase_wait", "ticks", "tick_compute", "egress")
"""The terms, in the order a first frame meets them."""

_TEST_BUCKETS: dict[str, tuple[float, float, float]] = {
    # term: (lower bucket bound, upper bucket bound, every observation's value); binary fractions, so that
    # Prometheus's arithmetic and this module's give the same floats.
    "ingress": (0.0005, 0.001, 0.0009765625),
    "phase_wait": (0.03, 0.04, 0.03125),
    "ticks": (0.5, 1.5, 1.0),
    "tick_compute": (0.03, 0.04, 0.0390625),
    "egress": (0.0025, 0.005, 0.00390625),
}


def histogram(term: str) -> str:
    """The runtime's histogram of ``term`` (``duplex_first_audio_<term>_seconds``; the ticks: a count).

    Raises:
        ValueError: ``term`` is not one of ``BUDGET_TERMS``.
    """
    if term not in BUDGET_TERMS:
        raise ValueError(f"unknown first-audio budget term {term!r}; allowed: {', '.join(BUDGET_TERMS)}")
    return f"duplex_first_audio_{term}" + ("" if term == "ticks" else "_seconds")


def budget_recording_rules(selector: str, window: str) -> list[dict[str, str]]:
    """The mean and p99 recording rules of every term (module docstring) for the series matching
    ``selector`` (with braces: ``{job="runtime"}``) over ``window`` (a PromQL duration such as ``5m``)."""
    rules: list[dict[str, str]] = []
    for term in BUDGET_TERMS:
        metric = histogram(term)
        rules.append(
            {
                "record": f"duplex:first_audio_{term}:mean_{window}",
                "expr": f"rate({metric}_sum{selector}[{window}]) / rate({metric}_count{selector}[{window}])",
            }
        )
        rules.append(
            {
                "record": f"duplex:first_audio_{term}:p99_{window}",
                "expr": f"histogram_quantile(0.99, rate({metric}_bucket{selector}[{window}]))",
            }
        )
    return rules


def _series(metric: str, labels: Mapping[str, str]) -> str:
    return metric + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _num(value: float) -> str:
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def budget_test_group(
    labels: Mapping[str, str], window: str, window_min: int, minutes: int
) -> dict[str, Any]:
    """A ``promtool test rules`` group for ``budget_recording_rules``: for ``minutes`` minutes the runtime
    target ``labels`` starts 60 sessions a minute, every one observing each term at one value inside one
    bucket of its histogram (``_TEST_BUCKETS``); at the last minute each mean must be that value and each p99
    the bucket's lower bound + 0.99 x its width (Prometheus's linear interpolation, every observation in the
    bucket).

    Raises:
        ValueError: ``minutes`` does not leave a whole ``window_min`` window of samples.
    """
    if minutes < window_min + 1:
        raise ValueError(f"minutes must be > window_min ({window_min}), got {minutes}")
    per_min = 60

    def counter(increment: float) -> str:
        return f"0+{_num(increment)}x{minutes}"

    series: list[dict[str, str]] = []
    tests: list[dict[str, Any]] = []
    for term in BUDGET_TERMS:
        metric = histogram(term)
        low, high, value = _TEST_BUCKETS[term]
        for le, count in ((low, 0), (high, per_min), ("+Inf", per_min)):
            bound = le if isinstance(le, str) else _num(le)
            series.append(
                {"series": _series(f"{metric}_bucket", {**labels, "le": bound}), "values": counter(count)}
            )
        series.append({"series": _series(f"{metric}_count", labels), "values": counter(per_min)})
        series.append({"series": _series(f"{metric}_sum", labels), "values": counter(per_min * value)})
        for name, expected in (("mean", value), ("p99", low + (high - low) * 0.99)):
            record = f"duplex:first_audio_{term}:{name}_{window}"
            tests.append(
                {
                    "expr": record,
                    "eval_time": f"{minutes}m",
                    "exp_samples": [{"labels": _series(record, labels), "value": expected}],
                }
            )
    return {
        "name": "first-audio budget terms: means and p99s recorded",
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [],
        "promql_expr_test": tests,
    }
