"""The browser client over WebRTC, in a real browser against a real node: Debian's headless Chromium with a
fake microphone from a WAV of espeak-ng speech, the page loaded from a local node (``LocalNode``: nginx over
TLS, the runtime with the tiny model, Redis, coturn) with one slot.

The page's ``/api/rtc`` requests are passed to the runtime itself by the browser's request routing (the
node's nginx proxies ``/api/rtc`` only once its locations are there; the page, the tokens, the ICE servers
and coturn are the node's own). Checked: the page connects over WebRTC with host candidates and gets the
node's audio (decoded samples in ``getStats()``) and the DataChannel's text; relay-only
(``?relay=1``) through the node's coturn connects through a relay candidate and gets audio; with ICE
servers that name a TURN server that is not there, relay-only ICE cannot connect and the page falls back to
the WebSocket within its 3 s limit (the page's own count) with the same, unspent token, and gets audio.
Bounds are the page's own counters; the timeouts are hang guards.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from browser_fixtures import (  # noqa: F401 (fixtures)
    CHROMIUM,
    browser_fixture,
    node_fixture,
    speech_wav_fixture,
    wait_slot_free,
    wait_stats,
)
from playwright.sync_api import Error as PlaywrightError

from infra.node.local.node import LocalNode, missing_binaries

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (CI: apt-get install chromium)"),
    pytest.mark.skipif(bool(missing_binaries()), reason=f"missing system binaries: {missing_binaries()}"),
]

TIMEOUT_MS = 60_000  # hang guard for each wait
CONNECT_LIMIT_MS = 3000  # rtc.js CONNECT_LIMIT_MS: ICE must connect within this, else the WebSocket
SLACK_MS = 2000  # timers on a loaded 2-core machine
RTC_PATH = re.compile(r"^https://[^/]+(/api/rtc(?:/.*|\?.*)?)$")


def open_page(
    browser: Any,
    node: LocalNode,
    query: str,
    ice_servers: list[dict[str, Any]] | None = None,
    refuse_post: int | None = None,
) -> Any:
    """A page of the client at ``/?<query>#token=<fresh token>``; its ``/api/rtc`` requests go to the
    runtime (``ice_servers``: the ICE server list to answer instead of the node's;
    ``refuse_post``: the status to answer the offer's POST with instead of the runtime). ``page.rtc_requests``
    lists the (method, path) of each."""
    context = browser.new_context(ignore_https_errors=True)
    page = context.new_page()
    page.errors = []
    page.rtc_requests = []
    page.rtc_answered = []
    page.on("pageerror", lambda error: page.errors.append(str(error)))

    def to_runtime(route: Any) -> None:
        path = RTC_PATH.match(route.request.url).group(1)  # type: ignore[union-attr]
        page.rtc_requests.append((route.request.method, path.split("?")[0]))
        if refuse_post is not None and route.request.method == "POST":
            route.fulfill(status=refuse_post, content_type="text/plain", body="not_found: no such location\n")
            return
        if ice_servers is not None and path == "/api/rtc/ice-servers":
            route.fulfill(
                status=200, content_type="application/json", body=json.dumps({"iceServers": ice_servers})
            )
            return
        try:
            route.fulfill(response=route.fetch(url=f"{node.runtime_url}{path}"))
        except PlaywrightError:  # the page went away meanwhile (its context closed): nothing to answer
            return
        page.rtc_answered.append((route.request.method, path.split("?")[0]))

    page.route(RTC_PATH, to_runtime)
    page.goto(f"{node.https_url}/?{query}#token={node.mint_token()}")
    page.wait_for_function("() => window.duplexClient !== undefined")
    return page


def end_conversation(page: Any, node: LocalNode) -> None:
    page.click("#talk")
    page.wait_for_function("() => document.getElementById('status').textContent === 'Conversation ended.'")
    wait_slot_free(node)  # the DELETE (or the WebSocket's close) freed the slot
    if ("POST", "/api/rtc") in page.rtc_answered:  # let the DELETE's answer come before the page goes
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        while not any(m == "DELETE" for m, _ in page.rtc_answered) and time.monotonic() < deadline:
            page.wait_for_timeout(100)
    assert page.errors == [], page.errors
    page.context.close()


@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay-only"])
def test_webrtc_conversation(node: LocalNode, browser: Any, relay: bool) -> None:
    """WebRTC forced (a fallback would fail the test): connected through a host candidate, or through the
    node's coturn when relay-only; the node's audio is decoded and played, text comes on the DataChannel,
    getStats() gives the jitter buffer delay, concealed samples and the round trip; the page says WebRTC."""
    wait_slot_free(node)
    page = open_page(browser, node, "transport=webrtc" + ("&relay=1" if relay else ""))
    page.click("#talk")
    live = wait_stats(page, "s.state === 'live'")
    assert live["transport"] == "webrtc" and live["fallbackReason"] == ""
    # 2 s of the node's audio decoded (48 kHz), text on the DataChannel, a ping echoed over it.
    end = wait_stats(
        page,
        "s.rtcSamplesReceived >= 96000 && s.transcriptChars > 0 && s.rttMs !== null "
        "&& s.rtcRttMs !== null && s.rtcJitterBufferMs !== null && s.rtcPacketsSent > 0",
    )
    assert end["state"] == "live" and end["reason"] == ""
    assert end["rtcCandidateType"] == ("relay" if relay else "host"), end
    assert end["rtcConcealedSamples"] < end["rtcSamplesReceived"]
    assert 0 <= end["rtcJitterBufferMs"] < 1000 and end["rtcRttMs"] >= 0
    assert page.text_content("#transcript").strip()
    assert page.text_content("#problem") == ""
    page.wait_for_function(
        "() => document.getElementById('stat-transport').textContent.startsWith('WebRTC')", timeout=TIMEOUT_MS
    )
    end_conversation(page, node)
    assert ("POST", "/api/rtc") in page.rtc_requests
    assert any(method == "DELETE" for method, _ in page.rtc_answered)  # the page ended its session
    print(
        f"\nWebRTC {'relay-only' if relay else 'direct'}: connected in {end['rtcConnectMs']:.0f} ms "
        f"(first ICE server request -> connected, page clock), via {end['rtcCandidateType']}; "
        f"{end['rtcPacketsReceived']} packets in, {end['rtcPacketsLost']} lost, "
        f"{end['rtcConcealedSamples']} of {end['rtcSamplesReceived']} samples concealed; jitter buffer "
        f"{end['rtcJitterBufferMs']:.1f} ms; RTT {end['rtcRttMs']:.1f} ms (ICE), {end['rttMs']:.1f} ms (ping)"
    )


def test_ice_failure_falls_back_to_the_websocket(node: LocalNode, browser: Any) -> None:
    """Relay-only with a TURN server that is not there: no candidate can connect, so the page gives WebRTC
    up within its 3 s limit and opens the WebSocket with the same token (not spent: no offer was posted),
    gets audio and text, and says which transport it uses."""
    wait_slot_free(node)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # a UDP port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    dead_turn = [{"urls": [f"turn:127.0.0.1:{dead_port}?transport=udp"], "username": "u", "credential": "c"}]
    page = open_page(browser, node, "relay=1", ice_servers=dead_turn)
    sockets: list[Any] = []
    page.on("websocket", lambda ws: sockets.append(ws))
    page.click("#talk")
    end = wait_stats(page, "s.state === 'live' && s.framesReceived >= 20 && s.transcriptChars > 0")
    assert end["transport"] == "websocket" and "relay" in end["fallbackReason"], end
    assert end["rtcAttemptMs"] <= CONNECT_LIMIT_MS + SLACK_MS, end  # the page's own count
    assert len(sockets) == 1 and end["reason"] == ""
    assert ("POST", "/api/rtc") not in page.rtc_requests  # the token was not spent on an offer
    page.wait_for_function(
        "() => document.getElementById('stat-transport').textContent === 'WebSocket (WebRTC failed)'",
        timeout=TIMEOUT_MS,
    )
    end_conversation(page, node)
    print(f"\nfallback: WebRTC given up after {end['rtcAttemptMs']:.0f} ms ({end['fallbackReason']})")


def test_a_post_refused_for_a_transport_reason_falls_back(node: LocalNode, browser: Any) -> None:
    """The default transport (WebRTC first) against a node whose proxy does not know ``/api/rtc`` (the
    POST answered 404, as nginx without the location does): the page opens the WebSocket at once with the
    same token (no slot was taken, no token spent), gets audio and text, and says why."""
    wait_slot_free(node)
    page = open_page(browser, node, "", refuse_post=404)
    page.click("#talk")
    end = wait_stats(page, "s.state === 'live' && s.framesReceived >= 20 && s.transcriptChars > 0")
    assert end["transport"] == "websocket" and "HTTP 404" in end["fallbackReason"], end
    assert end["reason"] == "" and ("POST", "/api/rtc") in page.rtc_requests
    end_conversation(page, node)


def _descendants(root: int) -> set[int]:
    """The pids under ``root`` (this test's Chromium, never another job's), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def drop_browser_udp() -> int:
    """Destroy this test's Chromium UDP sockets (``ss -K``: the kernel aborts them, nothing is sent), as a
    phone's network going away: its ICE path is gone, no DTLS close, no ``DELETE``. Returns how many."""
    ours = _descendants(os.getpid())
    listing = subprocess.run(
        ["ss", "-u", "-a", "-n", "-p"], capture_output=True, text=True, check=True
    ).stdout
    ports = set()
    for line in listing.splitlines():
        pids = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if pids & ours and "chrom" in line:
            ports.add(line.split()[3].rsplit(":", 1)[1])
    for port in ports:
        subprocess.run(["ss", "-K", "-u", "-a", "sport", "=", f":{port}"], check=True, capture_output=True)
    return len(ports)


def runtime_counter(node: LocalNode, name: str) -> float:
    with urllib.request.urlopen(f"{node.runtime_url}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, flags=re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_dropped_webrtc_call_is_resumed_by_the_page(node: LocalNode, browser: Any) -> None:
    """Mid-call, the page's UDP sockets are destroyed (its network gone): the page sees ICE go, closes that
    peer connection without ``DELETE``, posts a fresh offer with the session's credential (no token), says
    so, and the conversation goes on over WebRTC in the same session (the runtime counts one resume)."""
    wait_slot_free(node)
    resumed_before = runtime_counter(node, "duplex_sessions_resumed_total")
    page = open_page(browser, node, "transport=webrtc")
    page.click("#talk")
    wait_stats(page, "s.state === 'live' && s.transport === 'webrtc' && s.rtcSamplesReceived >= 48000")
    assert drop_browser_udp() > 0
    page.wait_for_function(
        "() => document.getElementById('status').textContent.startsWith('Live again')", timeout=TIMEOUT_MS
    )
    after = wait_stats(page, "s.resumes === 1 && s.state === 'live' && s.rtcSamplesReceived >= 48000")
    assert after["transport"] == "webrtc" and page.text_content("#problem") == "", after
    # The page's "Live again" comes with the resume's answer; each worker's /metrics may serve its own
    # rendering up to DUPLEX_METRICS_CACHE_S old (1 s; Prometheus's scrapes refresh them): wait for it.
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while (resumed := runtime_counter(node, "duplex_sessions_resumed_total")) < resumed_before + 1:
        assert time.monotonic() < deadline, "the runtime never counted the page's resume"
        time.sleep(0.2)
    assert resumed == resumed_before + 1
    posts = [path for method, path in page.rtc_requests if method == "POST"]
    assert len(posts) >= 2 and not any(m == "DELETE" for m, _ in page.rtc_requests)  # the old call: no DELETE
    end_conversation(page, node)
