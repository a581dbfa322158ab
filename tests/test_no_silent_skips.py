"""A run that skips a test fails (tests/conftest.py, "No silent skips"; issue 25: about 60 tests skipped
silently when a system program was missing, and CI passed). Planted bug this guards: the session hook
removed, or matching every reason."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")

SKIPPING = """
import pytest


def test_runs():
    pass


def test_needs_a_program():
    pytest.skip("chromium is not on PATH")
"""


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    environment = {k: v for k, v in os.environ.items() if k != "DUPLEX_ALLOW_SKIPS"} | env
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_skip_fails_the_run_and_names_the_test(tmp_path: Path) -> None:
    run = _run(tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 test(s) skipped; the suite allows none" in run.stdout
    assert "test_skipping.py::test_needs_a_program: Skipped: chromium is not on PATH" in run.stdout


def test_a_partial_local_environment_may_allow_skips(tmp_path: Path) -> None:
    run = _run(tmp_path, DUPLEX_ALLOW_SKIPS="1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 1 skipped" in run.stdout
