"""pydantic's collected errors in the project's words: one line per problem, naming the Pulumi key (or the
item of ``regions``), the bad value (never a secret's) and what is allowed. docs/stack-configuration.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from infra.stack_config.keys import KNOWN_KEYS, _pulumi_keys
from infra.stack_config.keys_common import _Keys
from infra.stack_config.keys_node import _NodeKeys
from infra.stack_config.keys_regions import RegionKeys
from infra.stack_config.settings import GCP_NAMESPACE, NAMESPACE, SECRET_KEYS
from infra.stack_config.values import PROBLEM

__all__ = ["describe", "drop_echoes"]


def _where(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _nested(info: FieldInfo | None) -> type[BaseModel] | None:
    """The keys model a field holds (``regions`` -> ``RegionKeys``, ``recordings`` -> ``RecordingsKeys``),
    or None for a plain value."""
    stack: list[Any] = [] if info is None else [info.annotation]
    while stack:
        arg = stack.pop()
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        stack.extend(get_args(arg))
    return None


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The keys model whose field ``loc``'s last part names (``regions[0].minNodes`` -> ``RegionKeys``)."""
    current: type[BaseModel] | None = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if current is None:
            return None
        by_alias = {(f.alias or n): f for n, f in current.model_fields.items()}
        current = _nested(by_alias.get(str(part)))
    return current


def _field(model: type[BaseModel], loc: tuple[Any, ...]) -> FieldInfo | None:
    """The field a location names (through ``regions[i]`` into ``RegionKeys``, through an object key such as
    ``maintenanceWindow`` into its model)."""
    parent = _model_at(model, loc)
    if parent is None or not loc:
        return None
    return {(f.alias or n): f for n, f in parent.model_fields.items()}.get(str(loc[-1]))


def _allowed_text(info: FieldInfo | None) -> str:
    """What a field allows, from its ``allowed`` note, its choices or its bounds."""
    if info is None:
        return "see docs/stack-configuration.md"
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "allowed" in extra:
        return str(extra["allowed"])
    annotation = info.annotation
    for arg in (annotation, *get_args(annotation)):
        if get_origin(arg) is Literal:
            return ", ".join(get_args(arg))
        if arg is bool:
            return "true, false"
    bounds = {
        k: getattr(m, k) for m in info.metadata for k in ("ge", "le") if getattr(m, k, None) is not None
    }
    if "ge" in bounds and "le" in bounds:
        return f"an integer from {bounds['ge']} to {bounds['le']}"
    return "a non-empty string"


def drop_echoes(errors: list[Any]) -> list[Any]:
    """``errors`` without the ``too_short`` of a list whose items have errors of their own (pydantic
    measures a list's length on the items that validated: the item's error is the problem)."""
    nested = {tuple(e["loc"][:i]) for e in errors for i in range(1, len(e["loc"]))}
    return [e for e in errors if not (e["type"] == "too_short" and tuple(e["loc"]) in nested)]


def describe(model: type[_Keys], error: Mapping[str, Any]) -> list[str]:
    """One line per problem of a pydantic error: ``<key>: <bad value> ...; allowed: ...``."""
    loc = tuple(error.get("loc") or ())
    where = _where(loc)
    kind = error.get("type")
    if kind == PROBLEM:
        lines = []
        for at, message in error["ctx"]["problems"]:
            whole = at.startswith((f"{NAMESPACE}:", f"{GCP_NAMESPACE}:"))
            lines.append(f"{at if whole else where + at}: {message}")
        return lines
    key = str(loc[0]) if loc else ""
    info = _field(model, loc)
    allowed = _allowed_text(info)
    value = error.get("input")
    secret = key.partition(":")[2] in SECRET_KEYS
    if kind == "extra_forbidden" and len(loc) == 1:
        if key.partition(":")[2] in KNOWN_KEYS:
            own = [k.partition(":")[2] for k in _pulumi_keys(model) if k.startswith(f"{NAMESPACE}:")]
            common = [
                k.partition(":")[2] for k in _pulumi_keys(_NodeKeys if "redisPassword" in own else _Keys)
            ]
            specific = [k for k in own if k not in common]
            return [
                f"{key}: does not apply to topology {model.topology_name!r}; remove it "
                f"(its keys: {', '.join(specific)}; common keys: {', '.join(common)})"
            ]
        return [f"{key}: unknown key; allowed keys: {', '.join(KNOWN_KEYS)}"]
    if kind == "extra_forbidden":
        parent = _model_at(model, loc) or RegionKeys
        keys = ", ".join((f.alias or n) for n, f in parent.model_fields.items())
        return [f"{where}: unknown key; allowed keys: {keys}"]
    if kind == "missing" and len(loc) == 1:
        how = "--secret " if secret else ""
        return [
            f"{key}: missing (required for this topology); allowed: {allowed}; "
            f"set it with `pulumi config set {how}{key} <value>`"
        ]
    if kind == "missing":
        return [f"{where}: missing; allowed: {allowed}"]
    if kind == "literal_error":
        return [f"{where}: unknown value {value!r}; allowed: {allowed}"]
    if secret:
        return [f"{where}: the value (not shown) is not valid; allowed: {allowed}"]
    return [f"{where}: {value!r} is not valid; allowed: {allowed}"]
