"""GCE host-maintenance watcher: a GPU VM's notice of maintenance drains the node's admissions.

:class:`MaintenanceWatcher` long-polls the metadata server's ``instance/maintenance-event`` key
(``wait_for_change`` with ``last_etag``, no busy polling) and :func:`start_maintenance_watch` also
``instance/preempted``. A pending notice (:func:`is_pending`: ``TERMINATE_ON_HOST_MAINTENANCE`` or an
unknown value) stops admissions while live sessions go on, ``NONE`` admits again (never after a SIGTERM
drain), a preemption calls ``on_preempted`` once (a drain within ``PREEMPTION_GRACE_S``) and is never
withdrawn. Metadata-server failures are logged, counted and retried with backoff (:func:`backoff_delay`);
nothing here raises into the runtime, and the watch runs in a daemon thread the tick never waits on.

What each value does, and the sources: docs/operations.md, "Drain"."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.config import RuntimeConfig
    from runtime.metrics import RuntimeMetrics

__all__ = [
    "GCE_MAINTENANCE_EVENT_URL",
    "GCE_PREEMPTED_URL",
    "PREEMPTION_GRACE_S",
    "MaintenanceWatcher",
    "backoff_delay",
    "is_pending",
    "is_preempted",
    "preempted_url",
    "start_maintenance_watch",
]

log = logging.getLogger("duplex.maintenance")

GCE_MAINTENANCE_EVENT_URL = "http://metadata.google.internal/computeMetadata/v1/instance/maintenance-event"
"""The key's URL on a GCE VM (https://cloud.google.com/compute/docs/gpus/gpu-host-maintenance)."""

GCE_PREEMPTED_URL = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"
"""A Spot VM's preemption flag, ``TRUE`` once preempted (https://cloud.google.com/compute/docs/instances/
create-use-spot, "Detect if a VM was preempted")."""

PREEMPTION_GRACE_S = 15.0
"""Seconds live sessions may go on after a preemption notice before they are closed with 1001: half of
the 30 s Spot notice (``infra.components.gce_node.SPOT_PREEMPTION_NOTICE_S``), leaving the rest for the
closes to reach the callers before GCE's soft off and hard off."""

NONE = "NONE"
MIGRATE = "MIGRATE_ON_HOST_MAINTENANCE"
TERMINATE = "TERMINATE_ON_HOST_MAINTENANCE"


def is_pending(value: str) -> bool:
    """Whether a ``maintenance-event`` value means "stop admitting": True for
    ``TERMINATE_ON_HOST_MAINTENANCE`` and for any value not known here, False for ``NONE`` and
    ``MIGRATE_ON_HOST_MAINTENANCE`` (module docstring for why)."""
    return value.strip() not in (NONE, MIGRATE)


def is_preempted(value: str) -> bool:
    """Whether an ``instance/preempted`` value says the VM is being preempted (``TRUE``)."""
    return value.strip().upper() == "TRUE"


def preempted_url(maintenance_url: str) -> str:
    """The ``preempted`` key beside a ``maintenance-event`` URL (same metadata root: a fake server in tests).

    Raises:
        ValueError: the URL's path does not end in ``/maintenance-event``.
    """
    parts = urllib.parse.urlsplit(maintenance_url)
    if not parts.path.endswith("/maintenance-event"):
        raise ValueError(f"maintenance metadata URL must end in /maintenance-event, got {maintenance_url!r}")
    path = parts.path.removesuffix("maintenance-event") + "preempted"
    return urllib.parse.urlunsplit(parts._replace(path=path))


def backoff_delay(failures: int, *, initial_s: float, maximum_s: float) -> float:
    """Seconds to wait after ``failures`` consecutive failed requests (>= 1): ``initial_s`` doubled for
    each further failure, capped at ``maximum_s``.

    Raises:
        ValueError: ``failures`` < 1, or ``initial_s`` not in (0, ``maximum_s``].
    """
    if failures < 1:
        raise ValueError(f"failures must be >= 1 (the count of consecutive failures), got {failures}")
    if not 0 < initial_s <= maximum_s:
        raise ValueError(f"need 0 < initial_s <= maximum_s, got initial_s={initial_s}, maximum_s={maximum_s}")
    return min(maximum_s, initial_s * 2.0 ** min(failures - 1, 62))


class MaintenanceWatcher:
    """Long-polls a GCE ``maintenance-event`` key and calls ``on_change(pending)`` on the event loop
    whenever pending (:func:`is_pending`) changes, first with the value read at start.

    Args:
        url: the key's URL (``GCE_MAINTENANCE_EVENT_URL`` on a VM; a loopback fake in tests).
        on_change: called on ``loop``'s thread with True (notice) or False (clear); its exceptions are
            logged, never raised.
        metrics: ``maintenance_pending`` (0/1) and ``maintenance_watch_errors`` are kept up to date.
        wait_timeout_s: ``timeout_sec`` of each wait-for-change request (the server answers by then).
        backoff_initial_s, backoff_max_s: retry delays after failures (:func:`backoff_delay`).
        classify: value -> pending (:func:`is_pending`; :func:`is_preempted` for the preemption key).
        track_metrics: keep ``maintenance_pending`` up to date (off for the preemption watch).

    Raises:
        ValueError: a URL that is not http(s), or a non-positive timeout.
    """

    def __init__(
        self,
        url: str,
        on_change: Callable[[bool], None],
        metrics: RuntimeMetrics,
        *,
        wait_timeout_s: int = 300,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 60.0,
        classify: Callable[[str], bool] = is_pending,
        track_metrics: bool = True,
    ) -> None:
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ValueError(f"maintenance metadata URL must be http(s)://..., got {url!r}")
        if wait_timeout_s < 1:
            raise ValueError(f"wait_timeout_s must be >= 1 s, got {wait_timeout_s}")
        backoff_delay(1, initial_s=backoff_initial_s, maximum_s=backoff_max_s)  # validates both
        self.url = url
        self.on_change = on_change
        self.metrics = metrics
        self.wait_timeout_s = wait_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.classify = classify
        self.track_metrics = track_metrics
        self.companions: list[MaintenanceWatcher] = []  # stopped with this one (the preemption watch)
        self.value: str | None = None  # the last value read (None before the first answer)
        self._pending: bool | None = None  # as delivered to on_change
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # No proxy: the metadata server is link-local, and a proxy variable of the host must not catch it.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # --- lifecycle ------------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start watching; changes are delivered on ``loop``."""
        if self._thread is not None:
            raise RuntimeError("the maintenance watcher is already started")
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="duplex-maintenance-watch", daemon=True)
        self._thread.start()
        log.info("watching %s for host maintenance notices", self.url)

    def stop(self) -> None:
        """Stop watching. From then on nothing is delivered, even a change already read (call it on the
        loop's thread, as the server does). The thread ends when its current request returns. Its
        companions stop with it."""
        self._stop.set()
        for companion in self.companions:
            companion.stop()

    @property
    def alive(self) -> bool:
        """Whether the watching thread still runs."""
        return self._thread is not None and self._thread.is_alive()

    # --- the thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        etag: str | None = None
        while not self._stop.is_set():
            try:
                value, etag = self._read(etag)
            except Exception as exc:  # noqa: BLE001 - whatever happens, the runtime goes on
                failures += 1
                delay = backoff_delay(
                    failures, initial_s=self.backoff_initial_s, maximum_s=self.backoff_max_s
                )
                self.metrics.maintenance_watch_errors.inc()
                log.warning(
                    "maintenance watch: %s failed (%s); retrying in %.0f s (failure %d in a row)",
                    self.url,
                    _describe(exc),
                    delay,
                    failures,
                )
                self._stop.wait(delay)
                continue
            failures = 0
            if etag is None:  # a server without ETags (not GCE's): poll, never spin
                self._stop.wait(self.backoff_max_s)
            if value != self.value:
                log.info("maintenance-event: %s (was %s)", value, self.value)
            self.value = value
            self._post(self.classify(value))

    def _read(self, etag: str | None) -> tuple[str, str | None]:
        """One request: at once when no etag is known yet, else a wait for a change since ``etag``."""
        url = self.url
        timeout = 10.0
        if etag is not None:
            query = urllib.parse.urlencode(
                {"wait_for_change": "true", "last_etag": etag, "timeout_sec": str(self.wait_timeout_s)}
            )
            url = f"{url}{'&' if '?' in url else '?'}{query}"
            timeout = self.wait_timeout_s + 10.0
        request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        with self._opener.open(request, timeout=timeout) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}")
            value = response.read(4096).decode("utf-8", "replace").strip()
            return value, response.headers.get("ETag") or etag

    def _post(self, pending: bool) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            self._stop.set()
            return
        with contextlib.suppress(RuntimeError):  # the loop closed in between: nothing left to tell
            loop.call_soon_threadsafe(self._deliver, pending)

    # --- on the loop ----------------------------------------------------------------------------------

    def _deliver(self, pending: bool) -> None:
        if self._stop.is_set() or pending == self._pending:
            return
        self._pending = pending
        if self.track_metrics:
            self.metrics.maintenance_pending.set(int(pending))
        try:
            self.on_change(pending)
        except Exception:
            log.exception("maintenance watch: the runtime's handler failed")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}"
    if isinstance(exc, urllib.error.URLError):
        return f"{type(exc.reason).__name__}: {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


def start_maintenance_watch(
    config: RuntimeConfig,
    metrics: RuntimeMetrics,
    on_change: Callable[[bool], None],
    on_preempted: Callable[[], object] | None = None,
) -> MaintenanceWatcher | None:
    """The watcher ``config.maintenance_watch`` asks for, started on the running loop; None when ``off``.
    With ``gce`` it also watches ``instance/preempted`` (:func:`preempted_url`): on ``TRUE`` it calls
    ``on_preempted()`` once on the loop (the server: ``drain(PREEMPTION_GRACE_S)``), or, without one,
    ``on_change(True)``. The preemption watch stops with the returned watcher; a metadata URL that does not
    end in ``/maintenance-event`` gets none (logged). Call from a coroutine (the server's ``start``)."""
    if config.maintenance_watch == "off":
        return None
    loop = asyncio.get_running_loop()
    watcher = MaintenanceWatcher(config.maintenance_metadata_url, on_change, metrics)
    fired = False

    def preempted(now: bool) -> None:
        nonlocal fired
        if not now or fired:  # FALSE before a preemption; a preemption is never withdrawn
            return
        fired = True
        log.warning("preempted: closing live sessions within %.0f s", PREEMPTION_GRACE_S)
        if on_preempted is None:
            on_change(True)
        else:
            on_preempted()

    watcher.start(loop)
    try:
        url = preempted_url(config.maintenance_metadata_url)
    except ValueError as exc:  # a URL of another shape: the maintenance watch alone
        log.warning("no preemption watch: %s", exc)
        return watcher
    preemption = MaintenanceWatcher(url, preempted, metrics, classify=is_preempted, track_metrics=False)
    watcher.companions.append(preemption)
    preemption.start(loop)
    return watcher
