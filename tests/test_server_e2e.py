"""End-to-end tests of the batched full-duplex server: real sockets, real speech, real Redis, real signals.

Every test talks to a :class:`runtime.frontend.server.DuplexServer` over the wire protocol on ``/api/chat``
and over
HTTP (``/healthz``, ``/readyz``, ``/metrics``), exactly as a deployed node is used. The tiny model (random
weights, CPU) is built once per module; each server gets its own deep copy, since the engine puts the
models in streaming mode.

Servers:

- ``shared_server`` (module scope, 5 slots, no store) serves the tests that leave it as they found it: the
  bad-input tests, the node-full and disconnect tests and the HTTP endpoint test. The function-scoped
  ``server`` fixture hands it out and, after each test, checks that every session is gone and every slot
  free again, so a leaked session fails the test that leaked it.
- Tests that change server state for good (a Redis registry to inspect, a drain, counters that must start
  at zero) start their own with :func:`running_server`.

Timing: sessions stream at real-time pace (80 ms frames), so the assertions on time are loose (an audio
gap under half a second where 80 ms is normal); counts allow for the acoustic delay of a frame or two.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import sphn
from inproc_node import InProcessNode
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from runtime.config import RuntimeConfig
from runtime.engine.engine_core import LocalSlots
from runtime.engine.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.engine.models import ModelBundle, build_tiny
from runtime.frontend.audio_codec import make_codec
from runtime.frontend.protocol import AudioFormat, MessageKind, encode_audio
from runtime.frontend.server import DuplexServer
from runtime.frontend.session_store import SessionStore
from runtime.metrics import RuntimeMetrics
from runtime.tools.loadgen import SessionResult, run_session, session_url, synthesize_speech
from runtime.tools.local_redis import free_loopback_port

pytestmark = pytest.mark.asyncio(loop_scope="module")

SLOTS = 5
FRAME_S = FRAME_SAMPLES / SAMPLE_RATE_HZ
FRAME_ALLOWANCE = 3
"""Audio messages a session may receive fewer than the frames it sent (acoustic delay, first frame)."""
MAX_GAP_S = 0.5
"""Longest silence allowed between two audio messages of a healthy session (80 ms is normal)."""
SENTENCES = (
    "Hello, can you hear me? I would like to book a table.",
    "What is the weather going to be like tomorrow morning?",
    "Please tell me a short story about a robot.",
    "I am calling about my order from last week.",
    "How many planets are there in the solar system?",
)
NODE_ID = "e2e-node"


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    """The tiny model, built once; never started itself (servers get deep copies)."""
    return build_tiny(0)


@pytest.fixture(scope="module")
def speech() -> list[np.ndarray]:
    """Five different sentences of real speech (espeak-ng, 24 kHz), each 2 to 4 s long."""
    clips = [synthesize_speech(text) for text in SENTENCES]
    for text, pcm in zip(SENTENCES, clips, strict=True):
        assert 2.0 <= len(pcm) / SAMPLE_RATE_HZ <= 4.0, (text, len(pcm) / SAMPLE_RATE_HZ)
    return clips


def make_server(
    bundle: ModelBundle,
    *,
    redis_url: str | None = None,
    max_sessions: int = SLOTS,
    workers: int = 0,
    **config: object,
) -> DuplexServer:
    """A DuplexServer on a free port with its own copy of the model, wired like ``build_server``; with
    ``workers`` >= 1, the same front end in that many workers over an engine (``tests/inproc_node.py``).
    Access control is off unless ``auth_mode`` is given (tests/test_access_control.py covers it)."""
    config.setdefault("auth_mode", "off")
    config.setdefault("metrics_cache_s", 0)  # each scrape sees the counters of the moment
    settings = RuntimeConfig(
        host="127.0.0.1",
        port=0,
        max_sessions=max_sessions,
        node_id=NODE_ID,
        redis_url=redis_url,
        **config,
    )
    metrics = RuntimeMetrics()
    store = None
    if redis_url:
        store = SessionStore(
            redis_url,
            NODE_ID,
            on_error=lambda op: metrics.redis_errors.labels(op=op).inc(),
            on_backlog=metrics.redis_backlog.set,
        )
    if workers:
        node = InProcessNode(settings, copy.deepcopy(bundle), workers=workers, store=store, metrics=metrics)
        return node  # type: ignore[return-value]  # the server surface these tests use
    backend = LocalSlots(settings, copy.deepcopy(bundle), metrics)
    return DuplexServer(settings, backend, store=store, metrics=metrics)


@contextlib.asynccontextmanager
async def running_server(bundle: ModelBundle, **kwargs: object) -> AsyncIterator[DuplexServer]:
    """A started server, closed on exit (closing twice, e.g. after a drain, is harmless)."""
    server = make_server(bundle, **kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_server(bundle: ModelBundle) -> AsyncIterator[DuplexServer]:
    async with running_server(bundle) as server:
        yield server


WORKER_MODES = [pytest.param(0, id="workers0"), pytest.param(2, id="workers2")]
"""``duplex serve --workers 0`` and ``--workers 2`` (issue 21: one front end over either backend)."""


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=WORKER_MODES)
async def shared_node(request: pytest.FixtureRequest, bundle: ModelBundle) -> AsyncIterator[DuplexServer]:
    async with running_server(bundle, workers=request.param) as server:
        yield server


@pytest_asyncio.fixture(loop_scope="module")
async def node(shared_node: DuplexServer) -> AsyncIterator[DuplexServer]:
    """As ``server``, in each mode (``WORKER_MODES``): the representative tests run against both."""
    yield shared_node
    await wait_until(
        lambda: not shared_node.sessions and shared_node.backend.status().free_slots == SLOTS,
        timeout_s=15,
        what="the shared node to be idle after the test (a session was left behind)",
    )


@pytest_asyncio.fixture(loop_scope="module")
async def server(shared_server: DuplexServer) -> AsyncIterator[DuplexServer]:
    """The shared server; after the test every session must have ended and every slot be free."""
    yield shared_server
    await wait_until(
        lambda: not shared_server.sessions and shared_server.backend.status().free_slots == SLOTS,
        timeout_s=15,
        what="the shared server to be idle after the test (a session was left behind)",
    )


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


async def wait_until(predicate: Callable[[], bool], *, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what or predicate}")
        await asyncio.sleep(0.05)


def base_url(server: DuplexServer) -> str:
    return f"ws://127.0.0.1:{server.port}"


def chat_url(server: DuplexServer, **params: object) -> str:
    return session_url(base_url(server), **params)


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


async def http_get(port: int, path: str) -> tuple[int, str, str]:
    """(status, Content-Type, body) of ``GET http://127.0.0.1:port/path``; 4xx/5xx are returned too."""

    def get() -> tuple[int, str, str]:
        try:
            with _NO_PROXY.open(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
                return response.status, response.headers.get("Content-Type", ""), response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()

    return await asyncio.to_thread(get)


async def readyz(server: DuplexServer) -> tuple[int, dict]:
    status, content_type, body = await http_get(server.port, "/readyz")
    assert content_type.startswith("application/json"), content_type
    return status, json.loads(body)


async def readyz_settled(server: DuplexServer, expected: int, timeout_s: float = 5.0) -> tuple[int, dict]:
    """``/readyz`` once it answers ``expected`` (or the last answer after ``timeout_s``): with ``--workers
    N`` a worker answers from the engine's last status, sent every 100 ms (``STATUS_PERIOD_S``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = await readyz(server)
        if status == expected or time.monotonic() > deadline:
            return status, body
        await asyncio.sleep(0.05)


class Metrics:
    """One parsed Prometheus scrape: ``value(name, **labels)``; a name absent from the scrape raises."""

    def __init__(self, text: str) -> None:
        self.samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.names: set[str] = set()  # sample names, and family names (a labelled metric may have none)
        for family in text_string_to_metric_families(text):
            self.names.add(family.name)
            for sample in family.samples:
                self.names.add(sample.name)
                self.samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def _check(self, name: str) -> None:
        if name not in self.names and name.removesuffix("_total") not in self.names:
            raise KeyError(f"metric {name} not in the scrape")

    def value(self, name: str, **labels: str) -> float:
        self._check(name)
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def total(self, name: str) -> float:
        """Sum over every label set of ``name``."""
        self._check(name)
        return sum(v for (n, _), v in self.samples.items() if n == name)


async def scrape(server: DuplexServer) -> Metrics:
    status, _, body = await http_get(server.port, "/metrics")
    assert status == 200
    return Metrics(body)


def local_metrics(server: DuplexServer) -> Metrics:
    """The server's metrics without HTTP (for a server that has stopped listening)."""
    return Metrics(server.metrics.render().decode())


class LiveClient:
    """A wire-protocol client that streams speech (looped) at real-time pace until told to stop.

    Unlike :func:`runtime.tools.loadgen.run_session` it can be held open, interleaved with other clients, sent
    raw messages at any moment, aborted, and it records when each frame was sent.
    """

    def __init__(self, url: str, pcm: np.ndarray, *, audio_format: AudioFormat = AudioFormat.PCM) -> None:
        self.url = url
        self.frames = [
            pcm[i : i + FRAME_SAMPLES] for i in range(0, len(pcm) - FRAME_SAMPLES + 1, FRAME_SAMPLES)
        ]
        _, self.encoder = make_codec(audio_format, max_buffered_frames=1000)
        self.result = SessionResult()
        self.sent_at: list[float] = []
        self.audio_payloads: list[bytes] = []  # the 0x01 payloads received, in order
        self.ws: ClientConnection | None = None
        self.settled = asyncio.Event()  # handshake received, or the connection ended without one
        self.closed = asyncio.Event()
        self._receiver: asyncio.Task[None] | None = None
        self._sender: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._frame_index = 0

    async def open(self, timeout_s: float = 30.0) -> LiveClient:
        self.ws = await connect(self.url, max_size=2**20, compression=None, open_timeout=30, proxy=None)
        self._receiver = asyncio.create_task(self._receive())
        await asyncio.wait_for(self.settled.wait(), timeout_s)
        return self

    async def _receive(self) -> None:
        assert self.ws is not None
        result = self.result
        try:
            async for message in self.ws:
                if isinstance(message, str) or not message:
                    result.errors.append(f"unexpected message from the server: {message!r}")
                    continue
                kind, payload = message[0], message[1:]
                if kind == MessageKind.HANDSHAKE:
                    result.handshake = True
                    self.settled.set()
                elif kind == MessageKind.AUDIO:
                    result.audio_messages += 1
                    result.audio_arrival_s.append(time.monotonic())
                    self.audio_payloads.append(payload)
                elif kind == MessageKind.TEXT:
                    result.text += payload.decode("utf-8")
                elif kind == MessageKind.ERROR:
                    result.errors.append(payload.decode("utf-8"))
        except ConnectionClosed:
            pass
        finally:
            result.close_code = self.ws.close_code
            result.close_reason = self.ws.close_reason or ""
            self.settled.set()
            self.closed.set()

    def next_frame_message(self) -> bytes:
        frame = self.frames[self._frame_index % len(self.frames)]
        self._frame_index += 1
        return encode_audio(self.encoder.encode(frame))

    async def send_frame(self) -> None:
        assert self.ws is not None
        await self.ws.send(self.next_frame_message())
        self.result.frames_sent += 1
        self.sent_at.append(time.monotonic())

    def start_streaming(self, *, burst_frames: int = 0) -> None:
        """Send frames in the background: ``burst_frames`` as fast as possible, then one per 80 ms."""
        assert self._sender is None
        self._stop.clear()
        self._sender = asyncio.create_task(self._stream(burst_frames))

    async def _stream(self, burst_frames: int) -> None:
        try:
            for _ in range(burst_frames):
                await self.send_frame()
            next_send = time.monotonic()
            while not self._stop.is_set():
                await self.send_frame()
                next_send += FRAME_S
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), max(0.0, next_send - time.monotonic()))
        except ConnectionClosed:
            pass

    async def stop_streaming(self) -> None:
        if self._sender is not None:
            self._stop.set()
            await self._sender
            self._sender = None

    async def send(self, message: bytes | str) -> None:
        assert self.ws is not None
        await self.ws.send(message)

    async def wait_error(self, timeout_s: float = 10.0) -> str:
        await wait_until(lambda: bool(self.result.errors), timeout_s=timeout_s, what="a 0x05 error")
        return self.result.errors[0]

    async def wait_closed(self, timeout_s: float = 15.0) -> SessionResult:
        await asyncio.wait_for(self.closed.wait(), timeout_s)
        await self.stop_streaming()
        return self.result

    async def finish(self, tail_s: float = 0.6) -> SessionResult:
        """Stop streaming, listen ``tail_s`` more, close normally; what the session saw."""
        await self.stop_streaming()
        if not self.closed.is_set():
            await asyncio.sleep(tail_s)
            assert self.ws is not None
            await self.ws.close()
        return await self.wait_closed()

    def abort(self) -> None:
        """Drop the TCP connection without a close frame (a crashed client, a pulled cable)."""
        assert self.ws is not None
        self.ws.transport.abort()

    async def discard(self) -> None:
        """Cleanup after a test, whatever state it left the client in."""
        for task in (self._sender, self._receiver):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if self.ws is not None and not self.closed.is_set():
            self.ws.transport.abort()


@contextlib.asynccontextmanager
async def live(url: str, pcm: np.ndarray, **kwargs: object) -> AsyncIterator[LiveClient]:
    """An open :class:`LiveClient` (handshake received or refused), discarded on exit."""
    client = LiveClient(url, pcm, **kwargs)  # type: ignore[arg-type]
    try:
        await client.open()
        yield client
    finally:
        await client.discard()


def assert_healthy(client: LiveClient, *, after: float | None = None, label: str = "session") -> None:
    """The session ran normally to its end: handshake, audio for every frame sent, no gap, no error,
    text, a normal close; and, from ``after`` on, it still got audio for every frame sent."""
    r = client.result
    assert r.handshake, f"{label}: no handshake ({r.errors}, close {r.close_code})"
    assert r.errors == [], f"{label}: errors {r.errors}"
    assert r.close_code == 1000, f"{label}: close {r.close_code} {r.close_reason!r}"
    assert r.frames_sent >= 10, f"{label}: only {r.frames_sent} frames sent"
    assert r.audio_messages >= r.frames_sent - FRAME_ALLOWANCE, (
        f"{label}: {r.audio_messages} audio messages for {r.frames_sent} frames sent"
    )
    assert r.max_audio_gap_s() < MAX_GAP_S, f"{label}: audio stalled for {r.max_audio_gap_s():.2f} s"
    assert r.text, f"{label}: no text"
    if after is not None:
        sent = sum(t > after for t in client.sent_at)
        received = sum(t > after for t in r.audio_arrival_s)
        assert sent >= 5, f"{label}: only {sent} frames sent after the disturbance"
        assert received >= sent - FRAME_ALLOWANCE, (
            f"{label}: {received} audio messages after the disturbance for {sent} frames sent"
        )


def assert_refused(result: SessionResult, code: int, *needles: str) -> str:
    """Refused before the handshake with one 0x05 error containing every needle, then ``code``."""
    assert not result.handshake, "the refused session got a handshake"
    assert result.audio_messages == 0
    assert len(result.errors) == 1, result.errors
    message = result.errors[0]
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert result.close_code == code, (result.close_code, result.close_reason)
    return message


async def knock(url: str, pcm: np.ndarray) -> SessionResult:
    """One short session attempt through the reference client."""
    return await run_session(url, pcm[: FRAME_SAMPLES * 3], tail_s=0.1, handshake_timeout_s=15)


# --------------------------------------------------------------------------------------------------
# 1. Five concurrent sessions of real speech, registry and metrics
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("workers", WORKER_MODES)
async def test_five_concurrent_real_speech_sessions_with_redis_registry(
    bundle, speech, redis_server, workers
):
    async with running_server(bundle, redis_url=redis_server.url, workers=workers) as srv:
        assert srv.store is not None
        results = await asyncio.gather(*[run_session(chat_url(srv), pcm) for pcm in speech])

        for i, (r, pcm) in enumerate(zip(results, speech, strict=True)):
            frames = len(pcm) // FRAME_SAMPLES
            assert r.handshake, (i, r.errors, r.close_code)
            assert r.errors == [], (i, r.errors)
            assert r.frames_sent == frames, (i, r.frames_sent, frames)
            assert r.audio_messages >= r.frames_sent - FRAME_ALLOWANCE, (i, r.audio_messages, r.frames_sent)
            assert r.audio_samples == r.audio_messages * FRAME_SAMPLES  # PCM: one whole frame per message
            assert r.text.strip(), i
            assert r.close_code == 1000, (i, r.close_code, r.close_reason)
            assert r.first_audio_ms is not None

        # Every session ended and the store caught up; then read the registry back from Redis.
        await wait_until(
            lambda: not srv.sessions and srv.store.backlog == 0 and srv.backend.status().free_slots == SLOTS,
            what="the store to flush and the slots to be freed (at the next tick)",
        )
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        try:
            keys = [key async for key in client.scan_iter(match="duplex:session:*")]
            ids = [key.removeprefix("duplex:session:") for key in keys]
            assert len(ids) == 5, keys
            transcripts, slots = [], []
            for session_id in ids:
                record = await srv.store.get_session(session_id)
                assert record is not None
                assert record["state"] == "ended", record
                assert record["end_reason"] == "client_closed", record
                assert record["node"] == NODE_ID
                assert record["format"] == "pcm"
                slots.append(int(record["slot"]))
                transcripts.append(await srv.store.get_transcript(session_id))
            assert sorted(slots) == list(range(SLOTS))
            assert await srv.store.active_sessions() == set()
        finally:
            await client.aclose()
        assert all(transcripts), transcripts
        assert sorted(transcripts) == sorted(r.text for r in results)

        metrics = await scrape(srv)
        assert metrics.value("duplex_sessions_started_total") == 5
        assert metrics.value("duplex_sessions_ended_total", reason="client_closed") == 5
        assert metrics.value("duplex_first_audio_latency_seconds_count") == 5
        assert metrics.value("duplex_admissions_refused_total", reason="node_full") == 0
        assert metrics.total("duplex_redis_errors_total") == 0
        assert metrics.value("duplex_active_sessions") == 0


# --------------------------------------------------------------------------------------------------
# 2. The sixth session on a full node
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_sixth_session_refused_while_five_run(node, speech):
    server = node  # both modes (WORKER_MODES)
    before = await scrape(server)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(live(chat_url(server), pcm)) for pcm in speech]
        for c in clients:
            assert c.result.handshake
            c.start_streaming()
        await asyncio.sleep(0.8)

        extra = await knock(chat_url(server), speech[0])
        mark = time.monotonic()
        message = assert_refused(extra, 1013, "node full")
        assert re.search(r"\b5\b", message), message

        await asyncio.sleep(1.5)
        for c in clients:
            await c.finish()
        for i, c in enumerate(clients):
            assert_healthy(c, after=mark, label=f"session {i}")

    after = await scrape(server)
    refused = after.value("duplex_admissions_refused_total", reason="node_full")
    assert refused == before.value("duplex_admissions_refused_total", reason="node_full") + 1
    started = after.value("duplex_sessions_started_total")
    assert started == before.value("duplex_sessions_started_total") + 5


# --------------------------------------------------------------------------------------------------
# 3. A client that vanishes frees its slot
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_abrupt_disconnect_frees_the_slot(node, speech):
    server = node  # both modes (WORKER_MODES)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(live(chat_url(server), pcm)) for pcm in speech]
        for c in clients:
            assert c.result.handshake
            c.start_streaming()
        await asyncio.sleep(0.5)

        status, body = await readyz(server)
        assert status == 503, body
        assert body["ready"] is False
        assert "node full" in body["reason"], body

        vanishing, holders = clients[0], clients[1:]
        vanishing.abort()
        await asyncio.wait_for(vanishing.closed.wait(), 10)
        await wait_until(lambda: server.backend.status().free_slots == 1, what="the aborted session's slot")
        status, body = await readyz_settled(server, 200)
        assert status == 200, body
        assert body["ready"] is True

        newcomer = await stack.enter_async_context(live(chat_url(server), speech[0]))
        assert newcomer.result.handshake, newcomer.result.errors
        newcomer.start_streaming()
        mark = time.monotonic()
        status, body = await readyz_settled(server, 503)
        assert status == 503 and "node full" in body["reason"], body

        await asyncio.sleep(1.5)
        for c in [*holders, newcomer]:
            await c.finish()
        for i, c in enumerate(holders):
            assert_healthy(c, after=mark, label=f"holder {i}")
        assert_healthy(newcomer, label="newcomer")

    status, body = await readyz_settled(server, 200)
    assert status == 200 and body["ready"] is True, body


# --------------------------------------------------------------------------------------------------
# 4. Drain
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_drain_refuses_new_sessions_and_closes_the_rest_with_1001(bundle, speech):
    async with running_server(bundle) as srv, contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(live(chat_url(srv), pcm)) for pcm in speech[:2]]
        for c in clients:
            assert c.result.handshake
            c.start_streaming()
        await asyncio.sleep(0.5)

        started = time.monotonic()
        drain = asyncio.create_task(srv.drain(grace_s=1.0))
        await asyncio.sleep(0)  # let the drain begin
        assert srv.draining
        (status, body), refused = await asyncio.gather(readyz(srv), knock(chat_url(srv), speech[0]))
        assert status == 503, body
        assert body == {"ready": False, "reason": "draining"}
        assert_refused(refused, 1013, "draining")

        await asyncio.wait_for(drain, 30)
        for i, c in enumerate(clients):
            r = await c.wait_closed()
            assert r.handshake and r.errors == [], (i, r.errors)
            assert r.close_code == 1001, (i, r.close_code, r.close_reason)
            assert r.audio_messages > 0
            # They kept streaming through the grace period.
            assert sum(t > started for t in r.audio_arrival_s) >= 5, i

        metrics = local_metrics(srv)
        assert metrics.value("duplex_sessions_ended_total", reason="drained") == 2
        assert metrics.value("duplex_admissions_refused_total", reason="draining") == 1
        assert metrics.value("duplex_draining") == 1
        assert metrics.value("duplex_ready") == 0
        assert not srv.sessions


@pytest.mark.slow
async def test_the_pyav_opus_encoder_serves_a_stream_sphn_decodes_frame_for_frame(bundle, speech):
    """DUPLEX_OPUS_ENCODER=pyav at complexity 5: the session runs normally and every outbound audio message
    decodes, with sphn's reader as Kyutai's client uses it, to exactly one 80 ms frame."""
    async with (
        running_server(bundle, opus_encoder="pyav", opus_complexity=5) as srv,
        live(
            chat_url(srv, audio_format=AudioFormat.OPUS), speech[2], audio_format=AudioFormat.OPUS
        ) as client,
    ):
        assert client.result.handshake
        client.start_streaming()
        await asyncio.sleep(2.0)
        result = await client.finish()
    assert_healthy(client)
    reader = sphn.OpusStreamReader(SAMPLE_RATE_HZ)
    sizes = [np.asarray(reader.append_bytes(payload)).size for payload in client.audio_payloads]
    assert len(sizes) == result.audio_messages and sizes == [FRAME_SAMPLES] * len(sizes)


async def test_drain_lets_a_session_finish_within_the_grace(bundle, speech):
    async with running_server(bundle) as srv, live(chat_url(srv), speech[0]) as client:
        assert client.result.handshake
        client.start_streaming()
        await asyncio.sleep(0.5)
        started = time.monotonic()
        drain = asyncio.create_task(srv.drain(grace_s=10.0))
        await asyncio.sleep(0.5)
        result = await client.finish()
        await asyncio.wait_for(drain, 30)
        # The drain ended when the last session did, not at the end of its grace period.
        assert time.monotonic() - started < 9.0
        assert_healthy(client)
        assert result.close_code == 1000
        metrics = local_metrics(srv)
        assert metrics.value("duplex_sessions_ended_total", reason="client_closed") == 1
        assert metrics.value("duplex_sessions_ended_total", reason="drained") == 0


def _serve_command(port: int) -> list[str]:
    """``duplex serve`` from this interpreter's environment (the console script, or its entry point)."""
    args = ["serve", "--port", str(port), "--max-sessions", "2", "--log-level", "INFO"]
    script = Path(sys.executable).with_name("duplex")
    if script.exists():
        return [str(script), *args]
    return [sys.executable, "-c", "from runtime.tools.cli import app; app()", *args]


@pytest.mark.slow
async def test_sigterm_drains_a_real_process(speech, tmp_path):
    port = free_loopback_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
    env.update(DUPLEX_DRAIN_GRACE_S="1", DUPLEX_NODE_ID="sigterm-node", DUPLEX_AUTH_MODE="off")
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(_serve_command(port), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                status, _, body = await http_get(port, "/readyz")  # /healthz says "loading" before
                if status == 200:
                    assert json.loads(body)["ready"] is True
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            await asyncio.sleep(0.25)

        async with live(f"ws://127.0.0.1:{port}/api/chat?format=pcm", speech[1]) as client:
            assert client.result.handshake, client.result.errors
            client.start_streaming()
            await asyncio.sleep(0.8)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            result = await client.wait_closed(timeout_s=30)
            closed_after = time.monotonic() - signalled

        assert result.close_code == 1001, (result.close_code, result.close_reason)
        assert result.errors == []
        assert closed_after >= 0.9, f"closed {closed_after:.2f} s after SIGTERM, before the 1 s grace"
        assert sum(t > signalled for t in result.audio_arrival_s) >= 5  # audio went on during the grace
        returncode = await asyncio.to_thread(proc.wait, 60)
        assert returncode == 0, log_path.read_text()
        log_text = log_path.read_text()
        assert "draining" in log_text, log_text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------------------------------
# 5. Redis outage mid-session
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_redis_outage_does_not_stop_audio_and_transcript_catches_up(bundle, speech, redis_server):
    pcm = np.concatenate([speech[0], speech[1]])  # about 6.8 s
    async with running_server(bundle, redis_url=redis_server.url) as srv:
        assert srv.store is not None

        async def outage() -> None:
            await asyncio.sleep(1.5)
            await asyncio.to_thread(redis_server.stop)
            await asyncio.sleep(1.5)
            await asyncio.to_thread(redis_server.start)

        result, _ = await asyncio.gather(run_session(chat_url(srv), pcm), outage())

        assert result.handshake and result.errors == [], result.errors
        assert result.close_code == 1000
        assert result.audio_messages > 0
        # The criterion: the client's audio never stopped while Redis was away.
        assert result.max_audio_gap_s() < MAX_GAP_S, result.max_audio_gap_s()
        assert result.text

        await wait_until(
            lambda: not srv.sessions and srv.store.backlog == 0 and srv.store.connected,
            timeout_s=30,
            what="the store to reconnect and flush",
        )
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        try:
            keys = [key async for key in client.scan_iter(match="duplex:session:*")]
        finally:
            await client.aclose()
        assert len(keys) == 1, keys
        session_id = keys[0].removeprefix("duplex:session:")
        record = await srv.store.get_session(session_id)
        assert record is not None and record["state"] == "ended", record
        assert await srv.store.get_transcript(session_id) == result.text

        metrics = await scrape(srv)
        assert metrics.total("duplex_redis_errors_total") > 0
        assert metrics.value("duplex_redis_backlog_ops") == 0


# --------------------------------------------------------------------------------------------------
# 6. Bad input over the wire, with a healthy neighbour each time
# --------------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def neighbour(server: DuplexServer, pcm: np.ndarray) -> AsyncIterator[LiveClient]:
    """A healthy session streaming alongside the test's bad one; the test calls ``finish`` on it."""
    async with live(chat_url(server), pcm) as client:
        assert client.result.handshake
        client.start_streaming()
        await asyncio.sleep(0.5)
        yield client


async def protocol_errors(server: DuplexServer, reason: str) -> float:
    return (await scrape(server)).value("duplex_protocol_errors_total", reason=reason)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"", "empty_message"),
        (b"\x09abc", "unknown_kind"),
        (b"\x02hi", "server_only_kind"),
        (b"\x03", "bad_control"),
        (b"\x04{not json", "bad_metadata"),
        (b"\x01\x00\x01\x02", "bad_pcm"),
        ("hello", "text_frame"),
    ],
    ids=["empty", "unknown-kind", "server-only-kind", "truncated-control", "bad-metadata", "odd-pcm", "str"],
)
async def test_malformed_message_gets_an_error_and_the_session_goes_on(server, speech, raw, reason):
    errors_before = await protocol_errors(server, reason)
    async with neighbour(server, speech[0]) as healthy, live(chat_url(server), speech[1]) as bad:
        assert bad.result.handshake
        bad.start_streaming()
        await asyncio.sleep(0.3)
        mark = time.monotonic()
        await bad.send(raw)
        error = await bad.wait_error()
        assert error.startswith(f"{reason}:"), error
        await asyncio.sleep(1.0)
        await bad.finish()
        await healthy.finish()

    # The offender's session survived its bad message: audio went on and it closed normally.
    r = bad.result
    assert r.errors == [error]
    assert r.close_code == 1000, (r.close_code, r.close_reason)
    assert sum(t > mark for t in r.audio_arrival_s) >= 5
    assert_healthy(healthy, after=mark, label="neighbour")
    assert await protocol_errors(server, reason) == errors_before + 1


@pytest.mark.slow
async def test_oversized_message_closes_only_that_session_with_1009(server, speech):
    limit = server.config.max_message_bytes
    async with neighbour(server, speech[0]) as healthy, live(chat_url(server), speech[1]) as bad:
        assert bad.result.handshake
        mark = time.monotonic()
        await bad.send(b"\x01" + bytes(limit + 2))
        r = await bad.wait_closed()
        assert r.close_code == 1009, (r.close_code, r.close_reason)
        await wait_until(lambda: len(server.sessions) == 1, what="the oversized session to end")
        await asyncio.sleep(1.0)
        await healthy.finish()
    assert_healthy(healthy, after=mark, label="neighbour")


@pytest.mark.slow
async def test_garbage_in_opus_stream_is_an_error_then_1008(node, speech):
    server = node  # both modes (WORKER_MODES)
    ended_before = (await scrape(server)).value("duplex_sessions_ended_total", reason="protocol_bad_opus")
    async with (
        neighbour(server, speech[0]) as healthy,
        live(
            chat_url(server, audio_format=AudioFormat.OPUS), speech[1], audio_format=AudioFormat.OPUS
        ) as bad,
    ):
        assert bad.result.handshake
        bad.start_streaming()
        await asyncio.sleep(1.0)  # a valid Opus stream first: the session works
        await bad.stop_streaming()
        assert bad.result.audio_messages > 0
        mark = time.monotonic()
        await bad.send(b"\x01" + b"this is not an Ogg page at all " * 8)
        r = await bad.wait_closed()
        assert r.close_code == 1008, (r.close_code, r.close_reason)
        assert len(r.errors) == 1 and r.errors[0].startswith("bad_opus:"), r.errors
        await asyncio.sleep(1.0)
        await healthy.finish()
    assert_healthy(healthy, after=mark, label="neighbour")
    metrics = await scrape(server)
    assert metrics.value("duplex_sessions_ended_total", reason="protocol_bad_opus") == ended_before + 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("params", "needles"),
    [
        ({"audio_temperature": 9}, ("bad request", "audio_temperature", "9")),
        ({"voice_prompt": "nobody-here"}, ("bad request", "voice_prompt", "nobody-here")),
        ({"voice_prompt": "../etc/passwd"}, ("bad request", "voice_prompt")),
    ],
    ids=["audio-temperature", "unknown-voice", "voice-path"],
)
async def test_bad_query_is_refused_with_1008(node, speech, params, needles):
    server = node  # both modes (WORKER_MODES)
    refused_before = (await scrape(server)).value("duplex_admissions_refused_total", reason="bad_request")
    async with neighbour(server, speech[0]) as healthy:
        mark = time.monotonic()
        result = await knock(chat_url(server, **params), speech[1])
        assert_refused(result, 1008, *needles)
        await asyncio.sleep(1.0)
        await healthy.finish()
    assert_healthy(healthy, after=mark, label="neighbour")
    refused = (await scrape(server)).value("duplex_admissions_refused_total", reason="bad_request")
    assert refused == refused_before + 1


@pytest.mark.slow
async def test_client_faster_than_real_time_loses_frames_not_the_session(server, speech):
    dropped_before = (await scrape(server)).value("duplex_frames_dropped_total", reason="input_overflow")
    async with neighbour(server, speech[0]) as healthy, live(chat_url(server), speech[1]) as fast:
        assert fast.result.handshake
        mark = time.monotonic()
        fast.start_streaming(burst_frames=60)  # 4.8 s of audio at once, then real time
        await asyncio.sleep(2.0)
        await fast.finish()
        await healthy.finish()
    dropped = (await scrape(server)).value("duplex_frames_dropped_total", reason="input_overflow")
    # 60 frames against an inbox of 8: most of the burst is dropped.
    assert dropped - dropped_before >= 30, dropped - dropped_before
    r = fast.result
    assert r.errors == [] and r.close_code == 1000, (r.errors, r.close_code)
    # The session went on in real time after the burst.
    assert sum(t > mark + 1.0 for t in r.audio_arrival_s) >= 8
    assert_healthy(healthy, after=mark, label="neighbour")


@pytest.mark.slow
async def test_one_message_of_too_many_frames_is_refused_and_the_session_goes_on(server, speech):
    dropped_before = (await scrape(server)).value("duplex_frames_dropped_total", reason="input_overflow")
    frames = server.config.max_inbox_frames + 2
    async with neighbour(server, speech[0]) as healthy, live(chat_url(server), speech[1]) as bad:
        bad.start_streaming()
        await asyncio.sleep(0.3)
        mark = time.monotonic()
        await bad.send(b"\x01" + bytes(FRAME_SAMPLES * 2 * frames))
        error = await bad.wait_error()
        assert error.startswith("too_fast:"), error
        await asyncio.sleep(1.0)
        await bad.finish()
        await healthy.finish()
    assert bad.result.close_code == 1000
    assert sum(t > mark for t in bad.result.audio_arrival_s) >= 5
    assert_healthy(healthy, after=mark, label="neighbour")
    dropped = (await scrape(server)).value("duplex_frames_dropped_total", reason="input_overflow")
    assert dropped > dropped_before


@pytest.mark.slow
async def test_client_that_never_reads_does_not_hold_up_others(server, speech):
    async with neighbour(server, speech[0]) as healthy:
        # max_queue=1: once a message waits unread, the client stops reading its socket at all.
        ws = await connect(chat_url(server), compression=None, max_queue=1, open_timeout=30, proxy=None)
        try:
            assert await asyncio.wait_for(ws.recv(), 30) == b"\x00"
            _, encoder = make_codec(AudioFormat.PCM, 1000)
            frames = [speech[1][i : i + FRAME_SAMPLES] for i in range(0, 30 * FRAME_SAMPLES, FRAME_SAMPLES)]
            mark = time.monotonic()
            next_send = mark
            for i in range(38):  # about 3 s of audio, never reading a byte back
                await ws.send(encode_audio(encoder.encode(frames[i % len(frames)])))
                next_send += FRAME_S
                await asyncio.sleep(max(0.0, next_send - time.monotonic()))
        finally:
            ws.transport.abort()
        await wait_until(lambda: len(server.sessions) == 1, what="the non-reading session to end")
        await asyncio.sleep(0.5)
        await healthy.finish()
    assert_healthy(healthy, after=mark, label="neighbour")


# --------------------------------------------------------------------------------------------------
# 7. HTTP endpoints
# --------------------------------------------------------------------------------------------------


async def test_http_endpoints(server):
    status, content_type, body = await http_get(server.port, "/healthz")
    assert (status, body) == (200, "ok\n")
    assert content_type.startswith("text/plain")

    status, body_json = await readyz(server)
    assert status == 200
    assert body_json["ready"] is True
    assert body_json["reason"] == "5 of 5 slots free"

    status, content_type, body = await http_get(server.port, "/metrics")
    assert status == 200
    media_type, *params = [part.strip() for part in content_type.split(";")]
    assert media_type == "text/plain", content_type
    # The Prometheus text format: 0.0.4, or 1.0.0 (the same text) from prometheus_client >= 0.22.
    assert any(p in ("version=0.0.4", "version=1.0.0") for p in params), content_type
    assert re.search(r"^duplex_slots_total 5(\.0)?$", body, re.MULTILINE), body[:500]
    metrics = Metrics(body)
    assert metrics.value("duplex_ready") == 1
    assert metrics.value("duplex_draining") == 0
    assert metrics.value("duplex_active_sessions") == 0

    status, _, body = await http_get(server.port, "/no/such/path")
    assert status == 404
    assert "/api/chat" in body
