"""The front end over a slot backend, without a model or ZeroMQ (``tests/fake_backend.py``): the refusal
table, the HTTP routes in both phases, a session through the backend, and the defects of issue 21 that live
in the front end (engine loss, upgrades while loading, the slot held after an invalid UTF-8 frame, client
addresses from proxies, waiters per address)."""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
from fake_backend import FakeBackend
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from runtime.config import RuntimeConfig
from runtime.engine.api import REFUSAL_REASONS, Refusal
from runtime.frontend.codecs.protocol import MessageKind
from runtime.frontend.gate.access import Access, RequestView
from runtime.frontend.gate.refusals import (
    ADMISSION_REASONS,
    DRAINING_MESSAGE,
    ENGINE_LOST_MESSAGE,
    REFUSALS,
    RefusalKind,
    SessionRefused,
)
from runtime.frontend.gate.tokens import REFUSAL_STATUS
from runtime.frontend.server import DuplexServer
from runtime.metrics import RuntimeMetrics


def _config(**overrides: object) -> RuntimeConfig:
    overrides.setdefault("auth_mode", "off")
    overrides.setdefault("metrics_cache_s", 0)
    return RuntimeConfig(host="127.0.0.1", port=0, node_id="fake", **overrides)  # type: ignore[arg-type]


@asynccontextmanager
async def fake_node(backend: FakeBackend | None = None, **config: object) -> AsyncIterator[DuplexServer]:
    server = DuplexServer(_config(**config), backend or FakeBackend(), metrics=RuntimeMetrics())
    await server.start()
    try:
        yield server
    finally:
        await server.close()


def _get(server: DuplexServer, path: str, method: str = "GET") -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


async def get(server: DuplexServer, path: str, method: str = "GET") -> tuple[int, dict[str, str], str]:
    return await asyncio.to_thread(_get, server, path, method)


def chat(server: DuplexServer, **params: str) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"format": "pcm", **params}.items())
    return f"ws://127.0.0.1:{server.port}/api/chat?{query}"


# --------------------------------------------------------------------------------------------------
# The refusal table
# --------------------------------------------------------------------------------------------------


def test_every_refusal_keeps_its_status_close_code_and_message():
    """Guards the contract callers rely on (README, the web client's words): each refusal's HTTP status,
    close code after the upgrade and fixed sentence, as they were before the table existed."""
    expected = {
        "missing": RefusalKind(401, 1008),
        "malformed": RefusalKind(401, 1008),
        "expired": RefusalKind(401, 1008),
        "not_yet_valid": RefusalKind(401, 1008),
        "bad_signature": RefusalKind(401, 1008),
        "unknown_key": RefusalKind(401, 1008),
        "wrong_audience": RefusalKind(401, 1008),
        # Issue 34, items 7 and 8: lifetime capped at verify, deny-list, a key of the other kind.
        "lifetime_too_long": RefusalKind(401, 1008),
        "revoked": RefusalKind(401, 1008),
        "wrong_key_kind": RefusalKind(401, 1008),
        "replayed": RefusalKind(403, 1008),
        "wrong_token_kind": RefusalKind(403, 1008),  # an application token on /api/chat (issue 23)
        "wrong_tenant": RefusalKind(403, 1008),  # a tenant claim its key does not sign for (issue 34)
        "insufficient_scope": RefusalKind(403, 1008),  # the sessions API's (issue 23)
        "persona_not_allowed": RefusalKind(403, 1008),
        "origin_not_allowed": RefusalKind(403, 1008),
        "replay_check_unavailable": RefusalKind(503, 1013),
        "rate_limited": RefusalKind(429, 1013),
        "bad_request": RefusalKind(400, 1008),
        "draining": RefusalKind(503, 1013, "node is draining for shutdown; connect to another node"),
        "not_ready": RefusalKind(503, 1013),
        "node_full": RefusalKind(503, 1013),
        "waiting_room_full": RefusalKind(503, 1013),
        "wait_timeout": RefusalKind(503, 1013),
        "engine_lost": RefusalKind(503, 1011, "engine unreachable"),
        # Resume (issue 23): the credential cannot resume a session; the caller starts a new one.
        "resume_off": RefusalKind(
            404, 1008, "this node holds no slot for resume (DUPLEX_RESUME_S=0): start a new session"
        ),
        "resume_invalid": RefusalKind(403, 1008),
        "resume_replayed": RefusalKind(403, 1008),
        "resume_expired": RefusalKind(410, 1008),
        # Issue 34: a resume while the session's owner is still connected and sending.
        "resume_live": RefusalKind(409, 1008),
        # Issue 32: a phone carrier's media stream before its upgrade.
        "carrier_off": RefusalKind(404, 1008, "this node has no bridge for this carrier configured"),
        "carrier_signature": RefusalKind(
            403, 1008, "the carrier's request signature is missing or does not match"
        ),
    }
    assert expected == REFUSALS
    assert set(REFUSAL_STATUS) <= set(REFUSALS) and set(REFUSAL_REASONS) <= set(REFUSALS)
    assert set(ADMISSION_REASONS) - {"ok"} <= set(REFUSALS)
    assert SessionRefused("draining").message == DRAINING_MESSAGE
    assert (
        SessionRefused("engine_lost").kind.close_code == 1011 and ENGINE_LOST_MESSAGE == "engine unreachable"
    )
    with pytest.raises(KeyError):
        SessionRefused("no_such_reason")
    with pytest.raises(ValueError, match="unknown refusal reason 'nope'; one of node_full"):
        Refusal("nope", "x")


# --------------------------------------------------------------------------------------------------
# HTTP routes over the fake backend
# --------------------------------------------------------------------------------------------------


async def test_routes_answer_from_the_backend():
    backend = FakeBackend(slots=2)
    async with fake_node(backend) as server:
        assert backend.started
        assert (await get(server, "/healthz"))[::2] == (200, "ok\n")
        status, _, body = await get(server, "/readyz")
        assert status == 200 and json.loads(body) == {
            "ready": True,
            "reason": "2 of 2 slots free",
            "fake": True,
        }
        status, _, body = await get(server, "/api/personas")
        assert status == 200 and json.loads(body)["voices"] == ["alice"]
        status, _, body = await get(server, "/api/admission?format=pcm&voice_prompt=bob")
        answer = json.loads(body)
        assert (answer["ok"], answer["status"], answer["reason"]) == (False, 400, "bad_request")
        assert "unknown voice prompt 'bob'" in answer["message"]
        status, headers, body = await get(server, "/readyz", method="POST")
        assert status == 405 and headers["Allow"] == "GET"
        status, _, body = await get(server, "/nope")
        assert status == 404 and body.startswith("no route /nope; try /api/chat, /api/admission")


async def test_a_session_runs_through_the_backend_and_gives_its_slot_back():
    backend = FakeBackend(slots=1)
    async with fake_node(backend) as server:
        frame = (np.arange(1920) % 100).astype("<i2")
        async with connect(chat(server)) as client:
            assert await client.recv() == bytes([MessageKind.HANDSHAKE])
            await client.send(bytes([MessageKind.AUDIO]) + frame.tobytes())
            echoed = await client.recv()
            assert echoed[0] == MessageKind.AUDIO
            assert np.array_equal(np.frombuffer(echoed[1:], "<i2"), frame)
            assert backend.status().free_slots == 0
        await _until(lambda: not server.sessions)
        assert backend.released and backend.status().free_slots == 1
        assert backend.requests[0].client == "127.0.0.1"


async def test_the_chat_query_is_parsed_once_per_connection(monkeypatch):
    """Issue 31: the ``/api/chat`` query was parsed three times per connection (the gate, the metadata
    prompt's check, the session plan). Every module that parses it is counted, for a session whose text
    prompt comes as its first message."""
    from runtime.frontend.gate import admission, query
    from runtime.frontend.session import conversation
    from runtime.frontend.transports import websocket

    calls: list[str] = []

    def counting(text):  # type: ignore[no-untyped-def]
        calls.append(text if isinstance(text, str) else "mapping")
        return query.parse_session_query(text)

    for module in (admission, conversation, websocket):
        monkeypatch.setattr(module, "parse_session_query", counting)
    prompt = bytes([MessageKind.METADATA]) + json.dumps({"text_prompt": "Be kind."}).encode()
    async with (
        fake_node(FakeBackend(slots=1)) as server,
        connect(chat(server, text_prompt_in="metadata")) as ws,
    ):
        await ws.send(prompt)
        assert await ws.recv() == bytes([MessageKind.HANDSHAKE])
    assert len(calls) == 1, calls


async def test_a_backend_refusal_closes_with_its_table_code():
    backend = FakeBackend()
    backend.refuse_with = Refusal("wait_timeout", "node full: no slot freed within 3 s")
    async with fake_node(backend) as server, connect(chat(server)) as client:
        error = await client.recv()
        assert error == bytes([MessageKind.ERROR]) + b"node full: no slot freed within 3 s"
        with pytest.raises(ConnectionClosed):
            await client.recv()
        assert client.close_code == 1013


# --------------------------------------------------------------------------------------------------
# Issue 21's defects in the front end
# --------------------------------------------------------------------------------------------------


async def test_upgrades_are_refused_with_503_before_the_upgrade_while_the_engine_loads():
    """Guards issue 21: a worker accepted WebSocket upgrades before its engine was ready (then closed them
    with 1013); the loading phase answers every route as the pre-load server does, /api/chat with 503."""
    backend = FakeBackend(loaded=False)
    async with fake_node(backend) as server:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(chat(server)):
                pass
        assert refused.value.response.status_code == 503
        assert b"loading the model" in refused.value.response.body
        assert (await get(server, "/healthz"))[::2] == (200, "loading\n")
        status, _, body = await get(server, "/readyz")
        assert status == 503 and json.loads(body) == {
            "ready": False,
            "reason": "loading the model",
            "fake": True,
        }
        backend.loaded = True
        async with connect(chat(server)) as client:
            assert await client.recv() == bytes([MessageKind.HANDSHAKE])


async def test_engine_loss_closes_sessions_with_1011_and_fails_healthz_at_once():
    """Guards issue 21: for 5 s after the engine died, /healthz answered 200 and sessions got neither
    audio nor a close. The backend's loss (its on_lost callbacks) closes them with 1011 at once."""
    backend = FakeBackend()
    async with fake_node(backend) as server:
        async with connect(chat(server)) as client:
            assert await client.recv() == bytes([MessageKind.HANDSHAKE])
            backend.lose()
            with pytest.raises(ConnectionClosed):
                while True:
                    await client.recv()
            assert (client.close_code, client.close_reason) == (1011, "engine unreachable")
        status, _, body = await get(server, "/healthz")
        assert (status, body) == (500, "engine unreachable\n")
        assert json.loads((await get(server, "/readyz"))[2])["reason"] == "engine unreachable"


def _masked_frame(opcode: int, payload: bytes) -> bytes:
    """One client frame (RFC 6455, 5.2), masked with a zero key."""
    assert len(payload) < 126
    return struct.pack("!BB", 0x80 | opcode, 0x80 | len(payload)) + b"\x00\x00\x00\x00" + payload


async def test_the_slot_is_released_when_the_server_closes_not_when_the_client_answers():
    """Guards issue 21: after an invalid UTF-8 text frame the server sends a close frame (1007); a client
    that never answers it held the slot until the closing timeout (10 s). The slot is released once the
    server has decided to close, whatever the client does."""
    backend = FakeBackend(slots=1)
    async with fake_node(backend) as server, connect(chat(server)) as client:
        assert await client.recv() == bytes([MessageKind.HANDSHAKE])
        (session,) = server.sessions
        connection = session.transport.connection  # type: ignore[attr-defined]
        client.transport.pause_reading()  # never reads (so never answers) the server's close frame
        client.transport.write(_masked_frame(0x1, b"\xff\xfe"))
        await _until(lambda: bool(backend.released))
        assert connection.close_sent == 1007  # the server decided to close; the client never answered
        assert backend.status().free_slots == 1
        client.transport.abort()


def test_client_address_believes_only_named_proxies_and_only_addresses():
    """Guards issue 21: X-Real-IP was believed verbatim (not even an address) from any private peer."""
    access = Access(_config(), RuntimeMetrics())

    def address(peer: str, **headers: str) -> str:
        return access.client_address(
            RequestView(peer, [(k.replace("_", "-"), v) for k, v in headers.items()], "")
        )

    assert address("127.0.0.1", X_Real_IP="203.0.113.7") == "203.0.113.7"  # the node's nginx
    assert address("10.1.2.3", X_Real_IP="203.0.113.7") == "10.1.2.3"  # private, not named: not believed
    assert address("127.0.0.1", X_Real_IP="evil; drop") == "127.0.0.1"  # not an address: the peer
    assert address("127.0.0.1", X_Forwarded_For="198.51.100.1, 127.0.0.1") == "198.51.100.1"
    assert address("127.0.0.1", X_Forwarded_For="junk, 127.0.0.1") == "127.0.0.1"
    lb = Access(_config(trusted_proxies="130.211.0.0/22,35.191.0.0/16"), RuntimeMetrics())
    view = RequestView("35.191.4.5", [("X-Real-IP", "2001:db8::1")], "")
    assert lb.client_address(view) == "2001:db8::1"


def test_a_worker_process_imports_no_torch():
    """Guards issue 21: every worker imported torch (seconds to start, torch's memory per worker)."""
    code = (
        "import sys, runtime.frontend.worker, runtime.frontend.server, runtime.frontend.engine_client; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'moshi'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


async def _until(predicate, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def test_workers_split_the_node_handshake_limits():
    """Guards issue 21: each worker had the whole node's global handshake bucket (N workers let N times
    the node's limit through); each now holds its share."""
    from runtime.frontend.worker import build_worker, worker_share

    config = _config(workers=2, handshake_rate_global=200, handshake_burst_global=401)
    share = worker_share(config)
    assert (share.handshake_rate_global, share.handshake_burst_global) == (100, 201)
    assert (share.handshake_rate_per_client, share.handshake_burst_per_client) == (10, 30)
    assert worker_share(_config(workers=1)) == _config(workers=1)
    limiter = build_worker(config, "ipc:///nowhere", "worker-0").access.limiter
    assert limiter.per_client_rate == 10 and limiter.per_client_burst == 30


# --------------------------------------------------------------------------------------------------
# Drains: a Spot preemption, and a SIGTERM during it
# --------------------------------------------------------------------------------------------------


async def test_a_drain_asked_for_during_a_drain_joins_it_and_the_earlier_deadline_holds():
    """Guards the preemption drain meeting the SIGTERM drain (issue 20, item 13): before, each ran its own
    loop, the long one went on after the short one had closed everything, and the listener, the backend and
    the store were closed twice. Now the second joins the first: one close, at the earlier deadline."""
    backend = FakeBackend(slots=1)
    async with fake_node(backend) as server:
        async with connect(chat(server)) as client:
            assert await client.recv() == bytes([MessageKind.HANDSHAKE])
            sigterm = asyncio.ensure_future(server.drain(grace_s=3600))
            await _until(lambda: server.draining)
            preempted = asyncio.ensure_future(server.drain(grace_s=0))
            with pytest.raises(ConnectionClosed):
                while True:
                    await client.recv()
            assert client.close_code == 1001
            # A bound on a hang, not a latency: the hour's grace must not be waited out.
            async with asyncio.timeout(30):
                await asyncio.gather(sigterm, preempted)
        assert backend.closes == 1


async def test_a_spot_preemption_drains_the_server():
    """Guards issue 20, item 13 in the server itself: ``instance/preempted`` TRUE makes the server drain
    (``PREEMPTION_GRACE_S``) and close, not merely stop admitting (before, the server passed no
    ``on_preempted``, so live sessions ran on until GCE cut the power)."""
    from test_maintenance import FakeMetadataServer

    metadata = FakeMetadataServer()
    backend = FakeBackend()
    try:
        watch = {"maintenance_watch": "gce", "maintenance_metadata_url": metadata.url}
        async with fake_node(backend, **watch) as server:
            assert not server.draining
            metadata.preempt()
            await _until(lambda: backend.closes == 1, timeout_s=30)
            assert server.draining
    finally:
        metadata.close()


# --------------------------------------------------------------------------------------------------
# The HTTP layer (aiohttp): what callers relied on from websockets' process_request
# --------------------------------------------------------------------------------------------------


async def _raw(port: int, request: bytes) -> bytes:
    """Send ``request`` and read the answer until the server closes the connection (bounded)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    try:
        async with asyncio.timeout(10):
            return await reader.read()
    finally:
        writer.close()


async def test_a_refused_upgrade_is_a_plain_status_and_ends_its_connection():
    """Guards issue 21, item 4: refusals before the upgrade stay plain HTTP statuses with their reason, and
    the connection ends after them (a WebSocket server's habit that clients and nginx rely on). Planted
    bug: a refusal answered keep-alive leaves the caller's read hanging (the read is bounded: it fails)."""
    async with fake_node(
        auth_mode="token", token_replay_check="memory", token_keys='{"k": "' + "s" * 32 + '"}'
    ) as server:
        answer = await _raw(
            server.port,
            b"GET /api/chat?format=pcm HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        )
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401 "), head
        assert b'WWW-Authenticate: Bearer realm="duplex"' in head
        assert body.startswith(b"missing: "), body
        assert not server.sessions and server.backend.status().free_slots == 2


async def test_only_websocket_version_13_is_upgraded():
    """Guards issue 21, item 4: aiohttp also accepts the drafts' versions 7 and 8; this protocol is RFC
    6455's. Planted bug: relying on aiohttp's own check upgrades a version 7 request (101)."""
    async with fake_node() as server:
        for version in (b"7", b"8", b""):
            answer = await _raw(
                server.port,
                b"GET /api/chat?format=pcm HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"Sec-WebSocket-Version: " + version + b"\r\n\r\n",
            )
            assert answer.startswith(b"HTTP/1.1 426 "), (version, answer[:80])
            assert b"Sec-WebSocket-Version: 13" in answer


async def test_oversized_request_lines_and_headers_are_refused_and_the_node_serves_on():
    """Guards issue 21, item 4: a request line or header over the limit (8,190 bytes) is refused with 400,
    never served, and the node goes on answering (planted bug: no limit, the 20 kB URL is routed)."""
    async with fake_node() as server:
        long_url = b"GET /healthz?" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        assert (await _raw(server.port, long_url)).split(b" ", 2)[1] == b"400"
        long_header = (
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 20_000 + b"\r\nConnection: close\r\n\r\n"
        )
        assert (await _raw(server.port, long_header)).split(b" ", 2)[1] == b"400"
        status, _, body = await asyncio.to_thread(_get, server, "/healthz")
        assert status == 200, body


async def test_a_worker_names_itself_in_the_server_header():
    """Guards the workers' ``Server`` header (tests and operators tell workers apart by it)."""
    backend = FakeBackend()
    server = DuplexServer(_config(), backend, metrics=RuntimeMetrics(), worker_id="worker-7")
    await server.start()
    try:
        _, headers, _ = await asyncio.to_thread(_get, server, "/healthz")
        assert headers["Server"] == f"duplex worker-7 pid={os.getpid()}"
    finally:
        await server.close()


async def test_the_frame_is_the_models_as_the_backend_reports_it():
    """Issue 31: ``/api/personas`` gives clients the model's frame from the backend's status; a model whose
    frame the front end's codecs do not carry keeps the node unready, saying both frames, instead of
    serving noise."""
    from runtime.engine.api import FrameFormat

    backend = FakeBackend(slots=2)
    async with fake_node(backend) as server:
        status, _, body = await get(server, "/api/personas")
        assert json.loads(body)["frame"] == {"sample_rate_hz": 24000, "samples": 1920, "ms": 80.0}
        backend.frame = FrameFormat(16_000, 1280)
        status, _, body = await get(server, "/readyz")
        assert status == 503
        assert json.loads(body)["reason"] == (
            "the model's frame (16000 Hz, 1280 samples (80 ms)) is not the one the front end's codecs carry "
            "(24000 Hz, 1920 samples (80 ms))"
        )
        status, _, body = await get(server, "/api/personas")
        assert json.loads(body)["frame"]["samples"] == 1280
