"""The browser client's adaptive playout buffer (``infra/node/web/playout.js``), unit-tested without a
browser: ``node --test tests/js/`` drives it with a synthetic clock and arrival patterns (a clean path, a
few ms of jitter, 0-150 ms of injected jitter that comes and goes, a stall and burst, clock drift and a
step in path delay) and checks ``stretch()``, its pitch-keeping time compression and expansion. The same
module runs in the page (``player.js``); ``test_browser_client`` checks it there, in Chromium."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

NODE = shutil.which("node")
TESTS = Path(__file__).resolve().parent / "js"

pytestmark = pytest.mark.skipif(NODE is None, reason="no node binary on PATH (apt-get install nodejs)")


def test_playout_logic_under_node() -> None:
    assert NODE is not None
    files = sorted(str(path) for path in TESTS.glob("*.test.mjs"))
    assert files, f"no node tests under {TESTS}"
    result = subprocess.run(
        [NODE, "--test", "--test-reporter=tap", *files],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=TESTS,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    passed = re.search(r"^# pass (\d+)$", output, flags=re.MULTILINE)
    failed = re.search(r"^# fail (\d+)$", output, flags=re.MULTILINE)
    assert passed and failed and int(failed.group(1)) == 0, output
    assert int(passed.group(1)) >= 12, output  # every test ran (none filtered or skipped)
    assert "# skipped 0" in output and "# todo 0" in output, output
