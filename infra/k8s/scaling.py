"""Scaling of one region: the HorizontalPodAutoscaler of the runtime's Deployment on the active sessions
per pod, through Google Managed Prometheus and the Custom Metrics Stackdriver Adapter
(``infra.k8s.metrics_adapter``). docs/deploying.md, "Stack multi-region".
"""

from __future__ import annotations

from typing import Any

from infra.k8s.base import APP_NAME, RegionWorkload, object_meta, quantity

__all__ = [
    "HPA_METRIC",
    "HPA_SCALE_DOWN_WINDOW_S",
    "horizontal_pod_autoscaler",
    "hpa_target_average",
]

HPA_SCALE_DOWN_WINDOW_S = 1800
"""The HPA's scale-down stabilization window (s): see ``horizontal_pod_autoscaler``."""


def hpa_target_average(workload: RegionWorkload) -> str:
    """The HPA's target of active sessions per pod, as a Kubernetes quantity: slots per pod x
    ``target_slot_utilization`` (5 slots x 0.8 = ``4``; 3 x 0.8 = ``2400m``)."""
    return quantity(workload.slots * workload.target_slot_utilization)


HPA_METRIC = "prometheus.googleapis.com|duplex_active_sessions|gauge"
"""The runtime's ``duplex_active_sessions`` as the Custom Metrics Stackdriver Adapter serves GMP metrics
(``prometheus.googleapis.com/<name>/<kind>`` with ``/`` as ``|``), per pod."""


def horizontal_pod_autoscaler(workload: RegionWorkload) -> dict[str, Any]:
    """HorizontalPodAutoscaler (autoscaling/v2) of the Deployment, ``min_replicas``-``max_replicas`` pods, on
    the active sessions per pod (``HPA_METRIC``, type Pods) against ``hpa_target_average`` = slots x
    ``target_slot_utilization``: it adds a pod before the region is full.

    Behaviour: scale up at once (no stabilization; +2 pods or +100 % per minute, whichever is more): a new
    pod needs a GPU node and a model load, minutes, before it serves. Scale down slowly: the highest
    recommendation of the last ``HPA_SCALE_DOWN_WINDOW_S`` (30 min) and one pod per 10 min. A pod removed
    by scale-down keeps its GPU while it drains its conversations, for up to the grace period (an hour),
    and a new one costs a node start and a load: removing pods on a short dip and adding them back after
    would cost both. Which pod goes: the ReplicaSet deletes the one with the lowest
    ``controller.kubernetes.io/pod-deletion-cost``, which each runtime pod keeps at its live sessions
    (``infra.k8s.disruption``, ``runtime/fleet/deletion_cost.py``): the idlest, not the newest. Metrics
    reach the HPA through GMP and the adapter, a minute or two behind."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": object_meta(workload, APP_NAME, "runtime"),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": APP_NAME},
            "minReplicas": workload.min_replicas,
            "maxReplicas": workload.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": HPA_METRIC},
                        "target": {"type": "AverageValue", "averageValue": hpa_target_average(workload)},
                    },
                }
            ],
            "behavior": {
                "scaleUp": {
                    "stabilizationWindowSeconds": 0,
                    "selectPolicy": "Max",
                    "policies": [
                        {"type": "Pods", "value": 2, "periodSeconds": 60},
                        {"type": "Percent", "value": 100, "periodSeconds": 60},
                    ],
                },
                "scaleDown": {
                    "stabilizationWindowSeconds": HPA_SCALE_DOWN_WINDOW_S,
                    "selectPolicy": "Min",
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 600}],
                },
            },
        },
    }
