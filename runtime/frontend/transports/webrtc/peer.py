"""One WebRTC session (``/api/rtc``): its aiortc peer connection, its media
(``runtime.frontend.transports.webrtc.media``),
its DataChannel, and the transport-neutral :class:`runtime.frontend.session.conversation.ChatSession` it
carries.

The DataChannel carries the messages of Kyutai's protocol (``runtime.frontend.codecs.protocol``) minus audio:
the
server sends 0x00 when the slot is live, 0x02 text pieces and 0x05 errors; the client may send 0x03
control, 0x04 metadata (ignored, as on ``/api/chat``) and 0x06 ping (echoed). The client opens it (any
label) before its offer; a second one is closed. Audio travels as RTP only: a 0x01 on the channel gets a
0x05 error.

The session ends (its slot freed at once) on a normal close: ``DELETE`` of its resource; the peer's DTLS
``close_notify`` (the client's ``RTCPeerConnection.close()``); the client closing
the DataChannel while connected (a client that means to stay keeps its channel: a hang-up); no connection
within ``rtc_connect_timeout_s`` of the answer; the session's ``max_session_s``; a drain or the engine's
loss (``Transport.close``). It is *lost* (:class:`SessionOutcome` ``lost``), and a resumable session
(``resumable=1``, or resumed) is detached instead, its slot held paused for ``resume_s``
(``runtime.frontend.session.resume``; docs/runtime.md, "Resume"), when the transport goes without a word
from the client: no RTP for ``rtc_media_timeout_s`` once connected (``rtc_media_timeout``: a dropped UDP path,
a phone changing networks; aiortc has no ``disconnected`` state, so this timeout is the grace), ICE failed
(consent freshness, RFC 7675: aioice gives up after 6 unanswered checks 5 s apart), or the DTLS transport
closed without a ``close_notify`` (its ICE path closed: ``rtc_failed``); a resumed call's connect timeout
too (its 201 carried the next credential). With ``resumable=1`` the 0x00 is followed by a 0x04
metadata message with the session id and its single-use credential, as on ``/api/chat``.

The session token is spent when the peer connection connects (ICE and DTLS), not when the answer is sent:
a session that never connects leaves it unspent, for the caller's WebSocket fallback. Until it is spent,
no audio flows either way and no 0x00 is sent; a token spent meanwhile (by that fallback) ends this session
with a 0x05 ``replayed`` error, so of two uses of one token at most one carries on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.rtcdatachannel import RTCDataChannel
from OpenSSL import SSL

from runtime.frontend.codecs.protocol import (
    AudioMessage,
    PingMessage,
    ProtocolError,
    encode_error,
    encode_ping,
    parse_client_message,
)
from runtime.frontend.gate.refusals import SessionRefused
from runtime.frontend.session.conversation import ChatSession, FrontEnd, SessionOutcome
from runtime.frontend.session.lifecycle import Edge
from runtime.frontend.transports.webrtc.candidates import CandidatePolicy, filter_offer_candidates
from runtime.frontend.transports.webrtc.media import FirstAudioTrace, OpusPacketTrack, RtpInbound
from runtime.frontend.transports.webrtc.offer_checks import OfferInvalid, check_offer

__all__ = [
    "CHANNEL_BURST",
    "CHANNEL_RATE_PER_S",
    "OfferRejected",
    "RtcPeer",
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
        self.edge: Edge | None = None
        """The session's edges (``edge.RtcTransport``), where the peer's end goes."""
        self.channel: RTCDataChannel | None = None
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
        self.task: asyncio.Task[None] | None = None
        """The session's lifecycle (``runtime.frontend.session.lifecycle.run``), set by the signalling."""
        self.spent = asyncio.Event()
        """Set once the session's token is spent (the connection is up): media flows from then on."""
        self._spender: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._stopped = False
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("connectionstatechange", self._on_state)

    # --- the offer and the answer ---------------------------------------------------------------------

    async def accept_offer(self, sdp: str) -> None:
        """Read the offer; nothing is reserved yet.

        The caller's ICE candidates are filtered first (``candidates.filter_offer_candidates``: the ICE agent
        never sends to the dropped ones), and the offer's mids, BUNDLE group, fingerprints and ICE
        credentials checked (``offer_checks.check_offer``).

        Raises:
            OfferRejected: malformed SDP (``offer_checks.check_offer``: mids, BUNDLE, DTLS fingerprint, ICE
                credentials), no audio m-line, or no Opus in it (the message says which).
        """
        filtered = filter_offer_candidates(sdp, CandidatePolicy.from_config(self.front.config))
        if filtered.dropped:  # counted by reason: an offer may list hundreds
            reasons = collections.Counter(d.reason for d in filtered.dropped)
            log.info("WebRTC offer: %d candidates kept, dropped %s", filtered.kept, dict(reasons))
        sdp = filtered.sdp
        try:
            check_offer(sdp)
        except OfferInvalid as exc:
            raise OfferRejected(f"malformed SDP offer: {exc}") from None
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
        except Exception as exc:  # aiortc's parser raises whatever the text provokes: all of it is bad input
            raise OfferRejected(f"malformed SDP offer: {type(exc).__name__}: {exc}"[:300]) from None
        audio = [t for t in self.pc.getTransceivers() if t.kind == "audio"]
        if not audio:
            raise OfferRejected("the SDP offer has no audio m-line: offer one sendrecv Opus audio track")
        if len(audio) > 1:
            raise OfferRejected(f"the SDP offer has {len(audio)} audio m-lines: offer exactly one")
        try:
            check_offer(sdp)
        except OfferInvalid as exc:
            raise OfferRejected(str(exc)) from None
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
        for transceiver in self.pc.getTransceivers():
            dtls = transceiver.receiver.transport
            dtls.on("statechange", lambda dtls=dtls: self._on_dtls_state(dtls))
        return str(self.pc.localDescription.sdp)

    # --- running --------------------------------------------------------------------------------------

    @property
    def outcome(self) -> SessionOutcome | None:
        """How the session ended (None while it runs)."""
        return None if self.edge is None else self.edge.outcome

    def start(self) -> None:
        """The call is answered: watch its connect and media timeouts; spend the token once connected."""
        self._watchdog = asyncio.create_task(self._watch(), name="rtc watchdog")
        self._spend_once_connected()

    def stop(self) -> None:
        """Stop the watchdog and the spend (the session is decided)."""
        self._stopped = True
        for task in (self._watchdog, self._spender):
            if task is not None:
                task.cancel()

    def _spend_once_connected(self) -> None:
        """Once connected and started (either may come first), spend the token, once."""
        if self.connected_at is None or self.session is None or self._watchdog is None:
            return  # not connected, or not answered yet
        if self._spender is not None or self._stopped:
            return
        self._spender = asyncio.create_task(self._spend(self.session))

    async def _spend(self, session: ChatSession) -> None:
        """Spend the token; when it was spent meanwhile (or cannot be checked), a 0x05 and the end."""
        try:
            await session.spend_token()
        except SessionRefused as exc:
            self.front.metrics.refused(exc.reason)
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
                    # A resume's answer carried its next credential (rtc.RESUME_HEADER): a resume whose ICE
                    # never connects is held again, for the caller's next try. A new call is ended.
                    resumed = self.session is not None and self.session.resumed is not None
                    self.end(SessionOutcome("rtc_connect_timeout", lost=resumed))
                continue
            last = self.inbound.last_packet_at or self.connected_at
            if now - last > config.rtc_media_timeout_s:  # a dropped path: no word from the client
                self.end(SessionOutcome("rtc_media_timeout", lost=True))

    async def wait_closed(self) -> None:
        """Until the session's task has ended (its peer connection closed)."""
        if self.task is not None:
            await asyncio.shield(self.task)

    def end(self, outcome: SessionOutcome, *, hang_up: bool = False) -> None:
        """End the session (``Edge.end``: the first outcome given stands; its slot is freed at once unless
        the outcome is ``lost`` and the session resumable). ``hang_up``: a ``DELETE`` or the server's own
        close, which turns a lost outcome not yet acted on into a normal end, or ends a hold."""
        if self.edge is not None:
            self.edge.end(outcome, hang_up=hang_up)

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
        elif state == "failed" and self.session is not None:
            self.end(SessionOutcome("rtc_failed", lost=True))  # ICE failed (consent expired)
        elif state == "closed" and self.session is not None:
            self.end(SessionOutcome("client_closed"))  # a lost path was named by _on_dtls_state first

    def _on_dtls_state(self, dtls: Any) -> None:
        """The DTLS transport closed: by the peer's ``close_notify`` (a hang-up: a browser's ``pc.close()``),
        or without one (its ICE path closed, consent expired: lost). Runs before aiortc's own ``closed``
        ``connectionState`` (which it triggers), so it names the outcome first. Whether a ``close_notify``
        came is OpenSSL's ``SSL_RECEIVED_SHUTDOWN``, read through aiortc 1.16's private ``_ssl``."""
        if dtls.state != "closed" or self.session is None or self.outcome is not None:
            return
        ssl = getattr(dtls, "_ssl", None)
        told = ssl is not None and bool(ssl.get_shutdown() & SSL.RECEIVED_SHUTDOWN)
        if told:
            self.end(SessionOutcome("client_closed"))
        else:
            self.end(SessionOutcome("rtc_failed", lost=True))

    def _on_pcm(self, pcm: np.ndarray) -> bool:
        """Inbound float32 samples ``[T]`` to the session; whether it took them (it drops them before its
        handshake)."""
        session = self.session
        if session is None or not self.spent.is_set():
            return False
        session.push_samples(pcm)
        return session.takes_audio

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if self.channel is not None:
            channel.close()
            return
        self.channel = channel
        channel.on("message", self._on_message)
        channel.on("close", self._on_channel_closed)
        channel.on("open", self._flush)
        if channel.readyState == "open":
            self._flush()

    def _on_channel_closed(self) -> None:
        """The client closed the DataChannel while connected: a hang-up (its transport is not lost)."""
        if self.session is not None and self.pc.connectionState == "connected":
            self.end(SessionOutcome("client_closed"))

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
