"""A WebRTC offer cannot aim the node's UDP nor hold a slot it cannot use (issue 34, items 3 and 11):
the caller's ICE candidates filtered before ``setRemoteDescription``
(``runtime.frontend.transports.webrtc.candidates``), the offer's mids, BUNDLE group, fingerprints and ICE
credentials checked (``offer_checks``), a token's TURN credentials one coturn user (``turn``); pure unit
tests on SDP text, and the real aiortc peer's remote candidates after ``RtcPeer.accept_offer``."""

from __future__ import annotations

import re
from types import SimpleNamespace

import aiohttp
import pytest
from aiortc import RTCPeerConnection
from test_access_control import ORIGIN, token
from test_rtc import rtc_settings
from test_server_e2e import bundle, running_server  # noqa: F401  (fixtures)

from runtime.config import RuntimeConfig
from runtime.frontend.transports.webrtc.candidates import (
    MAX_CANDIDATES,
    CandidatePolicy,
    candidate_refusal,
    filter_offer_candidates,
)
from runtime.frontend.transports.webrtc.offer_checks import OfferInvalid, check_offer
from runtime.frontend.transports.webrtc.peer import OfferRejected, RtcPeer
from runtime.metrics import RuntimeMetrics

FINGERPRINT = "sha-256 " + ":".join(["AB"] * 32)
UFRAG = "Abcd"
PWD = "p" * 24


def offer(candidates: list[str], *, extra_session: str = "", audio: str = "", application: str = "") -> str:
    """A browser-shaped offer (audio and a DataChannel, bundled) with ``candidates`` on its audio m-line."""
    lines = [
        "v=0",
        "o=- 1 1 IN IP4 0.0.0.0",
        "s=-",
        "t=0 0",
        "a=group:BUNDLE 0 1",
        "a=msid-semantic:WMS *",
        *([extra_session] if extra_session else []),
        "m=audio 9 UDP/TLS/RTP/SAVPF 111",
        "c=IN IP4 0.0.0.0",
        "a=rtcp-mux",
        "a=mid:0",
        "a=sendrecv",
        "a=rtpmap:111 opus/48000/2",
        f"a=ice-ufrag:{UFRAG}",
        f"a=ice-pwd:{PWD}",
        f"a=fingerprint:{FINGERPRINT}",
        "a=setup:actpass",
        *candidates,
        "a=end-of-candidates",
        *([audio] if audio else []),
        "m=application 9 UDP/DTLS/SCTP webrtc-datachannel",
        "c=IN IP4 0.0.0.0",
        "a=mid:1",
        "a=sctp-port:5000",
        f"a=ice-ufrag:{UFRAG}",
        f"a=ice-pwd:{PWD}",
        f"a=fingerprint:{FINGERPRINT}",
        "a=setup:actpass",
        *([application] if application else []),
    ]
    return "\r\n".join(lines) + "\r\n"


def host(address: str, port: int = 50000, typ: str = "host", n: int = 1) -> str:
    return f"a=candidate:{n} 1 udp 2130706431 {address} {port} typ {typ}"


def kept(sdp: str) -> list[str]:
    return re.findall(r"(?m)^a=candidate:\S+ \d+ \S+ \d+ (\S+) ", sdp)


# --- candidates -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("169.254.169.254", "link_local"),
        ("fe80::1", "link_local"),
        ("224.0.0.251", "multicast"),
        ("ff02::fb", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("10.1.2.3", "not_global"),
        ("172.16.0.9", "not_global"),
        ("192.168.1.1", "not_global"),
        ("100.64.0.1", "not_global"),
        ("fd00::1", "not_global"),
        ("abcd-1234.local", "mdns"),
        ("metadata.google.internal", "name"),
        ("8.8.8.8", None),
        ("2001:4860:4860::8888", None),
    ],
)
def test_candidate_addresses_are_judged_by_kind(address: str, reason: str | None) -> None:
    assert candidate_refusal(address, "3478", "udp", "host", CandidatePolicy()) == reason


def test_ports_transports_and_allowed_nets() -> None:
    policy = CandidatePolicy.of(["10.0.0.0/8", "127.0.0.1"])
    assert candidate_refusal("10.9.9.9", "50000", "udp", "host", policy) is None
    assert candidate_refusal("127.0.0.1", "50000", "udp", "host", policy) is None
    assert candidate_refusal("127.0.0.2", "50000", "udp", "host", policy) == "loopback"
    assert candidate_refusal("8.8.8.8", "0", "udp", "host", policy) == "port"
    assert candidate_refusal("8.8.8.8", "70000", "udp", "host", policy) == "port"
    assert candidate_refusal("8.8.8.8", "9", "tcp", "host", policy) == "transport"
    with pytest.raises(ValueError, match="'ten' is not an address or CIDR"):
        CandidatePolicy.of(["ten"])


def test_an_offer_aimed_at_the_node_keeps_only_public_candidates() -> None:
    aimed = [
        host("169.254.169.254", 53, n=1),
        host("169.254.169.254", 80, n=2),
        host("10.0.0.7", n=3),
        host("192.168.0.1", n=4),
        host("127.0.0.1", 6379, n=5),
        host("e3b0c442-98fc-1c14.local", n=6),
        host("203.0.113.9", n=7),  # TEST-NET-3: not global
        host("8.8.4.4", 40000, "srflx", n=8),
    ]
    sdp = offer(aimed)
    filtered = filter_offer_candidates(sdp, CandidatePolicy())
    assert kept(filtered.sdp) == ["8.8.4.4"] and filtered.kept == 1
    assert [d.reason for d in filtered.dropped] == [
        "link_local",
        "link_local",
        "not_global",
        "not_global",
        "loopback",
        "mdns",
        "not_global",
    ]
    # every other line is untouched, line endings included
    others = [line for line in sdp.split("\r\n") if not line.startswith("a=candidate:")]
    assert [line for line in filtered.sdp.split("\r\n") if not line.startswith("a=candidate:")] == others


def test_at_most_sixteen_candidates_are_kept() -> None:
    flood = [host("8.8.8.8", 1000 + i, n=i) for i in range(254)]
    filtered = filter_offer_candidates(offer(flood), CandidatePolicy())
    assert filtered.kept == MAX_CANDIDATES == len(kept(filtered.sdp)) == 16
    assert {d.reason for d in filtered.dropped} == {"over_limit"} and len(filtered.dropped) == 238


def test_relay_only_keeps_the_nodes_relay_candidates() -> None:
    policy = CandidatePolicy.of(relay=["172.31.254.128/25"], relay_only=True)
    sdp = offer(
        [
            host("8.8.8.8", n=1),
            host("172.31.254.200", 61000, "relay", n=2),
            host("172.31.254.10", 61001, "host", n=3),  # the runtime's own address, claimed as host
            host("9.9.9.9", 61002, "relay", n=4),  # someone else's relay
        ]
    )
    filtered = filter_offer_candidates(sdp, policy)
    assert kept(filtered.sdp) == ["172.31.254.200"]
    assert {d.reason for d in filtered.dropped} == {"relay_only"}
    # not relay-only: the relay's private address is kept for relay candidates (a Compose node's coturn)
    mixed = filter_offer_candidates(sdp, CandidatePolicy.of(relay=["172.31.254.128/25"]))
    assert kept(mixed.sdp) == ["8.8.8.8", "172.31.254.200", "9.9.9.9"]
    with pytest.raises(ValueError, match="relay_only needs"):
        CandidatePolicy.of(relay_only=True)


def test_malformed_candidate_lines_are_dropped() -> None:
    filtered = filter_offer_candidates(
        offer(["a=candidate:1 1 udp 1 8.8.8.8", "a=candidate:x"]), CandidatePolicy()
    )
    assert filtered.kept == 0 and [d.reason for d in filtered.dropped] == ["malformed", "malformed"]


def test_the_config_reads_the_nets_and_refuses_relay_only_without_the_relay() -> None:
    config = RuntimeConfig(
        rtc_allowed_candidate_nets="10.0.0.0/8, 127.0.0.1", rtc_relay_nets="172.31.254.0/24"
    )
    policy = CandidatePolicy.from_config(config)
    assert [str(n) for n in policy.allowed_nets] == ["10.0.0.0/8", "127.0.0.1/32"] and not policy.relay_only
    with pytest.raises(ValueError, match="DUPLEX_RTC_RELAY_NETS"):
        RuntimeConfig(rtc_relay_only=True)
    with pytest.raises(ValueError, match="'10.0.0.0/33' is not an address or CIDR"):
        RuntimeConfig(rtc_allowed_candidate_nets="10.0.0.0/33")


# --- offer checks -----------------------------------------------------------------------------------------


async def test_an_aiortc_offer_passes_the_checks() -> None:
    pc = RTCPeerConnection()
    try:
        pc.addTransceiver("audio", direction="sendrecv")
        pc.createDataChannel("chat")
        await pc.setLocalDescription(await pc.createOffer())
        check_offer(pc.localDescription.sdp)
    finally:
        await pc.close()
    check_offer(offer([host("8.8.8.8")]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.replace("a=group:BUNDLE 0 1", "a=group:BUNDLE 0 2"), "a=group:BUNDLE names 0 2"),
        (lambda s: s.replace("a=group:BUNDLE 0 1", "a=group:BUNDLE 0"), "a=group:BUNDLE names 0 but"),
        (lambda s: s.replace("a=group:BUNDLE 0 1\r\n", ""), "0 a=group:BUNDLE lines"),
        (lambda s: s.replace("a=mid:1", "a=mid:0"), "m-lines share a=mid:0"),
        (lambda s: s.replace("a=mid:1\r\n", ""), "m-line 1 (m=application"),
        (lambda s: s.replace(f"a=fingerprint:{FINGERPRINT}\r\n", ""), "has no a=fingerprint"),
        (lambda s: s.replace("sha-256", "sha-1"), "a=fingerprint uses 'sha-1'"),
        (lambda s: s.replace("sha-256 AB", "sha-256 ZZ"), "is not '<hash> <hex bytes"),
        (lambda s: s.replace(f"a=ice-ufrag:{UFRAG}\r\n", ""), "0 a=ice-ufrag lines"),
        (lambda s: s.replace(f"a=ice-pwd:{PWD}", "a=ice-pwd:short"), "a=ice-pwd must be 22-256"),
        (lambda s: s.replace(f"a=ice-ufrag:{UFRAG}", "a=ice-ufrag:a b!"), "a=ice-ufrag must be 4-256"),
        (lambda s: s.split("m=audio")[0], "no m-line"),
    ],
)
def test_offers_that_cannot_connect_are_named(change, message: str) -> None:  # noqa: ANN001
    with pytest.raises(OfferInvalid, match=re.escape(message)):
        check_offer(change(offer([host("8.8.8.8")])))


def test_session_level_fingerprint_and_credentials_serve_every_m_line() -> None:
    sdp = offer([host("8.8.8.8")], extra_session=f"a=fingerprint:{FINGERPRINT}")
    check_offer(sdp.replace(f"a=fingerprint:{FINGERPRINT}\r\na=setup", "a=setup"))


# --- through the real aiortc peer -------------------------------------------------------------------------


def _front(**settings: object) -> SimpleNamespace:
    return SimpleNamespace(config=RuntimeConfig(**settings), metrics=RuntimeMetrics())


async def _client_offer(extra: list[str]) -> str:
    pc = RTCPeerConnection()
    try:
        pc.addTransceiver("audio", direction="sendrecv")
        pc.createDataChannel("chat")
        await pc.setLocalDescription(await pc.createOffer())
        sdp = pc.localDescription.sdp
    finally:
        await pc.close()
    sdp = re.sub(r"(?m)^a=candidate:.*\r\n", "", sdp)
    return sdp.replace("a=end-of-candidates", "\r\n".join([*extra, "a=end-of-candidates"]), 1)


async def test_the_nodes_ice_agent_gets_none_of_the_aimed_candidates() -> None:
    aimed = [host("127.0.0.1", 6379, n=1), host("169.254.169.254", 80, n=2), host("8.8.8.8", 40000, n=3)]
    sdp = await _client_offer(aimed)
    peer = RtcPeer(_front(), 0.0)  # type: ignore[arg-type]
    try:
        await peer.accept_offer(sdp)
        transports = {t.receiver.transport.transport for t in peer.pc.getTransceivers()}
        remote = [c.ip for transport in transports for c in transport.getRemoteCandidates()]
        assert remote == ["8.8.8.8"]
    finally:
        await peer.close()
    allowed = RtcPeer(_front(rtc_allowed_candidate_nets="127.0.0.0/8"), 0.0)  # type: ignore[arg-type]
    try:
        await allowed.accept_offer(sdp)
        transports = {t.receiver.transport.transport for t in allowed.pc.getTransceivers()}
        assert sorted(c.ip for t in transports for c in t.getRemoteCandidates()) == ["127.0.0.1", "8.8.8.8"]
    finally:
        await allowed.close()


async def test_an_offer_without_a_fingerprint_is_rejected_by_the_peer() -> None:
    sdp = re.sub(r"(?m)^a=fingerprint:.*\r\n", "", await _client_offer([host("8.8.8.8")]))
    peer = RtcPeer(_front(), 0.0)  # type: ignore[arg-type]
    try:
        with pytest.raises(OfferRejected, match="no a=fingerprint"):
            await peer.accept_offer(sdp)
    finally:
        await peer.close()


# --- through the server -----------------------------------------------------------------------------------


@pytest.mark.asyncio(loop_scope="module")
async def test_bad_offers_get_a_400_before_any_slot_and_delete_is_rate_limited(bundle) -> None:  # noqa: F811
    settings = rtc_settings(handshake_rate_per_client=0.01, handshake_burst_per_client=4)
    async with running_server(bundle, max_sessions=1, **settings) as server, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        good = await _client_offer([host("8.8.8.8")])
        headers = {"Content-Type": "application/sdp", "Authorization": f"Bearer {token()}", "Origin": ORIGIN}
        for sdp, named in (
            (good.replace("a=group:BUNDLE 0 1", "a=group:BUNDLE 0 2"), "a=group:BUNDLE names 0 2"),
            (re.sub(r"(?m)^a=fingerprint:.*\r\n", "", good), "has no a=fingerprint"),
        ):
            async with http.post(base + "/api/rtc", data=sdp.encode(), headers=headers) as response:
                text = await response.text()
                assert response.status == 400 and named in text, text
        assert not server.sessions and server.backend.status().free_slots == 1
        statuses = []
        for _ in range(6):  # 2 of the burst of 4 left after the POSTs
            async with http.delete(f"{base}/api/rtc/{'0' * 32}/{'k' * 24}") as response:
                statuses.append((response.status, response.headers.get("Retry-After")))
        assert [s for s, _ in statuses] == [404, 404, 429, 429, 429, 429]
        assert all(retry is not None and int(retry) >= 1 for s, retry in statuses if s == 429)
