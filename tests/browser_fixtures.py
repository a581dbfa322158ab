"""The browser tests' shared fixtures and helpers (``tests/test_browser_client.py``,
``tests/test_browser_webrtc.py``, ``tests/test_browser_connects.py``): a local node with one slot, Debian's
headless Chromium (Playwright) whose fake microphone plays a WAV of espeak-ng speech, and the page's stats
(``stats``, ``wait_stats``). Import the ``*_fixture`` functions into a test module: each registers under its
``name`` (``speech_wav``, ``node``, ``browser``), so that a test's parameters do not shadow an import.
``CHROMIUM`` is None where there is no ``chromium`` on PATH (the modules then skip, which
tests/conftest.py turns into a failure)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.node.local.browser_launch import chromium_args, chromium_binary
from infra.node.local.browser_launch import speech_wav as write_speech_wav
from infra.node.local.node import LocalNode, free_port_profile

CHROMIUM = chromium_binary()
STATS_TIMEOUT_MS = 60_000
"""``wait_stats``'s hang guard (ms): a bound on a stuck test, never a speed check (a loaded 2-core machine
needs the slack)."""


@pytest.fixture(scope="module", name="speech_wav")
def speech_wav_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two sentences of espeak-ng speech as a 16-bit PCM WAV (Chromium's fake capture device loops it)."""
    return write_speech_wav(tmp_path_factory.mktemp("speech") / "speech.wav")


@pytest.fixture(scope="module", name="node")
def node_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    """The local node (nginx over TLS, the runtime with the tiny model, Redis, coturn) with one slot: one
    conversation fills it."""
    local = LocalNode(tmp_path_factory.mktemp("node") / "node", free_port_profile(max_sessions=1))
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module", name="browser")
def browser_fixture(speech_wav: Path) -> Iterator[Any]:
    """Headless Chromium with the microphone granted and fed from ``speech_wav``, autoplay allowed."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=chromium_args(speech_wav))
        try:
            yield chromium
        finally:
            chromium.close()


def wait_slot_free(node: LocalNode, timeout_s: float = 20.0) -> None:
    """Poll the node's runtime ``/slotz`` every 100 ms until it answers 200 (a slot is free). Raises
    AssertionError after ``timeout_s`` seconds (a hang guard)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{node.runtime_url}/slotz", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise AssertionError("the node's slot was not freed")


def stats(page: Any) -> dict[str, Any]:
    """A copy of the page's ``window.duplexClient.stats`` (app.js and rtc.js: transport, frames, getStats()
    figures)."""
    return page.evaluate("({...window.duplexClient.stats})")


def wait_stats(page: Any, condition: str, timeout_ms: int = STATS_TIMEOUT_MS) -> dict[str, Any]:
    """Wait until ``condition`` (a JS expression over ``s``, the page's stats) holds; the stats then.
    Raises Playwright's TimeoutError after ``timeout_ms`` (a hang guard)."""
    page.wait_for_function(f"() => (s => {condition})(window.duplexClient.stats)", timeout=timeout_ms)
    return stats(page)
