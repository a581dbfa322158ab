"""Access control over the wire: session tokens checked before the WebSocket upgrade, the origin
allow-list, single use across a runtime restart (Redis), key rotation, the subprotocol path, a token's
session limit, and a handshake flood cut by the local node's nginx.

Each refusal is checked as a deployed node is used: the refused caller's HTTP status and reason, the
``duplex_admissions_refused_total{reason}`` counter, no slot taken, and a session running alongside that
keeps receiving audio after the refusal, every frame accounted for. Servers and helpers come from
``test_server_e2e``; as there, the tests wait for events, never for a time (issue 25, item 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from test_server_e2e import (  # noqa: F401 (bundle, speech: fixtures)
    SLOTS,
    WAIT_S,
    WORKER_MODES,
    assert_healthy,
    bundle,
    chat_url,
    live,
    running_server,
    scrape,
    speech,
    wait_until,
)
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from infra.node.local.node import LocalNode, free_port_profile, missing_binaries
from runtime.engine.model_presets import FRAME_SAMPLES
from runtime.frontend.gate.tokens import SUBPROTOCOL_PREFIX, SigningKey, mint_token
from runtime.frontend.server import DuplexServer
from runtime.tools.loadgen import run_session, session_url
from runtime.tools.local_redis import RedisServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

AUDIENCE = "access-test-node"
KEY = SigningKey("current", "c" * 32)
ORIGIN = "https://app.example.com"


def token(key: SigningKey = KEY, **overrides: object) -> str:
    args: dict = {"ttl_s": 120, "personas": ["*"], "audience": AUDIENCE, **overrides}
    return mint_token(key, **args)


def auth_settings(redis_url: str | None, *keys: SigningKey, replay: str = "redis") -> dict[str, object]:
    return {
        "redis_url": redis_url,
        "auth_mode": "token",
        "token_keys": json.dumps({k.kid: k.secret.decode() for k in keys or (KEY,)}),
        "token_audience": AUDIENCE,
        "token_replay_check": replay,
        "allowed_origins": [ORIGIN],
    }


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=WORKER_MODES)
async def guarded(request, bundle, module_redis: RedisServer) -> AsyncIterator[DuplexServer]:  # noqa: F811
    """One server with access control on (token, Redis replay check, one allowed origin), in each mode
    (``--workers 0`` and ``--workers 2``)."""
    settings = auth_settings(module_redis.url)
    async with running_server(bundle, workers=request.param, **settings) as server:
        yield server


async def attempt(
    url: str, *, token_value: str | None = None, origin: str | None = None, via: str = "query"
) -> tuple[int, str, dict[str, str]]:
    """One handshake: (HTTP status, body, response headers); 101 when upgraded (then closed at once)."""
    subprotocols = None
    if token_value is not None and via == "subprotocol":
        subprotocols = [SUBPROTOCOL_PREFIX + token_value]
    elif token_value is not None:
        url = f"{url}&token={token_value}"
    try:
        ws = await connect(url, origin=origin, subprotocols=subprotocols, open_timeout=15, proxy=None)
    except InvalidStatus as exc:
        response = exc.response
        return response.status_code, response.body.decode(), dict(response.headers.raw_items())
    await ws.close()
    return 101, "", {}


@contextlib.asynccontextmanager
async def neighbour(server: DuplexServer, pcm: np.ndarray) -> AsyncIterator:
    """A healthy session with a valid token, streaming alongside; the test calls ``finish`` on it."""
    async with live(chat_url(server, token=token()), pcm) as client:
        assert client.result.handshake, (client.result.errors, client.result.close_code)
        client.start_streaming()
        await client.wait_audio(1)
        yield client


_REFUSALS: list[tuple[str, Callable[[], dict], int]] = [
    # (reason, the attempt's arguments: minted when the test runs, HTTP status)
    ("missing", lambda: {}, 401),
    ("malformed", lambda: {"token_value": "not.a-jwt"}, 401),
    ("expired", lambda: {"token_value": token(now=time.time() - 600, ttl_s=60)}, 401),
    ("bad_signature", lambda: {"token_value": token(SigningKey(KEY.kid, "forged-" * 6))}, 401),
    ("not_yet_valid", lambda: {"token_value": token(now=time.time() + 600)}, 401),
    ("unknown_key", lambda: {"token_value": token(SigningKey("retired", "r" * 32))}, 401),
    ("wrong_audience", lambda: {"token_value": token(audience="another-node")}, 401),
    ("persona_not_allowed", lambda: {"token_value": token(personas=["alice"]), "voice": "bob"}, 403),
    ("origin_not_allowed", lambda: {"token_value": token(), "origin": "https://evil.example.net"}, 403),
    ("replayed", lambda: {"replay": True}, 403),
]


@pytest.mark.slow
@pytest.mark.parametrize(("reason", "make_case", "status"), _REFUSALS, ids=[r[0] for r in _REFUSALS])
async def test_each_refusal_before_the_upgrade(guarded, speech, reason, make_case, status):  # noqa: F811
    server = guarded
    case = make_case()
    url = chat_url(server, voice_prompt=case.pop("voice", None))
    if case.pop("replay", False):
        spent = token()
        first = await run_session(chat_url(server, token=spent), speech[2][: FRAME_SAMPLES * 3], tail_s=0.1)
        assert first.handshake, first.refusal_reason
        case["token_value"] = spent
        await wait_until(lambda: server.backend.status().free_slots == SLOTS, what="the first use's slot")
    before = await scrape(server)
    async with neighbour(server, speech[0]) as healthy:
        free_before = server.backend.status().free_slots
        got, body, headers = await attempt(url, **case)
        assert server.backend.status().free_slots == free_before == SLOTS - 1  # no slot taken, none released
        mark = time.monotonic()
        await healthy.wait_audio(after=mark)
        await healthy.finish()
    assert (got, body.split(":")[0]) == (status, reason), body
    assert body.endswith("\n") and len(body) > len(reason) + 5
    if status == 401:
        assert headers.get("WWW-Authenticate", "").startswith('Bearer realm="duplex"'), headers
    assert_healthy(healthy, after=mark, label="neighbour")
    after = await scrape(server)
    assert after.value("duplex_admissions_refused_total", reason=reason) == (
        before.value("duplex_admissions_refused_total", reason=reason) + 1
    )
    assert (
        after.total("duplex_admissions_refused_total") == before.total("duplex_admissions_refused_total") + 1
    )
    assert after.value("duplex_sessions_started_total") == before.value("duplex_sessions_started_total") + 1


@pytest.mark.slow
async def test_valid_tokens_from_an_allowed_origin_or_none_open_sessions(guarded, speech):  # noqa: F811
    server = guarded
    assert (await attempt(chat_url(server), token_value=token(), origin=ORIGIN))[0] == 101
    assert (await attempt(chat_url(server), token_value=token(), origin=ORIGIN + "/"))[0] == 101
    assert (await attempt(chat_url(server), token_value=token()))[0] == 101  # no Origin: not a browser
    allowed = token(personas=["alice", "bob"])
    assert (await attempt(chat_url(server, voice_prompt="bob"), token_value=allowed))[0] != 403
    await wait_until(lambda: server.backend.status().free_slots == SLOTS, what="the slots to be free")


@pytest.mark.slow
async def test_subprotocol_token_is_selected_by_the_server(guarded, speech):  # noqa: F811
    server = guarded
    value = token()
    async with connect(
        chat_url(server), subprotocols=["duplex.v1", SUBPROTOCOL_PREFIX + value], open_timeout=15, proxy=None
    ) as ws:
        assert ws.subprotocol == SUBPROTOCOL_PREFIX + value  # a browser fails the handshake otherwise
        assert ws.response.headers["Sec-WebSocket-Protocol"] == SUBPROTOCOL_PREFIX + value
        assert await asyncio.wait_for(ws.recv(), 15) == b"\x00"
    # The reference client presents its token the same way by default, and the token is spent by it.
    result = await run_session(chat_url(server), speech[1][: FRAME_SAMPLES * 10], token=token())
    assert result.handshake and result.audio_messages > 0, result.refusal_reason
    assert (await attempt(chat_url(server), token_value=value, via="subprotocol"))[:1] == (403,)
    await wait_until(lambda: server.backend.status().free_slots == SLOTS, what="the slots to be free")


@pytest.mark.slow
async def test_token_session_limit_closes_the_session(guarded, speech):  # noqa: F811
    """The token's ``max_session_s`` (1.5 s, under the node's hour) ends the session: the node names the
    token's limit, closes normally with ``max_session_length``, and not before the limit had passed.

    The lower bound is an ordering on one clock: the node starts the session's timer after the connection
    opened, and ``opened`` is read before it, so a slower machine only closes it later. No upper bound: a
    limit not applied would leave the session open (the wait's timeout then fails the test), and the
    message says which limit fired."""
    server = guarded
    opened = time.monotonic()
    async with live(chat_url(server, token=token(max_session_s=1.5)), np.concatenate(speech)) as client:
        assert client.result.handshake
        client.start_streaming()
        result = await client.wait_closed(timeout_s=WAIT_S)
    closed_after = time.monotonic() - opened
    assert closed_after >= 1.5, f"closed {closed_after:.2f} s after the connection, before the token's 1.5 s"
    assert result.errors == ["session reached max_session_s=1.5 (the token's limit)"], result.errors
    assert result.close_code == 1000 and result.close_reason == "max_session_length"
    assert result.audio_messages > 0  # it was served until then
    assert client.result.frames_sent > 0
    metrics = await scrape(server)
    assert metrics.value("duplex_sessions_ended_total", reason="max_session_length") >= 1


@pytest.mark.slow
async def test_replay_is_refused_across_a_restart_and_redis_down_fails_closed(bundle, speech, redis_server):  # noqa: F811
    used = token()
    async with running_server(bundle, **auth_settings(redis_server.url)) as first:
        result = await run_session(chat_url(first), speech[0][: FRAME_SAMPLES * 5], token=used, tail_s=0.1)
        assert result.handshake, result.refusal_reason
    async with running_server(bundle, **auth_settings(redis_server.url)) as second:  # a new process's state
        status, body, _ = await attempt(chat_url(second), token_value=used)
        assert (status, body.split(":")[0]) == (403, "replayed"), body
        assert used.split(".")[1] not in body  # the token itself is not echoed
        assert (await scrape(second)).value("duplex_admissions_refused_total", reason="replayed") == 1

        # Redis down: DUPLEX_TOKEN_REPLAY_CHECK=redis refuses new sessions (503) and keeps running ones.
        async with neighbour(second, speech[1]) as healthy:
            await asyncio.to_thread(redis_server.stop)
            mark = time.monotonic()
            status, body, _ = await attempt(chat_url(second), token_value=token())
            assert (status, body.split(":")[0]) == (503, "replay_check_unavailable"), body
            await healthy.wait_audio(after=mark)  # the running session goes on without Redis
            await healthy.finish()
        assert_healthy(healthy, after=mark, label="neighbour")
        metrics = await scrape(second)
        assert metrics.value("duplex_admissions_refused_total", reason="replay_check_unavailable") == 1
        assert metrics.value("duplex_redis_errors_total", op="token_replay_check") >= 1
    # redis-or-memory: fails open to the process's memory, which still refuses a replay.
    async with running_server(bundle, **auth_settings(redis_server.url, replay="redis-or-memory")) as third:
        fresh = token()
        assert (await attempt(chat_url(third), token_value=fresh))[0] == 101
        assert (await attempt(chat_url(third), token_value=fresh))[:1] == (403,)


@pytest.mark.slow
async def test_key_rotation(bundle, speech):  # noqa: F811
    old, new = SigningKey("2024-q4", "o" * 32), SigningKey("2025-q1", "n" * 32)
    async with running_server(bundle, **auth_settings(None, old, new, replay="memory")) as both:
        for key in (old, new):
            result = await run_session(
                chat_url(both), speech[0][: FRAME_SAMPLES * 3], token=token(key), tail_s=0.1
            )
            assert result.handshake, (key.kid, result.refusal_reason)
    async with running_server(bundle, **auth_settings(None, new, replay="memory")) as only_new:
        status, body, _ = await attempt(chat_url(only_new), token_value=token(old))
        assert (status, body.split(":")[0]) == (401, "unknown_key") and "2024-q4" in body, body
        assert (await attempt(chat_url(only_new), token_value=token(new)))[0] == 101


@pytest.mark.slow
async def test_access_control_off_admits_without_token_but_checks_origins(bundle):  # noqa: F811
    async with running_server(bundle, allowed_origins=[ORIGIN]) as open_server:  # auth_mode off
        assert (await attempt(chat_url(open_server)))[0] == 101
        assert (await attempt(chat_url(open_server), origin="https://evil.example.net"))[0] == 403


# --- the edge: a handshake flood through the local node's nginx --------------------------------------------

_FLOOD = r"""
import json, socket, ssl, sys
from concurrent.futures import ThreadPoolExecutor
host, port, cafile, attempts = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
context = ssl.create_default_context(cafile=cafile)
request = (
    "GET /api/chat?format=pcm HTTP/1.1\r\nHost: {h}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
).format(h=host).encode()
def knock(_):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname=host) as tls:
                tls.sendall(request)
                return int(tls.recv(64).split(b" ")[1])
    except Exception as exc:
        return type(exc).__name__
with ThreadPoolExecutor(4) as pool:
    statuses = list(pool.map(knock, range(attempts)))
counts = {}
for s in statuses:
    counts[str(s)] = counts.get(str(s), 0) + 1
print(json.dumps(counts))
"""


@pytest.mark.slow
@pytest.mark.skipif(bool(missing_binaries()), reason=f"missing system binaries: {missing_binaries()}")
async def test_handshake_flood_is_cut_by_nginx_and_sessions_keep_their_audio(tmp_path: Path, speech):  # noqa: F811
    """Two sessions stream through the node's TLS edge while 300 handshakes hit it: nginx cuts the flood,
    and the sessions' audio goes on after it, to a normal close. Events, not times: the flood starts once
    both sessions get audio, and they end once they got audio after it. (How much a flood delays audio is
    a latency, measured by ``duplex loadgen``'s lost frames: docs/benchmarks.md.)"""
    node = LocalNode(tmp_path / "node", free_port_profile())
    await asyncio.to_thread(node.start)
    try:
        limits = node.profile.limits
        url = session_url(node.wss_url)

        async def flood() -> dict[str, int]:
            args = [node.profile.domain, str(node.profile.ports.https), str(node.certificate_path), "300"]
            done = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", _FLOOD, *args],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout)

        async with contextlib.AsyncExitStack() as stack:
            sessions = [
                await stack.enter_async_context(
                    live(url, pcm, ssl_context=node.ssl_context(), token=node.mint_token())
                )
                for pcm in speech[:2]
            ]
            for session in sessions:
                assert session.result.handshake, session.result.errors
                session.start_streaming()
            for session in sessions:
                await session.wait_audio()  # the sessions are streaming
            started = time.monotonic()
            counts = await flood()
            flood_s = time.monotonic() - started  # an upper bound on the flood's own duration
            mark = time.monotonic()
            for session in sessions:
                await session.wait_audio(after=mark)  # their audio goes on after the flood
            await asyncio.gather(*(session.finish() for session in sessions))
        assert sum(counts.values()) == 300, counts
        # Most attempts stop at nginx; the rest (the burst, then the rate) reach the runtime, which
        # refuses them for having no token (or nginx's per-client session cap answers first).
        assert counts.get("429", 0) >= 250, counts
        assert set(counts) <= {"429", "401", "503"}, counts
        passed = counts.get("401", 0) + counts.get("503", 0)
        assert passed <= limits.handshake_burst + limits.handshakes_per_second_per_client * flood_s + 2, (
            counts
        )
        for i, session in enumerate(sessions):
            assert_healthy(session, after=mark, label=f"session {i}")  # served to a normal close
        statuses = re.findall(
            r'"GET /api/chat" (\d{3}) ', (node.node_dir / "logs" / "access.log").read_text()
        )
        assert statuses.count("429") == counts["429"]  # logged without the query string
    finally:
        await asyncio.to_thread(node.stop)
