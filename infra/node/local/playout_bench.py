"""Measure the browser client's playout buffer: one conversation in headless Chromium (fake microphone:
espeak-ng speech) against a local node with one slot, for ``--seconds`` of received audio, optionally
through the jitter relay (``infra.node.local.jitter_relay``), optionally with the player of an older commit.

    python -m infra.node.local.playout_bench --seconds 60                       # this tree's player
    python -m infra.node.local.playout_bench --seconds 60 --player-from d5a8f48 # the fixed 120 ms player
    python -m infra.node.local.playout_bench --seconds 60 --jitter-ms 150       # 0-150 ms of injected jitter

What it reports, from the page itself: the **lead** of every frame handed to the AudioContext (how far
ahead of the playhead it was scheduled: how long its first sample waits to be played, which is the delay
the buffer adds; hooked on ``AudioBufferSourceNode.start`` so that any player version is measured the
same way), as mean, p50, p95 and max; the underruns (the page's playback gaps) and frames received and
dropped. The audio queued at an arbitrary moment is the lead plus 0-80 ms (the part of the current frame
not yet played). Needs ``chromium`` and the local node's programs (``duplex node up``'s); Playwright comes
with the test extra. Exit 0, or 1 with the reason.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from infra.node.local.browser_launch import chromium_args, chromium_binary, speech_wav
from infra.node.local.jitter_relay import JitterRelay
from infra.node.local.node import LocalNode, free_port_profile, missing_binaries

__all__ = ["LEAD_HOOK", "main", "measure", "summarize_leads"]

LEAD_HOOK = """(() => {
  // Every frame's lead (ms): how far ahead of the AudioContext's playhead it is scheduled.
  // And when it was scheduled (performance.now(), ms): the page schedules a frame as it arrives.
  const leads = [];
  const times = [];
  window.__playoutLeads = leads;
  window.__playoutTimes = times;
  const start = AudioBufferSourceNode.prototype.start;
  AudioBufferSourceNode.prototype.start = function (when = 0, ...rest) {
    leads.push(Math.max(0, when - this.context.currentTime) * 1000);
    times.push(performance.now());
    return start.call(this, when, ...rest);
  };
})();"""
"""A Playwright init script (runs before the page's own): records each scheduled frame's lead in
``window.__playoutLeads``."""


def summarize_leads(leads: list[float]) -> dict[str, float]:
    """``{"mean", "p50", "p95", "max"}`` of frame leads (ms), skipping the first frame (its lead is the
    starting target, not a measure of the path). Raises ValueError with fewer than two leads."""
    if len(leads) < 2:
        raise ValueError(f"need at least two scheduled frames to summarize, got {len(leads)}")
    values = sorted(leads[1:])
    return {
        "mean": statistics.fmean(values),
        "p50": values[len(values) // 2],
        "p95": values[min(len(values) - 1, int(0.95 * len(values)))],
        "max": values[-1],
    }


def measure(
    *,
    seconds: float,
    jitter_ms: float = 0.0,
    pace_ms: float = 0.0,
    player_from: str | None = None,
    seed: int = 0,
    model: str = "tiny",
) -> dict[str, Any]:
    """Run one conversation of ``seconds`` of received audio (frames received x 80 ms) and return the
    page's figures: ``leads`` (summarize_leads), ``stats`` (the page's ``window.duplexClient.stats`` at the
    end). ``player_from``: a git revision whose ``infra/node/web/player.js`` and ``app.js`` replace this
    tree's in the node's served files (the "before" of a change). Raises RuntimeError when a program is
    missing or the conversation does not reach ``seconds``."""
    from playwright.sync_api import ProxySettings, sync_playwright

    chromium = chromium_binary()
    missing = missing_binaries()
    if chromium is None or missing:
        raise RuntimeError(f"missing programs: chromium={chromium}, node: {missing}")
    frames_wanted = int(seconds * 1000 / 80)
    with tempfile.TemporaryDirectory(prefix="playout-bench-") as tmp:
        node = LocalNode(Path(tmp) / "node", free_port_profile(max_sessions=1, model=model))
        node.start()
        try:
            if player_from:
                for name in ("player.js", "app.js"):
                    old = subprocess.run(
                        ["git", "show", f"{player_from}:infra/node/web/{name}"],
                        capture_output=True,
                        check=True,
                        cwd=Path(__file__).resolve().parent,
                    ).stdout
                    (node.node_dir / "web" / name).write_bytes(old)
            wav = speech_wav(Path(tmp) / "speech.wav")
            with JitterRelay(seed=seed) as relay, sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=chromium, args=chromium_args(wav))
                proxy: ProxySettings = {"server": relay.url, "bypass": "<-loopback>"}
                context = browser.new_context(ignore_https_errors=True, proxy=proxy)
                context.add_init_script(LEAD_HOOK)
                page = context.new_page()
                page.goto(f"{node.https_url}/#token={node.mint_token()}")
                page.wait_for_function("() => window.duplexClient !== undefined")
                page.click("#talk")
                page.wait_for_function("() => window.duplexClient.stats.state === 'live'", timeout=60_000)
                relay.max_delay_ms, relay.pace_lead_ms = jitter_ms, pace_ms
                page.wait_for_function(
                    f"() => window.duplexClient.stats.framesReceived >= {frames_wanted}",
                    timeout=int(seconds * 3000) + 60_000,
                )
                stats = page.evaluate("({...window.duplexClient.stats})")
                relayed = {"audio_records": relay.audio_records, "late_for_pace": relay.late_for_pace}
                leads = page.evaluate("[...window.__playoutLeads]")
                times = page.evaluate("[...window.__playoutTimes]")
                page.click("#talk")
                browser.close()
        finally:
            node.stop()
    return {"leads": summarize_leads(leads), "stats": stats, "relay": relayed, "raw": [leads, times]}


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); prints one Markdown table row and, with ``--json``, writes
    the figures."""
    parser = argparse.ArgumentParser(prog="python -m infra.node.local.playout_bench", description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="received audio to measure (s)")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="relay delay: random 0-N ms")
    parser.add_argument(
        "--pace-ms", type=float, default=0.0, help="re-time the audio on an 80 ms clock, this far behind"
    )
    parser.add_argument("--player-from", default=None, help="git revision of player.js/app.js to measure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny", help="the node's model: tiny (real compute) or sim")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.jitter_ms < 0 or args.pace_ms < 0:
        parser.error("--seconds must be > 0, --jitter-ms and --pace-ms >= 0")
    started = time.monotonic()
    try:
        result = measure(
            seconds=args.seconds,
            jitter_ms=args.jitter_ms,
            pace_ms=args.pace_ms,
            player_from=args.player_from,
            seed=args.seed,
            model=args.model,
        )
    except (RuntimeError, subprocess.CalledProcessError) as error:
        print(f"playout bench failed: {error}", file=sys.stderr)
        return 1
    leads, stats = result["leads"], result["stats"]
    player = args.player_from or "this tree"
    print(
        "| player | jitter | frames | lead mean | p50 | p95 | max | underruns | dropped |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
        f"| {player} | 0-{args.jitter_ms:g} ms | {stats['framesReceived']} | {leads['mean']:.1f} | "
        f"{leads['p50']:.1f} | {leads['p95']:.1f} | {leads['max']:.1f} | {stats['underruns']} | "
        f"{stats['dropped']} |"
    )
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
