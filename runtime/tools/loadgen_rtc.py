"""``duplex loadgen --transport webrtc``: the load generator's sessions over ``/api/rtc``
(``runtime.tools.rtc_client``), spread over several processes (aiortc's RTP, SRTP and DTLS are pure
Python on the generator's side too: one process would measure itself, not the node).

Each session replays its clip pre-encoded as 20 ms Opus packets, once, at real-time pace from the node's
0x00 on (the node drops audio before it, as ``/api/chat``'s generator sends its first frame after the
handshake), then silence until it hangs up (as a live microphone's would), then hangs up (``DELETE``); it
reports the load generator's usual figures (``runtime.tools.loadgen.SessionResult``: an 80 ms frame is four
packets) plus the POST -> answer and POST -> connected (ICE and DTLS) times and the packets its own jitter
buffer (``runtime.frontend.transports.webrtc.jitter``, run on arrivals) had to conceal.

First audio is counted from the packet that completes the node's first 1920-sample frame (the fourth, sent
60 ms after the first): the WebSocket generator's clock starts when it sends a whole 80 ms frame, which the
node takes on arrival, so this is the like-for-like figure; ``first_audio_first_packet_ms`` counts from
the first packet too (60 ms more: the packetisation a 20 ms transport adds before the node has a frame).

With ``relay`` each session first asks ``GET /api/rtc/ice-servers`` (its token checked,
not spent) and gathers relay candidates only (``iceTransportPolicy: "relay"``): its media then goes through
the node's TURN relay, as a firewalled caller's would.
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import ssl
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from runtime.frontend.gate.refusals import CLOSE_NORMAL
from runtime.frontend.transports.webrtc.jitter import JitterBuffer
from runtime.tools.loadgen import (
    LoadReport,
    SessionResult,
    _percentile,
    check_load_args,
    gather_sessions,
)
from runtime.tools.rtc_client import RtcCall, encode_packets

__all__ = [
    "RtcLoadReport",
    "RtcSessionResult",
    "fetch_ice_servers",
    "http_base",
    "run_rtc_load",
    "run_rtc_session",
]

PACKETS_PER_FRAME = 4
TAIL_S = 1.0
"""After its last packet, how long a session keeps listening for the node's last audio."""


@dataclass
class RtcSessionResult(SessionResult):
    """:class:`SessionResult` of a WebRTC session, plus its signalling times and concealment.

    Attributes:
        answer_ms: POST -> the 201's answer; ice_connect_ms: POST -> connected (ICE and DTLS).
        concealed_packets: 20 ms packets of the node's audio its jitter buffer concealed (lost or late).
        first_audio_ms: like the WebSocket generator's: from the send of the packet that completes the
            node's first frame (the fourth after the 0x00 handshake, before which nothing is sent) to the
            first RTP packet back.
        first_audio_first_packet_ms: from the send of the first packet (60 ms of packetisation more).
        session_id: the node's session id (from the ``Location``), to match the node's log line of the
            session's first audio (``runtime.frontend.transports.webrtc.media.FirstAudioTrace``).
        stamps: monotonic seconds (the node's clock too, on one machine): ``handshake`` (0x00 received),
            ``packet0`` .. ``packet3`` (sent), ``first_audio`` (first RTP packet back).
    """

    answer_ms: float | None = None
    ice_connect_ms: float | None = None
    concealed_packets: int = 0
    first_audio_first_packet_ms: float | None = None
    session_id: str = ""
    stamps: dict[str, float] = field(default_factory=dict)


@functools.cache
def _silence() -> bytes:
    """One 20 ms Opus packet of silence."""
    return encode_packets(np.zeros(1920, dtype=np.float32))[-1]


def http_base(url: str) -> str:
    """``ws://`` -> ``http://``, ``wss://`` -> ``https://`` (the loadgen's ``--url``), path dropped."""
    scheme, _, rest = url.partition("://")
    host = rest.split("/", 1)[0]
    return {"ws": "http", "wss": "https"}.get(scheme, scheme) + "://" + host


async def fetch_ice_servers(
    base: str, token: str | None, ssl_context: ssl.SSLContext | None = None
) -> list[dict[str, object]]:
    """``GET <base>/api/rtc/ice-servers``'s ``iceServers`` (the token checked, not spent).

    Raises:
        ValueError: not 200 (the status and the node's sentence), or no TURN server among them.
        aiohttp.ClientError: the node did not answer.
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    connector = aiohttp.TCPConnector(ssl=ssl_context) if ssl_context is not None else None
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.get(f"{base}/api/rtc/ice-servers", headers=headers) as response,
    ):
        body = await response.text()
        if response.status != 200:
            raise ValueError(f"/api/rtc/ice-servers answered {response.status}: {body.strip()[:200]}")
    servers: list[dict[str, object]] = json.loads(body)["iceServers"]
    if not any(s.get("username") for s in servers):
        raise ValueError("the node named no TURN server (is its relay on? DUPLEX_TURN_URLS)")
    return servers


async def run_rtc_session(
    base: str,
    packets: Sequence[bytes],
    *,
    token: str | None = None,
    query: str = "",
    ssl_context: ssl.SSLContext | None = None,
    connect_timeout_s: float = 10.0,
    relay: bool = False,
) -> RtcSessionResult:
    """One WebRTC session against ``base`` (``http(s)://host:port``) replaying ``packets`` once; ``relay``:
    through the node's TURN relay only (the ICE servers from ``GET /api/rtc/ice-servers``)."""
    result = RtcSessionResult(frames_planned=len(packets) // PACKETS_PER_FRAME)
    ice_servers: list[dict[str, object]] = []
    if relay:
        try:
            ice_servers = await fetch_ice_servers(base, token, ssl_context)
        except (aiohttp.ClientError, ValueError) as exc:
            result.connect_error = f"ICE servers: {type(exc).__name__}: {exc}"
            return result
    call = RtcCall(
        base,
        packets,
        token=token,
        query=query,
        loop=False,
        ice_servers=ice_servers,
        relay_only=relay,
        audio_after_handshake=True,
    )
    call.track.after = _silence()  # as a live client: audio goes on (silence) until it hangs up
    buffer = JitterBuffer(time.monotonic)
    arrivals: list[float] = []
    original = call._on_rtp

    async def on_rtp(packet: object, arrival_time_ms: int) -> None:
        await original(packet, arrival_time_ms)
        arrivals.append(time.monotonic())
        buffer.push(packet.sequence_number, packet.timestamp, packet.payload)  # type: ignore[attr-defined]
        buffer.pop()

    call.transceiver.receiver._handle_rtp_packet = on_rtp  # type: ignore[method-assign]
    connector = aiohttp.TCPConnector(ssl=ssl_context) if ssl_context is not None else None
    try:
        async with aiohttp.ClientSession(connector=connector) as http:
            try:
                outcome = await call.start(http)
            except aiohttp.ClientError as exc:
                result.connect_error = f"{type(exc).__name__}: {exc}"
                return result
            result.answer_ms = outcome.answer_s * 1e3 if outcome.answer_s is not None else None
            if outcome.status != 201:
                result.http_status, result.http_body = outcome.status, outcome.body
                return result
            try:
                await asyncio.wait_for(call.connected.wait(), connect_timeout_s)
            except TimeoutError:
                result.connect_error = f"ICE/DTLS not connected within {connect_timeout_s:g} s"
                return result
            assert outcome.connected_s is not None
            result.ice_connect_ms = result.connect_ms = outcome.connected_s * 1e3
            result.session_id = (call.location or "").rstrip("/").split("/")[-2]
            while call.track.sent < len(packets) and call.pc.connectionState == "connected":
                await asyncio.sleep(0.1)
            await asyncio.sleep(TAIL_S)
            result.handshake = outcome.handshake_s is not None
            result.frames_sent = call.track.sent // PACKETS_PER_FRAME
            result.text = "".join(outcome.texts)
            result.errors = list(outcome.errors)
            frames = arrivals[PACKETS_PER_FRAME - 1 :: PACKETS_PER_FRAME]
            result.audio_messages = len(frames)
            result.audio_arrival_s = frames
            _first_audio(result, call, arrivals)
            result.bytes_sent = sum(len(p) for p in packets[: call.track.sent])
            result.bytes_received = outcome.bytes_in
            result.concealed_packets = buffer.stats.concealed
            status = await call.hang_up(http)
            result.close_code = CLOSE_NORMAL if status == 200 else None
            result.close_reason = "" if status == 200 else f"DELETE answered {status}"
    finally:
        await call.close()
    return result


def _first_audio(result: RtcSessionResult, call: RtcCall, arrivals: Sequence[float]) -> None:
    """``result``'s first-audio figures and stamps from the call's packet send times and ``arrivals``."""
    sent_at = call.track.sent_at
    if call.outcome.handshake_s is not None:
        result.stamps["handshake"] = call.started_at + call.outcome.handshake_s
    result.stamps.update({f"packet{i}": t for i, t in enumerate(sent_at[:PACKETS_PER_FRAME])})
    if not arrivals:
        return
    result.stamps["first_audio"] = arrivals[0]
    if sent_at:
        result.first_audio_first_packet_ms = (arrivals[0] - sent_at[0]) * 1e3
    if len(sent_at) >= PACKETS_PER_FRAME:
        result.first_audio_ms = (arrivals[0] - sent_at[PACKETS_PER_FRAME - 1]) * 1e3


@dataclass
class RtcLoadReport(LoadReport):
    """:class:`LoadReport` plus WebRTC's signalling times and concealment over the sessions."""

    def summary(self) -> dict[str, float | int | None]:
        totals = super().summary()
        rtc = [r for r in self.sessions if isinstance(r, RtcSessionResult)]
        answer = [r.answer_ms for r in rtc if r.answer_ms is not None]
        first_packet = [
            r.first_audio_first_packet_ms
            for r in rtc
            if r.handshake and r.first_audio_first_packet_ms is not None
        ]
        ice = [r.ice_connect_ms for r in rtc if r.ice_connect_ms is not None]
        totals.update(
            {
                "first_audio_first_packet_ms_p50": _percentile(first_packet, 50),
                "first_audio_first_packet_ms_p99": _percentile(first_packet, 99),
                "answer_ms_p50": _percentile(answer, 50),
                "answer_ms_p99": _percentile(answer, 99),
                "ice_connect_ms_p50": _percentile(ice, 50),
                "ice_connect_ms_p99": _percentile(ice, 99),
                "concealed_packets": sum(r.concealed_packets for r in rtc),
            }
        )
        return totals

    def session_rows(self) -> list[dict[str, object]]:
        rows = super().session_rows()
        for row, r in zip(rows, self.sessions, strict=True):
            if isinstance(r, RtcSessionResult):
                row["first_audio_first_packet_ms"] = r.first_audio_first_packet_ms
                row["session_id"] = r.session_id
                row["stamps"] = r.stamps
        return rows


def _process_share(
    base: str,
    clips: list[list[bytes]],
    indices: list[int],
    tokens: list[str | None],
    query: str,
    stagger_s: float,
    max_duration_s: float,
    cafile: str | None,
    relay: bool = False,
) -> tuple[list[RtcSessionResult], float]:
    """One generator process: its sessions concurrently; (results in ``indices`` order, CPU seconds)."""
    context = ssl.create_default_context(cafile=cafile) if cafile else None
    cpu = time.process_time()

    async def main() -> list[RtcSessionResult]:
        async def one(n: int, i: int, token: str | None) -> RtcSessionResult:
            await asyncio.sleep(i * stagger_s)
            return await run_rtc_session(
                base, clips[i % len(clips)], token=token, query=query, ssl_context=context, relay=relay
            )

        tasks = [
            asyncio.create_task(one(n, i, t)) for n, (i, t) in enumerate(zip(indices, tokens, strict=True))
        ]
        return await gather_sessions(tasks, max_duration_s, RtcSessionResult)

    results = asyncio.run(main())
    return results, time.process_time() - cpu


async def run_rtc_load(
    url: str,
    speech: Sequence[np.ndarray],
    *,
    sessions: int,
    processes: int = 2,
    token: str | Callable[[], str] | None = None,
    query: str = "",
    cafile: str | None = None,
    max_duration_s: float = 120.0,
    stagger_s: float = 0.0,
    relay: bool = False,
) -> RtcLoadReport:
    """``sessions`` concurrent WebRTC sessions against ``url`` (``ws(s)://`` or ``http(s)://host:port``),
    spread round-robin over ``processes`` generator processes; session ``i`` replays ``speech[i %
    len(speech)]`` pre-encoded; ``relay``: every session through the node's TURN relay only.

    Raises:
        ValueError: ``sessions`` outside 1..MAX_LOAD_SESSIONS, ``processes`` < 1, no speech, a bad duration,
            or one token for several sessions.
    """
    check_load_args(sessions, speech, max_duration_s, token)
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    base = http_base(url)
    clips = [encode_packets(clip) for clip in speech[: min(len(speech), sessions)]]
    tokens = [token() if callable(token) else token for _ in range(sessions)]
    shares = [list(range(p, sessions, processes)) for p in range(min(processes, sessions))]
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(len(shares), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [
            loop.run_in_executor(
                pool,
                _process_share,
                base,
                clips,
                share,
                [tokens[i] for i in share],
                query,
                stagger_s,
                max_duration_s,
                cafile,
                relay,
            )
            for share in shares
        ]
        parts = await asyncio.gather(*futures)
    results: list[SessionResult] = [RtcSessionResult() for _ in range(sessions)]
    cpu = 0.0
    for share, (share_results, share_cpu) in zip(shares, parts, strict=True):
        cpu += share_cpu
        for i, result in zip(share, share_results, strict=True):
            results[i] = result
    return RtcLoadReport(results, time.monotonic() - started, cpu)
