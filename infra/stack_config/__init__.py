"""The stack's configuration, typed and validated before any resource is declared.

``load_stack_config()`` reads Pulumi's configuration, ``parse_stack_config`` a plain mapping; the keys are
declared once in ``keys`` (pydantic models whose aliases are Pulumi's keys, validators calling the capacity
planner), every problem is collected and raised as one ``StackConfigError`` whose lines name the key, the
bad value and what is allowed (``errors``), and the result is a ``StackConfig`` (``settings``). Every key:
docs/stack-configuration.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import ValidationError

from infra.stack_config.errors import describe, drop_echoes
from infra.stack_config.keys import KEYS_OF, KNOWN_KEYS, _pulumi_keys
from infra.stack_config.keys_multi_region import MultiRegionKeys
from infra.stack_config.keys_node import GceNodeKeys, OnPremNodeKeys
from infra.stack_config.keys_regions import RegionKeys
from infra.stack_config.settings import (
    BUILT_TOPOLOGIES,
    GCP_NAMESPACE,
    NAMESPACE,
    PLACEHOLDER_IMAGE,
    SECRET_KEYS,
    TOPOLOGIES,
    GceSettings,
    MaintenanceWindow,
    MultiRegionSettings,
    OnPremSettings,
    RecordingSettings,
    RegionSettings,
    StackConfig,
    StackConfigError,
    StackSecretsConfig,
)

__all__ = [
    "BUILT_TOPOLOGIES",
    "GCP_NAMESPACE",
    "KEYS_OF",
    "KNOWN_KEYS",
    "NAMESPACE",
    "PLACEHOLDER_IMAGE",
    "SECRET_KEYS",
    "TOPOLOGIES",
    "GceNodeKeys",
    "GceSettings",
    "MaintenanceWindow",
    "MultiRegionKeys",
    "MultiRegionSettings",
    "RecordingSettings",
    "OnPremNodeKeys",
    "OnPremSettings",
    "RegionKeys",
    "RegionSettings",
    "StackConfig",
    "StackConfigError",
    "StackSecretsConfig",
    "load_stack_config",
    "parse_stack_config",
]

_GCP_KEYS = ("project", "region", "zone")

# --- reading Pulumi's configuration -----------------------------------------------------------------------


def load_stack_config() -> StackConfig:
    """The current stack's configuration from Pulumi (program start, before any resource).

    Raises:
        StackConfigError: every problem found, one line each.
    """
    import pulumi
    from pulumi.runtime import config as runtime_config

    values: dict[str, str] = {}
    for namespace, keys in ((NAMESPACE, KNOWN_KEYS), (GCP_NAMESPACE, _GCP_KEYS)):
        bag = pulumi.Config(namespace)
        for key in keys:
            value = bag.get(key)
            if value is not None:
                values[f"{namespace}:{key}"] = value
    # Keys set in the stack but unknown here (typos): every key Pulumi passed to the program.
    present: set[str] = set()
    try:
        present |= set(runtime_config.get_config_env())
        present |= set(runtime_config.CONFIG.get())
    except Exception:  # the SDK's internals moved: skip the typo check rather than fail
        present = set()
    secret_keys = set(runtime_config.get_config_secret_keys_env()) | {
        f"{NAMESPACE}:{k}" for k in SECRET_KEYS if runtime_config.is_config_secret(f"{NAMESPACE}:{k}")
    }
    secrets_known = "PULUMI_CONFIG_SECRET_KEYS" in os.environ or bool(secret_keys)
    return parse_stack_config(
        values,
        stack=pulumi.get_stack(),
        project=pulumi.get_project(),
        secret_keys=secret_keys if secrets_known else None,
        present_keys=present,
    )


def parse_stack_config(
    values: Mapping[str, str],
    *,
    stack: str,
    project: str = NAMESPACE,
    secret_keys: set[str] | frozenset[str] | None = None,
    present_keys: set[str] | None = None,
) -> StackConfig:
    """Validate ``values`` (``{"duplexops:topology": "gce-node", "gcp:project": ...}``, strings as Pulumi
    gives them; lists as JSON) for stack ``stack`` with the topology's keys model (``KEYS_OF``).

    Args:
        secret_keys: the full keys Pulumi holds as secrets; a secret key outside it is reported as set in
            plain text. None: not known (no check).
        present_keys: every full key of the stack's configuration; unknown ``duplexops:`` keys are
            reported. None: ``values``' own keys.

    Raises:
        StackConfigError: every problem found.
    """
    problems = []
    for full_key in sorted(set(present_keys or ()) | set(values)):
        namespace, _, key = full_key.partition(":")
        if namespace == NAMESPACE and key not in KNOWN_KEYS:
            problems.append(f"{full_key}: unknown key; allowed keys: {', '.join(KNOWN_KEYS)}")
    known = {k: v for k, v in values.items() if k.partition(":")[2] in KNOWN_KEYS or k.startswith("gcp:")}
    topology = known.get(f"{NAMESPACE}:topology")
    model = KEYS_OF.get(topology or "")
    if model is None:
        allowed = ", ".join(TOPOLOGIES)
        key = f"{NAMESPACE}:topology"
        problems.append(
            f"{key}: unknown value {topology!r}; allowed: {allowed}"
            if topology is not None
            else f"{key}: missing (required for this topology); allowed: {allowed}; set it with "
            f"`pulumi config set {key} <value>`"
        )
        raise StackConfigError(problems)
    own = set(_pulumi_keys(model))
    given = {k: v for k, v in known.items() if k in own or not k.startswith(f"{GCP_NAMESPACE}:")}
    context = {"stack": stack, "project": project, "secret_keys": secret_keys}
    try:
        keys = model.model_validate(given, context=context)
    except ValidationError as exc:
        problems += [line for error in drop_echoes(exc.errors()) for line in describe(model, error)]
        raise StackConfigError(problems) from None
    if problems:
        raise StackConfigError(problems)
    assert keys._result is not None
    return keys._result
