"""Helpers shared by the components."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pulumi

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The repository root (the runtime image's build context)."""

COMPONENT_PACKAGE = "duplexops:components"
"""Type-token prefix of this project's components (``duplexops:components:<Class>``)."""


def child_options(
    parent: pulumi.Resource, depends_on: Sequence[pulumi.Resource] = (), **kwargs: object
) -> pulumi.ResourceOptions:
    """Options of a component's child: parented to the component, and depending on ``depends_on`` (what
    the component was asked to wait for: a component's own ``depends_on`` is not passed to its children)."""
    return pulumi.ResourceOptions(parent=parent, depends_on=list(depends_on) or None, **kwargs)  # type: ignore[arg-type]


def dependencies(opts: pulumi.ResourceOptions | None) -> list[pulumi.Resource]:
    """The resources ``opts.depends_on`` names (a list, one resource, or nothing)."""
    if opts is None or opts.depends_on is None:
        return []
    deps = opts.depends_on
    if isinstance(deps, pulumi.Resource):
        return [deps]
    return [d for d in deps if isinstance(d, pulumi.Resource)]  # type: ignore[union-attr]
