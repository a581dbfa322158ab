"""PromQL text for the node's rules, and what promtool's unit tests need to check them.

- Label-matcher selectors (``job="runtime"``, ``namespace="duplex", job="runtime"``): parsed, normalised and
  refused when they would match everything (``matchers``, ``normalised``, ``sel``);
- thresholds written as PromQL reads them back exactly (``num``);
- Prometheus's annotation templating (``{{ $labels.x }}``, ``{{ $value | humanize... }}``) in Python, so a
  unit test can expect the exact annotation text (``expand``; Go's ``%.4g`` and Prometheus's ``humanize*``
  functions, ``template/template.go``);
- the arithmetic Prometheus does on the unit tests' synthetic series (``rate_per_s``, ``bucket_quantile``)
  and ``RuleTestKit``, which builds ``promtool test rules`` groups from alert specs (``AlertSpec``).

Used by ``infra.node.monitoring.alert_rules`` and the rule modules it gathers (``first_audio_rules``,
``rtc_rules``, ``session_rules``) and by ``infra.node.monitoring.alert_rule_tests``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = [
    "RATE_WINDOW",
    "RATE_WINDOW_MIN",
    "AlertSpec",
    "RuleTestKit",
    "Series",
    "bucket_quantile",
    "equality_labels",
    "expand",
    "matchers",
    "normalised",
    "num",
    "rate_per_s",
    "sel",
    "series",
]

RATE_WINDOW = "5m"
RATE_WINDOW_MIN = 5
"""The rules' usual rate window (PromQL duration, and in minutes for the unit tests' arithmetic)."""


class AlertSpec(NamedTuple):
    """One alert rule: name, PromQL condition, ``for`` (``"0s"``: none), severity (``page`` or ``ticket``),
    and the summary and description templates (the runbook text: what it means and where to look)."""

    alert: str
    expr: str
    duration: str
    severity: str
    summary: str
    description: str

    def rule(self) -> dict[str, Any]:
        """The rule as Prometheus's rule file writes it (``for`` left out when ``"0s"``)."""
        rule: dict[str, Any] = {"alert": self.alert, "expr": self.expr}
        if self.duration != "0s":
            rule["for"] = self.duration
        rule["labels"] = {"severity": self.severity}
        rule["annotations"] = {"summary": self.summary, "description": self.description}
        return rule


# --- label matchers -------------------------------------------------------------------------------------

_MATCHER_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"\\]*)"\s*')


def matchers(selector: str, what: str) -> list[tuple[str, str, str]]:
    """Parse ``name="value", name=~"re", ...`` (no braces, no escapes) into (name, op, value)."""
    out: list[tuple[str, str, str]] = []
    pos = 0
    while True:
        match = _MATCHER_RE.match(selector, pos)
        if match is None:
            raise ValueError(
                f"{what} {selector!r} is not a list of label matchers such as 'job=\"runtime\"' or "
                '\'namespace="duplex", job="runtime"\' (no braces; quotes and backslashes inside values '
                "are not supported)"
            )
        out.append((match.group(1), match.group(2), match.group(3)))
        pos = match.end()
        if pos == len(selector):
            break
        if selector[pos] != ",":
            raise ValueError(f"{what} {selector!r}: expected ',' between matchers at character {pos}")
        pos += 1
    if not any(op == "=" and value for _, op, value in out):
        raise ValueError(
            f"{what} {selector!r} needs at least one equality matcher with a non-empty value "
            "(PromQL refuses selectors that match everything, and absent() takes its labels from them)"
        )
    return out


def normalised(selector: str, what: str) -> str:
    """``selector`` written one way (``name="value",...``, no spaces).

    Raises:
        ValueError: as ``matchers``.
    """
    return ",".join(f'{name}{op}"{value}"' for name, op, value in matchers(selector, what))


def equality_labels(selector: str, what: str) -> dict[str, str]:
    """The labels a series selected by ``selector`` must carry (equality matchers only)."""
    labels: dict[str, str] = {}
    for name, op, value in matchers(selector, what):
        if op != "=":
            raise ValueError(
                f"{what} {selector!r}: unit tests can only synthesise series for equality matchers "
                f'(name="value"), not {name}{op}"{value}"'
            )
        labels[name] = value
    return labels


def sel(selector: str, *extra: str) -> str:
    """``{selector,extra...}``: a normalised selector and more matchers, in braces."""
    return "{" + ",".join((selector, *extra)) + "}"


def num(value: float) -> str:
    """A threshold as PromQL reads it back exactly (shortest round-trip repr, no trailing '.0')."""
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


# --- annotation templates (and a Python rendering of them, for the unit tests) ---------------------------

_TEMPLATE_RE = re.compile(r"\{\{ (?:\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)|\$value \| (humanize\w*)) \}\}")


def _go_g4(value: float) -> str:
    """Go's ``fmt.Sprintf("%.4g", v)`` (Python's ``.4g`` agrees with it for finite values)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return f"{value:.4g}"


def _humanize(value: float) -> str:
    if value == 0 or math.isnan(value) or math.isinf(value):
        return _go_g4(value)
    prefix = ""
    if abs(value) >= 1:
        for p in ("k", "M", "G", "T", "P", "E", "Z", "Y"):
            if abs(value) < 1000:
                break
            prefix, value = p, value / 1000
        return _go_g4(value) + prefix
    for p in ("m", "u", "n", "p", "f", "a", "z", "y"):
        if abs(value) >= 1:
            break
        prefix, value = p, value * 1000
    return _go_g4(value) + prefix


def _humanize_duration(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return _go_g4(value)
    if value == 0:
        return _go_g4(value) + "s"
    if abs(value) >= 1:
        sign = "-" if value < 0 else ""
        value = abs(value)
        duration = int(value)
        seconds, minutes = duration % 60, (duration // 60) % 60
        hours, days = (duration // 3600) % 24, duration // 86400
        if days:
            return f"{sign}{days}d {hours}h {minutes}m {seconds}s"
        if hours:
            return f"{sign}{hours}h {minutes}m {seconds}s"
        if minutes:
            return f"{sign}{minutes}m {seconds}s"
        return f"{sign}{_go_g4(value)}s"
    prefix = ""
    for p in ("m", "u", "n", "p", "f", "a", "z", "y"):
        if abs(value) >= 1:
            break
        prefix, value = p, value * 1000
    return f"{_go_g4(value)}{prefix}s"


_HUMANIZERS = {
    "humanize": _humanize,
    "humanizeDuration": _humanize_duration,
    "humanizePercentage": lambda v: _go_g4(v * 100) + "%",
}


def expand(template: str, labels: Mapping[str, str], value: float) -> str:
    """What Prometheus makes of ``template`` for an alert with these sample labels and this value."""

    def one(match: re.Match[str]) -> str:
        if match.group(1) is not None:
            return labels.get(match.group(1), "")
        return _HUMANIZERS[match.group(2)](value)

    text = _TEMPLATE_RE.sub(one, template)
    if "{{" in text:
        raise AssertionError(f"annotation template {template!r} uses a form expand does not render")
    return text


# --- promtool unit tests ---------------------------------------------------------------------------------

Series = tuple[str, Mapping[str, str], str]
"""(metric name, labels, promtool values notation) of one input series."""


def series(metric: str, labels: Mapping[str, str]) -> str:
    """``metric{k="v",...}`` as promtool's ``series`` and ``exp_samples`` write it."""
    return metric + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def rate_per_s(increment_per_min: float, eval_min: int, window_min: int = RATE_WINDOW_MIN) -> float:
    """``rate(x[<window_min>m])`` at ``eval_min`` of a counter ``0+increment_per_min x N`` sampled each
    minute, as Prometheus computes it, per second: every sample in the window, so no extrapolation, and the
    increase times (extrapolated / sampled interval) / range, in that order (``extrapolatedRate``,
    ``promql/functions.go``), so that a ratio of two rates is the same float as Prometheus's."""
    assert eval_min >= window_min
    first = increment_per_min * (eval_min - window_min)
    last = increment_per_min * eval_min
    sampled = window_min * 60.0
    return (last - first) * ((sampled / sampled) / sampled)


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's ``bucketQuantile`` for cumulative (upper bound, rate) buckets ending with +Inf."""
    rank = q * buckets[-1][1]
    b = next(i for i, (_, count) in enumerate(buckets[:-1]) if count >= rank)
    start, end, count = 0.0, buckets[b][0], buckets[b][1]
    if b > 0:
        start = buckets[b - 1][0]
        count -= buckets[b - 1][1]
        rank -= buckets[b - 1][1]
    return start + (end - start) * (rank / count)


class RuleTestKit:
    """Builds ``promtool test rules`` groups for a rule file's alerts (``rules``: ``{alert name: rule dict}``)
    over ``horizon`` minutes of input sampled each minute; ``late`` (``horizon - 5``) is a time at which every
    ``for`` has passed."""

    def __init__(self, rules: Mapping[str, Mapping[str, Any]], horizon: int) -> None:
        self.rules = rules
        self.horizon = horizon
        self.late = horizon - 5

    def steady(self, value: float) -> str:
        """A gauge at ``value`` for the whole horizon."""
        return f"{num(value)}x{self.horizon}"

    def counter(self, per_min: float) -> str:
        """A counter from 0 growing by ``per_min`` each minute for the whole horizon."""
        return f"0+{num(per_min)}x{self.horizon}"

    def expect(self, alert: str, labels: Mapping[str, str], value: float) -> dict[str, Any]:
        """The firing alert ``alert`` with these sample labels and value: its exact labels and annotations."""
        annotations = self.rules[alert]["annotations"]
        return {
            "exp_labels": {**labels, **self.rules[alert]["labels"]},
            "exp_annotations": {key: expand(text, labels, value) for key, text in annotations.items()},
        }

    @staticmethod
    def check(alert: str, at_min: int, *expected: dict[str, Any]) -> dict[str, Any]:
        """An ``alert_rule_test`` case: at ``at_min`` minutes, exactly ``expected`` (none: silent)."""
        return {"eval_time": f"{at_min}m", "alertname": alert, "exp_alerts": list(expected)}

    @staticmethod
    def group(name: str, input_series: list[Series], *tests: dict[str, Any]) -> dict[str, Any]:
        """A test group: one-minute samples of ``input_series`` and these cases."""
        return {
            "name": name,
            "interval": "1m",
            "input_series": [{"series": series(m, lab), "values": values} for m, lab, values in input_series],
            "alert_rule_test": list(tests),
        }

    @staticmethod
    def with_series(base: list[Series], metric: str, labels: Mapping[str, str], values: str) -> list[Series]:
        """``base`` with the series (metric, labels) given these values (added if missing)."""
        return [s for s in base if not (s[0] == metric and s[1] == labels)] + [(metric, labels, values)]

    @staticmethod
    def without(base: list[Series], metric: str, labels: Mapping[str, str] | None = None) -> list[Series]:
        """``base`` without ``metric`` (only its series with exactly ``labels`` when given)."""
        return [s for s in base if not (s[0] == metric and (labels is None or s[1] == labels))]
