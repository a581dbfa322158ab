"""``duplex``, the project's command line: the one place that puts it together. The runtime's commands
(``runtime.tools.cli``: ``serve``, ``demo``, ``loadgen``, ``bench``, ``token``), the node's
(``infra.node.cli``:
``duplex node``), the capacity planner's (``infra.capacity.cli``: ``duplex capacity``) and the GPU quota check
(``infra.preflight.cli``: ``duplex preflight``). The runtime image
has no ``infra`` package and runs ``duplex-runtime`` (``runtime.tools.cli.app``) instead. README, "Layout".
"""

from __future__ import annotations

import sys

from infra.capacity.cli import app as capacity_app
from infra.node.cli import app as node_app
from infra.preflight.cli import preflight
from runtime.tools.cli import runtime_app

__all__ = ["app", "main"]

app = runtime_app(
    help="Batched full-duplex speech-to-speech runtime (Moshi / PersonaPlex) and its deployment tools."
)
app.add_typer(capacity_app, name="capacity")
app.add_typer(node_app, name="node")
app.command("preflight")(preflight)


def main() -> None:  # pragma: no cover - console entry
    """``python -m infra.cli``: run ``duplex``."""
    sys.exit(app())


if __name__ == "__main__":
    main()
