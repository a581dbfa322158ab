"""The LiveKit row of ``duplex node up`` (issue 32, "Done when"): ``infra.node.local.livekit_row`` runs the
plugin's agent (``runtime/tools/livekit_agent.py``) as a subprocess of the LiveKit virtualenv's Python, and
``infra.node.local.bringup`` sets its row beside the other transports and fails the node check on its failure.

Nothing here needs the plugin: the subprocess is replaced by a runner (``subprocess.run``'s shape) or by a
small executable standing in for the virtualenv's Python. The real plugin against a real node:
tests/test_livekit_plugin.py and tests/test_node_local.py.

Planted bugs these catch: a missing virtualenv raising out of the node check (or passing it); the agent's
non-zero exit read as an empty, passing run; a plugin error or a session without audio not failing the
check; the LiveKit row missing from ``transport_rows`` or the CLI's table.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from infra.node.cli import _transport_table
from infra.node.local.bringup import NodeCheck, _check_load, transport_rows
from infra.node.local.livekit_row import LIVEKIT_VOICE, LiveKitReport, LiveKitSession, run_livekit_load
from runtime.tools.loadgen import LoadReport, SessionResult

SPEECH = [np.zeros(24000, dtype=np.float32)]


class Tokens:
    def __init__(self) -> None:
        self.minted = 0

    def __call__(self) -> str:
        self.minted += 1
        return f"token-{self.minted}"


def runner(stdout: str = "", stderr: str = "", returncode: int = 0, seen: list[Any] | None = None) -> Any:
    """A stand-in for ``subprocess.run`` that records the plan it was given and answers as told."""

    def run(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if seen is not None:
            seen.append((args, json.loads(Path(args[2]).read_text()), kwargs))
        return subprocess.CompletedProcess(args, returncode, stdout, stderr)

    return run


@pytest.fixture
def python(tmp_path: Path) -> Path:
    path = tmp_path / "python"
    path.write_text("")
    return path


def test_the_agent_gets_a_plan_with_one_fresh_token_per_session_and_its_report_is_read(python: Path) -> None:
    seen: list[Any] = []
    answer = {
        "sessions": [
            {"samples": 48000, "first_audio_ms": 120.0, "errors": []},
            {"samples": 24000, "first_audio_ms": 200.0, "errors": []},
        ],
        "wall_s": 9.5,
    }
    tokens = Tokens()
    report = run_livekit_load(
        "wss://127.0.0.1:8443",
        SPEECH,
        sessions=2,
        token=tokens,
        cafile="/node/tls/node.crt",
        python=python,
        run=runner(stdout="a log line\n" + json.dumps(answer) + "\n", seen=seen),
    )
    ((args, plan, kwargs),) = seen
    assert args[0] == str(python) and args[1].endswith("runtime/tools/livekit_agent.py")
    assert plan["scenario"] == "load" and plan["url"] == "wss://127.0.0.1:8443"
    assert plan["tokens"] == ["token-1", "token-2"] and plan["sessions"] == 2
    assert plan["voice"] == LIVEKIT_VOICE and plan["cafile"] == "/node/tls/node.crt"
    assert kwargs["timeout"] > 0
    assert report.failure is None and report.problems() == []
    summary = report.summary()
    assert summary["served"] == 2 and summary["failed"] == 0
    assert summary["first_audio_ms_p50"] == 160.0 and summary["audio_s"] == 3.0


def test_a_missing_virtualenv_is_a_failed_row_naming_it_and_the_node_check_fails(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    report = run_livekit_load("wss://x:1", SPEECH, sessions=5, token=Tokens(), python=missing)
    assert report.failure is not None
    assert str(missing) in report.failure and "make livekit-deps" in report.failure
    check = _checked(report)
    assert not check.ok
    assert check.problems == [f"LiveKit plugin: {report.failure}"]
    (row,) = [r for r in transport_rows(check) if r["transport"] == "livekit"]
    assert row["served"] == 0 and row["sessions"] == 5 and row["failure"] == report.failure


def test_the_plugin_failing_in_its_subprocess_is_a_failed_row_with_its_last_words(tmp_path: Path) -> None:
    """A real subprocess: an executable standing in for the virtualenv's Python that fails as a broken
    plugin install would."""
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
        "echo \"ModuleNotFoundError: No module named 'livekit'\" >&2\nexit 1\n"
    )
    python.chmod(0o755)
    report = run_livekit_load("wss://x:1", SPEECH, sessions=1, token=Tokens(), python=python)
    assert report.failure == (
        "the LiveKit agent exited with code 1: ModuleNotFoundError: No module named 'livekit'"
    )
    assert not _checked(report).ok


@pytest.mark.parametrize(
    ("outcome", "failure"),
    [
        (subprocess.TimeoutExpired("python", 180), "the LiveKit agent ran past 180 s"),
        (runner(stdout="not json"), "the LiveKit agent's report is unreadable"),
        (runner(stdout='{"sessions": [{}]}'), "the LiveKit agent's report is unreadable"),
    ],
)
def test_no_report_from_the_agent_is_a_failure_not_an_exception(
    python: Path, outcome: Any, failure: str
) -> None:
    def timing_out(*args: Any, **kwargs: Any) -> Any:
        raise outcome

    run = timing_out if isinstance(outcome, Exception) else outcome
    report = run_livekit_load("wss://x:1", SPEECH, sessions=1, token=Tokens(), python=python, run=run)
    assert report.failure is not None and report.failure.startswith(failure), report.failure
    assert report.sessions == [] and not _checked(report).ok


def test_a_plugin_error_or_a_silent_session_fails_the_node_check() -> None:
    error = {"type": "APIConnectionError", "message": "PersonaPlex connection closed", "recoverable": True}
    report = LiveKitReport(
        planned=3,
        sessions=[
            LiveKitSession(samples=24000, first_audio_ms=100.0),
            LiveKitSession(samples=0, errors=[error]),
            LiveKitSession(samples=0),
        ],
    )
    check = _checked(report)
    assert check.problems == [
        "LiveKit session 1: APIConnectionError: PersonaPlex connection closed",
        "LiveKit session 2 got no audio",
    ]
    (row,) = [r for r in transport_rows(check) if r["transport"] == "livekit"]
    assert row["served"] == 1 and row["sessions"] == 3 and row["failure"] is None


def test_bad_arguments_are_refused_before_anything_runs(python: Path) -> None:
    with pytest.raises(ValueError, match="sessions must be >= 1"):
        run_livekit_load("wss://x:1", SPEECH, sessions=0, token=Tokens(), python=python)
    with pytest.raises(ValueError, match="seconds must be > 0"):
        run_livekit_load("wss://x:1", SPEECH, sessions=1, token=Tokens(), python=python, seconds=0)
    with pytest.raises(ValueError, match="no speech"):
        run_livekit_load("wss://x:1", [], sessions=1, token=Tokens(), python=python)


def test_the_livekit_row_is_rendered_beside_the_websocket_row() -> None:
    websocket = SessionResult(handshake=True, audio_messages=10, first_audio_ms=90.0, close_code=1000)
    check = NodeCheck(
        load=LoadReport(sessions=[websocket], wall_s=5.0),
        livekit_load=LiveKitReport(
            planned=2,
            sessions=[
                LiveKitSession(samples=48000, first_audio_ms=300.0),
                LiveKitSession(samples=72000, first_audio_ms=500.0),
            ],
        ),
    )
    rows = transport_rows(check)
    assert [r["transport"] for r in rows] == ["websocket", "livekit"]
    livekit = rows[1]
    assert livekit["served"] == livekit["sessions"] == 2
    assert livekit["first_audio_ms_p50"] == 400.0 and livekit["first_audio_ms_p99"] == pytest.approx(498.0)
    assert livekit["audio_s"] == 5.0 and livekit["frames_lost"] is None
    assert check.as_dict()["livekit"]["summary"]["served"] == 2  # type: ignore[index]
    console = Console(width=200, record=True)
    console.print(_transport_table(rows))
    text = console.export_text()
    (line,) = [line for line in text.splitlines() if "livekit" in line and "2/2" in line]
    cells = [cell.strip() for cell in line.split("│")[1:-1]]
    assert cells == ["livekit", "2/2", "400", "498", "-", "-", "-", "-", "5"], line


def _checked(report: LiveKitReport) -> NodeCheck:
    """A node check whose WebSocket run was fine and whose LiveKit run is ``report``, checked."""
    websocket = SessionResult(
        handshake=True, audio_messages=10, text="hi", first_audio_ms=90.0, close_code=1000
    )
    check = NodeCheck(load=LoadReport(sessions=[websocket], wall_s=5.0), livekit_load=report)
    _check_load(check, sessions=1)
    return check
