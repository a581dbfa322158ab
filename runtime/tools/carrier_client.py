"""A phone carrier's side of a media stream, played against a node's ``/api/carriers/<carrier>``: for the
load generator (``duplex loadgen --transport twilio|plivo|telnyx|exotel``) and the tests. What differs per
carrier (its messages, its signature, where the call's parameters travel) is a :class:`CarrierSide`
(``runtime.tools.carrier_sides``); the call itself is here.

It does what the carrier's media servers do with a bidirectional stream: the upgrade signed with the
carrier's signature, the opening messages (a stream id, a call id, the parameters, the media format), the
caller's audio as ``media`` messages of 20 ms paced in real time, DTMF when asked, then a hang-up (the
carrier's stop message, or a dropped socket). Outbound audio is "played" on a clock: each 20 ms packet the
node sends is queued after the ones before it, a checkpoint (Twilio's ``mark``, Plivo's ``checkpoint``) is
echoed back when the audio before it has played out, and a clear empties the queue and echoes every
pending checkpoint at once, as the carriers do.

Units: caller audio is float32 at 8000 Hz in [-1, 1]; times are monotonic seconds.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import contextlib
import json
import ssl
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

__all__ = ["PACKET_S", "CallIds", "CallResult", "CarrierSide", "carrier_call"]

PACKET_S = 0.02
"""One carrier media packet: 20 ms (160 G.711 bytes at 8000 Hz)."""


@dataclass
class CallResult:
    """What one call saw.

    Attributes:
        status: the HTTP status of a refused upgrade (None when upgraded).
        close_code, close_reason: how the node closed the stream (None: this side ended it).
        received: the audio bytes of every media message the node sent, in order (the stream's encoding).
        encoding: ``mulaw`` or ``l16`` (little-endian 16-bit): how :attr:`received` is coded.
        packets_before_live: media packets received before the first checkpoint (the hold tone).
        first_audio_s: from the ``start`` message to the first checkpointed (agent) audio packet, or None.
        marks: checkpoints the node sent; clears: clear messages it sent.
        packets_sent: caller packets sent.
        mark_arrival_s: monotonic arrival time of each checkpoint (one per 80 ms frame of the agent's audio).
        sent_messages, received_messages: the first ``keep_messages`` JSON messages each way (parsed), to
            check against another implementation of the protocol.
        failure: why the call failed, or "".
    """

    status: int | None = None
    close_code: int | None = None
    close_reason: str = ""
    received: bytearray = field(default_factory=bytearray)
    encoding: Literal["mulaw", "l16"] = "mulaw"
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
        """``[T]`` float32 at 8000 Hz: the node's audio decoded (μ-law through ``audioop``, or L16)."""
        data = bytes(self.received)
        linear = audioop.ulaw2lin(data, 2) if self.encoding == "mulaw" else data[: len(data) // 2 * 2]
        return np.frombuffer(linear, dtype="<i2").astype(np.float32) / 32768.0


@dataclass(frozen=True)
class CallIds:
    """One call's identifiers as the carrier makes them (``stream``, ``call``, ``account``)."""

    stream: str
    call: str
    account: str


class CarrierSide(abc.ABC):
    """One carrier's messages as its media servers send and read them."""

    name: str
    """The carrier (``twilio``): the node's route is ``/api/carriers/<name>``."""
    encoding: Literal["mulaw", "l16"] = "mulaw"
    """How the caller's packets are coded (``l16``: 16-bit little-endian PCM, Exotel's)."""

    @abc.abstractmethod
    def ids(self) -> CallIds:
        """Fresh identifiers for one call, in the carrier's forms."""

    @abc.abstractmethod
    def upgrade(self, secret: str, stream_url: str, parameters: dict[str, str]) -> tuple[str, dict[str, str]]:
        """The query string of the upgrade (``""`` for none) and its signature headers."""

    @abc.abstractmethod
    def opening(
        self, ids: CallIds, parameters: dict[str, str], media_format: dict[str, object] | None
    ) -> list[dict[str, object]]:
        """The messages before the caller's audio (``connected``, ``start``)."""

    @abc.abstractmethod
    def media(self, ids: CallIds, index: int, payload: str) -> dict[str, object]:
        """The caller's ``index``-th packet (``payload``: base64 of 20 ms)."""

    @abc.abstractmethod
    def dtmf(self, ids: CallIds, digit: str) -> dict[str, object]:
        """A key the caller pressed."""

    @abc.abstractmethod
    def stop(self, ids: CallIds) -> dict[str, object]:
        """The hang-up."""

    @abc.abstractmethod
    def incoming(self, event: dict[str, object]) -> tuple[str, str]:
        """A node's message as ``(kind, value)``: ``("media", base64 payload)``, ``("mark", name)``,
        ``("clear", "")`` or ``("other", "")``."""

    @abc.abstractmethod
    def played(self, ids: CallIds, name: str) -> dict[str, object]:
        """The echo of checkpoint ``name`` once the audio before it played out."""

    def forged(self, query: str, headers: dict[str, str], signature: str) -> tuple[str, dict[str, str]]:
        """The upgrade with ``signature`` in place of the right one (tests of a refusal): the first header
        replaced; ``""``: no signature headers at all."""
        if not signature:
            return query, {}
        return query, {**headers, next(iter(headers)): signature}

    def cleared(self, ids: CallIds) -> dict[str, object] | None:
        """The acknowledgement of a clear, where the carrier sends one (None: none)."""
        return None

    def packets(self, caller_8k: np.ndarray) -> list[str]:
        """Caller audio -> base64 payloads of 20 ms (the last one zero-padded), in :attr:`encoding`."""
        samples = np.clip(np.asarray(caller_8k, dtype=np.float32), -1.0, 1.0)
        samples = np.pad(samples, (0, -samples.size % 160))
        linear = np.rint(samples * 32767).astype("<i2").tobytes()
        coded, width = (audioop.lin2ulaw(linear, 2), 160) if self.encoding == "mulaw" else (linear, 320)
        return [base64.b64encode(coded[i : i + width]).decode() for i in range(0, len(coded), width)]


async def carrier_call(
    side: CarrierSide,
    base_url: str,
    caller_8k: np.ndarray,
    *,
    secret: str,
    stream_url: str,
    parameters: dict[str, str] | None = None,
    dtmf: tuple[tuple[int, str], ...] = (),
    hang_up: str = "stop",
    tail_s: float = 0.5,
    media_format: dict[str, object] | None = None,
    signature: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
    keep_messages: int = 0,
) -> CallResult:
    """One call: connect to ``base_url`` (``ws://host:port``; the path is ``/api/carriers/<carrier>``),
    signed for ``stream_url`` (what the carrier's XML names) with ``secret``, stream ``caller_8k``, then wait
    ``tail_s`` and hang up.

    Args:
        parameters: the call's parameters (``token``, ``voice_prompt``, ``text_prompt``, ...), where the
            carrier carries them.
        dtmf: ``(packet index, digit)`` pairs: a DTMF message before that packet.
        hang_up: ``stop`` (the carrier's stop message, then close) or ``drop`` (the socket closed, no stop).
        media_format: the ``start`` message's media format (default: the carrier's μ-law at 8000 Hz).
        signature: the signature header to send instead of the right one (tests of a refusal); "" sends
            none.
        ssl_context: for ``wss://`` to a node with its own certificate authority (a self-signed node).
        keep_messages: keep the first this many messages each way in the result.
    Raises:
        ValueError: ``hang_up`` not ``stop`` or ``drop``.
    """
    if hang_up not in ("stop", "drop"):
        raise ValueError(f"hang_up must be stop or drop, got {hang_up!r}")
    result = CallResult(encoding=side.encoding)
    parameters = parameters or {}
    query, headers = side.upgrade(secret, stream_url, parameters)
    if signature is not None:
        query, headers = side.forged(query, headers, signature)
    url = base_url.rstrip("/") + f"/api/carriers/{side.name}" + (f"?{query}" if query else "")
    try:
        async with connect(
            url,
            additional_headers=headers,
            open_timeout=10,
            ssl=ssl_context if base_url.startswith("wss://") else None,
        ) as socket:
            await _converse(
                side,
                socket,
                result,
                caller_8k,
                parameters,
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
    side: CarrierSide,
    socket,  # type: ignore[no-untyped-def]
    result: CallResult,
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
    ids = side.ids()
    packet_s = PACKET_S

    async def send(body: dict[str, object]) -> None:
        if len(result.sent_messages) < keep_messages:
            result.sent_messages.append(body)
        await socket.send(json.dumps(body))

    def echo(name: str) -> None:
        pending.pop(name, None)
        with contextlib.suppress(Exception):
            asyncio.ensure_future(send(side.played(ids, name)))

    async def receive() -> None:
        with contextlib.suppress(ConnectionClosed):
            async for data in socket:
                event = json.loads(data)
                if len(result.received_messages) < keep_messages:
                    result.received_messages.append(event)
                kind, value = side.incoming(event)
                now = time.monotonic()
                if kind == "media":
                    result.received += base64.b64decode(value)
                    playout["until"] = max(now, playout["until"]) + packet_s
                    if result.marks == 0:
                        result.packets_before_live += 1
                elif kind == "mark":
                    if result.marks == 0:
                        result.first_audio_s = now - started
                    result.marks += 1
                    result.mark_arrival_s.append(now)
                    pending[value] = loop.call_later(max(0.0, playout["until"] - now), echo, value)
                elif kind == "clear":
                    result.clears += 1
                    playout["until"] = now
                    for name, handle in list(pending.items()):
                        handle.cancel()
                        echo(name)
                    acknowledgement = side.cleared(ids)
                    if acknowledgement is not None:
                        asyncio.ensure_future(send(acknowledgement))

    reader = asyncio.create_task(receive())
    try:
        for message in side.opening(ids, parameters, media_format):
            await send(message)
        digits = dict(dtmf)
        for index, payload in enumerate(side.packets(caller_8k)):
            if reader.done():
                break
            if index in digits:
                await send(side.dtmf(ids, digits[index]))
            await send(side.media(ids, index, payload))
            result.packets_sent += 1
            await asyncio.sleep(max(0.0, started + (index + 1) * packet_s - time.monotonic()))
        if not reader.done():
            await asyncio.wait({reader}, timeout=tail_s)
        if not reader.done():
            if hang_up == "stop":
                await send(side.stop(ids))
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


def new_id(prefix: str = "") -> str:
    """A fresh identifier: ``prefix`` + 32 hex digits (Twilio's ``MZ...``), or a UUID without one (Plivo)."""
    return prefix + uuid.uuid4().hex if prefix else str(uuid.uuid4())
