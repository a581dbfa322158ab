"""Prometheus rules for what outlives a session's connection (issue 23): resume and recordings.

The runtime's series (``runtime/metrics.py``): ``duplex_sessions_detached_total`` (resumable sessions whose
connection was lost: slot held for ``DUPLEX_RESUME_S``), ``duplex_sessions_resumed_total``,
``duplex_resume_gap_seconds`` (histogram), ``duplex_resume_refused_total{reason}`` (``resume_expired``,
``resume_replayed``, ``resume_invalid``, ``resume_off``; also ``not_ready``, ``draining``, ``engine_lost``),
``duplex_recordings_total{side}``, ``duplex_recording_bytes_total{side}``,
``duplex_recording_errors_total{reason=queue_full|write}`` and ``duplex_recordings_swept_total``.

Alerts, each with its runbook in the description (docs/operations.md, "Alerts"):

- ``ResumeRefusalsHigh`` (ticket): more than ``RESUME_REFUSED_ALERT_FRACTION`` of the resume attempts over
  10 m refused, with at least ``RESUME_REFUSED_ALERT_MIN`` refusals in those 10 m, for 5 m;
- ``RecordingErrors`` (ticket): a recording fault in the last 10 m, by reason, at once (a consenting
  caller's recording has a hole, or stopped).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra.node.monitoring.promql import AlertSpec, RuleTestKit, Series, num, rate_per_s, sel, series

__all__ = [
    "RESUME_REFUSED_ALERT_FRACTION",
    "RESUME_REFUSED_ALERT_MIN",
    "SESSION_WINDOW",
    "session_alert_specs",
    "session_expression_tests",
    "session_healthy_series",
    "session_recording_rules",
    "session_test_groups",
]

RESUME_REFUSED_ALERT_FRACTION = 0.5
"""``ResumeRefusalsHigh`` fires above this share (0..1) of resume attempts refused."""
RESUME_REFUSED_ALERT_MIN = 10
"""``ResumeRefusalsHigh`` needs at least this many refusals in ``SESSION_WINDOW``."""

SESSION_WINDOW = "10m"
_WINDOW_MIN = 10
_REFUSED = "duplex_resume_refused_total"


def _refused(runtime: str, fn: str = "rate") -> str:
    return f"sum without (reason) ({fn}({_REFUSED}{sel(runtime)}[{SESSION_WINDOW}]))"


def _refused_ratio(runtime: str) -> str:
    """Resumes refused / resume attempts (refused + granted), over ``SESSION_WINDOW``."""
    resumed = f"rate(duplex_sessions_resumed_total{sel(runtime)}[{SESSION_WINDOW}])"
    return f"{_refused(runtime)} / ({_refused(runtime)} + {resumed})"


def session_recording_rules(runtime: str) -> list[dict[str, str]]:
    """Per runtime target (``runtime``: normalised matchers without braces), over ``SESSION_WINDOW``: the
    refused share of resume attempts, resume refusals by reason, the resume gap's p50 and p99, recording
    bytes a second by side, and recording faults by reason."""
    w = SESSION_WINDOW
    gap = f"rate(duplex_resume_gap_seconds_bucket{sel(runtime)}[{w}])"
    return [
        {"record": f"duplex:resume_refused:ratio_rate{w}", "expr": _refused_ratio(runtime)},
        {"record": f"duplex:resume_refused:rate{w}", "expr": f"rate({_REFUSED}{sel(runtime)}[{w}])"},
        {"record": f"duplex:resume_gap_seconds:p50_{w}", "expr": f"histogram_quantile(0.5, {gap})"},
        {"record": f"duplex:resume_gap_seconds:p99_{w}", "expr": f"histogram_quantile(0.99, {gap})"},
        {
            "record": f"duplex:recording_bytes:rate{w}",
            "expr": f"rate(duplex_recording_bytes_total{sel(runtime)}[{w}])",
        },
        {
            "record": f"duplex:recording_errors:rate{w}",
            "expr": f"rate(duplex_recording_errors_total{sel(runtime)}[{w}])",
        },
    ]


def session_alert_specs(runtime: str) -> list[AlertSpec]:
    """``ResumeRefusalsHigh`` and ``RecordingErrors`` (module docstring) for the runtime targets ``runtime``
    (normalised matchers without braces)."""
    where = "on {{ $labels.instance }} (node {{ $labels.node }})"
    return [
        AlertSpec(
            "ResumeRefusalsHigh",
            f"{_refused_ratio(runtime)} > {num(RESUME_REFUSED_ALERT_FRACTION)} "
            f"and {_refused(runtime, 'increase')} >= {RESUME_REFUSED_ALERT_MIN}",
            "5m",
            "ticket",
            "Most resumes refused " + where,
            "{{ $value | humanizePercentage }} of the attempts to resume a dropped session "
            + where
            + " over the last 10 minutes were refused, for 5 minutes (threshold "
            f"{num(RESUME_REFUSED_ALERT_FRACTION * 100)}%, at least {RESUME_REFUSED_ALERT_MIN} refusals). "
            "The dashboard's 'Resume refusals by reason' says which: resume_expired (callers come back after "
            "DUPLEX_RESUME_S: a longer hold, or a client that retries too slowly), resume_invalid or "
            "resume_replayed (a client bug, or someone guessing credentials: look at the addresses in the "
            "log), resume_off (clients ask for resume where DUPLEX_RESUME_S is 0), not_ready or draining.",
        ),
        AlertSpec(
            "RecordingErrors",
            f"increase(duplex_recording_errors_total{sel(runtime)}[{SESSION_WINDOW}]) > 0",
            "0s",
            "ticket",
            "Recording faults ({{ $labels.reason }}) " + where,
            "{{ $value | humanize }} recording faults with reason {{ $labels.reason }} " + where + " in "
            "the last 10 minutes. write: a disk error stopped that side of a consenting session's recording "
            "(check DUPLEX_RECORDING_DIR's disk: space, permissions, errors in the kernel log); queue_full: "
            "the PCM encoder fell behind and left audio out (the host's CPU is saturated).",
        ),
    ]


# --- promtool unit tests ---------------------------------------------------------------------------------


def session_healthy_series(kit: RuleTestKit, rt: Mapping[str, str]) -> list[Series]:
    """A healthy node's resume and recording series for runtime target labels ``rt``: 2 resumes a minute
    and 1 refusal (``resume_expired``) a minute, a third of the attempts; no recording fault."""
    return [
        ("duplex_sessions_detached_total", rt, kit.counter(3)),
        ("duplex_sessions_resumed_total", rt, kit.counter(2)),
        (_REFUSED, {**rt, "reason": "resume_expired"}, kit.counter(1)),
        (_REFUSED, {**rt, "reason": "resume_invalid"}, kit.counter(0)),
        ("duplex_recording_errors_total", {**rt, "reason": "write"}, kit.counter(0)),
        ("duplex_recording_errors_total", {**rt, "reason": "queue_full"}, kit.counter(0)),
    ]


def session_test_groups(
    kit: RuleTestKit, healthy: list[Series], rt: Mapping[str, str]
) -> list[dict[str, Any]]:
    """For each alert a group where it fires (exact labels and annotations) on ``healthy`` with one thing
    made bad, silent before its ``for``; and a group where a high refused share on few refusals is quiet."""
    late, check, expect, group, with_series = kit.late, kit.check, kit.expect, kit.group, kit.with_series

    def rate(per_min: float) -> float:
        return rate_per_s(per_min, late, _WINDOW_MIN)

    invalid = {**rt, "reason": "resume_invalid"}
    guessing = with_series(healthy, _REFUSED, invalid, kit.counter(5))
    refused_share = (rate(1) + rate(5)) / (rate(1) + rate(5) + rate(2))
    few = with_series(healthy, "duplex_sessions_resumed_total", rt, kit.counter(0))
    few = with_series(few, _REFUSED, {**rt, "reason": "resume_expired"}, kit.counter(0.9))
    write = {**rt, "reason": "write"}
    # 2 write errors a minute for 5 minutes, then none: 6 in the 10 minutes before minute 12, 0 before 20.
    faulty = with_series(healthy, "duplex_recording_errors_total", write, f"0+2x5 10x{kit.horizon - 5}")
    return [
        group(
            "ResumeRefusalsHigh: resume_invalid refusals, 75 % of the attempts",
            guessing,
            check("ResumeRefusalsHigh", 3),
            check("ResumeRefusalsHigh", late, expect("ResumeRefusalsHigh", rt, refused_share)),
        ),
        group(
            "ResumeRefusalsHigh: every attempt refused, but only 9 in 10 minutes",
            few,
            check("ResumeRefusalsHigh", late),
        ),
        group(
            "RecordingErrors: write errors, then none",
            faulty,
            check("RecordingErrors", 12, expect("RecordingErrors", write, 6)),
            check("RecordingErrors", 20),
        ),
    ]


def session_expression_tests(kit: RuleTestKit, rt: Mapping[str, str]) -> list[dict[str, Any]]:
    """``promql_expr_test`` cases for the healthy group: the recorded refused share of resume attempts."""
    rate = rate_per_s(1, kit.late, _WINDOW_MIN), rate_per_s(2, kit.late, _WINDOW_MIN)
    record = f"duplex:resume_refused:ratio_rate{SESSION_WINDOW}"
    return [
        {
            "expr": record,
            "eval_time": f"{kit.late}m",
            "exp_samples": [{"labels": series(record, rt), "value": rate[0] / (rate[0] + rate[1])}],
        }
    ]
