"""WebRTC signalling through the node's nginx: the rendered ``/api/rtc`` locations (POST an offer, the ICE
servers, DELETE a session) checked as text for every profile, and the local profile's nginx (TLS) in front of
the in-process server with the ``sim`` model: an aiortc call gets its 201, its audio and its DELETE through
nginx; a huge offer, other methods and a flood stop at nginx with the runtime's statuses."""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from nginx_front import start_nginx
from test_access_control import token
from test_node_gateway import _block
from test_rtc import rtc_settings
from test_server_e2e import (  # noqa: F401 (fixtures)
    WAIT_S,
    LiveClient,
    bundle,
    local_metrics,
    running_server,
    speech,
    wait_until,
)

from infra.node.bundle.nginx import NGINX_CONF, RTC_OFFER_MAX_BYTES, render_nginx
from infra.node.local.node import free_port_profile
from infra.node.profile.profiles import PROFILES
from runtime.frontend.gate.query import RESUME_HEADER, RESUME_SUBPROTOCOL_PREFIX
from runtime.frontend.server import DuplexServer
from runtime.frontend.transports.webrtc import signalling as rtc
from runtime.tools.cli import app as runtime_app
from runtime.tools.loadgen_rtc import fetch_ice_servers
from runtime.tools.rtc_client import RtcCall, encode_packets

PROXY_HEADERS = (
    "proxy_set_header X-Real-IP $remote_addr;",
    "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;",
    "proxy_pass http://duplex_runtime;",
)


def test_the_offer_cap_is_the_runtimes() -> None:
    assert RTC_OFFER_MAX_BYTES == rtc.MAX_OFFER_BYTES


@pytest.mark.parametrize("profile_name", sorted(PROFILES))
def test_every_profile_routes_webrtc_signalling(profile_name: str) -> None:
    profile = PROFILES[profile_name]
    conf = render_nginx(profile)[NGINX_CONF].decode()
    limits = profile.limits
    offer = _block(conf, "location = /api/rtc {")
    assert "limit_except POST {" in offer and f"client_max_body_size {RTC_OFFER_MAX_BYTES};" in offer
    assert f"limit_conn duplex_node_sessions {profile.sessions};" in offer
    assert f"limit_conn duplex_client_sessions {limits.max_sessions_per_client};" in offer
    assert f"limit_req zone=duplex_handshakes burst={limits.handshake_burst} nodelay;" in offer
    for page in ("503 @node_full", "429 @too_many_handshakes", "413 @offer_too_large"):
        assert f"error_page {page};" in offer, page
    servers = _block(conf, "location = /api/rtc/ice-servers {")
    assert "limit_except GET {" in servers and "limit_req zone=duplex_handshakes" in servers
    session = _block(conf, "location ^~ /api/rtc/ {")
    assert "limit_except DELETE {" in session
    for block in (offer, servers, session):
        for line in PROXY_HEADERS:
            assert line in block, line


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(bundle, tmp_path_factory) -> AsyncIterator[tuple[DuplexServer, str, ssl.SSLContext]]:  # noqa: F811
    """The in-process server (sim model, 2 slots) behind the local profile's rendered nginx."""
    directory = tmp_path_factory.mktemp("rtc-gateway")
    async with running_server(bundle, max_sessions=2, **rtc_settings()) as server:
        # 1 offer a second past a burst of 12: the tests before the flood stay inside it, the flood does not.
        limits = {"handshakes_per_second_per_client": 1.0, "handshake_burst": 12}
        profile = free_port_profile(limits=limits)
        ports = profile.ports.model_copy(update={"runtime": server.port})
        profile = profile.model_copy(update={"ports": ports})
        process, context, base = start_nginx(profile, directory, render_nginx(profile))
        try:
            deadline = time.monotonic() + WAIT_S
            while True:
                try:
                    async with aiohttp.ClientSession() as http, http.get(base + "/healthz", ssl=context):
                        break
                except aiohttp.ClientConnectionError:
                    assert process.poll() is None, (Path(directory) / "logs" / "error.log").read_text()
                    assert time.monotonic() < deadline, "nginx did not start"
                    await asyncio.sleep(0.1)
            yield server, base, context
        finally:
            process.terminate()
            process.wait(10)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_call_through_nginx_gets_its_answer_audio_and_ends_with_delete(gateway, speech) -> None:  # noqa: F811
    server, base, context = gateway
    connector = aiohttp.TCPConnector(ssl=context)
    async with aiohttp.ClientSession(connector=connector) as http:
        async with http.get(
            base + "/api/rtc/ice-servers", headers={"Authorization": f"Bearer {token()}"}
        ) as response:
            assert response.status == 200, await response.text()
            servers = json.loads(await response.text())["iceServers"]
        assert any(s.get("username") for s in servers)  # the TURN credentials came through
        call = RtcCall(base, encode_packets(speech[0]), token=token(), query="seed=7")
        try:
            outcome = await call.start(http)
            assert outcome.status == 201, outcome.body
            assert re.fullmatch(r"/api/rtc/[0-9a-f]{32}/[A-Za-z0-9_-]{24}", call.location or "")
            await asyncio.wait_for(call.audio_arrived.wait(), WAIT_S)
            await asyncio.wait_for(call.handshake.wait(), WAIT_S)
            assert call.outcome.packets_in > 0
            assert len(server.sessions) == 1
            assert await call.hang_up(http) == 200
            await wait_until(lambda: not server.sessions, timeout_s=WAIT_S, what="the session ended")
            assert await call.hang_up(http) == 404
        finally:
            await call.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_the_relay_clients_ice_servers_come_through_nginx(gateway) -> None:
    """What ``duplex loadgen --transport webrtc --relay`` asks first: the TURN servers, token checked."""
    _, base, context = gateway
    servers = await fetch_ice_servers(base, token(), context)
    turn = [s for s in servers if s.get("username")]
    assert turn and all(str(url).startswith("turn") for s in turn for url in s["urls"])  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="answered 401"):
        await fetch_ice_servers(base, None, context)


@pytest.mark.asyncio(loop_scope="module")
async def test_resume_credentials_out_of_the_url_come_through_nginx(gateway, speech) -> None:  # noqa: F811
    """Issue 34: nginx passes ``Sec-WebSocket-Protocol: duplex.resume.<credential>`` and its answer, and
    the ``Duplex-Resume-Credential`` header, to and from the runtime: a WebSocket dropped at nginx (no close
    frame) is resumed as the page resumes it, by subprotocol (selected), and a header that disagrees with it
    is refused naming both places (each reached the runtime)."""
    server, base, context = gateway
    chat = base.replace("https://", "wss://") + "/api/chat?format=pcm"
    first = LiveClient(chat + "&resumable=1", speech[0], ssl_context=context, token=token())
    legs = [first]
    try:
        await first.open()
        assert first.result.handshake, first.result.errors
        await wait_until(lambda: bool(first.metadata), timeout_s=WAIT_S, what="the 0x04 resume metadata")
        session_id, credential = first.metadata[0]["session_id"], first.metadata[0]["resume"]
        first.abort()  # nginx closes its upstream connection: lost, no close frame
        await wait_until(
            lambda: local_metrics(server).value("duplex_sessions_detached_total") == 1,
            timeout_s=WAIT_S,
            what="the session detached",
        )
        offered = RESUME_SUBPROTOCOL_PREFIX + credential
        sid, secret = credential.split(".")
        clash = LiveClient(
            chat,
            speech[0],
            ssl_context=context,
            subprotocols=[offered],
            headers={RESUME_HEADER: f"{sid}.{secret[::-1]}"},
        )
        legs.append(clash)
        await clash.open()
        await clash.wait_closed()
        assert not clash.result.handshake and clash.result.close_code == 1008, clash.result.close_code
        assert "Duplex-Resume-Credential header and the Sec-WebSocket-Protocol" in clash.result.errors[0]
        again = LiveClient(chat, speech[0], ssl_context=context, subprotocols=[offered])
        legs.append(again)
        await again.open()
        assert again.result.handshake, again.result.errors
        assert again.ws is not None and again.ws.subprotocol == offered
        await wait_until(lambda: bool(again.metadata), timeout_s=WAIT_S, what="the resumed metadata")
        assert again.metadata[0]["session_id"] == session_id and again.metadata[0]["resumed"] is True
        await again.ws.close()
    finally:
        for leg in legs:
            await leg.discard()
    await wait_until(lambda: not server.sessions, timeout_s=WAIT_S, what="the session ended")


@pytest.mark.asyncio(loop_scope="module")
async def test_nginx_refuses_what_the_runtime_would(gateway) -> None:
    server, base, context = gateway
    sdp = {"Content-Type": "application/sdp", "Authorization": f"Bearer {token()}"}
    connector = aiohttp.TCPConnector(ssl=context)
    async with aiohttp.ClientSession(connector=connector) as http:
        huge = b"v=0\r\n" + b"a=x\r\n" * (RTC_OFFER_MAX_BYTES // 5 + 1)
        async with http.post(base + "/api/rtc", data=huge, headers=sdp) as response:
            assert response.status == 413
            assert await response.text() == f"the SDP offer is over {RTC_OFFER_MAX_BYTES} bytes\n"
        for method, path in (
            ("GET", "/api/rtc"),
            ("PUT", "/api/rtc"),
            ("POST", "/api/rtc/ice-servers"),
            ("GET", "/api/rtc/" + "ab" * 16 + "/key"),
        ):
            async with http.request(method, base + path) as response:
                assert response.status == 403, (method, path)  # limit_except: never reaches the runtime
        async with http.get(base + "/api/rtc/ice-servers") as response:
            assert response.status == 401  # the runtime's token check, passed through
        # A flood of offers from one address: 429 with a plain reason at nginx, nothing taken.
        statuses = []
        for _ in range(30):
            async with http.post(base + "/api/rtc", data=b"v=0\r\n", headers=sdp) as response:
                statuses.append(response.status)
                if response.status == 429:
                    assert (await response.text()).startswith("too many connection attempts")
        assert 429 in statuses and set(statuses) <= {400, 429}, statuses
    await wait_until(  # the earlier call's slot is freed at the next tick; the refusals took none
        lambda: not server.sessions and server.backend.status().free_slots == server.backend.status().slots,
        timeout_s=WAIT_S,
        what="every slot free",
    )


def test_relay_needs_the_webrtc_transport() -> None:
    from typer.testing import CliRunner

    result = CliRunner().invoke(runtime_app, ["loadgen", "--url", "wss://localhost:1", "--relay"])
    assert result.exit_code == 2 and "--relay needs --transport webrtc" in result.output
