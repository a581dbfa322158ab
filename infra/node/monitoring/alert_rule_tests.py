"""``promtool test rules`` for the node's rules (``infra.node.monitoring.alert_rules.alert_rules``): one
healthy group where every alert stays silent, and for each alert a group where it fires, with its exact labels
and annotations, computed as Prometheus computes them (``infra.node.monitoring.promql``).
``infra.node.monitoring.prometheus`` renders the file beside the rules; ``infra.k8s.monitoring`` builds it for
a region's selectors.
"""

from __future__ import annotations

import math
from types import EllipsisType
from typing import Any

from infra.node.bundle.services import Service, endpoint
from infra.node.monitoring.alert_rules import (
    DCGM_SELECTOR,
    LOADING_ALERT_MINUTES,
    REDIS_MEMORY_ALERT_FRACTION,
    REDIS_SELECTOR,
    RUNTIME_SELECTOR,
    TICKS_OVER_BUDGET_FRACTION,
    alert_rules,
    coturn_rule_selector,
)
from infra.node.monitoring.cert_rules import (
    NODE_EXPORTER_SELECTOR,
    cert_healthy_series,
    cert_rules_apply,
    cert_test_groups,
)
from infra.node.monitoring.first_audio_rules import budget_test_group
from infra.node.monitoring.promql import (
    RATE_WINDOW,
    RATE_WINDOW_MIN,
    RuleTestKit,
    Series,
    bucket_quantile,
    equality_labels,
    num,
    rate_per_s,
    series,
)
from infra.node.monitoring.rtc_rules import (
    rtc_expression_tests,
    rtc_healthy_series,
    rtc_test_groups,
    turn_healthy_series,
    turn_test_groups,
)
from infra.node.monitoring.session_rules import (
    session_expression_tests,
    session_healthy_series,
    session_test_groups,
)
from infra.node.profile.profiles import NodeProfile

__all__ = ["rules_unit_tests"]

REDIS_MAX_BYTES = 512 * 1024 * 1024
"""The test series' Redis ``maxmemory`` (bytes): the node profile's default 512 MB."""


def rules_unit_tests(
    profile: NodeProfile,
    runtime_selector: str = RUNTIME_SELECTOR,
    redis_selector: str = REDIS_SELECTOR,
    dcgm_selector: str = DCGM_SELECTOR,
    coturn_selector: str | None | EllipsisType = ...,
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
    rules = alert_rules(profile, runtime_selector, redis_selector, dcgm_selector, coturn_selector)
    specs = {rule["alert"]: rule for rule in rules["groups"][1]["rules"]}
    limits = profile.limits
    cap_min = limits.at_cap_alert_minutes
    kit = RuleTestKit(specs, horizon=max(30, cap_min + 15))  # minutes of input data
    late = kit.late  # every `for` has passed
    steady, counter, expect, check = kit.steady, kit.counter, kit.expect, kit.check
    group, with_series = kit.group, kit.with_series
    slots = profile.sessions

    def labels_of(selector: str, service: Service, what: str, **extra: str) -> dict[str, str]:
        """The selector's labels, then the target labels the node's Prometheus adds (unless set)."""
        labels = equality_labels(selector, what)
        instance = (  # coturn's exporter also where the node itself runs none (a region's selector)
            f"coturn:{profile.relay.metrics_port}" if service == "coturn" else endpoint(profile, service)
        )
        for name, value in {"instance": instance, "node": profile.name, **extra}.items():
            labels.setdefault(name, value)
        return labels

    rt = labels_of(runtime_selector, "runtime", "runtime_selector")
    rd = labels_of(redis_selector, "redis-exporter", "redis_selector")
    dc = (
        labels_of(dcgm_selector, "dcgm-exporter", "dcgm_selector", gpu="0") if profile.gpu is not None else {}
    )
    coturn = coturn_rule_selector(profile, coturn_selector)
    tu = labels_of(coturn, "coturn", "coturn_selector") if coturn is not None else {}
    certs = cert_rules_apply(profile)
    ne = labels_of(NODE_EXPORTER_SELECTOR, "node-exporter", "node_exporter", domain=profile.domain)

    # First-audio histogram: three buckets around the target, all observations in one of them.
    target_s = limits.first_audio_p99_target_ms / 1000
    below, above = round(0.95 * target_s, 6), round(1.1 * target_s, 6)
    bucket = "duplex_first_audio_latency_seconds_bucket"

    def first_audio(slow: bool) -> list[Series]:
        return [
            (bucket, {**rt, "le": num(below)}, counter(0 if slow else 10)),
            (bucket, {**rt, "le": num(above)}, counter(10)),
            (bucket, {**rt, "le": "+Inf"}, counter(10)),
        ]

    def first_audio_p99(slow: bool) -> float:
        r = rate_per_s(10, late)
        return bucket_quantile(0.99, [(below, 0.0 if slow else r), (above, r), (math.inf, r)])

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

    healthy: list[Series] = [
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
        ("redis_memory_max_bytes", rd, steady(REDIS_MAX_BYTES)),
        ("redis_memory_used_bytes", rd, steady(REDIS_MAX_BYTES // 2)),
    ]
    if profile.gpu is not None:
        healthy += [
            ("DCGM_FI_DEV_FB_USED", dc, steady(good_used)),
            ("DCGM_FI_DEV_FB_FREE", dc, steady(fb_total - good_used)),
        ]
    healthy += rtc_healthy_series(kit, rt) + session_healthy_series(kit, rt)
    if coturn is not None:
        healthy += turn_healthy_series(kit, tu)
    if certs:
        healthy += cert_healthy_series(kit, ne)
    healthy_group = group("healthy node: no alert", healthy, *(check(alert, late) for alert in specs))
    healthy_group["promql_expr_test"] = [
        {
            "expr": "duplex:session_utilisation:ratio",
            "eval_time": f"{late}m",
            "exp_samples": [
                {"labels": series("duplex:session_utilisation:ratio", rt), "value": (slots - 1) / slots}
            ],
        },
        *rtc_expression_tests(kit, rt),
        *session_expression_tests(kit, rt),
    ]

    groups = [healthy_group]
    groups.append(
        group(
            "RuntimeDown: runtime scrape failing",
            with_series(healthy, "up", rt, steady(0)),
            check("RuntimeDown", 0),
            check("RuntimeDown", late, expect("RuntimeDown", rt, 0)),
        )
    )
    absent_labels = equality_labels(runtime_selector, "runtime_selector")
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
    near_full = round(REDIS_MAX_BYTES * (1 + REDIS_MEMORY_ALERT_FRACTION) / 2)
    groups.append(
        group(
            "RedisMemoryNearFull: used past the alert share of maxmemory",
            with_series(healthy, "redis_memory_used_bytes", rd, steady(near_full)),
            check("RedisMemoryNearFull", 3),
            check(
                "RedisMemoryNearFull", late, expect("RedisMemoryNearFull", rd, near_full / REDIS_MAX_BYTES)
            ),
        )
    )
    groups.append(
        group(
            "RedisMemoryNearFull: no maxmemory set is no alert",
            with_series(
                with_series(healthy, "redis_memory_max_bytes", rd, steady(0)),
                "redis_memory_used_bytes",
                rd,
                steady(REDIS_MAX_BYTES),
            ),
            check("RedisMemoryNearFull", late),
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
    bad_ratio = rate_per_s(bad_over, late) / rate_per_s(ticks_per_min, late)
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
    refusing = with_series(
        healthy, "duplex_admissions_refused_total", refused, f"0+3x10 30x{kit.horizon - 10}"
    )
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
    groups += rtc_test_groups(kit, healthy, rt) + session_test_groups(kit, healthy, rt)
    if coturn is not None:
        groups += turn_test_groups(kit, healthy, tu, equality_labels(coturn, "coturn_selector"))
    if certs:
        groups += cert_test_groups(kit, healthy, ne)
    groups.append(budget_test_group(rt, RATE_WINDOW, RATE_WINDOW_MIN, late))
    return {"rule_files": [rule_file], "evaluation_interval": "1m", "tests": groups}
