"""Pulumi program entry (``main: infra/`` in Pulumi.yaml): read and validate the stack's configuration,
declare the topology, export its outputs. Everything else is in ``infra.program``
(one module per topology); docs/deploying.md."""

from __future__ import annotations

from typing import Any

import pulumi

from infra.program import run
from infra.stack_config import load_stack_config


def main() -> dict[str, Any]:
    """Run the program for the current stack; returns the exported outputs."""
    outputs = run(load_stack_config())
    for name, value in outputs.items():
        pulumi.export(name, value)
    return outputs


if __name__ == "__main__":
    main()
