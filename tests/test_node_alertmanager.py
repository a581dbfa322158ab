"""Alerts that reach someone (issue 20, item 8): the node's Alertmanager configuration, checked by
``amtool check-config`` for every profile and receiver combination, and a real Prometheus and a real
Alertmanager on loopback, both from the rendered bundle, delivering a firing alert to a webhook server the
test runs."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.node.bundle.cloud_init import USER_DATA_FILE, render_cloud_init
from infra.node.bundle.compose import COMPOSE_FILE
from infra.node.bundle.render import render_bundle, write_bundle, write_secrets
from infra.node.bundle.services import (
    OPTIONAL_SECRET_FILES,
    SECRET_FILES,
    NodeSecrets,
    endpoint,
    secret_files,
)
from infra.node.local.node import REQUIRED_BINARIES, free_port_profile
from infra.node.monitoring.alertmanager import (
    ALERTMANAGER_CONFIG,
    PAGE_RECEIVER,
    TICKET_RECEIVER,
    alertmanager_args,
    alertmanager_config,
    render_alertmanager,
)
from infra.node.monitoring.prometheus import CONFIG_FILE, prometheus_args
from infra.node.profile.profiles import PROFILES, NodeProfile, get_profile

WAIT_S = 90.0

ALL_RECEIVERS = {
    "webhook_url": "https://hooks.example.com/duplex",
    "email_to": "oncall@example.com",
    "email_from": "duplex@example.com",
    "email_smarthost": "smtp.example.com:587",
    "email_password": True,
    "pagerduty": True,
}


def _amtool_check(tmp_path: Path, profile: NodeProfile) -> subprocess.CompletedProcess[str]:
    path = tmp_path / f"{profile.name}-alertmanager.yml"
    path.write_bytes(render_alertmanager(profile)[ALERTMANAGER_CONFIG])
    return subprocess.run(["amtool", "check-config", str(path)], capture_output=True, text=True, check=False)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_amtool_accepts_every_profile(name: str, tmp_path: Path) -> None:
    result = _amtool_check(tmp_path, PROFILES[name])
    assert result.returncode == 0, result.stdout + result.stderr


def test_receivers_from_the_profile(tmp_path: Path) -> None:
    """Every receiver kind renders and passes amtool; pages reach PagerDuty, tickets never do; secrets are
    files, never values."""
    profile = get_profile("a100-80gb", alerting=ALL_RECEIVERS)
    result = _amtool_check(tmp_path, profile)
    assert result.returncode == 0, result.stdout + result.stderr
    config = alertmanager_config(profile)
    receivers = {r["name"]: r for r in config["receivers"]}
    page, ticket = receivers[PAGE_RECEIVER], receivers[TICKET_RECEIVER]
    assert page["pagerduty_configs"] == [
        {
            "routing_key_file": "/run/secrets/alert_pagerduty_routing_key",
            "send_resolved": True,
            "severity": "critical",
        }
    ]
    assert "pagerduty_configs" not in ticket
    for receiver in (page, ticket):
        assert receiver["webhook_configs"] == [{"url": ALL_RECEIVERS["webhook_url"], "send_resolved": True}]
        (email,) = receiver["email_configs"]
        assert email["auth_password_file"] == "/run/secrets/alert_email_password"
        assert email["auth_username"] == "duplex@example.com" and email["require_tls"] is True
    assert config["route"]["receiver"] == TICKET_RECEIVER
    assert config["route"]["routes"] == [
        {"receiver": PAGE_RECEIVER, "matchers": ['severity="page"'], "repeat_interval": "1h"}
    ]

    # The Compose file mounts the two secrets into Alertmanager; cloud-init fetches them when given.
    compose = yaml.safe_load(render_bundle(profile)[COMPOSE_FILE])
    assert compose["services"]["alertmanager"]["secrets"] == list(OPTIONAL_SECRET_FILES)
    for role, path in OPTIONAL_SECRET_FILES.items():
        assert compose["secrets"][role] == {"file": f"./{path}"}
    ids = {role: role.replace("_", "-") for role in SECRET_FILES}
    with pytest.raises(ValueError, match="missing role.*alert_email_password"):
        render_cloud_init(profile, render_bundle(profile), secret_manager_secrets=ids)
    all_ids = ids | {role: role.replace("_", "-") for role in OPTIONAL_SECRET_FILES}
    user_data = render_cloud_init(profile, render_bundle(profile), secret_manager_secrets=all_ids)
    assert "fetch alert-pagerduty-routing-key /etc/duplex/secrets/alert_pagerduty_routing_key 0640" in (
        user_data[USER_DATA_FILE].decode()
    )
    with pytest.raises(ValueError, match="does not use it"):
        plain = get_profile("a100-80gb")
        render_cloud_init(plain, render_bundle(plain), secret_manager_secrets=all_ids)

    # The secret files are written only with values.
    keys = {"k1": "x" * 64}
    base = {
        "redis_password": "r" * 20,
        "grafana_admin_password": "g" * 20,
        "token_keys": keys,
        "app_token_keys": {"a": "t" * 43},
    }
    base["turn_secret"] = "t" * 40
    with pytest.raises(ValueError, match="alert_email_password"):
        secret_files(profile, NodeSecrets(**base))
    files = secret_files(
        profile, NodeSecrets(**base, alert_email_password="smtp-pw", alert_pagerduty_routing_key="R0UT1NG")
    )
    assert files[OPTIONAL_SECRET_FILES["alert_pagerduty_routing_key"]] == b"R0UT1NG"
    assert b"smtp-pw" not in render_alertmanager(profile)[ALERTMANAGER_CONFIG]


@pytest.mark.parametrize(
    "receivers, problem",
    [
        ({"email_to": "a@example.com"}, "missing: email_from, email_smarthost"),
        ({"webhook_url": "ftp://x"}, "not an http"),
        ({"email_password": True}, "without email_to"),
        (
            {"email_to": "a@example.com", "email_from": "b@example.com", "email_smarthost": "smtp"},
            "not host:port",
        ),
    ],
)
def test_bad_receivers_are_refused(receivers: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        get_profile("l40s", alerting=receivers)


# --- a firing alert reaches a webhook ----------------------------------------------------------------------


class _Webhook:
    """An HTTP server on loopback that records Alertmanager's webhook POSTs and sets an event on each."""

    def __init__(self) -> None:
        self.payloads: list[dict[str, Any]] = []
        self.received = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                outer.payloads.append(json.loads(body))
                outer.received.set()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook() -> Iterator[_Webhook]:
    hook = _Webhook()
    yield hook
    hook.close()


ALWAYS_FIRING = {
    "groups": [
        {
            "name": "test",
            "rules": [
                {
                    "alert": "DuplexTestAlwaysFiring",
                    "expr": "vector(1)",
                    # Prometheus drops what an evaluation sends before it has discovered its Alertmanager
                    # (its service discovery publishes every 5 s) and resends only after
                    # --rules.alert.resend-delay (1 m): the alert fires once discovery is done.
                    "for": "10s",
                    "labels": {"severity": "page"},
                    "annotations": {"summary": "a test alert that always fires"},
                }
            ],
        }
    ]
}


def test_a_firing_alert_reaches_the_webhook(
    tmp_path: Path, webhook: _Webhook, started: list[subprocess.Popen[bytes]]
) -> None:
    """Guards item 8 (alerts reached nobody: no Alertmanager, no alerting section): the rendered Prometheus
    sends a firing alert to the rendered Alertmanager, which delivers it to the configured webhook."""
    profile = free_port_profile(alerting={"webhook_url": webhook.url, "group_wait_s": 0})
    node_dir = tmp_path / "node"
    for sub in ("logs", "prometheus/data", "alertmanager/data"):
        (node_dir / sub).mkdir(parents=True)
    write_bundle(render_bundle(profile), node_dir)
    write_secrets(profile, NodeSecrets.generate(), node_dir)
    (node_dir / "prometheus" / "rules" / "always.yml").write_text(yaml.safe_dump(ALWAYS_FIRING))
    assert yaml.safe_load((node_dir / CONFIG_FILE).read_text())["alerting"]["alertmanagers"] == [
        {"static_configs": [{"targets": [endpoint(profile, "alertmanager")]}]}
    ]

    commands = {
        "alertmanager": [
            "prometheus-alertmanager",
            *alertmanager_args(ALERTMANAGER_CONFIG, "alertmanager/data", endpoint(profile, "alertmanager")),
        ],
        "prometheus": [
            "prometheus",
            *prometheus_args(profile, CONFIG_FILE, "prometheus/data", endpoint(profile, "prometheus")),
        ],
    }
    assert "prometheus-alertmanager" in REQUIRED_BINARIES  # the local node runs it too
    logs = {}
    for name, argv in commands.items():
        logs[name] = node_dir / "logs" / f"{name}.log"
        with open(logs[name], "wb") as out:
            started.append(subprocess.Popen(argv, cwd=node_dir, stdout=out, stderr=subprocess.STDOUT))

    deadline = time.monotonic() + WAIT_S
    while not webhook.received.wait(0.2):
        for proc, (name, log) in zip(started, logs.items(), strict=True):
            assert proc.poll() is None, f"{name} exited {proc.returncode}: {log.read_text()}"
        assert time.monotonic() < deadline, f"no webhook delivery within {WAIT_S:.0f} s: " + " | ".join(
            log.read_text()[-2000:] for log in logs.values()
        )
    payload = webhook.payloads[0]
    assert payload["version"] == "4" and payload["status"] == "firing"
    assert payload["receiver"] == PAGE_RECEIVER
    (alert,) = [a for a in payload["alerts"] if a["labels"]["alertname"] == "DuplexTestAlwaysFiring"]
    assert alert["labels"]["severity"] == "page" and alert["labels"]["node"] == profile.name
    assert alert["annotations"]["summary"] == "a test alert that always fires"
