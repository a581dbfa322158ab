"""Consecutive browser connects over WebRTC (issue 22: "100 consecutive browser connects, direct and relay:
100 %"): headless Chromium (Debian's, the fake microphone playing espeak-ng speech) opens the browser
client against a local node (nginx over TLS, the runtime, Redis, coturn; one slot), one call after another:

    python -m infra.node.local.browser_connects --count 100 --mode direct
    python -m infra.node.local.browser_connects --count 100 --mode relay     # the page's ?relay=1

Each call, in a fresh browser context: load the page with a fresh session token and
``?transport=webrtc`` (so a WebSocket fallback is a failure, not a success), press "Start talking", wait
until the page is live over WebRTC and has played at least ``AUDIO_MS`` of the node's audio that was not
concealed (``getStats()``: ``totalSamplesReceived - concealedSamples`` at 48 kHz), check the candidate in
use (``host`` direct, ``relay`` relay-only), hang up, and wait for the node's slot to be free again
(``/slotz``) before the next call. A call fails when any of these does not happen within
``--call-timeout-s``, when the page ends the call (its reason and sentence are the failure's reason), when
it connects through the wrong kind of candidate, or when the page throws. Reported: successes of the
count, each failure with its reason, and the connect time p50 / p99 on the page's clock
(``rtcConnectMs``: from the page's first ICE server request to ICE connected). Exit 0 when every call
succeeded, 1 otherwise (or when a program is missing). Needs ``chromium`` and the local node's programs
(``duplex node up``'s); Playwright comes with the test extra.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infra.node.local.browser_launch import chromium_args, chromium_binary, speech_wav
from infra.node.local.node import LocalNode, free_port_profile, missing_binaries

__all__ = ["AUDIO_MS", "CallResult", "ConnectsReport", "main", "run_calls"]

AUDIO_MS = 500
"""Audio the page must have played, not concealed, for a call to count as "audio came back" (ms)."""
RATE_HZ = 48_000
"""The browser's decoding rate for Opus (Hz): ``getStats()``'s samples are at this rate."""
MODES = {"direct": ("", "host"), "relay": ("&relay=1", "relay")}
"""Mode -> (the page's extra query, the local candidate type its calls must connect through)."""


@dataclass
class CallResult:
    """One call: ``ok``; ``reason`` (why it failed: "" when ok); ``connect_ms`` (page clock, first ICE
    server request -> connected; None when it never connected); ``candidate`` (the local candidate type
    in use); ``audio_ms`` (the node's audio played, not concealed); ``wall_ms`` (the whole call on this
    process's clock, page load to slot free)."""

    ok: bool
    reason: str = ""
    connect_ms: float | None = None
    candidate: str = ""
    audio_ms: float = 0.0
    wall_ms: float = 0.0


@dataclass
class ConnectsReport:
    """The calls of one mode, in order."""

    mode: str
    calls: list[CallResult] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Successes, failures by reason, connect time p50 / p99 (ms, nearest rank over the successes)."""
        connects = sorted(c.connect_ms for c in self.calls if c.ok and c.connect_ms is not None)
        ok = sum(c.ok for c in self.calls)
        return {
            "mode": self.mode,
            "calls": len(self.calls),
            "succeeded": ok,
            "success_percent": round(100 * ok / len(self.calls), 1) if self.calls else None,
            "failures": dict(collections.Counter(c.reason for c in self.calls if not c.ok)),
            "connect_ms_p50": _nearest_rank(connects, 50),
            "connect_ms_p99": _nearest_rank(connects, 99),
            "connect_ms_max": round(connects[-1], 1) if connects else None,
            "candidates": dict(collections.Counter(c.candidate for c in self.calls)),
        }


def _nearest_rank(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile of sorted ``values`` by nearest rank (None when empty)."""
    if not values:
        return None
    return round(values[max(0, math.ceil(q / 100 * len(values)) - 1)], 1)


def _slot_free(node: LocalNode, timeout_s: float) -> bool:
    """Poll the runtime's ``/slotz`` until 200 (its one slot free) or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{node.runtime_url}/slotz", timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return False


_DONE = f"""s => (s.transport === 'webrtc' && s.state === 'live'
    && s.rtcSamplesReceived - s.rtcConcealedSamples >= {RATE_HZ * AUDIO_MS // 1000})
    || s.reason !== ''"""
"""JS over the page's stats: the call is through (live over WebRTC, audio played) or over (a reason)."""


def one_call(browser: Any, node: LocalNode, mode: str, timeout_s: float) -> CallResult:
    """One call in a fresh context of ``browser`` (a Playwright ``Browser``); never raises for the call's
    own failures (they are the result's ``reason``)."""
    from playwright.sync_api import Error as PlaywrightError

    query, candidate = MODES[mode]
    started = time.monotonic()
    context = browser.new_context(ignore_https_errors=True)
    errors: list[str] = []
    result = CallResult(ok=False)
    try:
        page = context.new_page()
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(f"{node.https_url}/?transport=webrtc{query}#token={node.mint_token()}")
        page.wait_for_function("() => window.duplexClient !== undefined", timeout=timeout_s * 1000)
        page.click("#talk")
        with contextlib.suppress(PlaywrightError):  # timed out: the stats below say how far it got
            page.wait_for_function(f"() => ({_DONE})(window.duplexClient.stats)", timeout=timeout_s * 1000)
        stats = page.evaluate("({...window.duplexClient.stats})")
        result.connect_ms = None if stats["rtcConnectMs"] is None else round(stats["rtcConnectMs"], 1)
        result.candidate = stats["rtcCandidateType"]
        result.audio_ms = round(1000 * (stats["rtcSamplesReceived"] - stats["rtcConcealedSamples"]) / RATE_HZ)
        if stats["reason"]:
            problem = (page.text_content("#problem") or "").strip()
            result.reason = f"ended by the page: {stats['reason']} ({problem or stats['fallbackReason']})"
        elif stats["transport"] != "webrtc" or stats["state"] != "live":
            result.reason = f"not live over WebRTC after {timeout_s:g} s (state {stats['state']!r})"
        elif result.audio_ms < AUDIO_MS:
            result.reason = f"no audio back within {timeout_s:g} s ({result.audio_ms:g} ms played)"
        elif result.candidate != candidate:
            result.reason = f"connected through a {result.candidate or 'unknown'} candidate, not {candidate}"
        if stats["state"] == "live":
            page.click("#talk")  # hang up: the page DELETEs its Location and closes the peer connection
            page.wait_for_function(
                "() => document.getElementById('status').textContent === 'Conversation ended.'",
                timeout=timeout_s * 1000,
            )
    except PlaywrightError as error:
        result.reason = result.reason or f"browser: {str(error).splitlines()[0]}"
    finally:
        context.close()
    if not _slot_free(node, timeout_s):
        result.reason = result.reason or f"the node's slot was not free {timeout_s:g} s after the hang-up"
    if errors and not result.reason:
        result.reason = f"page error: {errors[0].splitlines()[0]}"
    result.ok = not result.reason
    result.wall_ms = round(1000 * (time.monotonic() - started))
    return result


def run_calls(
    node: LocalNode, wav: Path, modes: list[str], count: int, *, timeout_s: float = 30.0, echo: bool = False
) -> list[ConnectsReport]:
    """``count`` consecutive calls per mode (``direct``, ``relay``) against a started ``node``, one
    Chromium whose fake microphone plays ``wav``; ``echo`` prints each call as a JSON line.

    Raises:
        ValueError: an unknown mode or a count below 1.
        RuntimeError: no ``chromium`` on PATH.
    """
    unknown = [m for m in modes if m not in MODES]
    if unknown or count < 1:
        raise ValueError(f"modes must be among {sorted(MODES)} and count >= 1, got {modes}, {count}")
    chromium = chromium_binary()
    if chromium is None:
        raise RuntimeError("no chromium on PATH (Debian: apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    reports = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=chromium_args(wav))
        try:
            for mode in modes:
                report = ConnectsReport(mode)
                for n in range(count):
                    report.calls.append(one_call(browser, node, mode, timeout_s))
                    if echo:
                        print(
                            json.dumps({"mode": mode, "call": n + 1, **asdict(report.calls[-1])}), flush=True
                        )
                reports.append(report)
        finally:
            browser.close()
    return reports


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring): one JSON line per call, then a summary per mode."""
    parser = argparse.ArgumentParser(prog="python -m infra.node.local.browser_connects", description=__doc__)
    parser.add_argument("--count", type=int, default=100, help="consecutive calls per mode")
    parser.add_argument("--mode", choices=[*MODES, "both"], default="both")
    parser.add_argument("--model", default="sim", help="the node's model: sim (a fixed step) or tiny")
    parser.add_argument("--call-timeout-s", type=float, default=30.0, help="hang guard of each step (s)")
    parser.add_argument("--json", type=Path, default=None, help="write every call and the summaries here")
    args = parser.parse_args(argv)
    if args.count < 1 or args.call_timeout_s <= 0:
        parser.error("--count must be >= 1 and --call-timeout-s > 0")
    missing = missing_binaries()
    if chromium_binary() is None or missing:
        print(
            f"browser connects: missing programs: chromium={chromium_binary()}, node: {missing}",
            file=sys.stderr,
        )
        return 1
    modes = list(MODES) if args.mode == "both" else [args.mode]
    print(json.dumps({"machine": {"cores": os.cpu_count(), "load_average": os.getloadavg()}}), flush=True)
    with tempfile.TemporaryDirectory(prefix="browser-connects-") as tmp:
        node = LocalNode(Path(tmp) / "node", free_port_profile(max_sessions=1, model=args.model))
        node.start()
        try:
            wav = speech_wav(Path(tmp) / "speech.wav")
            reports = run_calls(node, wav, modes, args.count, timeout_s=args.call_timeout_s, echo=True)
        finally:
            node.stop()
    summaries = [r.summary() for r in reports]
    for summary in summaries:
        print(json.dumps(summary), flush=True)
    print(json.dumps({"machine_after": {"load_average": os.getloadavg()}}))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"summaries": summaries, "calls": {r.mode: [asdict(c) for c in r.calls] for r in reports}}
            )
        )
    return 0 if all(s["succeeded"] == s["calls"] for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
