"""docs/deploying.md on what a first ``up`` in a fresh project needs and what it may not promise (issue 33):
GPU quota is regional plus the project-wide ``GPUS_ALL_REGIONS`` (0 on a new project), with what to request
for each GPU stack; Let's Encrypt sends no expiry e-mail since 2025-06-04."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOYING = (ROOT / "docs" / "deploying.md").read_text()


def _section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", DEPLOYING, re.S | re.M)
    assert match, f"docs/deploying.md has no section '## {title}'"
    return match[1]


def test_gpu_quota_is_regional_plus_gpus_all_regions_for_each_gpu_stack() -> None:
    """A fresh project has GPUS_ALL_REGIONS = 0: the per-model regional quota alone does not let a first up
    create a GPU; the docs name both for every stack that runs GPUs on Google Cloud."""
    quota = _section("GPU quota")
    assert "GPUS_ALL_REGIONS" in quota and "regional" in quota
    rows = {
        line.split("|")[1].strip().strip("`").split("`")[0]: line
        for line in quota.splitlines()
        if line.startswith("| `")
    }
    for path in sorted((ROOT / "stacks").glob("Pulumi.*.yaml")):
        stack = path.name.removeprefix("Pulumi.").removesuffix(".yaml")
        topology = yaml.safe_load(path.read_text())["config"]["duplexops:topology"]
        assert stack in rows, f"no GPU quota row for stack {stack}"
        if topology != "onprem-node":
            assert re.search(r"GPUS\b", rows[stack].split("|")[2]), rows[stack]  # a regional GPU quota
            assert ">=" in rows[stack].split("|")[3], rows[stack]  # and GPUS_ALL_REGIONS
    # The old wording: quota asked "in every zone" (GPU quotas are regional).
    assert not re.search(r"GPU quota in every zone", DEPLOYING)


def test_no_promise_of_lets_encrypt_expiry_mail() -> None:
    """Let's Encrypt stopped expiry notification e-mails on 2025-06-04: acmeEmail is a contact only."""
    text = DEPLOYING.replace("No expiry e-mail:", "")
    assert not re.search(r"expiry mail|expiration e-?mail|expiry e-?mail", text)
    assert "2025-06-04" in _section("Certificates on a single node")
