"""The node's Prometheus rules: ``alert_rules(profile)`` gives the rule file (a recording group and an alert
group), built from the runtime's metric names (``runtime.metrics``) and reusable by a Kubernetes stack
through label selectors (``infra.k8s.monitoring``); a selector without a non-empty equality matcher is
refused.

The node's own alerts (runtime up, ready and loading, Redis, first-audio latency, ticks over budget, slot cap,
refusals, GPU memory) are here; the first-audio budget's recording rules come from
``infra.node.monitoring.first_audio_rules``, WebRTC's and the TURN relay's rules from
``infra.node.monitoring.rtc_rules``, resume's and recordings' from ``infra.node.monitoring.session_rules``,
the certificate's (``tls.mode: acme``) from ``infra.node.monitoring.cert_rules``. Their
``promtool test rules`` file: ``infra.node.monitoring.alert_rule_tests``. The rules, each alert's condition
and the selectors: docs/operations.md, "Alerts".
"""

from __future__ import annotations

from types import EllipsisType
from typing import Any

from infra.node.monitoring.cert_rules import cert_alert_specs, cert_rules_apply
from infra.node.monitoring.first_audio_rules import budget_recording_rules
from infra.node.monitoring.promql import RATE_WINDOW, AlertSpec, normalised, num, sel
from infra.node.monitoring.rtc_rules import (
    coturn_exported,
    rtc_alert_specs,
    rtc_recording_rules,
    turn_alert_specs,
)
from infra.node.monitoring.session_rules import session_alert_specs, session_recording_rules
from infra.node.profile.profiles import NodeProfile

__all__ = [
    "COTURN_SELECTOR",
    "DCGM_SELECTOR",
    "LOADING_ALERT_MINUTES",
    "NODE_SIDE_REFUSALS",
    "REDIS_MEMORY_ALERT_FRACTION",
    "REDIS_SELECTOR",
    "RUNTIME_SELECTOR",
    "TICKS_OVER_BUDGET_FRACTION",
    "alert_rules",
    "alert_specs",
    "coturn_rule_selector",
]

LOADING_ALERT_MINUTES = 20
"""Minutes of ``duplex_loading`` 1 before ``RuntimeLoadingTooLong`` (a 7B load takes a few minutes)."""

RUNTIME_SELECTOR = 'job="runtime"'
"""Label matchers selecting the runtime's targets on a node."""
REDIS_SELECTOR = 'job="redis-exporter"'
"""Label matchers selecting redis_exporter's targets on a node."""
REDIS_MEMORY_ALERT_FRACTION = 0.9
"""``RedisMemoryNearFull`` fires past this share of ``maxmemory`` (redis_exporter's
``redis_memory_used_bytes`` over ``redis_memory_max_bytes``): room for the last minutes of writes before
``noeviction`` refuses them."""
DCGM_SELECTOR = 'job="dcgm-exporter"'
"""Label matchers selecting dcgm-exporter's targets on a node."""
COTURN_SELECTOR = 'job="coturn"'
"""Label matchers selecting coturn's exporter on a node (scraped where ``coturn_exported(profile)``)."""


NODE_SIDE_REFUSALS = ("node_full", "draining", "replay_check_unavailable")
"""``duplex_admissions_refused_total`` reasons that ``AdmissionsRefused`` alerts on: the node's own
capacity or availability. The others (a bad request, a missing or invalid token, a foreign origin) are the
client's."""

TICKS_OVER_BUDGET_FRACTION = 0.01
"""``TicksOverBudget`` fires above this share (0..1) of busy ticks longer than the 80 ms frame."""


def _node_alert_specs(profile: NodeProfile, runtime: str, redis: str, dcgm: str) -> list[AlertSpec]:
    """The node's own alerts (module docstring) for these normalised selectors."""
    limits = profile.limits
    target_ms = limits.first_audio_p99_target_ms
    window = RATE_WINDOW
    over = num(TICKS_OVER_BUDGET_FRACTION)
    node_side = f'reason=~"{"|".join(NODE_SIDE_REFUSALS)}"'
    specs = [
        (
            "RuntimeDown",
            f"up{sel(runtime)} == 0 or absent(up{sel(runtime)})",
            "1m",
            "page",
            "Runtime {{ $labels.instance }} is down",
            "Prometheus has failed to scrape the runtime target '{{ $labels.instance }}' (node "
            "{{ $labels.node }}), or has no runtime target at all, for 1 minute: the node serves no "
            "sessions.",
        ),
        (
            "RuntimeNotReady",
            f"duplex_ready{sel(runtime)} == 0 unless duplex_draining{sel(runtime)} == 1 "
            f"unless duplex_loading{sel(runtime)} == 1",
            "2m",
            "page",
            "Runtime {{ $labels.instance }} is not ready",
            "duplex_ready has been {{ $value | humanize }} on {{ $labels.instance }} (node "
            "{{ $labels.node }}) for 2 minutes while the runtime is neither draining nor loading its model: "
            "it admits no sessions.",
        ),
        (
            "RuntimeLoadingTooLong",
            f"duplex_loading{sel(runtime)} == 1",
            f"{LOADING_ALERT_MINUTES}m",
            "ticket",
            "Runtime {{ $labels.instance }} is still loading its model",
            f"{{{{ $labels.instance }}}} (node {{{{ $labels.node }}}}) has been loading its model for "
            f"{LOADING_ALERT_MINUTES} minutes: the weights download or load is stuck or far slower than "
            "usual (a 7B model loads in a few minutes from a warm cache). Check the runtime's log.",
        ),
        (
            "RedisDown",
            f"redis_up{sel(redis)} == 0 or up{sel(redis)} == 0 or absent(up{sel(redis)})",
            "1m",
            "page",
            "Redis behind {{ $labels.instance }} is down",
            "redis_exporter '{{ $labels.instance }}' (node {{ $labels.node }}) has reported Redis down, or "
            "could not be scraped, for 1 minute (value {{ $value | humanize }}): session state and "
            "transcripts are not being stored.",
        ),
        (
            "RedisMemoryNearFull",
            f"redis_memory_used_bytes{sel(redis)} / (redis_memory_max_bytes{sel(redis)} > 0) "
            f"> {num(REDIS_MEMORY_ALERT_FRACTION)}",
            "5m",
            "page",
            "Redis behind {{ $labels.instance }} is near its maxmemory",
            "Redis on node {{ $labels.node }} uses {{ $value | humanizePercentage }} of its maxmemory. With "
            "noeviction (issue 34: a full Redis must not drop the spent-token markers) writes fail once it "
            "is full: new sessions are refused (the replay check fails closed) and transcripts stop being "
            "written. Raise retention.redis_max_memory_mb or shorten DUPLEX_TRANSCRIPT_TTL_S.",
        ),
        (
            "FirstAudioLatencyHigh",
            f"histogram_quantile(0.99, rate(duplex_first_audio_latency_seconds_bucket{sel(runtime)}"
            f"[{window}])) > {num(target_ms / 1000)}",
            "5m",
            "page",
            f"First-audio latency p99 above {num(target_ms)} ms on {{{{ $labels.instance }}}}",
            "The p99 time from a session's first input frame to its first output frame over the last 5 "
            "minutes is {{ $value | humanizeDuration }} on {{ $labels.instance }} (node {{ $labels.node }}); "
            f"the node's target is {num(target_ms)} ms (profile limits.first_audio_p99_target_ms).",
        ),
        (
            "TicksOverBudget",
            f"rate(duplex_ticks_over_budget_total{sel(runtime)}[{window}]) / "
            f"rate(duplex_ticks_total{sel(runtime)}[{window}]) > {over}",
            "5m",
            "page",
            "Ticks over the 80 ms budget on {{ $labels.instance }}",
            "{{ $value | humanizePercentage }} of busy ticks on {{ $labels.instance }} (node "
            "{{ $labels.node }}) took longer than the 80 ms frame over the last 5 minutes (threshold "
            f"{num(TICKS_OVER_BUDGET_FRACTION * 100)}%): every session on the node hears gaps.",
        ),
        (
            "NodeAtSessionCap",
            f"duplex_active_sessions{sel(runtime)} >= duplex_slots_total{sel(runtime)} "
            f"and duplex_slots_total{sel(runtime)} > 0",
            f"{limits.at_cap_alert_minutes}m",
            "ticket",
            "Node {{ $labels.node }} is at its session cap",
            "All {{ $value | humanize }} slots of {{ $labels.instance }} (node {{ $labels.node }}) have "
            f"been in use for {limits.at_cap_alert_minutes} minutes (profile "
            "limits.at_cap_alert_minutes): new sessions are refused; add capacity.",
        ),
        (
            "AdmissionsRefused",
            f"increase(duplex_admissions_refused_total{sel(runtime, node_side)}[{window}]) > 0",
            "0s",
            "ticket",
            "Sessions refused on {{ $labels.instance }} ({{ $labels.reason }})",
            "{{ $value | humanize }} sessions were refused with reason {{ $labels.reason }} on "
            "{{ $labels.instance }} (node {{ $labels.node }}) in the last 5 minutes.",
        ),
    ]
    if profile.gpu is not None:
        fraction = limits.gpu_memory_alert_fraction
        used, free = f"DCGM_FI_DEV_FB_USED{sel(dcgm)}", f"DCGM_FI_DEV_FB_FREE{sel(dcgm)}"
        specs.append(
            (
                "GpuMemoryHigh",
                f"{used} / ({used} + {free}) > {num(fraction)}",
                "5m",
                "ticket",
                "GPU {{ $labels.gpu }} memory high on {{ $labels.instance }}",
                "GPU {{ $labels.gpu }} on {{ $labels.instance }} (node {{ $labels.node }}) has used "
                "{{ $value | humanizePercentage }} of its framebuffer for 5 minutes (threshold "
                f"{num(fraction * 100)}%, profile limits.gpu_memory_alert_fraction).",
            )
        )
    return [AlertSpec(*spec) for spec in specs]


def _recording_rules(runtime: str) -> list[dict[str, str]]:
    window = RATE_WINDOW
    rules: list[dict[str, str]] = []
    for metric in ("tick_duration_seconds", "first_audio_latency_seconds"):
        for name, q in (("p50", "0.5"), ("p99", "0.99")):
            rules.append(
                {
                    "record": f"duplex:{metric}:{name}_{window}",
                    "expr": f"histogram_quantile({q}, rate(duplex_{metric}_bucket{sel(runtime)}[{window}]))",
                }
            )
    rules += [
        {
            "record": "duplex:session_utilisation:ratio",
            "expr": f"duplex_active_sessions{sel(runtime)} / (duplex_slots_total{sel(runtime)} > 0)",
        },
        {
            "record": f"duplex:ticks_over_budget:ratio_rate{window}",
            "expr": f"rate(duplex_ticks_over_budget_total{sel(runtime)}[{window}]) / "
            f"rate(duplex_ticks_total{sel(runtime)}[{window}])",
        },
        {
            "record": f"duplex:admissions_refused:rate{window}",
            "expr": f"rate(duplex_admissions_refused_total{sel(runtime)}[{window}])",
        },
        {
            "record": f"duplex:frames_dropped:rate{window}",
            "expr": f"rate(duplex_frames_dropped_total{sel(runtime)}[{window}])",
        },
    ]
    rules += budget_recording_rules(sel(runtime), window)
    return rules + rtc_recording_rules(runtime) + session_recording_rules(runtime)


def alert_specs(
    profile: NodeProfile,
    runtime_selector: str = RUNTIME_SELECTOR,
    redis_selector: str = REDIS_SELECTOR,
    dcgm_selector: str = DCGM_SELECTOR,
    coturn_selector: str | None | EllipsisType = ...,
) -> list[AlertSpec]:
    """Every alert of ``alert_rules`` (same arguments), in the rule file's order.

    Raises:
        ValueError: as ``alert_rules``.
    """
    runtime = normalised(runtime_selector, "runtime_selector")
    redis = normalised(redis_selector, "redis_selector")
    dcgm = normalised(dcgm_selector, "dcgm_selector")
    specs = _node_alert_specs(profile, runtime, redis, dcgm) + rtc_alert_specs(runtime)
    coturn = coturn_rule_selector(profile, coturn_selector)
    if coturn is not None:
        specs += turn_alert_specs(normalised(coturn, "coturn_selector"))
    specs += session_alert_specs(runtime)
    if cert_rules_apply(profile):  # the node's own certificate (certbot's metrics through node_exporter)
        specs += cert_alert_specs()
    return specs


def coturn_rule_selector(
    profile: NodeProfile, coturn_selector: str | None | EllipsisType = ...
) -> str | None:
    """The selector of the TURN relay's exporter that the rules use: ``coturn_selector``, or for ``...`` the
    node's (``COTURN_SELECTOR`` where ``coturn_exported(profile)``, else None: no relay rules)."""
    if coturn_selector is ...:
        return COTURN_SELECTOR if coturn_exported(profile) else None
    return coturn_selector


def alert_rules(
    profile: NodeProfile,
    runtime_selector: str = RUNTIME_SELECTOR,
    redis_selector: str = REDIS_SELECTOR,
    dcgm_selector: str = DCGM_SELECTOR,
    coturn_selector: str | None | EllipsisType = ...,
) -> dict[str, Any]:
    """The rule file's content, ``{"groups": [recording group, alert group]}``, as a dict ready for
    ``yaml.safe_dump`` (or the ``spec`` of a Kubernetes ``PrometheusRule``).

    Thresholds: ``profile.limits.first_audio_p99_target_ms`` (milliseconds; compared in seconds),
    ``at_cap_alert_minutes``, ``gpu_memory_alert_fraction`` (0..1; ``GpuMemoryHigh`` only when
    ``profile.gpu`` is set) and ``TICKS_OVER_BUDGET_FRACTION``. The selectors are label-matcher lists
    without braces (``job="runtime"``; see the module docstring). ``coturn_selector`` selects the TURN
    relay's exporter: ``...`` (the default) is the node's, ``COTURN_SELECTOR`` where the node scrapes one
    (``coturn_exported(profile)``) and none elsewhere; None: no relay alerts.

    Raises:
        ValueError: a selector is not a list of label matchers with a non-empty equality matcher.
    """
    runtime = normalised(runtime_selector, "runtime_selector")
    alerts = alert_specs(profile, runtime_selector, redis_selector, dcgm_selector, coturn_selector)
    return {
        "groups": [
            {"name": "duplex-node.recording", "rules": _recording_rules(runtime)},
            {"name": "duplex-node.alerts", "rules": [spec.rule() for spec in alerts]},
        ]
    }
