"""Raw PCM over a plain byte stream (TCP): the smallest transport, and the proof of the seam (issue 31).

It reuses nothing of the other transports: only the lifecycle (``runtime.frontend.session.lifecycle.run``)
and the query's check (``plan_session``). It is not routed by the HTTP layer; it is the shape a phone
carrier's media stream takes (the next transport on the roadmap): the caller's audio in, the agent's out,
a few events. The caller is the one who opened the connection (``serve`` is a ``asyncio.start_server``
callback); access control is the caller's to do (``claims``).

Wire: the client's first line is the ``/api/chat`` query (ASCII, ``\\n``-terminated, at most
:data:`MAX_QUERY_BYTES`). Then messages both ways, each a kind byte and a big-endian 32-bit length, then the
payload: 0x00 handshake (the slot is live), 0x01 audio (Int16 little-endian mono at 24000 Hz, any whole
number of samples), 0x02 text (UTF-8), 0x04 metadata (a JSON object: the resume metadata), 0x05 error
(UTF-8, before the server closes). The kinds are Kyutai's (``runtime.frontend.codecs.protocol``). The
client sends audio only; the end of its stream is a normal close, a reset or a broken message is *lost*
(a resumable session is held).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct

import numpy as np

from runtime.frontend.gate.refusals import CLOSE_GOING_AWAY, CLOSE_NORMAL, SessionRefused
from runtime.frontend.gate.tokens import TokenClaims
from runtime.frontend.session.conversation import FrontEnd, SessionOutcome, plan_session
from runtime.frontend.session.lifecycle import Edge, TransportClosed, run

__all__ = ["HEADER", "MAX_QUERY_BYTES", "PcmStream", "serve"]

HEADER = struct.Struct(">BI")
"""A message's header: its kind (one byte), its payload's length (bytes, big-endian 32 bits)."""
MAX_QUERY_BYTES = 4096
"""Longest first line (the query) read."""
_HANDSHAKE, _AUDIO, _TEXT, _METADATA, _ERROR = 0x00, 0x01, 0x02, 0x04, 0x05
_SCALE = 32768.0
"""Int16 full scale: sample k <-> float k / 32768."""


class PcmStream(Edge):
    """A conversation's edges on a byte stream (see the module doc)."""

    name = "pcm_stream"
    audio_format = "pcm"

    def __init__(self, front: FrontEnd, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__()
        self.front, self.reader, self.writer = front, reader, writer
        self._reading = asyncio.create_task(self._read(), name="pcm stream reader")

    async def _read(self) -> None:
        limit = self.front.config.max_message_bytes
        between = True  # between messages, the end of the stream is a normal close; inside one, a loss
        try:
            while True:
                between = True
                kind, size = HEADER.unpack(await self.reader.readexactly(HEADER.size))
                between = False
                if size > limit:
                    await self.send_error(f"message of {size} bytes: the limit is {limit}")
                    self.end(SessionOutcome("protocol_too_large", 1009))
                    return
                payload = await self.reader.readexactly(size)
                session = self.session
                if kind == _AUDIO and session is not None and session.takes_audio and size % 2 == 0:
                    session.push_samples(
                        np.frombuffer(payload, "<i2").astype(np.float32) / np.float32(_SCALE)
                    )
        except asyncio.IncompleteReadError as exc:
            self.end(SessionOutcome("client_closed", lost=not between or bool(exc.partial)))
        except ConnectionError:
            self.end(SessionOutcome("client_closed", lost=True))

    async def _send(self, kind: int, payload: bytes) -> None:
        if self.writer.is_closing():
            raise TransportClosed("stream closed")
        self.writer.write(HEADER.pack(kind, len(payload)) + payload)
        try:
            await self.writer.drain()
        except ConnectionError as exc:
            raise TransportClosed(str(exc)) from None

    async def send_audio(self, pcm: np.ndarray) -> None:
        await self._send(_AUDIO, np.clip(np.rint(pcm * _SCALE), -32768, 32767).astype("<i2").tobytes())

    async def send_text(self, piece: str) -> None:
        await self._send(_TEXT, piece.encode())

    async def send_handshake(self) -> None:
        await self._send(_HANDSHAKE, b"")

    async def send_metadata(self, body: dict[str, object]) -> None:
        await self._send(_METADATA, json.dumps(body).encode())

    async def send_error(self, message: str) -> None:
        with contextlib.suppress(TransportClosed):
            await self._send(_ERROR, message.encode())

    async def refuse(self, exc: SessionRefused, *, counted: bool) -> None:
        if not counted:
            self.front.metrics.refused(exc.reason)
        await self.send_error(f"{exc.reason}: {exc.message}")
        await self.shutdown(SessionOutcome(exc.reason, exc.kind.close_code), False)

    async def close(self, code: int, reason: str) -> None:
        if code != CLOSE_NORMAL:
            await self.send_error(reason)
        self.end(
            SessionOutcome("drained" if code == CLOSE_GOING_AWAY else "closed_by_server", code), hang_up=True
        )
        self.writer.close()

    async def shutdown(self, outcome: SessionOutcome, held: bool) -> None:
        self._reading.cancel()
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


async def serve(
    front: FrontEnd,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    claims: TokenClaims | None = None,
) -> None:
    """One connection (an ``asyncio.start_server`` callback): its query line, then its conversation."""
    peer = writer.get_extra_info("peername")
    client = str(peer[0]) if isinstance(peer, tuple) else ""
    try:
        line = await reader.readuntil(b"\n")
        if len(line) > MAX_QUERY_BYTES:
            raise SessionRefused("bad_request", f"bad request: a query over {MAX_QUERY_BYTES} bytes")
        request, sampling = plan_session(front, line.decode("ascii", "replace").strip())
        if front.draining:
            raise SessionRefused("draining")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        writer.close()
        return
    except SessionRefused as exc:
        front.metrics.refused(exc.reason)
        sentence = f"{exc.reason}: {exc.message}".encode()
        writer.write(HEADER.pack(_ERROR, len(sentence)) + sentence)
        writer.close()
        return
    await run(front, PcmStream(front, reader, writer), request, sampling, claims, client)
