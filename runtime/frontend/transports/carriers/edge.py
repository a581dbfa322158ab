"""A phone carrier's media stream on the lifecycle's seam (``runtime.frontend.session.lifecycle.run``): one
call in one batched slot, whatever the carrier. What differs per carrier (its messages' names and fields,
its signature, its audio encoding) is its ``Dialect`` (``dialect.py``; ``twilio.py``, ``plivo.py``,
``telnyx.py``, ``exotel.py``); what is the same is here: the upgrade's gate, the ``start`` message and the
token's half of the gate (or, for a carrier that admits on its credential, its persona policy), pacing the
agent's audio in 20 ms packets with a checkpoint after each 80 ms frame, barge-in, the hold tone, DTMF to
the session's events, and bad input.

Admission: :func:`runtime.frontend.gate.admission.admit_connection` and the dialect's upgrade check (404
``carrier_off`` without the node's secret for that carrier, 403 ``carrier_signature``) before the upgrade,
then :func:`runtime.frontend.gate.admission.admit_token` on the ``start`` message's parameters (``token``,
``voice_prompt``, ``text_prompt`` and any other ``/api/chat`` query parameter; where they travel is the
dialect's). A refusal after the upgrade closes the WebSocket with the refusal's close code and its reason,
counted once in ``duplex_admissions_refused_total``.

While the caller waits for a slot (the waiting room) and its persona prompt runs, it hears a hold tone, not
silence. Barge-in: when the caller starts speaking (:data:`BARGE_IN_PACKETS` packets in a row over
:data:`BARGE_IN_DBFS`) while the agent's speech is queued at the carrier (a frame over
:data:`AGENT_SPEECH_DBFS` sent and its checkpoint not yet played back), one clear empties the carrier's
queue so the caller does not hear stale speech. Once per onset: the full-duplex model itself yields the
floor, and clearing every 60 ms while the caller talks would cut the agent's backchannel too. A hang-up, or
the socket's end, releases the slot at once (:meth:`Edge.end`); a call is not resumed (no carrier here
reconnects a stream).

Bad input after ``start`` (an unknown event, a second ``start``, a payload that is not base64 or not 10-200
ms of audio, a binary frame, a message over ``DUPLEX_MAX_MESSAGE_BYTES``) closes that stream with 1008 (1009
for the size) and a log line naming it on the dialect's logger; its slot is released at once and the other
calls go on.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import time
from urllib.parse import urlencode

import numpy as np
from aiohttp import WSMsgType, web

from runtime.frontend.codecs.protocol import ProtocolError
from runtime.frontend.codecs.telephony import PACKET_MS, PhoneAudioIn, PhoneAudioOut
from runtime.frontend.gate.admission import GateRefused, admit_token
from runtime.frontend.gate.query import SessionRequest, parse_session_query
from runtime.frontend.gate.refusals import (
    CARRIER_OFF_MESSAGE,
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    REFUSALS,
    SessionRefused,
)
from runtime.frontend.gate.tokens import TokenClaims
from runtime.frontend.session.conversation import ChatSession, FrontEnd, SessionOutcome, plan_session
from runtime.frontend.session.lifecycle import Edge, TransportClosed, run
from runtime.frontend.transports.carriers.dialect import CallStart, CarrierProtocolError, Dialect
from runtime.frontend.transports.websocket import (
    HEARTBEAT_S,
    ConnectionClosed,
    DuplexWebSocket,
    full_before_upgrade,
)

__all__ = [
    "AGENT_SPEECH_DBFS",
    "BARGE_IN_DBFS",
    "BARGE_IN_PACKETS",
    "START_TIMEOUT_S",
    "CarrierStream",
    "hold_tone",
    "serve_stream",
    "serve_upgrade",
]

START_TIMEOUT_S = 10.0
"""Longest wait after the upgrade for the carrier's ``start`` message (each sends it at once)."""
BARGE_IN_DBFS = -35.0
"""A caller packet this loud (RMS, dB relative to full scale) counts as speech for barge-in."""
BARGE_IN_PACKETS = 3
"""Packets of speech in a row (3 x 20 ms = 60 ms) that make a barge-in."""
AGENT_SPEECH_DBFS = -40.0
"""An agent frame this loud (RMS) is speech worth clearing; quieter frames (the model listening) are not."""
MIN_PACKET_MS, MAX_PACKET_MS = 10, 200
"""A ``media`` payload's allowed length: 10 to 200 ms of audio (carriers send 20 ms; Exotel up to 100)."""
HOLD_TONE_AFTER_S = 1.0
"""How long a caller not yet live hears silence before the hold tone starts."""
HOLD_TONE_HZ = 425.0
"""The hold tone's pitch: ITU-T E.180's comfort tones are 400-450 Hz."""
TOKEN_PARAMETER = "token"
"""The call parameter that carries the session token (every carrier)."""
_FRAME_SAMPLES = 1920
"""The model's frame: 80 ms at 24000 Hz."""


def hold_tone(seconds: float, rate_hz: int = 24000) -> np.ndarray:
    """``[rate_hz * seconds]`` float32 from the call's pickup: silence for :data:`HOLD_TONE_AFTER_S`, then a
    soft 425 Hz tone (-20 dBFS) 0.4 s on in every 2 s. A caller admitted at once (the persona prompt takes
    well under a second) hears no beep; one waiting for a slot hears the tone."""
    t = np.arange(int(rate_hz * seconds), dtype=np.float32) / rate_hz
    on = (t >= HOLD_TONE_AFTER_S) & (((t - HOLD_TONE_AFTER_S) % 2.0) < 0.4)
    return (0.1 * np.sin(2 * np.pi * HOLD_TONE_HZ * t) * on).astype(np.float32)


class CarrierStream(Edge):
    """A phone call's edges on a carrier's media stream (the module doc); the reader starts with
    :meth:`listen`."""

    audio_format = "pcmu"

    def __init__(self, front: FrontEnd, connection: DuplexWebSocket, dialect: Dialect) -> None:
        super().__init__()
        self.front, self.connection, self.dialect = front, connection, dialect
        self.name = dialect.name
        self.log = dialect.log
        start = dialect.start
        self.stream_id, self.call_id = start.stream_id, start.call_id
        self.audio_in = PhoneAudioIn(start.encoding, start.rate_hz)
        self.audio_out = PhoneAudioOut(start.encoding, start.rate_hz)
        width = start.rate_hz // 1000 * start.encoding.bytes_per_sample
        self.packet_bytes = (MIN_PACKET_MS * width, MAX_PACKET_MS * width)
        """A ``media`` payload's allowed size in bytes (80-1600 for G.711 at 8000 Hz)."""
        self.marks_pending: set[str] = set()
        """Checkpoints sent whose audio the carrier has not played yet: the agent's audio queued there."""
        self.speech_marks: set[str] = set()
        """Of :attr:`marks_pending`, those after a frame of agent speech (over :data:`AGENT_SPEECH_DBFS`)."""
        self.barge_ins = 0
        self._marks_sent = 0
        self._speech_run = 0
        self._live = False
        self._reader: asyncio.Task[None] | None = None
        self._holding: asyncio.Task[None] | None = None

    def listen(self) -> None:
        """Start reading the stream (after ``start``)."""
        self._reader = asyncio.create_task(self._read(), name=f"{self.name} {self.stream_id}")

    # --- in ------------------------------------------------------------------------------------------

    async def _read(self) -> None:
        outcome = SessionOutcome("client_closed", lost=True)
        try:
            while True:
                message = await self.connection.receive()
                if message.type is not WSMsgType.TEXT:
                    # Closed without a stop; a binary frame (the carriers here send none); a message over
                    # the size limit (aiohttp has closed with 1009).
                    if message.type is WSMsgType.BINARY:
                        raise CarrierProtocolError(
                            "binary_frame", f"a binary frame ({self.name} sends JSON text)"
                        )
                    if message.type is WSMsgType.ERROR:
                        self.log.info("%s stream %s: %s: closing", self.name, self.stream_id, message.data)
                    break
                event = json.loads(message.data)
                if not isinstance(event, dict):
                    raise CarrierProtocolError("bad_message", "a message that is not a JSON object")
                parsed = self.dialect.parse(event)
                if parsed.kind == "stop":
                    outcome = SessionOutcome("client_closed")  # the call hung up: a normal end
                    break
                if parsed.kind == "media":
                    self._on_media(parsed.payload)
                elif parsed.kind == "played":
                    self.marks_pending.discard(parsed.name)
                    self.speech_marks.discard(parsed.name)
                elif parsed.kind == "dtmf":
                    self._on_dtmf(parsed.digit)
                elif parsed.kind == "start":
                    raise CarrierProtocolError("replayed_start", "a second start message on one stream")
        except CarrierProtocolError as exc:
            self.log.info("%s stream %s: %s: closing", self.name, self.stream_id, exc)
            outcome = SessionOutcome(f"protocol_{exc.reason}", CLOSE_POLICY)
        except (ValueError, AttributeError, TypeError, binascii.Error) as exc:
            self.log.info("%s stream %s: bad message (%s): closing", self.name, self.stream_id, exc)
            outcome = SessionOutcome("protocol_bad_message", CLOSE_POLICY)
        except ConnectionError:
            pass
        self.end(outcome)

    def _on_media(self, encoded: str) -> None:
        payload = base64.b64decode(encoded, validate=True)
        low, high = self.packet_bytes
        if not low <= len(payload) <= high:
            start = self.dialect.start
            raise CarrierProtocolError(
                "bad_packet",
                f"a media payload of {len(payload)} bytes; allowed {low}-{high} ({MIN_PACKET_MS}-"
                f"{MAX_PACKET_MS} ms of {start.encoding.value} at {start.rate_hz} Hz; {PACKET_MS} ms is "
                f"{low * PACKET_MS // MIN_PACKET_MS} bytes)",
            )
        pcm = self.audio_in.decode(payload)
        session = self.session
        if session is None or not self._live or not session.takes_audio:
            return  # before the slot is live: dropped, as the other transports do
        self._barge_in_check()
        session.push_samples(pcm)

    def _barge_in_check(self) -> None:
        """Count packets of caller speech; the onset (the :data:`BARGE_IN_PACKETS`-th in a row) while agent
        speech is queued at the carrier sends its clear (the task it starts)."""
        speech = self.audio_in.level_dbfs >= BARGE_IN_DBFS
        self._speech_run = self._speech_run + 1 if speech else 0
        if self._speech_run == BARGE_IN_PACKETS and self.speech_marks:
            self.marks_pending.clear()
            self.speech_marks.clear()
            self.audio_out.discard()
            self.barge_ins += 1
            self.front.metrics.carrier_barge_ins.labels(carrier=self.name).inc()
            asyncio.ensure_future(self._send_json(self.dialect.clear()))

    def _on_dtmf(self, digit: str) -> None:
        session, store = self.session, self.front.store
        self.front.metrics.carrier_dtmf.labels(carrier=self.name).inc()
        if session is not None and store is not None and digit:
            store.record_event(session.session_id, "dtmf", {"digit": digit[:1], "carrier": self.name})

    # --- out -----------------------------------------------------------------------------------------

    async def _send_json(self, body: dict[str, object]) -> None:
        if self.connection.closed:
            raise TransportClosed(f"{self.name} stream closed")
        try:
            await self.connection.send_str(json.dumps(body, separators=(",", ":")))
        except ConnectionError as exc:
            raise TransportClosed(str(exc)) from None

    async def _send_packets(self, pcm: np.ndarray, *, mark: bool) -> None:
        power = float(np.mean(np.square(pcm, dtype=np.float64))) if pcm.size else 0.0
        speech = power > 0 and 10 * np.log10(power) >= AGENT_SPEECH_DBFS
        for packet in self.audio_out.encode(pcm):
            await self._send_json(self.dialect.media(base64.b64encode(packet).decode()))
        if mark:
            self._marks_sent += 1
            name = f"frame-{self._marks_sent}"
            self.marks_pending.add(name)
            if speech:
                self.speech_marks.add(name)
            await self._send_json(self.dialect.checkpoint(name))

    async def send_audio(self, pcm: np.ndarray) -> None:
        await self._send_packets(pcm, mark=True)

    async def send_text(self, piece: str) -> None:
        """Nothing: a phone call has no text channel (the transcript goes to the store as for any session)."""

    async def _hold(self) -> None:
        """Play the hold tone in real time, one 80 ms frame at a time, until cancelled: its first second
        (silence), then its 2 s cycle again and again."""
        lead = int(HOLD_TONE_AFTER_S * 24000)
        tone = hold_tone(HOLD_TONE_AFTER_S + 2.0)
        step, started, sent = _FRAME_SAMPLES, time.monotonic(), 0
        with contextlib.suppress(TransportClosed):
            while True:
                offset = sent * step
                start = offset if offset < lead else lead + (offset - lead) % (tone.size - lead)
                await self._send_packets(tone[start : start + step], mark=False)
                sent += 1
                await asyncio.sleep(max(0.0, started + sent * 0.08 - time.monotonic()))

    async def prepare(self, session: ChatSession) -> None:
        await super().prepare(session)
        self._holding = asyncio.create_task(self._hold(), name=f"hold tone {self.stream_id}")

    async def _stop_hold(self) -> None:
        if self._holding is not None:
            self._holding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._holding
            self._holding = None
            self.audio_out.discard()

    async def send_handshake(self) -> None:
        await self._stop_hold()
        self._live = True

    async def send_metadata(self, body: dict[str, object]) -> None:
        """Nothing: the resume metadata has no channel here (a stream is not resumed)."""

    async def send_error(self, message: str) -> None:
        self.log.info("%s stream %s: %s", self.name, self.stream_id, message)

    async def refuse(self, exc: SessionRefused, *, counted: bool) -> None:
        await self._stop()
        if not counted:
            self.front.metrics.refused(exc.reason)
        self.log.info("refused %s call %s: %s", self.name, self.call_id, exc.message)
        await self.connection.end(exc.kind.close_code, f"{exc.reason}: {exc.message}")

    async def close(self, code: int, reason: str) -> None:
        self.end(
            SessionOutcome("drained" if code == CLOSE_GOING_AWAY else "closed_by_server", code), hang_up=True
        )
        await self.connection.end(code, reason)

    async def shutdown(self, outcome: SessionOutcome, held: bool) -> None:
        await self._stop()
        await self.connection.end(outcome.close_code or CLOSE_NORMAL, outcome.reason)

    async def _stop(self) -> None:
        await self._stop_hold()
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


async def _start_message(connection: DuplexWebSocket, dialect: type[Dialect]) -> CallStart:
    """Read up to the carrier's ``start`` message (what the dialect skips before it is skipped).

    Raises:
        SessionRefused: ``bad_request``: a message that is not a JSON object, one the dialect refuses, or
            no ``start`` within :data:`START_TIMEOUT_S`.
        ConnectionClosed: the carrier left.
    """
    label = dialect.name.capitalize()
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            while True:
                data = await connection.recv()
                try:
                    event = json.loads(data)
                except ValueError:
                    event = None
                if not isinstance(event, dict):
                    raise SessionRefused("bad_request", f"bad request: a {label} message that is not JSON")
                start = dialect.read_start(event)
                if start is not None:
                    return start
    except TimeoutError:
        raise SessionRefused(
            "bad_request", f"bad request: no {label} start message within {START_TIMEOUT_S:g} s"
        ) from None


async def _admit(
    front: FrontEnd, dialect: type[Dialect], token: str | None, request: SessionRequest
) -> TokenClaims | None:
    """The token's half of the gate (:func:`admit_token`), or, for a dialect that admits on the carrier's
    credential, its persona policy (no claims: no token to spend, no recording consent).

    Raises:
        GateRefused: the token's refusal, or ``persona_not_allowed`` (counted).
    """
    if not dialect.admits_on_credential:
        return await admit_token(front.access, front.metrics, token, request)
    refusal = dialect.check_persona(front.config, request.voice_prompt)
    if refusal is not None:
        front.metrics.refused("persona_not_allowed")
        raise GateRefused("persona_not_allowed", refusal, resume=False)
    return None


async def serve_upgrade(
    front: FrontEnd, request: web.Request, client: str, dialect: type[Dialect]
) -> web.StreamResponse:
    """``GET <dialect.path>`` past the connection's gate (rate limits): 404 ``carrier_off`` without the
    node's secret for that carrier, 403 ``carrier_signature`` when the dialect finds no valid signature
    (each counted once, before any work), 426 for a request that is not a WebSocket upgrade, and with
    ``full_before_upgrade`` 503 ``node_full`` + ``Retry-After`` when no slot or waiting-room place is left
    (the global entry retries it on another pod); else the upgrade and :func:`serve_stream`."""
    secret = dialect.secret(front.config)
    refusal: SessionRefused | None = None
    if secret is None:
        refusal = SessionRefused(
            "carrier_off", f"{CARRIER_OFF_MESSAGE} ({dialect.name}: set {dialect.secret_env})"
        )
    elif not dialect.signed(front.config, secret, request):
        refusal = SessionRefused("carrier_signature")
    if refusal is not None:
        front.metrics.refused(refusal.reason)
        dialect.log.info("refused %s stream from %s: %s", dialect.name, client, refusal.message)
        answer = web.Response(status=refusal.kind.status, text=f"{refusal.reason}: {refusal.message}\n")
        answer.force_close()
        return answer
    connection = DuplexWebSocket(
        max_msg_size=front.config.max_message_bytes, compress=False, heartbeat=HEARTBEAT_S
    )
    if not connection.can_prepare(request).ok:
        answer = web.Response(
            status=426, text=f"this route speaks WebSocket only ({dialect.name} media streams)\n"
        )
        answer.headers["Upgrade"] = "websocket"
        answer.force_close()
        return answer
    if front.config.full_before_upgrade:  # multi-region: a full pod's 503 is retried on another (issue 33)
        full = full_before_upgrade(front)
        if full is not None:
            return full
    carried = dialect.upgrade_parameters(request)
    await connection.prepare(request)
    await serve_stream(front, connection, client, dialect, carried)
    return connection


async def serve_stream(
    front: FrontEnd,
    connection: DuplexWebSocket,
    client: str,
    dialect: type[Dialect],
    carried: dict[str, str] | None = None,
) -> None:
    """One media stream after its upgrade (its signature checked): the ``start`` message, the token's half
    of the gate on the call's parameters (``carried`` by the upgrade, then the ``start`` message's over
    them), then the conversation (:func:`run`)."""
    log = dialect.log
    try:
        start = await _start_message(connection, dialect)
        parameters = {**(carried or {}), **start.parameters}
        token = parameters.get(TOKEN_PARAMETER)
        query = urlencode({k: v for k, v in parameters.items() if k != TOKEN_PARAMETER})
        request = parse_session_query(query)
        claims = await _admit(front, dialect, token or None, request)
        request, sampling = plan_session(front, request)
        if front.draining:
            raise SessionRefused("draining")
    except ConnectionClosed:
        return
    except GateRefused as refused:  # counted by the gate
        await connection.end(
            REFUSALS[refused.reason].close_code, f"{refused.reason}: {refused.message}"[:120]
        )
        return
    except SessionRefused as exc:
        front.metrics.refused(exc.reason)
        log.info("refused %s call: %s", dialect.name, exc.message)
        await connection.end(exc.kind.close_code, f"{exc.reason}: {exc.message}"[:120])
        return
    except ProtocolError as exc:  # a parameter the query parser refuses, named to the caller
        front.metrics.refused("bad_request")
        await connection.end(CLOSE_POLICY, f"bad_request: {exc}"[:120])
        return
    edge = CarrierStream(front, connection, dialect(start))
    edge.listen()
    await run(front, edge, request, sampling, claims, client)
