"""The local node for real: redis-server, the exporters, the runtime, Prometheus and nginx as processes on
loopback, sessions of real speech through nginx over TLS, and the faults an SRE meets (Redis killed, the
runtime killed, a client that vanishes).

No assertion depends on how fast this machine runs (issue 25, item 2): a test waits for events (a process
gone, so many audio messages after a fault); the waits' timeouts only stop a hung test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import ssl
import time
import urllib.request
from pathlib import Path

import pytest
from test_server_e2e import AFTER_FRAMES, WAIT_S, LiveClient, Metrics, assert_healthy, live

from infra.node.local.bringup import bring_up_and_check, transport_rows
from infra.node.local.node import (
    LocalNode,
    MissingBinaryError,
    NodeStartError,
    free_port_profile,
    missing_binaries,
)
from infra.node.local.prometheus_api import prometheus_query
from runtime.tools.loadgen import DEMO_SENTENCES, run_session, session_url, synthesize_speech

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(missing_binaries()), reason=f"missing system binaries: {missing_binaries()}"),
]


@pytest.fixture(scope="module")
def speech() -> list:
    return [synthesize_speech(sentence) for sentence in DEMO_SENTENCES]


def _nothing_listens(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _alert_states(node: LocalNode, name: str) -> set[str]:
    with urllib.request.urlopen(f"{node.prometheus_url}/api/v1/alerts", timeout=5) as response:
        alerts = json.loads(response.read())["data"]["alerts"]
    return {a["state"] for a in alerts if a["labels"].get("alertname") == name}


def _wait_for(predicate, timeout_s: float, interval_s: float = 0.5) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


def test_local_node_end_to_end(tmp_path: Path, speech: list) -> None:
    """What the README's main job does: 5 sessions through wss://, the 6th refused, one dropped and resumed,
    5 more over WebRTC (signalling through nginx, media relay-only through the node's coturn), 5 phone calls
    as Twilio's side, 5 sessions through LiveKit's plugin, Prometheus saw them all, and nothing is left
    behind."""
    node = LocalNode(tmp_path / "node", free_port_profile())
    node.start()
    pids = [p.popen.pid for p in node.processes if p.popen is not None]
    try:
        check = bring_up_and_check(node, speech)
        # The node's Prometheus sends its alerts to the node's Alertmanager (issue 20, item 8).
        with urllib.request.urlopen(f"{node.prometheus_url}/api/v1/alertmanagers", timeout=5) as response:
            alertmanagers = json.loads(response.read())["data"]["activeAlertmanagers"]
    finally:
        codes = node.stop()
    assert alertmanagers == [{"url": f"{node.alertmanager_url}/api/v2/alerts"}]
    assert check.ok, check.problems
    assert len(check.load.served) == 5
    for r in check.load.served:  # served end to end (how much audio per second: docs/benchmarks.md)
        assert r.audio_messages > 0 and r.text.strip() and r.first_audio_ms is not None
        assert r.connect_ms is not None and r.bytes_received > 0 and r.bytes_sent > 0
    # WebRTC: every session answered, connected through the relay (relay-only: no other candidate) and got
    # audio and text back on the node's RTP and DataChannel.
    assert check.rtc_relay and check.rtc_load is not None
    assert len(check.rtc_load.sessions) == len(check.rtc_load.served) == 5
    for r in check.rtc_load.served:
        assert r.audio_messages > 0 and r.text.strip() and r.first_audio_ms is not None
        assert r.ice_connect_ms is not None and r.answer_ms is not None and r.close_code == 1000
    # Phone calls (issue 32): each carrier's side through nginx's /api/carriers/<carrier>, with the node's
    # stand-in carrier secrets (signed for Twilio and Plivo), a session token per call (Exotel: admitted on
    # its credential): served whole, agent audio back.
    assert list(check.phone_loads) == ["twilio", "plivo", "telnyx", "exotel"]
    for carrier, report in check.phone_loads.items():
        assert len(report.served) == 5, carrier
        for r in report.served:
            assert r.failure == "" and r.audio_messages > 0 and r.first_audio_ms is not None, carrier
    # LiveKit's PersonaPlex plugin, unmodified, in its own virtualenv: 5 sessions through nginx over wss://,
    # a token per connection, the node's NATF2 voice, audio back from the plugin.
    livekit = check.livekit_load
    assert livekit is not None and livekit.failure is None and len(livekit.served) == 5, livekit
    assert all(s.samples > 0 and s.first_audio_ms is not None for s in livekit.sessions)
    rows = {row["transport"]: row for row in transport_rows(check)}
    assert set(rows) == {"websocket", "webrtc", "twilio", "plivo", "telnyx", "exotel", "livekit"}
    assert rows["webrtc"]["served"] == rows["websocket"]["served"] == rows["twilio"]["served"] == 5
    assert rows["livekit"]["served"] == 5 and rows["livekit"]["audio_s"] > 0
    assert rows["webrtc"]["relay_only"] and rows["webrtc"]["ice_connect_ms_p99"] is not None
    assert check.scraped["webrtc_sessions_started"] == 5
    # The resume step: one session's TCP connection cut without a close frame mid-conversation and resumed
    # with its credential through nginx: audio again, the same session id and slot (read back through the
    # sessions API), a normal close, one session record ended.
    resume = check.resume
    assert resume is not None and resume.ok, resume
    assert resume.audio_before >= 5 and resume.audio_after > 0
    assert resume.resumed_session_id == resume.session_id and len(resume.session_id) == 32
    assert resume.slot is not None and resume.resumed_slot == resume.slot
    assert resume.close_code == 1000 and resume.state == "ended"
    assert resume.handshake_ms is not None and resume.audio_again_ms is not None
    assert resume.audio_again_ms >= resume.handshake_ms
    row = resume.as_row()
    assert row["resumed"] and row["same_session"] and row["same_slot"]
    assert check.as_dict()["resume"]["audio_again_ms"] == resume.audio_again_ms
    assert check.scraped["sessions_started"] >= 20
    extra = check.extra_caller
    assert extra.http_status == 503 and "node full" in extra.http_body, extra.refusal_reason
    assert check.scraped["peak_active_sessions"] == 5
    assert check.scraped["targets_up"] == check.scraped["targets"] == 4
    assert check.scraped["tick_p99_ms"] is not None and check.scraped["first_audio_p99_ms"] is not None
    # Everything stopped: every process reaped, every port free again.
    assert set(codes) == {
        "nginx",
        "prometheus",
        "alertmanager",
        "runtime",
        "node-exporter",
        "redis-exporter",
        "redis",
        "coturn",
    }
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    ports = node.profile.ports.model_dump()
    assert all(
        _nothing_listens(port) for name, port in ports.items() if name not in ("grafana", "dcgm_exporter")
    )


def _runtime_counter(node: LocalNode, name: str) -> float:
    """Sum over every label set of counter ``name`` at the runtime's ``/metrics`` (0 before any)."""
    with urllib.request.urlopen(f"{node.runtime_url}/metrics", timeout=5) as response:
        samples = Metrics(response.read().decode()).samples
    return sum(value for (sample, _), value in samples.items() if sample == name)


def test_redis_killed_mid_run_audio_goes_on_and_redis_down_is_raised(tmp_path: Path, speech: list) -> None:
    """Redis killed under two sessions: once the runtime has failed a Redis write, the sessions' audio goes
    on (so many messages after that, however long they take) to a normal close. How long audio may pause is
    a latency (docs/benchmarks.md), not asserted here."""
    node = LocalNode(tmp_path / "node", free_port_profile())
    node.start()
    try:
        url = session_url(node.wss_url)

        async def run() -> tuple[list[LiveClient], float]:
            async with contextlib.AsyncExitStack() as stack:
                clients = [
                    await stack.enter_async_context(
                        live(url, pcm, ssl_context=node.ssl_context(), token=node.mint_token())
                    )
                    for pcm in speech[:2]
                ]
                for client in clients:
                    assert client.result.handshake, client.result.errors
                    client.start_streaming()
                for client in clients:
                    await client.wait_audio()
                redis = node.process("redis").popen
                redis.send_signal(signal.SIGKILL)
                await asyncio.to_thread(redis.wait, WAIT_S)
                # The runtime's store has seen the outage (a failed write: the sessions' text goes to it)...
                assert await asyncio.to_thread(
                    _wait_for,
                    lambda: _runtime_counter(node, "duplex_redis_errors_total") > 0,
                    WAIT_S,
                    0.1,
                )
                mark = time.monotonic()
                for client in clients:  # ...and the audio goes on
                    await client.wait_audio(2 * AFTER_FRAMES, after=mark)
                await asyncio.gather(*(client.finish() for client in clients))
            return clients, mark

        clients, mark = asyncio.run(run())
        for i, client in enumerate(clients):
            assert_healthy(client, after=mark, label=f"session {i}")
        assert node.dead_processes() == {"redis": -signal.SIGKILL}
        # The live Prometheus evaluates the rendered rules on what it scraped: RedisDown goes pending
        # (it fires after its `for`, which the promtool unit tests cover).
        assert _wait_for(lambda: _alert_states(node, "RedisDown") & {"pending", "firing"}, WAIT_S)
        assert prometheus_query(node.prometheus_url, 'redis_up{job="redis-exporter"}') == 0
    finally:
        node.stop()


def test_runtime_killed_nginx_answers_502_and_the_check_reports_it(tmp_path: Path, speech: list) -> None:
    node = LocalNode(tmp_path / "node", free_port_profile())
    node.start()
    try:
        node.process("runtime").popen.send_signal(signal.SIGKILL)
        assert _wait_for(lambda: "runtime" in node.dead_processes(), WAIT_S)
        # Reported, not hung: its load stops at max_duration_s, and pytest's timeout stops a hang.
        check = bring_up_and_check(node, [s[: 1920 * 10] for s in speech], max_duration_s=30)
        assert not check.ok
        assert any("runtime exited with code -9" in p for p in check.problems), check.problems
        for r in check.load.sessions:
            assert r.http_status == 502 and "runtime unavailable" in r.http_body
        assert _wait_for(lambda: _alert_states(node, "RuntimeDown") & {"pending", "firing"}, WAIT_S)
    finally:
        node.stop()


def test_client_vanishing_mid_session_frees_its_slot(tmp_path: Path, speech: list) -> None:
    node = LocalNode(tmp_path / "node", free_port_profile())
    node.start()
    try:
        context = node.ssl_context()

        def active_sessions() -> float:
            with urllib.request.urlopen(f"{node.runtime_url}/metrics", timeout=5) as response:
                for line in response.read().decode().splitlines():
                    if line.startswith("duplex_active_sessions "):
                        return float(line.split()[1])
            raise AssertionError("duplex_active_sessions not exported")

        async def vanish() -> None:
            from websockets.asyncio.client import connect

            from runtime.frontend.codecs.protocol import encode_audio

            ws = await connect(
                session_url(node.wss_url, token=node.mint_token()), ssl=context, compression=None
            )
            await ws.recv()  # handshake
            for i in range(10):
                pcm16 = (speech[0][i * 1920 : (i + 1) * 1920] * 32767).astype("<i2").tobytes()
                await ws.send(encode_audio(pcm16))
                await asyncio.sleep(0.08)
            ws.transport.abort()  # no close frame: the client is simply gone

        asyncio.run(vanish())
        assert _wait_for(lambda: active_sessions() == 0, WAIT_S), "slot not freed"
        # The slot serves the next caller.
        result = asyncio.run(
            run_session(
                session_url(node.wss_url),
                speech[1][: 1920 * 20],
                ssl_context=context,
                token=node.mint_token(),
            )
        )
        assert result.handshake and result.audio_messages > 0
    finally:
        node.stop()


def test_missing_binary_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MissingBinaryError, match=r"apt-get install .*nginx-light"):
        LocalNode(tmp_path / "node", free_port_profile()).start()


def test_port_in_use_is_reported_before_anything_starts(tmp_path: Path) -> None:
    profile = free_port_profile()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", profile.ports.prometheus))
        holder.listen()
        node = LocalNode(tmp_path / "node", profile)
        with pytest.raises(NodeStartError, match=f"prometheus {profile.ports.prometheus}"):
            node.start()
        assert node.processes == []


def test_tls_is_verified_and_plain_http_redirects(tmp_path: Path) -> None:
    node = LocalNode(tmp_path / "node", free_port_profile())
    node.start()
    try:
        with urllib.request.urlopen(f"{node.https_url}/healthz", context=node.ssl_context(), timeout=5) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(
                f"{node.https_url}/healthz", context=ssl.create_default_context(), timeout=5
            )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{node.https_url}/metrics", context=node.ssl_context(), timeout=5)
        assert err.value.code == 404  # never public

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args, **kwargs):  # noqa: ANN002, ANN003
                return None

        opener = urllib.request.build_opener(NoRedirect)
        with pytest.raises(urllib.error.HTTPError) as err:
            opener.open(f"http://127.0.0.1:{node.profile.ports.http}/api/chat", timeout=5)
        assert err.value.code == 301
        assert err.value.headers["Location"].startswith("https://")
    finally:
        node.stop()
