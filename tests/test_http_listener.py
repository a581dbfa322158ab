"""The runtime's own HTTP listener against bad and slow callers (issue 31; issue 34, item 10).

- A request aiohttp cannot parse (a 60 KB request line, a 60 KB subprotocol header, a broken header line)
  is answered 400 and logged as one INFO line naming the reason: no ERROR record, no traceback (before:
  one full aiohttp traceback at ERROR each).
- Slow and silent callers are cut off on the runtime's port (on GKE no nginx absorbs them): a connection
  that sends nothing, or half a request, is closed after ``DUPLEX_HTTP_HEADER_TIMEOUT_S``; a ``POST
  /api/rtc`` whose offer body stalls is answered 408 after ``DUPLEX_HTTP_BODY_TIMEOUT_S``; an idle
  keep-alive connection is closed after ``DUPLEX_HTTP_IDLE_TIMEOUT_S``; and a WebSocket call running beside
  them gets every audio frame it sends echoed back (a count, not a time).

The timeouts are injected small; the tests wait for the events they cause (each wait bounded by a generous
``WAIT_S`` so a broken build fails instead of hanging), never assert a duration.
"""

from __future__ import annotations

import asyncio
import logging
import re

import numpy as np
import pytest
from fake_backend import FakeBackend
from test_frontend_seam import chat, fake_node
from websockets.asyncio.client import connect

from runtime.frontend.codecs.protocol import MessageKind

WAIT_S = 20.0
"""Bound on every wait for an event (a broken build fails here instead of hanging)."""
FAST = {"http_header_timeout_s": 0.2, "http_body_timeout_s": 0.2, "http_idle_timeout_s": 0.3}


async def _exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` and read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        async with asyncio.timeout(WAIT_S):
            return await reader.read()
    finally:
        writer.close()


BAD_REQUESTS = {
    "request line of 60 KB": b"GET /api/chat?token=" + b"a" * 60_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "subprotocol header of 60 KB": b"GET /api/chat HTTP/1.1\r\nHost: x\r\n"
    + b"Sec-WebSocket-Protocol: duplex.token."
    + b"b" * 60_000
    + b"\r\n\r\n",
    "header line without a colon": b"GET /healthz HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
    "not HTTP at all": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40 + b"\r\n\r\n",
}


@pytest.mark.parametrize("kind", list(BAD_REQUESTS))
async def test_a_bad_request_is_one_info_line_not_a_traceback(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with fake_node() as server:
        caplog.clear()
        caplog.set_level(logging.DEBUG, logger="aiohttp.server")
        answer = await _exchange(server.port, BAD_REQUESTS[kind])
        assert re.match(rb"HTTP/1\.[01] 400 ", answer), answer[:80]
        server_records = [r for r in caplog.records if r.name == "aiohttp.server"]
        assert not [r for r in server_records if r.levelno >= logging.WARNING], [
            r.getMessage()[:200] for r in server_records
        ]
        assert not [r for r in server_records if r.exc_info or r.exc_text], "a traceback was logged"
        # aiohttp keeps a first request that is not HTTP at all (TLS, scanners) at DEBUG: one line, too
        level = logging.DEBUG if kind == "not HTTP at all" else logging.INFO
        assert len(server_records) == 1 and server_records[0].levelno == level, [
            (r.levelname, r.getMessage()[:200]) for r in server_records
        ]
        line = server_records[0].getMessage()
        assert line.startswith("refused a bad HTTP request from 127.0.0.1: 400 "), line
        assert len(line) < 400, "the log line quotes at most a bounded part of the request"


def test_the_header_deadline_closes_only_connections_that_sent_no_request_head() -> None:
    """The sweep with an injected clock: a connection is closed once ``timeout_s`` has passed since it was
    first seen without a request; one that has sent a request is never closed by it."""
    from runtime.frontend.listener import HeaderDeadline

    class Connection:
        def __init__(self) -> None:
            self.closed = False

        def force_close(self) -> None:
            self.closed = True

    class Request:
        def __init__(self, protocol: object) -> None:
            self.protocol = protocol

    now = [100.0]
    deadline = HeaderDeadline(2.0, clock=lambda: now[0])
    silent, talking = Connection(), Connection()
    deadline._started.add(talking)  # type: ignore[arg-type]  # as started() does for a web.RequestHandler
    both = [silent, talking]
    assert deadline.sweep(both) == 0  # type: ignore[arg-type]
    now[0] += 1.9
    assert deadline.sweep(both) == 0 and not silent.closed  # type: ignore[arg-type]
    now[0] += 0.1
    assert deadline.sweep(both) == 1 and silent.closed and not talking.closed  # type: ignore[arg-type]
    assert deadline.closed == 1
    with pytest.raises(ValueError, match="header timeout must be > 0 s"):
        HeaderDeadline(0)


async def test_slow_and_silent_callers_are_cut_off_and_a_live_call_keeps_its_audio() -> None:
    """Guards issue 34, item 10: 40 slow ``POST /api/rtc`` were neither answered nor closed and
    connections sending half a request, or nothing, stayed open past 75 s. Planted bug: without the
    header deadline, the silent and half-request reads below never end (bounded by ``WAIT_S``: fail)."""
    async with fake_node(FakeBackend(slots=2), **FAST) as server:
        port = server.port
        frame = (np.arange(1920) % 100).astype("<i2")
        async with connect(chat(server)) as call:
            assert await call.recv() == bytes([MessageKind.HANDSHAKE])
            silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(8)]
            half = [await asyncio.open_connection("127.0.0.1", port) for _ in range(8)]
            for _, writer in half:
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            slow_posts = [await asyncio.open_connection("127.0.0.1", port) for _ in range(8)]
            for _, writer in slow_posts:
                writer.write(
                    b"POST /api/rtc HTTP/1.1\r\nHost: x\r\nContent-Type: application/sdp\r\n"
                    b"Content-Length: 4000\r\n\r\nv=0\r\n"
                )
            idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
            idle_writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")

            sent = received = 0

            async def talk() -> None:
                nonlocal sent, received
                for _ in range(25):
                    await call.send(bytes([MessageKind.AUDIO]) + frame.tobytes())
                    sent += 1
                    echoed = await call.recv()
                    assert isinstance(echoed, bytes) and echoed[0] == MessageKind.AUDIO
                    assert np.array_equal(np.frombuffer(echoed[1:], "<i2"), frame)
                    received += 1

            async def cut(reader: asyncio.StreamReader) -> bytes:
                return await reader.read()  # b"" or an answer, then EOF: the server closed it

            async with asyncio.timeout(WAIT_S):
                talking = asyncio.create_task(talk())
                silent_ends = await asyncio.gather(*(cut(r) for r, _ in silent))
                half_ends = await asyncio.gather(*(cut(r) for r, _ in half))
                post_ends = await asyncio.gather(*(cut(r) for r, _ in slow_posts))
                idle_end = await cut(idle_reader)
                await talking
            assert silent_ends == [b""] * 8 and half_ends == [b""] * 8
            for answer in post_ends:
                assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
                assert b"bad_request: the request body did not arrive within 0.2 s" in answer
            assert idle_end.startswith(b"HTTP/1.1 200 "), idle_end[:80]  # answered, then closed when idle
            assert (sent, received) == (25, 25)
            for _, writer in silent + half + slow_posts + [(idle_reader, idle_writer)]:
                writer.close()
            # the call is still up after all of it: one more frame goes round
            await call.send(bytes([MessageKind.AUDIO]) + frame.tobytes())
            assert (await call.recv())[0] == MessageKind.AUDIO
        value = server.metrics.registry.get_sample_value(
            "duplex_admissions_refused_total", {"reason": "bad_request"}
        )
        assert value == 8.0  # the 408s, once each
