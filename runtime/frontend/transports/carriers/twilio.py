"""Twilio Media Streams (bidirectional ``<Connect><Stream>``) on ``/api/carriers/twilio``: one transport on
the lifecycle's seam (``runtime.frontend.session.lifecycle.run``), a phone call in one batched slot.

Messages (JSON text frames; Twilio's "Media Streams - WebSocket Messages" reference):

- in: ``connected``; ``start`` (``streamSid``, ``start.callSid``, ``start.customParameters``: the TwiML's
  ``<Parameter>`` elements, ``start.mediaFormat``: ``audio/x-mulaw`` at 8000 Hz mono); ``media``
  (``media.payload``: base64 of 20 ms of μ-law); ``dtmf`` (``dtmf.digit``); ``mark`` (``mark.name``: a mark
  this side sent, played out); ``stop``.
- out: ``media`` (base64 μ-law, 20 ms each), ``mark`` after each model frame (80 ms), ``clear`` (barge-in).

Admission: :func:`runtime.frontend.gate.admission.admit_connection` and the ``X-Twilio-Signature`` before the
upgrade (``runtime.frontend.gate.carrier_auth``), then :func:`runtime.frontend.gate.admission.admit_token` on
the ``start`` message: Twilio sends no ``Authorization`` header and drops a stream URL's query string, so
the session token, voice and role prompt come as custom parameters (``token``, ``voice_prompt``,
``text_prompt``, and any other ``/api/chat`` query parameter). A refusal after the upgrade closes the
WebSocket with the refusal's close code and its reason (Twilio ends the ``<Connect>`` and logs it), counted
once in ``duplex_admissions_refused_total``.

While the caller waits for a slot (the waiting room) and its persona prompt runs, it hears a hold tone, not
silence. Barge-in: when the caller starts speaking (:data:`BARGE_IN_PACKETS` packets in a row over
:data:`BARGE_IN_DBFS`) while the agent's speech is queued at Twilio (a frame over :data:`AGENT_SPEECH_DBFS`
sent and its mark not yet played back), one ``clear`` empties Twilio's queue so the caller does not hear
stale speech. Once per onset: the full-duplex model itself yields the floor, and clearing every 60 ms while
the caller talks would cut the agent's backchannel too. ``stop``, or the socket's end, releases the slot at
once (the lifecycle's :meth:`Edge.end`); a call is not resumed (Twilio does not reconnect a stream).

Bad input after ``start`` (an unknown event, a second ``start``, a payload that is not base64 or not 10-200
ms of audio, a binary frame, a message over ``DUPLEX_MAX_MESSAGE_BYTES``) closes that stream with 1008 (1009
for the size) and a log line naming it; its slot is released at once and the other calls go on.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import time
from urllib.parse import urlencode

import numpy as np
from aiohttp import WSMsgType, web

from runtime.frontend.codecs.protocol import ProtocolError
from runtime.frontend.codecs.telephony import CarrierEncoding, PhoneAudioIn, PhoneAudioOut
from runtime.frontend.gate.admission import GateRefused, admit_token
from runtime.frontend.gate.carrier_auth import TWILIO_SIGNATURE_HEADER, twilio_signature_valid
from runtime.frontend.gate.query import parse_session_query
from runtime.frontend.gate.refusals import (
    CARRIER_OFF_MESSAGE,
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    REFUSALS,
    SessionRefused,
)
from runtime.frontend.session.conversation import ChatSession, FrontEnd, SessionOutcome, plan_session
from runtime.frontend.session.lifecycle import Edge, TransportClosed, run
from runtime.frontend.transports.websocket import HEARTBEAT_S, ConnectionClosed, DuplexWebSocket

__all__ = [
    "AGENT_SPEECH_DBFS",
    "BARGE_IN_DBFS",
    "BARGE_IN_PACKETS",
    "MAX_PACKET_BYTES",
    "MIN_PACKET_BYTES",
    "CarrierProtocolError",
    "START_TIMEOUT_S",
    "TWILIO_PATH",
    "TwilioStream",
    "hold_tone",
    "serve_stream",
    "serve_upgrade",
]

log = logging.getLogger(__name__)

TWILIO_PATH = "/api/carriers/twilio"
START_TIMEOUT_S = 10.0
"""Longest wait after the upgrade for Twilio's ``start`` message (it follows ``connected`` at once)."""
BARGE_IN_DBFS = -35.0
"""A caller packet this loud (RMS, dB relative to full scale) counts as speech for barge-in."""
BARGE_IN_PACKETS = 3
"""Packets of speech in a row (3 x 20 ms = 60 ms) that make a barge-in."""
AGENT_SPEECH_DBFS = -40.0
"""An agent frame this loud (RMS) is speech worth clearing; quieter frames (the model listening) are not."""
MIN_PACKET_BYTES, MAX_PACKET_BYTES = 80, 1600
"""A ``media`` payload's allowed size: 10 to 200 ms of 8 kHz μ-law (Twilio sends 160 bytes, 20 ms)."""
HOLD_TONE_AFTER_S = 1.0
"""How long a caller not yet live hears silence before the hold tone starts."""
HOLD_TONE_HZ = 425.0
"""The hold tone's pitch: ITU-T E.180's comfort tones are 400-450 Hz."""
_TOKEN_PARAMETER = "token"


def hold_tone(seconds: float, rate_hz: int = 24000) -> np.ndarray:
    """``[rate_hz * seconds]`` float32 from the call's pickup: silence for :data:`HOLD_TONE_AFTER_S`, then a
    soft 425 Hz tone (-20 dBFS) 0.4 s on in every 2 s. A caller admitted at once (the persona prompt takes
    well under a second) hears no beep; one waiting for a slot hears the tone."""
    t = np.arange(int(rate_hz * seconds), dtype=np.float32) / rate_hz
    on = (t >= HOLD_TONE_AFTER_S) & (((t - HOLD_TONE_AFTER_S) % 2.0) < 0.4)
    return (0.1 * np.sin(2 * np.pi * HOLD_TONE_HZ * t) * on).astype(np.float32)


class CarrierProtocolError(ValueError):
    """A carrier message this bridge refuses: ``reason`` (the outcome ``protocol_<reason>``), and why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TwilioStream(Edge):
    """A phone call's edges on a Twilio Media Stream (the module doc). ``stream_sid``, ``call_sid``: from
    the ``start`` message; the connection's reader is started by :meth:`listen`."""

    name = "twilio"
    audio_format = "pcmu"

    def __init__(self, front: FrontEnd, connection: DuplexWebSocket, stream_sid: str, call_sid: str) -> None:
        super().__init__()
        self.front, self.connection = front, connection
        self.stream_sid, self.call_sid = stream_sid, call_sid
        self.audio_in = PhoneAudioIn(CarrierEncoding.MULAW)
        self.audio_out = PhoneAudioOut(CarrierEncoding.MULAW)
        self.marks_pending: set[str] = set()
        """Marks sent whose audio Twilio has not played yet: the agent's audio queued at Twilio."""
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
        self._reader = asyncio.create_task(self._read(), name=f"twilio {self.stream_sid}")

    # --- in ------------------------------------------------------------------------------------------

    async def _read(self) -> None:
        outcome = SessionOutcome("client_closed", lost=True)
        try:
            while True:
                message = await self.connection.receive()
                if message.type is not WSMsgType.TEXT:
                    # Closed without a stop; a binary frame (Twilio sends none); a message over the size
                    # limit (aiohttp has closed with 1009).
                    if message.type is WSMsgType.BINARY:
                        raise CarrierProtocolError("binary_frame", "a binary frame (Twilio sends JSON text)")
                    if message.type is WSMsgType.ERROR:
                        log.info("twilio stream %s: %s: closing", self.stream_sid, message.data)
                    break
                event = json.loads(message.data)
                kind = event.get("event") if isinstance(event, dict) else None
                if kind == "stop":
                    outcome = SessionOutcome("client_closed")  # the call hung up: a normal end
                    break
                if kind == "media":
                    self._on_media(event.get("media") or {})
                elif kind == "mark":
                    name = str((event.get("mark") or {}).get("name"))
                    self.marks_pending.discard(name)
                    self.speech_marks.discard(name)
                elif kind == "dtmf":
                    self._on_dtmf(str((event.get("dtmf") or {}).get("digit", "")))
                elif kind == "start":
                    raise CarrierProtocolError("replayed_start", "a second start message on one stream")
                else:
                    raise CarrierProtocolError("unknown_event", f"unknown event {str(kind)[:40]!r}")
        except CarrierProtocolError as exc:
            log.info("twilio stream %s: %s: closing", self.stream_sid, exc)
            outcome = SessionOutcome(f"protocol_{exc.reason}", CLOSE_POLICY)
        except (ValueError, AttributeError, binascii.Error) as exc:
            log.info("twilio stream %s: bad message (%s): closing", self.stream_sid, exc)
            outcome = SessionOutcome("protocol_bad_message", CLOSE_POLICY)
        except ConnectionError:
            pass
        self.end(outcome)

    def _on_media(self, media: dict[str, object]) -> None:
        payload = base64.b64decode(str(media.get("payload", "")), validate=True)
        if not MIN_PACKET_BYTES <= len(payload) <= MAX_PACKET_BYTES:
            raise CarrierProtocolError(
                "bad_packet",
                f"a media payload of {len(payload)} bytes; allowed {MIN_PACKET_BYTES}-{MAX_PACKET_BYTES} "
                "(10-200 ms of 8 kHz mu-law; Twilio sends 160: 20 ms)",
            )
        pcm = self.audio_in.decode(payload)
        session = self.session
        if session is None or not self._live or not session.takes_audio:
            return  # before the slot is live: dropped, as the other transports do
        self._barge_in_check()
        session.push_samples(pcm)

    def _barge_in_check(self) -> None:
        """Count packets of caller speech; the onset (the :data:`BARGE_IN_PACKETS`-th in a row) while agent
        speech is queued at Twilio sends ``clear`` (the task it starts)."""
        speech = self.audio_in.level_dbfs >= BARGE_IN_DBFS
        self._speech_run = self._speech_run + 1 if speech else 0
        if self._speech_run == BARGE_IN_PACKETS and self.speech_marks:
            self.marks_pending.clear()
            self.speech_marks.clear()
            self.audio_out.discard()
            self.barge_ins += 1
            self.front.metrics.carrier_barge_ins.labels(carrier=self.name).inc()
            asyncio.ensure_future(self._send_json({"event": "clear", "streamSid": self.stream_sid}))

    def _on_dtmf(self, digit: str) -> None:
        session, store = self.session, self.front.store
        self.front.metrics.carrier_dtmf.labels(carrier=self.name).inc()
        if session is not None and store is not None and digit:
            store.record_event(session.session_id, "dtmf", {"digit": digit[:1], "carrier": self.name})

    # --- out -----------------------------------------------------------------------------------------

    async def _send_json(self, body: dict[str, object]) -> None:
        if self.connection.closed:
            raise TransportClosed("twilio stream closed")
        try:
            await self.connection.send_str(json.dumps(body, separators=(",", ":")))
        except ConnectionError as exc:
            raise TransportClosed(str(exc)) from None

    async def _send_packets(self, pcm: np.ndarray, *, mark: bool) -> None:
        power = float(np.mean(np.square(pcm, dtype=np.float64))) if pcm.size else 0.0
        speech = power > 0 and 10 * np.log10(power) >= AGENT_SPEECH_DBFS
        for packet in self.audio_out.encode(pcm):
            payload = base64.b64encode(packet).decode()
            await self._send_json(
                {"event": "media", "streamSid": self.stream_sid, "media": {"payload": payload}}
            )
        if mark:
            self._marks_sent += 1
            name = f"frame-{self._marks_sent}"
            self.marks_pending.add(name)
            if speech:
                self.speech_marks.add(name)
            await self._send_json({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}})

    async def send_audio(self, pcm: np.ndarray) -> None:
        await self._send_packets(pcm, mark=True)

    async def send_text(self, piece: str) -> None:
        """Nothing: a phone call has no text channel (the transcript goes to the store as for any session)."""

    async def _hold(self) -> None:
        """Play the hold tone in real time, one 80 ms frame at a time, until cancelled: its first second
        (silence), then its 2 s cycle again and again."""
        lead = int(HOLD_TONE_AFTER_S * 24000)
        tone = hold_tone(HOLD_TONE_AFTER_S + 2.0)
        step, started, sent = 1920, time.monotonic(), 0
        with contextlib.suppress(TransportClosed):
            while True:
                offset = sent * step
                start = offset if offset < lead else lead + (offset - lead) % (tone.size - lead)
                await self._send_packets(tone[start : start + step], mark=False)
                sent += 1
                await asyncio.sleep(max(0.0, started + sent * 0.08 - time.monotonic()))

    async def prepare(self, session: ChatSession) -> None:
        await super().prepare(session)
        self._holding = asyncio.create_task(self._hold(), name=f"hold tone {self.stream_sid}")

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
        log.info("twilio stream %s: %s", self.stream_sid, message)

    async def refuse(self, exc: SessionRefused, *, counted: bool) -> None:
        await self._stop()
        if not counted:
            self.front.metrics.refused(exc.reason)
        log.info("refused call %s: %s", self.call_sid, exc.message)
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


async def _start_message(connection: DuplexWebSocket) -> dict[str, object]:
    """Read up to the ``start`` message (``connected`` before it is skipped).

    Raises:
        SessionRefused: ``bad_request``: another event first, a message that is not JSON, a media format
            other than μ-law at 8000 Hz mono, or no ``start`` within :data:`START_TIMEOUT_S`.
        ConnectionClosed: Twilio left.
    """
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            while True:
                data = await connection.recv()
                try:
                    event = json.loads(data)
                except ValueError:
                    raise SessionRefused(
                        "bad_request", "bad request: a Twilio message that is not JSON"
                    ) from None
                kind = event.get("event") if isinstance(event, dict) else None
                if kind == "connected":
                    continue
                if kind != "start" or not isinstance(event.get("start"), dict):
                    raise SessionRefused(
                        "bad_request", f"bad request: expected Twilio's start message, got {kind!r}"
                    )
                start: dict[str, object] = event["start"]
                media = start.get("mediaFormat") or {}
                wanted = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}
                got = {key: media.get(key) for key in wanted} if isinstance(media, dict) else {}
                if got != wanted:
                    raise SessionRefused(
                        "bad_request", f"bad request: media format {got}; this bridge takes {wanted}"
                    )
                start.setdefault("streamSid", event.get("streamSid", ""))
                return start
    except TimeoutError:
        raise SessionRefused(
            "bad_request", f"bad request: no Twilio start message within {START_TIMEOUT_S:g} s"
        ) from None


async def serve_upgrade(front: FrontEnd, request: web.Request, client: str) -> web.StreamResponse:
    """``GET /api/carriers/twilio`` past the connection's gate (rate limits): 404 ``carrier_off`` without
    the node's Twilio secret, 403 ``carrier_signature`` when ``X-Twilio-Signature`` does not sign
    ``DUPLEX_TWILIO_STREAM_URL`` with it (each counted once, before any work), 426 for a request that is not
    a WebSocket upgrade; else the upgrade and :func:`serve_stream`. The secret is read per call (a rotated
    file is picked up)."""
    config = front.config
    secret = config.twilio_secret()
    refusal: SessionRefused | None = None
    if secret is None or config.twilio_stream_url is None:
        refusal = SessionRefused(
            "carrier_off", f"{CARRIER_OFF_MESSAGE} (twilio: set DUPLEX_TWILIO_AUTH_TOKEN)"
        )
    elif not twilio_signature_valid(
        secret, config.twilio_stream_url, request.headers.get(TWILIO_SIGNATURE_HEADER)
    ):
        refusal = SessionRefused("carrier_signature")
    if refusal is not None:
        front.metrics.refused(refusal.reason)
        log.info("refused twilio stream from %s: %s", client, refusal.message)
        answer = web.Response(status=refusal.kind.status, text=f"{refusal.reason}: {refusal.message}\n")
        answer.force_close()
        return answer
    connection = DuplexWebSocket(
        max_msg_size=front.config.max_message_bytes, compress=False, heartbeat=HEARTBEAT_S
    )
    if not connection.can_prepare(request).ok:
        answer = web.Response(status=426, text="this route speaks WebSocket only (Twilio Media Streams)\n")
        answer.headers["Upgrade"] = "websocket"
        answer.force_close()
        return answer
    await connection.prepare(request)
    await serve_stream(front, connection, client)
    return connection


async def serve_stream(front: FrontEnd, connection: DuplexWebSocket, client: str) -> None:
    """One Twilio Media Stream after its upgrade (its signature checked): the ``start`` message, the token's
    half of the gate on its custom parameters, then the conversation (:func:`run`)."""
    try:
        start = await _start_message(connection)
        parameters = start.get("customParameters") or {}
        if not isinstance(parameters, dict):
            raise SessionRefused("bad_request", "bad request: customParameters is not an object")
        token = parameters.get(_TOKEN_PARAMETER)
        query = urlencode({k: str(v) for k, v in parameters.items() if k != _TOKEN_PARAMETER})
        request = parse_session_query(query)
        claims = await admit_token(front.access, front.metrics, str(token) if token else None, request)
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
        log.info("refused call: %s", exc.message)
        await connection.end(exc.kind.close_code, f"{exc.reason}: {exc.message}"[:120])
        return
    except ProtocolError as exc:  # a parameter the query parser refuses, named to the caller
        front.metrics.refused("bad_request")
        await connection.end(CLOSE_POLICY, f"bad_request: {exc}"[:120])
        return
    edge = TwilioStream(front, connection, str(start.get("streamSid", "")), str(start.get("callSid", "")))
    edge.listen()
    await run(front, edge, request, sampling, claims, client)
