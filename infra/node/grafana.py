"""Grafana for one node: the Prometheus datasource, the dashboard provider and the node dashboard.

``render_grafana(profile)`` gives three files, the same bytes for the same profile:

- ``grafana/provisioning/datasources/prometheus.yml``: the node's Prometheus (``DATASOURCE_UID``), default,
  not editable from the UI;
- ``grafana/provisioning/dashboards/duplex.yml``: a file provider reading ``dashboards_path`` (where Compose
  mounts ``grafana/dashboards/``);
- ``grafana/dashboards/duplex-node.json``: the node dashboard (``node_dashboard``).

The dashboard is built with grafana-foundation-sdk's typed builders (the SDK release generated for Grafana
11.6, ``GRAFANA_VERSION``): sessions against the slot cap, tick time against the 80 ms frame budget,
first-audio latency against the profile's p99 target, refusals and drops by reason, GPU memory, utilisation
and power from dcgm-exporter (GPU nodes only), Redis health from redis_exporter and the runtime's own
session-store counters, readiness, draining and scrape health.

Every query is scoped by one label selector. On a node that is ``node="$node"`` (every scrape target carries
``node=<profile name>``, and the dashboard has a ``node`` variable defaulting to this node); a stack that
labels series differently (Kubernetes: ``namespace="duplex"``) passes its own to ``node_dashboard``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus as prometheus_builders
from grafana_foundation_sdk.builders import stat as stat_builders
from grafana_foundation_sdk.builders import timeseries as timeseries_builders
from grafana_foundation_sdk.cog import builder as cog_builder
from grafana_foundation_sdk.cog import variants as cog_variants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common, units
from grafana_foundation_sdk.models import dashboard as dashboard_models

from infra.capacity.gpus import GPUS
from infra.node.profile import NodeProfile
from infra.node.prometheus import scrape_interval
from infra.node.services import endpoint
from runtime.engine.model_presets import FRAME_MS

__all__ = [
    "DASHBOARDS_PATH",
    "DASHBOARD_FILE",
    "DATASOURCE_FILE",
    "DATASOURCE_TYPE",
    "DATASOURCE_UID",
    "NODE_SELECTOR",
    "PROVIDER_FILE",
    "TICK_BUDGET_S",
    "dashboard_bytes",
    "dashboard_uid",
    "datasource_yaml",
    "node_dashboard",
    "provider_yaml",
    "render_grafana",
]

DATASOURCE_FILE = "grafana/provisioning/datasources/prometheus.yml"
PROVIDER_FILE = "grafana/provisioning/dashboards/duplex.yml"
DASHBOARD_FILE = "grafana/dashboards/duplex-node.json"
"""Bundle paths of the rendered files."""

DASHBOARDS_PATH = "/var/lib/grafana/dashboards"
"""Where the Grafana container finds ``grafana/dashboards/`` (the Compose mount)."""

DATASOURCE_UID = "duplex-prometheus"
DATASOURCE_TYPE = "prometheus"
"""The provisioned datasource; every panel, query and variable of the dashboard refers to it by this uid."""

NODE_SELECTOR = 'node="$node"'
"""The default label selector: the series of the node picked in the dashboard's ``node`` variable."""

TICK_BUDGET_S = FRAME_MS / 1000.0
"""A tick must finish within one 80 ms frame (the runtime counts the ones that don't)."""

_FIRST_AUDIO_WINDOW = "10m"
FIRST_AUDIO_TIME_TERMS = ("ingress", "phase_wait", "tick_compute", "egress")
"""The first-audio budget's terms observed in seconds (``runtime/metrics.py``: ``duplex_first_audio_<term>_
seconds``); the fifth, ``duplex_first_audio_ticks``, is a count of 80 ms ticks."""
"""Rate window of the first-audio quantiles: one observation per session start, too few for short windows."""

_PanelBuilder = timeseries_builders.Panel | stat_builders.Panel

_UID_MAX = 40  # Grafana's limit on dashboard uids
_BYTES_PER_MIB = 1024 * 1024  # Redis's "mb" in maxmemory, dcgm-exporter's framebuffer unit


def dashboard_uid(profile: NodeProfile) -> str:
    """The node dashboard's uid: ``duplex-node-<name>``, or a digest of the name where that would exceed
    Grafana's 40 characters. Stable: the same profile name always gives the same uid."""
    uid = f"duplex-node-{profile.name}"
    if len(uid) <= _UID_MAX:
        return uid
    return f"duplex-node-{hashlib.sha256(profile.name.encode()).hexdigest()[: _UID_MAX - 12]}"


def render_grafana(profile: NodeProfile, dashboards_path: str = DASHBOARDS_PATH) -> dict[str, bytes]:
    """The node's Grafana files, ``{bundle path: content}``; the same arguments give the same bytes.

    ``dashboards_path`` is where Grafana reads ``grafana/dashboards/`` from (the container path in Compose).
    """
    return {
        DATASOURCE_FILE: _datasource_yaml(profile),
        PROVIDER_FILE: _provider_yaml(profile, dashboards_path),
        DASHBOARD_FILE: dashboard_bytes(node_dashboard(profile)),
    }


def dashboard_bytes(model: dashboard_models.Dashboard) -> bytes:
    """A dashboard model as Grafana's JSON: sorted keys, two-space indent, trailing newline."""
    return (json.dumps(model, cls=JSONEncoder, sort_keys=True, indent=2) + "\n").encode()


def node_dashboard(
    profile: NodeProfile,
    selector: str = NODE_SELECTOR,
    *,
    uid: str | None = None,
    title: str | None = None,
) -> dashboard_models.Dashboard:
    """The node dashboard for ``profile``, every query scoped by ``selector`` (PromQL label matchers
    without braces, e.g. ``node="$node"`` or ``namespace="duplex"``).

    The ``node`` template variable is added when the selector refers to ``$node``; its default is the
    profile's name. GPU rows (dcgm-exporter) appear only when ``profile.gpu`` is set. Thresholds follow the
    profile: the first-audio p99 target, Redis ``maxmemory`` and, on GPU nodes, the GPU-memory alert
    fraction of the catalog's memory. ``uid`` and ``title`` default to ones derived from the profile name.
    """
    panels = _Panels(selector)
    builder = (
        dashboard_builders.Dashboard(title or f"Duplex node {profile.name}")
        .uid(uid or dashboard_uid(profile))
        .description(
            f"Batched full-duplex runtime on node profile {profile.name!r} ({profile.sessions} slots, "
            f"{profile.gpu or 'CPU'}, {profile.model} {profile.precision}). Rendered by infra.node.grafana."
        )
        .tags(["duplex", "node"])
        .readonly()
        .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("utc")
    )
    if "$node" in selector:
        builder.with_variable(
            dashboard_builders.QueryVariable("node")
            .label("Node")
            .datasource(_datasource_ref())
            .query("label_values(up, node)")
            .refresh(dashboard_models.VariableRefresh.ON_DASHBOARD_LOAD)
            .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC)
            .current(dashboard_models.VariableOption(selected=True, text=profile.name, value=profile.name))
        )
    rows: list[tuple[str, list[_PanelBuilder]]] = [
        ("Sessions", panels.sessions()),
        (
            "Latency",
            panels.latency(profile.limits.first_audio_p99_target_ms / 1000.0, profile.stagger_groups),
        ),
        ("Refusals and drops", panels.refusals_and_drops()),
    ]
    if profile.gpu is not None:
        memory_alert_mib = profile.limits.gpu_memory_alert_fraction * GPUS[profile.gpu].memory_mib
        rows.append(("GPU (dcgm-exporter)", panels.gpu(memory_alert_mib)))
    rows.append(("Redis", panels.redis(profile.retention.redis_max_memory_mb * _BYTES_PER_MIB)))
    rows.append(("Runtime and scrape health", panels.health()))

    panel_id = 0
    for row_title, row_panels in rows:
        panel_id += 1
        builder.with_row(dashboard_builders.Row(row_title).id(panel_id))
        for panel in row_panels:
            panel_id += 1
            builder.with_panel(panel.id(panel_id))
    return builder.build()


def _datasource_ref() -> dashboard_models.DataSourceRef:
    return dashboard_models.DataSourceRef(type_val=DATASOURCE_TYPE, uid=DATASOURCE_UID)


def _steps(*steps: tuple[float | None, str]) -> dashboard_builders.ThresholdsConfig:
    return (
        dashboard_builders.ThresholdsConfig()
        .mode(dashboard_models.ThresholdsMode.ABSOLUTE)
        .steps([dashboard_models.Threshold(value=value, color=color) for value, color in steps])
    )


def _value_text(mapping: dict[str, tuple[str, str]]) -> list[dashboard_models.ValueMapping]:
    return [
        dashboard_models.ValueMap(
            options={
                value: dashboard_models.ValueMappingResult(text=text, color=color, index=index)
                for index, (value, (text, color)) in enumerate(sorted(mapping.items()))
            }
        )
    ]


class _Panels:
    """Panel builders for one selector. Each row's panels are 24 columns wide in all (the SDK's layout
    wraps to a new line once a line is full)."""

    def __init__(self, selector: str) -> None:
        self.selector = selector

    def _m(self, metric: str) -> str:
        """``metric{selector}``."""
        return f"{metric}{{{self.selector}}}"

    def _rate(self, counter: str, window: str = "$__rate_interval") -> str:
        return f"rate({self._m(counter)}[{window}])"

    def _quantile(self, q: float, histogram: str, window: str = "$__rate_interval") -> str:
        return f"histogram_quantile({q}, sum by (le) ({self._rate(histogram + '_bucket', window)}))"

    @staticmethod
    def _targets(queries: Sequence[tuple[str, str]]) -> list[cog_builder.Builder[cog_variants.Dataquery]]:
        return [
            prometheus_builders.Dataquery()
            .datasource(_datasource_ref())
            .expr(expr)
            .legend_format(legend)
            .range()
            .ref_id(chr(ord("A") + index))
            for index, (expr, legend) in enumerate(queries)
        ]

    def _timeseries(
        self,
        title: str,
        description: str,
        unit: str,
        queries: Sequence[tuple[str, str]],
        *,
        width: int,
        height: int = 8,
        min_value: float | None = 0,
        max_value: float | None = None,
        threshold: tuple[float, str] | None = None,
        bars: bool = False,
        stacked: bool = False,
        decimals: float | None = None,
    ) -> timeseries_builders.Panel:
        panel = (
            timeseries_builders.Panel()
            .title(title)
            .description(description)
            .datasource(_datasource_ref())
            .targets(self._targets(queries))
            .unit(unit)
            .span(width)
            .height(height)
            .line_width(1)
            .fill_opacity(10)
            .legend(
                common_builders.VizLegendOptions()
                .display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM)
                .show_legend(True)
            )
            .tooltip(
                common_builders.VizTooltipOptions()
                .mode(common.TooltipDisplayMode.MULTI)
                .sort(common.SortOrder.DESCENDING)
            )
        )
        if min_value is not None:
            panel.min(min_value)
        if max_value is not None:
            panel.max(max_value)
        if decimals is not None:
            panel.decimals(decimals)
        if bars:
            panel.draw_style(common.GraphDrawStyle.BARS).fill_opacity(80).stacking(
                common_builders.StackingConfig().mode(common.StackingMode.NORMAL)
            )
        if stacked:
            panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(60)
        if threshold is None:
            panel.thresholds(_steps((None, "green")))
        else:
            value, label = threshold
            panel.thresholds(_steps((None, "green"), (value, "red"))).thresholds_style(
                common_builders.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.DASHED)
            )
            panel.description(f"{description} Dashed red line: {label}.")
        return panel

    def _stat(
        self,
        title: str,
        description: str,
        queries: Sequence[tuple[str, str]],
        mapping: dict[str, tuple[str, str]],
        *,
        width: int,
        height: int = 8,
    ) -> stat_builders.Panel:
        return (
            stat_builders.Panel()
            .title(title)
            .description(description)
            .datasource(_datasource_ref())
            .targets(self._targets(queries))
            .unit(units.NoUnit)
            .span(width)
            .height(height)
            .mappings(_value_text(mapping))
            .thresholds(_steps((None, "text")))
            .color_mode(common.BigValueColorMode.BACKGROUND)
            .graph_mode(common.BigValueGraphMode.NONE)
            .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        )

    def sessions(self) -> list[_PanelBuilder]:
        active, slots = self._m("duplex_active_sessions"), self._m("duplex_slots_total")
        return [
            self._timeseries(
                "Sessions vs cap",
                "Sessions holding a batch slot against the node's slot count (nginx caps connections at it).",
                units.Short,
                [(f"sum({active})", "active"), (f"sum({slots})", "slots")],
                width=8,
                decimals=0,
            ),
            self._timeseries(
                "Slot utilisation",
                "Active sessions / slots. At 100% new sessions are refused (node_full).",
                units.PercentUnit,
                [(f"sum({active}) / sum({slots})", "utilisation")],
                width=8,
                max_value=1,
                threshold=(1.0, "full"),
            ),
            self._timeseries(
                "Session starts",
                "Sessions admitted per second.",
                units.CountsPerSecond,
                [(f"sum({self._rate('duplex_sessions_started_total')})", "started")],
                width=8,
            ),
        ]

    def latency(self, first_audio_target_s: float, stagger_groups: int = 1) -> list[_PanelBuilder]:
        """The latency row; ``stagger_groups`` 2: the tick budget is the 40 ms sub-tick period."""
        period_ms = FRAME_MS / stagger_groups
        budget = (
            f"the {FRAME_MS:g} ms frame budget"
            if stagger_groups == 1
            else f"the {period_ms:g} ms sub-tick period ({stagger_groups} staggered groups)"
        )
        over = f"sum({self._rate('duplex_ticks_over_budget_total')})"
        ticks = f"sum({self._rate('duplex_ticks_total')})"
        return [
            self._timeseries(
                "Tick time p50 / p99",
                "Wall time of one batched tick (encode, LM step, decode).",
                units.Seconds,
                [
                    (self._quantile(0.5, "duplex_tick_duration_seconds"), "p50"),
                    (self._quantile(0.99, "duplex_tick_duration_seconds"), "p99"),
                ],
                width=8,
                threshold=(period_ms / 1000.0, budget),
            ),
            self._timeseries(
                "Ticks over budget",
                f"Share of busy ticks that took longer than {budget}.",
                units.PercentUnit,
                [(f"{over} / {ticks}", "over budget")],
                width=8,
                max_value=1,
            ),
            self._timeseries(
                "First-audio latency p50 / p99",
                "Time from a session's first input frame to its first output frame, over "
                f"{_FIRST_AUDIO_WINDOW} windows.",
                units.Seconds,
                [
                    (self._quantile(0.5, "duplex_first_audio_latency_seconds", _FIRST_AUDIO_WINDOW), "p50"),
                    (self._quantile(0.99, "duplex_first_audio_latency_seconds", _FIRST_AUDIO_WINDOW), "p99"),
                ],
                width=8,
                threshold=(first_audio_target_s, f"the p99 target, {first_audio_target_s * 1000:g} ms"),
            ),
            *self._first_audio_budget(),
        ]

    def _first_audio_budget(self) -> list[_PanelBuilder]:
        """The first-audio latency budget's terms (docs/benchmarks.md, "First-audio latency budget"): their
        means stacked (they add up to the mean first audio, ticks counted at 80 ms each) and their p99s."""
        window = _FIRST_AUDIO_WINDOW
        frame_s = FRAME_MS / 1000

        def mean(metric: str) -> str:
            return (
                f"sum({self._rate(metric + '_sum', window)}) / sum({self._rate(metric + '_count', window)})"
            )

        ticks = "duplex_first_audio_ticks"
        terms = [(f"duplex_first_audio_{t}_seconds", t.replace("_", " ")) for t in FIRST_AUDIO_TIME_TERMS]
        means = [(mean(m), label) for m, label in terms]
        means.insert(2, (f"{mean(ticks)} * {frame_s:g}", f"ticks x {FRAME_MS:g} ms"))
        p99s = [(self._quantile(0.99, m, window), label) for m, label in terms]
        p99s.insert(2, (f"{self._quantile(0.99, ticks, window)} * {frame_s:g}", f"ticks x {FRAME_MS:g} ms"))
        return [
            self._timeseries(
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
            self._timeseries(
                "First-audio budget by term (p99)",
                f"Each term's p99 over {window} windows (estimated within its histogram bucket; ticks "
                "within half a tick). The phase wait's is up to one tick period: 80 ms, or 40 ms with "
                "staggered sub-batches (DUPLEX_STAGGER_GROUPS=2).",
                units.Seconds,
                p99s,
                width=12,
            ),
        ]

    def refusals_and_drops(self) -> list[_PanelBuilder]:
        return [
            self._timeseries(
                "Admissions refused by reason",
                "Sessions refused per second: node_full, draining, bad_request, and the access check's "
                "(missing, expired, bad_signature, replayed, origin_not_allowed, ...).",
                units.CountsPerSecond,
                [(f"sum by (reason) ({self._rate('duplex_admissions_refused_total')})", "{{reason}}")],
                width=12,
                bars=True,
            ),
            self._timeseries(
                "Frames dropped by reason",
                "Frames lost per second: late_input, input_overflow, slow_client.",
                units.CountsPerSecond,
                [(f"sum by (reason) ({self._rate('duplex_frames_dropped_total')})", "{{reason}}")],
                width=12,
                bars=True,
            ),
        ]

    def gpu(self, memory_alert_mib: float) -> list[_PanelBuilder]:
        used, free = self._m("DCGM_FI_DEV_FB_USED"), self._m("DCGM_FI_DEV_FB_FREE")
        allocated = self._m("duplex_gpu_memory_allocated_bytes")
        return [
            self._timeseries(
                "GPU memory",
                "Framebuffer used and used + free (dcgm-exporter), and what the runtime's torch allocated.",
                units.Mebibytes,
                [
                    (f"sum({used})", "used"),
                    (f"sum({used} + {free})", "used + free"),
                    (f"sum({allocated}) / {_BYTES_PER_MIB}", "torch allocated"),
                ],
                width=8,
                threshold=(memory_alert_mib, f"the alert threshold, {memory_alert_mib:g} MiB"),
            ),
            self._timeseries(
                "GPU utilisation",
                "Share of time a kernel was running (dcgm-exporter).",
                units.Percent,
                [(f"avg({self._m('DCGM_FI_DEV_GPU_UTIL')})", "utilisation")],
                width=8,
                max_value=100,
            ),
            self._timeseries(
                "GPU power",
                "Board power draw (dcgm-exporter).",
                units.Watt,
                [(f"sum({self._m('DCGM_FI_DEV_POWER_USAGE')})", "power")],
                width=8,
            ),
        ]

    def redis(self, max_memory_bytes: int) -> list[_PanelBuilder]:
        return [
            self._stat(
                "Redis up",
                "redis_exporter's view of Redis (down: the runtime's session store is failing).",
                [(f"min({self._m('redis_up')})", "redis")],
                {"0": ("down", "red"), "1": ("up", "green")},
                width=4,
            ),
            self._timeseries(
                "Redis memory",
                "Memory Redis uses.",
                units.BytesIEC,
                [(f"sum({self._m('redis_memory_used_bytes')})", "used")],
                width=10,
                threshold=(float(max_memory_bytes), f"maxmemory, {max_memory_bytes // _BYTES_PER_MIB} MiB"),
            ),
            self._timeseries(
                "Redis clients",
                "Connected clients.",
                units.Short,
                [(f"sum({self._m('redis_connected_clients')})", "clients")],
                width=10,
                decimals=0,
            ),
            self._timeseries(
                "Session-store backlog",
                "Runtime session-store writes waiting for Redis (grows while Redis is unreachable).",
                units.Short,
                [(f"sum({self._m('duplex_redis_backlog_ops')})", "backlog")],
                width=8,
                decimals=0,
            ),
            self._timeseries(
                "Runtime Redis errors by op",
                "Failed Redis operations of the runtime per second.",
                units.CountsPerSecond,
                [(f"sum by (op) ({self._rate('duplex_redis_errors_total')})", "{{op}}")],
                width=8,
                bars=True,
            ),
            self._timeseries(
                "Redis commands",
                "Commands Redis processed per second.",
                units.OpsPerSecond,
                [(f"sum({self._rate('redis_commands_processed_total')})", "commands")],
                width=8,
            ),
        ]

    def health(self) -> list[_PanelBuilder]:
        return [
            self._stat(
                "Runtime ready",
                "1 when /readyz answers 200.",
                [(f"min({self._m('duplex_ready')})", "ready")],
                {"0": ("not ready", "red"), "1": ("ready", "green")},
                width=6,
                height=5,
            ),
            self._stat(
                "Runtime draining",
                "1 while the runtime drains after SIGTERM (no new sessions).",
                [(f"max({self._m('duplex_draining')})", "draining")],
                {"0": ("serving", "green"), "1": ("draining", "orange")},
                width=6,
                height=5,
            ),
            self._stat(
                "Scrape targets",
                "Prometheus's scrape of each job (runtime, prometheus, exporters).",
                [(f"min by (job) ({self._m('up')})", "{{job}}")],
                {"0": ("down", "red"), "1": ("up", "green")},
                width=12,
                height=5,
            ),
        ]


def datasource_yaml(profile: NodeProfile, url: str | None = None) -> bytes:
    """The datasource provisioning file (``DATASOURCE_FILE``'s content) with the Prometheus API at ``url``
    (default the node's Prometheus, ``http://<endpoint(profile, "prometheus")>``; a Kubernetes stack passes
    its query frontend's)."""
    return _datasource_yaml(profile, url)


def provider_yaml(profile: NodeProfile, dashboards_path: str = DASHBOARDS_PATH) -> bytes:
    """The dashboard provider provisioning file (``PROVIDER_FILE``'s content), reading ``dashboards_path``."""
    return _provider_yaml(profile, dashboards_path)


def _datasource_yaml(profile: NodeProfile, url: str | None = None) -> bytes:
    document = {
        "apiVersion": 1,
        "datasources": [
            {
                "name": "Prometheus",
                "uid": DATASOURCE_UID,
                "type": DATASOURCE_TYPE,
                "access": "proxy",
                "orgId": 1,
                "url": url or f"http://{endpoint(profile, 'prometheus')}",
                "isDefault": True,
                "editable": False,
                "jsonData": {"httpMethod": "POST", "timeInterval": scrape_interval(profile)},
            }
        ],
    }
    return _yaml_document(profile, document)


def _provider_yaml(profile: NodeProfile, dashboards_path: str) -> bytes:
    document = {
        "apiVersion": 1,
        "providers": [
            {
                "name": "duplex",
                "orgId": 1,
                "folder": "Duplex",
                "type": "file",
                "disableDeletion": True,
                "allowUiUpdates": False,
                "updateIntervalSeconds": 60,
                "options": {"path": dashboards_path, "foldersFromFilesStructure": False},
            }
        ],
    }
    return _yaml_document(profile, document)


def _yaml_document(profile: NodeProfile, document: dict[str, Any]) -> bytes:
    header = f"# Rendered by infra.node.grafana for node profile {profile.name!r}. Do not edit: re-render.\n"
    return (header + "\n".join(_yaml_lines(document, 0)) + "\n").encode()


def _yaml_lines(value: dict[str, Any], indent: int) -> list[str]:
    """Block YAML for a mapping of str keys to scalars, mappings and lists of mappings. Strings are JSON
    double-quoted scalars (valid YAML), so no value is ever read back as another type."""
    pad = " " * indent
    lines: list[str] = []
    for key, item in value.items():
        if isinstance(item, dict):
            lines.append(f"{pad}{key}:")
            lines.extend(_yaml_lines(item, indent + 2))
        elif isinstance(item, list):
            lines.append(f"{pad}{key}:")
            for element in item:
                nested = _yaml_lines(element, indent + 4)
                lines.append(f"{pad}  - {nested[0].lstrip()}")
                lines.extend(nested[1:])
        else:
            lines.append(f"{pad}{key}: {_yaml_scalar(item)}")
    return lines


def _yaml_scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise TypeError(f"no YAML scalar for {value!r}")
