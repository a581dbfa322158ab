"""A WebRTC caller of ``/api/rtc`` on aiortc: the load generator's ``--transport webrtc`` and the tests'
client.

It does what a browser does: one sendrecv Opus audio track and one DataChannel in the offer, non-trickle ICE
(every candidate in the offer), ``POST /api/rtc`` with the offer and ``Authorization: Bearer <token>``, the
answer from the ``201``, and ``DELETE`` of the ``Location`` to hang up. Its audio is pre-encoded Opus
replayed at 20 ms a packet (:class:`PacketReplayTrack`: no encoder runs per session); what comes back is
counted as RTP packets (no decoder runs either), and the DataChannel's messages are kept by kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import av
import numpy as np
from aioice.ice import get_host_addresses
from aiortc import (
    RTCConfiguration,
    RTCIceServer,
    RTCIceTransportPolicy,
    RTCPeerConnection,
    RTCSessionDescription,
)
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from runtime.engine.model_presets import FRAME_SAMPLES
from runtime.frontend.codecs.opus_rtp import OpusEncoder
from runtime.frontend.codecs.protocol import MessageKind
from runtime.frontend.gate.query import RESUME_HEADER

__all__ = ["PacketReplayTrack", "RtcCall", "RtcOutcome", "encode_packets", "local_candidate_nets"]

_TIME_BASE = fractions.Fraction(1, 48_000)
PACKET_S = 0.02


def encode_packets(pcm: np.ndarray, complexity: int = 5) -> list[bytes]:
    """24 kHz float32 mono ``pcm`` as 20 ms Opus packets (the tail padded with silence to a whole frame)."""
    frames = -(-len(pcm) // FRAME_SAMPLES)
    padded = np.zeros(frames * FRAME_SAMPLES, dtype=np.float32)
    padded[: len(pcm)] = pcm
    encoder = OpusEncoder(complexity)
    try:
        return [
            p
            for i in range(frames)
            for p in encoder.encode(padded[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES])
        ]
    finally:
        encoder.close()


SENT_AT_KEPT = 64
"""Packets whose send time :class:`PacketReplayTrack` keeps (the first: first audio counts from them)."""


class PacketReplayTrack(MediaStreamTrack):
    """Pre-encoded Opus packets sent 20 ms apart, looped (``loop``) or once; after them, ``after`` (one
    packet, e.g. 20 ms of silence) again and again when set, else nothing (a peer that went quiet).

    Attributes:
        sent: packets handed to the RTP sender.
        gate: when set to an event, nothing is sent until it is set (the load generator: the node's 0x00,
            before which the node drops audio, as a WebSocket client sends its first frame after the
            handshake); the first packet then goes at once.
        sent_at: monotonic time (s) each of the first :data:`SENT_AT_KEPT` packets was handed to the RTP
            sender (aiortc encrypts and sends it in the same step).
    """

    kind = "audio"

    def __init__(self, packets: Sequence[bytes], *, loop: bool = True) -> None:
        super().__init__()
        if not packets:
            raise ValueError("no packets to replay")
        self.packets = list(packets)
        self.loop = loop
        self.after: bytes | None = None
        self.sent = 0
        self.gate: asyncio.Event | None = None
        self.sent_at: list[float] = []
        self._start: float | None = None

    async def recv(self) -> av.Packet:  # type: ignore[override]
        if self.readyState != "live":
            raise MediaStreamError
        done = not self.loop and self.sent >= len(self.packets)
        if done and self.after is None:
            await asyncio.Event().wait()  # nothing more: wait until stopped (the sender cancels)
        if self.gate is not None:
            await self.gate.wait()
        now = time.monotonic()
        if self._start is None:
            self._start = now
        delay = self._start + self.sent * PACKET_S - now
        if delay > 0:
            await asyncio.sleep(delay)
        packet = av.Packet(self.after if done else self.packets[self.sent % len(self.packets)])
        packet.pts = self.sent * 960
        packet.time_base = _TIME_BASE
        self.sent += 1
        if len(self.sent_at) < SENT_AT_KEPT:
            self.sent_at.append(time.monotonic())
        return packet


@dataclass
class RtcOutcome:
    """What one call saw (monotonic seconds from the POST).

    Attributes:
        status: the POST's HTTP status; body: its body when not 201 (the refusal's sentence).
        headers: the POST's response headers (``Location``, ``Link``, ``Retry-After``).
        answer_s: POST -> answer received; connected_s: POST -> connectionState ``connected``.
        handshake_s: POST -> 0x00 on the DataChannel; first_audio_s: POST -> first RTP packet back.
        packets_in: RTP audio packets received; bytes_in: their payload bytes plus the DataChannel's
            message bytes (what ``/api/chat``'s generator counts as bytes received).
        texts: 0x02 pieces; errors: 0x05 sentences; pongs: 0x06.
        metadata: the 0x04 objects (``resumable=1``: session id and resume credential; docs/protocol.md).
        answer_sdp: the answer as received (201).
    """

    status: int = 0
    body: str = ""
    headers: dict[str, list[str]] = field(default_factory=dict)
    answer_s: float | None = None
    connected_s: float | None = None
    handshake_s: float | None = None
    first_audio_s: float | None = None
    packets_in: int = 0
    bytes_in: int = 0
    texts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    pongs: int = 0
    metadata: list[dict[str, Any]] = field(default_factory=list)
    answer_sdp: str = ""


class RtcCall:
    """One WebRTC call to ``base_url`` (``http://host:port``).

    Args:
        base_url: the node's HTTP(S) origin.
        packets: the Opus packets the call sends (:func:`encode_packets`).
        token: the session token (``Authorization: Bearer``), or None.
        query: the ``/api/chat``-style query string (persona, sampling), without ``?``.
        resume: a resume credential, presented in the ``Duplex-Resume-Credential`` header (never in the URL,
            which proxies log: issue 34); the call then carries no token.
        ice_servers: ``RTCIceServer`` dicts (``{"urls", "username", "credential"}``) for the offer.
        offer_filter: rewrites the offer's SDP before the POST (tests: drop candidates, break it).
        answer_filter: rewrites the answer's SDP before it is applied (tests: route through a relay).
        datachannel: offer a DataChannel (a browser client does).
        relay_only: gather relay candidates only (``iceTransportPolicy: "relay"``, as a firewalled browser):
            needs a TURN server in ``ice_servers``, else the offer has no candidate and ICE never connects.
        audio_after_handshake: send no audio until the node's 0x00 (:attr:`PacketReplayTrack.gate`).
    """

    def __init__(
        self,
        base_url: str,
        packets: Sequence[bytes],
        *,
        token: str | None = None,
        query: str = "",
        resume: str | None = None,
        ice_servers: Sequence[dict[str, Any]] = (),
        offer_filter: Callable[[str], str] | None = None,
        answer_filter: Callable[[str], str] | None = None,
        datachannel: bool = True,
        loop: bool = True,
        relay_only: bool = False,
        audio_after_handshake: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.query = query
        self.resume = resume
        self.offer_filter = offer_filter
        self.answer_filter = answer_filter
        servers = [
            RTCIceServer(urls=s["urls"], username=s.get("username"), credential=s.get("credential"))
            for s in ice_servers
        ]
        policy = RTCIceTransportPolicy.RELAY if relay_only else RTCIceTransportPolicy.ALL
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=servers, iceTransportPolicy=policy))
        self.track = PacketReplayTrack(packets, loop=loop)
        self.transceiver = self.pc.addTransceiver(self.track, direction="sendrecv")
        self.channel = self.pc.createDataChannel("duplex") if datachannel else None
        self.outcome = RtcOutcome()
        self.location: str | None = None
        self.audio_arrived = asyncio.Event()
        self.handshake = asyncio.Event()
        self.connected = asyncio.Event()
        self.got_metadata = asyncio.Event()
        if audio_after_handshake:
            self.track.gate = self.handshake
        self._t0 = 0.0
        self.transceiver.receiver._handle_rtp_packet = self._on_rtp  # type: ignore[method-assign]
        if self.channel is not None:
            self.channel.on("message", self._on_message)
        self.pc.on("connectionstatechange", self._on_state)

    @property
    def started_at(self) -> float:
        """Monotonic seconds of the POST (:class:`RtcOutcome`'s times count from it)."""
        return self._t0

    def _elapsed(self) -> float:
        return time.monotonic() - self._t0

    async def _on_rtp(self, packet: Any, arrival_time_ms: int) -> None:
        if not packet.payload:
            return
        self.outcome.packets_in += 1
        self.outcome.bytes_in += len(packet.payload)
        if self.outcome.first_audio_s is None:
            self.outcome.first_audio_s = self._elapsed()
            self.audio_arrived.set()

    def _on_message(self, data: bytes | str) -> None:
        self.outcome.bytes_in += len(data.encode() if isinstance(data, str) else data)
        if isinstance(data, str) or not data:
            return
        kind, payload = data[0], data[1:]
        if kind == MessageKind.HANDSHAKE:
            self.outcome.handshake_s = self._elapsed()
            self.handshake.set()
        elif kind == MessageKind.TEXT:
            self.outcome.texts.append(payload.decode("utf-8", "replace"))
        elif kind == MessageKind.ERROR:
            self.outcome.errors.append(payload.decode("utf-8", "replace"))
        elif kind == MessageKind.PING:
            self.outcome.pongs += 1
        elif kind == MessageKind.METADATA:
            with contextlib.suppress(ValueError):
                self.outcome.metadata.append(json.loads(payload))
            self.got_metadata.set()

    async def _on_state(self) -> None:
        if self.pc.connectionState == "connected" and self.outcome.connected_s is None:
            self.outcome.connected_s = self._elapsed()
            self.connected.set()

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/sdp"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if self.resume:
            headers[RESUME_HEADER] = self.resume
        return headers

    async def offer(self) -> str:
        """The offer's SDP, every candidate gathered (non-trickle); made once."""
        if self.pc.localDescription is None:
            await self.pc.setLocalDescription(await self.pc.createOffer())
        return str(self.pc.localDescription.sdp)

    async def start(self, http: aiohttp.ClientSession) -> RtcOutcome:
        """Offer, POST, apply the answer. Returns the outcome so far (``status`` 201 when the call is on)."""
        sdp = await self.offer()
        if self.offer_filter is not None:
            sdp = self.offer_filter(sdp)
        self._t0 = time.monotonic()
        url = f"{self.base_url}/api/rtc" + (f"?{self.query}" if self.query else "")
        async with http.post(url, data=sdp.encode(), headers=self._headers()) as response:
            self.outcome.status = response.status
            self.outcome.headers = {k: response.headers.getall(k) for k in set(response.headers.keys())}
            body = await response.text()
        self.outcome.answer_s = self._elapsed()
        if self.outcome.status != 201:
            self.outcome.body = body
            await self.pc.close()
            return self.outcome
        self.location = self.outcome.headers["Location"][0]
        self.outcome.answer_sdp = body
        if self.answer_filter is not None:
            body = self.answer_filter(body)
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=body, type="answer"))
        return self.outcome

    def send(self, message: bytes) -> None:
        """Send one protocol message on the DataChannel."""
        assert self.channel is not None
        self.channel.send(message)

    async def hang_up(self, http: aiohttp.ClientSession) -> int:
        """``DELETE`` the session's ``Location``; its status (200 when it ended the session)."""
        assert self.location is not None
        async with http.delete(self.base_url + self.location) as response:
            return response.status

    def drop(self) -> None:
        """Lose the call's UDP path, as a phone changing networks does: stop sending and close the ICE
        sockets at once, with no DTLS ``close_notify`` and no ``DELETE``: the server hears nothing more.
        Reads aioice's sockets through aiortc 1.16's private ``RTCIceTransport._connection``."""
        self.track.stop()
        for transceiver in self.pc.getTransceivers():
            connection = transceiver.receiver.transport.transport._connection
            for protocol in list(connection._protocols):
                transport = getattr(protocol, "transport", None)
                if transport is not None:
                    transport.abort()

    async def close(self) -> None:
        """Close the peer connection (a DTLS close to the server), stop sending."""
        self.track.stop()
        with contextlib.suppress(Exception):
            await self.pc.close()


def local_candidate_nets() -> list[str]:
    """The host candidates an aiortc caller on this host offers (aioice 0.13 ``get_host_addresses``: every
    IPv4 interface address but 127.0.0.1). A node tried by callers on its own host allows them
    (``DUPLEX_RTC_ALLOWED_CANDIDATE_NETS``): they are private, and a node drops non-global candidates
    (``runtime.frontend.transports.webrtc.candidates``)."""
    return list(get_host_addresses(use_ipv4=True, use_ipv6=False))
