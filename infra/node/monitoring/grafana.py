"""Grafana for one node: the Prometheus datasource, the dashboard provider and the node dashboard.

``render_grafana(profile)`` gives three files, the same bytes for the same profile:

- ``grafana/provisioning/datasources/prometheus.yml``: the node's Prometheus (``DATASOURCE_UID``), default,
  not editable from the UI;
- ``grafana/provisioning/dashboards/duplex.yml``: a file provider reading ``dashboards_path`` (where Compose
  mounts ``grafana/dashboards/``);
- ``grafana/dashboards/duplex-node.json``: the node dashboard (``node_dashboard``).

The dashboard is built with grafana-foundation-sdk's typed builders (the SDK release generated for Grafana
11.6, ``GRAFANA_VERSION``; the panel kit: ``infra.node.monitoring.grafana_panels``; the rows:
``infra.node.dashboard_*``): sessions against the slot cap, tick time against the 80 ms frame budget,
first-audio latency against the profile's p99 target, refusals and drops by reason, sessions by transport
and WebRTC's media and signalling, the TURN relay (coturn, where its exporter is scraped), resume and
recordings, GPU memory, utilisation and power from dcgm-exporter (GPU nodes only), Redis health from
redis_exporter and the runtime's own session-store counters, readiness, draining and scrape health.

Every query is scoped by one label selector. On a node that is ``node="$node"`` (every scrape target carries
``node=<profile name>``, and the dashboard has a ``node`` variable defaulting to this node); a stack that
labels series differently (Kubernetes: ``namespace="duplex"``) passes its own to ``node_dashboard``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dashboard_models

from infra.capacity.gpus import GPUS
from infra.node.bundle.services import endpoint
from infra.node.monitoring.dashboard_node_rows import (
    FIRST_AUDIO_TIME_TERMS,
    gpu_row,
    health_row,
    latency_row,
    redis_row,
    refusals_and_drops_row,
    sessions_row,
)
from infra.node.monitoring.dashboard_rtc_rows import turn_row, webrtc_row
from infra.node.monitoring.dashboard_session_rows import resume_and_recordings_row
from infra.node.monitoring.grafana_panels import (
    BYTES_PER_MIB,
    DATASOURCE_TYPE,
    DATASOURCE_UID,
    PanelBuilder,
    PanelKit,
    datasource_ref,
)
from infra.node.monitoring.prometheus import scrape_interval
from infra.node.monitoring.rtc_rules import coturn_exported
from infra.node.profile.profiles import NodeProfile
from runtime.engine.model_presets import FRAME_MS

__all__ = [
    "DASHBOARDS_PATH",
    "DASHBOARD_FILE",
    "DATASOURCE_FILE",
    "DATASOURCE_TYPE",
    "DATASOURCE_UID",
    "FIRST_AUDIO_TIME_TERMS",
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

NODE_SELECTOR = 'node="$node"'
"""The default label selector: the series of the node picked in the dashboard's ``node`` variable."""

TICK_BUDGET_S = FRAME_MS / 1000.0
"""A tick must finish within one 80 ms frame (the runtime counts the ones that don't)."""

_UID_MAX = 40  # Grafana's limit on dashboard uids


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
    turn_relay: bool | None = None,
) -> dashboard_models.Dashboard:
    """The node dashboard for ``profile``, every query scoped by ``selector`` (PromQL label matchers
    without braces, e.g. ``node="$node"`` or ``namespace="duplex"``).

    The ``node`` template variable is added when the selector refers to ``$node``; its default is the
    profile's name. GPU rows (dcgm-exporter) appear only when ``profile.gpu`` is set. Thresholds follow the
    profile: the first-audio p99 target, Redis ``maxmemory`` and, on GPU nodes, the GPU-memory alert
    fraction of the catalog's memory. ``uid`` and ``title`` default to ones derived from the profile name.
    The TURN relay's row (coturn's exporter, ``job="coturn"``) appears when ``turn_relay`` is true; None:
    where the node scrapes one (``coturn_exported(profile)``).
    """
    kit = PanelKit(selector)
    builder = (
        dashboard_builders.Dashboard(title or f"Duplex node {profile.name}")
        .uid(uid or dashboard_uid(profile))
        .description(
            f"Batched full-duplex runtime on node profile {profile.name!r} ({profile.sessions} slots, "
            f"{profile.gpu or 'CPU'}, {profile.model} {profile.precision}). "
            "Rendered by infra.node.monitoring.grafana."
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
            .datasource(datasource_ref())
            .query("label_values(up, node)")
            .refresh(dashboard_models.VariableRefresh.ON_DASHBOARD_LOAD)
            .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC)
            .current(dashboard_models.VariableOption(selected=True, text=profile.name, value=profile.name))
        )
    rows: list[tuple[str, list[PanelBuilder]]] = [
        ("Sessions", sessions_row(kit)),
        (
            "Latency",
            latency_row(kit, profile.limits.first_audio_p99_target_ms / 1000.0, profile.stagger_groups),
        ),
        ("Refusals and drops", refusals_and_drops_row(kit)),
        ("Transports and WebRTC", webrtc_row(kit)),
    ]
    if coturn_exported(profile) if turn_relay is None else turn_relay:
        rows.append(("TURN relay (coturn)", turn_row(kit)))
    rows.append(("Resume and recordings", resume_and_recordings_row(kit)))
    if profile.gpu is not None:
        memory_alert_mib = profile.limits.gpu_memory_alert_fraction * GPUS[profile.gpu].memory_mib
        rows.append(("GPU (dcgm-exporter)", gpu_row(kit, memory_alert_mib)))
    rows.append(("Redis", redis_row(kit, profile.retention.redis_max_memory_mb * BYTES_PER_MIB)))
    rows.append(("Runtime and scrape health", health_row(kit)))

    panel_id = 0
    for row_title, row_panels in rows:
        panel_id += 1
        builder.with_row(dashboard_builders.Row(row_title).id(panel_id))
        for panel in row_panels:
            panel_id += 1
            builder.with_panel(panel.id(panel_id))
    return builder.build()


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
    header = (
        f"# Rendered by infra.node.monitoring.grafana for profile {profile.name!r}. Do not edit: re-render.\n"
    )
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
