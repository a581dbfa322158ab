"""A node's monitoring, rendered from its profile: Prometheus (``prometheus``: its configuration, rule file
and rule tests), the rules (``alert_rules`` with ``cert_rules``, ``rtc_rules``, ``session_rules``,
``first_audio_rules``, over ``promql``) and their promtool tests (``alert_rule_tests``), Alertmanager
(``alertmanager``), Grafana (``grafana``: the node dashboard, built from ``grafana_panels`` and the
``dashboard_*_rows``). The Kubernetes stack reuses the rules (``infra.k8s``).
"""
