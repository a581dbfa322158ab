"""Prometheus rules for a node's own TLS certificate (issue 33, "Single nodes fail silently"): on a node with
``tls.mode: acme``, certbot's renew script (``infra.node.bundle.acme``) writes node_exporter textfile metrics
at each run, and these alerts read them through node_exporter (``NODE_EXPORTER_SELECTOR``). Let's Encrypt
stopped sending expiry e-mails on 2025-06-04 (letsencrypt.org/2025/01/22/ending-expiration-emails), so the
node has to say it itself.

The series (``infra.node.bundle.acme.METRICS_FILE``, each labelled ``domain``):
``duplex_tls_certificate_not_after_timestamp_seconds`` (the served certificate's notAfter, Unix s),
``duplex_acme_renewal_success`` (1: the last certbot run obtained or kept a valid certificate; 0: it failed,
or the name does not resolve yet, or nginx did not answer on port 80) and
``duplex_acme_renewal_last_run_timestamp_seconds`` (Unix s).

Alerts, each with its runbook in the description (docs/operations.md, "Alerts"):

- ``TlsCertificateExpiringSoon`` (ticket): fewer than ``EXPIRY_WARNING_DAYS`` days left;
- ``TlsCertificateExpiryCritical`` (page): fewer than ``EXPIRY_CRITICAL_DAYS`` days left;
- ``AcmeRenewalFailed`` (ticket): the last certbot run failed, for ``RENEWAL_FAILED_FOR`` (the first
  issuance retries every 5 minutes; a renewal twice a day);
- ``AcmeRenewalNotRunning`` (ticket): no run for ``RENEWAL_STALE_HOURS`` hours (the timer is off or the
  script hangs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra.node.monitoring.promql import AlertSpec, RuleTestKit, Series, sel
from infra.node.profile.profiles import NodeProfile

__all__ = [
    "EXPIRY_CRITICAL_DAYS",
    "EXPIRY_WARNING_DAYS",
    "NODE_EXPORTER_SELECTOR",
    "RENEWAL_FAILED_FOR",
    "RENEWAL_STALE_HOURS",
    "cert_alert_specs",
    "cert_healthy_series",
    "cert_rules_apply",
    "cert_test_groups",
]

NODE_EXPORTER_SELECTOR = 'job="node-exporter"'
"""Label matchers selecting node_exporter's target on a node (its textfile collector serves the metrics)."""
EXPIRY_WARNING_DAYS = 14
"""``TlsCertificateExpiringSoon`` fires below this many days left (certbot renews at 30 days left, so a
certificate reaching 14 has failed to renew for two weeks)."""
EXPIRY_CRITICAL_DAYS = 3
"""``TlsCertificateExpiryCritical`` pages below this many days left."""
RENEWAL_FAILED_FOR = "15m"
"""How long ``duplex_acme_renewal_success`` stays 0 before ``AcmeRenewalFailed``: three first-issuance
retries (``infra.node.bundle.acme.FIRST_RETRY_S``), so a transient failure retried at once stays quiet."""
RENEWAL_STALE_HOURS = 48
"""``AcmeRenewalNotRunning`` fires when the renew script has not run for this many hours (it runs twice a
day, ``infra.node.bundle.acme.TIMER``)."""

_NOT_AFTER = "duplex_tls_certificate_not_after_timestamp_seconds"
_SUCCESS = "duplex_acme_renewal_success"
_LAST_RUN = "duplex_acme_renewal_last_run_timestamp_seconds"
_DAY_S = 86400
_WHERE = "{{ $labels.domain }} on node {{ $labels.node }}"


def cert_rules_apply(profile: NodeProfile) -> bool:
    """True where the node renews its own certificate (``tls.mode: acme`` on a ``compose`` node: the renew
    script and node_exporter's textfile collector run there)."""
    return profile.tls.mode == "acme" and profile.deployment == "compose"


def cert_alert_specs(node_exporter: str = NODE_EXPORTER_SELECTOR) -> list[AlertSpec]:
    """The certificate alerts (module docstring) for node_exporter's targets ``node_exporter`` (normalised
    matchers without braces)."""
    left = f"{_NOT_AFTER}{sel(node_exporter)} - time()"
    runbook = (
        "certbot renews at 30 days left, twice a day: look at `journalctl -u duplex-certbot` and "
        "/var/lib/duplex/acme/logs (is the name still pointed at this node? does port 80 reach nginx?), fix, "
        "then `systemctl start duplex-certbot` (docs/deploying.md, 'Certificates on a single node')."
    )
    return [
        AlertSpec(
            "TlsCertificateExpiringSoon",
            f"{left} < {EXPIRY_WARNING_DAYS * _DAY_S}",
            "0s",
            "ticket",
            f"TLS certificate of {_WHERE} expires in under {EXPIRY_WARNING_DAYS} days",
            f"The certificate nginx serves for {_WHERE} expires in {{{{ $value | humanizeDuration }}}}. "
            + runbook,
        ),
        AlertSpec(
            "TlsCertificateExpiryCritical",
            f"{left} < {EXPIRY_CRITICAL_DAYS * _DAY_S}",
            "0s",
            "page",
            f"TLS certificate of {_WHERE} expires in under {EXPIRY_CRITICAL_DAYS} days",
            f"The certificate nginx serves for {_WHERE} expires in {{{{ $value | humanizeDuration }}}}: "
            "browsers and SIP/WebRTC clients will then refuse the node. " + runbook,
        ),
        AlertSpec(
            "AcmeRenewalFailed",
            f"{_SUCCESS}{sel(node_exporter)} == 0",
            RENEWAL_FAILED_FOR,
            "ticket",
            f"Certificate renewal failing for {_WHERE}",
            f"The last run of certbot for {_WHERE} failed (or the name does not resolve yet, or nginx did "
            f"not answer on port 80), and no run since has succeeded for {RENEWAL_FAILED_FOR}. " + runbook,
        ),
        AlertSpec(
            "AcmeRenewalNotRunning",
            f"time() - {_LAST_RUN}{sel(node_exporter)} > {RENEWAL_STALE_HOURS * 3600}",
            "0s",
            "ticket",
            f"Certificate renewal has not run for {_WHERE}",
            f"certbot's renew script last ran {{{{ $value | humanizeDuration }}}} ago for {_WHERE} (it runs "
            "twice a day): check `systemctl list-timers duplex-certbot.timer` and "
            "`journalctl -u duplex-certbot`.",
        ),
    ]


# --- promtool unit tests ---------------------------------------------------------------------------------

_HEALTHY_DAYS = 60


def cert_healthy_series(kit: RuleTestKit, ne: Mapping[str, str]) -> list[Series]:
    """A healthy node's certificate series for node_exporter's target labels ``ne`` (with ``domain``):
    60 days left, the last run a success at time 0."""
    return [
        (_NOT_AFTER, ne, kit.steady(_HEALTHY_DAYS * _DAY_S)),
        (_SUCCESS, ne, kit.steady(1)),
        (_LAST_RUN, ne, kit.steady(0)),
    ]


def cert_test_groups(kit: RuleTestKit, healthy: list[Series], ne: Mapping[str, str]) -> list[dict[str, Any]]:
    """For each alert a group where it fires (exact labels and annotations) on ``healthy`` with one thing
    made bad, and the boundaries: 14 days and a minute left is quiet, and so is a failure fixed by the next
    run (promtool's clock starts at Unix time 0: ``time()`` is the evaluation minute in seconds)."""
    late, check, expect, group, with_series = kit.late, kit.check, kit.expect, kit.group, kit.with_series
    now = late * 60
    warning, critical = EXPIRY_WARNING_DAYS * _DAY_S, EXPIRY_CRITICAL_DAYS * _DAY_S
    failed_for = int(RENEWAL_FAILED_FOR.removesuffix("m"))
    stale = RENEWAL_STALE_HOURS * 3600
    # Failed for 5 minutes, then a retry succeeds.
    fixed = f"0x5 1x{kit.horizon - 5}"
    return [
        group(
            f"TlsCertificateExpiringSoon: {EXPIRY_WARNING_DAYS - 4} days left",
            with_series(healthy, _NOT_AFTER, ne, kit.steady(warning - 4 * _DAY_S)),
            check(
                "TlsCertificateExpiringSoon",
                late,
                expect("TlsCertificateExpiringSoon", ne, warning - 4 * _DAY_S - now),
            ),
            check("TlsCertificateExpiryCritical", late),
        ),
        group(
            f"TlsCertificateExpiringSoon: {EXPIRY_WARNING_DAYS} days and a minute left at minute {late}",
            with_series(healthy, _NOT_AFTER, ne, kit.steady(warning + now + 60)),
            check("TlsCertificateExpiringSoon", late),
        ),
        group(
            f"TlsCertificateExpiryCritical: {EXPIRY_CRITICAL_DAYS - 1} days left",
            with_series(healthy, _NOT_AFTER, ne, kit.steady(critical - _DAY_S)),
            check(
                "TlsCertificateExpiryCritical",
                late,
                expect("TlsCertificateExpiryCritical", ne, critical - _DAY_S - now),
            ),
        ),
        group(
            "AcmeRenewalFailed: certbot keeps failing",
            with_series(healthy, _SUCCESS, ne, kit.steady(0)),
            check("AcmeRenewalFailed", failed_for - 1),
            check("AcmeRenewalFailed", late, expect("AcmeRenewalFailed", ne, 0)),
        ),
        group(
            "AcmeRenewalFailed: a failure the next run fixes is quiet",
            with_series(healthy, _SUCCESS, ne, fixed),
            check("AcmeRenewalFailed", late),
        ),
        group(
            f"AcmeRenewalNotRunning: the last run {RENEWAL_STALE_HOURS} hours and 10 minutes ago",
            with_series(healthy, _LAST_RUN, ne, kit.steady(-(stale + 600 - now))),
            check("AcmeRenewalNotRunning", late, expect("AcmeRenewalNotRunning", ne, stale + 600)),
        ),
        group(
            f"AcmeRenewalNotRunning: the last run just under {RENEWAL_STALE_HOURS} hours ago",
            with_series(healthy, _LAST_RUN, ne, kit.steady(-(stale - 600 - now))),
            check("AcmeRenewalNotRunning", late),
        ),
    ]
