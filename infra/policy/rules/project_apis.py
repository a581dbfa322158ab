"""The stack rule on ``gcp:projects/service:Service``: every API a resource needs is enabled, and the
resource waits for it."""

from __future__ import annotations

from collections.abc import Sequence

from infra.gcp_apis import SERVICE_TYPE, STEP_0_APIS, required_apis, step_0_command
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
    may see the request first and answer SERVICE_DISABLED). The step-0 APIs (``infra.gcp_apis.STEP_0_APIS``:
    Cloud Resource Manager and Service Usage, which ``projects.Service`` and ``projects.IAMMember`` call) are
    enabled by hand before any program (terraform-provider-google #6101, #11435): declaring one is a
    violation, needing one is not.

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

    problems = [
        f"{SERVICE_TYPE} {name} enables {api}, a step-0 API that no program can enable (enabling an API "
        f"needs it): remove it and run `{step_0_command()}` once per project (step 0)."
        for api, name in sorted(services.items())
        if api in STEP_0_APIS
    ]
    for r in resources:
        for api, why in sorted(required_apis(r.type, _normalize(r.props)).items()):
            if api in STEP_0_APIS:
                continue  # enabled at step 0, before any program runs
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
