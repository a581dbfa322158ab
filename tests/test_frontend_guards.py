"""The front end's guards (issue 16): a slot freed when its client leaves at any phase, a token spent only
by a session that got a slot, HTTP methods, quiet access logs, handshake rate limits, a cheap ``/metrics``,
and the bounded waiting room that keeps Kyutai-style clients waiting for a slot.

Real servers on loopback with the tiny model (``tests/test_server_e2e.py``'s helpers); the rate limiter's
own arithmetic runs on an injected clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator

import numpy as np
import pytest
from test_access_control import KEY, auth_settings, token
from test_server_e2e import (  # noqa: F401 (bundle, speech: fixtures)
    LiveClient,
    bundle,
    chat_url,
    http_get,
    live,
    running_server,
    scrape,
    speech,
    wait_until,
)
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from runtime.engine.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.frontend.codecs.kyutai_audio import OpusFrameEncoder
from runtime.frontend.codecs.protocol import AudioFormat, MessageKind, encode_audio
from runtime.frontend.server import DuplexServer
from runtime.tools.loadgen import run_session

pytestmark = pytest.mark.asyncio(loop_scope="module")


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def raw_http(port: int, request: bytes) -> tuple[int, dict[str, str], str]:
    """Send one raw HTTP/1.1 request; (status, headers lower-cased, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body.decode("utf-8", errors="replace")


class KyutaiStyleClient:
    """Behaves as Kyutai's ``moshi.client`` does (moshi 0.2.13, ``client.py``): connects, starts sending its
    microphone's Ogg/Opus at once, before any handshake, and waits for audio; it reads every message."""

    def __init__(self, url: str, pcm: np.ndarray) -> None:
        self.url = url
        self.pcm = pcm
        self.kinds: list[int] = []
        self.ws: ClientConnection | None = None
        self.handshake = asyncio.Event()
        self.closed = asyncio.Event()
        self.error: str | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def open(self) -> KyutaiStyleClient:
        self.ws = await connect(self.url, max_size=2**20, compression=None, proxy=None)
        self._tasks = [asyncio.create_task(self._send()), asyncio.create_task(self._receive())]
        return self

    async def _send(self) -> None:
        assert self.ws is not None
        encoder = OpusFrameEncoder()
        i = 0
        with contextlib.suppress(ConnectionClosed):
            while True:
                frame = self.pcm[(i * FRAME_SAMPLES) % (len(self.pcm) - FRAME_SAMPLES) :][:FRAME_SAMPLES]
                payload = encoder.encode(frame)
                if payload:
                    await self.ws.send(encode_audio(payload))
                i += 1
                await asyncio.sleep(FRAME_SAMPLES / SAMPLE_RATE_HZ)

    async def _receive(self) -> None:
        assert self.ws is not None
        try:
            async for message in self.ws:
                assert isinstance(message, bytes)
                self.kinds.append(message[0])
                if message[0] == MessageKind.HANDSHAKE:
                    self.handshake.set()
                elif message[0] == MessageKind.ERROR:
                    self.error = message[1:].decode()
        except ConnectionClosed:
            pass
        finally:
            self.closed.set()

    @property
    def audio_messages(self) -> int:
        return self.kinds.count(MessageKind.AUDIO)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if self.ws is not None:
            await self.ws.close()


@contextlib.asynccontextmanager
async def kyutai_client(url: str, pcm: np.ndarray) -> AsyncIterator[KyutaiStyleClient]:
    client = KyutaiStyleClient(url, pcm)
    try:
        yield await client.open()
    finally:
        await client.close()


def long_prompts(server: DuplexServer, factor: int = 2000) -> None:
    """Make every persona prompt ``factor`` times longer (minutes of teacher-forced steps)."""
    backend = server.backend
    prompt = backend.prompt

    def longer(*args):  # type: ignore[no-untyped-def]
        return prompt(*args) * factor

    backend.prompt = longer  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------------------
# A slot is freed at once when its client leaves before its handshake
# --------------------------------------------------------------------------------------------------


async def test_leaving_during_the_persona_prompt_frees_the_slot(bundle, speech):  # noqa: F811
    # Step by step (no prefill), so that the prompt runs for minutes.
    async with running_server(bundle, max_sessions=1, prompt_prefill=False) as server:
        long_prompts(server)
        url = chat_url(server, text_prompt="You are a helpful travel agent.")
        async with kyutai_client(url, speech[0]) as leaving:
            await wait_until(lambda: server.backend.status().free_slots == 0, what="the slot to be taken")
            await asyncio.sleep(0.3)  # the prompt runs (minutes of steps) and the client sends audio
            assert not leaving.handshake.is_set()
        await wait_until(
            lambda: server.backend.status().free_slots == 1, timeout_s=5, what="the slot to be freed"
        )
        assert not server.sessions
        metrics = await scrape(server)
        assert metrics.value("duplex_sessions_ended_total", reason="client_closed") == 1
        # The node takes the next caller at once (no prompt for this one).
        del server.backend.prompt  # the class's own again
        result = await run_session(chat_url(server), speech[1][: FRAME_SAMPLES * 5], tail_s=0.1)
        assert result.handshake and result.close_code == 1000, result


# --------------------------------------------------------------------------------------------------
# A token is spent only by a session that got its slot
# --------------------------------------------------------------------------------------------------


async def test_token_unspent_by_refused_upgrade_or_full_node(bundle, speech):  # noqa: F811
    async with running_server(bundle, max_sessions=1, **auth_settings(None, KEY, replay="memory")) as server:
        value = token()
        path = f"/api/chat?token={value}"
        # 426: no Upgrade header.
        status, _, _ = await asyncio.to_thread(
            raw_http, server.port, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
        )
        assert status == 426
        # 400: a WebSocket version this server does not speak.
        bad_version = (
            f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 7\r\n\r\n"
        )
        status, _, _ = await asyncio.to_thread(raw_http, server.port, bad_version.encode())
        assert status in (400, 426)
        # Node full: a holder takes the only slot; the token's session is refused and keeps its token.
        holder = LiveClient(chat_url(server, token=token()), speech[0])
        await holder.open()
        try:
            assert holder.result.handshake
            refused = await run_session(chat_url(server, token=value), speech[1][: FRAME_SAMPLES * 3])
            assert not refused.handshake and refused.close_code == 1013, refused
            assert "node full" in refused.errors[0]
        finally:
            await holder.finish(tail_s=0.1)
        await wait_until(lambda: server.backend.status().free_slots == 1, what="the holder's slot")
        # The same token still opens a session: nothing above spent it.
        served = await run_session(chat_url(server, token=value), speech[1][: FRAME_SAMPLES * 5], tail_s=0.1)
        assert served.handshake and served.close_code == 1000, served
        # And now it is spent.
        again = await run_session(chat_url(server, token=value), speech[1][: FRAME_SAMPLES * 3])
        assert again.http_status == 403 and again.http_body.startswith("replayed"), again


# --------------------------------------------------------------------------------------------------
# HTTP methods, access logs, /metrics
# --------------------------------------------------------------------------------------------------


async def test_routes_methods_and_quiet_access_log(bundle, caplog):  # noqa: F811
    async with running_server(bundle, max_sessions=1) as server:
        caplog.set_level(logging.INFO)
        caplog.clear()
        for _ in range(3):
            assert (await http_get(server.port, "/metrics"))[0] == 200
            assert (await http_get(server.port, "/healthz"))[0] == 200
        assert [r for r in caplog.records if r.levelno >= logging.INFO] == []
        for method in ("PUT", "POST", "DELETE"):
            status, headers, body = await asyncio.to_thread(
                raw_http,
                server.port,
                f"{method} /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                "Connection: close\r\n\r\n".encode(),
            )
            assert status == 405, (method, status, body)
            assert headers["allow"] == "GET"
            assert method in body
        status, _, body = await http_get(server.port, "/nothing")
        assert status == 404 and "/metrics" in body


async def test_metrics_rendered_once_per_cache_period(bundle):  # noqa: F811
    async with running_server(bundle, max_sessions=1, metrics_cache_s=1.0) as server:
        first = server.render_metrics(now=100.0)
        server.metrics.sessions_started.inc()
        assert server.render_metrics(now=100.9) is first  # cached
        fresh = server.render_metrics(now=101.0)
        assert fresh is not first and b"duplex_sessions_started_total 1.0" in fresh


# --------------------------------------------------------------------------------------------------
# Handshake rate limits
# --------------------------------------------------------------------------------------------------


async def test_rate_limited_upgrades_get_429_before_token_check(bundle):  # noqa: F811
    settings = auth_settings(None, KEY, replay="memory")
    settings.update(handshake_rate_per_client=0.01, handshake_burst_per_client=2, handshake_rate_global=0)
    async with running_server(bundle, max_sessions=1, **settings) as server:
        statuses = []
        for _ in range(4):
            with pytest.raises(InvalidStatus) as info:
                await connect(chat_url(server), proxy=None, open_timeout=10)
            statuses.append(info.value.response.status_code)
            retry_after = info.value.response.headers.get("Retry-After")
        assert statuses == [401, 401, 429, 429]
        assert retry_after is not None and int(retry_after) >= 1
        # Another client (nginx's X-Real-IP from a trusted proxy, here loopback) has its own bucket.
        with pytest.raises(InvalidStatus) as info:
            await connect(
                chat_url(server), proxy=None, open_timeout=10, additional_headers={"X-Real-IP": "203.0.113.7"}
            )
        assert info.value.response.status_code == 401
        metrics = await scrape(server)
        assert metrics.value("duplex_admissions_refused_total", reason="rate_limited") == 2
        assert metrics.value("duplex_admissions_refused_total", reason="missing") == 3


async def test_global_rate_limit_holds_across_clients(bundle):  # noqa: F811
    settings = {"handshake_rate_per_client": 0, "handshake_rate_global": 0.01, "handshake_burst_global": 2}
    async with running_server(bundle, max_sessions=1, **settings) as server:
        statuses = []
        for i in range(3):
            with pytest.raises(InvalidStatus) as info:  # an origin refusal (403) costs one handshake each
                await connect(
                    f"ws://127.0.0.1:{server.port}/api/chat",
                    proxy=None,
                    open_timeout=10,
                    additional_headers={"X-Real-IP": f"203.0.113.{i}", "Origin": "https://evil.example"},
                )
            statuses.append(info.value.response.status_code)
        assert statuses == [403, 403, 429]


# --------------------------------------------------------------------------------------------------
# The waiting room
# --------------------------------------------------------------------------------------------------


async def test_kyutai_style_client_waits_for_a_slot(bundle, speech):  # noqa: F811
    async with running_server(bundle, max_sessions=1, waiting_room_s=60, waiting_room_size=1) as server:
        holder = LiveClient(chat_url(server), speech[0])
        await holder.open()
        assert holder.result.handshake
        holder.start_streaming()
        url = chat_url(server, audio_format=AudioFormat.OPUS)
        async with kyutai_client(url, speech[1]) as waiting:
            await wait_until(lambda: server.backend.admission.waiting == 1, what="the caller to wait")
            session_id = server.backend.admission._queue[0].session.session_id
            assert server.backend.admission.position(session_id) == 1
            assert (await scrape(server)).value("duplex_waiting_sessions") == 1
            # Past the bound: the room holds one caller; the next is refused clearly, at once.
            refused = await run_session(
                chat_url(server), speech[2][: FRAME_SAMPLES * 3], handshake_timeout_s=10
            )
            assert not refused.handshake and refused.close_code == 1013, refused
            assert "waiting room" in refused.errors[0], refused.errors
            await asyncio.sleep(0.5)
            assert not waiting.handshake.is_set()  # its early audio was dropped, it still waits
            await holder.finish(tail_s=0.1)
            await asyncio.wait_for(waiting.handshake.wait(), 10)
            await wait_until(lambda: waiting.audio_messages >= 5, what="audio for the admitted caller")
        await wait_until(lambda: server.backend.status().free_slots == 1, what="the slot to be free again")
        metrics = await scrape(server)
        assert metrics.value("duplex_waiting_room_total", outcome="admitted") == 1
        assert metrics.value("duplex_waiting_room_total", outcome="full") == 1
        assert metrics.value("duplex_admissions_refused_total", reason="waiting_room_full") == 1
        assert metrics.value("duplex_waiting_sessions") == 0


async def test_waiting_room_timeout_and_leaver(bundle, speech):  # noqa: F811
    async with running_server(bundle, max_sessions=1, waiting_room_s=0.5, waiting_room_size=2) as server:
        holder = LiveClient(chat_url(server), speech[0])
        await holder.open()
        holder.start_streaming()
        try:
            timed_out = await run_session(
                chat_url(server), speech[1][: FRAME_SAMPLES * 3], handshake_timeout_s=20
            )
            assert not timed_out.handshake and timed_out.close_code == 1013, timed_out
            assert "no slot freed within" in timed_out.errors[0], timed_out.errors
            async with kyutai_client(chat_url(server, audio_format=AudioFormat.OPUS), speech[2]):
                await wait_until(lambda: server.backend.admission.waiting == 1, what="the caller to wait")
            await wait_until(
                lambda: server.backend.admission.waiting == 0, what="the leaver to leave the queue"
            )
        finally:
            await holder.finish(tail_s=0.1)
        metrics = await scrape(server)
        assert metrics.value("duplex_waiting_room_total", outcome="timeout") == 1
        assert metrics.value("duplex_admissions_refused_total", reason="wait_timeout") == 1
        assert metrics.value("duplex_waiting_room_total", outcome="left") == 1
