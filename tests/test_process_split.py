"""The process split (``duplex serve --workers N``): one engine process, N front-end workers on one port.

Real nodes, started as ``python -m runtime.tools.cli serve --workers 2`` with the ``sim`` model (a 5 ms step):
admission stays exact under concurrent handshakes on every worker, metrics add up over the processes, a
killed worker ends only its own sessions, a killed engine makes every worker unhealthy, and SIGTERM
drains across the processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from test_server_e2e import (  # noqa: F401 (speech: fixture)
    WAIT_S,
    LiveClient,
    Metrics,
    assert_healthy,
    http_get,
    knock,
    speech,
    wait_until,
)
from websockets.asyncio.client import connect

from infra.node.local.bringup import runtime_health_problem
from runtime.frontend.codecs.protocol import encode_metadata
from runtime.frontend.gate.tokens import generate_signing_key, mint_token
from runtime.tools.loadgen import run_session, session_url
from runtime.tools.local_redis import free_loopback_port

pytestmark = pytest.mark.asyncio(loop_scope="module")

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120.0  # two spawned interpreters importing torch on a busy 2-core machine


class SplitNode:
    """A ``duplex serve --workers N`` process group on a free loopback port."""

    def __init__(self, port: int, process: subprocess.Popen[bytes], log: Path) -> None:
        self.port = port
        self.process = process
        self.log = log

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def chat_url(self) -> str:
        return session_url(self.url)

    async def readyz(self, path: str = "/readyz") -> tuple[int, dict]:
        status, _, body = await http_get(self.port, path)
        return status, json.loads(body)

    async def metrics(self) -> Metrics:
        status, _, body = await http_get(self.port, "/metrics")
        assert status == 200
        return Metrics(body)


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"


def sim_node_env(**env: str) -> dict[str, str]:
    """This process's environment for a ``duplex serve`` child on the sim model (5 ms steps, no access
    control, this checkout first on the path), plus ``env``; without the parent's Prometheus multiprocess
    directory."""
    environment = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DUPLEX_AUTH_MODE": "off",
        "DUPLEX_MODEL": "sim",
        "DUPLEX_SIM_STEP_MS": "5",
        **env,
    }
    environment.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return environment


def serve_command(port: int, workers: int) -> list[str]:
    """``duplex serve --port PORT --workers N`` with this interpreter."""
    return [
        sys.executable,
        "-m",
        "runtime.tools.cli",
        "serve",
        "--port",
        str(port),
        "--workers",
        str(workers),
    ]


@contextlib.asynccontextmanager
async def split_node(tmp_path: Path, workers: int = 2, **env: str) -> AsyncIterator[SplitNode]:
    port = free_loopback_port()
    log = tmp_path / f"node-{port}.log"
    environment = sim_node_env(**{"DUPLEX_MAX_SESSIONS": "3", "DUPLEX_DRAIN_GRACE_S": "2", **env})
    with log.open("wb") as out:
        process = subprocess.Popen(
            serve_command(port, workers),
            env=environment,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    node = SplitNode(port, process, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        seen: set[str] = set()
        while len(seen) < workers:
            assert process.poll() is None, f"the node exited: {_tail(log)}"
            assert time.monotonic() < deadline, f"the node did not start: {_tail(log)}"
            with contextlib.suppress(OSError, ValueError):
                status, body = await node.readyz()
                if status == 200:
                    seen.add(body["worker"])
            await asyncio.sleep(0.2)
        yield node
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(process.wait, 30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                await asyncio.to_thread(process.wait, 10)


async def open_live(url: str, pcm) -> tuple[LiveClient, str]:  # type: ignore[no-untyped-def]
    """An open client and the ``Server`` header of its worker (``duplex worker-N pid=P``)."""
    client = LiveClient(url, pcm)
    await client.open()
    assert client.ws is not None and client.ws.response is not None
    return client, client.ws.response.headers.get("Server", "")


def _pid(server_header: str) -> int:
    return int(server_header.rsplit("pid=", 1)[1])


@pytest.fixture
def node_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


@pytest.mark.slow
async def test_admission_is_exact_across_workers_and_metrics_add_up(node_dir, speech):  # noqa: F811
    async with split_node(node_dir) as node:
        attempts = 12
        results = await asyncio.gather(
            *(asyncio.wait_for(_try_open(node.chat_url(), speech[i % 5]), 60) for i in range(attempts))
        )
        admitted = [(c, h) for c, h in results if c.result.handshake]
        refused = [c for c, _ in results if not c.result.handshake]
        seen = [(c.result.handshake, c.result.errors, c.result.close_code, h) for c, h in results]
        try:
            assert len(admitted) == 3, seen
            assert all(c.result.errors and "node full" in c.result.errors[0] for c in refused), seen
            workers = {h.split()[1] for _, h in results if h}
            assert workers == {"worker-0", "worker-1"}, workers  # handshakes landed on both workers
            for _ in range(50):  # a worker's view of the slots is the engine's Status of <= 0.1 s ago
                status, body = await node.readyz("/slotz")
                if status == 503:
                    break
                await asyncio.sleep(0.1)
            assert status == 503 and body["free_slots"] == 0, body
            assert (await node.readyz())[0] == 200  # full, still serving (issue 33)
        finally:
            for client, _ in results:
                await client.finish(tail_s=0.1) if client.result.handshake else await client.discard()
        await wait_until_free(node, 3)
        metrics = await node.metrics()
        assert metrics.value("duplex_sessions_started_total") == 3
        assert metrics.value("duplex_admissions_refused_total", reason="node_full") == attempts - 3
        assert metrics.value("duplex_slots_total") == 3
        assert metrics.value("duplex_ticks_total") > 0  # the engine's counters, read through a worker


async def _try_open(url: str, pcm) -> tuple[LiveClient, str]:  # type: ignore[no-untyped-def]
    client = LiveClient(url, pcm)
    await client.open()
    header = client.ws.response.headers.get("Server", "") if client.ws and client.ws.response else ""
    return client, header


async def wait_until_free(node: SplitNode, free: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = await node.readyz()
        if status == 200 and body["reason"].startswith(f"{free} of"):
            return
        assert time.monotonic() < deadline, f"slots not free: {body}"
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_a_killed_worker_ends_only_its_sessions(node_dir, speech):  # noqa: F811
    # As many slots as connection attempts: the kernel spreads connections over the workers by a hash
    # (SO_REUSEPORT), so the first few may all land on one worker; every attempt must still get a slot.
    async with split_node(node_dir, DUPLEX_MAX_SESSIONS="12") as node:
        clients: list[tuple[LiveClient, str]] = []
        try:
            for i in range(12):  # until both workers hold sessions
                clients.append(await open_live(node.chat_url(), speech[i % 5]))
                by_worker = {h.split()[1] for _, h in clients}
                if len(by_worker) == 2 and len(clients) >= 3:
                    break
            assert len({h.split()[1] for _, h in clients}) == 2
            for client, _ in clients:
                client.start_streaming()
            for client, _ in clients:
                await client.wait_audio(1)
            victim_header = clients[0][1]
            victims = [c for c, h in clients if h == victim_header]
            survivors = [c for c, h in clients if h != victim_header]
            os.kill(_pid(victim_header), signal.SIGKILL)
            mark = time.monotonic()
            for client in victims:
                await asyncio.wait_for(client.closed.wait(), 10)
            for client in survivors:  # their audio goes on after the kill (events, not a time)
                await client.wait_audio(after=mark)
            for client in survivors:
                await client.finish()
                assert_healthy(client, after=mark, label="a session of the other worker")
        finally:
            for client, _ in clients:
                await client.discard()
        await wait_until_free(node, 12)  # the engine freed the dead worker's slots
        assert node.process.poll() is None
        # The supervisor started the worker again: both answer.
        seen: set[str] = set()
        for _ in range(200):
            status, body = await node.readyz()
            if status == 200:
                seen.add(body["worker"])
            if len(seen) == 2:
                break
            await asyncio.sleep(0.2)
        assert seen == {"worker-0", "worker-1"}


@pytest.mark.slow
async def test_a_killed_engine_makes_every_worker_unhealthy(node_dir, speech):  # noqa: F811
    async with split_node(node_dir) as node:
        client, _ = await open_live(node.chat_url(), speech[0])
        try:
            client.start_streaming()
            _, body = await node.readyz()
            os.kill(int(body["engine_pid"]), signal.SIGKILL)
            result = await client.wait_closed(timeout_s=15)
            assert result.close_code == 1011, (result.close_code, result.close_reason)
        finally:
            await client.discard()
        workers: dict[str, tuple[int, str]] = {}
        for _ in range(100):
            status, _, text = await http_get(node.port, "/healthz")
            rstatus, rbody = await node.readyz()
            workers[rbody.get("worker", "?")] = (status, text)
            if len(workers) == 2:
                break
        assert set(workers) == {"worker-0", "worker-1"}
        for status, text in workers.values():
            assert (status, text.strip()) == (500, "engine unreachable")
        refused = await knock(node.chat_url(), speech[1])
        assert not refused.handshake
        # `duplex node up` (infra.node.local.bringup) reports it.
        problem = await asyncio.to_thread(runtime_health_problem, f"http://127.0.0.1:{node.port}")
        assert problem == "runtime /healthz answered 500: engine unreachable"


@pytest.mark.slow
async def test_sigterm_drains_every_process(node_dir, speech):  # noqa: F811
    # A grace long enough for the checks below to run inside it on any machine; they wait for events.
    async with split_node(node_dir, DUPLEX_DRAIN_GRACE_S="10") as node:
        client, _ = await open_live(node.chat_url(), speech[0])
        try:
            client.start_streaming()
            await client.wait_audio(1)
            os.kill(node.process.pid, signal.SIGTERM)
            # Until both workers have begun their drain (each logs it), rather than after some time: a worker
            # without sessions then stops listening, the other answers until its grace ends.
            await wait_until(
                lambda: all(
                    f"{worker} runtime.frontend.server: draining:" in node.log.read_text(errors="replace")
                    for worker in ("worker-0", "worker-1")
                ),
                timeout_s=WAIT_S,
                what="both workers to begin draining",
            )
            status, body = await node.readyz()
            assert status == 503 and body["reason"] == "draining", body
            refused = await knock(node.chat_url(), speech[1])
            assert not refused.handshake and refused.close_code == 1013, refused
            result = await client.wait_closed(timeout_s=20)
            assert result.close_code == 1001, (result.close_code, result.close_reason)
        finally:
            await client.discard()
        code = await asyncio.to_thread(node.process.wait, 40)
        assert code == 0, _tail(node.log)


async def test_a_split_node_answers_every_route_on_one_port(node_dir):
    async with split_node(node_dir, workers=1) as node:
        status, _, text = await http_get(node.port, "/healthz")
        assert (status, text) == (200, "ok\n")
        status, _, text = await http_get(node.port, "/api/personas")
        assert status == 200 and json.loads(text)["voices"] == []
        status, _, text = await http_get(node.port, "/api/admission")
        assert status == 200 and json.loads(text)["ok"] is True
        async with connect(node.chat_url() + "&voice_prompt=nobody", proxy=None) as ws:
            message = await ws.recv()
            assert isinstance(message, bytes) and message[0] == 5 and b"nobody" in message
        # A text prompt sent as 0x04 metadata: the worker reads it, the engine builds the prompt.
        async with connect(node.chat_url() + "&text_prompt_in=metadata", proxy=None) as ws:
            await ws.send(encode_metadata({"text_prompt": "You are a kind travel agent."}))
            message = await asyncio.wait_for(ws.recv(), 30)
            assert message == b"\x00", message


@pytest.mark.slow
async def test_a_token_is_single_use_across_workers(node_dir, speech):  # noqa: F811
    key = generate_signing_key("split")
    env = {
        "DUPLEX_AUTH_MODE": "token",
        "DUPLEX_TOKEN_KEYS": json.dumps({key.kid: key.secret.decode()}),
        "DUPLEX_TOKEN_REPLAY_CHECK": "memory",
    }
    async with split_node(node_dir, **env) as node:
        value = mint_token(key, ttl_s=120, personas=["*"], audience="duplex")
        results = []
        for _ in range(4):  # whichever worker each lands on, one engine spends the token
            results.append(await run_session(node.chat_url(), speech[0][: 1920 * 4], tail_s=0.1, token=value))
            await wait_until_free(node, 3)  # a refused replay held its slot until the next tick
        assert results[0].handshake, results[0]
        for again in results[1:]:
            assert not again.handshake
            assert again.http_status == 403 or "already used" in again.errors[0], again


@pytest.mark.slow
async def test_a_killed_supervisor_takes_its_engine_and_workers_with_it(node_dir):
    async with split_node(node_dir, workers=1) as node:
        _, body = await node.readyz()
        engine_pid = int(body["engine_pid"])
        async with connect(node.chat_url(), proxy=None) as ws:
            worker_pid = _pid(ws.response.headers["Server"])
        os.kill(node.process.pid, signal.SIGKILL)
        await asyncio.to_thread(node.process.wait, 10)

        def gone(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"

        deadline = time.monotonic() + 10
        while not (gone(engine_pid) and gone(worker_pid)):
            assert time.monotonic() < deadline, "the engine or the worker outlived the supervisor"
            await asyncio.sleep(0.1)
