"""What every rule module shares: the resource type tokens, unknown values during preview, and the
normalisation of a resource's inputs (camelCase keys, secrets unwrapped)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

INSTANCE = "gcp:compute/instance:Instance"
INSTANCE_TEMPLATE = "gcp:compute/instanceTemplate:InstanceTemplate"
FIREWALL = "gcp:compute/firewall:Firewall"
NODE_POOL = "gcp:container/nodePool:NodePool"
CLUSTER = "gcp:container/cluster:Cluster"
REDIS = "gcp:redis/instance:Instance"
BACKEND_SERVICE = "gcp:compute/backendService:BackendService"
TARGET_HTTPS_PROXY = "gcp:compute/targetHttpsProxy:TargetHttpsProxy"
SSL_POLICY = "gcp:compute/sSLPolicy:SSLPolicy"
BUCKET = "gcp:storage/bucket:Bucket"

# --------------------------------------------------------------------------------------------------------
# Unknown values
# --------------------------------------------------------------------------------------------------------

UNKNOWN_SENTINELS: frozenset[str] = frozenset(
    {
        "1c4a061d-8072-4f0a-a4cb-0ff528b18fe7",  # boolean
        "3eeb2bf0-c639-47a8-9e75-3b44932eb421",  # number
        "04da6b54-80e4-46f7-96ec-b56ff0331ba9",  # string (also pulumi.runtime's UNKNOWN in mocks)
        "6a19a0b0-7e62-4c92-b797-7f8e31da9cc2",  # array
        "030794c1-ac77-496b-92df-f27374a8bd58",  # asset
        "e48ece36-62e2-4504-bad9-02848725956a",  # archive
        "dd056dcd-154b-4c76-9bd3-c8f88648b5ff",  # object
    }
)
"""The engine's wire sentinels for values unknown during preview (``pulumi_policy.proxy`` UNKNOWN_*)."""


class _Unknown:
    """Type of :data:`UNKNOWN`."""

    _instance: _Unknown | None = None

    def __new__(cls) -> _Unknown:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<unknown during preview>"


UNKNOWN = _Unknown()
"""A value that cannot be known during preview (what the adapter puts where the SDK raises)."""


def is_unknown(value: object) -> bool:
    """True for :data:`UNKNOWN` and the engine's sentinel strings; False for missing values (None)."""
    return value is UNKNOWN or (isinstance(value, str) and value in UNKNOWN_SENTINELS)


_CAMEL_RE = re.compile(r"_([a-z0-9])")


def _camel(key: str) -> str:
    return key if key.startswith("_") else _CAMEL_RE.sub(lambda m: m.group(1).upper(), key)


_SIG_KEY = "4dabf18193072939515e22adb298388d"  # Pulumi's wire signature key ...
_SECRET_SIG = "1b47061264138c4ac30d75fd1eb44270"  # ... and its value for a secret


def _normalize(value: Any) -> Any:
    """Plain dicts/lists with camelCase keys, unknown sentinels replaced by :data:`UNKNOWN`, secrets
    unwrapped (the engine unwraps them for a policy pack; inputs recorded by mocks still carry the wire
    wrapper ``{SIG: SECRET_SIG, "value": ...}``)."""
    if is_unknown(value):
        return UNKNOWN
    if isinstance(value, Mapping) and value.get(_SIG_KEY) == _SECRET_SIG:
        return _normalize(value.get("value"))
    if isinstance(value, Mapping):
        return {_camel(str(k)): _normalize(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_normalize(v) for v in value]
    return value


def _obj(value: Any) -> dict[str, Any] | _Unknown | None:
    """A nested object: the dict, UNKNOWN, or None when missing (anything else counts as missing)."""
    if value is UNKNOWN:
        return UNKNOWN
    return value if isinstance(value, dict) else None


def _list(value: Any) -> list[Any] | _Unknown:
    """A nested list: the list, UNKNOWN, or [] when missing."""
    if value is UNKNOWN:
        return UNKNOWN
    return value if isinstance(value, list) else []


def _q(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


@dataclass(frozen=True)
class StackResource:
    """One resource as a stack rule sees it: type token, inputs, name, and the names (or URNs) of the
    resources it depends on (None when the caller does not know them)."""

    type: str
    props: Mapping[str, Any]
    name: str
    dependencies: tuple[str, ...] | None = None
