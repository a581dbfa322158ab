"""The node dashboard's own rows (``infra.node.monitoring.grafana.node_dashboard``): sessions against the slot
cap, tick time against the 80 ms frame budget, first-audio latency against the profile's p99 target and its
budget term by term, refusals and drops by reason, GPU memory, utilisation and power from dcgm-exporter
(GPU nodes only), Redis health from redis_exporter and the runtime's own session-store counters, readiness,
draining and scrape health. Each function gives one row's panels, 24 columns wide in all."""

from __future__ import annotations

from grafana_foundation_sdk.models import units

from infra.node.monitoring.grafana_panels import BYTES_PER_MIB, PanelBuilder, PanelKit
from runtime.engine.model_presets import FRAME_MS

__all__ = [
    "FIRST_AUDIO_TIME_TERMS",
    "FIRST_AUDIO_WINDOW",
    "gpu_row",
    "health_row",
    "latency_row",
    "redis_row",
    "refusals_and_drops_row",
    "sessions_row",
]

FIRST_AUDIO_WINDOW = "10m"
"""Rate window of the first-audio quantiles: one observation per session start, too few for short windows."""
FIRST_AUDIO_TIME_TERMS = ("ingress", "phase_wait", "tick_compute", "egress")
"""The first-audio budget's terms observed in seconds (``runtime/metrics.py``: ``duplex_first_audio_<term>_
seconds``); the fifth, ``duplex_first_audio_ticks``, is a count of 80 ms ticks."""


def sessions_row(kit: PanelKit) -> list[PanelBuilder]:
    """Sessions against the slot cap, slot utilisation, session starts."""
    active, slots = kit.m("duplex_active_sessions"), kit.m("duplex_slots_total")
    return [
        kit.timeseries(
            "Sessions vs cap",
            "Sessions holding a batch slot against the node's slot count (nginx caps connections at it).",
            units.Short,
            [(f"sum({active})", "active"), (f"sum({slots})", "slots")],
            width=8,
            decimals=0,
        ),
        kit.timeseries(
            "Slot utilisation",
            "Active sessions / slots. At 100% new sessions are refused (node_full).",
            units.PercentUnit,
            [(f"sum({active}) / sum({slots})", "utilisation")],
            width=8,
            max_value=1,
            threshold=(1.0, "full"),
        ),
        kit.timeseries(
            "Session starts",
            "Sessions admitted per second.",
            units.CountsPerSecond,
            [(f"sum({kit.rate('duplex_sessions_started_total')})", "started")],
            width=8,
        ),
    ]


def latency_row(kit: PanelKit, first_audio_target_s: float, stagger_groups: int = 1) -> list[PanelBuilder]:
    """The latency row; ``stagger_groups`` 2: the tick budget is the 40 ms sub-tick period."""
    period_ms = FRAME_MS / stagger_groups
    budget = (
        f"the {FRAME_MS:g} ms frame budget"
        if stagger_groups == 1
        else f"the {period_ms:g} ms sub-tick period ({stagger_groups} staggered groups)"
    )
    over = f"sum({kit.rate('duplex_ticks_over_budget_total')})"
    ticks = f"sum({kit.rate('duplex_ticks_total')})"
    return [
        kit.timeseries(
            "Tick time p50 / p99",
            "Wall time of one batched tick (encode, LM step, decode).",
            units.Seconds,
            [
                (kit.quantile(0.5, "duplex_tick_duration_seconds"), "p50"),
                (kit.quantile(0.99, "duplex_tick_duration_seconds"), "p99"),
            ],
            width=8,
            threshold=(period_ms / 1000.0, budget),
        ),
        kit.timeseries(
            "Ticks over budget",
            f"Share of busy ticks that took longer than {budget}.",
            units.PercentUnit,
            [(f"{over} / {ticks}", "over budget")],
            width=8,
            max_value=1,
        ),
        kit.timeseries(
            "First-audio latency p50 / p99",
            "Time from a session's first input frame to its first output frame, over "
            f"{FIRST_AUDIO_WINDOW} windows.",
            units.Seconds,
            [
                (kit.quantile(0.5, "duplex_first_audio_latency_seconds", FIRST_AUDIO_WINDOW), "p50"),
                (kit.quantile(0.99, "duplex_first_audio_latency_seconds", FIRST_AUDIO_WINDOW), "p99"),
            ],
            width=8,
            threshold=(first_audio_target_s, f"the p99 target, {first_audio_target_s * 1000:g} ms"),
        ),
        *_first_audio_budget(kit),
    ]


def _first_audio_budget(kit: PanelKit) -> list[PanelBuilder]:
    """The first-audio latency budget's terms (docs/benchmarks.md, "First-audio latency budget"): their
    means stacked (they add up to the mean first audio, ticks counted at 80 ms each) and their p99s."""
    window = FIRST_AUDIO_WINDOW
    frame_s = FRAME_MS / 1000

    def mean(metric: str) -> str:
        return f"sum({kit.rate(metric + '_sum', window)}) / sum({kit.rate(metric + '_count', window)})"

    ticks = "duplex_first_audio_ticks"
    terms = [(f"duplex_first_audio_{t}_seconds", t.replace("_", " ")) for t in FIRST_AUDIO_TIME_TERMS]
    means = [(mean(m), label) for m, label in terms]
    means.insert(2, (f"{mean(ticks)} * {frame_s:g}", f"ticks x {FRAME_MS:g} ms"))
    p99s = [(kit.quantile(0.99, m, window), label) for m, label in terms]
    p99s.insert(2, (f"{kit.quantile(0.99, ticks, window)} * {frame_s:g}", f"ticks x {FRAME_MS:g} ms"))
    return [
        kit.timeseries(
            "First-audio budget by term (means, stacked)",
            "Where a session's first audio goes, term by term, means over "
            f"{window} windows: ingress (front end to the engine), phase wait (to the tick that takes "
            f"the first frame), ticks until audio x {FRAME_MS:g} ms (the acoustic delay: 1), that "
            "tick's compute, egress (to the socket). Stacked, they add up to the mean first audio.",
            units.Seconds,
            means,
            width=12,
            stacked=True,
        ),
        kit.timeseries(
            "First-audio budget by term (p99)",
            f"Each term's p99 over {window} windows (estimated within its histogram bucket; ticks "
            "within half a tick). The phase wait's is up to one tick period: 80 ms, or 40 ms with "
            "staggered sub-batches (DUPLEX_STAGGER_GROUPS=2).",
            units.Seconds,
            p99s,
            width=12,
        ),
    ]


def refusals_and_drops_row(kit: PanelKit) -> list[PanelBuilder]:
    """Admissions refused and frames dropped, by reason."""
    return [
        kit.timeseries(
            "Admissions refused by reason",
            "Sessions refused per second: node_full, draining, bad_request, and the access check's "
            "(missing, expired, bad_signature, replayed, origin_not_allowed, ...).",
            units.CountsPerSecond,
            [(f"sum by (reason) ({kit.rate('duplex_admissions_refused_total')})", "{{reason}}")],
            width=12,
            bars=True,
        ),
        kit.timeseries(
            "Frames dropped by reason",
            "Frames lost per second: late_input, input_overflow, slow_client.",
            units.CountsPerSecond,
            [(f"sum by (reason) ({kit.rate('duplex_frames_dropped_total')})", "{{reason}}")],
            width=12,
            bars=True,
        ),
    ]


def gpu_row(kit: PanelKit, memory_alert_mib: float) -> list[PanelBuilder]:
    """GPU memory (threshold line at ``memory_alert_mib``, MiB), utilisation and power (dcgm-exporter)."""
    used, free = kit.m("DCGM_FI_DEV_FB_USED"), kit.m("DCGM_FI_DEV_FB_FREE")
    allocated = kit.m("duplex_gpu_memory_allocated_bytes")
    return [
        kit.timeseries(
            "GPU memory",
            "Framebuffer used and used + free (dcgm-exporter), and what the runtime's torch allocated.",
            units.Mebibytes,
            [
                (f"sum({used})", "used"),
                (f"sum({used} + {free})", "used + free"),
                (f"sum({allocated}) / {BYTES_PER_MIB}", "torch allocated"),
            ],
            width=8,
            threshold=(memory_alert_mib, f"the alert threshold, {memory_alert_mib:g} MiB"),
        ),
        kit.timeseries(
            "GPU utilisation",
            "Share of time a kernel was running (dcgm-exporter).",
            units.Percent,
            [(f"avg({kit.m('DCGM_FI_DEV_GPU_UTIL')})", "utilisation")],
            width=8,
            max_value=100,
        ),
        kit.timeseries(
            "GPU power",
            "Board power draw (dcgm-exporter).",
            units.Watt,
            [(f"sum({kit.m('DCGM_FI_DEV_POWER_USAGE')})", "power")],
            width=8,
        ),
    ]


def redis_row(kit: PanelKit, max_memory_bytes: int) -> list[PanelBuilder]:
    """Redis up, memory (against ``max_memory_bytes``), clients, commands; the runtime's store backlog and
    errors."""
    return [
        kit.stat(
            "Redis up",
            "redis_exporter's view of Redis (down: the runtime's session store is failing).",
            [(f"min({kit.m('redis_up')})", "redis")],
            {"0": ("down", "red"), "1": ("up", "green")},
            width=4,
        ),
        kit.timeseries(
            "Redis memory",
            "Memory Redis uses.",
            units.BytesIEC,
            [(f"sum({kit.m('redis_memory_used_bytes')})", "used")],
            width=10,
            threshold=(float(max_memory_bytes), f"maxmemory, {max_memory_bytes // BYTES_PER_MIB} MiB"),
        ),
        kit.timeseries(
            "Redis clients",
            "Connected clients.",
            units.Short,
            [(f"sum({kit.m('redis_connected_clients')})", "clients")],
            width=10,
            decimals=0,
        ),
        kit.timeseries(
            "Session-store backlog",
            "Runtime session-store writes waiting for Redis (grows while Redis is unreachable).",
            units.Short,
            [(f"sum({kit.m('duplex_redis_backlog_ops')})", "backlog")],
            width=8,
            decimals=0,
        ),
        kit.timeseries(
            "Runtime Redis errors by op",
            "Failed Redis operations of the runtime per second.",
            units.CountsPerSecond,
            [(f"sum by (op) ({kit.rate('duplex_redis_errors_total')})", "{{op}}")],
            width=8,
            bars=True,
        ),
        kit.timeseries(
            "Redis commands",
            "Commands Redis processed per second.",
            units.OpsPerSecond,
            [(f"sum({kit.rate('redis_commands_processed_total')})", "commands")],
            width=8,
        ),
    ]


def health_row(kit: PanelKit) -> list[PanelBuilder]:
    """Readiness, draining and every scrape target's ``up``."""
    return [
        kit.stat(
            "Runtime ready",
            "1 when /readyz answers 200.",
            [(f"min({kit.m('duplex_ready')})", "ready")],
            {"0": ("not ready", "red"), "1": ("ready", "green")},
            width=6,
            height=5,
        ),
        kit.stat(
            "Runtime draining",
            "1 while the runtime drains after SIGTERM (no new sessions).",
            [(f"max({kit.m('duplex_draining')})", "draining")],
            {"0": ("serving", "green"), "1": ("draining", "orange")},
            width=6,
            height=5,
        ),
        kit.stat(
            "Scrape targets",
            "Prometheus's scrape of each job (runtime, prometheus, exporters).",
            [(f"min by (job) ({kit.m('up')})", "{{job}}")],
            {"0": ("down", "red"), "1": ("up", "green")},
            width=12,
            height=5,
        ),
    ]
