"""A region's Kubernetes objects for the ``tests/test_k8s_*.py`` modules: a ``RegionWorkload`` with plain
strings where the stack passes Pulumi Outputs (``make_workload``), the values it holds (``SECRETS``,
``IMAGE``, ``CA``) and ``one`` to pick an object. ``conftest.py`` serves ``make_workload()`` and its
``region_objects`` as the module-scoped fixtures ``workload`` and ``objects``.

pytest puts ``tests/`` on ``sys.path``::

    from k8s_fixtures import make_workload, one
"""

from __future__ import annotations

import json
from typing import Any

from infra.k8s import base
from infra.node.profile.profiles import PROFILES

__all__ = ["CA", "IMAGE", "SECRETS", "make_workload", "one"]

SECRETS = {
    "redis_password": "redis-pw-0123456789abcdef",
    "token_keys_json": json.dumps({"k2025": "s" * 43}),
    "hf_token": "hf_SecretTokenForTests0123456789",
    "grafana_admin_password": "grafana-pw-0123456789abcdef",
}
"""The workload's secret fields (``RegionWorkload`` keyword arguments): they may appear only in Secrets."""
IMAGE = "us-central1-docker.pkg.dev/my-gcp-project/duplex/runtime@sha256:" + "ab" * 32
CA = "-----BEGIN CERTIFICATE-----\nTW9jayBNZW1vcnlzdG9yZSBDQQ==\n-----END CERTIFICATE-----\n"


def make_workload(**overrides: Any) -> base.RegionWorkload:
    """A region with plain values everywhere (the stack passes Outputs for the cloud's values): us-central1,
    one zone, profile ``a100-80gb``, 1-4 replicas; ``overrides`` replace any field."""
    fields: dict[str, Any] = {
        "region": "us-central1",
        "zones": ("us-central1-a",),
        "cluster_name": "duplex-multi-region-us-central1",
        "project": "my-gcp-project",
        "profile": PROFILES["a100-80gb"],
        "image": IMAGE,
        "accelerator": "nvidia-a100-80gb",
        "min_replicas": 1,
        "max_replicas": 4,
        "redis_host": "10.64.0.3",
        "redis_port": 6378,
        "redis_ca_certificate": CA,
        "weights_bucket": "duplex-models-us-central1",
        "runtime_service_account": "duplex-rt-0@my-gcp-project.iam.gserviceaccount.com",
        "weights_service_account": "duplex-wt-0@my-gcp-project.iam.gserviceaccount.com",
        "monitoring_service_account": "duplex-mon-0@my-gcp-project.iam.gserviceaccount.com",
        "neg_name": "duplex-multi-region-runtime",
        "page_neg_name": "duplex-multi-region-page",
        **SECRETS,
    }
    fields.update(overrides)
    return base.RegionWorkload(**fields)


def one(objects: list[dict], kind: str, name: str = base.APP_NAME) -> dict:
    """The one object of ``kind`` named ``name`` (the runtime's ``APP_NAME`` by default); fails unless
    there is exactly one."""
    [found] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found
