"""The drain's close at the end of its grace period (runtime/frontend/server.py, ``DuplexServer.drain``), over
the fake backend (``tests/fake_backend.py``).

Other drain tests bound the close from below (not before the grace ends). Without the drain's own 1001 the
session is still closed, by ``close()`` 5 s past the deadline (websockets' ``Server.close``: 1001 with no
reason). The first test injects the server's clock (``runtime.frontend.server.time``) and freezes it past
the deadline but short of those 5 s: only the drain's own close can end the session then. The second tells
the two closes apart by their reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import pytest
from fake_backend import FakeBackend
from test_frontend_seam import chat, fake_node
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

import runtime.frontend.server as server_module
from runtime.frontend.codecs.protocol import MessageKind

GRACE_S = 30.0
HANG_BOUND_S = 20.0
"""How long a test waits for something the fake clock has already made due: a bound on a hang, not a
latency (it is never reached on a correct server)."""


class FrozenClock:
    """Stands in for the ``time`` module inside ``runtime.frontend.server``: ``monotonic`` reads ``now``
    (moved by the test) and counts its reads; everything else is the real module."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.reads = 0

    def monotonic(self) -> float:
        self.reads += 1
        return self.now

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[FrozenClock]:
    frozen = FrozenClock(1000.0)
    monkeypatch.setattr(server_module, "time", frozen)
    yield frozen


async def _until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    try:
        async with asyncio.timeout(HANG_BOUND_S):
            while not predicate():
                await asyncio.sleep(0.01)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


async def _close(client: ClientConnection, when: str) -> tuple[int | None, str | None]:
    """Read until the server closes the connection: its close code and reason. Fails when no close frame
    comes within ``HANG_BOUND_S`` (``when`` says what the clock stood at)."""
    try:
        async with asyncio.timeout(HANG_BOUND_S):
            with contextlib.suppress(ConnectionClosed):
                while True:
                    await client.recv()
    except TimeoutError:
        pytest.fail(f"no close frame {when}")
    return client.close_code, client.close_reason


async def test_drain_closes_a_live_session_with_1001_when_the_grace_ends(clock: FrozenClock) -> None:
    """A live session goes on while the drain's grace runs; once the (injected) clock passes the deadline
    the client gets the close frame 1001 "server draining", while the clock still stands 1 s past the
    deadline (websockets' own close, 5 s past it, cannot have sent it), the session is counted as
    ``drained``, and the drain ends (backend closed once).

    Planted bug: ``_drain`` skipping ``_close_sessions(CLOSE_GOING_AWAY, "server draining")`` at the
    deadline — fails on it: no close frame arrives while the clock stands 1 s past the deadline
    ("no close frame with the clock 1 s past the drain's deadline"; unfrozen, the close would come 5 s
    late, without the reason)."""
    backend = FakeBackend(slots=1)
    async with fake_node(backend) as server:
        async with connect(chat(server), close_timeout=60) as client:
            assert await client.recv() == bytes([MessageKind.HANDSHAKE])
            drain = asyncio.ensure_future(server.drain(grace_s=GRACE_S))
            try:
                await _until(lambda: server.draining, "the drain to start")
                # Before the deadline: the drain's loop reads the clock again and again, the session lives.
                clock.now = 1000.0 + GRACE_S - 1.0
                reads = clock.reads
                await _until(lambda: clock.reads >= reads + 3, "the drain to look at the clock")
                assert client.state is State.OPEN and len(server.sessions) == 1
                assert backend.closes == 0

                clock.now = 1000.0 + GRACE_S + 1.0
                closed = await _close(client, "with the clock 1 s past the drain's deadline")
                assert closed == (1001, "server draining")
                async with asyncio.timeout(HANG_BOUND_S):
                    await drain
            finally:
                drain.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drain
        assert backend.closes == 1 and backend.released
        drained = server.metrics.registry.get_sample_value(
            "duplex_sessions_ended_total", {"reason": "drained"}
        )
        assert drained == 1


async def test_a_drain_with_no_grace_closes_with_its_own_reason_not_the_listener_s() -> None:
    """``drain(grace_s=0)`` on the real clock: the session is closed by the drain itself (1001, reason
    "server draining"), not by the listener's close that follows it (1001 with an empty reason), nor
    aborted (1006) or failed (1011). No time is asserted: the reason tells the two closes apart.

    Planted bug: ``_drain`` skipping ``_close_sessions(CLOSE_GOING_AWAY, "server draining")`` at the
    deadline — fails on it: the close that comes (5 s later, from ``close()``) has the reason "", not
    "server draining"."""
    backend = FakeBackend(slots=1)
    async with fake_node(backend) as server, connect(chat(server), close_timeout=60) as client:
        assert await client.recv() == bytes([MessageKind.HANDSHAKE])
        drain = asyncio.ensure_future(server.drain(grace_s=0))
        try:
            assert await _close(client, "after a drain without grace") == (1001, "server draining")
            async with asyncio.timeout(HANG_BOUND_S):
                await drain
        finally:
            drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drain
        assert backend.closes == 1
