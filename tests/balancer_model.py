"""A model of the multi-region stack's global load balancer, driven against real ``duplex serve --model sim``
pods on loopback (issue 33: "prove it with a model of the balancer in the test harness").

What it models, from ``infra.components.global_entry``:

- **balancing on the pods' own report**: every runtime answer carries ``endpoint-load-metrics: TEXT
  named_metrics.slot_utilization=<u>`` (``runtime.frontend.gate.slot_load``); the model keeps the last value
  each endpoint reported (a request's answer, or a health check's) and picks among the endpoints below
  ``maxUtilization`` (``MAX_SLOT_UTILIZATION``) the least utilised, ties in turn (weighted round robin, made
  deterministic); with every endpoint at the maximum it still sends (the caller then waits or gets 503). It
  knows nothing the pods did not report: callers of one burst are placed on the reports from before it;
- **the route's retry policy** (``RUNTIME_RETRY_POLICY``): an answer in ``RETRY_STATUSES`` (``gateway-error``:
  502, 503, 504) is tried again, up to ``num_retries`` more times, on the endpoint picked then (the 503's own
  report, ``slot_utilization=1``, has moved the pick away from the full pod); the last answer goes back to
  the caller, ``Retry-After`` included;
- **health checks on ``/readyz``** (:class:`ReadinessWatch`): polled throughout; a full pod must stay 200.

The pods run with ``DUPLEX_FULL_BEFORE_UPGRADE=true`` as the multi-region pods do (``infra.k8s.workload``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sim_pods import start_serve
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from runtime.frontend.codecs.protocol import MessageKind
from runtime.frontend.gate.slot_load import LOAD_REPORT_HEADER, SLOT_UTILIZATION, SLOTZ_PATH, load_report
from runtime.tools.local_redis import free_loopback_port

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180.0
"""Pods start as spawned interpreters importing torch on a shared 2-core machine: a generous deadline."""
WAIT_S = 60.0
"""Deadline of every poll (not a timing assertion: a poll ends as soon as its condition holds)."""
RETRY_STATUSES = frozenset({502, 503, 504})
"""The URL map's ``gateway-error`` retry condition."""
METRIC = f"named_metrics.{SLOT_UTILIZATION}"


async def http_get(port: int, path: str) -> tuple[int, Mapping[str, str], str]:
    """``GET path`` on a loopback port: status, headers (lower-case names), body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        raw = await reader.read()
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body.decode(errors="replace")


@dataclass
class Pod:
    """One ``duplex serve --workers 0 --model sim`` process on a loopback port."""

    port: int
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    async def slotz(self) -> dict[str, object]:
        status, _, body = await http_get(self.port, SLOTZ_PATH)
        return {"status": status, **json.loads(body)}


@contextlib.asynccontextmanager
async def running_pods(tmp_path: Path, count: int, slots: int, **env: str) -> AsyncIterator[list[Pod]]:
    """``count`` pods of ``slots`` slots each (the sim model, 5 ms steps, no access control, this checkout
    on the path), started together; yielded once every one answers ``/readyz`` 200; stopped after."""
    environment = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DUPLEX_AUTH_MODE": "off",
        "DUPLEX_MODEL": "sim",
        "DUPLEX_SIM_STEP_MS": "5",
        "DUPLEX_MAX_SESSIONS": str(slots),
        "DUPLEX_DRAIN_GRACE_S": "1",
        "DUPLEX_FULL_BEFORE_UPGRADE": "true",
        **env,
    }
    environment.pop("PROMETHEUS_MULTIPROC_DIR", None)
    pods: list[Pod] = []
    try:
        for _ in range(count):
            port = free_loopback_port()
            log = tmp_path / f"pod-{port}.log"
            process = start_serve(port, environment, log)
            pods.append(Pod(port, process, log))
        deadline = time.monotonic() + START_TIMEOUT_S
        for pod in pods:
            while True:
                assert pod.process.poll() is None, f"pod {pod.port} exited: {pod.tail()}"
                assert time.monotonic() < deadline, f"pod {pod.port} did not start: {pod.tail()}"
                with contextlib.suppress(OSError, ValueError, IndexError):
                    if (await http_get(pod.port, "/readyz"))[0] == 200:
                        break
                await asyncio.sleep(0.2)
        yield pods
    finally:
        for pod in pods:
            if pod.process.poll() is None:
                os.killpg(pod.process.pid, signal.SIGTERM)
        for pod in pods:
            try:
                await asyncio.to_thread(pod.process.wait, 30)
            except subprocess.TimeoutExpired:
                os.killpg(pod.process.pid, signal.SIGKILL)
                await asyncio.to_thread(pod.process.wait, 10)


class ReadinessWatch:
    """The load balancer's health checks: ``/readyz`` of every pod, polled until stopped; ``answers``: every
    status seen per port (a full pod answering anything but 200 is a flap)."""

    def __init__(self, pods: Iterable[Pod], period_s: float = 0.1) -> None:
        self.pods = list(pods)
        self.period_s = period_s
        self.answers: dict[int, list[int]] = {pod.port: [] for pod in self.pods}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ReadinessWatch:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        while True:
            for pod in self.pods:
                status, _, _ = await http_get(pod.port, "/readyz")
                self.answers[pod.port].append(status)
            await asyncio.sleep(self.period_s)

    def flaps(self) -> dict[int, list[int]]:
        """Per port, the statuses other than 200 seen (empty: no flapping)."""
        return {
            port: [s for s in seen if s != 200] for port, seen in self.answers.items() if set(seen) - {200}
        }


@dataclass
class Placement:
    """Where a caller's request ended: the WebSocket (None when refused), the endpoint of the last try,
    every endpoint tried in order, and the last status with its ``Retry-After``."""

    ws: ClientConnection | None
    port: int
    tried: list[int]
    status: int
    retry_after: str | None = None


@dataclass
class Balancer:
    """The global entry's balancing and retry policy over ``ports`` (see the module docstring).

    Attributes:
        reported: the last ``slot_utilization`` each endpoint reported (0.0 before any report).
        max_utilization: ``backends[].customMetrics[].maxUtilization``.
        num_retries: ``retryPolicy.numRetries``.
    """

    ports: list[int]
    max_utilization: float = 1.0
    num_retries: int = 3
    reported: dict[int, float] = field(default_factory=dict)
    _turn: int = 0

    def __post_init__(self) -> None:
        for port in self.ports:
            self.reported.setdefault(port, 0.0)

    def observe(self, port: int, headers: Mapping[str, str]) -> None:
        """Take an answer's load report (an answer without one leaves the last)."""
        value = {k.lower(): v for k, v in headers.items()}.get(LOAD_REPORT_HEADER)
        if value is not None:
            self.reported[port] = load_report(value)[METRIC]

    async def health_check(self) -> None:
        """One round of health checks: each ``/readyz`` answer's report."""
        for port in self.ports:
            _, headers, _ = await http_get(port, "/readyz")
            self.observe(port, headers)

    def pick(self) -> int:
        """The endpoint of the next try: the least utilised below ``max_utilization`` (all of them when none
        is), ties in turn."""
        below = [p for p in self.ports if self.reported[p] < self.max_utilization]
        pool = below or self.ports
        low = min(self.reported[p] for p in pool)
        tied = [p for p in pool if self.reported[p] == low]
        port = tied[self._turn % len(tied)]
        self._turn += 1
        return port

    async def connect(self, path: str = "/api/chat?format=pcm") -> Placement:
        """A WebSocket upgrade through the model: tried, retried on ``RETRY_STATUSES`` up to ``num_retries``
        times; the last answer is the caller's."""
        tried: list[int] = []
        while True:
            port = self.pick()
            tried.append(port)
            try:
                ws = await connect(f"ws://127.0.0.1:{port}{path}", open_timeout=WAIT_S)
            except InvalidStatus as refused:
                answer = refused.response
                self.observe(port, dict(answer.headers))
                if answer.status_code in RETRY_STATUSES and len(tried) <= self.num_retries:
                    continue
                return Placement(None, port, tried, answer.status_code, answer.headers.get("Retry-After"))
            assert ws.response is not None
            self.observe(port, dict(ws.response.headers))
            return Placement(ws, port, tried, ws.response.status_code)


class Caller:
    """A WebSocket caller once placed: ``live`` is set at its handshake (0x00: it holds a slot); until then
    it waits (the waiting room). ``errors``: the 0x05 sentences it was sent."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self.live = asyncio.Event()
        self.errors: list[str] = []
        self._reader = asyncio.create_task(self._read()) if placement.ws is not None else None

    async def _read(self) -> None:
        assert self.placement.ws is not None
        with contextlib.suppress(ConnectionClosed):
            async for message in self.placement.ws:
                if isinstance(message, bytes) and message[:1] == bytes([MessageKind.HANDSHAKE]):
                    self.live.set()
                elif isinstance(message, bytes) and message[:1] == bytes([MessageKind.ERROR]):
                    self.errors.append(message[1:].decode(errors="replace"))

    @property
    def refused(self) -> bool:
        return self.placement.ws is None or bool(self.errors)

    async def hang_up(self) -> None:
        if self.placement.ws is not None:
            await self.placement.ws.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


async def burst(balancer: Balancer, size: int) -> list[Caller]:
    """``size`` callers arriving at once: every one placed on the reports from before the burst."""
    placements = await asyncio.gather(*(balancer.connect() for _ in range(size)))
    return [Caller(p) for p in placements]


async def poll(condition: object, what: str, deadline_s: float = WAIT_S) -> None:
    """Wait until ``condition()`` (sync or async) holds; AssertionError naming ``what`` past the deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = condition()  # type: ignore[operator]
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        assert time.monotonic() < deadline, f"not within {deadline_s:g} s: {what}"
        await asyncio.sleep(0.05)
