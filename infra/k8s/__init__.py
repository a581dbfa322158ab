"""Kubernetes objects of one region of the multi-region stack, as plain manifests.

Every builder returns Kubernetes objects as plain dicts, camelCase, exactly as ``kubectl apply`` YAML would
hold them; leaf values that come from the cloud (the image digest, Memorystore's address and CA, service
account emails, secrets) may be Pulumi ``Output`` objects and are placed, never inspected. The Pulumi
side (``infra.components.regional_runtime``) declares them with pulumi-kubernetes.

- ``infra.k8s.workload``: ``RegionWorkload`` (what one region runs) and the runtime's objects: Namespace,
  ServiceAccounts, Secret, Redis CA ConfigMap, the weights-prefetch Job, the Deployment, its Service
  (standalone NEG for the global load balancer), PodDisruptionBudget and HorizontalPodAutoscaler; and the
  pieces the other modules build with: ``object_meta`` (``standard_labels``, ``selector_labels``),
  ``pod_security``/``container_security`` (Pod Security ``restricted``), ``service_account`` (Workload
  Identity) and ``cluster_ip_service``.
- ``infra.k8s.metrics_adapter``: Google's Custom Metrics Stackdriver Adapter (the HPA's metric source).
- ``infra.k8s.monitoring``: Google Managed Prometheus scrape configs and rules (the node's alert rules,
  reused), redis_exporter for Memorystore, the GMP query frontend and Grafana with the node dashboard.
- ``infra.k8s.region``: ``region_objects`` (everything, in apply order), the Workload Identity bindings and
  the operator commands (above the three builders, which never import it).
- ``infra.k8s.manifest``: ``to_manifest``, ``write_manifests`` and ``validate_manifests`` (strict, offline;
  its validators are dev-only and imported when it validates).
"""

from __future__ import annotations

from infra.k8s.workload import RegionWorkload, redis_address, redis_url

__all__ = ["RegionWorkload", "redis_address", "redis_url"]
