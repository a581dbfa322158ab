"""Kyutai's WebSocket protocol on ``/api/chat``: one transport over
``runtime.frontend.session.conversation.ChatSession``.

Binary messages, first byte = kind (``runtime.frontend.codecs.protocol``): the server sends 0x00 when the
slot is
live, 0x01 audio, 0x02 text, 0x05 an error before closing; the client sends 0x01 audio, 0x04 metadata (the
text prompt with ``text_prompt_in=metadata``), 0x06 ping (echoed unchanged). A caller is read (and its
audio dropped) until its handshake, so one that leaves while it waits for a slot or while its persona prompt
runs gives its place back at once. Refusals after the upgrade: a 0x05 error naming the reason, then the
close code of ``runtime.frontend.gate.refusals.REFUSALS``. The slot is released when the server decides to
close, not when the closing handshake ends (a client that never answers a close frame held it 10 s). The
WebSocket is aiohttp's (the HTTP layer's server, ``runtime.frontend.http``), as in moshi's own server.

Resume (``runtime.frontend.session.resume``; docs/protocol.md, "Resume"): with ``resumable=1`` the
handshake is followed by a 0x04 metadata message with the session id and a single-use credential. A
connection lost without a close frame (a reset, a dead peer past the heartbeat) detaches a resumable
session: its slot is held, paused, for ``resume_s``; the credential on a new connection (the
``Duplex-Resume-Credential`` header, or the subprotocol ``duplex.resume.<credential>`` from a browser, which
the server selects; the deprecated ``?resume=`` too), through any worker, takes it over (a new handshake,
then a new credential). A close frame ends the session as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from urllib.parse import parse_qs

import numpy as np
from aiohttp import WSCloseCode, WSMsgType, web

from runtime.engine.api import node_full_message
from runtime.frontend.codecs.kyutai_audio import make_codec
from runtime.frontend.codecs.protocol import (
    AudioFormat,
    AudioMessage,
    MetadataMessage,
    PingMessage,
    ProtocolError,
    encode_audio,
    encode_error,
    encode_handshake,
    encode_metadata,
    encode_ping,
    encode_text,
    parse_client_message,
)
from runtime.frontend.gate.admission import Admitted
from runtime.frontend.gate.query import (
    TEXT_PROMPT_IN_METADATA,
    ResumePresented,
    SessionRequest,
    parse_prompt_metadata,
    parse_session_query,
)
from runtime.frontend.gate.refusals import (
    CLOSE_GOING_AWAY,
    CLOSE_POLICY,
    SessionRefused,
)
from runtime.frontend.gate.slot_load import Reservation, SlotLoad
from runtime.frontend.gate.tokens import SUBPROTOCOL_PREFIX, TokenClaims
from runtime.frontend.session.conversation import ChatSession, FrontEnd, SessionOutcome, plan_session
from runtime.frontend.session.lifecycle import Edge, TransportClosed, run

__all__ = [
    "HEARTBEAT_S",
    "METADATA_PROMPT_TIMEOUT_S",
    "DuplexWebSocket",
    "handle",
    "serve_chat",
    "token_subprotocol",
]

log = logging.getLogger(__name__)

METADATA_PROMPT_TIMEOUT_S = 10.0
"""With ``text_prompt_in=metadata``: longest wait for the 0x04 message carrying the text prompt."""
FULL_RETRY_AFTER_S = 5
"""``Retry-After`` (s) of a 503 ``node_full`` before the upgrade (as WebRTC's offer refusals:
``runtime.frontend.transports.webrtc.signalling.RETRY_AFTER_S``)."""
HEARTBEAT_S = 20.0
"""A ping every 20 s; a client that has not answered within half of it is closed (websockets' defaults
before: a dead peer behind a NAT does not hold a slot until TCP gives up)."""
CLOSE_TIMEOUT_S = 10.0
"""How long a close waits for the client's close frame (the slot is already released by then)."""
_FATAL_PROTOCOL_REASONS = frozenset({"bad_opus"})
"""Errors after which the session's input cannot recover: the session is closed (1008)."""


class ConnectionClosed(TransportClosed):
    """The client's WebSocket is closed (or closing): nothing more will be read from it."""


class DuplexWebSocket(web.WebSocketResponse):
    """aiohttp's server WebSocket, with :attr:`closing` set as soon as the server decides to close (a close
    frame about to be sent: e.g. aiohttp failing the connection on an invalid UTF-8 text frame with 1007,
    or answering the client's close), before the closing handshake ends."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.closing = asyncio.Event()
        self.close_sent: int | None = None
        """The code of the server's own close frame (None until it sends one)."""
        self.server_ended = False
        """The server decided to close (:meth:`end`), as opposed to a close aiohttp makes when the
        connection is already gone."""
        self.reservation = Reservation(None)
        """The upgrade's count in ``FrontEnd.upgrades`` until its session holds a slot (none for a resume:
        its slot is held already)."""

    async def close(self, *, code: int = WSCloseCode.OK, message: bytes = b"", drain: bool = True) -> bool:
        self.closing.set()
        if self.close_sent is None and not self.closed:
            self.close_sent = code
        return await super().close(code=code, message=message, drain=drain)

    @property
    def transport(self) -> asyncio.BaseTransport | None:
        """The connection's socket transport (None before :meth:`prepare` or after the connection ended)."""
        request = self._req
        return None if request is None else request.transport

    async def recv(self) -> bytes | str:
        """The next data message (binary as bytes, text as str); pings are answered by aiohttp.

        Raises:
            ConnectionClosed: the client closed, the connection failed, or the server is closing it.
        """
        message = await self.receive()
        if message.type in (WSMsgType.BINARY, WSMsgType.TEXT):
            return message.data  # type: ignore[no-any-return]
        self.closing.set()
        raise ConnectionClosed(f"websocket {message.type.name.lower()}")

    async def send(self, payload: bytes) -> None:
        """Send a binary message.

        Raises:
            ConnectionClosed: the connection is closed or closing.
        """
        if self.closed:
            raise ConnectionClosed("websocket closed")
        try:
            await self.send_bytes(payload)
        except ConnectionError as exc:  # aiohttp: "Cannot write to closing transport"
            raise ConnectionClosed(str(exc)) from None

    async def end(self, code: int, reason: str) -> None:
        """Close with ``code`` and ``reason`` (cut to the 123 bytes a close frame carries); no error when it
        is already closed."""
        self.server_ended = True
        with contextlib.suppress(ConnectionError):
            await self.close(code=code, message=reason.encode()[:123])


class _WsTransport(Edge):
    """The session's edges on a Kyutai WebSocket (``runtime.frontend.session.lifecycle`` runs the rest).

    Its codec (``runtime.frontend.codecs.kyutai_audio`` ``make_codec``, from the request's ``format``)
    decodes the client's 0x01 payloads into frames and encodes each outbound ``[1920]`` frame into one 0x01
    payload (none while sphn's writer fills a page). One reader, from the upgrade: until the handshake it
    drops what the client sends (Kyutai's client sends audio before it), so a client leaving while it waits
    for a slot or while its persona prompt runs is seen at once; from the handshake on, audio goes to the
    session and pings are echoed. The connection's end is the transport's (:meth:`Edge.end`): lost when it
    ended without a close frame and without the server closing it."""

    def __init__(self, connection: DuplexWebSocket, front: FrontEnd, audio_format: AudioFormat) -> None:
        super().__init__()
        self.connection = connection
        self.front = front
        config = front.config
        self.audio_format = audio_format.value
        self.assembler, self.encoder = make_codec(
            audio_format,
            config.max_inbox_frames,
            opus_encoder=config.opus_encoder,
            opus_complexity=config.opus_complexity,
        )
        self._live = False
        self._reader = asyncio.create_task(self._read(), name="websocket reader")
        self._watch = asyncio.ensure_future(connection.closing.wait())
        # The slot goes back as soon as the connection closes, unless a lost connection may be resumed (the
        # lifecycle decides then: held, or finished).
        self._watch.add_done_callback(self._on_closing)

    def _on_closing(self, _: object) -> None:
        session = self.session
        if session is not None and not (session.offers_resume and not self.connection.server_ended):
            session.release()

    def decode(self, payload: bytes) -> list[np.ndarray]:
        """One client audio payload -> the whole ``[1920]`` float32 frames it completes.

        Raises:
            ProtocolError: ``bad_opus``, ``bad_pcm`` or ``too_fast`` (``FrameAssembler.push``).
        """
        return self.assembler.push(payload)

    async def _read(self) -> None:
        try:
            outcome = await _receive_loop(self.front, self)
        except ConnectionClosed:
            outcome = SessionOutcome("client_closed", lost=_lost(self.connection))
        self.end(outcome)

    async def send_audio(self, pcm: np.ndarray) -> None:
        payload = self.encoder.encode(pcm)
        if payload:
            await self.connection.send(encode_audio(payload))

    async def send_text(self, piece: str) -> None:
        await self.connection.send(encode_text(piece))

    async def send_handshake(self) -> None:
        self._live = True  # what the client sends from now on is the conversation's
        await self.connection.send(encode_handshake())

    async def send_metadata(self, body: dict[str, object]) -> None:
        await self.connection.send(encode_metadata(body))

    async def send_error(self, message: str) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self.connection.send(encode_error(message))

    async def admitted(self, session: ChatSession) -> SessionOutcome | None:
        self.connection.reservation.release()  # the slot is counted as in use now
        return await super().admitted(session)

    async def refuse(self, exc: SessionRefused, *, counted: bool) -> None:
        self.connection.reservation.release()
        await self._stop()
        await refuse(self.front, self.connection, exc, resume=None if counted else False)

    async def close(self, code: int, reason: str) -> None:
        """The server closes (a drain: 1001, the engine's loss, a resume elsewhere): a normal end."""
        drained = code == CLOSE_GOING_AWAY and self.front.draining
        self.end(SessionOutcome("drained", CLOSE_GOING_AWAY) if drained else SessionOutcome("client_closed"))
        await self.connection.end(code, reason)

    async def shutdown(self, outcome: SessionOutcome, held: bool) -> None:
        await self._stop()
        if not held:  # a held session's connection is gone already
            await self.connection.end(outcome.close_code, outcome.reason)

    async def _stop(self) -> None:
        self._watch.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


def token_subprotocol(headers: Iterable[str]) -> str | None:
    """The ``duplex.token.<jwt>`` subprotocol among the ``Sec-WebSocket-Protocol`` header values, to be
    selected: a browser fails the handshake unless the server names one of the subprotocols it offered."""
    for header in headers:
        for offered in header.split(","):
            offered = offered.strip()
            if offered.startswith(SUBPROTOCOL_PREFIX):
                return offered
    return None


async def serve_chat(front: FrontEnd, request: web.Request, admitted: Admitted) -> web.StreamResponse:
    """Upgrade an admitted ``/api/chat`` request (its token and origin checked) and run its session;
    426 with ``Upgrade: websocket`` and ``Sec-WebSocket-Version: 13`` when it is not a valid WebSocket
    version 13 upgrade (RFC 6455, 4.2.2 and 4.4). ``admitted``: what the gate let through
    (``runtime.frontend.gate.admission.admit``: claims, client, the resume credential as presented); a
    ``duplex.resume.<credential>`` subprotocol is the one selected (before ``duplex.token.<jwt>``: a resume
    needs no token), even when the resume is then refused, so a browser reads the refusal's 0x05."""
    claims, client, resume = admitted.claims, admitted.client, admitted.presented
    offered = resume.subprotocol or token_subprotocol(request.headers.getall("Sec-WebSocket-Protocol", ()))
    connection = DuplexWebSocket(
        protocols=(offered,) if offered else (),
        max_msg_size=front.config.max_message_bytes,
        compress=False,
        heartbeat=HEARTBEAT_S,
        timeout=CLOSE_TIMEOUT_S,
    )
    # aiohttp also accepts the drafts' versions 7 and 8; this protocol is RFC 6455's (13) only.
    version_13 = request.headers.get("Sec-WebSocket-Version", "").strip() == "13"
    if not version_13 or not connection.can_prepare(request).ok:
        answer = web.Response(
            status=426,
            text="this route speaks WebSocket only: send an Upgrade: websocket request (version 13)\n",
            content_type="text/plain",
        )
        answer.headers["Upgrade"] = "websocket"
        answer.headers["Sec-WebSocket-Version"] = "13"
        return answer
    if not resume.given and front.config.full_before_upgrade:
        full = full_before_upgrade(front)
        if full is not None:
            return full
    # Counted until the session holds a slot (or never will): racing upgrades cannot all pass the check
    # above for one free slot, and the load report counts them meanwhile.
    if not resume.given:
        connection.reservation = front.upgrades.reserve()
    try:
        await connection.prepare(request)
        # The query the gate parsed (once); a query that did not parse goes as its text, for plan_session to
        # refuse it naming the parameter.
        query = admitted.request if admitted.request is not None else request.query_string
        await handle(front, connection, query, claims, client, resume)
    finally:
        connection.reservation.release()
    return connection


def full_before_upgrade(front: FrontEnd) -> web.Response | None:
    """With ``full_before_upgrade``: a 503 ``node_full`` with ``Retry-After`` when no slot and no waiting-room
    place is left for a new caller (``SlotLoad.takes_upgrade``), before any upgrade, so that the global
    entry's retry policy tries another pod (issue 33); counted as a refusal. None when there is room. Used
    by ``/api/chat`` and the phone carriers' routes alike."""
    load = SlotLoad.of(front.backend.status(), front.upgrades.count)
    if load.takes_upgrade(front.config):
        return None
    front.metrics.refused("node_full", resume=False)
    message = node_full_message(load.slots)
    log.info("refused before the upgrade: %s", message)
    answer = web.Response(status=503, text=f"node_full: {message}\n", content_type="text/plain")
    answer.headers["Retry-After"] = str(FULL_RETRY_AFTER_S)
    answer.force_close()
    return answer


async def refuse(
    front: FrontEnd, connection: DuplexWebSocket, exc: SessionRefused, *, resume: bool | None = False
) -> None:
    """A refusal after the upgrade: counted once (``RuntimeMetrics.refused``: ``resume`` True for a
    connection that presented a resume credential; None: counted already), a 0x05 error with its sentence,
    then its close code."""
    if resume is not None:
        front.metrics.refused(exc.reason, resume=resume)
    log.info("refused session: %s", exc.message)
    with contextlib.suppress(ConnectionClosed):
        await connection.send(encode_error(exc.message))
    await connection.end(exc.kind.close_code, exc.message[:120])


async def handle(
    front: FrontEnd,
    connection: DuplexWebSocket,
    query: str | SessionRequest,
    claims: TokenClaims | None,
    client: str,
    presented: ResumePresented | None = None,
) -> None:
    """One ``/api/chat`` connection, from the upgrade to the close. ``query``: the request the gate parsed
    (``Admitted.request``), or the raw query string (one that did not parse is refused naming the
    parameter); ``presented``: the resume credential as the request presented it (None: only a
    ``?resume=`` in a raw ``query``)."""
    if presented is None:
        raw = query if isinstance(query, str) else ""
        presented = ResumePresented.of(next(iter(parse_qs(raw).get("resume", ())), None), ())
    resume = presented.given  # its refusals count in duplex_resume_refused_total only
    try:
        prompt = await _metadata_prompt(front, connection, query)
        request, sampling = plan_session(front, query, prompt, presented)
    except ProtocolError as exc:
        await refuse(front, connection, SessionRefused("bad_request", f"bad request: {exc}"), resume=resume)
        return
    except SessionRefused as exc:
        await refuse(front, connection, exc, resume=resume)
        return
    except ConnectionClosed:
        return
    if request.ignored_params:
        log.debug("ignored query parameters: %s", ", ".join(request.ignored_params))
    if front.draining:
        await refuse(front, connection, SessionRefused("draining"), resume=resume)
        return
    await run(front, _WsTransport(connection, front, request.format), request, sampling, claims, client)


def _lost(connection: DuplexWebSocket, message_type: WSMsgType | None = None) -> bool:
    """The connection ended without a close frame from the client and without the server closing it (a
    reset, a peer that stopped answering the heartbeat: 1006, RFC 6455 7.1.5). ``message_type``: what the
    last ``receive`` returned (CLOSED: the stream ended without a close frame), if that is how it ended."""
    if connection.server_ended:
        return False
    return message_type is WSMsgType.CLOSED or connection.close_code in (None, WSCloseCode.ABNORMAL_CLOSURE)


async def _receive_loop(front: FrontEnd, transport: _WsTransport) -> SessionOutcome:
    """Read client messages until the client leaves: dropped before the handshake; then audio, decoded by
    the transport, goes to the session and pings are echoed."""
    metrics = front.metrics
    connection = transport.connection
    while True:
        message = await connection.receive()
        if message.type is WSMsgType.ERROR:
            # aiohttp has failed the connection (a frame over max_msg_size: 1009; invalid UTF-8: 1007)
            # and sent its close frame; or the connection broke (1006: lost).
            log.debug("websocket failed: %s", message.data)
            code = connection.close_code or CLOSE_POLICY
            lost = code == WSCloseCode.ABNORMAL_CLOSURE and _lost(connection)
            return SessionOutcome("client_closed", code, lost=lost)
        if message.type not in (WSMsgType.BINARY, WSMsgType.TEXT):
            lost = message.type is not WSMsgType.CLOSE and _lost(connection, message.type)
            return SessionOutcome("client_closed", lost=lost)
        session = transport.session
        if not transport._live or session is None:
            continue  # before the handshake: dropped, as moshi's server does
        try:
            parsed = parse_client_message(message.data, max_message_bytes=front.config.max_message_bytes)
            if isinstance(parsed, PingMessage):
                # Echoed unchanged: the client times the round trip (the web client shows it in ms).
                await connection.send(encode_ping(parsed.payload))
            elif isinstance(parsed, AudioMessage):
                for frame in transport.decode(parsed.payload):
                    session.push_samples(frame)
            # control and metadata carry nothing the batch needs
        except ProtocolError as exc:
            metrics.protocol_errors.labels(reason=exc.reason).inc()
            if exc.reason == "too_fast":
                metrics.frames_dropped.labels(reason="input_overflow").inc()
            await connection.send(encode_error(f"{exc.reason}: {exc}"))
            if exc.reason in _FATAL_PROTOCOL_REASONS:
                return SessionOutcome(f"protocol_{exc.reason}", CLOSE_POLICY)


async def _metadata_prompt(
    front: FrontEnd, connection: DuplexWebSocket, query: str | SessionRequest
) -> str | None:
    """With ``text_prompt_in=metadata``, the text prompt from the client's first message (a 0x04 metadata
    ``{"text_prompt": ...}``); None otherwise (a bad query is left to ``plan_session``).

    Raises:
        ProtocolError: ``bad_metadata``: another kind of message first, a bad object, a prompt over the
            limit, or nothing within ``METADATA_PROMPT_TIMEOUT_S``.
        ConnectionClosed: the client left.
    """
    if isinstance(query, str):  # a raw query: parsed here (the gate's parse is passed in when it has one)
        try:
            query = parse_session_query(query)
        except ProtocolError:
            return None
    wanted = query.text_prompt_in == TEXT_PROMPT_IN_METADATA
    if not wanted:
        return None
    try:
        async with asyncio.timeout(METADATA_PROMPT_TIMEOUT_S):
            message = await connection.recv()
    except TimeoutError:
        raise ProtocolError(
            "bad_metadata",
            f"text_prompt_in=metadata: no 0x04 metadata message within {METADATA_PROMPT_TIMEOUT_S:g} s",
        ) from None
    parsed = parse_client_message(message, max_message_bytes=front.config.max_message_bytes)
    if not isinstance(parsed, MetadataMessage):
        raise ProtocolError(
            "bad_metadata",
            f'text_prompt_in=metadata: the first message must be 0x04 metadata {{"text_prompt": ...}}, '
            f"got {type(parsed).__name__}",
        )
    return parse_prompt_metadata(parsed.data)
