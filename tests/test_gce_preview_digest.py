"""A preview of a new runtime image on a GCE node (issue 33, latent): the digest is unknown until the
build pushes it, and the user-data (``replaceOnChanges``) used to be rendered from the digest-pinned
reference, so the preview showed ``user-data`` unknown and the VM replaced; the ``up`` then replaced
nothing. Rendered from the repository path (known at preview), it shows the same user-data and only the
rollout metadata key changing: an in-place update."""

from __future__ import annotations

import pytest
from pulumi.runtime import rpc
from pulumi_harness import run_stack

from infra.node.bundle.rollout import ROLLOUT_METADATA_KEY

INSTANCE = "gcp:compute/instance:Instance"


@pytest.mark.parametrize("stack", ["dev", "scale5-gcp"])
def test_a_new_digest_previews_as_an_in_place_metadata_update(stack: str) -> None:
    built = run_stack(stack).one(INSTANCE)
    previewed = run_stack(stack, unknown_image_digest=True).one(INSTANCE)
    assert 'metadata["user-data"]' in previewed.replace_on_changes
    user_data = previewed.plain["metadata"]["user-data"]
    assert user_data != rpc.UNKNOWN, "the preview cannot tell the user-data stays: it shows a replacement"
    assert user_data == built.plain["metadata"]["user-data"]
    # What changes is the key the rollout agent reads (unknown until the build: the SDK leaves it out of
    # the map), updated in place; built, it names the digest.
    assert previewed.plain["metadata"].get(ROLLOUT_METADATA_KEY, rpc.UNKNOWN) == rpc.UNKNOWN
    assert "@sha256:" in built.plain["metadata"][ROLLOUT_METADATA_KEY]
