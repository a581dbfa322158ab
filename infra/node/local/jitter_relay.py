"""A user-space jitter relay for browser tests and measurements: an HTTP ``CONNECT`` proxy on loopback that
holds every TLS record the server sends back to the browser for a random 0-``max_delay_ms`` ms, in order,
and can first re-time the node's audio on an exact 80 ms clock (``pace_lead_ms``), so that a path is clean
or jittered by construction rather than by how loaded the machine is.

This kernel has no netem (``tc qdisc ... netem`` is unknown), so path jitter is made in user space. A
browser context pointed at the relay (Playwright ``proxy={"server": relay.url, "bypass": "<-loopback>"}``:
Chromium bypasses proxies for loopback unless told ``<-loopback>``) keeps the node's origin
(``https://localhost:<port>``, which the node's CSP and origin check require) while its bytes pass through
here. TLS passes through untouched: the relay splits the server's bytes at TLS record boundaries (5-byte
headers: type, version, length) and nginx writes each WebSocket message as its own record(s), so a record
is a message or part of one; audio frames (3.8 kB of PCM) are the application-data records of at least
``AUDIO_RECORD_MIN_BYTES``. Each record's release time is ``max(previous release, base + uniform(0,
max_delay_ms))``, ``base`` its arrival: a record never overtakes the one before it (one TCP stream), so a
long delay also holds back the records behind it, as a real path's queue does.

Pacing (``pace_lead_ms`` > 0): the first audio record seen after it is switched on fixes a grid, one slot
every 80 ms starting ``pace_lead_ms`` after it; each audio record's base is its slot (or its arrival, which
restarts the grid, if it comes later than its slot). The node's own tick jitter (on a loaded 2-core machine,
frames 30-155 ms apart) is absorbed up to ``pace_lead_ms``: what reaches the browser is a clean 80 ms
cadence, to which the random delay is then added. Only the server-to-browser direction is touched (the
direction the page's playout buffer sees). Only loopback targets are relayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Iterator

__all__ = ["JitterRelay"]

_LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]"}
_CHUNK_BYTES = 65536
AUDIO_RECORD_MIN_BYTES = 1024
"""TLS application-data records at least this long carry audio (an 80 ms PCM frame is 3841 bytes)."""
FRAME_S = 0.080
_APPLICATION_DATA = 0x17
_HEADER_LIMIT_BYTES = 8192


class JitterRelay:
    """The relay, running on its own event loop in a daemon thread; ``max_delay_ms`` may be changed at any
    time (0: no delay; records still pass in order), and so may ``pace_lead_ms`` (0: no pacing). ``seed``
    makes the delays reproducible.

    Use as a context manager, or ``start()`` (returns the port) and ``stop()``. ``chunks`` counts the TLS
    records relayed to browsers, ``delayed_ms`` the random delay drawn for them (ms, summed). Raises
    ValueError for a negative delay.
    """

    def __init__(self, max_delay_ms: float = 0.0, seed: int = 0, pace_lead_ms: float = 0.0) -> None:
        if max_delay_ms < 0 or pace_lead_ms < 0:
            raise ValueError(f"delays must be >= 0 ms, got max_delay_ms={max_delay_ms}, pace={pace_lead_ms}")
        self.max_delay_ms = max_delay_ms
        self.pace_lead_ms = pace_lead_ms
        self.audio_records = 0  # audio records relayed
        self.late_for_pace = 0  # audio records that came after their paced slot (the grid restarted)
        self.chunks = 0
        self.delayed_ms = 0.0
        self._random = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``: the proxy server to give the browser."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> int:
        """Listen on a free loopback port; returns it. Raises RuntimeError if already started."""
        if self._thread is not None:
            raise RuntimeError("the relay is already running")
        started = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="jitter-relay", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the jitter relay did not start")
        return self.port

    def stop(self) -> None:
        """Close the listener and every relayed connection, and stop the thread (idempotent)."""
        if self._loop is None or self._thread is None:
            return
        loop = self._loop

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)
        self._loop = self._thread = None

    def __enter__(self) -> JitterRelay:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @contextlib.contextmanager
    def jitter(self, max_delay_ms: float) -> Iterator[None]:
        """Delay by random 0-``max_delay_ms`` ms inside the block, as before after it. Raises ValueError
        for a negative delay."""
        if max_delay_ms < 0:
            raise ValueError(f"max_delay_ms must be >= 0 ms, got {max_delay_ms}")
        before, self.max_delay_ms = self.max_delay_ms, max_delay_ms
        try:
            yield
        finally:
            self.max_delay_ms = before

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.CancelledError):  # stop() cancels every connection
            await self._relay(client_reader, client_writer)

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            head = await client_reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            client_writer.close()
            return
        request = head[:_HEADER_LIMIT_BYTES].split(b"\r\n", 1)[0].decode("latin-1").split()
        target = request[1] if len(request) == 3 and request[0] == "CONNECT" else ""
        host, _, port = target.rpartition(":")
        if host not in _LOOPBACK or not port.isdigit():
            client_writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            await client_writer.drain()
            client_writer.close()
            return
        try:
            server_reader, server_writer = await asyncio.open_connection(host.strip("[]"), int(port))
        except OSError:
            client_writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            client_writer.close()
            return
        client_writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await client_writer.drain()
        up = asyncio.ensure_future(self._pump(client_reader, server_writer))
        down = asyncio.ensure_future(self._delayed_pump(server_reader, client_writer))
        try:
            await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (up, down):
                task.cancel()
            for writer in (client_writer, server_writer):
                writer.close()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(_CHUNK_BYTES):
            writer.write(chunk)
            await writer.drain()

    async def _delayed_pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def release() -> None:
            while True:
                at, chunk = await queue.get()
                if not chunk:
                    return
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                writer.write(chunk)
                await writer.drain()

        releaser = asyncio.ensure_future(release())
        last = 0.0
        slot: float | None = None  # the paced grid's next slot (monotonic s)
        pending = b""
        try:
            while chunk := await reader.read(_CHUNK_BYTES):
                now = time.monotonic()
                pending += chunk
                while len(pending) >= 5 and len(pending) >= 5 + int.from_bytes(pending[3:5], "big"):
                    size = 5 + int.from_bytes(pending[3:5], "big")
                    record, pending = pending[:size], pending[size:]
                    base = now
                    if record[0] == _APPLICATION_DATA and size >= AUDIO_RECORD_MIN_BYTES:
                        self.audio_records += 1
                        if self.pace_lead_ms <= 0:
                            slot = None
                        else:
                            if slot is None:
                                slot = now + self.pace_lead_ms / 1000
                            elif now > slot:
                                self.late_for_pace += 1
                                slot = now  # the node fell behind: restart the grid here
                            base, slot = slot, slot + FRAME_S
                    delay_ms = self._random.uniform(0, self.max_delay_ms) if self.max_delay_ms > 0 else 0.0
                    last = max(last, base + delay_ms / 1000)
                    self.chunks += 1
                    self.delayed_ms += delay_ms
                    queue.put_nowait((last, record))
            if pending:
                queue.put_nowait((last, pending))
            queue.put_nowait((last, b""))
            await releaser
        finally:
            releaser.cancel()
