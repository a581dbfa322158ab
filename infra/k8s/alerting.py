"""Where one region's alerts go: GMP's managed Alertmanager, configured from the node's receivers.

The region's ``ClusterRules`` (``infra.k8s.monitoring``) are evaluated by GMP's rule-evaluator, which sends
firing alerts to the managed Alertmanager that GKE runs in ``gmp-system`` (the operator adds it to the
rule-evaluator's Alertmanagers whenever its Service exists). That Alertmanager reads one configuration:
the key ``alertmanager.yaml`` of the Secret ``alertmanager`` in namespace ``gmp-public``, which the GMP
operator copies into ``gmp-system`` (without it: a no-op configuration, alerts reach nobody). Sources:
Google Cloud's "Managed Service for Prometheus: configure a managed Alertmanager" page and the operator's
code, GoogleCloudPlatform/prometheus-engine ``pkg/operator/operator_config.go``
(``AlertmanagerPublicSecretName = "alertmanager"``, ``AlertmanagerPublicSecretKey = "alertmanager.yaml"``,
``ensureAlertmanagerConfigSecret``: the default selector, used when the ``OperatorConfig``'s
``managedAlertmanager.configSecret`` is unset, as here; nothing else to set in the ``OperatorConfig``).

The configuration is the node's (``infra.node.monitoring.alertmanager.alertmanager_config`` of the region's
profile:
the same receivers, routes and grouping as a single node), with one difference: the operator copies only
that key, so the receivers' secrets (the SMTP password, the PagerDuty routing key) are written into the
configuration itself rather than read from files. The Secret's text is therefore a secret as a whole (the
stack passes ``alert_secrets`` as a secret Output, which makes it one; a webhook URL may carry a token
too). Without any receiver (``profile.alerting.any`` false) no Secret is declared: the stack warns at
``up`` that alerts reach nobody.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra.k8s.base import PART_OF, RegionWorkload, lift
from infra.node.monitoring.alertmanager import alertmanager_config
from infra.node.profile.profiles import NodeProfile
from infra.yaml_text import dump_yaml

__all__ = [
    "ALERTMANAGER_SECRET",
    "ALERTMANAGER_SECRET_KEY",
    "GMP_PUBLIC_NAMESPACE",
    "alertmanager_secret",
    "managed_alertmanager_yaml",
]

GMP_PUBLIC_NAMESPACE = "gmp-public"
"""GMP's public namespace: where the operator reads the user's configuration (``DefaultPublicNamespace``)."""
ALERTMANAGER_SECRET = "alertmanager"
ALERTMANAGER_SECRET_KEY = "alertmanager.yaml"
"""The Secret (and key) the managed Alertmanager's configuration is read from (see the module docstring)."""


def managed_alertmanager_yaml(profile: NodeProfile, secrets: Mapping[str, str] | None) -> str:
    """The managed Alertmanager's configuration text for ``profile.alerting``, the receivers' secrets
    (``{role of OPTIONAL_SECRET_FILES: value}``) inline.

    Raises:
        ValueError: a secret the receivers use is missing from ``secrets``.
    """
    header = (
        f"# Rendered by infra.k8s.alerting (infra.node.monitoring.alertmanager's receivers) for profile "
        f"{profile.name!r}; GMP's managed Alertmanager reads it from Secret "
        f"{GMP_PUBLIC_NAMESPACE}/{ALERTMANAGER_SECRET}.\n"
    )
    return header + dump_yaml(alertmanager_config(profile, inline_secrets=dict(secrets or {})))


def alertmanager_secret(workload: RegionWorkload) -> dict[str, Any] | None:
    """Secret ``gmp-public/alertmanager`` with ``alertmanager.yaml`` = ``managed_alertmanager_yaml`` of the
    region's profile and ``workload.alert_secrets`` (a plain str, or an Output, secret when
    ``alert_secrets`` is); None when the profile has no receiver.

    Raises:
        ValueError: (plain ``alert_secrets``) a secret the receivers use is missing.
    """
    profile = workload.profile
    if not profile.alerting.any:
        return None
    secrets = workload.alert_secrets
    if secrets is None or isinstance(secrets, Mapping):
        text: Any = managed_alertmanager_yaml(profile, secrets)
    else:  # an Output of the mapping (the stack's secrets)
        text = lift(lambda plain: managed_alertmanager_yaml(profile, plain), secrets)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": ALERTMANAGER_SECRET,
            "namespace": GMP_PUBLIC_NAMESPACE,
            "labels": {"app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/component": "monitoring"},
        },
        "type": "Opaque",
        "stringData": {ALERTMANAGER_SECRET_KEY: text},
    }
