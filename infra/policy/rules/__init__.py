"""The deployment rules of the ``duplexops-policies`` pack, as pure functions, one module per resource type
or family, put together here in :data:`RULES` and :data:`STACK_RULES`.

Each rule is ``rule(resource_type, props) -> list[str]``: the violation messages for one resource (empty
when it passes or does not apply). ``props`` may be camelCase (as the engine hands them) or snake_case. A
value unknown at preview (:data:`UNKNOWN`) passes; a missing one is judged as the provider's default. No
Pulumi import: ``infra.policy.pack`` wraps these for the engine, and :func:`check_resources` serves the
stacks' tests.

Each rule, what it enforces and why, and unknown values: infra/policy/README.md, "The rules" (linked from
docs/deploying.md, "Deploying (Pulumi)")."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from infra.capacity.gcp import IAP_SOURCE_RANGE
from infra.names import GPU_TAINT
from infra.policy.rules._common import (
    BACKEND_SERVICE,
    BUCKET,
    CLUSTER,
    FIREWALL,
    INSTANCE,
    INSTANCE_TEMPLATE,
    NODE_POOL,
    REDIS,
    SSL_POLICY,
    TARGET_HTTPS_PROXY,
    UNKNOWN,
    UNKNOWN_SENTINELS,
    StackResource,
    is_unknown,
)
from infra.policy.rules._gpus import ACCELERATOR_GPUS
from infra.policy.rules._gpus import BUILT_IN_GPU_SERIES as BUILT_IN_GPU_SERIES
from infra.policy.rules.compute_instance import MIN_GRACEFUL_SHUTDOWN_S as MIN_GRACEFUL_SHUTDOWN_S
from infra.policy.rules.compute_instance import (
    gpu_instance_graceful_shutdown,
    gpu_instance_terminates_on_maintenance,
    provisioning_model_sold,
)
from infra.policy.rules.firewall import (
    GRAFANA_PORT,
    PROMETHEUS_PORT,
    firewall_no_public_monitoring,
    firewall_no_world_ssh,
)
from infra.policy.rules.firewall import PRIVATE_SOURCE_RANGES as PRIVATE_SOURCE_RANGES
from infra.policy.rules.gke import GPU_TAINT_EFFECT as GPU_TAINT_EFFECT
from infra.policy.rules.gke import gpu_node_pool_tainted, gpu_node_pool_upgrade_needs_no_extra_gpu
from infra.policy.rules.load_balancing import HASH_LOCALITY_POLICIES as HASH_LOCALITY_POLICIES
from infra.policy.rules.load_balancing import (
    MIN_WEBSOCKET_BACKEND_TIMEOUT_S,
    backend_timeout_fits_websockets,
    https_proxy_tls_1_2,
    session_affinity_needs_hash_policy,
)
from infra.policy.rules.machine_types import machine_type_carries_gpu
from infra.policy.rules.memorystore import redis_requires_auth
from infra.policy.rules.project_apis import apis_enabled_for_features
from infra.policy.rules.storage import bucket_private, recordings_bucket_retention

__all__ = [
    "ACCELERATOR_GPUS",
    "BACKEND_SERVICE",
    "BUCKET",
    "CLUSTER",
    "MIN_WEBSOCKET_BACKEND_TIMEOUT_S",
    "FIREWALL",
    "INSTANCE",
    "INSTANCE_TEMPLATE",
    "NODE_POOL",
    "REDIS",
    "RULES",
    "UNKNOWN",
    "UNKNOWN_SENTINELS",
    "STACK_RULES",
    "Rule",
    "StackResource",
    "StackRule",
    "apis_enabled_for_features",
    "backend_timeout_fits_websockets",
    "bucket_private",
    "check_resources",
    "gpu_instance_graceful_shutdown",
    "provisioning_model_sold",
    "session_affinity_needs_hash_policy",
    "firewall_no_public_monitoring",
    "firewall_no_world_ssh",
    "gpu_instance_terminates_on_maintenance",
    "gpu_node_pool_tainted",
    "gpu_node_pool_upgrade_needs_no_extra_gpu",
    "https_proxy_tls_1_2",
    "is_unknown",
    "machine_type_carries_gpu",
    "recordings_bucket_retention",
    "redis_requires_auth",
]


# --------------------------------------------------------------------------------------------------------
# The pack's rule list and a helper for the stacks' tests
# --------------------------------------------------------------------------------------------------------

RuleCheck = Callable[[str, Mapping[str, Any]], list[str]]


@dataclass(frozen=True)
class Rule:
    """One policy of the pack: its name (the policy's id), description, the resource types it polices,
    its check and the steps that fix a violation."""

    name: str
    description: str
    resource_types: tuple[str, ...]
    check: RuleCheck
    remediation: str


RULES: tuple[Rule, ...] = (
    Rule(
        "gpu-instance-terminate-on-maintenance",
        "GPU VMs must use scheduling.onHostMaintenance = TERMINATE (GPUs cannot live-migrate).",
        (INSTANCE, INSTANCE_TEMPLATE),
        gpu_instance_terminates_on_maintenance,
        'Set scheduling.onHostMaintenance to "TERMINATE" (and automaticRestart to true).',
    ),
    Rule(
        "firewall-no-world-ssh",
        "No INGRESS firewall rule may open SSH (tcp/22) to 0.0.0.0/0 or ::/0.",
        (FIREWALL,),
        firewall_no_world_ssh,
        f"Limit sourceRanges to IAP's {IAP_SOURCE_RANGE} or a private range, or remove port 22.",
    ),
    Rule(
        "firewall-no-public-monitoring",
        f"No INGRESS firewall rule may open Prometheus (tcp/{PROMETHEUS_PORT}) or Grafana "
        f"(tcp/{GRAFANA_PORT}) to a public source range.",
        (FIREWALL,),
        firewall_no_public_monitoring,
        f"Limit sourceRanges to RFC 1918 ranges or IAP's {IAP_SOURCE_RANGE}, or remove the monitoring ports.",
    ),
    Rule(
        "gpu-machine-type-match",
        "Attached GPUs must be ones the machine type can carry (capacity planner's GCP catalog).",
        (INSTANCE, INSTANCE_TEMPLATE, NODE_POOL, CLUSTER),
        machine_type_carries_gpu,
        "Use the machine type the planner pairs with the GPU (infra/capacity/gcp.py DEFAULT_MACHINE_TYPE).",
    ),
    Rule(
        "redis-auth-required",
        "Memorystore Redis must require AUTH and use transit encryption (SERVER_AUTHENTICATION).",
        (REDIS,),
        redis_requires_auth,
        'Set authEnabled = true and transitEncryptionMode = "SERVER_AUTHENTICATION".',
    ),
    Rule(
        "gpu-node-pool-tainted",
        "GKE node pools with GPUs must carry the taint nvidia.com/gpu with effect NO_SCHEDULE.",
        (NODE_POOL, CLUSTER),
        gpu_node_pool_tainted,
        f"Add {json.dumps(GPU_TAINT)} to nodeConfig.taints.",
    ),
    Rule(
        "backend-timeout-fits-websockets",
        f"HTTP(S) backend services must have timeoutSec >= {MIN_WEBSOCKET_BACKEND_TIMEOUT_S} s (the 30 s "
        "default cuts WebSocket sessions).",
        (BACKEND_SERVICE,),
        backend_timeout_fits_websockets,
        "Set timeoutSec past the longest session (max_session_s + 60).",
    ),
    Rule(
        "gpu-instance-graceful-shutdown",
        "GPU VMs must enable GCE graceful shutdown for as long as the node needs to drain.",
        (INSTANCE, INSTANCE_TEMPLATE),
        gpu_instance_graceful_shutdown,
        "Set scheduling.gracefulShutdown = {enabled: true, maxDuration: {seconds: <node stop timeout>}}.",
    ),
    Rule(
        "provisioning-model-sold",
        "A VM's provisioning model must be one GCE sells for its machine type, with the settings it needs.",
        (INSTANCE,),
        provisioning_model_sold,
        "Set duplexops:provisioningModel to one the machine type is sold as (a3-highgpu-1g: spot or "
        "flex-start).",
    ),
    Rule(
        "session-affinity-needs-hash-policy",
        "Backend services with session affinity must use localityLbPolicy MAGLEV or RING_HASH.",
        (BACKEND_SERVICE,),
        session_affinity_needs_hash_policy,
        "Set localityLbPolicy to RING_HASH (or MAGLEV), or sessionAffinity to NONE.",
    ),
    Rule(
        "https-proxy-tls-1-2",
        "HTTPS proxies name an SSL policy, and SSL policies refuse TLS before 1.2.",
        (TARGET_HTTPS_PROXY, SSL_POLICY),
        https_proxy_tls_1_2,
        'Set the proxy\'s sslPolicy to a compute.SSLPolicy with min_tls_version "TLS_1_2".',
    ),
    Rule(
        "gpu-node-pool-upgrade-needs-no-extra-gpu",
        "GKE GPU node pools upgrade in place (maxSurge 0, maxUnavailable >= 1): no extra GPU per upgrade.",
        (NODE_POOL,),
        gpu_node_pool_upgrade_needs_no_extra_gpu,
        'Set upgradeSettings = {"strategy": "SURGE", "maxSurge": 0, "maxUnavailable": 1}.',
    ),
    Rule(
        "storage-bucket-private",
        "Cloud Storage buckets use uniform bucket-level access and enforce public access prevention.",
        (BUCKET,),
        bucket_private,
        'Set uniformBucketLevelAccess = true and publicAccessPrevention = "enforced".',
    ),
    Rule(
        "recordings-bucket-retention",
        "A recordings bucket deletes objects by age, keeps no versions and has soft delete off.",
        (BUCKET,),
        recordings_bucket_retention,
        'Add a lifecycle rule {"action": {"type": "Delete"}, "condition": {"age": <retention days>}}, set '
        'versioning = {"enabled": false} and softDeletePolicy = {"retentionDurationSeconds": 0}.',
    ),
)
"""The pack's resource rules, in the order the pack lists its policies."""


@dataclass(frozen=True)
class StackRule:
    """One stack-wide policy: its name, description, check over every resource, and the fix."""

    name: str
    description: str
    check: Callable[[Sequence[StackResource]], list[str]]
    remediation: str


STACK_RULES: tuple[StackRule, ...] = (
    StackRule(
        "apis-enabled-for-features",
        "Every Google API a resource or feature needs is enabled by the stack, and the resource waits for "
        "it.",
        apis_enabled_for_features,
        "Add the API to the topology's list (infra/program/gce.py GCP_APIS, infra/program/multi_region.py "
        "GKE_APIS) and create the resource after it.",
    ),
)
"""The pack's stack rules (after the resource rules)."""


def check_resources(
    resources: Iterable[
        tuple[str, Mapping[str, Any]]
        | tuple[str, Mapping[str, Any], str]
        | tuple[str, Mapping[str, Any], str, Sequence[str] | None]
    ],
) -> list[str]:
    """Apply every rule to every resource, then every stack rule to all of them; the violations, each
    prefixed ``[policy] type name:`` (stack rules: ``[policy]``).

    ``resources`` are ``(resource_type, props)`` pairs, ``(resource_type, props, name)`` triples, e.g.
    ``(args.typ, args.inputs, args.name)`` collected by a ``pulumi.runtime.Mocks.new_resource``, or
    quadruples adding the names/URNs the resource depends on (the stack rules check them; None or absent:
    not known). An empty result means the stack passes the pack (as far as values known in the mocks go).
    """
    violations = []
    stack: list[StackResource] = []
    for index, item in enumerate(resources):
        resource_type, props = item[0], item[1]
        name = item[2] if len(item) > 2 else f"#{index}"  # type: ignore[misc]
        deps = item[3] if len(item) > 3 else None  # type: ignore[misc]
        stack.append(StackResource(resource_type, props, name, None if deps is None else tuple(deps)))
        for rule in RULES:
            if resource_type not in rule.resource_types:
                continue
            for message in rule.check(resource_type, props):
                violations.append(f"[{rule.name}] {resource_type} {name}: {message}")
    for stack_rule in STACK_RULES:
        violations.extend(f"[{stack_rule.name}] {message}" for message in stack_rule.check(stack))
    return violations
