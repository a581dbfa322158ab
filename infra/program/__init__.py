"""The Pulumi program: ``run(config)`` declares the stack's topology (one module each: ``gce``,
``onprem``, ``multi_region``; what they share in ``shared``) and returns its outputs, never a secret value
(passwords are named by where to read them). Topologies, stacks and outputs: docs/deploying.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from infra.program import gce, multi_region, onprem
from infra.stack_config import StackConfig

__all__ = ["TOPOLOGY_PROGRAMS", "run"]

TOPOLOGY_PROGRAMS: dict[str, Callable[[StackConfig], dict[str, Any]]] = {
    "gce-node": gce.declare,
    "onprem-node": onprem.declare,
    "multi-region": multi_region.declare,
}
"""The program of each topology (``infra.stack_config.TOPOLOGIES``)."""


def run(config: StackConfig) -> dict[str, Any]:
    """Declare the stack's resources; return its outputs (``{name: value or Output}``)."""
    return TOPOLOGY_PROGRAMS[config.topology](config)
