"""The pack's policies: each rule of ``infra.policy.rules`` as a ``ResourceValidationPolicy``.

Building the list needs ``pulumi_policy`` but no engine; ``PolicyPack(...)`` itself starts the gRPC server
the CLI talks to and never returns, so only ``__main__`` constructs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    Policy,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    Severity,
    StackValidationArgs,
    StackValidationPolicy,
)
from pulumi_policy.proxy import UnknownValueError

from infra.policy.rules import RULES, STACK_RULES, UNKNOWN, Rule, StackResource, StackRule

__all__ = ["DESCRIPTION", "ENFORCEMENT_LEVEL", "PACK_NAME", "build_policies", "plain"]

PACK_NAME = "duplexops-policies"
ENFORCEMENT_LEVEL = EnforcementLevel.MANDATORY
DESCRIPTION = (
    "Guard rails for the duplex runtime's stacks: GPU VMs terminate on maintenance, machine types match "
    "their GPUs, no SSH or monitoring ports open to the internet, Redis requires AUTH over TLS, GPU node "
    "pools are tainted, HTTP load balancers keep WebSockets open past 30 s, GPU VMs shut down gracefully and "
    "use a provisioning model GCE sells, session affinity only with a hashing locality policy, every API a "
    "resource needs enabled first, HTTPS proxies with TLS 1.2 or later, GPU node pools that upgrade without "
    "an extra GPU, private buckets, recordings buckets that expire and keep nothing erased."
)

_SEVERITY = {
    "gpu-instance-terminate-on-maintenance": Severity.MEDIUM,
    "firewall-no-world-ssh": Severity.CRITICAL,
    "firewall-no-public-monitoring": Severity.HIGH,
    "gpu-machine-type-match": Severity.MEDIUM,
    "redis-auth-required": Severity.HIGH,
    "gpu-node-pool-tainted": Severity.MEDIUM,
    "backend-timeout-fits-websockets": Severity.HIGH,
    "gpu-instance-graceful-shutdown": Severity.HIGH,
    "provisioning-model-sold": Severity.HIGH,
    "session-affinity-needs-hash-policy": Severity.MEDIUM,
    "apis-enabled-for-features": Severity.HIGH,
    "https-proxy-tls-1-2": Severity.HIGH,
    "gpu-node-pool-upgrade-needs-no-extra-gpu": Severity.MEDIUM,
    "storage-bucket-private": Severity.CRITICAL,
    "recordings-bucket-retention": Severity.HIGH,
}


def plain(value: Any) -> Any:
    """A copy of ``args.props`` as plain dicts and lists, each value the engine marks unknown during
    preview replaced by ``rules.UNKNOWN``.

    The SDK hands the props wrapped in a proxy that raises ``UnknownValueError`` on reading an unknown
    value, which would end the whole policy with an advisory "can't run during preview" note; the rules
    instead skip just the unknown value and still judge the known ones.
    """
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key in list(value):
            try:
                item = value[key]
            except UnknownValueError:
                out[key] = UNKNOWN
                continue
            out[key] = plain(item)
        return out
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        items: list[Any] = []
        for i in range(len(value)):
            try:
                items.append(plain(value[i]))
            except UnknownValueError:
                items.append(UNKNOWN)
        return items
    return value


def _validator(rule: Rule) -> Callable[[ResourceValidationArgs, ReportViolation], None]:
    def validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        if args.resource_type not in rule.resource_types:
            return
        for message in rule.check(args.resource_type, plain(args.props)):
            report_violation(message, None)

    validate.__name__ = f"validate_{rule.name.replace('-', '_')}"
    return validate


def _stack_validator(rule: StackRule) -> Callable[[StackValidationArgs, ReportViolation], None]:
    def validate(args: StackValidationArgs, report_violation: ReportViolation) -> None:
        resources = [
            StackResource(
                r.resource_type, plain(r.props), r.name, tuple(d.urn for d in (r.dependencies or []))
            )
            for r in args.resources
        ]
        for message in rule.check(resources):
            report_violation(message, None)

    validate.__name__ = f"validate_{rule.name.replace('-', '_')}"
    return validate


def build_policies() -> list[Policy]:
    """One ``ResourceValidationPolicy`` per rule, in ``rules.RULES`` order. The enforcement level is the
    pack's (mandatory); ``--policy-pack-config`` can lower a single policy to advisory."""
    policies: list[Policy] = [
        ResourceValidationPolicy(
            name=rule.name,
            description=rule.description,
            validate=_validator(rule),
            severity=_SEVERITY[rule.name],
            remediation_steps=rule.remediation,
        )
        for rule in RULES
    ]
    policies.extend(
        StackValidationPolicy(
            name=rule.name,
            description=rule.description,
            validate=_stack_validator(rule),
            severity=_SEVERITY[rule.name],
            remediation_steps=rule.remediation,
        )
        for rule in STACK_RULES
    )
    return policies
