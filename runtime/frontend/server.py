"""The front end's server: one class over a slot backend (``runtime.engine.api.SlotBackend``), the same code
for ``duplex serve --workers 0`` (the model in this process, ``runtime.engine.engine_core.LocalSlots``) and
``--workers N`` (each worker over ZeroMQ, ``runtime.frontend.engine_client.EngineClient``). It never touches
a tensor.

By role: the HTTP routes (``runtime.frontend.http``: one table for the loading and serving phases), access
(``runtime.frontend.gate.access``: trusted proxies, rate limits, origin, token), the transport-neutral session
(``runtime.frontend.session.conversation``), the refusal table (``runtime.frontend.gate.refusals``) and
Kyutai's WebSocket
protocol as one transport (``runtime.frontend.transports.websocket``). This module holds the lifecycle:
start, drain (SIGTERM:
``/readyz`` 503, new sessions refused, running ones closed with 1001 after the grace period), a GCE host
maintenance notice (``runtime.frontend.maintenance``: the first two, undone when the notice clears), the
backend's loss (sessions closed with 1011, ``/healthz`` 500), readiness and the ``/metrics`` cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from runtime.config import RuntimeConfig
from runtime.engine.api import MIMI_FRAME, SlotBackend
from runtime.fleet.deletion_cost import DeletionCostTask, sessions_on, start_deletion_cost
from runtime.frontend import http
from runtime.frontend.gate.access import Access
from runtime.frontend.gate.refusals import (
    ADMISSION_REASONS,
    CLOSE_GOING_AWAY,
    CLOSE_INTERNAL_ERROR,
    DRAINING_MESSAGE,
    ENGINE_LOST_MESSAGE,
    LOADING_MESSAGE,
    Admission,
)
from runtime.frontend.gate.slot_load import UpgradeReservations
from runtime.frontend.listener import HEADER_DEADLINE
from runtime.frontend.maintenance import PREEMPTION_GRACE_S, MaintenanceWatcher, start_maintenance_watch
from runtime.frontend.session.conversation import ChatSession
from runtime.frontend.store.recordings import LocalRecordings, RecordingStore
from runtime.frontend.store.records import RedisSessionReader
from runtime.frontend.store.redis_store import SessionStore
from runtime.frontend.transports.webrtc import signalling as rtc
from runtime.heap_trim import HeapTrimmer, TrimResult
from runtime.metrics import RuntimeMetrics

__all__ = [
    "ACCESS_LOG",
    "AccessLog",
    "ADMISSION_REASONS",
    "DRAINING_MESSAGE",
    "LOADING_MESSAGE",
    "Admission",
    "DuplexServer",
    "build_store",
    "loading_status",
]

log = logging.getLogger(__name__)


class AccessLog(AbstractAccessLogger):
    """aiohttp's access log, one DEBUG line per HTTP request (INFO wrote 8 MB in 22 minutes under test: issue
    16): peer, method, **path without its query**, status, body bytes, seconds. The query is left out because
    it may carry a session token (``?token=``) or a resume credential (``?resume=``): issue 34 found them
    kept in logs (nginx's ``duplex`` format logs ``$uri`` only, for the same reason)."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        self.logger.debug(
            '%s "%s %s" %s %s %.6f',
            request.remote,
            request.method,
            request.path,
            response.status,
            response.body_length,
            time,
        )

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.DEBUG)


ACCESS_LOG = logging.getLogger("runtime.access")
"""aiohttp's access log (:class:`AccessLog`): enable DEBUG on ``runtime.access`` to see every request."""
SHUTDOWN_TIMEOUT_S = 5.0
"""When the listener closes, how long aiohttp waits for requests still in their handlers (sessions were
closed before it: a drain's 1001, or an engine loss's 1011)."""


async def _listen(app: web.Application, host: str, port: int, *, reuse_port: bool = False) -> web.AppRunner:
    """Serve ``app`` on ``host:port`` (``reuse_port``: ``SO_REUSEPORT``, the workers' shared port), with
    the app's header deadline (``runtime.frontend.listener.HeaderDeadline``) swept over the listener's
    connections while it serves.

    Raises:
        OSError: the address is in use.
    """
    runner = web.AppRunner(
        app,
        access_log=ACCESS_LOG,
        access_log_class=AccessLog,
        handle_signals=False,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    deadline = app[HEADER_DEADLINE]

    def connections() -> list[web.RequestHandler]:
        server = runner.server
        return [] if server is None else server.connections

    async def sweep_headers(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(deadline.run(connections), name="http header deadline")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(sweep_headers)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


class DuplexServer:
    """The node's front end over ``backend``.

    Args:
        config: validated settings.
        backend: the slots' owner (in-process or the engine process).
        store: the Redis session store, or None to run without one.
        metrics: metrics registry; a fresh one by default.
        worker_id: with ``--workers N``, this worker's id (``Server`` header, ``SO_REUSEPORT``); None for one
            process.
    """

    def __init__(
        self,
        config: RuntimeConfig,
        backend: SlotBackend,
        *,
        store: SessionStore | None = None,
        metrics: RuntimeMetrics | None = None,
        worker_id: str | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.store = store
        self.metrics = metrics or RuntimeMetrics()
        self.worker_id = worker_id
        self.access = Access(config, self.metrics)
        # The sessions API's reads (runtime.frontend.sessions_api) and the recordings, when configured.
        self.records = (
            None
            if store is None
            else RedisSessionReader(
                store.url, key_prefix=store.key_prefix, aof_rewrite_every_s=config.erase_aof_rewrite_s
            )
        )
        self.recordings: RecordingStore | None = (
            None if config.recording_dir is None else LocalRecordings(config.recording_dir)
        )
        self._sweep_task: asyncio.Task[None] | None = None
        self._trim_task: asyncio.Task[None] | None = None
        self._deletion_cost: DeletionCostTask | None = None
        self.sessions: set[ChatSession] = set()
        self.draining = False
        self.upgrades = UpgradeReservations()
        """``/api/chat`` upgrades admitted at the edge whose sessions hold no slot yet
        (``runtime.frontend.gate.slot_load``)."""
        self.maintenance: MaintenanceWatcher | None = None
        self._runner: web.AppRunner | None = None
        self._drain_task: asyncio.Future[None] | None = None
        self._drain_deadline: float | None = None  # time.monotonic() at which live sessions get 1001
        self._metrics_cache: tuple[float, bytes] | None = None
        backend.on_lost.append(self._backend_lost)

    # --- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the backend's slots (or connect to the engine), start the store, and listen."""
        if self.worker_id is not None:
            self.metrics.loading.set(1)  # until the engine has loaded the model and answers
        await self.backend.start()
        if self.store is not None:
            await self.store.start()
        server_header = None
        if self.worker_id is not None:
            server_header = f"duplex {self.worker_id} pid={os.getpid()}"
        app = http.build_app(self, server_header=server_header)
        self._runner = await _listen(
            app, self.config.host, self.config.port, reuse_port=self.worker_id is not None
        )
        self.metrics.ready.set(1)
        if self.recordings is not None:
            self._sweep_task = asyncio.create_task(self._sweep_recordings(self.recordings))
        self.maintenance = start_maintenance_watch(
            self.config, self.metrics, self._on_maintenance_notice, on_preempted=self._on_preempted
        )
        if self.worker_id is None:  # the slots are in this process (--workers 0): one reporter per pod
            self._deletion_cost = start_deletion_cost(
                self.config, self.metrics, lambda: sessions_on(self.backend.status()), dict(os.environ)
            )
        trimmer = HeapTrimmer(self.config.malloc_trim_s, self._on_heap_trim)
        self._trim_task = asyncio.create_task(trimmer.run(), name="heap trim")
        log.info(
            "%s listening on %s:%d with %d slots",
            self.worker_id or "server",
            self.config.host,
            self.port,
            self.backend.status().slots,
        )

    @property
    def port(self) -> int:
        assert self._runner is not None
        return int(self._runner.addresses[0][1])

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop admitting, let running sessions go on for ``grace_s`` (default the config's), then close
        the rest with 1001 and stop listening. A drain asked for while one runs (a SIGTERM during a Spot
        preemption's drain) joins it, and the earlier of the two deadlines holds: the sessions are closed
        once, the listener and the backend closed once."""
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace
        if self._drain_deadline is None or deadline < self._drain_deadline:
            self._drain_deadline = deadline
        if self._drain_task is None:
            self._stop_maintenance_watch()  # a SIGTERM drain is final: a cleared notice must not undo it
            self.draining = True
            self.metrics.draining.set(1)
            self.metrics.ready.set(0)
            self._drain_task = asyncio.ensure_future(self._drain())
        await asyncio.shield(self._drain_task)

    async def _drain(self) -> None:
        log.info("draining: %d sessions, grace %.1f s", len(self.sessions), self._until_drain_deadline())
        while self.sessions and self._until_drain_deadline() > 0:
            await asyncio.sleep(0.05)
        await self._close_sessions(CLOSE_GOING_AWAY, "server draining")
        while self.sessions and self._until_drain_deadline() > -5:
            await asyncio.sleep(0.05)
        await self.close()

    def _until_drain_deadline(self) -> float:
        assert self._drain_deadline is not None
        return self._drain_deadline - time.monotonic()

    def _on_preempted(self) -> None:
        """GCE preempts this Spot VM (``instance/preempted`` TRUE, 30 s before the power-off): drain with
        :data:`PREEMPTION_GRACE_S`, so live sessions get 1001 before the VM is cut."""
        asyncio.ensure_future(self.drain(PREEMPTION_GRACE_S))

    async def _close_sessions(self, code: int, reason: str) -> None:
        transports = [session.transport for session in list(self.sessions)]
        await asyncio.gather(*(t.close(code, reason) for t in transports), return_exceptions=True)

    async def _sweep_recordings(self, recordings: RecordingStore) -> None:
        """Every ``recording_sweep_s``: delete recordings older than the retention (``transcript_ttl_s``)."""
        while True:
            try:
                removed = await asyncio.to_thread(recordings.sweep, self.config.transcript_ttl_s)
            except OSError as exc:
                log.warning("recording sweep failed: %s", exc)
            else:
                if removed:
                    log.info("recording sweep: %d expired files deleted", removed)
                    self.metrics.recordings_swept.inc(removed)
            await asyncio.sleep(self.config.recording_sweep_s)

    def _on_heap_trim(self, result: TrimResult) -> None:
        self.metrics.heap_trimmed.inc(result.released_bytes)
        self.metrics.heap_trim_duration.observe(result.duration_s)

    async def close(self) -> None:
        """End the WebRTC sessions left, stop listening, close the backend, flush the store. Idempotent."""
        self._stop_maintenance_watch()
        if self._deletion_cost is not None:
            deletion_cost, self._deletion_cost = self._deletion_cost, None
            await deletion_cost.close()
        if self._trim_task is not None:
            self._trim_task.cancel()
            self._trim_task = None
        if self._sweep_task is not None:
            self._sweep_task.cancel()
            self._sweep_task = None
        await rtc.end_all(self)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        await self.backend.close()
        if self.store is not None:
            await self.store.close()
        await self.access.close()
        if self.records is not None:
            await self.records.close()

    def _backend_lost(self) -> None:
        """The engine is gone: close every session with 1011 (their slots went with it)."""
        log.error("engine lost: closing %d sessions (1011)", len(self.sessions))
        for session in list(self.sessions):
            session.release()
        asyncio.ensure_future(self._close_sessions(CLOSE_INTERNAL_ERROR, ENGINE_LOST_MESSAGE))

    def _on_maintenance_notice(self, pending: bool) -> None:
        """A host maintenance notice (True) stops admissions as a drain does, live sessions go on; its end
        (False) admits again. Called on the loop by
        :class:`runtime.frontend.maintenance.MaintenanceWatcher`."""
        self.draining = pending
        self.metrics.draining.set(int(pending))
        self.metrics.ready.set(int(not pending))

    def _stop_maintenance_watch(self) -> None:
        if self.maintenance is not None:
            self.maintenance.stop()
            self.maintenance = None

    async def serve_until_signal(self) -> None:
        """Serve until SIGTERM or SIGINT, then drain."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await self.drain()

    # --- health, readiness, metrics -------------------------------------------------------------------

    def health(self) -> tuple[bool, str]:
        """(healthy, text): what ``/healthz`` answers (200 or 500)."""
        return self.backend.status().health()

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): what ``/readyz`` answers: serving (the model loaded and warm, the tick alive, not
        draining), whether or not a slot is free (that is ``/slotz``: ``runtime.frontend.gate.slot_load``)."""
        status = self.backend.status()
        if self.draining:
            return False, "draining"
        if status.lost:
            return False, "engine unreachable"
        if not status.loaded:
            return False, "warming up" if self.worker_id is None else "loading the model"
        if not status.tick_alive:
            return False, "tick loop stopped"
        if status.frame != MIMI_FRAME:
            return False, (
                f"the model's frame ({status.frame.describe()}) is not the one the front end's codecs carry "
                f"({MIMI_FRAME.describe()})"
            )
        # A full node is serving: it stays ready (issue 33: a full pod left the NEG and the Service's
        # endpoints and came back a health check after a slot freed). "Has a free slot" is /slotz's.
        return True, f"{status.free_slots} of {status.slots} slots free"

    def readiness_json(self) -> dict[str, object]:
        """``/readyz``'s JSON body: ``{"ready", "reason"}`` and the backend's detail (worker, engine pid)."""
        ready, reason = self.readiness()
        return {"ready": ready, "reason": reason, **self.backend.status().detail}

    def render_metrics(self, now: float | None = None) -> bytes:
        """``GET /metrics``: the registry's text, rendered at most once per ``config.metrics_cache_s``
        (a scrape flood costs one rendering per period, not one per request)."""
        now = time.monotonic() if now is None else now
        cached = self._metrics_cache
        if cached is not None and now - cached[0] < self.config.metrics_cache_s:
            return cached[1]
        if self.store is not None:
            self.metrics.redis_backlog.set(self.store.backlog)
        body = self.metrics.render()
        self._metrics_cache = (now, body)
        return body


@contextlib.asynccontextmanager
async def loading_status(
    config: RuntimeConfig, metrics: RuntimeMetrics
) -> AsyncIterator[web.AppRunner | None]:
    """Answer on the runtime's address while the model loads, then free the address for the real server.

    Inside the context every route gives its loading answer (``runtime.frontend.http``): ``/healthz`` 200
    ``loading`` (the process is alive), ``/readyz`` 503 ``{"ready": false, "reason": "loading the model"}``,
    ``/metrics`` the registry of ``metrics`` (with ``duplex_loading`` 1 and ``duplex_ready`` 0: Prometheus's
    ``up`` is 1, so ``RuntimeDown`` stays quiet during a load of minutes), ``/api/admission`` an
    ``Admission`` ``not_ready``, anything else 503 with ``LOADING_MESSAGE``. Nothing is upgraded to a
    WebSocket. ``duplex_loading`` is 0 again on exit.

    Yields the listening server, or None when ``config.port`` is 0 (an ephemeral port: the real server
    would listen elsewhere, so there is nothing to hold).

    Raises:
        OSError: the address is in use.
    """
    metrics.loading.set(1)
    metrics.ready.set(0)

    server = None
    if config.port != 0:
        app = http.build_loading_app(http.Loading(metrics.render, {}), config)
        server = await _listen(app, config.host, config.port)
        log.info("loading the model; %s:%d answers the probes meanwhile", config.host, config.port)
    try:
        yield server
    finally:
        if server is not None:
            await server.cleanup()
        metrics.loading.set(0)


def build_store(config: RuntimeConfig, metrics: RuntimeMetrics, writer_id: str = "") -> SessionStore | None:
    """The Redis session store of ``config.redis_url`` (not started), or None without one; ``writer_id``: the
    worker's id where several share the node (``SessionWriter.writer_key``)."""
    if not config.redis_url:
        return None
    return SessionStore(
        config.redis_url,
        config.node_id,
        session_ttl_s=config.transcript_ttl_s,
        transcript_ttl_s=config.transcript_ttl_s,
        on_error=lambda op: metrics.redis_errors.labels(op=op).inc(),
        on_backlog=metrics.redis_backlog.set,
        events_maxlen=config.events_maxlen,
        writer_id=writer_id,
        aof_rewrite_every_s=config.aof_rewrite_every_s,
    )
