"""The stack rule on ``gcp:projects/service:Service``: every API a resource needs is enabled, and the
resource waits for it."""

from __future__ import annotations

from collections.abc import Sequence

from infra.gcp_apis import SERVICE_TYPE, required_apis
from infra.policy.rules._common import (
    StackResource,
    _normalize,
)

# --------------------------------------------------------------------------------------------------------
# Stack rule: every API a resource needs is enabled, and the resource waits for it
# --------------------------------------------------------------------------------------------------------


def apis_enabled_for_features(resources: Sequence[StackResource]) -> list[str]:
    """Every API a declared resource needs (``infra.gcp_apis.required_apis``: its module's API and its
    features', e.g. image streaming -> ``containerfilesystem.googleapis.com``) is enabled by a
    ``gcp:projects/service:Service`` of the stack, and the resource depends on that Service (else GCE/GKE
    may see the request first and answer SERVICE_DISABLED).

    Applies to stacks that enable APIs themselves (at least one Service declared); a stack built with
    ``enableApis: false`` relies on APIs enabled outside it. Dependencies are checked where known, directly
    or through other resources (a binding that waits for a cluster that waits for the API is fine)."""
    services = {
        str(r.props.get("service")): r.name
        for r in resources
        if r.type == SERVICE_TYPE and isinstance(r.props.get("service"), str)
    }
    if not services:
        return []
    by_name = {r.name: r for r in resources}

    def waits_for(resource: StackResource, target: str) -> bool:
        """Whether ``resource`` depends on ``target`` directly or through other resources."""
        seen: set[str] = set()
        todo = list(resource.dependencies or ())
        while todo:
            dep = todo.pop()
            name = dep.rsplit("::", 1)[-1]
            if name == target:
                return True
            if name in seen or name not in by_name:
                continue
            seen.add(name)
            todo.extend(by_name[name].dependencies or ())
        return False

    problems = []
    for r in resources:
        if r.type == SERVICE_TYPE:
            continue
        for api, why in sorted(required_apis(r.type, _normalize(r.props)).items()):
            if api not in services:
                problems.append(
                    f"{r.type} {r.name} needs {api} ({why}), which the stack does not enable: add it to the "
                    "APIs the program enables."
                )
            elif r.dependencies is not None and not waits_for(r, services[api]):
                problems.append(
                    f"{r.type} {r.name} needs {api} ({why}) but does not depend on its enablement "
                    f"({services[api]}): pass the APIs' ResourceOptions (depends_on)."
                )
    return problems
