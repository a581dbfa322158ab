"""A WebRTC session's edges (``runtime.frontend.session.lifecycle.Edge``): what the lifecycle, written once
for every transport, calls on a peer connection (:class:`runtime.frontend.transports.webrtc.peer.RtcPeer`):
outbound frames to the peer's RTP Opus track, events on its DataChannel, the POST's answer
(:attr:`RtcTransport.answered`), the close. The peer itself (aiortc, the offer, the media and the
DataChannel) is ``peer.py``; the HTTP side is ``signalling.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from runtime.frontend.codecs.protocol import encode_error, encode_handshake, encode_metadata, encode_text
from runtime.frontend.gate.refusals import CLOSE_NORMAL, SessionRefused
from runtime.frontend.session.conversation import ChatSession, SessionOutcome
from runtime.frontend.session.lifecycle import Edge
from runtime.frontend.transports.webrtc.peer import RtcPeer

__all__ = ["Refused", "RtcTransport"]

log = logging.getLogger(__name__)


@dataclass
class Refused:
    """A session refused before its answer: ``counted``: in the metrics already (a resume's refusal)."""

    exc: SessionRefused
    counted: bool


class RtcTransport(Edge):
    """The session's edges on a peer connection (``runtime.frontend.session.lifecycle`` runs the rest):
    outbound frames go to the peer's :class:`OpusPacketTrack` (its own RTP Opus encoder), inbound RTP is
    decoded by its :class:`RtpInbound` (``RtcPeer._on_pcm``), events go on the DataChannel.

    The lifecycle runs in a task of its own, beyond the POST: :attr:`answered` is what the POST answers
    with: the answer's SDP (the session admitted and started), :class:`Refused` (an HTTP refusal), None
    (the caller left before its answer: 499), or the error that made the answer fail, as its exception.

    Args:
        peer: the peer connection, its offer accepted.
        client_gone: whether the POST's connection has closed (read after the waiting room).
        on_start: called with the peer once answered (the registry's record of it).
        on_done: called with the peer once the session has ended here.
    """

    name = "webrtc"
    audio_format = "opus"

    def __init__(
        self,
        peer: RtcPeer,
        client_gone: Callable[[], bool],
        on_start: Callable[[RtcPeer], None],
        on_done: Callable[[RtcPeer], None],
    ) -> None:
        super().__init__()
        self.peer = peer
        peer.edge = self
        self.client_gone = client_gone
        self.on_start = on_start
        self.on_done = on_done
        self.answered: asyncio.Future[str | Refused | None] = asyncio.get_running_loop().create_future()

    async def prepare(self, session: ChatSession) -> None:
        """The token is spent when ICE and DTLS connect (a failed ICE leaves it for a WebSocket fallback):
        only checked now (a token spent already: 403 before any answer)."""
        await super().prepare(session)
        self.peer.session = session
        session.spend_on_connect = True
        if not session.request.resume:  # the credential is the right to the slot: no token (claims None)
            await session.spend_token(check_only=True)

    async def refuse(self, exc: SessionRefused, *, counted: bool) -> None:
        await self.peer.close()
        if not self.answered.done():
            self.answered.set_result(Refused(exc, counted))

    async def admitted(self, session: ChatSession) -> SessionOutcome | None:
        if self.client_gone():  # it left while waiting for a slot (aiohttp does not cancel the handler)
            log.info("WebRTC caller left before its answer: session %s not started", session.session_id)
            self.answered.set_result(None)
            return SessionOutcome("client_closed")
        try:
            answer = await self.peer.answer()
        except Exception as exc:  # aiortc's createAnswer on an offer the checks let through: bad input, a 400
            log.info("WebRTC answer failed for session %s: %r", session.session_id, exc)
            message = f"bad request: the SDP offer cannot be answered: {type(exc).__name__}: {exc}"[:300]
            await self.peer.close()
            self.answered.set_result(Refused(SessionRefused("bad_request", message), False))
            return SessionOutcome("rtc_failed")
        self.on_start(self.peer)
        self.peer.start()
        self.answered.set_result(answer)
        return None

    async def connected(self) -> None:
        peer = self.peer
        await peer.spent.wait()
        peer.trace.handshake_at = peer.clock()

    async def send_audio(self, pcm: np.ndarray) -> None:
        self.peer.track.put_frame(pcm)

    async def send_text(self, piece: str) -> None:
        self.peer.send(encode_text(piece))

    async def send_handshake(self) -> None:
        self.peer.send(encode_handshake())

    async def send_metadata(self, body: dict[str, object]) -> None:
        self.peer.send(encode_metadata(body))

    async def send_error(self, message: str) -> None:
        self.peer.send(encode_error(message))

    async def close(self, code: int, reason: str) -> None:
        if code != CLOSE_NORMAL:
            self.peer.send(encode_error(reason))
        outcome = "drained" if code == 1001 else "closed_by_server"
        self.end(SessionOutcome(outcome, code), hang_up=True)

    async def shutdown(self, outcome: SessionOutcome, held: bool) -> None:
        """Stop the peer's tasks, log the first audio's trace, close the peer connection (held or not:
        a resume comes on a new one)."""
        peer = self.peer
        peer.stop()
        if self.session is not None:
            stamps = json.dumps(peer.trace.stamps())
            log.info("WebRTC session %s first audio: %s", self.session.session_id, stamps)
        await peer.close()

    def done(self) -> None:
        self.on_done(self.peer)
