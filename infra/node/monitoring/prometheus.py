"""Prometheus of one node, rendered from a ``NodeProfile``: ``render_prometheus`` gives its configuration
(static scrape targets from ``infra.node.bundle.services.endpoint``, alerts to the node's Alertmanager), its
rule file (``alert_rules``, ``infra.node.monitoring.alert_rules``) and the ``promtool test rules`` file for
those rules (``rules_unit_tests``, ``infra.node.monitoring.alert_rule_tests``). The same profile always gives
the same bytes.

``alert_rules``, ``rules_unit_tests`` and the selectors and thresholds are importable from here too, as they
were before the rules had modules of their own. The rules, each alert's condition and the selectors:
docs/operations.md, "Alerts"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from infra.node.bundle.services import Service, endpoint
from infra.node.monitoring.alert_rule_tests import rules_unit_tests
from infra.node.monitoring.alert_rules import (
    COTURN_SELECTOR,
    DCGM_SELECTOR,
    LOADING_ALERT_MINUTES,
    NODE_SIDE_REFUSALS,
    REDIS_SELECTOR,
    RUNTIME_SELECTOR,
    TICKS_OVER_BUDGET_FRACTION,
    alert_rules,
)
from infra.node.monitoring.rtc_rules import coturn_exported
from infra.node.profile.profiles import NodeProfile

__all__ = [
    "CONFIG_FILE",
    "COTURN_SELECTOR",
    "DCGM_SELECTOR",
    "NODE_SIDE_REFUSALS",
    "REDIS_SELECTOR",
    "RULES_FILE",
    "LOADING_ALERT_MINUTES",
    "RULES_TEST_FILE",
    "RUNTIME_SELECTOR",
    "scrape_interval",
    "TICKS_OVER_BUDGET_FRACTION",
    "alert_rules",
    "prometheus_args",
    "prometheus_config",
    "render_prometheus",
    "rules_unit_tests",
]

CONFIG_FILE = "prometheus/prometheus.yml"
"""The configuration, relative to the bundle root."""
RULES_FILE = "prometheus/rules/duplex-node.rules.yml"
"""The rule file, relative to the bundle root (``rule_files: [rules/*.yml]`` in the configuration)."""
RULES_TEST_FILE = "prometheus/tests/duplex-node.rules.test.yml"
"""The ``promtool test rules`` file, relative to the bundle root (outside ``rules/``: never loaded)."""

_HEADER = (
    "# Rendered by infra.node.monitoring.prometheus for profile {name!r}; edit the renderer, not this file.\n"
)


def scrape_interval(profile: NodeProfile) -> str:
    """The node's scrape and rule-evaluation interval, as Prometheus writes durations (``"5s"``)."""
    return f"{profile.scrape_interval_s}s"


def prometheus_config(profile: NodeProfile) -> dict[str, Any]:
    """``prometheus.yml`` as a dict: ``profile.scrape_interval_s`` scrape and evaluation intervals,
    ``rule_files: [rules/*.yml]`` (relative to the configuration's directory), and one job per scraped
    service with its static target from ``endpoint(profile, service)`` and the label ``node`` =
    ``profile.name``. dcgm-exporter is scraped only when ``profile.gpu`` is set, coturn (the TURN relay's
    exporter) only in a ``compose`` node with the relay on (Debian's coturn, which the local node runs, is
    built without one). ``alerting`` sends the alerts to the node's Alertmanager
    (``infra.node.monitoring.alertmanager``)."""
    # Job names are the service names.
    jobs: list[Service] = ["runtime", "prometheus", "node-exporter", "redis-exporter"]
    if profile.gpu is not None:
        jobs.append("dcgm-exporter")
    if coturn_exported(profile):
        jobs.append("coturn")
    return {
        "global": {
            "scrape_interval": scrape_interval(profile),
            # A scrape must end before the next one starts: 1 s less than the interval (at least 1 s).
            "scrape_timeout": f"{max(1, profile.scrape_interval_s - 1)}s",
            "evaluation_interval": scrape_interval(profile),
            "external_labels": {"node": profile.name},
        },
        "alerting": {
            "alertmanagers": [{"static_configs": [{"targets": [endpoint(profile, "alertmanager")]}]}]
        },
        "rule_files": ["rules/*.yml"],
        "scrape_configs": [
            {
                "job_name": service,
                "metrics_path": "/metrics",
                "static_configs": [
                    {"targets": [endpoint(profile, service)], "labels": {"node": profile.name}}
                ],
            }
            for service in jobs
        ],
    }


def _dump(profile: NodeProfile, document: Mapping[str, Any]) -> bytes:
    text = yaml.safe_dump(
        dict(document), sort_keys=False, default_flow_style=False, allow_unicode=True, width=4096
    )
    return (_HEADER.format(name=profile.name) + text).encode()


def render_prometheus(profile: NodeProfile) -> dict[str, bytes]:
    """The node's Prometheus files, {path relative to the bundle root: content}: ``CONFIG_FILE``,
    ``RULES_FILE`` (``alert_rules`` with the node's selectors) and ``RULES_TEST_FILE``
    (``rules_unit_tests``). Deterministic: the same profile gives the same bytes."""
    return {
        CONFIG_FILE: _dump(profile, prometheus_config(profile)),
        RULES_FILE: _dump(profile, alert_rules(profile)),
        RULES_TEST_FILE: _dump(profile, rules_unit_tests(profile)),
    }


def prometheus_args(profile: NodeProfile, config_path: str, data_dir: str, listen_address: str) -> list[str]:
    """Prometheus's command-line arguments (without the program name): ``--config.file``,
    ``--storage.tsdb.path``, ``--storage.tsdb.retention.time`` = ``profile.retention.prometheus_days``
    days (retention is a flag, not configuration) and ``--web.listen-address`` (``host:port``). The
    lifecycle API (``--web.enable-lifecycle``) stays off: reloads go through SIGHUP.

    Raises:
        ValueError: an empty path or address.
    """
    for name, value in (
        ("config_path", config_path),
        ("data_dir", data_dir),
        ("listen_address", listen_address),
    ):
        if not value:
            raise ValueError(f"{name} must not be empty")
    return [
        f"--config.file={config_path}",
        f"--storage.tsdb.path={data_dir}",
        f"--storage.tsdb.retention.time={profile.retention.prometheus_days}d",
        f"--web.listen-address={listen_address}",
    ]
