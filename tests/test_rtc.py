"""WebRTC on ``/api/rtc`` end to end: an aiortc client (runtime/tools/rtc_client.py) against the in-process
server on loopback, the ``sim`` model behind it, in both process modes (``--workers 0`` and ``--workers 2``).

Signalling (201, ``Location``, ``Link``, ``DELETE``, the ICE servers before the offer), media both ways, the
DataChannel (0x00, 0x02 text, 0x06 ping echoed, 0x05 errors), refusals before the answer taking no slot
and spending no token, bad input (malformed SDP, no audio, a huge body, an offer flood, DataChannel floods
and oversized messages), and the slot freed when the peer vanishes (DTLS close, media stops, ICE never
connects). Every wait is for an event, with a generous hang guard.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator

import aiohttp
import jwt
import numpy as np
import pytest
import pytest_asyncio
from test_access_control import AUDIENCE, KEY, ORIGIN, auth_settings, token
from test_server_e2e import (  # noqa: F401  (fixtures)
    WAIT_S,
    WORKER_MODES,
    bundle,
    running_server,
    scrape,
    speech,
    wait_until,
)

from runtime.frontend.codecs.protocol import encode_metadata, encode_ping
from runtime.frontend.server import DuplexServer
from runtime.frontend.transports.webrtc import signalling as rtc
from runtime.tools.rtc_client import RtcCall, encode_packets, local_candidate_nets

pytestmark = pytest.mark.asyncio(loop_scope="module")

TURN_SECRET = "t" * 40
TURN_URLS = ["turn:turn.example.com:3478?transport=udp", "stun:turn.example.com:3478"]


def token_id(value: str) -> str:
    """The ``jti`` of a session token (its signature not checked)."""
    return str(jwt.decode(value, options={"verify_signature": False})["jti"])


def rtc_settings(**extra: object) -> dict[str, object]:
    settings = auth_settings(None, replay="memory")
    settings.update(
        # the aiortc callers run on this host: their host candidates are private (candidates.py drops them)
        rtc_allowed_candidate_nets=local_candidate_nets(),
        model="sim",
        sim_step_ms="5",
        turn_secret=TURN_SECRET,
        turn_urls=TURN_URLS,
        rtc_connect_timeout_s=2.0,
        rtc_media_timeout_s=1.0,
    )
    settings.update(extra)
    return settings


@pytest.fixture(scope="module")
def packets(speech: list[np.ndarray]) -> list[bytes]:  # noqa: F811
    return encode_packets(speech[0])


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=WORKER_MODES)
async def node(request, bundle) -> AsyncIterator[DuplexServer]:  # noqa: F811
    async with running_server(bundle, workers=request.param, max_sessions=2, **rtc_settings()) as server:
        yield server


@pytest_asyncio.fixture(loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def url(server: DuplexServer) -> str:
    return f"http://127.0.0.1:{server.port}"


async def all_free(server: DuplexServer) -> None:
    """Every session gone and every slot free (the slot is freed at the next tick)."""
    await wait_until(
        lambda: not server.sessions and server.backend.status().free_slots == server.backend.status().slots,
        timeout_s=WAIT_S,
        what="every session gone and every slot free",
    )


async def raw_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str, path: str
) -> tuple[int, dict[str, str], str]:
    """One HTTP/1.1 request on a kept-alive connection: (status, headers, body)."""
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\n\r\n".encode())
    await writer.drain()
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    lines = head.split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    length = int(headers.get("Content-Length", "0"))
    body = (await reader.readexactly(length)).decode()
    return int(lines[0].split()[1]), headers, body


async def delete_from_another_worker(server: DuplexServer, location: str, owner: str) -> int:
    """DELETE ``location`` over a connection the kernel gave to a worker other than ``owner`` (the
    ``Server`` header names the worker; ``SO_REUSEPORT`` picks one per connection)."""
    for _ in range(200):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            _, headers, _ = await raw_request(reader, writer, "GET", "/healthz")
            if headers["Server"].split()[1] != owner:
                status, _, _ = await raw_request(reader, writer, "DELETE", location)
                return status
        finally:
            writer.close()
    raise AssertionError("no connection reached another worker in 200 tries")


async def test_a_call_gets_its_answer_audio_text_and_ends_with_delete(node, http, packets) -> None:
    value = token()
    call = RtcCall(url(node), packets, token=value, query="seed=7")
    outcome = await call.start(http)
    assert outcome.status == 201, outcome.body
    location = outcome.headers["Location"][0]
    candidates = re.findall(r"(?m)^a=candidate:.* typ (\w+)", outcome.answer_sdp)
    assert candidates and set(candidates) == {"host"}  # no STUN server asked (aiortc's default is Google's)
    assert "opus/48000/2" in outcome.answer_sdp and "PCMU" not in outcome.answer_sdp
    assert re.fullmatch(r"/api/rtc/[0-9a-f]{32}/[A-Za-z0-9_-]{24}", location)
    links = outcome.headers["Link"]
    assert '<stun:turn.example.com:3478>; rel="ice-server"' in links
    turn = next(link for link in links if link.startswith("<turn:"))
    username = re.search(r'username="([^"]+)"', turn)[1]  # type: ignore[index]
    credential = re.search(r'credential="([^"]+)"', turn)[1]  # type: ignore[index]
    expected = base64.b64encode(hmac.new(TURN_SECRET.encode(), username.encode(), hashlib.sha1).digest())
    # Minted under the token's id, its expiry fixed by the token: one username, one coturn quota, per token
    # (issue 34, item 2: a fresh session id per answered offer gave each unconnected offer its own quota).
    claims = jwt.decode(value, options={"verify_signature": False})
    assert credential == expected.decode() and username == f"{claims['exp'] + 3600}:{claims['jti']}"
    try:
        await asyncio.wait_for(call.handshake.wait(), WAIT_S)
        await asyncio.wait_for(call.audio_arrived.wait(), WAIT_S)
        await wait_until(lambda: len(call.outcome.texts) >= 2, timeout_s=WAIT_S, what="text on the channel")
        call.send(encode_ping(b"rt"))
        call.send(encode_metadata({"note": "ignored"}))
        await wait_until(lambda: call.outcome.pongs == 1, timeout_s=WAIT_S, what="the ping's echo")
        assert call.outcome.errors == []
        assert outcome.connected_s is not None and outcome.answer_s is not None
        if isinstance(node, DuplexServer):
            status = await call.hang_up(http)
        else:  # --workers 2: the DELETE reaches the worker that does not hold the session
            owner = outcome.headers["Server"][0].split()[1]
            status = await delete_from_another_worker(node, location, owner)
        assert status == 200
        await all_free(node)
        assert await call.hang_up(http) == 404  # gone
    finally:
        await call.close()
    await all_free(node)
    metrics = node.metrics
    await wait_until(
        lambda: metrics.rtp_packets.labels(outcome="received")._value.get() > 0,
        timeout_s=WAIT_S,
        what="the RTP packets counted",
    )
    scraped = await scrape(node)
    assert scraped.value("duplex_transport_sessions_started_total", transport="webrtc") >= 1
    assert scraped.value("duplex_transport_sessions_active", transport="webrtc") == 0
    assert scraped.value("duplex_rtc_connect_seconds_count") >= 1
    assert scraped.value("duplex_rtc_answer_seconds_count") >= 1
    assert scraped.value("duplex_rtp_jitter_buffer_depth_packets_count") > 0
    assert scraped.value("duplex_rtp_packets_total", outcome="received") > 0


async def test_ice_servers_before_the_offer_check_the_token_and_spend_nothing(node, http, packets) -> None:
    value = token()
    async with http.get(url(node) + rtc.ICE_SERVERS_PATH) as response:
        assert response.status == 401
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    headers = {"Authorization": f"Bearer {value}"}
    async with http.get(url(node) + rtc.ICE_SERVERS_PATH, headers=headers) as response:
        assert response.status == 200
        body = await response.json()
        assert len(response.headers.getall("Link")) == 2
    stun, turn = body["iceServers"]
    assert stun == {"urls": [TURN_URLS[1]]}
    assert turn["urls"] == [TURN_URLS[0]] and turn["username"].count(":") == 1 and turn["credential"]
    # the same token then opens a session: it was checked, not spent; its TURN credentials are the same
    # coturn user (issue 34: coturn's user-quota caps a token's allocations, not each answer's)
    call = RtcCall(url(node), packets, token=value)
    try:
        answered = await call.start(http)
        assert answered.status == 201
        link = next(link for link in answered.headers["Link"] if link.startswith("<turn:"))
        assert f'username="{turn["username"]}"' in link  # the same TURN username as before the offer
        await asyncio.wait_for(call.audio_arrived.wait(), WAIT_S)
    finally:
        await call.close()
    await all_free(node)


def _without_audio(sdp: str) -> str:
    """The offer with its audio m-section cut out (a DataChannel-only offer)."""
    head, *sections = re.split(r"(?m)^(?=m=)", sdp)
    kept = [s for s in sections if not s.startswith("m=audio")]
    return head.replace("a=group:BUNDLE 0 1", "a=group:BUNDLE 1") + "".join(kept)


@pytest.mark.parametrize("workers", [0])
async def test_refusals_before_the_answer_take_no_slot_and_spend_no_token(
    bundle,  # noqa: F811
    http,
    packets,
    workers,
) -> None:
    async with running_server(bundle, workers=workers, max_sessions=1, **rtc_settings()) as server:
        value = token()
        base = url(server)
        plain = {"Content-Type": "application/sdp", "Authorization": f"Bearer {value}"}

        async def post(body: bytes, headers: dict[str, str], query: str = "") -> tuple[int, str, dict]:
            async with http.post(f"{base}/api/rtc{query}", data=body, headers=headers) as response:
                return response.status, await response.text(), dict(response.headers)

        for bad in (b"v=0\r\nm=audio x UDP/TLS/RTP/SAVPF 111\r\n", b"v=0\r\nm=audio 9 RTP/SAVPF 111\r\n"):
            status, text, _ = await post(bad, plain)
            assert status == 400 and "malformed SDP offer" in text, text
        status, text, _ = await post(b"v=0\r\nthis is not sdp\r\n", plain)
        assert status == 400 and "no m-line" in text
        offer_call = RtcCall(base, packets)
        good_sdp = await offer_call.offer()
        await offer_call.close()
        status, text, _ = await post(_without_audio(good_sdp).encode(), plain)
        assert status == 400 and "no audio m-line" in text
        # Issue 34, item 11: a BUNDLE naming a mid the offer lacks was answered 500 after a slot and a record
        # were taken; an offer without a DTLS fingerprint held its slot until the connect timeout.
        broken = {
            "BUNDLE": good_sdp.replace("a=group:BUNDLE 0 1", "a=group:BUNDLE 0 7"),
            "fingerprint": re.sub(r"(?m)^a=fingerprint:.*\r?\n", "", good_sdp),
        }
        for needle, sdp in broken.items():
            assert sdp != good_sdp, needle
            status, text, _ = await post(sdp.encode(), plain)
            assert status == 400 and needle in text, (needle, status, text)
        status, text, _ = await post(good_sdp.encode(), {**plain, "Content-Type": "text/plain"})
        assert status == 415 and "application/sdp" in text
        status, text, _ = await post(b"v=0\r\n" + b"a=x\r\n" * 20_000, plain)
        assert status == 413 and str(rtc.MAX_OFFER_BYTES) in text
        status, text, _ = await post(good_sdp.encode(), plain, "?seed=-3")
        assert status == 400 and "seed" in text
        status, text, headers = await post(good_sdp.encode(), {"Content-Type": "application/sdp"})
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        status, text, _ = await post(good_sdp.encode(), {**plain, "Origin": "https://evil.example.com"})
        assert status == 403 and "origin" in text
        assert not server.sessions and server.backend.status().free_slots == 1
        # the node full: 503 with Retry-After, before any answer
        holder = RtcCall(base, packets, token=token())
        try:
            assert (await holder.start(http)).status == 201
            status, text, headers = await post(good_sdp.encode(), plain)
            assert status == 503 and text.startswith("node_full") and headers["Retry-After"] == "5"
            # Issue 33: the WebRTC call counts in the load the node reports although its POST returned,
            # and the full node stays ready (serving).
            assert headers["endpoint-load-metrics"] == "TEXT named_metrics.slot_utilization=1"
            async with http.get(f"{base}/readyz") as ready:
                assert ready.status == 200
            async with http.get(f"{base}/slotz") as slotz:
                assert slotz.status == 503 and (await slotz.json())["in_use"] == 1
        finally:
            await holder.close()
        await all_free(server)
        # every refusal above left the token unspent: it opens a session now, once
        call = RtcCall(base, packets, token=value)
        try:
            assert (await call.start(http)).status == 201
            await asyncio.wait_for(call.audio_arrived.wait(), WAIT_S)
        finally:
            await call.close()
        await all_free(server)
        again = RtcCall(base, packets, token=value)
        outcome = await again.start(http)
        assert outcome.status == 403 and "already used" in outcome.body


async def test_an_offer_flood_is_rate_limited_and_harms_nothing(bundle, http, packets) -> None:  # noqa: F811
    settings = rtc_settings(handshake_rate_per_client=1.0, handshake_burst_per_client=5)
    async with running_server(bundle, max_sessions=1, **settings) as server:
        headers = {"Content-Type": "application/sdp", "Authorization": f"Bearer {token()}"}

        async def post() -> tuple[int, str | None]:
            async with http.post(url(server) + "/api/rtc", data=b"v=0\r\n", headers=headers) as response:
                return response.status, response.headers.get("Retry-After")

        answers = await asyncio.gather(*(post() for _ in range(100)))
        limited = [retry for status, retry in answers if status == 429]
        assert len(limited) >= 90 and all(retry is not None and int(retry) >= 1 for retry in limited)
        assert {status for status, _ in answers} <= {400, 429}
        assert not server.sessions and server.backend.status().free_slots == 1


async def test_datachannel_floods_and_oversized_messages_get_errors_and_the_call_goes_on(
    bundle,  # noqa: F811
    http,
    packets,
) -> None:
    async with running_server(bundle, max_sessions=1, **rtc_settings(max_message_bytes=2048)) as server:
        call = RtcCall(url(server), packets, token=token())
        try:
            assert (await call.start(http)).status == 201
            await asyncio.wait_for(call.handshake.wait(), WAIT_S)
            call.send(encode_ping(b"x" * 4096))  # over max_message_bytes
            await wait_until(lambda: any("oversized" in e for e in call.outcome.errors), timeout_s=WAIT_S)
            call.send(b"\x01" + b"\x00" * 10)  # audio on the channel
            await wait_until(
                lambda: any("audio_on_datachannel" in e for e in call.outcome.errors), timeout_s=WAIT_S
            )
            for _ in range(500):
                call.send(encode_ping(b"f"))
            await wait_until(lambda: any("too_fast" in e for e in call.outcome.errors), timeout_s=WAIT_S)
            assert call.outcome.pongs <= 150  # the burst (100) and what the rate refilled meanwhile
            before = call.outcome.packets_in
            await wait_until(
                lambda: call.outcome.packets_in > before + 20, timeout_s=WAIT_S, what="audio goes on"
            )
            assert len(server.sessions) == 1
        finally:
            await call.close()
        await all_free(server)


async def test_the_slot_is_freed_when_the_peer_vanishes(node, http, packets) -> None:
    ended = node.metrics.sessions_ended

    def count(reason: str) -> float:
        return ended.labels(reason=reason)._value.get()

    # the peer closes (DTLS close_notify): freed at once
    before = count("client_closed")
    call = RtcCall(url(node), packets, token=token())
    assert (await call.start(http)).status == 201
    await asyncio.wait_for(call.audio_arrived.wait(), WAIT_S)
    await call.close()
    await all_free(node)
    assert count("client_closed") == before + 1
    # the peer stops sending (a lost network): freed after rtc_media_timeout_s
    before = count("rtc_media_timeout")
    call = RtcCall(url(node), packets, token=token(), loop=False)
    call.track.packets = call.track.packets[:10]
    try:
        assert (await call.start(http)).status == 201
        await asyncio.wait_for(call.connected.wait(), WAIT_S)
        await all_free(node)
        assert count("rtc_media_timeout") == before + 1
    finally:
        await call.close()
    # ICE never connects (the answer is never applied): freed after rtc_connect_timeout_s
    before = count("rtc_connect_timeout")
    call = RtcCall(url(node), packets, token=token(), answer_filter=lambda sdp: sdp)
    call.pc.setRemoteDescription = _never  # type: ignore[method-assign]
    try:
        assert (await call.start(http)).status == 201
        await all_free(node)
        assert count("rtc_connect_timeout") == before + 1
    finally:
        await call.close()


async def _never(*_: object) -> None:
    return None


async def test_link_headers_quote_their_values() -> None:
    from runtime.frontend.transports.webrtc.turn import IceServer

    links = rtc.link_headers([IceServer(("turn:a:3478",), 'u"x', "p\\w")])
    assert links == [
        '<turn:a:3478>; rel="ice-server"; username="u\\"x"; credential="p\\\\w"; credential-type="password"'
    ]
    assert AUDIENCE and KEY and ORIGIN  # the access test's settings, shared


async def test_closing_the_server_ends_its_live_calls(bundle, http, packets) -> None:  # noqa: F811
    async with running_server(bundle, max_sessions=1, **rtc_settings()) as server:
        call = RtcCall(url(server), packets, token=token())
        assert (await call.start(http)).status == 201
        await asyncio.wait_for(call.audio_arrived.wait(), WAIT_S)
    try:  # the server's DTLS close reaches the client
        await wait_until(
            lambda: call.pc.connectionState == "closed", timeout_s=WAIT_S, what="the call closed"
        )
        assert server.metrics.sessions_ended.labels(reason="server_closed")._value.get() == 1
    finally:
        await call.close()


async def test_the_load_generator_drives_webrtc_sessions_over_several_processes(node, speech, caplog) -> None:  # noqa: F811
    from runtime.tools.loadgen_rtc import run_rtc_load

    caplog.set_level(logging.INFO, logger="runtime.frontend.transports.webrtc")
    clip = speech[1][: 24_000 * 2]
    report = await run_rtc_load(
        f"ws://127.0.0.1:{node.port}", [clip], sessions=2, processes=2, token=token, max_duration_s=WAIT_S * 2
    )
    assert report.ok, report.failures()
    summary = report.summary()
    assert summary["served"] == 2 and summary["frames_sent"] >= 2 * 24
    assert summary["ice_connect_ms_p50"] is not None and summary["answer_ms_p99"] is not None
    assert summary["concealed_packets"] is not None and summary["frames_received"] > 0
    assert summary["bytes_received"] > 0 and summary["bytes_sent"] > 0
    await all_free(node)
    traces = {
        m.group(1): json.loads(m.group(2))
        for m in (
            re.search(r"WebRTC session (\w+) first audio: (\{.*\})", r.getMessage()) for r in caplog.records
        )
        if m
    }
    for row in report.session_rows():
        client = row["stamps"]
        assert isinstance(client, dict) and isinstance(row["first_audio_ms"], float)
        # The clock starts at the 4th packet: the one that completes the node's first frame (sent >= 60 ms
        # after the first: the replay sleeps until each packet's time).
        assert row["first_audio_first_packet_ms"] >= row["first_audio_ms"] + 59.9  # type: ignore[operator]
        assert client["handshake"] <= client["packet0"] < client["packet3"] < client["first_audio"]
        # The node's view of the same session, on the same monotonic clock: it took the client's first
        # packet (nothing was sent before the 0x00) and completed its frame with the client's 4th.
        node_side = traces[str(row["session_id"])]
        order = [
            "connected_at", "spent_at", "handshake_at", "first_rtp_at", "taken_arrived_at",
            "frame_arrived_at", "frame_at", "audio_put_at", "audio_sent_at",
        ]  # fmt: skip
        stamps = [node_side[name] for name in order]
        assert stamps == sorted(stamps), node_side
        assert node_side["first_rtp_at"] == node_side["taken_arrived_at"]
        assert (
            node_side["handshake_at"] < client["handshake"] <= client["packet0"] <= node_side["first_rtp_at"]
        )
        assert client["packet3"] <= node_side["frame_arrived_at"]
        assert node_side["audio_sent_at"] <= client["first_audio"]


async def test_a_drain_tells_the_call_on_its_channel_and_ends_it(bundle, http, packets) -> None:  # noqa: F811
    async with running_server(bundle, max_sessions=1, **rtc_settings()) as server:
        call = RtcCall(url(server), packets, token=token())
        try:
            assert (await call.start(http)).status == 201
            await asyncio.wait_for(call.handshake.wait(), WAIT_S)
            async with http.post(url(server) + "/api/rtc", data=b"v=0\r\n") as response:
                assert response.status in (400, 401)  # before the drain: refused for its own reasons
            await server.drain(grace_s=0)
            await wait_until(lambda: "server draining" in call.outcome.errors, timeout_s=WAIT_S, what="0x05")
            await wait_until(lambda: call.pc.connectionState == "closed", timeout_s=WAIT_S, what="closed")
            assert server.metrics.sessions_ended.labels(reason="drained")._value.get() == 1
        finally:
            await call.close()
