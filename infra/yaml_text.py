"""YAML as the renderers write it (Compose file, cloud-init user-data, Kubernetes manifests): block style,
keys in the builders' order, no aliases (shared mappings are written out each time), no line folding;
with ``literal_blocks`` multi-line strings (PEM, scripts, dashboards) as literal blocks (``|``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml

__all__ = ["dump_yaml", "dump_yaml_all"]


class _BlockDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


class _LiteralDumper(_BlockDumper):
    pass


def _literal_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_LiteralDumper.add_representer(str, _literal_str)

_OPTIONS: dict[str, Any] = {"sort_keys": False, "default_flow_style": False, "width": 4096}


def dump_yaml(document: Any, *, literal_blocks: bool = False) -> str:
    """One YAML document (see the module docstring)."""
    return yaml.dump(document, Dumper=_LiteralDumper if literal_blocks else _BlockDumper, **_OPTIONS)


def dump_yaml_all(documents: Iterable[Any], *, literal_blocks: bool = False) -> str:
    """Several YAML documents separated by ``---``."""
    dumper = _LiteralDumper if literal_blocks else _BlockDumper
    return yaml.dump_all(list(documents), Dumper=dumper, **_OPTIONS)
