"""``python -m infra.node.local.browser_connects`` (issue 22: "100 consecutive browser connects, direct and
relay"), run small so that it cannot rot: 3 calls each way through its command line against its own local node
(sim model), every call through the right kind of candidate with audio back; and a relay that is down: each
call it breaks is a failure with the page's reason, and the calls after it go on. Real Chromium, nginx, coturn
and runtime on loopback; the timeouts are hang guards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from browser_fixtures import CHROMIUM, node_fixture, speech_wav_fixture  # noqa: F401 (fixtures)

from infra.node.local import browser_connects
from infra.node.local.node import LocalNode, missing_binaries

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (CI: apt-get install chromium)"),
    pytest.mark.skipif(bool(missing_binaries()), reason=f"missing system binaries: {missing_binaries()}"),
]


def test_three_calls_each_way_through_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every call connects over WebRTC (host candidates direct, the node's coturn relay-only), plays the
    node's audio and frees the slot; the summary and the JSON file say 3 of 3 with page-clock connect
    times; exit 0."""
    out = tmp_path / "connects.json"
    assert browser_connects.main(["--count", "3", "--mode", "both", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    summaries = {s["mode"]: s for s in report["summaries"]}
    assert summaries["direct"]["succeeded"] == summaries["relay"]["succeeded"] == 3
    assert summaries["direct"]["failures"] == summaries["relay"]["failures"] == {}
    assert summaries["direct"]["candidates"] == {"host": 3}
    assert summaries["relay"]["candidates"] == {"relay": 3}
    for mode in ("direct", "relay"):
        calls = report["calls"][mode]
        assert len(calls) == 3
        assert all(
            c["ok"] and c["connect_ms"] > 0 and c["audio_ms"] >= browser_connects.AUDIO_MS for c in calls
        )
        assert summaries[mode]["connect_ms_p50"] <= summaries[mode]["connect_ms_p99"]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sum(1 for line in printed if "call" in line) == 6  # one line per call, as it happens


def test_calls_through_a_relay_that_is_down_fail_with_the_pages_reason(
    node: LocalNode, speech_wav: Path
) -> None:
    """With the node's coturn stopped, a relay-only call cannot connect: the page gives up (its 3 s limit)
    and the call is a failure naming the page's reason, not a success and not an exception; the direct
    call after it still succeeds (each call stands alone)."""
    node.process("coturn").stop()
    [relay, direct] = browser_connects.run_calls(node, speech_wav, ["relay", "direct"], 1, timeout_s=30)
    [failed] = relay.calls
    assert not failed.ok and failed.connect_ms is None
    assert failed.reason.startswith("ended by the page: connection_failed"), failed.reason
    assert relay.summary()["succeeded"] == 0 and relay.summary()["failures"] == {failed.reason: 1}
    [ok] = direct.calls
    assert ok.ok and ok.candidate == "host", ok
