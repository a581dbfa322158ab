"""Pulumi program entry of the bootstrap project (``main: __main__.py`` in ``infra/bootstrap/Pulumi.yaml``):
read the configuration, declare the bootstrap, export what CI needs."""

from __future__ import annotations

from typing import Any

import pulumi

from infra.bootstrap.config import load_bootstrap_config
from infra.bootstrap.program import declare


def main() -> dict[str, Any]:
    """Run the bootstrap for the current stack; returns the exported outputs."""
    outputs = declare(load_bootstrap_config())
    for name, value in outputs.items():
        pulumi.export(name, value)
    return outputs


if __name__ == "__main__":
    main()
