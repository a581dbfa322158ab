"""Grafana files of a node (``infra.node.monitoring.grafana``): provisioning YAML, the node dashboard,
determinism.

There is no Grafana server here, so the dashboard is checked as far as tools allow: the SDK's model decoder
reads it back into typed objects (with the SDK's panel and query plugins) and must give back the same JSON
(a key the schema doesn't know is dropped on the way, so it would show); ``promtool check rules`` parses
every PromQL expression; structural invariants (datasource uids, panel ids, grid, units, metric names,
thresholds) are asserted directly. No dashboard JSON schema was found in a PyPI package to validate against
(grafana-foundation-sdk's repository has ``jsonschema/dashboard.jsonschema.json``; its wheel does not).

A missing ``promtool`` is a failure, not a skip: CI installs it (Debian/Ubuntu package ``prometheus``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard, Panel

from infra.capacity.gpus import GPUS
from infra.node.bundle.services import endpoint
from infra.node.monitoring.grafana import (
    DASHBOARD_FILE,
    DATASOURCE_FILE,
    PROVIDER_FILE,
    dashboard_bytes,
    dashboard_uid,
    node_dashboard,
    render_grafana,
)
from infra.node.profile.profiles import PROFILES, NodeProfile, get_profile
from runtime.metrics import RuntimeMetrics

GPU_PROFILES = [name for name, profile in PROFILES.items() if profile.gpu is not None]
CPU_PROFILES = [name for name, profile in PROFILES.items() if profile.gpu is None]

EXPORTER_METRICS = {
    # NVIDIA dcgm-exporter (GPU nodes)
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_POWER_USAGE",
    # oliver006 redis_exporter
    "redis_up",
    "redis_connected_clients",
    "redis_memory_used_bytes",
    "redis_commands_processed_total",
    # coturn's exporter (coturn 4.6.3, src/apps/relay/prom_server.c; compose nodes and regions with TURN)
    "turn_total_allocations",
    "turn_total_traffic_rcvb",
    "turn_total_traffic_sentb",
    "turn_total_traffic_peer_rcvb",
    "turn_total_traffic_peer_sentb",
    # Prometheus's own series for every scrape target
    "up",
}
TURN_METRICS = {name for name in EXPORTER_METRICS if name.startswith("turn_")}
DCGM_METRICS = {name for name in EXPORTER_METRICS if name.startswith("DCGM_")}

# Grafana's own variables in queries, and what promtool sees instead.
GRAFANA_MACROS = {"$__rate_interval": "1m", "$node": "some-node"}

_PROMQL_WORDS = {"and", "or", "unless", "offset", "bool", "on", "ignoring", "group_left", "group_right"}


def runtime_metric_names() -> set[str]:
    """The series names the runtime exposes, by the type of each family in its registry."""
    names = set()
    for family in RuntimeMetrics().registry.collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads: identifiers left once matchers, ranges and grouping clauses
    are removed, that are neither functions/aggregations (followed by '(') nor keywords."""
    stripped = re.sub(r"\{[^}]*\}", "", expr)
    stripped = re.sub(r"\[[^\]]*\]", "", stripped)
    stripped = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", stripped)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", stripped):
        if stripped[match.end() :].lstrip().startswith("(") or match.group() in _PROMQL_WORDS:
            continue
        names.add(match.group())
    return names


def scoped_by(matchers: str, selector: str) -> bool:
    """Whether a query's matchers are the dashboard's ``selector``, then only matchers on the labels that
    pick a series within it (``outcome``, ``job``)."""
    if matchers == selector:
        return True
    extra = matchers.removeprefix(selector + ",")
    return extra != matchers and all(re.fullmatch(r'(outcome|job)=~?"[a-z|]+"', m) for m in extra.split(","))


def dashboard_of(profile: NodeProfile) -> dict[str, Any]:
    return json.loads(render_grafana(profile)[DASHBOARD_FILE])


def content_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def panel(dashboard: dict[str, Any], title: str) -> dict[str, Any]:
    matches = [p for p in dashboard["panels"] if p.get("title") == title]
    assert len(matches) == 1, f"expected one panel titled {title!r}, found {len(matches)}"
    return matches[0]


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for p in content_panels(dashboard) for target in p["targets"]]


def threshold_line(p: dict[str, Any]) -> float:
    """The value of a panel's threshold line (its last step), checking the line is drawn."""
    defaults = p["fieldConfig"]["defaults"]
    assert defaults["custom"]["thresholdsStyle"]["mode"] in ("line", "dashed", "line+area", "dashed+area")
    return defaults["thresholds"]["steps"][-1]["value"]


def promtool_check(expressions: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not on PATH (install the 'prometheus' package): PromQL can't be validated")
    rules = []
    for index, expr in enumerate(expressions):
        for macro, value in GRAFANA_MACROS.items():
            expr = expr.replace(macro, value)
        assert "$" not in expr, f"unsubstituted Grafana variable in {expr!r}"
        rules.append({"record": f"dashboard:expr_{index}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    return subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


# --- files, determinism ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PROFILES))
def test_render_is_deterministic(name: str) -> None:
    first = render_grafana(PROFILES[name])
    assert set(first) == {DATASOURCE_FILE, PROVIDER_FILE, DASHBOARD_FILE}
    # A profile built afresh (not the same object) renders the same bytes.
    assert render_grafana(get_profile(name)) == first
    assert render_grafana(PROFILES[name]) == first
    for content in first.values():
        assert isinstance(content, bytes) and content.endswith(b"\n")
    raw = first[DASHBOARD_FILE].decode()
    assert raw == json.dumps(json.loads(raw), sort_keys=True, indent=2) + "\n"


def test_dashboard_uids_are_stable_and_distinct() -> None:
    uids = {name: dashboard_of(profile)["uid"] for name, profile in PROFILES.items()}
    assert uids["l40s"] == "duplex-node-l40s"
    assert len(set(uids.values())) == len(uids)
    long_name = "n" + "-x" * 19  # 39 characters: "duplex-node-" + name exceeds Grafana's 40
    uid = dashboard_uid(NodeProfile(name=long_name, max_sessions=2))
    assert len(uid) <= 40 and re.fullmatch(r"[a-z0-9-]+", uid)
    assert uid == dashboard_uid(NodeProfile(name=long_name, max_sessions=3))
    assert uid != dashboard_uid(NodeProfile(name=long_name[:-1] + "y", max_sessions=2))
    assert dashboard_of(NodeProfile(name=long_name, max_sessions=2))["uid"] == uid


def test_dashboards_path_is_a_parameter() -> None:
    profile = PROFILES["local"]
    default = yaml.safe_load(render_grafana(profile)[PROVIDER_FILE])
    custom = yaml.safe_load(render_grafana(profile, dashboards_path="/srv/grafana/dashboards")[PROVIDER_FILE])
    assert default["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert custom["providers"][0]["options"]["path"] == "/srv/grafana/dashboards"


# --- provisioning YAML ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PROFILES))
def test_datasource_provisioning(name: str) -> None:
    profile = PROFILES[name]
    document = yaml.safe_load(render_grafana(profile)[DATASOURCE_FILE])
    assert document["apiVersion"] == 1
    (datasource,) = document["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["access"] == "proxy"
    assert datasource["url"] == f"http://{endpoint(profile, 'prometheus')}"
    assert datasource["isDefault"] is True
    assert datasource["editable"] is False
    assert isinstance(datasource["uid"], str) and datasource["uid"]
    assert re.fullmatch(r"\d+s", datasource["jsonData"]["timeInterval"])


def test_datasource_url_follows_deployment() -> None:
    local = yaml.safe_load(render_grafana(PROFILES["local"])[DATASOURCE_FILE])["datasources"][0]
    compose = yaml.safe_load(render_grafana(PROFILES["l40s"])[DATASOURCE_FILE])["datasources"][0]
    assert local["url"] == "http://127.0.0.1:9090"
    assert compose["url"] == "http://prometheus:9090"
    moved = get_profile("l40s", ports={"prometheus": 9099})
    assert yaml.safe_load(render_grafana(moved)[DATASOURCE_FILE])["datasources"][0]["url"] == (
        "http://prometheus:9099"
    )


@pytest.mark.parametrize("name", list(PROFILES))
def test_dashboard_provider(name: str) -> None:
    document = yaml.safe_load(render_grafana(PROFILES[name])[PROVIDER_FILE])
    assert document["apiVersion"] == 1
    (provider,) = document["providers"]
    assert provider["type"] == "file"
    assert provider["name"] and provider["folder"]
    assert provider["allowUiUpdates"] is False
    assert isinstance(provider["updateIntervalSeconds"], int)
    assert provider["options"]["path"].startswith("/")


# --- the dashboard -------------------------------------------------------------------------------------


def sdk_round_trip(raw: dict[str, Any]) -> dict[str, Any]:
    register_default_plugins()
    model = Dashboard.from_json(raw)
    return json.loads(json.dumps(model, cls=JSONEncoder))


@pytest.mark.parametrize("name", list(PROFILES))
def test_dashboard_round_trips_through_the_sdk_decoder(name: str) -> None:
    raw = dashboard_of(PROFILES[name])
    assert sdk_round_trip(raw) == raw
    register_default_plugins()
    model = Dashboard.from_json(raw)
    # The decoder typed the queries and panel options (not its catch-all "unknown" bags).
    queries = [t for p in model.panels or [] if isinstance(p, Panel) for t in p.targets or []]
    assert queries and all(type(q).__module__.endswith("models.prometheus") for q in queries)
    assert dashboard_bytes(model) == render_grafana(PROFILES[name])[DASHBOARD_FILE]


def test_round_trip_catches_keys_outside_the_schema() -> None:
    raw = dashboard_of(PROFILES["l40s"])
    broken = json.loads(json.dumps(raw))
    content_panels(broken)[0]["gridpos"] = content_panels(broken)[0].pop("gridPos")
    assert sdk_round_trip(broken) != broken


@pytest.mark.parametrize("name", list(PROFILES))
def test_every_query_uses_the_provisioned_datasource(name: str) -> None:
    files = render_grafana(PROFILES[name])
    uid = yaml.safe_load(files[DATASOURCE_FILE])["datasources"][0]["uid"]
    dashboard = json.loads(files[DASHBOARD_FILE])
    panels = content_panels(dashboard)
    assert panels
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": uid}, p["title"]
        assert p["targets"], p["title"]
        for target in p["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": uid}, p["title"]
        ref_ids = [target["refId"] for target in p["targets"]]
        assert len(set(ref_ids)) == len(ref_ids) and all(ref_ids), p["title"]
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"] == {"type": "prometheus", "uid": uid}


@pytest.mark.parametrize("name", list(PROFILES))
def test_panel_ids_and_grid(name: str) -> None:
    dashboard = dashboard_of(PROFILES[name])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids)
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard["panels"]:
        grid = p["gridPos"]
        assert grid["x"] >= 0 and grid["y"] >= 0 and grid["w"] > 0 and grid["h"] > 0, p["title"]
        assert grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] == "row":
            assert (grid["x"], grid["w"], grid["h"]) == (0, 24, 1)
            assert p["panels"] == [] and p["collapsed"] is False
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r} at {(x, y)}"
                cells[(x, y)] = p["title"]


@pytest.mark.parametrize("name", list(PROFILES))
def test_every_panel_has_a_unit_and_the_right_ones(name: str) -> None:
    dashboard = dashboard_of(PROFILES[name])
    for p in content_panels(dashboard):
        assert p["fieldConfig"]["defaults"].get("unit"), p["title"]
    expected = {
        "Tick time p50 / p99": "s",
        "First-audio latency p50 / p99": "s",
        "Slot utilisation": "percentunit",
        "Redis memory": "bytes",
    }
    if PROFILES[name].gpu is not None:
        expected |= {"GPU memory": "mbytes", "GPU utilisation": "percent", "GPU power": "watt"}
    for title, unit in expected.items():
        assert panel(dashboard, title)["fieldConfig"]["defaults"]["unit"] == unit, title


@pytest.mark.parametrize("name", list(PROFILES))
def test_queries_read_only_known_metrics(name: str) -> None:
    known = runtime_metric_names() | EXPORTER_METRICS
    read: set[str] = set()
    for expr in exprs(dashboard_of(PROFILES[name])):
        names = metric_names(expr)
        assert names, f"no metric found in {expr!r}"
        assert names <= known, f"{expr!r} reads unknown metrics {sorted(names - known)}"
        read |= names
    # The panels the dashboard promises are there.
    for wanted in (
        "duplex_active_sessions",
        "duplex_slots_total",
        "duplex_tick_duration_seconds_bucket",
        "duplex_first_audio_latency_seconds_bucket",
        "duplex_admissions_refused_total",
        "duplex_frames_dropped_total",
        "duplex_ready",
        "duplex_draining",
        "duplex_redis_errors_total",
        "duplex_redis_backlog_ops",
        "redis_up",
        "redis_memory_used_bytes",
        "redis_connected_clients",
        # issue 22: sessions by transport, RTP, the jitter buffer, POST to answer and to connected
        "duplex_transport_sessions_active",
        "duplex_transport_sessions_started_total",
        "duplex_rtp_packets_total",
        "duplex_rtp_jitter_buffer_depth_packets_bucket",
        "duplex_rtc_answer_seconds_bucket",
        "duplex_rtc_connect_seconds_bucket",
        # issue 23: resume and recordings
        "duplex_sessions_detached_total",
        "duplex_sessions_resumed_total",
        "duplex_resume_refused_total",
        "duplex_resume_gap_seconds_bucket",
        "duplex_recordings_total",
        "duplex_recording_bytes_total",
        "duplex_recording_errors_total",
        "duplex_recordings_swept_total",
    ):
        assert wanted in read, wanted


def test_metric_name_extraction() -> None:
    assert metric_names('histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="1"}[5m])))') == {"a_bucket"}
    assert metric_names('sum(b{n="$node"} + c{n="$node"}) / 1048576') == {"b", "c"}
    assert metric_names("min by (job) (up)") == {"up"}


def test_gpu_rows_only_on_gpu_profiles() -> None:
    assert GPU_PROFILES and CPU_PROFILES
    for name in GPU_PROFILES:
        dashboard = dashboard_of(PROFILES[name])
        read = set().union(*(metric_names(e) for e in exprs(dashboard)))
        assert read >= DCGM_METRICS, name
        assert any(p["type"] == "row" and "GPU" in p["title"] for p in dashboard["panels"]), name
    for name in CPU_PROFILES:
        dashboard = dashboard_of(PROFILES[name])
        read = set().union(*(metric_names(e) for e in exprs(dashboard)))
        assert not read & DCGM_METRICS, name
        assert "duplex_gpu_memory_allocated_bytes" not in read
        assert not any("GPU" in p["title"] for p in dashboard["panels"]), name
    # The same profile with its GPU taken away loses the rows.
    cpu_variant = get_profile("l40s", gpu=None, precision="bf16", model="tiny")
    assert not set().union(*(metric_names(e) for e in exprs(dashboard_of(cpu_variant)))) & DCGM_METRICS


def test_thresholds_follow_the_profile() -> None:
    for name, profile in PROFILES.items():
        dashboard = dashboard_of(profile)
        first_audio = threshold_line(panel(dashboard, "First-audio latency p50 / p99"))
        assert first_audio == pytest.approx(profile.limits.first_audio_p99_target_ms / 1000), name
        assert threshold_line(panel(dashboard, "Tick time p50 / p99")) == pytest.approx(0.08)
        max_memory = threshold_line(panel(dashboard, "Redis memory"))
        assert max_memory == profile.retention.redis_max_memory_mb * 1024 * 1024, name
        if profile.gpu is not None:
            expected = profile.limits.gpu_memory_alert_fraction * GPUS[profile.gpu].memory_mib
            assert threshold_line(panel(dashboard, "GPU memory")) == pytest.approx(expected), name
    # The built-in profiles differ (t4-int8: 250 ms, the others 180 ms), and an override follows through.
    assert threshold_line(panel(dashboard_of(PROFILES["t4-int8"]), "First-audio latency p50 / p99")) == 0.25
    assert threshold_line(panel(dashboard_of(PROFILES["l40s"]), "First-audio latency p50 / p99")) == 0.18
    slow = get_profile("l40s", limits={"first_audio_p99_target_ms": 300.0})
    assert threshold_line(panel(dashboard_of(slow), "First-audio latency p50 / p99")) == pytest.approx(0.3)


def test_node_variable_defaults_to_the_profile() -> None:
    dashboard = dashboard_of(PROFILES["a100-80gb"])
    (variable,) = dashboard["templating"]["list"]
    assert variable["name"] == "node" and variable["type"] == "query"
    assert variable["current"]["value"] == "a100-80gb"
    for expr in exprs(dashboard):
        for match in re.finditer(r"\{([^}]*)\}", expr):
            assert scoped_by(match.group(1), 'node="$node"'), expr


def test_dashboard_builder_takes_another_selector() -> None:
    profile = PROFILES["l40s"]
    model = node_dashboard(profile, 'namespace="duplex"', uid="duplex-k8s", title="Duplex (Kubernetes)")
    dashboard = json.loads(dashboard_bytes(model))
    assert dashboard["uid"] == "duplex-k8s" and dashboard["title"] == "Duplex (Kubernetes)"
    assert dashboard["templating"].get("list", []) == []
    text = json.dumps(dashboard)
    assert "$node" not in text
    for expr in exprs(dashboard):
        selectors = re.findall(r"\{([^}]*)\}", expr)
        assert selectors and all(scoped_by(s, 'namespace="duplex"') for s in selectors), expr
        # Every metric read carries the selector: none is left once the selected ones are removed.
        assert metric_names(re.sub(r"[A-Za-z_:][A-Za-z0-9_:]*\{[^}]*\}", "0", expr)) == set(), expr
    # Same panels as the node dashboard, only the selector differs.
    node = dashboard_of(profile)
    assert [p["title"] for p in dashboard["panels"]] == [p["title"] for p in node["panels"]]


@pytest.mark.parametrize("name", list(PROFILES))
def test_promql_parses_with_promtool(name: str, tmp_path: Path) -> None:
    expressions = exprs(dashboard_of(PROFILES[name]))
    result = promtool_check(expressions, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(expressions)} rules found" in result.stdout + result.stderr


def test_promtool_check_rejects_bad_promql(tmp_path: Path) -> None:
    result = promtool_check(['sum(rate(duplex_ticks_total{node="$node"}[$__rate_interval])'], tmp_path)
    assert result.returncode != 0


@pytest.mark.parametrize("name", list(PROFILES))
def test_the_first_audio_budget_panels_show_every_term(name: str) -> None:
    """Issue 24: the latency row shows the first-audio budget's five terms (runtime/metrics.py), their
    means stacked (they add up to the mean first audio: the tick count times the 80 ms frame) and their
    p99s, each from its own histogram."""
    dashboard = dashboard_of(PROFILES[name])
    means = panel(dashboard, "First-audio budget by term (means, stacked)")
    p99s = panel(dashboard, "First-audio budget by term (p99)")
    assert means["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert "stacking" not in p99s["fieldConfig"]["defaults"]["custom"] or (
        p99s["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "none"
    )
    terms = ("ingress", "phase_wait", "ticks", "tick_compute", "egress")
    mean_exprs = [t["expr"] for t in means["targets"]]
    p99_exprs = [t["expr"] for t in p99s["targets"]]
    assert len(mean_exprs) == len(p99_exprs) == len(terms)
    for term, mean, p99 in zip(terms, mean_exprs, p99_exprs, strict=True):
        metric = f"duplex_first_audio_{term}" + ("" if term == "ticks" else "_seconds")
        assert metric_names(mean) == {f"{metric}_sum", f"{metric}_count"}, mean
        assert metric_names(p99) == {f"{metric}_bucket"}, p99
        assert mean.endswith(" * 0.08") == (term == "ticks") == p99.endswith(" * 0.08"), (mean, p99)
        assert "[10m]" in mean and "[10m]" in p99
    assert means["fieldConfig"]["defaults"]["unit"] == p99s["fieldConfig"]["defaults"]["unit"] == "s"


def test_a_staggered_node_draws_its_tick_budget_at_the_sub_tick_period() -> None:
    """With two staggered groups a tick must fit 40 ms, not 80 (the runtime counts ticks over budget
    against the period it runs at): the tick panel's budget line follows the profile."""
    staggered = dashboard_of(get_profile("a100-80gb", stagger_groups=2))
    assert threshold_line(panel(staggered, "Tick time p50 / p99")) == pytest.approx(0.04)
    assert "40 ms sub-tick period" in panel(staggered, "Ticks over budget")["description"]
    assert threshold_line(panel(dashboard_of(PROFILES["a100-80gb"]), "Tick time p50 / p99")) == pytest.approx(
        0.08
    )


# --- WebRTC, the TURN relay, resume and recordings (issues 22 and 23) ------------------------------------


def test_the_turn_relay_row_only_where_coturn_is_scraped() -> None:
    """coturn's panels read its exporter: on a compose node with the relay on (the coturn/coturn image), not
    on the local node (Debian's coturn has none) nor with the relay off; a stack can ask for them."""
    from infra.node.monitoring.rtc_rules import coturn_exported

    for name, profile in PROFILES.items():
        read = set().union(*(metric_names(e) for e in exprs(dashboard_of(profile))))
        assert bool(read & TURN_METRICS) == coturn_exported(profile), name
        assert ("TURN relay (coturn)" in [p["title"] for p in dashboard_of(profile)["panels"]]) == (
            coturn_exported(profile)
        )
    assert not coturn_exported(PROFILES["local"]) and coturn_exported(PROFILES["l40s"])
    relay_off = get_profile("l40s", relay={"enabled": False})
    assert not set().union(*(metric_names(e) for e in exprs(dashboard_of(relay_off)))) & TURN_METRICS
    forced = json.loads(dashboard_bytes(node_dashboard(PROFILES["local"], turn_relay=True)))
    up = panel(forced, "TURN relay up")["targets"][0]["expr"]
    assert up == 'min(up{node="$node",job="coturn"})', up
    assert read_metrics(panel(forced, "TURN allocations by type")) == {"turn_total_allocations"}


def read_metrics(p: dict[str, Any]) -> set[str]:
    return set().union(*(metric_names(target["expr"]) for target in p["targets"]))


def test_webrtc_panels_read_their_series_and_draw_the_alert_thresholds() -> None:
    from infra.node.monitoring.rtc_rules import (
        RTC_CONNECT_P99_ALERT_S,
        RTC_UNCONNECTED_ALERT_FRACTION,
        RTP_CONCEALED_ALERT_FRACTION,
    )

    dashboard = dashboard_of(PROFILES["l40s"])
    by_transport = panel(dashboard, "Sessions by transport")
    assert by_transport["targets"][0]["expr"] == (
        'sum by (transport) (duplex_transport_sessions_active{node="$node"})'
    )
    assert by_transport["targets"][0]["legendFormat"] == "{{transport}}"
    loss = panel(dashboard, "RTP concealment and loss")
    concealed, lost = (target["expr"] for target in loss["targets"])
    assert 'outcome=~"concealed"' in concealed and 'outcome=~"late"' in concealed
    assert lost.startswith('sum(rate(duplex_rtp_packets_total{node="$node",outcome=~"lost"}')
    assert lost.endswith(
        '/ sum(rate(duplex_rtp_packets_total{node="$node",outcome=~"received|lost"}[$__rate_interval]))'
    )
    assert threshold_line(loss) == RTP_CONCEALED_ALERT_FRACTION
    assert loss["fieldConfig"]["defaults"]["unit"] == "percentunit"
    depth = panel(dashboard, "Jitter buffer depth")
    assert all(t["expr"].endswith(" * 0.02") for t in depth["targets"])  # packets x 20 ms
    assert threshold_line(depth) == pytest.approx(0.12)
    connect = panel(dashboard, "WebRTC POST to connected p50 / p99")
    assert threshold_line(connect) == RTC_CONNECT_P99_ALERT_S
    assert read_metrics(connect) == {"duplex_rtc_connect_seconds_bucket"}
    assert [t["legendFormat"] for t in connect["targets"]] == ["p50", "p99"]
    answer = panel(dashboard, "WebRTC POST to answer p50 / p99")
    assert threshold_line(answer) == pytest.approx(0.05)
    assert read_metrics(answer) == {"duplex_rtc_answer_seconds_bucket"}
    unconnected = panel(dashboard, "Answered calls not connecting")
    assert threshold_line(unconnected) == RTC_UNCONNECTED_ALERT_FRACTION
    assert read_metrics(unconnected) == {
        "duplex_rtc_answer_seconds_count",
        "duplex_rtc_connect_seconds_count",
    }


def test_resume_and_recording_panels() -> None:
    dashboard = dashboard_of(PROFILES["local"])
    refusals = panel(dashboard, "Resume refusals by reason")
    assert refusals["targets"][0]["expr"] == (
        'sum by (reason) (rate(duplex_resume_refused_total{node="$node"}[$__rate_interval]))'
    )
    gap = panel(dashboard, "Resume gap p50 / p99")
    assert [t["legendFormat"] for t in gap["targets"]] == ["p50", "p99"]
    assert gap["targets"][1]["expr"].startswith("histogram_quantile(0.99, ")
    assert read_metrics(panel(dashboard, "Sessions detached and resumed")) == {
        "duplex_sessions_detached_total",
        "duplex_sessions_resumed_total",
    }
    assert read_metrics(panel(dashboard, "Recording bytes by side")) == {"duplex_recording_bytes_total"}
    assert panel(dashboard, "Recording bytes by side")["fieldConfig"]["defaults"]["unit"] == "Bps"
    assert read_metrics(panel(dashboard, "Recording faults and sweeps")) == {
        "duplex_recording_errors_total",
        "duplex_recordings_swept_total",
    }


def test_the_regions_dashboard_shows_the_turn_gateway_where_it_runs() -> None:
    from k8s_fixtures import make_workload

    from infra.k8s import monitoring

    def titles(workload: Any) -> list[str]:
        (config_map,) = [
            o
            for o in monitoring.grafana_objects(workload)
            if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "grafana-dashboards"
        ]
        return [p["title"] for p in json.loads(config_map["data"]["duplex-region.json"])["panels"]]

    assert "TURN relay up" not in titles(make_workload())
    with_turn = make_workload(turn_secret="t" * 40, turn_peer_ranges=("10.8.0.0/14",))
    assert "TURN relay up" in titles(with_turn) and "Sessions by transport" in titles(with_turn)
