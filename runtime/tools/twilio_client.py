"""Twilio's side of a Media Stream, played against a node's ``/api/carriers/twilio``: for the load generator
(``duplex loadgen --transport twilio``) and the tests.

It does what Twilio's media servers do with a bidirectional ``<Connect><Stream>`` (Twilio's "Media Streams -
WebSocket Messages" reference): the upgrade signed with ``X-Twilio-Signature`` (HMAC-SHA1 of the stream URL
with the account's auth token), ``connected`` then ``start`` (a ``streamSid``, a ``callSid``, the
``<Parameter>`` elements as ``customParameters``, ``audio/x-mulaw`` at 8000 Hz), the caller's audio as
``media`` messages of 20 ms paced in real time, ``dtmf`` when asked, then ``stop`` (a hang-up) or a dropped
socket. Outbound audio is "played" on a clock: each 20 ms packet the node sends is queued after the ones
before it, a ``mark`` is echoed back when the audio before it has played out, and a ``clear`` empties the
queue and echoes every pending mark at once, as Twilio does.

Units: caller audio is float32 at 8000 Hz in [-1, 1]; times are monotonic seconds.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import ssl
import time
import uuid
import warnings
from dataclasses import dataclass, field

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from runtime.frontend.gate.carrier_auth import TWILIO_SIGNATURE_HEADER, twilio_signature

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

__all__ = ["PACKET_S", "TwilioCallResult", "twilio_call"]

PACKET_S = 0.02
"""One Twilio media packet: 20 ms (160 μ-law bytes at 8000 Hz)."""


@dataclass
class TwilioCallResult:
    """What one call saw.

    Attributes:
        status: the HTTP status of a refused upgrade (None when upgraded).
        close_code, close_reason: how the node closed the stream (None: this side ended it).
        received: the μ-law bytes of every ``media`` message the node sent, in order.
        packets_before_live: media packets received before the first mark (the hold tone).
        first_audio_s: from the ``start`` message to the first marked (agent) audio packet, or None.
        marks: marks the node sent; clears: ``clear`` messages it sent.
        packets_sent: caller packets sent.
        mark_arrival_s: monotonic arrival time of each mark (one per 80 ms frame of the agent's audio).
        sent_messages, received_messages: the first ``keep_messages`` JSON messages each way (parsed), to
            check against another implementation of the protocol.
        failure: why the call failed, or "".
    """

    status: int | None = None
    close_code: int | None = None
    close_reason: str = ""
    received: bytearray = field(default_factory=bytearray)
    packets_before_live: int = 0
    first_audio_s: float | None = None
    marks: int = 0
    clears: int = 0
    packets_sent: int = 0
    mark_arrival_s: list[float] = field(default_factory=list)
    sent_messages: list[dict[str, object]] = field(default_factory=list)
    received_messages: list[dict[str, object]] = field(default_factory=list)
    failure: str = ""

    def received_pcm(self) -> np.ndarray:
        """``[T]`` float32 at 8000 Hz: the node's audio decoded from μ-law."""
        linear = np.frombuffer(audioop.ulaw2lin(bytes(self.received), 2), dtype="<i2")
        return linear.astype(np.float32) / 32768.0


def _packets(caller_8k: np.ndarray) -> list[str]:
    """Caller audio -> base64 μ-law payloads of 160 samples (the last one zero-padded)."""
    samples = np.clip(np.asarray(caller_8k, dtype=np.float32), -1.0, 1.0)
    samples = np.pad(samples, (0, -samples.size % 160))
    linear = np.rint(samples * 32767).astype("<i2").tobytes()
    mulaw = audioop.lin2ulaw(linear, 2)
    return [base64.b64encode(mulaw[i : i + 160]).decode() for i in range(0, len(mulaw), 160)]


async def twilio_call(
    base_url: str,
    caller_8k: np.ndarray,
    *,
    auth_token: str,
    stream_url: str,
    parameters: dict[str, str] | None = None,
    dtmf: tuple[tuple[int, str], ...] = (),
    hang_up: str = "stop",
    tail_s: float = 0.5,
    media_format: dict[str, object] | None = None,
    signature: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
    keep_messages: int = 0,
) -> TwilioCallResult:
    """One call: connect to ``base_url`` (``ws://host:port``; the path is ``/api/carriers/twilio``), sign
    ``stream_url`` (what the TwiML names), stream ``caller_8k``, then wait ``tail_s`` and hang up.

    Args:
        parameters: the ``<Parameter>`` elements (``token``, ``voice_prompt``, ``text_prompt``, ...).
        dtmf: ``(packet index, digit)`` pairs: a ``dtmf`` message before that packet.
        hang_up: ``stop`` (Twilio's stop message, then close) or ``drop`` (the socket closed, no stop).
        media_format: the ``start`` message's ``mediaFormat`` (default μ-law, 8000 Hz, mono).
        signature: the header to send instead of the right one (tests of a refusal); "" sends none.
        ssl_context: for ``wss://`` to a node with its own certificate authority (a self-signed node).
        keep_messages: keep the first this many messages each way in the result.
    Raises:
        ValueError: ``hang_up`` not ``stop`` or ``drop``.
    """
    if hang_up not in ("stop", "drop"):
        raise ValueError(f"hang_up must be stop or drop, got {hang_up!r}")
    result = TwilioCallResult()
    header = twilio_signature(auth_token, stream_url) if signature is None else signature
    headers = {TWILIO_SIGNATURE_HEADER: header} if header else {}
    stream_sid, call_sid = "MZ" + uuid.uuid4().hex, "CA" + uuid.uuid4().hex
    try:
        async with connect(
            base_url.rstrip("/") + "/api/carriers/twilio",
            additional_headers=headers,
            open_timeout=10,
            ssl=ssl_context if base_url.startswith("wss://") else None,
        ) as socket:
            await _converse(
                socket,
                result,
                stream_sid,
                call_sid,
                caller_8k,
                parameters or {},
                dtmf,
                hang_up,
                tail_s,
                media_format,
                keep_messages,
            )
            received = socket.protocol.close_rcvd  # the node's close frame (None: this side ended it)
            result.close_code = received.code if received is not None else None
            result.close_reason = received.reason if received is not None else ""
    except InvalidStatus as exc:
        result.status = exc.response.status_code
        result.close_reason = exc.response.body.decode(errors="replace").strip() if exc.response.body else ""
        result.failure = f"refused {result.status}"
    except (OSError, TimeoutError) as exc:
        result.failure = f"connect failed: {exc}"
    return result


async def _converse(
    socket,  # type: ignore[no-untyped-def]
    result: TwilioCallResult,
    stream_sid: str,
    call_sid: str,
    caller_8k: np.ndarray,
    parameters: dict[str, str],
    dtmf: tuple[tuple[int, str], ...],
    hang_up: str,
    tail_s: float,
    media_format: dict[str, object] | None,
    keep_messages: int = 0,
) -> None:
    loop = asyncio.get_running_loop()
    playout = {"until": 0.0}
    pending: dict[str, asyncio.TimerHandle] = {}
    started = time.monotonic()

    async def send(body: dict[str, object]) -> None:
        if len(result.sent_messages) < keep_messages:
            result.sent_messages.append(body)
        await socket.send(json.dumps(body))

    def echo(name: str) -> None:
        pending.pop(name, None)
        with contextlib.suppress(Exception):
            asyncio.ensure_future(send({"event": "mark", "streamSid": stream_sid, "mark": {"name": name}}))

    async def receive() -> None:
        with contextlib.suppress(ConnectionClosed):
            async for data in socket:
                event = json.loads(data)
                if len(result.received_messages) < keep_messages:
                    result.received_messages.append(event)
                kind = event.get("event")
                now = time.monotonic()
                if kind == "media":
                    result.received += base64.b64decode(event["media"]["payload"])
                    playout["until"] = max(now, playout["until"]) + PACKET_S
                    if result.marks == 0:
                        result.packets_before_live += 1
                elif kind == "mark":
                    if result.marks == 0:
                        result.first_audio_s = now - started
                    result.marks += 1
                    result.mark_arrival_s.append(now)
                    name = event["mark"]["name"]
                    pending[name] = loop.call_later(max(0.0, playout["until"] - now), echo, name)
                elif kind == "clear":
                    result.clears += 1
                    playout["until"] = now
                    for name, handle in list(pending.items()):
                        handle.cancel()
                        echo(name)

    reader = asyncio.create_task(receive())
    try:
        await send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await send(
            {
                "event": "start",
                "sequenceNumber": "1",
                "streamSid": stream_sid,
                "start": {
                    "accountSid": "AC" + "0" * 32,
                    "streamSid": stream_sid,
                    "callSid": call_sid,
                    "tracks": ["inbound"],
                    "customParameters": parameters,
                    "mediaFormat": media_format
                    or {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                },
            }
        )
        digits = dict(dtmf)
        for index, payload in enumerate(_packets(caller_8k)):
            if reader.done():
                break
            if index in digits:
                await send(
                    {
                        "event": "dtmf",
                        "streamSid": stream_sid,
                        "dtmf": {"track": "inbound_track", "digit": digits[index]},
                    }
                )
            await send(
                {
                    "event": "media",
                    "streamSid": stream_sid,
                    "media": {
                        "track": "inbound",
                        "chunk": str(index + 1),
                        "timestamp": str(index * 20),
                        "payload": payload,
                    },
                }
            )
            result.packets_sent += 1
            await asyncio.sleep(max(0.0, started + (index + 1) * PACKET_S - time.monotonic()))
        if not reader.done():
            await asyncio.wait({reader}, timeout=tail_s)
        if not reader.done():
            if hang_up == "stop":
                await send(
                    {
                        "event": "stop",
                        "streamSid": stream_sid,
                        "stop": {"accountSid": "AC" + "0" * 32, "callSid": call_sid},
                    }
                )
                await asyncio.wait({reader}, timeout=2.0)
            else:
                socket.transport.abort()  # a dropped socket: no stop, no close frame
    except ConnectionClosed:
        pass
    finally:
        for handle in pending.values():
            handle.cancel()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
