"""Monitoring of one region (``infra.k8s.monitoring``) and the metrics adapter
(``infra.k8s.metrics_adapter``): the node's rules with GMP's labels pass ``promtool check rules`` and
``promtool test rules``; the scrape configs, redis_exporter, the GMP frontend and Grafana's provisioning;
the adapter's objects as Google publishes them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from k8s_fixtures import make_workload, one
from test_node_alertmanager import ALL_RECEIVERS

from infra.k8s import base, metrics_adapter, monitoring, region
from infra.k8s.manifest import validate_manifests
from infra.node.profile.profiles import get_profile


def _promtool(promtool: str, cwd: Path, *args: str) -> None:
    result = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"promtool {' '.join(args)}\n{result.stdout}\n{result.stderr}"


@pytest.mark.parametrize(
    "profile",
    [
        get_profile("a100-80gb"),
        get_profile("t4-int8", domain="duplex.example.com"),
        get_profile("a100-80gb", max_sessions=3, limits={"max_session_s": 900, "at_cap_alert_minutes": 3}),
    ],
    ids=["a100-80gb", "t4-int8", "a100-3-slots"],
)
def test_cluster_rules_pass_promtool(promtool: str, tmp_path: Path, profile) -> None:
    accelerator = {"t4": "nvidia-tesla-t4"}.get(profile.gpu, "nvidia-a100-80gb")
    workload = make_workload(profile=profile, accelerator=accelerator)
    rules = monitoring.cluster_rules(workload)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rules["spec"]["groups"]}, sort_keys=False))
    tests = monitoring.alert_rules_unit_tests(workload, rule_file="rules.yml")
    (tmp_path / "rules.test.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    _promtool(promtool, tmp_path, "check", "rules", "rules.yml")
    _promtool(promtool, tmp_path, "test", "rules", "rules.test.yml")


def test_turn_relay_rules_only_with_the_regions_turn_gateway(promtool: str, tmp_path: Path) -> None:
    """A region with a TURN secret runs coturn (PodMonitoring ``coturn``): TurnRelayDown selects that job in
    the runtime's namespace, and its unit tests pass; without one, no relay rule (it would fire on
    absence)."""
    plain = make_workload()
    assert monitoring.alert_selectors(plain)["coturn_selector"] is None
    alerts = {r["alert"] for g in monitoring.rule_groups(plain) for r in g["rules"] if "alert" in r}
    assert "TurnRelayDown" not in alerts and "RtcCallsNotConnecting" in alerts
    workload = make_workload(turn_secret="t" * 40, turn_peer_ranges=("10.8.0.0/14",))
    assert one(region.region_objects(workload), "PodMonitoring", "coturn")
    rules = {r["alert"]: r for g in monitoring.rule_groups(workload) for r in g["rules"] if "alert" in r}
    assert rules["TurnRelayDown"]["expr"] == (
        'up{namespace="duplex",job="coturn"} == 0 or absent(up{namespace="duplex",job="coturn"})'
    )
    (tmp_path / "rules.yml").write_text(
        yaml.safe_dump({"groups": monitoring.rule_groups(workload)}, sort_keys=False)
    )
    tests = monitoring.alert_rules_unit_tests(workload, rule_file="rules.yml")
    (tmp_path / "rules.test.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    _promtool(promtool, tmp_path, "test", "rules", "rules.test.yml")


def test_rules_select_gmp_target_labels(objects: list[dict]) -> None:
    rules = one(objects, "ClusterRules", "duplex-rules")
    assert "namespace" not in rules["metadata"]  # cluster-scoped
    groups = rules["spec"]["groups"]
    assert [g["interval"] for g in groups] == [monitoring.RULE_INTERVAL] * len(groups)
    alerts = {r["alert"]: r["expr"] for g in groups for r in g["rules"] if "alert" in r}
    assert 'up{namespace="duplex",job="runtime"}' in alerts["RuntimeDown"]
    assert 'redis_up{namespace="duplex",job="redis-exporter"}' in alerts["RedisDown"]
    assert (
        'DCGM_FI_DEV_FB_USED{namespace="gke-managed-system",job="gke-managed-dcgm-exporter"}'
        in (alerts["GpuMemoryHigh"])
    )
    # The job labels are the PodMonitorings' names.
    assert one(objects, "PodMonitoring", monitoring.RUNTIME_JOB)
    assert one(objects, "PodMonitoring", monitoring.REDIS_EXPORTER_NAME)


def test_pod_monitorings_scrape_the_runtime_and_the_exporter(objects: list[dict], workload) -> None:
    runtime = one(objects, "PodMonitoring", "runtime")
    assert runtime["apiVersion"] == "monitoring.googleapis.com/v1"
    assert runtime["spec"]["selector"]["matchLabels"] == base.pod_labels(workload)
    assert runtime["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "5s"}]
    assert "node" in runtime["spec"]["targetLabels"]["metadata"]
    exporter = one(objects, "PodMonitoring", "redis-exporter")
    [endpoint] = exporter["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    deployment = one(objects, "Deployment", "redis-exporter")
    assert exporter["spec"]["selector"]["matchLabels"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )


def test_redis_exporter_watches_memorystore_over_tls(objects: list[dict]) -> None:
    deployment = one(objects, "Deployment", "redis-exporter")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "oliver006/redis_exporter:v1.74.0-alpine"  # the node's pin
    env = {e["name"]: e for e in container["env"]}
    assert env["REDIS_ADDR"]["value"] == "rediss://10.64.0.3:6378"
    assert env["REDIS_PASSWORD"]["valueFrom"] == {
        "secretKeyRef": {"name": base.SECRET_NAME, "key": "redis-password"}
    }
    assert env["REDIS_EXPORTER_TLS_CA_CERT_FILE"]["value"] == base.REDIS_CA_PATH
    assert {"name": "redis-ca", "mountPath": "/etc/duplex/redis-ca", "readOnly": True} in container[
        "volumeMounts"
    ]


def test_frontend_queries_the_project_as_the_monitoring_account(objects: list[dict], workload) -> None:
    account = one(objects, "ServiceAccount", monitoring.FRONTEND_NAME)
    assert (
        account["metadata"]["annotations"]["iam.gke.io/gcp-service-account"]
        == workload.monitoring_service_account
    )
    deployment = one(objects, "Deployment", monitoring.FRONTEND_NAME)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == monitoring.FRONTEND_NAME
    [container] = pod["containers"]
    assert container["image"].startswith("gke.gcr.io/prometheus-engine/frontend:v")
    assert container["args"] == ["--web.listen-address=:9090", "--query.project-id=my-gcp-project"]


def test_grafana_is_provisioned_with_the_node_dashboard(objects: list[dict], workload) -> None:
    provisioning = one(objects, "ConfigMap", "grafana-provisioning")["data"]
    datasources = yaml.safe_load(provisioning["datasources.yml"])
    [source] = datasources["datasources"]
    assert source["url"] == "http://gmp-frontend.duplex.svc:9090"
    providers = yaml.safe_load(provisioning["dashboards.yml"])
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads(one(objects, "ConfigMap", "grafana-dashboards")["data"]["duplex-region.json"])
    assert dashboard["uid"] == "duplex-us-central1"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    scope = (
        'cluster="duplex-multi-region-us-central1", location="us-central1", '
        'namespace=~"duplex|gke-managed-system"'
    )
    assert exprs and all(scope in e for e in exprs)
    assert any("DCGM_FI_DEV_FB_USED" in e for e in exprs)
    assert len(json.dumps(dashboard)) < 1_000_000  # a ConfigMap holds at most 1 MiB
    deployment = one(objects, "Deployment", monitoring.GRAFANA_NAME)
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    [admin] = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "admin"]
    assert admin["secret"]["items"] == [{"key": "admin-password", "path": "grafana_admin_password"}]
    assert region.grafana_port_forward(workload) == "kubectl -n duplex port-forward svc/grafana 3000:3000"
    assert "secret grafana-admin" in region.grafana_password_command()


def test_adapter_objects_follow_googles_manifest(objects: list[dict], workload) -> None:
    adapter = [o for o in objects if o["metadata"].get("namespace") == "custom-metrics"]
    assert {o["kind"] for o in adapter} == {"ServiceAccount", "Deployment", "Service"}
    account = one(objects, "ServiceAccount", metrics_adapter.ADAPTER_NAME)
    assert (
        account["metadata"]["annotations"]["iam.gke.io/gcp-service-account"]
        == workload.monitoring_service_account
    )
    deployment = one(objects, "Deployment", metrics_adapter.ADAPTER_NAME)
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == metrics_adapter.ADAPTER_IMAGE
    assert "--use-new-resource-model=true" in container["command"]
    services = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "APIService"}
    assert set(services) == {
        "v1beta1.custom.metrics.k8s.io",
        "v1beta2.custom.metrics.k8s.io",
        "v1beta1.external.metrics.k8s.io",
    }
    for spec in services.values():
        assert spec["service"] == {"name": metrics_adapter.ADAPTER_NAME, "namespace": "custom-metrics"}
    assert validate_manifests(metrics_adapter.adapter_objects(workload)) == []


# --- GMP's managed Alertmanager (infra.k8s.alerting) ----------------------------------------------------

_ALERT_SECRETS = {"alert_email_password": "smtp-pw-0123", "alert_pagerduty_routing_key": "R" * 32}


def test_managed_alertmanager_gets_the_node_receivers_inline(tmp_path: Path) -> None:
    """The region's Secret gmp-public/alertmanager (the one key GMP's operator copies) holds the node's
    Alertmanager configuration (same routes and receivers) with the secrets inline instead of files;
    amtool accepts it; it validates as a Kubernetes Secret."""
    from infra.k8s import alerting
    from infra.node.monitoring.alertmanager import alertmanager_config

    profile = get_profile("a100-80gb", alerting=ALL_RECEIVERS)
    workload = make_workload(profile=profile, alert_secrets=_ALERT_SECRETS)
    secret = one(region.region_objects(workload), "Secret", alerting.ALERTMANAGER_SECRET)
    assert secret["metadata"]["namespace"] == alerting.GMP_PUBLIC_NAMESPACE == "gmp-public"
    text = secret["stringData"][alerting.ALERTMANAGER_SECRET_KEY]
    assert alerting.ALERTMANAGER_SECRET_KEY == "alertmanager.yaml"
    (tmp_path / "am.yml").write_text(text)
    result = subprocess.run(
        ["amtool", "check-config", str(tmp_path / "am.yml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    gmp, node = yaml.safe_load(text), alertmanager_config(profile)
    assert gmp["route"] == node["route"]
    page = {r["name"]: r for r in gmp["receivers"]}["duplex-page"]
    assert page["pagerduty_configs"][0]["routing_key"] == "R" * 32
    assert page["email_configs"][0]["auth_password"] == "smtp-pw-0123"
    assert "_file" not in text
    assert validate_manifests([secret]) == []


def test_managed_alertmanager_needs_receivers_and_their_secrets() -> None:
    """No receiver: no Secret (GMP keeps its no-op configuration). A receiver whose secret is missing: a
    clear error naming the secret."""
    from infra.k8s import alerting

    assert alerting.alertmanager_secret(make_workload()) is None
    profile = get_profile("a100-80gb", alerting=ALL_RECEIVERS)
    with pytest.raises(ValueError, match="alert_email_password"):
        alerting.alertmanager_secret(make_workload(profile=profile, alert_secrets={}))
