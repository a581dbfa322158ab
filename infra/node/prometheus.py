"""Prometheus of one node, rendered from a ``NodeProfile``: ``render_prometheus`` gives its configuration
(static scrape targets from ``infra.node.services.endpoint``, alerts to the node's Alertmanager),
``alert_rules`` its recording and alert rules (built from ``runtime.metrics``, reusable by a Kubernetes
stack through label selectors), ``rules_unit_tests`` a ``promtool test rules`` file for those rules. The
same profile always gives the same bytes; a selector without a non-empty equality matcher is refused.

The rules, each alert's condition and the selectors: docs/operations.md, "Alerts"."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import yaml

from infra.node.first_audio_rules import budget_recording_rules, budget_test_group
from infra.node.profile import NodeProfile
from infra.node.services import Service, endpoint

__all__ = [
    "CONFIG_FILE",
    "DCGM_SELECTOR",
    "NODE_SIDE_REFUSALS",
    "REDIS_SELECTOR",
    "RULES_FILE",
    "LOADING_ALERT_MINUTES",
    "RULES_TEST_FILE",
    "RUNTIME_SELECTOR",
    "scrape_interval",
    "TICKS_OVER_BUDGET_FRACTION",
    "alert_rules",
    "prometheus_args",
    "prometheus_config",
    "render_prometheus",
    "rules_unit_tests",
]

CONFIG_FILE = "prometheus/prometheus.yml"
"""The configuration, relative to the bundle root."""
RULES_FILE = "prometheus/rules/duplex-node.rules.yml"
"""The rule file, relative to the bundle root (``rule_files: [rules/*.yml]`` in the configuration)."""
RULES_TEST_FILE = "prometheus/tests/duplex-node.rules.test.yml"
"""The ``promtool test rules`` file, relative to the bundle root (outside ``rules/``: never loaded)."""

LOADING_ALERT_MINUTES = 20
"""Minutes of ``duplex_loading`` 1 before ``RuntimeLoadingTooLong`` (a 7B load takes a few minutes)."""

RUNTIME_SELECTOR = 'job="runtime"'
"""Label matchers selecting the runtime's targets on a node."""
REDIS_SELECTOR = 'job="redis-exporter"'
"""Label matchers selecting redis_exporter's targets on a node."""
DCGM_SELECTOR = 'job="dcgm-exporter"'
"""Label matchers selecting dcgm-exporter's targets on a node."""


def scrape_interval(profile: NodeProfile) -> str:
    """The node's scrape and rule-evaluation interval, as Prometheus writes durations (``"5s"``)."""
    return f"{profile.scrape_interval_s}s"


NODE_SIDE_REFUSALS = ("node_full", "draining", "replay_check_unavailable")
"""``duplex_admissions_refused_total`` reasons that ``AdmissionsRefused`` alerts on: the node's own
capacity or availability. The others (a bad request, a missing or invalid token, a foreign origin) are the
client's."""

TICKS_OVER_BUDGET_FRACTION = 0.01
"""``TicksOverBudget`` fires above this share (0..1) of busy ticks longer than the 80 ms frame."""

_RATE_WINDOW = "5m"
_RATE_WINDOW_MIN = 5
_HEADER = "# Rendered by infra.node.prometheus for node profile {name!r}; edit the renderer, not this file.\n"

# --- label matchers -------------------------------------------------------------------------------------

_MATCHER_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"\\]*)"\s*')


def _matchers(selector: str, what: str) -> list[tuple[str, str, str]]:
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


def _normalised(selector: str, what: str) -> str:
    return ",".join(f'{name}{op}"{value}"' for name, op, value in _matchers(selector, what))


def _equality_labels(selector: str, what: str) -> dict[str, str]:
    """The labels a series selected by ``selector`` must carry (equality matchers only)."""
    labels: dict[str, str] = {}
    for name, op, value in _matchers(selector, what):
        if op != "=":
            raise ValueError(
                f"{what} {selector!r}: unit tests can only synthesise series for equality matchers "
                f'(name="value"), not {name}{op}"{value}"'
            )
        labels[name] = value
    return labels


def _sel(selector: str, *extra: str) -> str:
    return "{" + ",".join((selector, *extra)) + "}"


def _num(value: float) -> str:
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


def _expand(template: str, labels: Mapping[str, str], value: float) -> str:
    """What Prometheus makes of ``template`` for an alert with these sample labels and this value."""

    def one(match: re.Match[str]) -> str:
        if match.group(1) is not None:
            return labels.get(match.group(1), "")
        return _HUMANIZERS[match.group(2)](value)

    text = _TEMPLATE_RE.sub(one, template)
    if "{{" in text:
        raise AssertionError(f"annotation template {template!r} uses a form _expand does not render")
    return text


# --- rules -----------------------------------------------------------------------------------------------


def _alert_specs(
    profile: NodeProfile, runtime: str, redis: str, dcgm: str
) -> list[tuple[str, str, str, str, str, str]]:
    """(alert, expr, for, severity, summary, description) of every alert of this profile."""
    limits = profile.limits
    target_ms = limits.first_audio_p99_target_ms
    window = _RATE_WINDOW
    over = _num(TICKS_OVER_BUDGET_FRACTION)
    node_side = f'reason=~"{"|".join(NODE_SIDE_REFUSALS)}"'
    specs = [
        (
            "RuntimeDown",
            f"up{_sel(runtime)} == 0 or absent(up{_sel(runtime)})",
            "1m",
            "page",
            "Runtime {{ $labels.instance }} is down",
            "Prometheus has failed to scrape the runtime target '{{ $labels.instance }}' (node "
            "{{ $labels.node }}), or has no runtime target at all, for 1 minute: the node serves no "
            "sessions.",
        ),
        (
            "RuntimeNotReady",
            f"duplex_ready{_sel(runtime)} == 0 unless duplex_draining{_sel(runtime)} == 1 "
            f"unless duplex_loading{_sel(runtime)} == 1",
            "2m",
            "page",
            "Runtime {{ $labels.instance }} is not ready",
            "duplex_ready has been {{ $value | humanize }} on {{ $labels.instance }} (node "
            "{{ $labels.node }}) for 2 minutes while the runtime is neither draining nor loading its model: "
            "it admits no sessions.",
        ),
        (
            "RuntimeLoadingTooLong",
            f"duplex_loading{_sel(runtime)} == 1",
            f"{LOADING_ALERT_MINUTES}m",
            "ticket",
            "Runtime {{ $labels.instance }} is still loading its model",
            f"{{{{ $labels.instance }}}} (node {{{{ $labels.node }}}}) has been loading its model for "
            f"{LOADING_ALERT_MINUTES} minutes: the weights download or load is stuck or far slower than "
            "usual (a 7B model loads in a few minutes from a warm cache). Check the runtime's log.",
        ),
        (
            "RedisDown",
            f"redis_up{_sel(redis)} == 0 or up{_sel(redis)} == 0 or absent(up{_sel(redis)})",
            "1m",
            "page",
            "Redis behind {{ $labels.instance }} is down",
            "redis_exporter '{{ $labels.instance }}' (node {{ $labels.node }}) has reported Redis down, or "
            "could not be scraped, for 1 minute (value {{ $value | humanize }}): session state and "
            "transcripts are not being stored.",
        ),
        (
            "FirstAudioLatencyHigh",
            f"histogram_quantile(0.99, rate(duplex_first_audio_latency_seconds_bucket{_sel(runtime)}"
            f"[{window}])) > {_num(target_ms / 1000)}",
            "5m",
            "page",
            f"First-audio latency p99 above {_num(target_ms)} ms on {{{{ $labels.instance }}}}",
            "The p99 time from a session's first input frame to its first output frame over the last 5 "
            "minutes is {{ $value | humanizeDuration }} on {{ $labels.instance }} (node {{ $labels.node }}); "
            f"the node's target is {_num(target_ms)} ms (profile limits.first_audio_p99_target_ms).",
        ),
        (
            "TicksOverBudget",
            f"rate(duplex_ticks_over_budget_total{_sel(runtime)}[{window}]) / "
            f"rate(duplex_ticks_total{_sel(runtime)}[{window}]) > {over}",
            "5m",
            "page",
            "Ticks over the 80 ms budget on {{ $labels.instance }}",
            "{{ $value | humanizePercentage }} of busy ticks on {{ $labels.instance }} (node "
            "{{ $labels.node }}) took longer than the 80 ms frame over the last 5 minutes (threshold "
            f"{_num(TICKS_OVER_BUDGET_FRACTION * 100)}%): every session on the node hears gaps.",
        ),
        (
            "NodeAtSessionCap",
            f"duplex_active_sessions{_sel(runtime)} >= duplex_slots_total{_sel(runtime)} "
            f"and duplex_slots_total{_sel(runtime)} > 0",
            f"{limits.at_cap_alert_minutes}m",
            "ticket",
            "Node {{ $labels.node }} is at its session cap",
            "All {{ $value | humanize }} slots of {{ $labels.instance }} (node {{ $labels.node }}) have "
            f"been in use for {limits.at_cap_alert_minutes} minutes (profile "
            "limits.at_cap_alert_minutes): new sessions are refused; add capacity.",
        ),
        (
            "AdmissionsRefused",
            f"increase(duplex_admissions_refused_total{_sel(runtime, node_side)}[{window}]) > 0",
            "0s",
            "ticket",
            "Sessions refused on {{ $labels.instance }} ({{ $labels.reason }})",
            "{{ $value | humanize }} sessions were refused with reason {{ $labels.reason }} on "
            "{{ $labels.instance }} (node {{ $labels.node }}) in the last 5 minutes.",
        ),
    ]
    if profile.gpu is not None:
        fraction = limits.gpu_memory_alert_fraction
        used, free = f"DCGM_FI_DEV_FB_USED{_sel(dcgm)}", f"DCGM_FI_DEV_FB_FREE{_sel(dcgm)}"
        specs.append(
            (
                "GpuMemoryHigh",
                f"{used} / ({used} + {free}) > {_num(fraction)}",
                "5m",
                "ticket",
                "GPU {{ $labels.gpu }} memory high on {{ $labels.instance }}",
                "GPU {{ $labels.gpu }} on {{ $labels.instance }} (node {{ $labels.node }}) has used "
                "{{ $value | humanizePercentage }} of its framebuffer for 5 minutes (threshold "
                f"{_num(fraction * 100)}%, profile limits.gpu_memory_alert_fraction).",
            )
        )
    return specs


def _recording_rules(runtime: str) -> list[dict[str, str]]:
    window = _RATE_WINDOW
    rules: list[dict[str, str]] = []
    for metric in ("tick_duration_seconds", "first_audio_latency_seconds"):
        for name, q in (("p50", "0.5"), ("p99", "0.99")):
            rules.append(
                {
                    "record": f"duplex:{metric}:{name}_{window}",
                    "expr": f"histogram_quantile({q}, rate(duplex_{metric}_bucket{_sel(runtime)}[{window}]))",
                }
            )
    rules += [
        {
            "record": "duplex:session_utilisation:ratio",
            "expr": f"duplex_active_sessions{_sel(runtime)} / (duplex_slots_total{_sel(runtime)} > 0)",
        },
        {
            "record": f"duplex:ticks_over_budget:ratio_rate{window}",
            "expr": f"rate(duplex_ticks_over_budget_total{_sel(runtime)}[{window}]) / "
            f"rate(duplex_ticks_total{_sel(runtime)}[{window}])",
        },
        {
            "record": f"duplex:admissions_refused:rate{window}",
            "expr": f"rate(duplex_admissions_refused_total{_sel(runtime)}[{window}])",
        },
        {
            "record": f"duplex:frames_dropped:rate{window}",
            "expr": f"rate(duplex_frames_dropped_total{_sel(runtime)}[{window}])",
        },
    ]
    return rules + budget_recording_rules(_sel(runtime), window)


def alert_rules(
    profile: NodeProfile,
    runtime_selector: str = RUNTIME_SELECTOR,
    redis_selector: str = REDIS_SELECTOR,
    dcgm_selector: str = DCGM_SELECTOR,
) -> dict[str, Any]:
    """The rule file's content, ``{"groups": [recording group, alert group]}``, as a dict ready for
    ``yaml.safe_dump`` (or the ``spec`` of a Kubernetes ``PrometheusRule``).

    Thresholds: ``profile.limits.first_audio_p99_target_ms`` (milliseconds; compared in seconds),
    ``at_cap_alert_minutes``, ``gpu_memory_alert_fraction`` (0..1; ``GpuMemoryHigh`` only when
    ``profile.gpu`` is set) and ``TICKS_OVER_BUDGET_FRACTION``. The selectors are label-matcher lists
    without braces (``job="runtime"``; see the module docstring).

    Raises:
        ValueError: a selector is not a list of label matchers with a non-empty equality matcher.
    """
    runtime = _normalised(runtime_selector, "runtime_selector")
    redis = _normalised(redis_selector, "redis_selector")
    dcgm = _normalised(dcgm_selector, "dcgm_selector")
    alerts: list[dict[str, Any]] = []
    for name, expr, duration, severity, summary, description in _alert_specs(profile, runtime, redis, dcgm):
        rule: dict[str, Any] = {"alert": name, "expr": expr}
        if duration != "0s":
            rule["for"] = duration
        rule["labels"] = {"severity": severity}
        rule["annotations"] = {"summary": summary, "description": description}
        alerts.append(rule)
    return {
        "groups": [
            {"name": "duplex-node.recording", "rules": _recording_rules(runtime)},
            {"name": "duplex-node.alerts", "rules": alerts},
        ]
    }


# --- promtool unit tests -------------------------------------------------------------------------------


_Series = tuple[str, Mapping[str, str], str]
"""(metric name, labels, promtool values notation) of one input series."""


def _series(metric: str, labels: Mapping[str, str]) -> str:
    return metric + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _rate_per_s(increment_per_min: float, eval_min: int) -> float:
    """``rate(x[5m])`` at ``eval_min`` of a counter ``0+increment_per_min x N`` sampled each minute, as
    Prometheus computes it (every sample in the window, no extrapolation needed)."""
    assert eval_min >= _RATE_WINDOW_MIN
    first = increment_per_min * (eval_min - _RATE_WINDOW_MIN)
    last = increment_per_min * eval_min
    sampled = _RATE_WINDOW_MIN * 60.0
    return (last - first) * (sampled / sampled) / sampled


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's ``bucketQuantile`` for cumulative (upper bound, rate) buckets ending with +Inf."""
    rank = q * buckets[-1][1]
    b = next(i for i, (_, count) in enumerate(buckets[:-1]) if count >= rank)
    start, end, count = 0.0, buckets[b][0], buckets[b][1]
    if b > 0:
        start = buckets[b - 1][0]
        count -= buckets[b - 1][1]
        rank -= buckets[b - 1][1]
    return start + (end - start) * (rank / count)


def rules_unit_tests(
    profile: NodeProfile,
    runtime_selector: str = RUNTIME_SELECTOR,
    redis_selector: str = REDIS_SELECTOR,
    dcgm_selector: str = DCGM_SELECTOR,
    rule_file: str = "../rules/duplex-node.rules.yml",
) -> dict[str, Any]:
    """A ``promtool test rules`` file (as a dict) for ``alert_rules(profile, <same selectors>)``.

    One healthy group, where every alert stays silent (with data just on the good side of each threshold
    and ``bad_request`` and ``expired`` refusals, which do not alert), and for each alert a group where it
    fires, with its exact labels and annotations (values computed as Prometheus computes them), and is
    checked silent before its ``for`` duration has passed. Thresholds come from the profile, so the file is
    true for every profile; ``rule_file`` is relative to the test file's directory.

    Raises:
        ValueError: a selector is invalid, or has a non-equality matcher (no series can be synthesised).
    """
    rules = alert_rules(profile, runtime_selector, redis_selector, dcgm_selector)
    specs = {rule["alert"]: rule for rule in rules["groups"][1]["rules"]}
    limits = profile.limits
    cap_min = limits.at_cap_alert_minutes
    horizon = max(30, cap_min + 15)  # minutes of input data
    late = horizon - 5  # every `for` has passed
    slots = profile.sessions

    def labels_of(selector: str, service: Service, what: str, **extra: str) -> dict[str, str]:
        """The selector's labels, then the target labels the node's Prometheus adds (unless set)."""
        labels = _equality_labels(selector, what)
        for name, value in {"instance": endpoint(profile, service), "node": profile.name, **extra}.items():
            labels.setdefault(name, value)
        return labels

    rt = labels_of(runtime_selector, "runtime", "runtime_selector")
    rd = labels_of(redis_selector, "redis-exporter", "redis_selector")
    dc = (
        labels_of(dcgm_selector, "dcgm-exporter", "dcgm_selector", gpu="0") if profile.gpu is not None else {}
    )

    def steady(value: float) -> str:
        return f"{_num(value)}x{horizon}"

    def counter(per_min: float) -> str:
        return f"0+{_num(per_min)}x{horizon}"

    def expect(alert: str, labels: Mapping[str, str], value: float) -> dict[str, Any]:
        annotations = specs[alert]["annotations"]
        return {
            "exp_labels": {**labels, **specs[alert]["labels"]},
            "exp_annotations": {key: _expand(text, labels, value) for key, text in annotations.items()},
        }

    def check(alert: str, at_min: int, *expected: dict[str, Any]) -> dict[str, Any]:
        return {"eval_time": f"{at_min}m", "alertname": alert, "exp_alerts": list(expected)}

    def group(name: str, series: list[_Series], *tests: dict[str, Any]) -> dict:
        return {
            "name": name,
            "interval": "1m",
            "input_series": [{"series": _series(m, lab), "values": values} for m, lab, values in series],
            "alert_rule_test": list(tests),
        }

    # First-audio histogram: three buckets around the target, all observations in one of them.
    target_s = limits.first_audio_p99_target_ms / 1000
    below, above = round(0.95 * target_s, 6), round(1.1 * target_s, 6)
    bucket = "duplex_first_audio_latency_seconds_bucket"

    def first_audio(slow: bool) -> list[_Series]:
        return [
            (bucket, {**rt, "le": _num(below)}, counter(0 if slow else 10)),
            (bucket, {**rt, "le": _num(above)}, counter(10)),
            (bucket, {**rt, "le": "+Inf"}, counter(10)),
        ]

    def first_audio_p99(slow: bool) -> float:
        r = _rate_per_s(10, late)
        return _quantile(0.99, [(below, 0.0 if slow else r), (above, r), (math.inf, r)])

    ticks_per_min = 10000.0
    good_over, bad_over = (
        ticks_per_min * TICKS_OVER_BUDGET_FRACTION / 2,
        ticks_per_min * TICKS_OVER_BUDGET_FRACTION * 2,
    )
    # Framebuffer in MiB (as DCGM reports it): used just below and well above the alert fraction.
    fb_total = 81920
    gpu_fraction = limits.gpu_memory_alert_fraction
    good_used = round(fb_total * gpu_fraction * 0.9)
    bad_used = round(fb_total * (1 + gpu_fraction) / 2)
    if good_used / fb_total >= gpu_fraction:
        good_used = 0
    if bad_used / fb_total <= gpu_fraction:
        bad_used = fb_total

    healthy: list[_Series] = [
        ("up", rt, steady(1)),
        ("duplex_ready", rt, steady(1)),
        ("duplex_draining", rt, steady(0)),
        ("duplex_slots_total", rt, steady(slots)),
        ("duplex_active_sessions", rt, steady(slots - 1)),
        ("duplex_ticks_total", rt, counter(ticks_per_min)),
        ("duplex_ticks_over_budget_total", rt, counter(good_over)),
        *first_audio(slow=False),
        ("duplex_admissions_refused_total", {**rt, "reason": "node_full"}, steady(0)),
        ("duplex_admissions_refused_total", {**rt, "reason": "draining"}, steady(0)),
        ("duplex_admissions_refused_total", {**rt, "reason": "bad_request"}, counter(4)),
        ("duplex_admissions_refused_total", {**rt, "reason": "expired"}, counter(4)),
        ("up", rd, steady(1)),
        ("redis_up", rd, steady(1)),
    ]
    if profile.gpu is not None:
        healthy += [
            ("DCGM_FI_DEV_FB_USED", dc, steady(good_used)),
            ("DCGM_FI_DEV_FB_FREE", dc, steady(fb_total - good_used)),
        ]
    healthy_group = group("healthy node: no alert", healthy, *(check(alert, late) for alert in specs))
    healthy_group["promql_expr_test"] = [
        {
            "expr": "duplex:session_utilisation:ratio",
            "eval_time": f"{late}m",
            "exp_samples": [
                {"labels": _series("duplex:session_utilisation:ratio", rt), "value": (slots - 1) / slots}
            ],
        }
    ]

    def with_series(
        base: list[_Series], metric: str, labels: Mapping[str, str], values: str
    ) -> list[_Series]:
        """``base`` with the series (metric, labels) given these values (added if missing)."""
        return [s for s in base if not (s[0] == metric and s[1] == labels)] + [(metric, labels, values)]

    groups = [healthy_group]
    groups.append(
        group(
            "RuntimeDown: runtime scrape failing",
            with_series(healthy, "up", rt, steady(0)),
            check("RuntimeDown", 0),
            check("RuntimeDown", late, expect("RuntimeDown", rt, 0)),
        )
    )
    absent_labels = _equality_labels(runtime_selector, "runtime_selector")
    groups.append(
        group(
            "RuntimeDown: no runtime target",
            [s for s in healthy if not (s[0] == "up" and s[1] == rt)],
            check("RuntimeDown", late, expect("RuntimeDown", absent_labels, 1)),
        )
    )
    groups.append(
        group(
            "RuntimeNotReady: not ready, not draining",
            with_series(healthy, "duplex_ready", rt, steady(0)),
            check("RuntimeNotReady", 1),
            check("RuntimeNotReady", late, expect("RuntimeNotReady", rt, 0)),
        )
    )
    draining = with_series(healthy, "duplex_ready", rt, steady(0))
    draining = with_series(draining, "duplex_draining", rt, steady(1))
    groups.append(group("RuntimeNotReady: draining is expected", draining, check("RuntimeNotReady", late)))
    loading = with_series(healthy, "duplex_ready", rt, steady(0))
    loading = with_series(loading, "duplex_loading", rt, steady(1))
    groups.append(
        group(
            "RuntimeNotReady: loading is expected; RuntimeLoadingTooLong once it lasts",
            loading,
            check("RuntimeNotReady", late),
            check("RuntimeLoadingTooLong", LOADING_ALERT_MINUTES - 1),
            check("RuntimeLoadingTooLong", late, expect("RuntimeLoadingTooLong", rt, 1)),
        )
    )
    groups.append(
        group(
            "RedisDown: redis_exporter reports redis_up 0",
            with_series(healthy, "redis_up", rd, steady(0)),
            check("RedisDown", 0),
            check("RedisDown", late, expect("RedisDown", rd, 0)),
        )
    )
    no_redis_up = [s for s in with_series(healthy, "up", rd, steady(0)) if s[0] != "redis_up"]
    groups.append(
        group(
            "RedisDown: redis_exporter not scraped",
            no_redis_up,
            check("RedisDown", late, expect("RedisDown", rd, 0)),
        )
    )
    groups.append(
        group(
            "FirstAudioLatencyHigh: p99 just above the target",
            [s for s in healthy if s[0] != bucket] + first_audio(slow=True),
            check("FirstAudioLatencyHigh", 3),
            check("FirstAudioLatencyHigh", late, expect("FirstAudioLatencyHigh", rt, first_audio_p99(True))),
        )
    )
    bad_ratio = _rate_per_s(bad_over, late) / _rate_per_s(ticks_per_min, late)
    groups.append(
        group(
            "TicksOverBudget: twice the allowed share",
            with_series(healthy, "duplex_ticks_over_budget_total", rt, counter(bad_over)),
            check("TicksOverBudget", 3),
            check("TicksOverBudget", late, expect("TicksOverBudget", rt, bad_ratio)),
        )
    )
    full = with_series(healthy, "duplex_active_sessions", rt, steady(slots))
    groups.append(
        group(
            f"NodeAtSessionCap: full for {cap_min + 5} minutes",
            full,
            check("NodeAtSessionCap", cap_min - 1),
            check("NodeAtSessionCap", cap_min + 5, expect("NodeAtSessionCap", rt, slots)),
        )
    )
    refused = {**rt, "reason": "node_full"}
    # 3 refusals a minute for 10 minutes, then none: 15 in the 5 minutes before minute 8, 0 before 20.
    refusing = with_series(healthy, "duplex_admissions_refused_total", refused, f"0+3x10 30x{horizon - 10}")
    groups.append(
        group(
            "AdmissionsRefused: node_full refusals, then none",
            refusing,
            check("AdmissionsRefused", 8, expect("AdmissionsRefused", refused, 15)),
            check("AdmissionsRefused", 20),
        )
    )
    if profile.gpu is not None:
        gpu_bad = [s for s in healthy if not s[0].startswith("DCGM_")] + [
            ("DCGM_FI_DEV_FB_USED", dc, steady(bad_used)),
            ("DCGM_FI_DEV_FB_FREE", dc, steady(fb_total - bad_used)),
        ]
        groups.append(
            group(
                "GpuMemoryHigh: framebuffer above the threshold",
                gpu_bad,
                check("GpuMemoryHigh", 3),
                check(
                    "GpuMemoryHigh",
                    late,
                    expect("GpuMemoryHigh", dc, bad_used / (bad_used + (fb_total - bad_used))),
                ),
            )
        )
    groups.append(budget_test_group(rt, _RATE_WINDOW, _RATE_WINDOW_MIN, late))
    return {"rule_files": [rule_file], "evaluation_interval": "1m", "tests": groups}


# --- configuration ---------------------------------------------------------------------------------------


def prometheus_config(profile: NodeProfile) -> dict[str, Any]:
    """``prometheus.yml`` as a dict: ``profile.scrape_interval_s`` scrape and evaluation intervals,
    ``rule_files: [rules/*.yml]`` (relative to the configuration's directory), and one job per scraped
    service with its static target from ``endpoint(profile, service)`` and the label ``node`` =
    ``profile.name``. dcgm-exporter is scraped only when ``profile.gpu`` is set, coturn (the TURN relay's
    exporter) only in a ``compose`` node with the relay on (Debian's coturn, which the local node runs, is
    built without one). ``alerting`` sends the alerts to the node's Alertmanager
    (``infra.node.alertmanager``)."""
    # Job names are the service names.
    jobs: list[Service] = ["runtime", "prometheus", "node-exporter", "redis-exporter"]
    if profile.gpu is not None:
        jobs.append("dcgm-exporter")
    if profile.relay.enabled and profile.deployment == "compose":
        jobs.append("coturn")
    return {
        "global": {
            "scrape_interval": scrape_interval(profile),
            # A scrape must end before the next one starts: 1 s less than the interval (at least 1 s).
            "scrape_timeout": f"{max(1, profile.scrape_interval_s - 1)}s",
            "evaluation_interval": scrape_interval(profile),
            "external_labels": {"node": profile.name},
        },
        "alerting": {
            "alertmanagers": [{"static_configs": [{"targets": [endpoint(profile, "alertmanager")]}]}]
        },
        "rule_files": ["rules/*.yml"],
        "scrape_configs": [
            {
                "job_name": service,
                "metrics_path": "/metrics",
                "static_configs": [
                    {"targets": [endpoint(profile, service)], "labels": {"node": profile.name}}
                ],
            }
            for service in jobs
        ],
    }


def _dump(profile: NodeProfile, document: Mapping[str, Any]) -> bytes:
    text = yaml.safe_dump(
        dict(document), sort_keys=False, default_flow_style=False, allow_unicode=True, width=4096
    )
    return (_HEADER.format(name=profile.name) + text).encode()


def render_prometheus(profile: NodeProfile) -> dict[str, bytes]:
    """The node's Prometheus files, {path relative to the bundle root: content}: ``CONFIG_FILE``,
    ``RULES_FILE`` (``alert_rules`` with the node's selectors) and ``RULES_TEST_FILE``
    (``rules_unit_tests``). Deterministic: the same profile gives the same bytes."""
    return {
        CONFIG_FILE: _dump(profile, prometheus_config(profile)),
        RULES_FILE: _dump(profile, alert_rules(profile)),
        RULES_TEST_FILE: _dump(profile, rules_unit_tests(profile)),
    }


def prometheus_args(profile: NodeProfile, config_path: str, data_dir: str, listen_address: str) -> list[str]:
    """Prometheus's command-line arguments (without the program name): ``--config.file``,
    ``--storage.tsdb.path``, ``--storage.tsdb.retention.time`` = ``profile.retention.prometheus_days``
    days (retention is a flag, not configuration) and ``--web.listen-address`` (``host:port``). The
    lifecycle API (``--web.enable-lifecycle``) stays off: reloads go through SIGHUP.

    Raises:
        ValueError: an empty path or address.
    """
    for name, value in (
        ("config_path", config_path),
        ("data_dir", data_dir),
        ("listen_address", listen_address),
    ):
        if not value:
            raise ValueError(f"{name} must not be empty")
    return [
        f"--config.file={config_path}",
        f"--storage.tsdb.path={data_dir}",
        f"--storage.tsdb.retention.time={profile.retention.prometheus_days}d",
        f"--web.listen-address={listen_address}",
    ]
