"""``infra.stack_config``: the keys declared as pydantic models (aliases are Pulumi's keys), pydantic's
collected errors turned into one line per problem (key, bad value, what is allowed; secrets never shown),
and the table of docs/stack-configuration.md naming every key. The stacks' own error tests run the whole
program (``tests/test_stacks_single_node.py``, ``tests/test_stack_multi_region.py``,
``tests/test_first_up.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pulumi_harness import stack_config

from infra.stack_config import (
    KEYS_OF,
    KNOWN_KEYS,
    GceNodeKeys,
    RegionKeys,
    StackConfigError,
    parse_stack_config,
)

ROOT = Path(__file__).resolve().parents[1]
K = "duplexops:"


def _problems(stack: str, secrets: dict[str, str] | None = None, **overrides: object) -> list[str]:
    values, secret_keys = stack_config(stack, overrides=overrides, secrets=secrets)
    with pytest.raises(StackConfigError) as caught:
        parse_stack_config(values, stack=stack, secret_keys=set(secret_keys))
    return caught.value.problems


def test_aliases_are_pulumis_keys() -> None:
    fields = GceNodeKeys.model_fields
    assert fields["boot_disk_size_gb"].alias == "duplexops:bootDiskSizeGb"
    assert fields["gcp_zone"].alias == "gcp:zone"
    assert RegionKeys.model_fields["min_nodes"].alias == "minNodes"
    assert set(KEYS_OF) == {"gce-node", "onprem-node", "multi-region"}


def test_the_stack_files_parse() -> None:
    for stack in ("dev", "scale5-gcp", "scale5-onprem", "multi-region"):
        values, secret_keys = stack_config(stack)
        config = parse_stack_config(values, stack=stack, secret_keys=set(secret_keys))
        assert config.stack == stack and config.profile.sessions >= 1


def test_every_problem_at_once_one_line_each() -> None:
    problems = _problems(
        "dev",
        **{
            K + "bootDiskSizeGb": "50",
            K + "bootDiskType": "pd-x",
            K + "enableApis": "yes",
            K + "subnetCidr": "8.8.8.0/24",
            "gcp:project": "X",
        },
    )
    assert problems == [
        "gcp:project: 'X' is not valid; allowed: a Google Cloud project id (6-30 lower case letters, "
        "digits, '-')",
        "duplexops:bootDiskSizeGb: '50' is not valid; allowed: an integer from 100 to 4096",
        "duplexops:bootDiskType: unknown value 'pd-x'; allowed: pd-balanced, pd-ssd",
        "duplexops:subnetCidr: '8.8.8.0/24' is not a private IPv4 network; allowed: an RFC 1918 CIDR of /29 "
        "or larger, e.g. 10.64.0.0/24",
        "duplexops:enableApis: 'yes' is not valid; allowed: true, false",
    ]


def test_gcp_rules_call_the_capacity_planner() -> None:
    [zone] = _problems("dev", **{"gcp:zone": "europe-west4-a"})
    assert (
        zone == "gcp:zone: 'europe-west4-a' is not in gcp:region 'us-central1'; allowed: us-central1-a, ..."
    )
    [machine] = _problems("dev", **{K + "machineType": "zz-1"})
    assert machine.startswith("duplexops:machineType: unknown machine type 'zz-1'; allowed: n1-standard-")
    [gpu] = _problems("dev", **{K + "profile": "l40s"})
    assert "the profile's GPU 'l40s' is not offered on GCP" in gpu and gpu.startswith("duplexops:profile: ")


def test_secret_values_are_never_shown() -> None:
    problems = _problems(
        "dev", secrets={"hfToken": "has a space", "tokenSigningKeys": '{"k": "short-secret"}'}
    )
    text = "\n".join(problems)
    assert "has a space" not in text and "short-secret" not in text
    assert any(p.startswith("duplexops:hfToken: the value (not shown) is not valid") for p in problems)


def test_token_keys_problems_name_the_key_once() -> None:
    [short] = _problems("dev", secrets={"tokenSigningKeys": '{"k": "short"}'})
    assert short.startswith(
        "duplexops:tokenSigningKeys: signing key 'k': the secret must be at least 32 bytes"
    )
    assert short.count("tokenSigningKeys") == 1 and 'short"' not in short


def test_region_items_name_their_place() -> None:
    regions = [
        {"zones": ["us-central1-a"]},
        {
            "region": "europe-west4",
            "zones": ["europe-west4-a"],
            "serving": "no",
            "minNodes": 5,
            "maxNodes": 2,
        },
        {"region": "asia-southeast1", "zones": ["asia-southeast1-c"], "colour": "red"},
    ]
    problems = _problems("multi-region", **{K + "regions": regions})
    assert problems == [
        "duplexops:regions[0].region: missing; allowed: a GCP region such as us-central1",
        "duplexops:regions[1].serving: 'no' is not valid; allowed: true, false",
        "duplexops:regions[2].colour: unknown key; allowed keys: region, zones, gpu, machineType, minNodes, "
        "maxNodes, redisMemoryGb, networkIndex, serving",
    ]
    [bounds] = _problems("multi-region", **{K + "regions": [{**regions[1], "serving": True}]})
    assert bounds == "duplexops:regions[0].minNodes: 5 is above maxNodes 2; allowed: minNodes <= maxNodes"


def test_the_docs_name_every_key() -> None:
    doc = (ROOT / "docs" / "stack-configuration.md").read_text()
    section = doc.split("# Stack configuration\n", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`([a-zA-Z]+)`", section))
    assert set(KNOWN_KEYS) <= documented, set(KNOWN_KEYS) - documented
    assert set(RegionKeys.model_fields[n].alias for n in RegionKeys.model_fields) <= documented


@pytest.mark.parametrize(
    ("stack", "profile"),
    [
        ("dev", "t4-int8"),
        ("scale5-gcp", "a100-80gb"),
        ("scale5-onprem", "l40s"),
        ("multi-region", "a100-80gb"),
    ],
)
def test_a_gated_model_requires_hf_token(stack: str, profile: str) -> None:
    """Issue 20 item 5: every profile of the stacks serves the gated nvidia/personaplex-7b-v1; without
    hfToken the weights download gets 401 and the node never turns ready, so the configuration refuses it
    before anything is declared (the harness's FAKE_SECRETS set it, so the stacks pass)."""
    values, secret_keys = stack_config(stack, drop=[K + "hfToken"])
    with pytest.raises(StackConfigError) as caught:
        parse_stack_config(values, stack=stack, secret_keys=set(secret_keys))
    assert caught.value.problems == [
        f"duplexops:hfToken: required: profile {profile!r} serves nvidia/personaplex-7b-v1, which is gated "
        "on the Hugging Face Hub; accept its licence there with your account, then set a token of that "
        "account with `pulumi config set --secret hfToken hf_...`"
    ]
    values, secret_keys = stack_config(stack)
    assert parse_stack_config(values, stack=stack, secret_keys=set(secret_keys)).secrets.hf_token is not None


def test_gated_ness_comes_from_the_model_preset() -> None:
    """Only a model whose preset is gated needs the token (moshi-7b's weights are public)."""
    from infra.node.profile.profiles import get_profile
    from infra.stack_config.keys_common import _require_hf_token
    from runtime.engine.model_presets import PRESETS

    assert {name for name, preset in PRESETS.items() if preset.gated} == {"personaplex-7b"}
    _require_hf_token(get_profile("a100-80gb", model="moshi-7b"), None)
    with pytest.raises(ValueError, match="hfToken"):
        _require_hf_token(get_profile("a100-80gb"), None)
