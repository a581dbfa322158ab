"""The stack's configuration keys, declared once: one pydantic model per topology (``GceNodeKeys`` and
``OnPremNodeKeys`` in ``keys_node``, ``MultiRegionKeys`` in ``keys_multi_region`` with its ``RegionKeys`` in
``keys_regions``, all on the ``_Keys`` base of ``keys_common``) whose aliases are Pulumi's keys
(``duplexops:<camelCase>``, ``gcp:project``...), with the constraints of each key and validators that apply
the GCP rules through the capacity planner (``keys_gcp``, over ``infra.capacity.gcp``: machine type vs GPU,
provisioning model, zones) and the node profile (sessions vs capacity). A valid model holds the
``StackConfig`` it built. This module assembles them: ``KEYS_OF`` (the model of each topology) and
``KNOWN_KEYS``. docs/stack-configuration.md.
"""

from __future__ import annotations

from pydantic import BaseModel

from infra.stack_config.keys_common import _Keys
from infra.stack_config.keys_multi_region import MultiRegionKeys
from infra.stack_config.keys_node import GceNodeKeys, OnPremNodeKeys
from infra.stack_config.settings import NAMESPACE

__all__ = ["KEYS_OF", "KNOWN_KEYS"]


KEYS_OF: dict[str, type[_Keys]] = {k.topology_name: k for k in (GceNodeKeys, OnPremNodeKeys, MultiRegionKeys)}
"""The keys model of each topology."""


def _pulumi_keys(model: type[BaseModel]) -> list[str]:
    return [info.alias or name for name, info in model.model_fields.items()]


KNOWN_KEYS: tuple[str, ...] = tuple(
    dict.fromkeys(
        key.partition(":")[2]
        for model in KEYS_OF.values()
        for key in _pulumi_keys(model)
        if key.startswith(f"{NAMESPACE}:")
    )
)
"""Every ``duplexops:`` key some topology reads."""
