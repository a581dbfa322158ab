"""The node dashboard's row for what outlives a connection (issue 23,
``infra.node.monitoring.grafana.node_dashboard``): resume (sessions detached, resumed, refusals by reason, the
resume gap) and recordings (files, bytes and faults by side or reason, the retention sweep). The series:
``runtime/metrics.py``; the alerts on them: ``infra.node.monitoring.session_rules``."""

from __future__ import annotations

from grafana_foundation_sdk.models import units

from infra.node.monitoring.grafana_panels import PanelBuilder, PanelKit

__all__ = ["resume_and_recordings_row"]


def resume_and_recordings_row(kit: PanelKit) -> list[PanelBuilder]:
    """Detached and resumed sessions, resume refusals by reason, resume gap p50/p99; recordings written and
    bytes by side, recording faults by reason and files swept."""
    gap = "duplex_resume_gap_seconds"
    return [
        kit.timeseries(
            "Sessions detached and resumed",
            "Resumable sessions whose connection was lost without a close (their slot held, paused, for "
            "DUPLEX_RESUME_S), and those resumed with their credential, per second.",
            units.CountsPerSecond,
            [
                (f"sum({kit.rate('duplex_sessions_detached_total')})", "detached"),
                (f"sum({kit.rate('duplex_sessions_resumed_total')})", "resumed"),
            ],
            width=8,
        ),
        kit.timeseries(
            "Resume refusals by reason",
            "Resumes refused per second: resume_expired (after the hold), resume_replayed, resume_invalid "
            "(a client bug or guessing), resume_off, not_ready, draining, engine_lost.",
            units.CountsPerSecond,
            [(f"sum by (reason) ({kit.rate('duplex_resume_refused_total')})", "{{reason}}")],
            width=8,
            bars=True,
        ),
        kit.timeseries(
            "Resume gap p50 / p99",
            "From a session's last input frame before the drop to its resume granted: what the caller "
            "missed (the hold, DUPLEX_RESUME_S, bounds it).",
            units.Seconds,
            [(kit.quantile(0.5, gap, "10m"), "p50"), (kit.quantile(0.99, gap, "10m"), "p99")],
            width=8,
        ),
        kit.timeseries(
            "Recordings written by side",
            "Recording files finished per second (one per side of a consenting session: caller, agent).",
            units.CountsPerSecond,
            [(f"sum by (side) ({kit.rate('duplex_recordings_total')})", "{{side}}")],
            width=8,
        ),
        kit.timeseries(
            "Recording bytes by side",
            "Ogg Opus bytes written to recordings per second, by side.",
            units.BytesPerSecondSI,
            [(f"sum by (side) ({kit.rate('duplex_recording_bytes_total')})", "{{side}}")],
            width=8,
        ),
        kit.timeseries(
            "Recording faults and sweeps",
            "Recording faults per second by reason (write: a disk error stopped that side; queue_full: the "
            "PCM encoder fell behind and left audio out), and files deleted by the retention sweep.",
            units.CountsPerSecond,
            [
                (f"sum by (reason) ({kit.rate('duplex_recording_errors_total')})", "{{reason}}"),
                (f"sum({kit.rate('duplex_recordings_swept_total')})", "swept"),
            ],
            width=8,
        ),
    ]
