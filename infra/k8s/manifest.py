"""A region's manifests as files: back from Pulumi's mocks (``to_manifest``), written out
(``write_manifests``) and validated offline (``validate_manifests``: the Kubernetes API's schemas with
``kubernetes_validate``, GMP's custom kinds against their CRD schemas in ``schemas/``, both strict).

The validators (``jsonschema``, ``kubernetes_validate``) are in the ``dev`` extra: they are imported only
when ``validate_manifests`` runs, so ``pulumi up`` never needs them. docs/deploying.md, "Stack multi-region".
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.yaml_text import dump_yaml_all

if TYPE_CHECKING:
    import jsonschema

__all__ = [
    "CRD_SCHEMAS",
    "KUBERNETES_VERSION",
    "UnknownKindError",
    "assert_valid",
    "to_manifest",
    "validate_manifests",
    "write_manifests",
]

KUBERNETES_VERSION = "1.33"
"""The Kubernetes minor version whose API schemas validate the manifests by default (kubernetes-validate
1.37 ships the schemas of every version up to 1.37); pass the clusters' version where it differs."""

SCHEMAS_DIR = Path(__file__).with_name("schemas")
CRD_SCHEMAS: dict[tuple[str, str], str] = {
    ("monitoring.googleapis.com/v1", "PodMonitoring"): "podmonitoring-v1.json",
    ("monitoring.googleapis.com/v1", "ClusterRules"): "clusterrules-v1.json",
}
"""Custom kinds validated here, (apiVersion, kind) -> schema file in ``schemas/`` (GMP's CRD schemas)."""
_CLUSTER_SCOPED_CRDS = frozenset({"ClusterRules"})

_SECRET_SIG_KEY = "4dabf18193072939515e22adb298388d"
_SECRET_SIG = "1b47061264138c4ac30d75fd1eb44270"
"""Pulumi's wire format for a secret value (``pulumi.runtime.rpc``): ``{<sig key>: <sig>, "value": ...}``."""
_PULUMI_ONLY_KEYS = frozenset({"id", "urn", "status"})
_META_KEYS = frozenset({"name", "namespace", "labels", "annotations"})
_DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class UnknownKindError(ValueError):
    """A manifest of a kind that neither the Kubernetes schemas nor ``CRD_SCHEMAS`` know."""


def _key(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    metadata = obj.get("metadata") or {}
    return (str(obj.get("kind")), str(metadata.get("namespace", "")), str(metadata.get("name")))


def _describe(obj: Mapping[str, Any]) -> str:
    kind, ns, name = _key(obj)
    return f"{kind} {ns + '/' if ns else ''}{name}"


# --- from Pulumi's mocks -----------------------------------------------------------------------------------


def _clean(value: Any) -> Any:
    if isinstance(value, Mapping):
        if value.get(_SECRET_SIG_KEY) == _SECRET_SIG:
            return _clean(value.get("value"))
        return {k: _clean(v) for k, v in value.items() if v is not None and not str(k).startswith("__")}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value if v is not None]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def to_manifest(
    type_token_or_inputs: str | Mapping[str, Any], inputs: Mapping[str, Any] | None = None
) -> dict:
    """The manifest of a pulumi-kubernetes resource from the inputs Pulumi's mocks captured:
    ``to_manifest(inputs)`` or ``to_manifest(type_token, inputs)`` (``kubernetes:apps/v1:Deployment``, used
    for ``apiVersion`` and ``kind`` when the inputs lack them).

    Removes Pulumi's secret wrappers (keeping the values), ``None`` values, keys starting with ``__`` and the
    top-level ``id``, ``urn`` and ``status``; turns integral floats back into ints (Pulumi's mocks carry
    every number as a float; Kubernetes objects have no float fields). ``apiVersion``, ``kind`` and
    ``metadata`` come first.

    Returns:
        a new dict; the inputs are not changed.
    """
    if inputs is None:
        if not isinstance(type_token_or_inputs, Mapping):
            raise TypeError("to_manifest(inputs) takes a mapping; or to_manifest(type_token, inputs)")
        type_token, raw = None, type_token_or_inputs
    else:
        type_token, raw = str(type_token_or_inputs), inputs
    manifest = {k: v for k, v in _clean(raw).items() if k not in _PULUMI_ONLY_KEYS}
    if type_token and ("apiVersion" not in manifest or "kind" not in manifest):
        parts = type_token.split(":")
        if len(parts) != 3 or parts[0] != "kubernetes":
            raise ValueError(f"to_manifest: {type_token!r} is not a pulumi-kubernetes type token")
        group_version = parts[1].removeprefix("core/")
        manifest.setdefault("apiVersion", group_version)
        manifest.setdefault("kind", parts[2])
    first = {k: manifest[k] for k in ("apiVersion", "kind", "metadata") if k in manifest}
    return {**first, **{k: v for k, v in manifest.items() if k not in first}}


# --- writing ---------------------------------------------------------------------------------------------


def write_manifests(objects: Iterable[Mapping[str, Any]], path: str | Path) -> Path:
    """Write ``objects`` (plain values only: no Pulumi Outputs) to ``path`` as one multi-document YAML file,
    keys in the builders' order, for ``kubectl apply -f`` or a review.

    Returns:
        the path written.
    """
    target = Path(path)
    text = dump_yaml_all([dict(o) for o in objects], literal_blocks=True)
    target.write_text("# Rendered by infra.k8s; edit the renderers, not this file.\n" + text)
    return target


# --- validating ------------------------------------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its properties and says
    nothing about others (what Kubernetes's strict field validation does with unknown fields)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        open_ended = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in out and not open_ended:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def _crd_validator(schema_file: str) -> jsonschema.Draft202012Validator:
    import jsonschema  # dev extra: only the validation needs it

    schema = json.loads((SCHEMAS_DIR / schema_file).read_text())
    return jsonschema.Draft202012Validator(_strict(schema))


def _path(parts: Iterable[Any]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text.lstrip(".") or "."


def _crd_problems(obj: Mapping[str, Any], schema_file: str) -> list[str]:
    where = _describe(obj)
    problems = [
        f"{where}: {_path(error.absolute_path)}: {error.message}"
        for error in sorted(
            _crd_validator(schema_file).iter_errors(dict(obj)), key=lambda e: list(e.absolute_path)
        )
    ]
    metadata = obj.get("metadata")
    if not isinstance(metadata, Mapping):
        return [*problems, f"{where}: metadata: must be a mapping with a name"]
    for key in sorted(set(metadata) - _META_KEYS):
        problems.append(f"{where}: metadata.{key}: unknown field (allowed: {', '.join(sorted(_META_KEYS))})")
    name = metadata.get("name")
    if not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN_RE.match(name):
        problems.append(f"{where}: metadata.name: {name!r} is not a DNS subdomain name")
    for field in ("labels", "annotations"):
        values = metadata.get(field, {})
        if not isinstance(values, Mapping) or not all(isinstance(v, str) for v in values.values()):
            problems.append(f"{where}: metadata.{field}: must map strings to strings")
    cluster_scoped = obj.get("kind") in _CLUSTER_SCOPED_CRDS
    if cluster_scoped and "namespace" in metadata:
        problems.append(f"{where}: metadata.namespace: {obj.get('kind')} is cluster-scoped; remove it")
    if not cluster_scoped and not metadata.get("namespace"):
        problems.append(f"{where}: metadata.namespace: {obj.get('kind')} is namespaced; set it")
    return problems


def validate_manifests(
    objects: Iterable[Mapping[str, Any]], kubernetes_version: str = KUBERNETES_VERSION
) -> list[str]:
    """Problems of ``objects`` (plain values), as ``"<Kind> <namespace>/<name>: <path>: <message>"``; an
    empty list when all are valid.

    Built-in kinds: ``kubernetes_validate.validate(obj, kubernetes_version, strict=True)`` (the API's
    OpenAPI schemas, unknown fields rejected; it reports the first problem of each object). GMP's
    ``PodMonitoring`` and ``ClusterRules`` (``CRD_SCHEMAS``): their CRD schemas, strict, every problem, plus
    the metadata they may carry and their scope. Also: an object without ``apiVersion``, ``kind`` or
    ``metadata.name``, and two objects with the same kind, namespace and name.

    Raises:
        UnknownKindError: a kind neither the Kubernetes schemas of that version nor ``CRD_SCHEMAS`` know
            (names the kind, its apiVersion and the custom kinds known).
    """
    import kubernetes_validate  # dev extra: only the validation needs it

    problems: list[str] = []
    seen: set[tuple[str, str, str]] = set()
    for index, obj in enumerate(objects):
        api_version, kind = obj.get("apiVersion"), obj.get("kind")
        metadata = obj.get("metadata")
        name = metadata.get("name") if isinstance(metadata, Mapping) else None
        if not isinstance(api_version, str) or not isinstance(kind, str) or not name:
            got = f"{api_version!r}, {kind!r}, {name!r}"
            problems.append(f"object #{index}: needs apiVersion, kind and metadata.name (got {got})")
            continue
        key = _key(obj)
        if key in seen:
            problems.append(f"{_describe(obj)}: another object has the same kind, namespace and name")
        seen.add(key)
        schema_file = CRD_SCHEMAS.get((api_version, kind))
        if schema_file is not None:
            problems += _crd_problems(obj, schema_file)
            continue
        try:
            kubernetes_validate.validate(dict(obj), kubernetes_version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            known = ", ".join(f"{k} ({a})" for a, k in sorted(CRD_SCHEMAS))
            raise UnknownKindError(
                f"{_describe(obj)}: no schema for kind {kind!r} of apiVersion {api_version!r}: not a "
                f"built-in kind of Kubernetes {kubernetes_version}, and not one of the custom kinds known "
                f"here ({known}); add the CRD's schema to infra/k8s/schemas and CRD_SCHEMAS"
            ) from None
        except kubernetes_validate.ValidationError as error:
            problems.append(f"{_describe(obj)}: {_path(error.absolute_path)}: {error.message}")
    return problems


def assert_valid(objects: Iterable[Mapping[str, Any]], kubernetes_version: str = KUBERNETES_VERSION) -> None:
    """``validate_manifests``, raising instead of returning.

    Raises:
        ValueError: one line per problem.
    """
    problems = validate_manifests(objects, kubernetes_version)
    if problems:
        raise ValueError("invalid manifests:\n" + "\n".join(problems))
