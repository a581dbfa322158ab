"""The node's Prometheus files (``infra.node.monitoring.prometheus``), checked by Prometheus's own tools:
``promtool check config``, ``promtool check rules`` and ``promtool test rules`` on the generated unit tests,
for every profile and for variants; mutations of the rules that those unit tests must catch; and a real
``prometheus`` started with ``prometheus_args`` on the rendered configuration.

promtool and prometheus come from the Debian/Ubuntu package ``prometheus`` (CI installs it); the tests that
need them are skipped, saying so, where they are not on PATH.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from infra.node.bundle.services import endpoint
from infra.node.monitoring.prometheus import (
    CONFIG_FILE,
    RULES_FILE,
    RULES_TEST_FILE,
    alert_rules,
    prometheus_args,
    render_prometheus,
    rules_unit_tests,
)
from infra.node.profile.profiles import PROFILES, NodeProfile, get_profile
from runtime.tools.local_redis import free_loopback_port

ALL_ALERTS = {
    "RuntimeDown",
    "RuntimeNotReady",
    "RuntimeLoadingTooLong",
    "RedisDown",
    "RedisMemoryNearFull",
    "FirstAudioLatencyHigh",
    "TicksOverBudget",
    "NodeAtSessionCap",
    "AdmissionsRefused",
    "RtpLossHigh",
    "RtcConnectSlow",
    "RtcCallsNotConnecting",
    "ResumeRefusalsHigh",
    "RecordingErrors",
}
TURN_ALERTS = {"TurnRelayDown"}
"""Only where the node scrapes coturn's exporter (a compose node with the relay on)."""
K8S_SELECTORS = {
    "runtime_selector": 'namespace="duplex", job="runtime"',
    "redis_selector": 'namespace="duplex",job="redis-exporter"',
    "dcgm_selector": 'namespace="gpu-operator", job="dcgm-exporter"',
    "coturn_selector": 'namespace="duplex", job="coturn"',
}


def _write(root: Path, files: dict[str, bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return root / "prometheus"


def _dump(document: dict) -> bytes:
    return yaml.safe_dump(document, sort_keys=False, width=4096).encode()


def _run(promtool: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, (
        f"{' '.join(result.args)} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )


def _check_all(promtool: str, root: Path, files: dict[str, bytes]) -> None:
    """promtool check config, check rules and test rules on the rendered files; all must pass."""
    prom = _write(root, files)
    _assert_ok(_run(promtool, prom, "check", "config", "prometheus.yml"))
    _assert_ok(_run(promtool, prom, "check", "rules", "rules/duplex-node.rules.yml"))
    _assert_ok(_run(promtool, prom, "test", "rules", "tests/duplex-node.rules.test.yml"))


def _alerts(rules: dict) -> dict[str, dict]:
    return {rule["alert"]: rule for group in rules["groups"] for rule in group["rules"] if "alert" in rule}


# --- promtool on every profile and on variants ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_promtool_accepts_config_rules_and_unit_tests(promtool: str, tmp_path: Path, name: str) -> None:
    _check_all(promtool, tmp_path, render_prometheus(PROFILES[name]))


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("l40s", {"limits": {"first_audio_p99_target_ms": 300.0, "at_cap_alert_minutes": 3}}),
        ("a100-80gb", {"limits": {"gpu_memory_alert_fraction": 0.75, "first_audio_p99_target_ms": 1500.0}}),
        # 200 ms: just above the 195.6 ms the planner says a T4 can reach at all (NodeProfile refuses less)
        ("t4-int8", {"limits": {"first_audio_p99_target_ms": 200.0, "at_cap_alert_minutes": 60}}),
        ("local", {"max_sessions": 1, "deployment": "compose"}),
        # ACME: the certificate's alerts (infra.node.monitoring.cert_rules) and their unit tests
        (
            "a100-80gb",
            {"domain": "voice.example.com", "tls": {"mode": "acme", "acme_email": "o@example.com"}},
        ),
    ],
)
def test_promtool_accepts_profile_variants(promtool: str, tmp_path: Path, name: str, overrides: dict) -> None:
    _check_all(promtool, tmp_path, render_prometheus(get_profile(name, **overrides)))


def test_kubernetes_selectors_give_valid_rules_and_passing_unit_tests(promtool: str, tmp_path: Path) -> None:
    profile = PROFILES["l40s"]
    rules = alert_rules(profile, **K8S_SELECTORS)
    for alert in _alerts(rules).values():
        assert '{job="' not in alert["expr"], alert
    assert 'up{namespace="duplex",job="runtime"}' in _alerts(rules)["RuntimeDown"]["expr"]
    assert 'namespace="gpu-operator",job="dcgm-exporter"' in _alerts(rules)["GpuMemoryHigh"]["expr"]
    assert 'absent(up{namespace="duplex",job="coturn"})' in _alerts(rules)["TurnRelayDown"]["expr"]
    without_relay = _alerts(alert_rules(profile, **{**K8S_SELECTORS, "coturn_selector": None}))
    assert set(without_relay) == set(_alerts(rules)) - TURN_ALERTS
    files = {
        RULES_FILE: _dump(rules),
        RULES_TEST_FILE: _dump(rules_unit_tests(profile, **K8S_SELECTORS)),
    }
    prom = _write(tmp_path, files)
    _assert_ok(_run(promtool, prom, "check", "rules", "rules/duplex-node.rules.yml"))
    _assert_ok(_run(promtool, prom, "test", "rules", "tests/duplex-node.rules.test.yml"))


def test_regex_selector_gives_valid_rules_but_no_unit_tests(promtool: str, tmp_path: Path) -> None:
    selector = 'namespace="duplex", pod=~"duplex-runtime-.+"'
    rules = alert_rules(PROFILES["a100-80gb"], runtime_selector=selector)
    prom = _write(tmp_path, {RULES_FILE: _dump(rules)})
    _assert_ok(_run(promtool, prom, "check", "rules", "rules/duplex-node.rules.yml"))
    with pytest.raises(ValueError, match="equality matchers"):
        rules_unit_tests(PROFILES["a100-80gb"], runtime_selector=selector)


@pytest.mark.parametrize(
    "selector", ['{job="runtime"}', "job=runtime", 'job!="runtime"', 'job=""', "", 'job="a" job="b"']
)
def test_bad_selector_is_refused(selector: str) -> None:
    with pytest.raises(ValueError, match="runtime_selector"):
        alert_rules(PROFILES["local"], runtime_selector=selector)


# --- the unit tests are not vacuous --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tests_for", "rules_for"),
    [
        ({"first_audio_p99_target_ms": 180.0}, {"first_audio_p99_target_ms": 250.0}),
        ({"first_audio_p99_target_ms": 250.0}, {"first_audio_p99_target_ms": 180.0}),
        ({"first_audio_p99_target_ms": 180.0}, {"first_audio_p99_target_ms": 190.0}),
        ({"at_cap_alert_minutes": 10}, {"at_cap_alert_minutes": 15}),
        ({"gpu_memory_alert_fraction": 0.9}, {"gpu_memory_alert_fraction": 0.97}),
        ({"gpu_memory_alert_fraction": 0.9}, {"gpu_memory_alert_fraction": 0.8}),
    ],
)
def test_unit_tests_fail_when_a_threshold_is_wrong(
    promtool: str, tmp_path: Path, tests_for: dict, rules_for: dict
) -> None:
    tests_profile = get_profile("l40s", limits=tests_for)
    rules_profile = get_profile("l40s", limits=rules_for)
    files = render_prometheus(tests_profile)
    files[RULES_FILE] = render_prometheus(rules_profile)[RULES_FILE]
    prom = _write(tmp_path, files)
    result = _run(promtool, prom, "test", "rules", "tests/duplex-node.rules.test.yml")
    assert result.returncode != 0, f"promtool passed rules for {rules_for} against tests for {tests_for}"
    assert "FAILED" in result.stdout + result.stderr


def _mutated(profile: NodeProfile, alert: str, expr: str) -> bytes:
    rules = copy.deepcopy(alert_rules(profile))
    _alerts(rules)[alert]["expr"] = expr
    return _dump(rules)


@pytest.mark.parametrize("alert", sorted(ALL_ALERTS | TURN_ALERTS | {"GpuMemoryHigh"}))
@pytest.mark.parametrize(
    ("kind", "expr"),
    [("never fires", "vector(1) == 0"), ("always fires", "vector(1)")],
)
def test_each_alert_has_positive_and_negative_cases(
    promtool: str, tmp_path: Path, alert: str, kind: str, expr: str
) -> None:
    """An alert that never fires must fail a positive case; one that always fires, a negative one."""
    profile = PROFILES["l40s"]
    files = render_prometheus(profile)
    files[RULES_FILE] = _mutated(profile, alert, expr)
    prom = _write(tmp_path, files)
    result = _run(promtool, prom, "test", "rules", "tests/duplex-node.rules.test.yml")
    assert result.returncode != 0, f"{alert} mutated to {kind} ({expr}) still passed the unit tests"
    assert alert in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("alert", "expr"),
    [
        # bad_request and token refusals are a client's fault: the healthy data has them and must not alert.
        ("AdmissionsRefused", 'increase(duplex_admissions_refused_total{job="runtime"}[5m]) > 0'),
        # A draining runtime reports not ready on purpose.
        ("RuntimeNotReady", 'duplex_ready{job="runtime"} == 0'),
        # A runtime loading its model reports not ready on purpose too.
        ("RuntimeNotReady", 'duplex_ready{job="runtime"} == 0 unless duplex_draining{job="runtime"} == 1'),
        # redis_exporter itself down (no redis_up at all) is Redis unobserved: it must alert.
        ("RedisDown", 'redis_up{job="redis-exporter"} == 0'),
        # A runtime missing from Prometheus must alert, not only a failing scrape.
        ("RuntimeDown", 'up{job="runtime"} == 0'),
        # A missing coturn target must alert too.
        ("TurnRelayDown", 'up{job="coturn"} == 0'),
        # One call's loss is the caller's network: the traffic floor must hold the alert back.
        (
            "RtpLossHigh",
            'sum without (outcome) (rate(duplex_rtp_packets_total{job="runtime",outcome="concealed"}[5m])) / '
            'sum without (outcome) (rate(duplex_rtp_packets_total{job="runtime",'
            'outcome=~"received|concealed"}[5m])) > 0.05',
        ),
        # A few unconnected calls in a quiet hour are not an outage: the answers floor must hold.
        (
            "RtcCallsNotConnecting",
            '(rate(duplex_rtc_answer_seconds_count{job="runtime"}[10m]) - '
            'rate(duplex_rtc_connect_seconds_count{job="runtime"}[10m])) / '
            'rate(duplex_rtc_answer_seconds_count{job="runtime"}[10m]) > 0.25',
        ),
        # Counting refusals alone (no share of the attempts) alerts on a healthy node's expired holds.
        (
            "ResumeRefusalsHigh",
            'sum without (reason) (increase(duplex_resume_refused_total{job="runtime"}[10m])) > 5',
        ),
        # A p50 instead of the p99 misses a slow tail.
        (
            "RtcConnectSlow",
            'histogram_quantile(0.5, rate(duplex_rtc_connect_seconds_bucket{job="runtime"}[10m])) > 1',
        ),
    ],
)
def test_unit_tests_catch_subtle_mistakes(promtool: str, tmp_path: Path, alert: str, expr: str) -> None:
    profile = PROFILES["l40s"]
    files = render_prometheus(profile)
    files[RULES_FILE] = _mutated(profile, alert, expr)
    prom = _write(tmp_path, files)
    result = _run(promtool, prom, "test", "rules", "tests/duplex-node.rules.test.yml")
    assert result.returncode != 0, f"{alert} as {expr!r} still passed the unit tests"


# --- content -----------------------------------------------------------------------------------------------


def test_files_and_determinism() -> None:
    for name, profile in PROFILES.items():
        first = render_prometheus(profile)
        assert set(first) == {CONFIG_FILE, RULES_FILE, RULES_TEST_FILE}
        assert first == render_prometheus(profile)
        assert first == render_prometheus(get_profile(name)), "an equal profile must give the same bytes"
        for content in first.values():
            assert isinstance(content, bytes) and content.endswith(b"\n")


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_scrape_jobs_targets_and_gpu_only_parts(name: str) -> None:
    profile = PROFILES[name]
    files = render_prometheus(profile)
    config = yaml.safe_load(files[CONFIG_FILE])
    interval = f"{profile.scrape_interval_s}s"  # 5 s on hosts, 1 s on the local node
    assert config["global"]["scrape_interval"] == config["global"]["evaluation_interval"] == interval
    timeout_s = int(config["global"]["scrape_timeout"].removesuffix("s"))
    assert 1 <= timeout_s <= profile.scrape_interval_s
    assert config["rule_files"] == ["rules/*.yml"]
    # Alerts go to the node's own Alertmanager (infra.node.monitoring.alertmanager).
    assert config["alerting"] == {
        "alertmanagers": [{"static_configs": [{"targets": [endpoint(profile, "alertmanager")]}]}]
    }
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    expected = ["runtime", "prometheus", "node-exporter", "redis-exporter"]
    if profile.gpu is not None:
        expected.append("dcgm-exporter")
    if profile.deployment == "compose":  # coturn's exporter (Debian's coturn on the local node has none)
        expected.append("coturn")
    assert list(jobs) == expected
    assert jobs["runtime"]["metrics_path"] == "/metrics"
    port = {"runtime": profile.ports.runtime, "prometheus": profile.ports.prometheus}
    port["coturn"] = profile.relay.metrics_port
    for job in jobs.values():
        (static,) = job["static_configs"]
        assert static["labels"] == {"node": name}
        (target,) = static["targets"]
        if job["job_name"] in port:
            assert target.endswith(f":{port[job['job_name']]}")
    if profile.deployment == "processes":
        assert jobs["runtime"]["static_configs"][0]["targets"] == [f"127.0.0.1:{profile.ports.runtime}"]

    alerts = _alerts(yaml.safe_load(files[RULES_FILE]))
    expected_alerts = ALL_ALERTS | ({"GpuMemoryHigh"} if profile.gpu is not None else set())
    assert set(alerts) == expected_alerts | (TURN_ALERTS if "coturn" in jobs else set())
    for rule in alerts.values():
        assert rule["labels"]["severity"] in ("page", "ticket")
        assert set(rule["annotations"]) == {"summary", "description"}
        assert "{{ $labels." in rule["annotations"]["summary"] + rule["annotations"]["description"]
    tests = yaml.safe_load(files[RULES_TEST_FILE])
    assert tests["rule_files"] == ["../rules/duplex-node.rules.yml"]
    tested = {case["alertname"] for group in tests["tests"] for case in group["alert_rule_test"]}
    assert tested == set(alerts)
    firing = {c["alertname"] for g in tests["tests"] for c in g["alert_rule_test"] if c["exp_alerts"]}
    assert firing == set(alerts), "every alert needs a case where it fires"


def test_thresholds_follow_the_profile() -> None:
    def alerts(profile: NodeProfile) -> dict[str, dict]:
        return _alerts(alert_rules(profile))

    assert PROFILES["l40s"].limits.first_audio_p99_target_ms == 180.0
    assert alerts(PROFILES["l40s"])["FirstAudioLatencyHigh"]["expr"].endswith("> 0.18")
    assert "180 ms" in alerts(PROFILES["l40s"])["FirstAudioLatencyHigh"]["annotations"]["summary"]
    assert get_profile("t4-int8").limits.first_audio_p99_target_ms == 250.0
    assert alerts(get_profile("t4-int8"))["FirstAudioLatencyHigh"]["expr"].endswith("> 0.25")
    variant = get_profile("l40s", limits={"first_audio_p99_target_ms": 212.5, "at_cap_alert_minutes": 7})
    assert alerts(variant)["FirstAudioLatencyHigh"]["expr"].endswith("> 0.2125")
    assert alerts(variant)["NodeAtSessionCap"]["for"] == "7m"
    gpu = get_profile("a100-80gb", limits={"gpu_memory_alert_fraction": 0.85})
    assert alerts(gpu)["GpuMemoryHigh"]["expr"].endswith("> 0.85")
    assert 'reason=~"node_full|draining|replay_check_unavailable"' in alerts(gpu)["AdmissionsRefused"]["expr"]


# --- command line and a real Prometheus --------------------------------------------------------------------


def test_prometheus_args() -> None:
    args = prometheus_args(PROFILES["l40s"], "/etc/prometheus/prometheus.yml", "/prometheus", "0.0.0.0:9090")
    assert args == [
        "--config.file=/etc/prometheus/prometheus.yml",
        "--storage.tsdb.path=/prometheus",
        "--storage.tsdb.retention.time=15d",
        "--web.listen-address=0.0.0.0:9090",
    ]
    local = prometheus_args(PROFILES["local"], "c.yml", "data", "127.0.0.1:9090")
    assert "--storage.tsdb.retention.time=1d" in local
    assert not any("lifecycle" in arg for arg in args + local)
    with pytest.raises(ValueError, match="data_dir"):
        prometheus_args(PROFILES["local"], "c.yml", "", "127.0.0.1:9090")


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def test_real_prometheus_starts_with_the_args_and_loads_the_rules(tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not on PATH (apt-get install prometheus); CI installs it")
    profile = PROFILES["local"]
    prom = _write(tmp_path / "bundle", render_prometheus(profile))
    address = f"127.0.0.1:{free_loopback_port()}"
    args = prometheus_args(profile, str(prom / "prometheus.yml"), str(tmp_path / "data"), address)
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen([binary, *args], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                with urllib.request.urlopen(f"http://{address}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.2)
        groups = _get_json(f"http://{address}/api/v1/rules")["data"]["groups"]
        assert {g["name"] for g in groups} == {"duplex-node.recording", "duplex-node.alerts"}
        loaded = {r["name"] for g in groups for r in g["rules"] if r["type"] == "alerting"}
        assert loaded == ALL_ALERTS
        info = _get_json(f"http://{address}/api/v1/status/runtimeinfo")["data"]
        assert info["storageRetention"].startswith("1d")
        # Prometheus adds its scrape targets one by one after /-/ready: wait for all four (a loaded CI
        # machine once read three), then check them.
        jobs = {"runtime", "prometheus", "node-exporter", "redis-exporter"}
        while True:
            targets = _get_json(f"http://{address}/api/v1/targets")["data"]["activeTargets"]
            if {t["labels"]["job"] for t in targets} == jobs:
                break
            assert time.monotonic() < deadline, f"active targets: {targets}"
            time.sleep(0.2)
        assert {t["labels"]["node"] for t in targets} == {"local"}
        try:
            urllib.request.urlopen(f"http://{address}/-/reload", data=b"", timeout=5).close()
        except urllib.error.HTTPError as exc:
            assert exc.code == 403, f"the lifecycle API answered {exc.code}; it must stay off"
        else:
            pytest.fail("the lifecycle API (/-/reload) answered 200; it must stay off")
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


# --- the first-audio budget's recording rules (issue 24) ------------------------------------------------


def test_the_first_audio_budget_terms_are_recorded_per_runtime() -> None:
    """Every term of the budget gets a mean and a p99 recording rule, read from its own histogram."""
    recording = alert_rules(PROFILES["l40s"])["groups"][0]["rules"]
    by_name = {rule["record"]: rule["expr"] for rule in recording}
    for term in ("ingress", "phase_wait", "ticks", "tick_compute", "egress"):
        metric = f"duplex_first_audio_{term}" + ("" if term == "ticks" else "_seconds")
        mean = by_name[f"duplex:first_audio_{term}:mean_5m"]
        assert mean == (
            f'rate({metric}_sum{{job="runtime"}}[5m]) / rate({metric}_count{{job="runtime"}}[5m])'
        )
        p99 = by_name[f"duplex:first_audio_{term}:p99_5m"]
        assert p99 == f'histogram_quantile(0.99, rate({metric}_bucket{{job="runtime"}}[5m]))'


_PHASE_WAIT_BUCKET = 'duplex_first_audio_phase_wait_seconds_bucket{job="runtime"}'
_EGRESS = 'duplex_first_audio_egress_seconds_{}{{job="runtime"}}'


@pytest.mark.parametrize(
    ("record", "wrong"),
    [
        # a p99 that is really a p90, and a mean over the wrong histogram: promtool's expression tests fail
        ("duplex:first_audio_phase_wait:p99_5m", f"histogram_quantile(0.9, rate({_PHASE_WAIT_BUCKET}[5m]))"),
        (
            "duplex:first_audio_ticks:mean_5m",
            f"rate({_EGRESS.format('sum')}[5m]) / rate({_EGRESS.format('count')}[5m])",
        ),
    ],
)
def test_the_budget_rules_unit_tests_catch_a_wrong_rule(
    promtool: str, tmp_path: Path, record: str, wrong: str
) -> None:
    profile = PROFILES["l40s"]
    rules = copy.deepcopy(alert_rules(profile))
    (rule,) = [r for r in rules["groups"][0]["rules"] if r.get("record") == record]
    rule["expr"] = wrong
    files = render_prometheus(profile)
    files[RULES_FILE] = _dump(rules)
    prom = _write(tmp_path, files)
    result = _run(promtool, prom, "test", "rules", "tests/duplex-node.rules.test.yml")
    assert result.returncode != 0, f"{record} = {wrong} passed the unit tests"
    assert record in result.stdout + result.stderr
