"""While the model loads, the runtime's address already answers its probes
(``runtime.frontend.server.loading_status``): alive but not ready, with ``duplex_loading 1`` for Prometheus;
then
it frees the address for the real server. And ``duplex serve`` really does this: a process started with
the tiny model answers ``/readyz`` with ``loading the model`` before it turns 200."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from runtime.config import RuntimeConfig
from runtime.frontend.server import LOADING_MESSAGE, loading_status
from runtime.metrics import RuntimeMetrics
from runtime.tools.local_redis import free_loopback_port


def _get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


async def _fetch(url: str) -> tuple[int, str]:
    return await asyncio.to_thread(_get, url)


def test_loading_status_answers_probes_then_frees_the_port() -> None:
    port = free_loopback_port()
    config = RuntimeConfig(host="127.0.0.1", port=port, auth_mode="off")
    metrics = RuntimeMetrics()
    base = f"http://127.0.0.1:{port}"

    async def scenario() -> None:
        async with loading_status(config, metrics) as server:
            assert server is not None
            assert await _fetch(f"{base}/healthz") == (200, "loading\n")
            status, body = await _fetch(f"{base}/readyz")
            assert status == 503 and json.loads(body) == {"ready": False, "reason": "loading the model"}
            status, body = await _fetch(f"{base}/metrics")
            assert status == 200
            assert "duplex_loading 1.0" in body and "duplex_ready 0.0" in body
            status, body = await _fetch(f"{base}/api/admission")
            assert status == 200 and json.loads(body)["reason"] == "not_ready"
            assert await _fetch(f"{base}/api/chat") == (503, LOADING_MESSAGE + "\n")
        assert metrics.loading._value.get() == 0  # type: ignore[attr-defined]
        # The address is free again: the real server can listen on it.
        again = await asyncio.start_server(lambda r, w: None, "127.0.0.1", port)
        again.close()
        await again.wait_closed()

    asyncio.run(scenario())


def test_ephemeral_port_holds_nothing() -> None:
    config = RuntimeConfig(host="127.0.0.1", port=0, auth_mode="off")

    async def scenario() -> None:
        async with loading_status(config, RuntimeMetrics()) as server:
            assert server is None

    asyncio.run(scenario())


def test_busy_address_is_an_error() -> None:
    port = free_loopback_port()
    config = RuntimeConfig(host="127.0.0.1", port=port, auth_mode="off")

    async def scenario() -> None:
        holder = await asyncio.start_server(lambda r, w: None, "127.0.0.1", port, reuse_address=False)
        try:
            with pytest.raises(OSError):
                async with loading_status(config, RuntimeMetrics()):
                    pass
        finally:
            holder.close()
            await holder.wait_closed()

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_duplex_serve_reports_loading_before_ready() -> None:
    port = free_loopback_port()
    env = {
        **os.environ,
        "DUPLEX_HOST": "127.0.0.1",
        "DUPLEX_PORT": str(port),
        "DUPLEX_MODEL": "tiny",
        "DUPLEX_AUTH_MODE": "off",
        "DUPLEX_MAX_SESSIONS": "2",
        "DUPLEX_TORCH_THREADS": "1",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "runtime.tools.cli", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline:
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
            try:
                status, body = _get(f"http://127.0.0.1:{port}/readyz", timeout=1)
            except OSError:
                time.sleep(0.05)
                continue
            seen.append("ready" if status == 200 else json.loads(body)["reason"])
            if status == 200:
                break
            time.sleep(0.05)
        assert seen and seen[-1] == "ready", seen
        assert "loading the model" in seen, f"never saw the loading answer: {seen[:5]}"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
