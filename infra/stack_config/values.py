"""The value types of the configuration keys (JSON lists, ``true``/``false``, IPv4 CIDRs, secrets never
shown) and the errors their validators raise (``problem``: a message under a key or an item of it).
docs/stack-configuration.md.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, SecretStr, ValidationInfo
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from infra.stack_config.settings import NAMESPACE

__all__ = [
    "CIDRS",
    "PROBLEM",
    "Boolean",
    "CidrList",
    "Secret",
    "allowed",
    "problem",
    "problems",
    "pulumi_key",
    "json_value",
    "secret_matching",
]

# --- problems as pydantic errors -------------------------------------------------------------------------

PROBLEM = "stack_config"
"""The error type of the rules below: ``ctx["problems"]`` holds ``(where, message)`` pairs; ``where`` is
appended to the error's location (``"[1].region"``, ``".minNodes"``), or replaces it when it is a whole key
(``"duplexops:profile"``)."""


def problem(message: str, where: str = "") -> PydanticCustomError:
    return PydanticCustomError(PROBLEM, "{message}", {"message": message, "problems": [(where, message)]})


def problems(found: list[tuple[str, str]]) -> PydanticCustomError:
    return PydanticCustomError(
        PROBLEM, "{count} problems", {"count": len(found), "problems": [tuple(p) for p in found]}
    )


def allowed(text: str) -> dict[str, Any]:
    """A field's ``json_schema_extra`` recording what the key allows, in the words of its error messages."""
    return {"allowed": text}


# --- reusable value types --------------------------------------------------------------------------------


def json_value(value: Any) -> Any:
    """Pulumi passes lists and mappings to a program as JSON text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError("not JSON") from None
    return value


def _boolean(value: Any) -> Any:
    """``true``/``false`` only (pydantic alone would also take ``yes``, ``on``, ``1``...)."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, bool):
        return value
    raise ValueError("not true or false")


def _ipv4_cidr(value: str) -> str:
    try:
        return str(ipaddress.IPv4Network(value, strict=True))
    except ValueError as exc:
        raise problem(f"{value!r} is not an IPv4 CIDR ({exc}); allowed: {CIDRS}") from None


def _is_secret(value: SecretStr, info: ValidationInfo) -> SecretStr:
    """A secret key set in plain text is refused (the value is never shown)."""
    secret_keys = (info.context or {}).get("secret_keys")
    key = pulumi_key(info.field_name or "")
    if secret_keys is not None and key not in secret_keys:
        raise problem(
            "set in plain text (the value is not shown); allowed: a secret value, "
            f"`pulumi config set --secret {key.partition(':')[2]} ...`"
        )
    return value


CIDRS = 'a list of IPv4 CIDRs, e.g. ["203.0.113.0/24"] (["0.0.0.0/0"]: the whole internet)'
Boolean = Annotated[bool, BeforeValidator(_boolean)]
CidrList = Annotated[
    tuple[Annotated[str, AfterValidator(_ipv4_cidr)], ...], BeforeValidator(json_value), Field(min_length=1)
]
Secret = Annotated[SecretStr, AfterValidator(_is_secret)]


def secret_matching(pattern: str, allowed: str) -> AfterValidator:
    """A secret's form, checked without ever showing the value."""
    compiled = re.compile(pattern)

    def check(value: SecretStr) -> SecretStr:
        if not compiled.match(value.get_secret_value()):
            raise problem(f"the value (not shown) is not valid; allowed: {allowed}")
        return value

    return AfterValidator(check)


def pulumi_key(field_name: str) -> str:
    """``duplexops:<camelCase>`` of a field (the ``gcp:`` fields carry their own alias)."""
    return f"{NAMESPACE}:{to_camel(field_name)}"
