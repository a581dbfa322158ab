"""Tests that kill mutants of infra/stack_config/keys.py's GCP functions that the stack configuration tests
let survive (``make mutation MODULE=infra/stack_config/keys.py``; docs/mutation.md). Each docstring names
the mutants it kills."""

from __future__ import annotations

import pytest
from test_stack_config_gpus import _parse, _region

from infra.stack_config import StackConfigError

NOT_ON_GCP = (
    "duplexops:regions[0].gpu: 'l40s' is not offered on GCP (on-premises only); allowed: a100-40gb, "
    "a100-80gb-sxm, h100, h200, l4, t4"
)


@pytest.mark.parametrize("gpu, profile", [("l40s", "t4-int8"), (None, "l40s")])
def test_a_region_whose_gpu_is_not_on_gcp_is_refused_by_name(gpu, profile):
    """Kills ``_region_settings``: the refusal's text (``"XX...XX"``, the ``", "`` join of the GPUs GCP
    offers) and its ``where`` (``[i].gpu``): an L40S, set on the region or coming with the profile, is
    named with the GPUs a region may use."""
    with pytest.raises(StackConfigError) as caught:
        _parse([_region("us-central1", gpu, "n1-standard-8")], profile=profile)
    assert caught.value.problems == [NOT_ON_GCP]
