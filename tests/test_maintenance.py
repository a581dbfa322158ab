"""The GCE host-maintenance watcher (``runtime/frontend/maintenance.py``) against a fake metadata server on
loopback,
alone and inside a running server with the tiny model.

:class:`FakeMetadataServer` serves the one key, ``/computeMetadata/v1/instance/maintenance-event``, as GCE's
metadata server does (https://cloud.google.com/compute/docs/metadata/querying-metadata): 403 without the
``Metadata-Flavor: Google`` header, the value with an ``ETag``, and with ``wait_for_change=true`` an answer
only once the value's ETag differs from ``last_etag`` (at once if it already does) or after
``timeout_sec``. It can also fail the next requests with 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from pydantic import ValidationError

# The end-to-end helpers and the tiny model's fixtures (bundle, speech) of the server tests.
from test_server_e2e import (
    assert_healthy,
    assert_refused,
    bundle,  # noqa: F401 - a fixture
    chat_url,
    knock,
    live,
    readyz,
    running_server,
    scrape,
    speech,  # noqa: F401 - a fixture
    wait_until,
)

from runtime.config import RuntimeConfig
from runtime.frontend.maintenance import (
    GCE_MAINTENANCE_EVENT_URL,
    GCE_PREEMPTED_URL,
    MIGRATE,
    NONE,
    PREEMPTION_GRACE_S,
    TERMINATE,
    MaintenanceWatcher,
    backoff_delay,
    is_pending,
    is_preempted,
    preempted_url,
    start_maintenance_watch,
)
from runtime.metrics import RuntimeMetrics

KEY_PATH = "/computeMetadata/v1/instance/maintenance-event"
PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"


class FakeMetadataServer:
    """GCE's metadata server for the ``maintenance-event`` key (and ``preempted`` beside it, whose
    requests are not recorded), on a free loopback port (a thread)."""

    def __init__(self, value: str = NONE) -> None:
        self._changed = threading.Condition()
        self._value = value
        self._version = 1
        self._preempted = ["FALSE", 1]  # value, version of instance/preempted
        self._closing = False
        self.fail_next = 0  # answer this many next requests with 503
        self.requests: list[tuple[dict[str, list[str]], str | None]] = []  # (query, Metadata-Flavor)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                parts = urlsplit(self.path)
                query = parse_qs(parts.query)
                flavor = self.headers.get("Metadata-Flavor")
                if parts.path == PREEMPTED_PATH:
                    return self._preempted(query, flavor)
                with fake._changed:
                    fake.requests.append((query, flavor))
                if parts.path != KEY_PATH:
                    return self._answer(404, "not found")
                if flavor != "Google":
                    return self._answer(403, "Missing Metadata-Flavor:Google header.")
                with fake._changed:
                    if fake.fail_next > 0:
                        fake.fail_next -= 1
                        return self._answer(503, "unavailable")
                    if query.get("wait_for_change") == ["true"]:
                        last = query.get("last_etag", [None])[0]
                        timeout_s = float(query.get("timeout_sec", ["60"])[0])
                        fake._changed.wait_for(lambda: fake.etag != last or fake._closing, timeout_s)
                    value, etag = fake._value, fake.etag
                return self._answer(200, value, etag)

            def _preempted(self, query: dict[str, list[str]], flavor: str | None) -> None:
                if flavor != "Google":
                    return self._answer(403, "Missing Metadata-Flavor:Google header.")
                with fake._changed:
                    if query.get("wait_for_change") == ["true"]:
                        last = query.get("last_etag", [None])[0]
                        timeout_s = float(query.get("timeout_sec", ["60"])[0])
                        fake._changed.wait_for(
                            lambda: f"p{fake._preempted[1]:015x}" != last or fake._closing, timeout_s
                        )
                    value, etag = fake._preempted[0], f"p{fake._preempted[1]:015x}"
                return self._answer(200, str(value), etag)

            def _answer(self, status: int, body: str, etag: str | None = None) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/text")
                self.send_header("Content-Length", str(len(data)))
                if etag is not None:
                    self.send_header("ETag", etag)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}{KEY_PATH}"

    @property
    def etag(self) -> str:
        return f"{self._version:016x}"

    def set(self, value: str) -> None:
        """A new value of the key (a new ETag); waiting requests are answered."""
        with self._changed:
            self._value = value
            self._version += 1
            self._changed.notify_all()

    def preempt(self) -> None:
        """GCE preempts the VM: ``instance/preempted`` reads TRUE."""
        with self._changed:
            self._preempted = ["TRUE", int(self._preempted[1]) + 1]
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def metadata() -> Iterator[FakeMetadataServer]:
    fake = FakeMetadataServer()
    try:
        yield fake
    finally:
        fake.close()


class Recorder:
    """``on_change`` that records what it was told."""

    def __init__(self) -> None:
        self.changes: list[bool] = []

    def __call__(self, pending: bool) -> None:
        self.changes.append(pending)


@contextlib.asynccontextmanager
async def watching(url: str, on_change: object, **kwargs: object) -> AsyncIterator[MaintenanceWatcher]:
    watcher = MaintenanceWatcher(url, on_change, RuntimeMetrics(), **kwargs)  # type: ignore[arg-type]
    watcher.start(asyncio.get_running_loop())
    try:
        yield watcher
    finally:
        watcher.stop()


# --------------------------------------------------------------------------------------------------
# The watcher alone
# --------------------------------------------------------------------------------------------------


def test_which_values_mean_a_pending_stop() -> None:
    assert is_pending(TERMINATE) and is_pending(TERMINATE + "\n")
    assert not is_pending(NONE) and not is_pending(MIGRATE)
    assert is_pending("SOMETHING_NEW_ON_HOST_MAINTENANCE")  # unknown: fail safe, stop admitting


def test_backoff_doubles_up_to_its_cap() -> None:
    delays = [backoff_delay(n, initial_s=1.0, maximum_s=60.0) for n in range(1, 10)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert backoff_delay(10_000, initial_s=0.5, maximum_s=5.0) == 5.0
    with pytest.raises(ValueError, match="failures must be >= 1"):
        backoff_delay(0, initial_s=1.0, maximum_s=2.0)
    with pytest.raises(ValueError, match="initial_s <= maximum_s"):
        backoff_delay(1, initial_s=3.0, maximum_s=2.0)


async def test_watcher_follows_the_notice_with_wait_for_change(metadata: FakeMetadataServer) -> None:
    told = Recorder()
    async with watching(metadata.url, told) as watcher:
        await wait_until(lambda: told.changes == [False], what="the first value")
        metadata.set(TERMINATE)
        await wait_until(lambda: told.changes == [False, True], what="the notice")
        assert watcher.metrics.maintenance_pending._value.get() == 1
        metadata.set(NONE)
        await wait_until(lambda: told.changes == [False, True, False], what="the notice to clear")
        assert watcher.metrics.maintenance_pending._value.get() == 0
        metadata.set(MIGRATE)  # a live migration is not a stop: nothing to tell
        await wait_until(lambda: watcher.value == MIGRATE, what="the migration notice to be read")
        assert told.changes == [False, True, False]
    # Every request carried the header; after the first, each waited for a change since the ETag it had.
    assert {flavor for _, flavor in metadata.requests} == {"Google"}
    first, *waits = [query for query, _ in metadata.requests]
    assert first == {}
    assert waits and all(q["wait_for_change"] == ["true"] and q["last_etag"] for q in waits)
    assert [q["last_etag"][0] for q in waits[:3]] == [f"{v:016x}" for v in (1, 2, 3)]


async def test_metadata_errors_are_counted_backed_off_and_survived(metadata: FakeMetadataServer) -> None:
    metadata.fail_next = 3
    told = Recorder()
    async with watching(metadata.url, told, backoff_initial_s=0.01, backoff_max_s=0.02) as watcher:
        await wait_until(lambda: told.changes == [False], what="the value after three 503s")
        assert watcher.metrics.maintenance_watch_errors._value.get() == 3
        assert watcher.alive
        metadata.set(TERMINATE)
        await wait_until(lambda: told.changes == [False, True], what="the notice after the errors")


async def test_an_unreachable_metadata_server_never_stops_the_watch() -> None:
    with contextlib.closing(FakeMetadataServer()) as gone:
        url = gone.url
    told = Recorder()
    async with watching(url, told, backoff_initial_s=0.01, backoff_max_s=0.02) as watcher:
        await wait_until(lambda: watcher.metrics.maintenance_watch_errors._value.get() >= 3)
        assert watcher.alive and told.changes == []  # state unchanged: nothing is pending


async def test_a_failing_handler_does_not_stop_the_watch(metadata: FakeMetadataServer) -> None:
    told = Recorder()

    def handler(pending: bool) -> None:
        told(pending)
        raise RuntimeError("the runtime's handler broke")

    async with watching(metadata.url, handler) as watcher:
        await wait_until(lambda: told.changes == [False])
        metadata.set(TERMINATE)
        await wait_until(lambda: told.changes == [False, True])
        assert watcher.alive


async def test_nothing_is_delivered_after_stop(metadata: FakeMetadataServer) -> None:
    told = Recorder()
    async with watching(metadata.url, told) as watcher:
        await wait_until(lambda: told.changes == [False])
        watcher.stop()
        watcher._deliver(True)  # a change read just before the stop, arriving on the loop after it
        assert told.changes == [False]


def test_settings_are_typed() -> None:
    config = RuntimeConfig()
    assert config.maintenance_watch == "off"
    assert config.maintenance_metadata_url == GCE_MAINTENANCE_EVENT_URL
    assert RuntimeConfig(maintenance_watch="gce").maintenance_watch == "gce"
    with pytest.raises(ValidationError, match="'gce' or 'off'"):
        RuntimeConfig(maintenance_watch="aws")
    with pytest.raises(ValidationError, match="maintenance_metadata_url"):
        RuntimeConfig(maintenance_metadata_url="metadata.google.internal/x")
    with pytest.raises(ValueError, match="must be http"):
        MaintenanceWatcher("file:///etc/passwd", Recorder(), RuntimeMetrics())


# --------------------------------------------------------------------------------------------------
# Inside the runtime
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_maintenance_notice_drains_admissions_and_live_sessions_go_on(
    bundle,  # noqa: F811
    speech,  # noqa: F811
    metadata: FakeMetadataServer,
) -> None:
    settings = {"maintenance_watch": "gce", "maintenance_metadata_url": metadata.url}
    async with running_server(bundle, **settings) as srv:
        assert srv.maintenance is not None
        await wait_until(lambda: srv.maintenance.value == NONE, what="the watcher's first read")
        assert (await readyz(srv))[0] == 200

        async with live(chat_url(srv), speech[0]) as client:
            assert client.result.handshake
            client.start_streaming()
            await client.wait_audio(1)
            metadata.set(TERMINATE)
            await wait_until(lambda: srv.draining, what="the notice to reach the server")
            noticed = time.monotonic()
            (status, body), refused = await asyncio.gather(readyz(srv), knock(chat_url(srv), speech[1]))
            assert status == 503 and body == {"ready": False, "reason": "draining"}
            assert_refused(refused, 1013, "draining")
            await client.wait_audio(after=noticed)  # the live session streams on through the notice
            await client.finish()
        assert_healthy(client, after=noticed)  # to its normal end: 1000, every frame accounted for

        metrics = await scrape(srv)
        assert metrics.value("duplex_maintenance_pending") == 1
        assert metrics.value("duplex_draining") == 1
        assert metrics.value("duplex_ready") == 0
        assert metrics.value("duplex_admissions_refused_total", reason="draining") == 1
        assert metrics.value("duplex_sessions_ended_total", reason="client_closed") == 1
        assert metrics.value("duplex_sessions_ended_total", reason="drained") == 0

        # The notice is withdrawn: the node admits again.
        metadata.set(NONE)
        await wait_until(lambda: not srv.draining, what="the cleared notice to reach the server")
        assert (await readyz(srv))[0] == 200
        assert (await knock(chat_url(srv), speech[1])).handshake
        metrics = await scrape(srv)
        assert metrics.value("duplex_maintenance_pending") == 0
        assert metrics.value("duplex_ready") == 1

        # A SIGTERM drain stops the watch first: a notice clearing afterwards cannot re-open the node.
        metadata.set(TERMINATE)
        await wait_until(lambda: srv.draining)
        watcher = srv.maintenance
        drain = asyncio.create_task(srv.drain(grace_s=0.5))
        await asyncio.sleep(0)
        assert srv.maintenance is None
        watcher._deliver(False)  # what a NONE read just then would do
        assert srv.draining
        await asyncio.wait_for(drain, 30)


# --------------------------------------------------------------------------------------------------
# Where it is on
# --------------------------------------------------------------------------------------------------


def test_gke_pods_do_not_watch(objects: list[dict]) -> None:
    """On GKE the cluster handles GPU host maintenance (cordon, drain, the pod's grace period): the runtime
    pods keep the default, off. (GCE VMs: tests/test_node_cloud_init.py; on-premises: compose's default.)"""
    runtimes = [
        container
        for o in objects
        if o["kind"] == "Deployment"
        for container in o["spec"]["template"]["spec"]["containers"]
        if container["name"] == "runtime"
    ]
    assert runtimes
    for container in runtimes:
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert "DUPLEX_MODEL" in env  # the runtime's settings are there
        assert env.get("DUPLEX_MAINTENANCE_WATCH", "off") == "off"


# --------------------------------------------------------------------------------------------------
# Spot preemption (issue 20 item 13)
# --------------------------------------------------------------------------------------------------


def test_the_preemption_key_sits_beside_the_maintenance_key() -> None:
    """The preemption watch reads ``instance/preempted`` at the same metadata root (GCE's, or a fake)."""
    assert preempted_url(GCE_MAINTENANCE_EVENT_URL) == GCE_PREEMPTED_URL
    assert preempted_url("http://127.0.0.1:8/computeMetadata/v1/instance/maintenance-event?x=1") == (
        "http://127.0.0.1:8/computeMetadata/v1/instance/preempted?x=1"
    )
    with pytest.raises(ValueError, match="must end in /maintenance-event"):
        preempted_url("http://127.0.0.1:8/other")
    assert is_preempted("TRUE") and is_preempted("TRUE\n") and not is_preempted("FALSE")
    assert PREEMPTION_GRACE_S < 30, "the Spot notice is 30 s"


async def test_a_preemption_calls_on_preempted_once(metadata: FakeMetadataServer) -> None:
    """Guards item 13: ``instance/preempted`` was not watched, so a Spot preemption cut every live session
    without a word. The watch started for ``gce`` calls ``on_preempted`` once on TRUE (never for FALSE),
    and stops with the maintenance watcher."""
    config = RuntimeConfig(maintenance_watch="gce", maintenance_metadata_url=metadata.url)
    changes = Recorder()
    preemptions: list[float] = []
    watcher = start_maintenance_watch(
        config, RuntimeMetrics(), changes, on_preempted=lambda: preemptions.append(time.monotonic())
    )
    assert watcher is not None
    try:
        await wait_until(lambda: changes.changes == [False], what="the first maintenance read")
        [preemption] = watcher.companions
        await wait_until(lambda: preemption.value == "FALSE", what="the first preemption read")
        assert preemptions == []
        metadata.preempt()
        await wait_until(lambda: len(preemptions) == 1, what="the preemption to be delivered")
        await asyncio.sleep(0.2)
        assert len(preemptions) == 1 and changes.changes == [False]
    finally:
        watcher.stop()
    assert preemption._stop.is_set()


async def test_without_on_preempted_a_preemption_stops_admissions(metadata: FakeMetadataServer) -> None:
    """A server that does not pass ``on_preempted`` still stops admitting on a preemption."""
    config = RuntimeConfig(maintenance_watch="gce", maintenance_metadata_url=metadata.url)
    changes = Recorder()
    watcher = start_maintenance_watch(config, RuntimeMetrics(), changes)
    assert watcher is not None
    try:
        await wait_until(lambda: changes.changes == [False], what="the first maintenance read")
        metadata.preempt()
        await wait_until(lambda: changes.changes == [False, True], what="the preemption as a notice")
    finally:
        watcher.stop()


@pytest.mark.slow
async def test_a_preemption_closes_live_sessions_with_1001_within_the_notice(
    bundle,  # noqa: F811
    speech,  # noqa: F811
    metadata: FakeMetadataServer,
) -> None:
    """Guards item 13 end to end: a live session on a preempted Spot VM is closed with 1001 (going away)
    within ``PREEMPTION_GRACE_S`` of the notice, well inside GCE's 30 s, instead of being cut by the hard
    power-off after a drain grace the notice cannot cover. The server is wired as the lead wires it:
    ``on_preempted`` = ``drain(PREEMPTION_GRACE_S)`` (here a 1 s grace, the budget injected)."""
    async with running_server(bundle) as srv:
        config = RuntimeConfig(maintenance_watch="gce", maintenance_metadata_url=metadata.url)
        drains: list[asyncio.Task] = []
        watcher = start_maintenance_watch(
            config,
            srv.metrics,
            lambda pending: None,
            on_preempted=lambda: drains.append(asyncio.ensure_future(srv.drain(grace_s=1.0))),
        )
        assert watcher is not None
        try:
            async with live(chat_url(srv), speech[0]) as client:
                assert client.result.handshake
                client.start_streaming()
                await asyncio.sleep(0.5)
                metadata.preempt()
                await wait_until(lambda: bool(drains), what="the preemption to reach the server")
                result = await client.wait_closed(timeout_s=20)
                await asyncio.wait_for(drains[0], 20)
            assert result.close_code == 1001, (result.close_code, result.close_reason)
        finally:
            watcher.stop()


async def test_a_metadata_url_of_another_shape_watches_maintenance_only(metadata: FakeMetadataServer) -> None:
    """``DUPLEX_MAINTENANCE_METADATA_URL`` pointing at another path still starts the maintenance watch (the
    preemption key cannot be placed beside it): nothing raises into the runtime."""
    config = RuntimeConfig(maintenance_watch="gce", maintenance_metadata_url=metadata.url + "-other")
    watcher = start_maintenance_watch(config, RuntimeMetrics(), Recorder())
    assert watcher is not None
    try:
        assert watcher.companions == [] and watcher.alive
    finally:
        watcher.stop()
