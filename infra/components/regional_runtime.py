"""``RegionalRuntime``: the Kubernetes objects of one region (``infra.k8s``) declared on its cluster.

``infra.k8s`` renders every object as a plain manifest (dicts, camelCase, values that may be Pulumi
Outputs); this component declares each one with pulumi-kubernetes through the region's provider, typed
where pulumi-kubernetes has the kind (``apps/v1`` ``Deployment`` -> ``kubernetes.apps.v1.Deployment``) and
as a ``CustomResource`` otherwise (GMP's ``PodMonitoring``, ``ClusterRules``). Objects are declared in the
renderer's order (``infra.k8s.region.APPLY_FIRST`` kinds first), each depending on the ones before it of
those kinds (Namespaces, ServiceAccounts, Secrets, ConfigMaps, RBAC).

A Secret that a pod template mounts but the objects do not declare (the TURN TLS Secret, ``turnTlsSecret``,
made by cert-manager or by hand: ``infra.k8s.turn``) is read first (``kubernetes.core.v1.Secret.get``,
logical name ``<name>-requires-secret-<namespace>-<secret>``), after the objects it needs (its Namespace)
and before the workload that mounts it: a missing one fails the update there, naming the Secret, before
the workload is touched, instead of pods stuck in ``ContainerCreating`` until the rollout's timeout; on a
cluster that exists already, ``pulumi preview`` reads it too and fails the same way.

Pulumi waits for a Deployment's rollout (its pods ready: model loaded, up to the startup probe's limit)
and a Job's completion; ``CUSTOM_TIMEOUT`` lets a 7B download and load take that long.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from typing import Any

import pulumi
import pulumi_kubernetes as kubernetes

from infra.components._util import COMPONENT_PACKAGE, child_options, dependencies
from infra.deploy_timeouts import PULUMI_CUSTOM_TIMEOUT
from infra.k8s.region import APPLY_FIRST, apply_rank

__all__ = ["CUSTOM_TIMEOUT", "RegionalRuntime", "external_secrets", "resource_class"]

CUSTOM_TIMEOUT = PULUMI_CUSTOM_TIMEOUT
"""Create/update timeout of each object: a first rollout downloads and loads the weights (longer than the
weights Job's deadline: infra/deploy_timeouts.py)."""


def resource_class(api_version: str, kind: str) -> type[pulumi.CustomResource] | None:
    """The pulumi-kubernetes class of ``apiVersion``/``kind`` (``apps/v1``, ``Deployment``), or None when
    pulumi-kubernetes has no typed class for it (a custom resource)."""
    group, _, version = api_version.rpartition("/")
    module = {
        "": "core",
        "rbac.authorization.k8s.io": "rbac",
        "apiregistration.k8s.io": "apiregistration",
    }.get(group, group.split(".")[0])
    if not re.fullmatch(r"[a-z0-9]+", module) or not re.fullmatch(r"v[0-9a-z]+", version):
        return None
    try:
        package = importlib.import_module(f"pulumi_kubernetes.{module}.{version}")
    except ImportError:
        return None
    cls = getattr(package, kind, None)
    return cls if isinstance(cls, type) and issubclass(cls, pulumi.CustomResource) else None


class RegionalRuntime(pulumi.ComponentResource):
    """Declares ``objects`` (manifests from ``infra.k8s``) on a cluster through ``provider``.

    Attributes:
        resources: ``{"<Kind>/<namespace>/<name>": resource}`` of every declared object.
    """

    resources: dict[str, pulumi.CustomResource]

    def __init__(
        self,
        name: str,
        objects: Sequence[dict[str, Any]],
        provider: kubernetes.Provider,
        opts: pulumi.ResourceOptions | None = None,
    ):
        super().__init__(f"{COMPONENT_PACKAGE}:RegionalRuntime", name, None, opts)
        deps = dependencies(opts)
        self.resources = {}
        foundations: list[pulumi.Resource] = []
        external = external_secrets(objects)
        for manifest in sorted(objects, key=apply_rank):
            if manifest["kind"] not in APPLY_FIRST and external:
                # Past the foundations: read the Secrets made outside the stack, before any workload.
                foundations.extend(self._read_secrets(name, external, provider, [*deps, *foundations]))
                external = []
            metadata = manifest.get("metadata") or {}
            key = f"{manifest['kind']}/{metadata.get('namespace', '')}/{metadata['name']}"
            if key in self.resources:
                raise ValueError(f"{name}: two objects {key}: every object needs its own kind/namespace/name")
            logical = (
                f"{name}-{manifest['kind'].lower()}-{metadata.get('namespace', 'cluster')}-{metadata['name']}"
            )
            options = child_options(
                self,
                [*deps, *foundations],
                provider=provider,
                custom_timeouts=pulumi.CustomTimeouts(create=CUSTOM_TIMEOUT, update=CUSTOM_TIMEOUT),
            )
            resource = declare(logical, manifest, options)
            self.resources[key] = resource
            if manifest["kind"] in APPLY_FIRST:
                foundations.append(resource)
        if external:  # no workload at all: still check them
            self._read_secrets(name, external, provider, [*deps, *foundations])
        self.register_outputs({"objects": sorted(self.resources)})

    def _read_secrets(
        self,
        name: str,
        secrets: Sequence[tuple[str, str]],
        provider: kubernetes.Provider,
        after: Sequence[pulumi.Resource],
    ) -> list[pulumi.Resource]:
        """Read each ``(namespace, name)`` Secret made outside the stack, after ``after``; the reads."""
        return [
            kubernetes.core.v1.Secret.get(
                f"{name}-requires-secret-{namespace}-{secret}",
                f"{namespace}/{secret}",
                opts=child_options(self, after, provider=provider),
            )
            for namespace, secret in secrets
        ]


_POD_TEMPLATE_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def external_secrets(objects: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(namespace, name)`` of every Secret a pod template among ``objects`` mounts (a ``secret`` volume
    not marked ``optional``) that ``objects`` do not declare, sorted: Secrets made outside the stack."""
    declared = {
        (o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in objects if o["kind"] == "Secret"
    }
    mounted: set[tuple[str, str]] = set()
    for manifest in objects:
        if manifest["kind"] not in _POD_TEMPLATE_KINDS:
            continue
        namespace = manifest["metadata"].get("namespace", "")
        pod = manifest["spec"]["template"]["spec"]
        for volume in pod.get("volumes") or ():
            source = volume.get("secret")
            if source and not source.get("optional") and isinstance(source.get("secretName"), str):
                mounted.add((namespace, source["secretName"]))
    return sorted(mounted - declared)


def declare(name: str, manifest: dict[str, Any], opts: pulumi.ResourceOptions) -> pulumi.CustomResource:
    """Declare one manifest as a pulumi-kubernetes resource named ``name``."""
    api_version, kind = manifest["apiVersion"], manifest["kind"]
    body = {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind")}
    cls = resource_class(api_version, kind)
    if cls is None:
        return kubernetes.apiextensions.CustomResource(
            name, api_version=api_version, kind=kind, **body, opts=opts
        )
    return cls(name, **{_snake(k): v for k, v in body.items()}, opts=opts)


def _snake(key: str) -> str:
    """A top-level manifest field as the resource's argument name (``stringData`` -> ``string_data``)."""
    return re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()
