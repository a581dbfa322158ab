"""A GCE node is watched from outside (issue 33: its Prometheus and Alertmanager run on the VM they watch,
so a dead, preempted or stopped node alerted nobody): a Cloud Monitoring uptime check of ``/healthz`` over
HTTPS and an alert policy on its ``check_passed`` metric, sent to channels made from the stack's own
receivers. Read from the stacks' programs under Pulumi mocks (``tests/pulumi_harness.py``)."""

from __future__ import annotations

import pytest
from pulumi_harness import MOCK_IP, StackRun, run_stack

from infra.components.node_uptime import (
    ALERT_DURATION,
    CHECK_PATH,
    FAILING_REGIONS_THRESHOLD,
    check_passed_filter,
)
from infra.gcp_apis import required_apis

K = "duplexops:"
CHECK = "gcp:monitoring/uptimeCheckConfig:UptimeCheckConfig"
POLICY = "gcp:monitoring/alertPolicy:AlertPolicy"
CHANNEL = "gcp:monitoring/notificationChannel:NotificationChannel"
DOMAIN = "voice.example.com"
RECEIVERS = {
    K + "alertWebhookUrl": "https://hooks.example.com/duplex",
    K + "alertEmailTo": "oncall@example.com",
    K + "alertEmailFrom": "duplex@example.com",
    K + "alertEmailSmarthost": "smtp.example.com:587",
}


@pytest.fixture(scope="module")
def dev() -> StackRun:
    return run_stack("dev")


@pytest.mark.parametrize("stack", ["dev", "scale5-gcp"])
def test_every_gce_node_has_an_uptime_check_and_a_policy(stack: str) -> None:
    """Guards issue 33: no uptime check was declared for a single GCE node."""
    run = run_stack(stack)
    check = run.one(CHECK).plain
    assert check["httpCheck"] == {
        "path": CHECK_PATH,
        "port": 443,
        "useSsl": True,
        "validateSsl": False,  # self-signed without a domain
        "requestMethod": "GET",
    }
    assert check["monitoredResource"] == {
        "type": "uptime_url",
        "labels": {"project_id": "my-gcp-project", "host": MOCK_IP},
    }
    assert check["period"] == "60s" and check["project"] == "my-gcp-project"
    policy = run.one(POLICY).plain
    [condition] = policy["conditions"]
    threshold = condition["conditionThreshold"]
    assert threshold["filter"] == check_passed_filter("node-uptime-check-uptime-id")
    assert 'metric.type="monitoring.googleapis.com/uptime_check/check_passed"' in threshold["filter"]
    assert threshold["comparison"] == "COMPARISON_GT"
    assert threshold["thresholdValue"] == FAILING_REGIONS_THRESHOLD
    assert threshold["duration"] == ALERT_DURATION
    assert threshold["aggregations"][0]["crossSeriesReducer"] == "REDUCE_COUNT_FALSE"
    assert policy["notificationChannels"] == []  # no receiver configured (up warns)
    assert run.outputs["uptimeCheck"] == "node-uptime-check-uptime-id"


def test_uptime_check_validates_an_acme_certificate_on_the_domain() -> None:
    run = run_stack("dev", overrides={K + "domain": DOMAIN, K + "acmeEmail": "ops@example.com"})
    check = run.one(CHECK).plain
    assert check["monitoredResource"]["labels"]["host"] == DOMAIN
    assert check["httpCheck"]["validateSsl"] is True


def test_policy_notifies_the_stacks_receivers() -> None:
    """The stack's e-mail address and webhook become Cloud Monitoring channels of the policy."""
    run = run_stack("dev", overrides=RECEIVERS)
    channels = {c.plain["type"]: c for c in run.of_type(CHANNEL)}
    assert set(channels) == {"email", "webhook_tokenauth"}
    assert channels["email"].plain["labels"] == {"email_address": "oncall@example.com"}
    assert channels["webhook_tokenauth"].plain["labels"] == {"url": "https://hooks.example.com/duplex"}
    policy = run.one(POLICY).plain
    assert sorted(policy["notificationChannels"]) == sorted(f"{c.name}-id" for c in channels.values())


def test_monitoring_api_is_enabled_before_the_check(dev: StackRun) -> None:
    """A fresh project has Cloud Monitoring's API off: the stack enables it, and the check waits for it."""
    assert required_apis(CHECK, {}) == {"monitoring.googleapis.com": "gcp:monitoring/ resources"}
    services = {r.plain["service"]: r for r in dev.of_type("gcp:projects/service:Service")}
    assert "monitoring.googleapis.com" in services
    assert services["monitoring.googleapis.com"].urn in dev.ordered_after(dev.one(CHECK))
