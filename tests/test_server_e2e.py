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

Timing: sessions stream at real-time pace (80 ms frames), but no assertion depends on how fast this machine
runs (issue 25, item 2). A test waits for events (``LiveClient.wait_audio``: so many audio messages after a
disturbance), never a fixed time, and the waits' timeouts only stop a hung test. Each in-process server
keeps a :class:`FrameLedger` on its slots, so a session's frames are accounted for exactly
(:func:`assert_healthy`): every frame sent reached its slot, every frame the slot kept was answered by one
audio frame, every audio frame reached the client, and a frame the node dropped (a machine too slow to keep
real time drops input, by design) was counted in ``duplex_frames_dropped_total``. Whether the node keeps
real time is a benchmark's question (docs/benchmarks.md), not this suite's. Counts allow for the acoustic
delay of a frame or two.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import itertools
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

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
from runtime.frontend.codecs.kyutai_audio import make_codec
from runtime.frontend.codecs.protocol import AudioFormat, MessageKind, encode_audio
from runtime.frontend.gate.tokens import SUBPROTOCOL_PREFIX
from runtime.frontend.server import DuplexServer
from runtime.frontend.store.redis_store import SessionStore
from runtime.metrics import RuntimeMetrics
from runtime.tools.loadgen import SessionResult, run_session, session_url, synthesize_speech
from runtime.tools.local_redis import free_loopback_port

pytestmark = pytest.mark.asyncio(loop_scope="module")

SLOTS = 5
FRAME_S = FRAME_SAMPLES / SAMPLE_RATE_HZ
FRAME_ALLOWANCE = 3
"""Audio messages a session may receive fewer than the frames it sent (acoustic delay, first frame)."""
AFTER_FRAMES = 5
"""Audio messages a session must receive after a disturbance to show that its audio went on."""
WAIT_S = 30.0
"""Timeout of an event wait: only stops a hung test, never a bound on how fast the machine is."""
OUTPUT_DROPS = ("slow_client", "slow_worker")
"""``duplex_frames_dropped_total`` reasons of audio frames produced and not sent (output side)."""
DROP_REASONS = ("input_overflow", *OUTPUT_DROPS)
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


@dataclass(eq=False)
class SlotAccount:
    """One session's audio as its slot saw it (:class:`FrameLedger`): frames pushed to the slot, frames the
    slot dropped at push (its inbox was full), audio frames the tick produced for it."""

    slot_session: Any  # runtime.engine.scheduler.SlotSession: its inbox says what is still to be taken
    pushed: int = 0
    dropped: int = 0
    produced: int = 0
    audio: list[bytes] = field(default_factory=list)
    """A digest of each audio frame produced, in order, as a PCM session receives it (:func:`pcm_digest`)."""


_PCM_ENCODER = make_codec(AudioFormat.PCM, 1)[1]


def pcm_digest(payload: bytes) -> bytes:
    """What identifies one PCM audio message (the frame's 3840 bytes) in a session's stream."""
    return hashlib.blake2b(payload, digest_size=16).digest()


def match_stream(produced: list[bytes], received: list[bytes]) -> tuple[int, int] | None:
    """``received`` matched, in order, against ``produced``: (how many produced frames the match spans,
    how many of those never arrived), or None when ``received`` is not ``produced`` in order with some
    frames left out (a frame out of order, twice, or not from this slot)."""
    at = skipped = 0
    for digest in received:
        while at < len(produced) and produced[at] != digest:
            at += 1
            skipped += 1
        if at == len(produced):
            return None
        at += 1
    return at, skipped


class FrameLedger:
    """Per session, what the engine's slots did with its audio, counted where it happens.

    Installed on the node's :class:`LocalSlots` (the server's ``backend`` in both modes: the slots of
    ``--workers 0`` and those of the engine of ``--workers N``), it wraps ``push_frame`` (a frame taken or
    dropped) and, at a session's first frame, its slot session's ``on_output`` (an audio frame produced by a
    tick). Nothing else changes. :func:`assert_healthy` reads it to account for every frame of a session
    exactly, however fast or slow the machine runs the ticks.
    """

    def __init__(self, slots: LocalSlots) -> None:
        self.sessions: dict[str, SlotAccount] = {}
        push = slots.push_frame

        def push_counted(lease: Any, frame: np.ndarray) -> bool:
            account = self.sessions.get(lease.session_id)
            if account is None:  # before the first push: the tick cannot produce audio for it yet
                account = self.sessions[lease.session_id] = self._open(lease.slot_session)
            kept = push(lease, frame)
            account.pushed += 1
            account.dropped += not kept
            return kept

        slots.push_frame = push_counted  # type: ignore[method-assign]

    @staticmethod
    def _open(slot_session: Any) -> SlotAccount:
        account = SlotAccount(slot_session)
        deliver = slot_session.on_output

        def output_counted(pcm: np.ndarray | None, piece: str | None) -> None:  # on the event loop
            if pcm is not None:
                account.produced += 1
                account.audio.append(pcm_digest(_PCM_ENCODER.encode(pcm)))
            deliver(pcm, piece)

        slot_session.on_output = output_counted
        return account


_IN_PROCESS: dict[int, tuple[DuplexServer, FrameLedger]] = {}
"""The servers :func:`running_server` started in this process, by port, with their ledgers: a
:class:`LiveClient` to one of them finds its session's account."""


@contextlib.asynccontextmanager
async def running_server(bundle: ModelBundle, **kwargs: object) -> AsyncIterator[DuplexServer]:
    """A started server with its :class:`FrameLedger`, closed on exit (closing twice, e.g. after a drain, is
    harmless)."""
    server = make_server(bundle, **kwargs)
    await server.start()
    port = server.port
    _IN_PROCESS[port] = (server, FrameLedger(server.backend))  # type: ignore[arg-type]
    try:
        yield server
    finally:
        _IN_PROCESS.pop(port, None)
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
        timeout_s=WAIT_S,
        what="the shared node to be idle after the test (a session was left behind)",
    )


@pytest_asyncio.fixture(loop_scope="module")
async def server(shared_server: DuplexServer) -> AsyncIterator[DuplexServer]:
    """The shared server; after the test every session must have ended and every slot be free."""
    yield shared_server
    await wait_until(
        lambda: not shared_server.sessions and shared_server.backend.status().free_slots == SLOTS,
        timeout_s=WAIT_S,
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


async def readyz(server: DuplexServer, path: str = "/readyz") -> tuple[int, dict]:
    """``/readyz`` (or ``/slotz``): its status and JSON body."""
    status, content_type, body = await http_get(server.port, path)
    assert content_type.startswith("application/json"), content_type
    return status, json.loads(body)


async def readyz_settled(
    server: DuplexServer, expected: int, timeout_s: float = WAIT_S, path: str = "/readyz"
) -> tuple[int, dict]:
    """``/readyz`` (or ``/slotz``) once it answers ``expected`` (or the last answer after ``timeout_s``):
    with ``--workers N`` a worker answers from the engine's last status, sent every 100 ms
    (``STATUS_PERIOD_S``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = await readyz(server, path)
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
    raw messages at any moment, aborted, and it records when each frame was sent. It waits for events
    (:meth:`wait_audio`), and :meth:`finish` ends the session once every frame it sent has been answered.

    To a server of this process (:func:`running_server`) it finds its session's :class:`SlotAccount` and the
    node's drop counters, for :func:`assert_healthy`'s exact accounting. ``frames``: stop after that many
    frames (None: loop the speech until :meth:`stop_streaming`). ``ssl_context`` and ``token`` (presented as a
    subprotocol) reach a node through its TLS edge; ``headers`` go on the upgrade request, ``subprotocols``
    are offered (before the token's).
    """

    def __init__(
        self,
        url: str,
        pcm: np.ndarray,
        *,
        audio_format: AudioFormat = AudioFormat.PCM,
        frames: int | None = None,
        ssl_context: ssl.SSLContext | None = None,
        token: str | None = None,
        headers: dict[str, str] | None = None,
        subprotocols: list[str] | None = None,
    ) -> None:
        self.url = url
        self.headers = headers
        self.offered = subprotocols or []
        self.audio_format = audio_format
        self.frames = [
            pcm[i : i + FRAME_SAMPLES] for i in range(0, len(pcm) - FRAME_SAMPLES + 1, FRAME_SAMPLES)
        ]
        self.frame_limit = frames
        self.ssl_context = ssl_context
        self.token = token
        _, self.encoder = make_codec(audio_format, max_buffered_frames=1000)
        self.result = SessionResult()
        self.sent_at: list[float] = []
        self.audio_payloads: list[bytes] = []  # the 0x01 payloads received, in order
        self.audio_digests: list[bytes] = []  # PCM: their pcm_digest, to match against the slot's
        self.metadata: list[dict[str, Any]] = []  # the 0x04 metadata objects received (resume: issue 23)
        self.ws: ClientConnection | None = None
        self.settled = asyncio.Event()  # handshake received, or the connection ended without one
        self.closed = asyncio.Event()
        self._receiver: asyncio.Task[None] | None = None
        self._sender: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._frame_index = 0
        # With a server of this process: its session's account, the node's drop counters at the start.
        self.server: DuplexServer | None = None
        self.session_id: str | None = None
        self._ledger: FrameLedger | None = None
        self._drops_before: dict[str, float] = {}
        self.flushed_at: int | None = None
        """Audio frames its slot had produced when :meth:`finish` found every frame sent answered."""

    async def open(self, timeout_s: float = 30.0) -> LiveClient:
        node = _IN_PROCESS.get(urlsplit(self.url).port or 0)
        before: set[str] = set()
        if node is not None:
            self.server, self._ledger = node
            before = {s.session_id for s in self.server.sessions}
            self._drops_before = self._drops()
        subprotocols = self.offered + ([] if self.token is None else [SUBPROTOCOL_PREFIX + self.token])
        self.ws = await connect(
            self.url,
            max_size=2**20,
            compression=None,
            open_timeout=30,
            proxy=None,
            ssl=self.ssl_context,
            subprotocols=subprotocols or None,  # type: ignore[arg-type]
            additional_headers=self.headers,
        )
        self._receiver = asyncio.create_task(self._receive())
        await asyncio.wait_for(self.settled.wait(), timeout_s)
        if self.server is not None and self.result.handshake:
            new = [s.session_id for s in self.server.sessions if s.session_id not in before]
            if len(new) == 1:  # this client's session (tests open their clients one at a time)
                self.session_id = new[0]
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
                    now = time.monotonic()
                    result.audio_messages += 1
                    result.audio_arrival_s.append(now)
                    if self.audio_format is AudioFormat.PCM:
                        result.audio_samples += len(payload) // 2
                    if result.first_audio_ms is None and self.sent_at:
                        result.first_audio_ms = (now - self.sent_at[0]) * 1e3
                    self.audio_payloads.append(payload)
                    if self.audio_format is AudioFormat.PCM:
                        self.audio_digests.append(pcm_digest(payload))
                elif kind == MessageKind.TEXT:
                    result.text += payload.decode("utf-8")
                elif kind == MessageKind.ERROR:
                    result.errors.append(payload.decode("utf-8"))
                elif kind == MessageKind.METADATA:
                    self.metadata.append(json.loads(payload))
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

    def _more(self) -> bool:
        return self.frame_limit is None or self.result.frames_sent < self.frame_limit

    async def _stream(self, burst_frames: int) -> None:
        try:
            for _ in range(burst_frames):
                await self.send_frame()
            next_send = time.monotonic()
            while not self._stop.is_set() and self._more():
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

    async def streamed(self, timeout_s: float = WAIT_S) -> None:
        """Until the ``frames`` it was made with are all sent."""
        assert self._sender is not None
        await asyncio.wait_for(asyncio.shield(self._sender), timeout_s)

    async def send(self, message: bytes | str) -> None:
        assert self.ws is not None
        await self.ws.send(message)

    def mark(self) -> float:
        """A point in this client's stream (``time.monotonic()``): :meth:`wait_audio` and
        :func:`assert_healthy` count the audio messages that arrive after it."""
        return time.monotonic()

    def audio_after(self, mark: float) -> int:
        return sum(t > mark for t in self.result.audio_arrival_s)

    async def wait_audio(
        self, count: int = AFTER_FRAMES, *, after: float | None = None, timeout_s: float = WAIT_S
    ) -> None:
        """Until ``count`` audio messages have arrived after ``after`` (a :meth:`mark`; None: since the
        start). The connection closing first fails the wait; the timeout only stops a hung test."""

        def arrived() -> int:
            return self.result.audio_messages if after is None else self.audio_after(after)

        await wait_until(
            lambda: arrived() >= count or self.closed.is_set(),
            timeout_s=timeout_s,
            what=f"{count} audio messages",
        )
        r = self.result
        assert arrived() >= count, (
            f"closed ({r.close_code} {r.close_reason!r}, errors {r.errors}) after {arrived()} of {count} "
            "audio messages"
        )

    async def wait_error(self, timeout_s: float = WAIT_S) -> str:
        await wait_until(lambda: bool(self.result.errors), timeout_s=timeout_s, what="a 0x05 error")
        return self.result.errors[0]

    async def wait_closed(self, timeout_s: float = WAIT_S) -> SessionResult:
        await asyncio.wait_for(self.closed.wait(), timeout_s)
        await self.stop_streaming()
        return self.result

    @property
    def account(self) -> SlotAccount | None:
        """Its session's account in the server's :class:`FrameLedger` (None: not a server of this process,
        or no frame pushed yet)."""
        if self._ledger is None or self.session_id is None:
            return None
        return self._ledger.sessions.get(self.session_id)

    def _drops(self) -> dict[str, float]:
        assert self.server is not None
        metrics = Metrics(self.server.metrics.render().decode())
        return {r: metrics.value("duplex_frames_dropped_total", reason=r) for r in DROP_REASONS}

    def drops_since_open(self, *reasons: str) -> float:
        """Frames the node counted as dropped, for these reasons, since this client opened (every session's:
        at least this one's)."""
        now = self._drops()
        return sum(now[r] - self._drops_before.get(r, 0.0) for r in reasons)

    async def finish(self, tail_s: float | None = None) -> SessionResult:
        """Stop streaming and close normally; what the session saw.

        ``tail_s`` None: close once every frame sent has been answered (:meth:`_flush`), with a server of
        this process; elsewhere, or before any frame reached the slot, listen 0.6 s more. A number: listen
        that long, whatever came back (a test that only needs the session gone).
        """
        await self.stop_streaming()
        if not self.closed.is_set():
            account = self.account
            if tail_s is None and account is not None:
                await self._flush(account)
            else:
                await asyncio.sleep(0.6 if tail_s is None else tail_s)
            assert self.ws is not None
            await self.ws.close()
        return await self.wait_closed()

    async def _flush(self, account: SlotAccount) -> None:
        """Every frame sent reaches its slot (PCM: one frame per message); the slot takes all of them; the
        tick produces the audio of the last ones (``FRAME_ALLOWANCE`` more: the acoustic delay); and the
        stream arrives up to that audio frame (PCM: matched frame by frame; Opus: counted, less the output
        frames the node counted as dropped). Each step is an event; a session closed meanwhile, or a stream
        that does not match, ends the flush (the close code or :func:`assert_healthy` tells why)."""
        r = self.result

        async def until(predicate: Callable[[], bool], what: str) -> bool:
            await wait_until(lambda: predicate() or self.closed.is_set(), timeout_s=WAIT_S, what=what)
            return not self.closed.is_set()

        if self.audio_format is AudioFormat.PCM and not await until(
            lambda: account.pushed >= r.frames_sent, "every frame sent to reach its slot"
        ):
            return
        if not await until(lambda: not account.slot_session.inbox, "the slot to take every frame"):
            return
        target = account.produced + FRAME_ALLOWANCE + 1
        if not await until(lambda: account.produced >= target, "the audio of the last frames taken"):
            return

        def arrived() -> bool:
            if self.audio_format is AudioFormat.PCM:
                match = match_stream(account.audio, self.audio_digests)
                return match is None or match[0] >= target
            # Opus: pages, not frames; a page may wait for the next frame.
            return r.audio_messages + self.drops_since_open(*OUTPUT_DROPS) >= target - FRAME_ALLOWANCE

        if await until(arrived, "that audio to reach the client"):
            self.flushed_at = target

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
async def live(url: str, pcm: np.ndarray, **kwargs: Any) -> AsyncIterator[LiveClient]:
    """An open :class:`LiveClient` (handshake received or refused), discarded on exit."""
    client = LiveClient(url, pcm, **kwargs)
    try:
        await client.open()
        yield client
    finally:
        await client.discard()


def assert_healthy(client: LiveClient, *, after: float | None = None, label: str = "session") -> None:
    """The session ran normally to its end: handshake, no error, text, a normal close; and, from ``after``
    on (a :meth:`LiveClient.mark` taken once the disturbance had happened), at least ``AFTER_FRAMES`` audio
    messages (the test waited for them: :meth:`LiveClient.wait_audio`).

    With a server of this process, closed by :meth:`LiveClient.finish`, its frames are accounted for exactly
    by the server's :class:`FrameLedger`, whatever the speed of the machine: every frame sent reached the
    slot; every frame the slot dropped (its inbox full: the ticks fell behind real time) was counted in
    ``duplex_frames_dropped_total``; every frame the slot kept was answered by one audio frame (less the
    acoustic delay); and the client received the audio frames its slot produced, in order, none twice, a
    frame missing only where the node counted an output frame dropped (PCM: matched frame by frame; Opus:
    counted). On a machine that keeps real time nothing is dropped: audio for every frame sent.
    """
    r = client.result
    assert r.handshake, f"{label}: no handshake ({r.errors}, close {r.close_code})"
    assert r.errors == [], f"{label}: errors {r.errors}"
    assert r.close_code == 1000, f"{label}: close {r.close_code} {r.close_reason!r}"
    assert r.frames_sent >= AFTER_FRAMES, f"{label}: only {r.frames_sent} frames sent"
    assert r.audio_messages > 0, f"{label}: no audio"
    assert r.text, f"{label}: no text"
    if client.server is not None:
        account = client.account
        assert account is not None and client.flushed_at is not None, (
            f"{label}: its frames are not accounted for (clients opened one at a time? closed with finish(), "
            f"no tail_s, and not cut by the server meanwhile? close {r.close_code})"
        )
        if client.audio_format is AudioFormat.PCM:
            assert account.pushed == r.frames_sent, f"{label}: {account.pushed} of {r.frames_sent} frames"
        input_drops = client.drops_since_open("input_overflow")
        assert account.dropped <= input_drops, (
            f"{label}: the slot dropped {account.dropped} frames, {input_drops:g} counted"
        )
        kept = account.pushed - account.dropped
        assert client.flushed_at >= kept - FRAME_ALLOWANCE, (
            f"{label}: {client.flushed_at} audio frames for {kept} frames taken "
            f"({account.dropped} of {account.pushed} dropped)"
        )
        output_drops = client.drops_since_open(*OUTPUT_DROPS)
        if client.audio_format is AudioFormat.PCM:
            match = match_stream(account.audio, client.audio_digests)
            assert match is not None, f"{label}: audio out of order, repeated, or not from its slot"
            spanned, missing = match
            assert spanned >= client.flushed_at, (spanned, client.flushed_at)
            assert missing <= output_drops, (
                f"{label}: {missing} of the first {spanned} audio frames never arrived, {output_drops:g} "
                "output frames counted as dropped"
            )
        else:  # Opus: pages, not frames
            assert r.audio_messages + output_drops >= client.flushed_at - FRAME_ALLOWANCE, (
                f"{label}: {r.audio_messages} audio messages of {client.flushed_at} produced "
                f"({output_drops:g} output frames dropped)"
            )
    if after is not None:
        received = client.audio_after(after)
        assert received >= AFTER_FRAMES, f"{label}: {received} audio messages after the disturbance"


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
    return await run_session(url, pcm[: FRAME_SAMPLES * 3], tail_s=0.1, handshake_timeout_s=WAIT_S)


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
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(live(chat_url(srv), pcm, frames=len(pcm) // FRAME_SAMPLES))
                for pcm in speech
            ]
            for c in clients:  # each sends its sentence once, all at the same time
                assert c.result.handshake, (c.result.errors, c.result.close_code)
                c.start_streaming()
            for c in clients:
                await c.streamed()
            await asyncio.gather(*(c.finish() for c in clients))  # once every frame is answered
        results = [c.result for c in clients]

        for i, (c, pcm) in enumerate(zip(clients, speech, strict=True)):
            r = c.result
            frames = len(pcm) // FRAME_SAMPLES
            assert r.frames_sent == frames, (i, r.frames_sent, frames)
            assert_healthy(c, label=f"session {i}")  # audio for every frame, or the node counted the drop
            assert r.audio_samples == r.audio_messages * FRAME_SAMPLES  # PCM: one whole frame per message
            assert r.text.strip(), i
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
        for c in clients:
            await c.wait_audio()  # all five stream

        extra = await knock(chat_url(server), speech[0])
        mark = time.monotonic()
        message = assert_refused(extra, 1013, "node full")
        assert re.search(r"\b5\b", message), message

        for c in clients:
            await c.wait_audio(after=mark)  # the refusal did not stop anyone's audio
        await asyncio.gather(*(c.finish() for c in clients))
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
        for c in clients:
            await c.wait_audio(1)

        # Full: still ready (serving; issue 33), and /slotz says no slot is free.
        status, body = await readyz(server)
        assert status == 200 and body["ready"] is True, body
        status, body = await readyz_settled(server, 503, path="/slotz")
        assert status == 503 and body["free_slots"] == 0, body

        vanishing, holders = clients[0], clients[1:]
        vanishing.abort()
        await asyncio.wait_for(vanishing.closed.wait(), 10)
        await wait_until(lambda: server.backend.status().free_slots == 1, what="the aborted session's slot")
        status, body = await readyz_settled(server, 200, path="/slotz")
        assert status == 200 and body["free_slots"] == 1, body

        newcomer = await stack.enter_async_context(live(chat_url(server), speech[0]))
        assert newcomer.result.handshake, newcomer.result.errors
        newcomer.start_streaming()
        mark = time.monotonic()
        status, body = await readyz_settled(server, 503, path="/slotz")
        assert status == 503 and body["free_slots"] == 0, body
        assert (await readyz(server))[0] == 200

        for c in [*holders, newcomer]:
            await c.wait_audio(after=mark)
        await asyncio.gather(*(c.finish() for c in [*holders, newcomer]))
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
        for c in clients:
            await c.wait_audio(1)

        # A grace this test ends itself, once it has seen what happens during it.
        drain = asyncio.create_task(srv.drain(grace_s=3600.0))
        await asyncio.sleep(0)  # let the drain begin
        assert srv.draining
        started = time.monotonic()
        (status, body), refused = await asyncio.gather(readyz(srv), knock(chat_url(srv), speech[0]))
        assert status == 503, body
        assert body == {"ready": False, "reason": "draining"}
        assert_refused(refused, 1013, "draining")

        # The running sessions stream on through the grace period: audio after the drain began, no close.
        for c in clients:
            await c.wait_audio(after=started)
        assert not drain.done() and not any(c.closed.is_set() for c in clients)
        # A second drain joins the first and the earlier deadline holds: the grace ends now.
        await asyncio.wait_for(srv.drain(grace_s=0.0), WAIT_S)
        assert drain.done()
        for i, c in enumerate(clients):
            r = await c.wait_closed()
            assert r.handshake and r.errors == [], (i, r.errors)
            assert r.close_code == 1001, (i, r.close_code, r.close_reason)
            assert c.audio_after(started) >= AFTER_FRAMES, i

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
        await client.wait_audio(2 * AFTER_FRAMES)
        result = await client.finish()
    assert_healthy(client)
    reader = sphn.OpusStreamReader(SAMPLE_RATE_HZ)
    sizes = [np.asarray(reader.append_bytes(payload)).size for payload in client.audio_payloads]
    assert len(sizes) == result.audio_messages and sizes == [FRAME_SAMPLES] * len(sizes)


async def test_drain_lets_a_session_finish_within_the_grace(bundle, speech):
    async with running_server(bundle) as srv, live(chat_url(srv), speech[0]) as client:
        assert client.result.handshake
        client.start_streaming()
        await client.wait_audio(1)
        drain = asyncio.create_task(srv.drain(grace_s=3600.0))  # a grace no test would wait out
        await asyncio.sleep(0)  # let the drain begin
        assert srv.draining
        mark = client.mark()
        await client.wait_audio(after=mark)  # the session streams on through the drain
        assert not drain.done()  # the drain waits for it...
        result = await client.finish()
        # ...and ends when the last session does, not at the end of its grace period (the wait's timeout
        # only stops a hung test: an hour's grace waited out fails it).
        await asyncio.wait_for(drain, WAIT_S)
        assert_healthy(client, after=mark)
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
            await client.wait_audio()
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            result = await client.wait_closed(timeout_s=30)
            closed_after = time.monotonic() - signalled

        assert result.close_code == 1001, (result.close_code, result.close_reason)
        assert result.errors == []
        # A lower bound on one clock (the server's grace starts after the signal was sent): a slower machine
        # only closes it later. That the sessions stream on through a grace is checked, event by event, by
        # test_drain_refuses_new_sessions_and_closes_the_rest_with_1001 (the same drain, in process).
        assert closed_after >= 0.9, f"closed {closed_after:.2f} s after SIGTERM, before the 1 s grace"
        assert client.audio_after(signalled) >= 1  # not cut at the signal: audio went on after it
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
    pcm = np.concatenate([speech[0], speech[1]])  # about 6.8 s, looped
    async with running_server(bundle, redis_url=redis_server.url) as srv:
        store = srv.store
        assert store is not None
        async with live(chat_url(srv), pcm) as client:
            assert client.result.handshake
            client.start_streaming()
            await client.wait_audio()
            await wait_until(lambda: store.connected and store.backlog == 0, what="the registration written")

            await asyncio.to_thread(redis_server.stop)
            # The store sees the outage (a write failed; its ops are kept), then the criterion: the client's
            # audio goes on while Redis is away, event by event rather than within some time.
            await wait_until(lambda: not store.connected, timeout_s=WAIT_S, what="the store to fail a write")
            outage = client.mark()
            await client.wait_audio(2 * AFTER_FRAMES, after=outage)
            assert not redis_server.running and not store.connected and store.backlog > 0
            await asyncio.to_thread(redis_server.start)
            await client.wait_audio(after=client.mark())
            result = await client.finish()
        assert_healthy(client, after=outage)  # and every frame answered (or its drop counted)

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
        await client.wait_audio(1)
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
        await bad.wait_audio(1)
        await bad.send(raw)
        error = await bad.wait_error()
        assert error.startswith(f"{reason}:"), error
        mark = time.monotonic()  # the bad message has been answered
        await bad.wait_audio(after=mark)
        await healthy.wait_audio(after=mark)
        await bad.finish()
        await healthy.finish()

    # The offender's session survived its bad message: audio went on and it closed normally.
    r = bad.result
    assert r.errors == [error]
    assert r.close_code == 1000, (r.close_code, r.close_reason)
    assert bad.audio_after(mark) >= AFTER_FRAMES
    assert_healthy(healthy, after=mark, label="neighbour")
    assert await protocol_errors(server, reason) == errors_before + 1


@pytest.mark.slow
async def test_oversized_message_closes_only_that_session_with_1009(server, speech):
    limit = server.config.max_message_bytes
    async with neighbour(server, speech[0]) as healthy, live(chat_url(server), speech[1]) as bad:
        assert bad.result.handshake
        await bad.send(b"\x01" + bytes(limit + 2))
        r = await bad.wait_closed()
        assert r.close_code == 1009, (r.close_code, r.close_reason)
        await wait_until(lambda: len(server.sessions) == 1, what="the oversized session to end")
        mark = time.monotonic()
        await healthy.wait_audio(after=mark)
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
        await bad.wait_audio()  # a valid Opus stream first: the session works
        await bad.stop_streaming()
        await bad.send(b"\x01" + b"this is not an Ogg page at all " * 8)
        r = await bad.wait_closed()
        assert r.close_code == 1008, (r.close_code, r.close_reason)
        assert len(r.errors) == 1 and r.errors[0].startswith("bad_opus:"), r.errors
        mark = time.monotonic()
        await healthy.wait_audio(after=mark)
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
        result = await knock(chat_url(server, **params), speech[1])
        assert_refused(result, 1008, *needles)
        mark = time.monotonic()
        await healthy.wait_audio(after=mark)
        await healthy.finish()
    assert_healthy(healthy, after=mark, label="neighbour")
    refused = (await scrape(server)).value("duplex_admissions_refused_total", reason="bad_request")
    assert refused == refused_before + 1


@pytest.mark.slow
async def test_client_faster_than_real_time_loses_frames_not_the_session(server, speech):
    burst, inbox = 60, server.config.max_inbox_frames
    dropped_before = (await scrape(server)).value("duplex_frames_dropped_total", reason="input_overflow")
    async with neighbour(server, speech[0]) as healthy, live(chat_url(server), speech[1]) as fast:
        assert fast.result.handshake
        ticks_before = local_metrics(server).value("duplex_ticks_total")
        fast.start_streaming(burst_frames=burst)  # 4.8 s of audio at once, then real time
        await wait_until(
            lambda: fast.account is not None and fast.account.pushed >= burst, what="the burst in the slot"
        )
        # The ticks that ran meanwhile, each of which may have taken one frame of the burst off the inbox.
        ticks_during = local_metrics(server).value("duplex_ticks_total") - ticks_before
        mark = time.monotonic()
        await fast.wait_audio(2 * inbox, after=mark)  # the session went on after the burst
        await healthy.wait_audio(after=mark)
        await fast.finish()
        await healthy.finish()
    dropped = (await scrape(server)).value("duplex_frames_dropped_total", reason="input_overflow")
    # 60 frames against an inbox of 8: all of the burst is dropped but the inbox and the frames the ticks
    # took while it arrived (none on a fast machine; the ticks are counted, not assumed), and counted.
    account = fast.account
    assert account is not None
    assert account.dropped >= burst - inbox - ticks_during, (account.dropped, ticks_during)
    assert dropped - dropped_before >= account.dropped, (dropped - dropped_before, account.dropped)
    # It lost frames, not the session: no error, a normal close, every frame kept answered.
    assert_healthy(fast, after=mark, label="the fast client")
    assert_healthy(healthy, after=mark, label="neighbour")


@pytest.mark.slow
async def test_one_message_of_too_many_frames_is_refused_and_the_session_goes_on(server, speech):
    dropped_before = (await scrape(server)).value("duplex_frames_dropped_total", reason="input_overflow")
    frames = server.config.max_inbox_frames + 2
    async with neighbour(server, speech[0]) as healthy, live(chat_url(server), speech[1]) as bad:
        bad.start_streaming()
        await bad.wait_audio(1)
        await bad.send(b"\x01" + bytes(FRAME_SAMPLES * 2 * frames))
        error = await bad.wait_error()
        assert error.startswith("too_fast:"), error
        mark = time.monotonic()
        await bad.wait_audio(after=mark)
        await healthy.wait_audio(after=mark)
        await bad.finish()
        await healthy.finish()
    assert bad.result.close_code == 1000
    assert bad.audio_after(mark) >= AFTER_FRAMES
    assert_healthy(healthy, after=mark, label="neighbour")
    dropped = (await scrape(server)).value("duplex_frames_dropped_total", reason="input_overflow")
    assert dropped > dropped_before


@pytest.mark.slow
async def test_client_that_never_reads_does_not_hold_up_others(server, speech):
    """A client that stops reading holds the server's sends to it: one send waits for its socket while the
    slot goes on producing audio for it. While it does, the neighbour's audio goes on. Both are events the
    test waits for, counted in the slot's own audio frames, however slowly the machine produces them; no
    time is assumed."""
    async with neighbour(server, speech[0]) as healthy:
        before = set(server.sessions)
        # A small receive buffer and max_queue=1: once a message waits unread, the client stops reading its
        # socket at all.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.connect(("127.0.0.1", server.port))
        ws = await connect(
            chat_url(server), sock=sock, compression=None, max_queue=1, open_timeout=30, proxy=None
        )
        frames = [speech[1][i : i + FRAME_SAMPLES] for i in range(0, 30 * FRAME_SAMPLES, FRAME_SAMPLES)]

        async def stream() -> None:  # audio in real time, never reading a byte back
            _, encoder = make_codec(AudioFormat.PCM, 1000)
            next_send = time.monotonic()
            for i in itertools.count():
                await ws.send(encode_audio(encoder.encode(frames[i % len(frames)])))
                next_send += FRAME_S
                await asyncio.sleep(max(0.0, next_send - time.monotonic()))

        sender = None
        try:
            assert await asyncio.wait_for(ws.recv(), 30) == b"\x00"
            [stuck] = set(server.sessions) - before
            # Small buffers on the server's side of this one connection (a path that holds little; loopback's
            # take megabytes): a few frames fill them, whatever the machine's speed.
            connection = stuck.transport.connection.transport
            connection.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            connection.set_write_buffer_limits(high=4096)
            # Watch the session's sends: the slot's audio frames produced when the pending one began.
            ledger = _IN_PROCESS[server.port][1]
            pending: list[int] = []

            def produced() -> int:
                account = ledger.sessions.get(stuck.session_id)
                return 0 if account is None else account.produced

            send_audio = stuck.transport.send_audio

            async def send_watched(payload: bytes) -> None:
                pending.append(produced())
                try:
                    await send_audio(payload)
                finally:
                    pending.pop()

            stuck.transport.send_audio = send_watched
            sender = asyncio.create_task(stream())

            def held() -> bool:  # one send has waited for the socket while 3 more audio frames came
                return bool(pending) and produced() >= pending[0] + FRAME_ALLOWANCE

            await wait_until(held, timeout_s=WAIT_S, what="a send to the non-reading client to be held")
            mark = time.monotonic()
            await healthy.wait_audio(after=mark)  # while that client holds the server's sends
            assert stuck in server.sessions and held(), "the non-reading client let go"
        finally:
            if sender is not None:
                sender.cancel()
                with contextlib.suppress(BaseException):
                    await sender
            ws.transport.abort()
        await wait_until(lambda: len(server.sessions) == 1, what="the non-reading session to end")
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
