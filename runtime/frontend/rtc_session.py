"""One WebRTC session (``/api/rtc``): its aiortc peer connection, its media (``runtime.frontend.rtc_media``),
its DataChannel, and the transport-neutral :class:`runtime.frontend.session.ChatSession` it carries.

The DataChannel carries the messages of Kyutai's protocol (``runtime.frontend.protocol``) minus audio: the
server sends 0x00 when the slot is live, 0x02 text pieces and 0x05 errors; the client may send 0x03
control, 0x04 metadata (ignored, as on ``/api/chat``) and 0x06 ping (echoed). The client opens it (any
label) before its offer; a second one is closed. Audio travels as RTP only: a 0x01 on the channel gets a
0x05 error.

The session ends (its slot freed at once) on: ``DELETE`` of its resource; the peer's DTLS close or an ICE
failure (aiortc's ``connectionState`` ``closed``/``failed``); no connection within
``rtc_connect_timeout_s`` of the answer; no RTP for ``rtc_media_timeout_s`` once connected; the session's
``max_session_s``; a drain or the engine's loss (``Transport.close``).

The session token is spent when the peer connection connects (ICE and DTLS), not when the answer is sent:
a session that never connects leaves it unspent, for the caller's WebSocket fallback. Until it is spent,
no audio flows either way and no 0x00 is sent; a token spent meanwhile (by that fallback) ends this session
with a 0x05 ``replayed`` error, so of two uses of one token at most one carries on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.rtcdatachannel import RTCDataChannel

from runtime.frontend.protocol import (
    AudioMessage,
    PingMessage,
    ProtocolError,
    encode_error,
    encode_handshake,
    encode_ping,
    encode_text,
    parse_client_message,
)
from runtime.frontend.refusals import CLOSE_NORMAL, SessionRefused
from runtime.frontend.rtc_media import FirstAudioTrace, OpusPacketTrack, RtpInbound
from runtime.frontend.session import ChatSession, FrontEnd, SessionOutcome, Transport

__all__ = [
    "CHANNEL_BURST",
    "CHANNEL_RATE_PER_S",
    "OfferRejected",
    "RtcPeer",
    "RtcTransport",
    "Float32Frames",
]

log = logging.getLogger(__name__)

CHANNEL_RATE_PER_S = 50.0
"""DataChannel messages a client may send per second (a ping every 20 ms); more are dropped."""
CHANNEL_BURST = 100
"""DataChannel messages a client may send at once."""
CHANNEL_PENDING = 256
"""Messages kept for the DataChannel before it opens (the oldest dropped past it)."""
CLOSE_TIMEOUT_S = 5.0
"""Longest wait for aiortc to close a peer connection (its transports' shutdown)."""
CHANNEL_MAX_BUFFERED_BYTES = 1 << 20
"""A DataChannel with more unsent bytes than this (a peer that stopped reading) drops further text."""


class OfferRejected(ValueError):
    """The SDP offer cannot make a session (malformed, no audio, no Opus): a 400 naming what is wrong."""


class Float32Frames:
    """The session's outbound "encoder" on WebRTC: the frame's float32 bytes, for :class:`RtcTransport` to
    encode into RTP-sized Opus packets (``ChatSession.send_loop`` encodes before it sends)."""

    def encode(self, frame: np.ndarray) -> bytes:
        return np.ascontiguousarray(frame, dtype="<f4").tobytes()


class RtcTransport(Transport):
    """``runtime.frontend.session.Transport`` over a peer connection."""

    name = "webrtc"

    def __init__(self, peer: RtcPeer) -> None:
        self.peer = peer

    async def send_audio(self, payload: bytes) -> None:
        self.peer.track.put_frame(np.frombuffer(payload, dtype="<f4"))

    async def send_text(self, piece: str) -> None:
        self.peer.send(encode_text(piece))

    async def close(self, code: int, reason: str) -> None:
        if code != CLOSE_NORMAL:
            self.peer.send(encode_error(reason))
        outcome = "drained" if code == 1001 else "closed_by_server"
        self.peer.end(SessionOutcome(outcome, code))


@dataclass
class _Bucket:
    """A token bucket: ``rate`` per second, ``burst`` at most."""

    rate: float
    burst: float
    tokens: float
    at: float

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class RtcPeer:
    """One session's peer connection, from the offer to the end.

    Args:
        front: the server.
        posted_at: when the offer's POST arrived (monotonic s): the connect time is measured from it.
        clock: monotonic seconds.

    Attributes:
        key: the session resource's secret (its ``Location`` carries it; ``DELETE`` must present it).
        session: the chat session, once made.
        outcome: how it ended (None while it runs).
    """

    def __init__(
        self, front: FrontEnd, posted_at: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.front = front
        self.posted_at = posted_at
        self.clock = clock
        self.key = secrets.token_urlsafe(18)
        # No ICE servers: the node's host candidates are what a caller (or the node's TURN relay) reaches;
        # aiortc's default would ask Google's STUN server during every answer.
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.session: ChatSession | None = None
        self.channel: RTCDataChannel | None = None
        self.outcome: SessionOutcome | None = None
        self.ended = asyncio.Event()
        self.connected_at: float | None = None
        self.on_token_settled: Callable[[], None] | None = None
        """Called once the token's spend is decided (spent, or refused): the signalling's one-call cap."""
        self.trace = FirstAudioTrace()
        """The first audio's way through the node, logged when the session ends (docs/benchmarks.md)."""
        self.track = OpusPacketTrack(
            front.config.opus_complexity,
            on_dropped=lambda n: front.metrics.frames_dropped.labels(reason="slow_client").inc(n / 4),
            trace=self.trace,
        )
        self.inbound = RtpInbound(self._on_pcm, front.metrics, trace=self.trace)
        self._pending: list[bytes] = []
        self._bucket = _Bucket(CHANNEL_RATE_PER_S, CHANNEL_BURST, CHANNEL_BURST, clock())
        self._last_flood_error = -1.0
        self._task: asyncio.Task[None] | None = None
        self.spent = asyncio.Event()
        """Set once the session's token is spent (the connection is up): media flows from then on."""
        self._spender: asyncio.Task[None] | None = None
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("connectionstatechange", self._on_state)

    # --- the offer and the answer ---------------------------------------------------------------------

    async def accept_offer(self, sdp: str) -> None:
        """Read the offer; nothing is reserved yet.

        Raises:
            OfferRejected: malformed SDP, no audio m-line, or no Opus in it (the message says which).
        """
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
        except Exception as exc:  # aiortc's parser raises whatever the text provokes: all of it is bad input
            raise OfferRejected(f"malformed SDP offer: {type(exc).__name__}: {exc}"[:300]) from None
        audio = [t for t in self.pc.getTransceivers() if t.kind == "audio"]
        if not audio:
            raise OfferRejected("the SDP offer has no audio m-line: offer one sendrecv Opus audio track")
        if len(audio) > 1:
            raise OfferRejected(f"the SDP offer has {len(audio)} audio m-lines: offer exactly one")
        transceiver = audio[0]
        opus = [c for c in transceiver._codecs if c.mimeType.lower() == "audio/opus"]
        if not opus:
            raise OfferRejected("the SDP offer's audio m-line has no Opus (opus/48000/2): offer Opus")
        transceiver._codecs = opus  # the answer offers Opus alone (aiortc 1.16 answers from this list)
        transceiver.direction = "sendrecv"
        transceiver.sender.replaceTrack(self.track)
        self.inbound.attach(transceiver.receiver, {c.payloadType for c in opus if c.payloadType is not None})

    async def answer(self) -> str:
        """The SDP answer, with every ICE candidate in it (non-trickle: gathering is done)."""
        answer = await self.pc.createAnswer()
        await self.pc.setLocalDescription(answer)
        return str(self.pc.localDescription.sdp)

    # --- running --------------------------------------------------------------------------------------

    def start(self, session: ChatSession, on_done: Callable[[RtcPeer], None]) -> None:
        """Run the admitted ``session`` until it ends (a task of its own, beyond the POST)."""
        self.session = session
        self._task = asyncio.create_task(self._run(session, on_done), name=f"rtc {session.session_id}")
        self._spend_once_connected()

    async def _run(self, session: ChatSession, on_done: Callable[[RtcPeer], None]) -> None:
        front = self.front
        front.sessions.add(session)
        watchdog = asyncio.create_task(self._watch())
        starter = asyncio.create_task(self._start_media(session))
        try:
            try:
                async with asyncio.timeout(session.max_session_s):
                    await self.ended.wait()
            except TimeoutError:
                limit = session.max_session_s
                self.send(encode_error(f"session reached max_session_s={limit:g}"))
                self.end(SessionOutcome("max_session_length"))
        finally:
            for task in (watchdog, starter, self._spender):
                if task is not None:
                    task.cancel()
            front.sessions.discard(session)
            session.finish(self.outcome or SessionOutcome("client_closed"))
            log.info("WebRTC session %s first audio: %s", session.session_id, json.dumps(self.trace.stamps()))
            on_done(self)
            await self.close()

    async def _start_media(self, session: ChatSession) -> None:
        """Once the persona prompt has run: 0x00 on the channel, then the session's outputs to the peer."""
        try:
            await session.wait_prompt()
        except TimeoutError:
            self.end(SessionOutcome("prompt_timeout", 1013))
            return
        await self.spent.wait()
        self.trace.handshake_at = self.clock()
        self.send(encode_handshake())
        await session.send_loop()

    def _spend_once_connected(self) -> None:
        """Once connected and started (either may come first), spend the token, once."""
        if self.connected_at is None or self.session is None or self._spender is not None:
            return
        self._spender = asyncio.create_task(self._spend(self.session))

    async def _spend(self, session: ChatSession) -> None:
        """Spend the token; when it was spent meanwhile (or cannot be checked), a 0x05 and the end."""
        try:
            await session.spend_token()
        except SessionRefused as exc:
            self.front.metrics.admissions_refused.labels(reason=exc.reason).inc()
            log.info("WebRTC session %s connected but refused: %s", session.session_id, exc.message)
            self.send(encode_error(f"{exc.reason}: {exc.message}"))
            self.end(SessionOutcome(exc.reason, exc.kind.close_code))
            return
        finally:
            if self.on_token_settled is not None:
                self.on_token_settled()
        self.trace.spent_at = self.clock()
        self.spent.set()

    async def _watch(self) -> None:
        """Connect and media timeouts; the RTP counters into the metrics once a second."""
        config = self.front.config
        answered_at = self.clock()
        while True:
            await asyncio.sleep(min(1.0, config.rtc_media_timeout_s / 4, config.rtc_connect_timeout_s / 4))
            self.inbound.count()
            now = self.clock()
            if self.connected_at is None:
                if now - answered_at > config.rtc_connect_timeout_s:
                    self.end(SessionOutcome("rtc_connect_timeout"))
                continue
            last = self.inbound.last_packet_at or self.connected_at
            if now - last > config.rtc_media_timeout_s:
                self.end(SessionOutcome("rtc_media_timeout"))

    async def wait_closed(self) -> None:
        """Until the session's task has ended (its peer connection closed)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    def end(self, outcome: SessionOutcome) -> None:
        """End the session (the first outcome given stands); its slot is freed at once."""
        if self.outcome is None:
            self.outcome = outcome
        if self.session is not None:
            self.session.release()
        self.ended.set()

    async def close(self) -> None:
        """Stop the media and close the peer connection (idempotent)."""
        self.inbound.close()
        self.track.stop()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self.pc.close()

    # --- events ---------------------------------------------------------------------------------------

    async def _on_state(self) -> None:
        state = self.pc.connectionState
        if state == "connected" and self.connected_at is None:
            self.connected_at = self.trace.connected_at = self.clock()
            self.front.metrics.rtc_connect.observe(self.connected_at - self.posted_at)
            self._spend_once_connected()
        elif state in ("failed", "closed") and self.session is not None:
            self.end(SessionOutcome("rtc_failed" if state == "failed" else "client_closed"))

    def _on_pcm(self, pcm: np.ndarray) -> bool:
        """Inbound samples to the session; whether it took them (it drops them before its handshake)."""
        session = self.session
        if session is None or not self.spent.is_set():
            return False
        try:
            session.push_audio(pcm.astype("<i2").tobytes())
        except ProtocolError as exc:  # too_fast cannot happen at 20 ms a push; counted all the same
            self.front.metrics.protocol_errors.labels(reason=exc.reason).inc()
        return session.ready.is_set() and session.lease is not None

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if self.channel is not None:
            channel.close()
            return
        self.channel = channel
        channel.on("message", self._on_message)
        channel.on("open", self._flush)
        if channel.readyState == "open":
            self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for message in pending:
            self.send(message)

    def send(self, message: bytes) -> None:
        """Send one protocol message on the DataChannel (kept until it opens; dropped when the peer has
        stopped reading or the channel is gone)."""
        channel = self.channel
        if channel is None or channel.readyState == "connecting":
            if len(self._pending) >= CHANNEL_PENDING:
                self._pending.pop(0)
            self._pending.append(message)
            return
        if channel.readyState != "open" or channel.bufferedAmount > CHANNEL_MAX_BUFFERED_BYTES:
            return
        with contextlib.suppress(Exception):
            channel.send(message)

    def _on_message(self, data: bytes | str) -> None:
        metrics = self.front.metrics
        now = self.clock()
        if not self._bucket.take(now):
            metrics.protocol_errors.labels(reason="too_fast").inc()
            if now - self._last_flood_error >= 1.0:
                self._last_flood_error = now
                self.send(
                    encode_error(
                        f"too_fast: more than {CHANNEL_RATE_PER_S:g} DataChannel messages per second "
                        f"(burst {CHANNEL_BURST}); messages dropped"
                    )
                )
            return
        try:
            parsed = parse_client_message(data, max_message_bytes=self.front.config.max_message_bytes)
            if isinstance(parsed, PingMessage):
                self.send(encode_ping(parsed.payload))
            elif isinstance(parsed, AudioMessage):
                raise ProtocolError(
                    "audio_on_datachannel", "audio travels as RTP (Opus) on /api/rtc, not on the DataChannel"
                )
        except ProtocolError as exc:
            metrics.protocol_errors.labels(reason=exc.reason).inc()
            self.send(encode_error(f"{exc.reason}: {exc}"))
