"""``NodeUptimeCheck``: a Cloud Monitoring uptime check of a single GCE node and an alert policy on it
(issue 33: Prometheus and Alertmanager run on the VM they watch, so a dead, preempted or stopped node
alerted nobody). Google's checkers, outside the VM, request ``https://<domain or address>/healthz``
every ``CHECK_PERIOD``; the policy opens an incident when more than one checker region fails for
``ALERT_DURATION`` and sends it to notification channels made from the stack's own alert receivers (the
e-mail address, the webhook URL) -- none configured: the incident shows in the console only, and ``up``
warns.

What it declares and what it cannot see: docs/deploying.md, "A node that dies"."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
import pulumi_gcp.monitoring as monitoring

from infra.components._util import COMPONENT_PACKAGE, child_options, dependencies
from infra.node.profile.profiles import NodeProfile

__all__ = [
    "ALERT_DURATION",
    "CHECK_PATH",
    "CHECK_PERIOD",
    "CHECK_TIMEOUT",
    "FAILING_REGIONS_THRESHOLD",
    "NodeUptimeCheck",
    "NodeUptimeCheckArgs",
    "check_passed_filter",
]

CHECK_PATH = "/healthz"
"""The node's liveness path through nginx (``infra.node.bundle.nginx``: proxied to the runtime)."""
CHECK_PERIOD = "60s"
"""How often each checker region requests it (the shortest period Cloud Monitoring offers:
``UptimeCheckConfig.period`` is one of 60s, 300s, 600s, 900s; pulumi-gcp ``uptime_check_config``)."""
CHECK_TIMEOUT = "10s"
"""How long a checker waits for the answer (1 to 60 s)."""
FAILING_REGIONS_THRESHOLD = 1
"""The policy fires when more than this many checker regions fail (one region's network blip alone is
not the node's death)."""
ALERT_DURATION = "300s"
"""How long the failing count must stay above the threshold before an incident opens (a 5-minute
outage; a Spot VM's restart takes longer, so a preemption pages)."""
_ALIGNMENT_PERIOD = "300s"


def check_passed_filter(check_id: str) -> str:
    """The Monitoring filter of the uptime check ``check_id``'s ``check_passed`` series, as Google's
    uptime alerting examples write it (cloud.google.com/monitoring/uptime-checks/uptime-alerting-policies:
    metric ``monitoring.googleapis.com/uptime_check/check_passed``, one boolean per checker region)."""
    return (
        'metric.type="monitoring.googleapis.com/uptime_check/check_passed" AND '
        f'metric.label.check_id="{check_id}" AND resource.type="uptime_url"'
    )


@dataclass(frozen=True)
class NodeUptimeCheckArgs:
    """One node's uptime check.

    Attributes:
        name_prefix: prefix of the display names (the VM's ``<prefix>-node``).
        project: the project holding the check and the policy (the node's).
        host: what the checkers request: the node's domain when it has one, else its external address.
        profile: the node profile (its HTTPS port; ``tls.mode`` decides whether the certificate is
            validated: only an ACME one can be).
    """

    name_prefix: str
    project: str
    host: pulumi.Input[str]
    profile: NodeProfile


class NodeUptimeCheck(pulumi.ComponentResource):
    """An uptime check of the node's ``/healthz`` over HTTPS, its alert policy, and the notification
    channels of the stack's receivers."""

    check: monitoring.UptimeCheckConfig
    policy: monitoring.AlertPolicy
    channels: list[monitoring.NotificationChannel]

    def __init__(self, name: str, args: NodeUptimeCheckArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PACKAGE}:NodeUptimeCheck", name, None, opts)
        deps = dependencies(opts)
        profile, prefix = args.profile, args.name_prefix
        self.check = monitoring.UptimeCheckConfig(
            f"{name}-check",
            project=args.project,
            display_name=f"duplexops node {prefix}: {CHECK_PATH}",
            period=CHECK_PERIOD,
            timeout=CHECK_TIMEOUT,
            http_check={
                "path": CHECK_PATH,
                "port": profile.ports.https,
                "use_ssl": True,
                # A self-signed certificate cannot be validated; an ACME one must be (expiry shows here).
                "validate_ssl": profile.tls.mode == "acme",
                "request_method": "GET",
            },
            monitored_resource={
                "type": "uptime_url",
                "labels": {"project_id": args.project, "host": args.host},
            },
            opts=child_options(self, deps),
        )
        self.channels = self._channels(name, args, deps)
        self.policy = monitoring.AlertPolicy(
            f"{name}-policy",
            project=args.project,
            display_name=f"duplexops node {prefix} unreachable",
            combiner="OR",
            severity="CRITICAL",
            conditions=[
                {
                    "display_name": f"{CHECK_PATH} failing from more than {FAILING_REGIONS_THRESHOLD} region",
                    "condition_threshold": {
                        "filter": self.check.uptime_check_id.apply(check_passed_filter),
                        "comparison": "COMPARISON_GT",
                        "threshold_value": FAILING_REGIONS_THRESHOLD,
                        "duration": ALERT_DURATION,
                        "trigger": {"count": 1},
                        "aggregations": [
                            {
                                "alignment_period": _ALIGNMENT_PERIOD,
                                "per_series_aligner": "ALIGN_NEXT_OLDER",
                                "cross_series_reducer": "REDUCE_COUNT_FALSE",
                                "group_by_fields": ["resource.label.*"],
                            }
                        ],
                    },
                }
            ],
            notification_channels=[channel.id for channel in self.channels],
            documentation={
                "mime_type": "text/markdown",
                "content": (
                    f"The node {prefix}-node does not answer `{CHECK_PATH}` over HTTPS from Google's uptime "
                    "checkers: it is stopped, preempted (Spot: the restarter starts it within 5 minutes "
                    "plus the model load), dead, or its certificate is invalid. Its own Prometheus cannot "
                    "say so. Look at `gcloud compute instances describe` and the serial console, then "
                    "docs/troubleshooting.md."
                ),
            },
            opts=child_options(self, deps),
        )
        self.register_outputs({"check_id": self.check.uptime_check_id})

    def _channels(
        self, name: str, args: NodeUptimeCheckArgs, deps: Sequence[pulumi.Resource]
    ) -> list[monitoring.NotificationChannel]:
        """Notification channels for the stack's receivers: an ``email`` channel for ``alertEmailTo``, a
        ``webhook_tokenauth`` channel for ``alertWebhookUrl`` (Cloud Monitoring posts its own incident
        JSON, not Alertmanager's). PagerDuty's routing key is not reused: Cloud Monitoring's ``pagerduty``
        channel takes a service integration key, which is another thing."""
        alerting = args.profile.alerting
        channels: list[monitoring.NotificationChannel] = []
        if alerting.email_to is not None:
            channels.append(
                monitoring.NotificationChannel(
                    f"{name}-email",
                    project=args.project,
                    display_name=f"duplexops {args.name_prefix}: {alerting.email_to}",
                    type="email",
                    labels={"email_address": alerting.email_to},
                    opts=child_options(self, list(deps)),
                )
            )
        if alerting.webhook_url is not None:
            channels.append(
                monitoring.NotificationChannel(
                    f"{name}-webhook",
                    project=args.project,
                    display_name=f"duplexops {args.name_prefix}: webhook",
                    type="webhook_tokenauth",
                    labels={"url": alerting.webhook_url},
                    opts=child_options(self, list(deps)),
                )
            )
        return channels
