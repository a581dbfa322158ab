"""Entry point the Pulumi CLI runs for ``--policy-pack infra/policy``: serves the pack to the engine.

The CLI runs this file with ``infra/policy`` as the script directory, so the repository root (two levels
up) is put on ``sys.path`` for ``infra.policy`` and the capacity planner's catalog (``infra.capacity``).
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from pulumi_policy import PolicyPack  # noqa: E402

from infra.policy.pack import DESCRIPTION, ENFORCEMENT_LEVEL, PACK_NAME, build_policies  # noqa: E402

if __name__ == "__main__":
    # Starts the analyzer's gRPC server, prints its port for the CLI and serves until the CLI stops it.
    PolicyPack(
        name=PACK_NAME,
        enforcement_level=ENFORCEMENT_LEVEL,
        policies=build_policies(),
        description=DESCRIPTION,
    )
