"""Issue 34, item 3: a caller's ICE candidates aimed the node's UDP anywhere (the metadata server, the node's
own loopback, its VPC, ``.local`` names, 254 candidates at one address). The offer's candidates are filtered
before the node's ICE agent sees them (``runtime.frontend.transports.webrtc.candidates``)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from aiortc import RTCPeerConnection

from runtime.config import RuntimeConfig
from runtime.frontend.transports.webrtc.candidates import MAX_CANDIDATES, CandidateFilter, filter_offer
from runtime.frontend.transports.webrtc.peer import RtcPeer
from runtime.metrics import RuntimeMetrics

CLOUD = CandidateFilter.from_cidrs([])  # a cloud node: public addresses only
LAN = CandidateFilter.from_cidrs(["192.168.0.0/16"])


def _candidate(address: str, port: int = 50000, kind: str = "host", n: int = 1) -> str:
    return f"a=candidate:{n} 1 udp 2122260223 {address} {port} typ {kind}\r\n"


def _offer(*candidates: str) -> str:
    return (
        "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\n"
        "c=IN IP4 0.0.0.0\r\na=rtpmap:111 opus/48000/2\r\n" + "".join(candidates) + "a=end-of-candidates\r\n"
    )


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("169.254.169.254", "link_local"),  # the cloud metadata server
        ("fe80::1", "link_local"),
        ("224.0.0.251", "multicast"),  # mDNS's group
        ("0.0.0.0", "unspecified"),
        ("0c5f4c1e-3c4b-4a51-9a2e-2b1f0f6c1a11.local", "not_an_address"),  # a browser's mDNS name
        ("metadata.google.internal", "not_an_address"),
        ("127.0.0.1", "not_allowed"),  # the node's own loopback
        ("10.128.0.7", "not_allowed"),  # the node's VPC
        ("192.168.1.20", "not_allowed"),
        ("100.64.0.1", "not_allowed"),  # carrier-grade NAT
    ],
)
def test_a_cloud_node_drops_every_candidate_that_is_not_public(address: str, reason: str) -> None:
    result = filter_offer(_offer(_candidate(address), _candidate("34.120.0.9", kind="srflx")), CLOUD)
    assert result.dropped == [(address, reason)]
    assert result.kept == 1 and "34.120.0.9" in result.sdp and _candidate(address) not in result.sdp


def test_a_lan_node_keeps_its_lans_candidates_and_still_drops_the_metadata_server() -> None:
    sdp = _offer(_candidate("192.168.1.20"), _candidate("169.254.169.254"), _candidate("10.0.0.1"))
    result = filter_offer(sdp, LAN)
    assert result.kept == 1 and "192.168.1.20" in result.sdp
    assert result.dropped == [("169.254.169.254", "link_local"), ("10.0.0.1", "not_allowed")]


def test_at_most_sixteen_candidates_are_kept() -> None:
    many = [_candidate("35.186.0.7", port=1000 + i, n=i) for i in range(254)]
    result = filter_offer(_offer(*many), CLOUD)
    assert result.kept == MAX_CANDIDATES
    assert len(result.dropped) == 254 - MAX_CANDIDATES and {r for _, r in result.dropped} == {"too_many"}


def test_everything_but_the_dropped_lines_is_kept_byte_for_byte() -> None:
    sdp = _offer(_candidate("35.186.0.7"), _candidate("127.0.0.1"))
    assert filter_offer(sdp, CLOUD).sdp == sdp.replace(_candidate("127.0.0.1"), "")
    assert filter_offer(sdp, CandidateFilter.from_cidrs(["0.0.0.0/0", "::/0"])).sdp == sdp
    with pytest.raises(ValueError, match="not a CIDR"):
        CandidateFilter.from_cidrs(["10.0.0.0/33"])


def test_the_nodes_ice_agent_never_gets_the_dropped_candidates() -> None:
    """Through aiortc: the offer of a real peer connection, with candidates at the metadata server and the
    node's loopback added; after ``RtcPeer.accept_offer`` the node's ICE agent holds the public one only."""

    async def scenario() -> list[str]:
        caller = RTCPeerConnection()
        caller.addTransceiver("audio", direction="sendrecv")
        caller.createDataChannel("duplex")
        await caller.setLocalDescription(await caller.createOffer())
        lines = caller.localDescription.sdp.replace("\r\n", "\n").split("\n")
        audio = next(i for i, line in enumerate(lines) if line.startswith("m=audio"))
        forged = [
            line.strip()
            for line in (
                _candidate("169.254.169.254", 53, n=91),
                _candidate("127.0.0.1", 6379, n=92),
                _candidate("35.186.0.7", 40000, n=93),
            )
        ]
        kept = [line for line in lines if not line.startswith("a=candidate:")]  # the caller's own: private
        kept[audio + 1 : audio + 1] = forged
        config = RuntimeConfig(host="127.0.0.1", port=0, node_id="n", rtc_candidate_nets="")  # type: ignore[arg-type]
        front = SimpleNamespace(config=config, metrics=RuntimeMetrics())
        peer = RtcPeer(front, time.monotonic())  # type: ignore[arg-type]
        try:
            await peer.accept_offer("\r\n".join(kept))
            (transceiver,) = [t for t in peer.pc.getTransceivers() if t.kind == "audio"]
            connection = transceiver.receiver.transport.transport._connection  # aioice's Connection
            return sorted(c.host for c in connection.remote_candidates)
        finally:
            await peer.close()
            await caller.close()

    assert asyncio.run(scenario()) == ["35.186.0.7"]
