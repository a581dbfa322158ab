"""The runtime's HTTP listener settings, beside its routes (``runtime.frontend.http``): the request line and
header sizes, the read buffer, the idle (keep-alive), header and lingering timeouts, and the quiet log of
requests aiohttp cannot parse (issue 31; issue 34, item 10: on GKE callers reach the pods with no nginx in
front, so slow and silent connections are cut here). ``listener_args`` is what an application hands
aiohttp (``web.Application(handler_args=...)``); ``runtime.frontend.server`` sweeps the
:class:`HeaderDeadline` over each listener's connections.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

__all__ = [
    "HEADER_DEADLINE",
    "LINGERING_S",
    "MAX_REQUEST_LINE_BYTES",
    "READ_BUFSIZE",
    "SERVER_LOG",
    "BadRequestLog",
    "HeaderDeadline",
    "listener_args",
]

log = logging.getLogger(__name__)

MAX_REQUEST_LINE_BYTES = 8190
"""Longest request line (method, URL, version) and longest header field aiohttp reads; longer gets 400
(aiohttp's defaults, as websockets' 8 KiB before)."""
READ_BUFSIZE = 2**16
"""aiohttp's read buffer per connection (bytes; its default, ``read_bufsize``): a body is buffered up to
twice this before aiohttp stops reading the socket. An SDP offer (``MAX_OFFER_BYTES``, 32 KiB) fits."""
LINGERING_S = 1.0
"""After answering a request whose body was not read to its end (a 408, a 405 to a POST), how long aiohttp
reads and drops the rest before it closes (s; aiohttp's ``lingering_time``, 10 s by default: a slow
sender held its connection that long after its answer, issue 34, item 10). Long enough for a client still
sending a small body to read its answer instead of a reset."""
MAX_LOGGED_CHARS = 160
"""Longest part of a bad request's parse error quoted in its log line (the error may quote the request)."""


class BadRequestLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger (``aiohttp.server``) with its parse errors made quiet: a request aiohttp
    could not parse (an over-long request line or header, a broken request line: ``HttpProcessingError``)
    is answered 400 by aiohttp and logged here as one INFO line naming the peer and the reason (a first
    request that is not HTTP at all, which aiohttp logs at DEBUG: one DEBUG line), never a traceback at
    ERROR (issue 31: 11 tracebacks from 113 kinds of bad input, a cheap way to flood the
    logs). Every other exception aiohttp logs keeps its traceback. aiohttp 3.11 logs these through
    ``RequestHandler.handle_error`` -> ``log_exception`` -> ``logger.exception``."""

    def exception(self, msg: object, *args: object, exc_info: object = True, **kwargs: Any) -> None:
        """One INFO line for a parse error, else the adapted logger's ``exception``."""
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError):
            self._refused(logging.INFO, exc, args)
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)  # type: ignore[arg-type]

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        """aiohttp logs a first request that is not HTTP at all (a TLS hello, a scanner) at DEBUG with its
        traceback: one DEBUG line here, no traceback."""
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            self._refused(logging.DEBUG, exc, args)
            return
        self.logger.debug(msg, *args, **kwargs)

    def _refused(self, level: int, exc: HttpProcessingError, args: tuple[object, ...]) -> None:
        reason = " ".join(str(exc.message).split())
        if len(reason) > MAX_LOGGED_CHARS:
            reason = reason[: MAX_LOGGED_CHARS - 3] + "..."
        peer = args[0] if args else "?"
        self.logger.log(
            level, "refused a bad HTTP request from %s: %d %s: %s", peer, exc.code, type(exc).__name__, reason
        )


SERVER_LOG = BadRequestLog(logging.getLogger("aiohttp.server"), {})
"""The logger every listener of the runtime hands aiohttp (``handler_args["logger"]``)."""


class HeaderDeadline:
    """Closes connections that have not sent a whole request head (request line and headers) within
    ``timeout_s`` of being first seen (issue 34, item 10: a caller sending half a request, or nothing, held
    its connection past 75 s; aiohttp 3.11 has no header timeout, and its ``keepalive_timeout`` only runs
    between requests). A connection counts as started once the application has seen one request on it
    (:meth:`started`); later requests on a kept-alive connection are aiohttp's ``keepalive_timeout``'s.

    :meth:`sweep` looks at the listener's connections (``aiohttp.web.Server.connections``); :meth:`run`
    sweeps every ``timeout_s / 4``, so a silent connection is closed between ``timeout_s`` and
    ``1.5 * timeout_s`` after it opened.

    Args:
        timeout_s: the deadline (s, > 0; ``DUPLEX_HTTP_HEADER_TIMEOUT_S``).
        clock: monotonic seconds (tests inject one).
    Raises:
        ValueError: ``timeout_s`` not positive.
    """

    def __init__(self, timeout_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the header timeout must be > 0 s, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._clock = clock
        # aiohttp's RequestHandler has __slots__ and no weak references: both are pruned on each sweep to the
        # connections still open.
        self._first_seen: dict[web.RequestHandler, float] = {}
        self._started: set[web.RequestHandler] = set()
        self.closed = 0
        """Connections closed for their deadline so far."""

    def started(self, request: web.BaseRequest) -> None:
        """``request`` reached the application: its connection has sent a whole request head."""
        protocol = request.protocol
        if isinstance(protocol, web.RequestHandler):
            self._started.add(protocol)

    def sweep(self, connections: Iterable[web.RequestHandler]) -> int:
        """Close every connection in ``connections`` not started ``timeout_s`` after it was first seen;
        returns how many were closed."""
        now = self._clock()
        closed = 0
        open_now = set(connections)
        self._started &= open_now
        self._first_seen = {c: t for c, t in self._first_seen.items() if c in open_now}
        for connection in open_now - self._started:
            first = self._first_seen.setdefault(connection, now)
            if now - first >= self.timeout_s:
                connection.force_close()
                del self._first_seen[connection]
                closed += 1
        if closed:
            self.closed += closed
            log.info("closed %d connection(s) that sent no whole request within %g s", closed, self.timeout_s)
        return closed

    async def run(self, connections: Callable[[], Iterable[web.RequestHandler]]) -> None:
        """Sweep ``connections()`` every ``timeout_s / 4`` until cancelled."""
        while True:
            await asyncio.sleep(self.timeout_s / 4)
            self.sweep(connections())


HEADER_DEADLINE = web.AppKey("header_deadline", HeaderDeadline)
"""The application's :class:`HeaderDeadline` (``runtime.frontend.server`` runs its sweep on the listener)."""


def listener_args(idle_timeout_s: float) -> dict[str, Any]:
    """aiohttp's ``handler_args`` of a runtime listener: the sizes above, :data:`LINGERING_S`,
    ``keepalive_timeout`` = ``idle_timeout_s`` (``DUPLEX_HTTP_IDLE_TIMEOUT_S``: an idle connection between
    requests; aiohttp's own default is 3630 s) and :data:`SERVER_LOG`."""
    return {
        "max_line_size": MAX_REQUEST_LINE_BYTES,
        "max_field_size": MAX_REQUEST_LINE_BYTES,
        "read_bufsize": READ_BUFSIZE,
        "lingering_time": LINGERING_S,
        "keepalive_timeout": idle_timeout_s,
        "logger": SERVER_LOG,
    }
