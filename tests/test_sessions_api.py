"""The sessions API, recordings and the events stream (issue 23, items 2-4), over the wire.

A real server (``--workers 0`` and ``--workers 2``) with access control, a real redis-server and a recording
directory: sessions run with session tokens (with and without ``recording_consent``), then an application
backend reads them back with an application token, downloads the recordings (decoded with FFmpeg's
libraries through PyAV), reads the events stream, and erases them. Bad input: a session token on the API
(403), no token (401), a read-only token erasing (403), path traversal and malformed ids (400/404),
unknown sessions and a second erase (404), a live session (409). Waits are for events, never for a time.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import av
import numpy as np
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from test_server_e2e import (  # noqa: F401 (bundle, speech: fixtures)
    WAIT_S,
    WORKER_MODES,
    bundle,
    chat_url,
    running_server,
    speech,
    wait_until,
)

from runtime.frontend.codecs.protocol import AudioFormat
from runtime.frontend.gate.app_tokens import SCOPE_READ, mint_app_token
from runtime.frontend.gate.tokens import SigningKey, mint_token
from runtime.frontend.server import DuplexServer
from runtime.tools.loadgen import run_session
from runtime.tools.local_redis import RedisServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

AUDIENCE = "sessions-api-test"
KEY = SigningKey("api", "a" * 32)
APP_KEY = SigningKey("api-app", "c" * 32)  # application tokens have keys of their own (issue 34, item 8)
FRAME_S = 0.08


def app_token(**kw: Any) -> str:
    return mint_app_token(APP_KEY, ttl_s=300, audience=AUDIENCE, **kw)


def session_token(**kw: Any) -> str:
    return mint_token(KEY, ttl_s=120, personas=["*"], audience=AUDIENCE, **kw)


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=WORKER_MODES)
async def api_node(
    request: pytest.FixtureRequest,
    bundle,  # noqa: F811
    module_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[DuplexServer]:
    settings = {
        "auth_mode": "token",
        "token_keys": json.dumps({KEY.kid: KEY.secret.decode()}),
        "app_token_keys": json.dumps({APP_KEY.kid: APP_KEY.secret.decode()}),
        "token_audience": AUDIENCE,
        "token_replay_check": "redis",
        "recording_dir": tmp_path_factory.mktemp("recordings"),
        "recording_sweep_s": 0.2,
    }
    async with running_server(
        bundle, workers=request.param, redis_url=module_redis.url, **settings
    ) as server:
        yield server


def recording_dir(server: DuplexServer) -> Path:
    directory = server.config.recording_dir
    assert directory is not None
    return Path(directory)


async def api(
    server: DuplexServer, path: str, *, token: str | None = None, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{server.port}{path}"
        async with http.request(method, url, headers=headers) as answer:
            return answer.status, dict(answer.headers), await answer.read()


async def raw_get(server: DuplexServer, target: str, token: str) -> tuple[int, bytes]:
    """One request with ``target`` sent byte for byte (no client normalises its dots or escapes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    request = (
        f"GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
    )
    writer.write(request.encode())
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), WAIT_S)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def ended_session(server: DuplexServer, session_ids: set[str]) -> dict[str, Any]:
    """The one session not in ``session_ids`` once the API shows it ended (the store writes in the
    background)."""
    found: dict[str, Any] = {}

    async def look() -> bool:
        status, _, body = await api(server, "/api/sessions?state=ended", token=app_token())
        assert status == 200, body
        new = [s for s in json.loads(body)["sessions"] if s["id"] not in session_ids]
        if new:
            found.update(new[0])
        return bool(new)

    deadline = time.monotonic() + WAIT_S
    while not await look():
        assert time.monotonic() < deadline, "the session did not show up as ended in the sessions API"
        await asyncio.sleep(0.05)
    return found


async def known_ids(server: DuplexServer) -> set[str]:
    status, _, body = await api(server, "/api/sessions?limit=1000", token=app_token())
    assert status == 200, body
    return {s["id"] for s in json.loads(body)["sessions"]}


def decoded_seconds(data: bytes, path: Path) -> float:
    """Seconds of audio in an Ogg Opus file, decoded by FFmpeg's libraries (PyAV)."""
    path.write_bytes(data)
    samples, rate = 0, 48000
    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        assert stream.codec_context.name == "opus"
        for frame in container.decode(stream):
            samples += frame.samples
            rate = frame.sample_rate
    return samples / rate


@pytest.mark.parametrize("audio_format", [AudioFormat.OPUS, AudioFormat.PCM], ids=["opus", "pcm"])
async def test_a_consenting_session_is_read_back_recorded_and_erased(
    api_node: DuplexServer,
    speech: list[np.ndarray],  # noqa: F811
    module_redis: RedisServer,
    audio_format: AudioFormat,
    tmp_path: Path,
) -> None:
    server = api_node
    before = await known_ids(server)
    clip = speech[0]
    url = chat_url(server, audio_format=audio_format, voice_prompt=None)
    result = await run_session(
        url, clip, audio_format=audio_format, token=session_token(recording_consent=True)
    )
    assert result.handshake, (result.errors, result.http_status, result.http_body)
    listed = await ended_session(server, before)
    sid = listed["id"]
    assert listed["state"] == "ended" and listed["outcome"] == "client_closed" and listed["recording"] is True
    assert listed["format"] == audio_format.value

    # Read one: timings, outcome, the transcript with its timestamps (what the client was sent).
    status, _, body = await api(server, f"/api/sessions/{sid}", token=app_token(scopes=[SCOPE_READ]))
    assert status == 200, body
    session = json.loads(body)
    assert session["started_at"] < session["ended_at"] <= time.time()
    assert session["duration_s"] == pytest.approx(session["ended_at"] - session["started_at"], abs=0.01)
    transcript = session["transcript"]
    assert result.text and transcript["text"].startswith(result.text)
    assert "".join(seg["text"] for seg in transcript["segments"]) == transcript["text"]
    offsets = [seg["start_s"] for seg in transcript["segments"]]
    assert (
        offsets == sorted(offsets)
        and offsets[0] >= 0
        and transcript["segments"][-1]["end_s"] <= session["duration_s"]
    )

    # The events stream: started, the text pieces in order, ended with the outcome.
    client = aioredis.Redis.from_url(module_redis.url, decode_responses=True)
    try:
        events = [f for _, f in await client.xrange("duplex:events") if f["session"] == sid]
    finally:
        await client.aclose()
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "started" and kinds[-1] == "ended" and set(kinds[1:-1]) == {"text"}
    assert events[0]["recording"] == "1" and events[-1]["reason"] == "client_closed"
    assert "".join(e["text"] for e in events if e["kind"] == "text") == transcript["text"]
    assert len({e["event"] for e in events}) == len(events)

    # Both recordings decode (FFmpeg, via PyAV) and last as long as the audio each side streamed.
    seconds = {}
    for side in ("caller", "agent"):
        status, headers, data = await api(server, f"/api/sessions/{sid}/recording/{side}", token=app_token())
        assert status == 200, data
        assert headers["Content-Type"] == "audio/ogg; codecs=opus"
        seconds[side] = decoded_seconds(data, tmp_path / f"{side}.opus")
    assert seconds["caller"] == pytest.approx(result.frames_sent * FRAME_S, abs=0.2)
    assert 0 < seconds["agent"] <= session["duration_s"]
    if audio_format is AudioFormat.PCM:  # PCM counts samples: the agent side holds every one sent
        assert seconds["agent"] == pytest.approx(result.audio_samples / 24000, abs=0.2)
    scrape = server.render_metrics().decode()
    assert 'duplex_recordings_total{side="caller"}' in scrape and "duplex_recording_bytes_total" in scrape

    # Erase: a read-only token may not; then 204, everything gone; a second erase is 404.
    status, _, body = await api(
        server, f"/api/sessions/{sid}", token=app_token(scopes=[SCOPE_READ]), method="DELETE"
    )
    assert status == 403 and json.loads(body)["error"] == "insufficient_scope"
    status, _, _ = await api(server, f"/api/sessions/{sid}", token=app_token(), method="DELETE")
    assert status == 204
    # Only the erase marker is left (no audio): a recorder finishing on another pod deletes its files.
    assert [p.name for p in recording_dir(server).iterdir() if p.name.startswith(sid)] == [f"{sid}.erased"]
    for path in (f"/api/sessions/{sid}", f"/api/sessions/{sid}/recording/caller"):
        status, _, body = await api(server, path, token=app_token())
        assert status == 404 and json.loads(body)["error"] == "unknown_session", body
    status, _, body = await api(server, f"/api/sessions/{sid}", token=app_token(), method="DELETE")
    assert status == 404 and "erased" in json.loads(body)["message"]
    assert sid not in await known_ids(server)
    client = aioredis.Redis.from_url(module_redis.url, decode_responses=True)
    try:
        assert not [f for _, f in await client.xrange("duplex:events") if f["session"] == sid]
        assert not await client.exists(
            f"duplex:lines:{sid}", f"duplex:transcript:{sid}", f"duplex:session:{sid}"
        )
    finally:
        await client.aclose()


async def test_no_consent_no_recording_and_live_sessions_cannot_be_erased(
    api_node: DuplexServer,
    speech: list[np.ndarray],  # noqa: F811
) -> None:
    server = api_node
    before = await known_ids(server)
    url = chat_url(server, audio_format=AudioFormat.PCM)
    task = asyncio.create_task(run_session(url, speech[1], token=session_token()))
    await wait_until(lambda: bool(server.sessions), timeout_s=WAIT_S, what="the session to start")
    live_id = next(iter(server.sessions)).session_id

    async def registered() -> bool:
        status, _, body = await api(server, f"/api/sessions/{live_id}", token=app_token())
        return status == 200

    deadline = time.monotonic() + WAIT_S
    while not await registered():
        assert time.monotonic() < deadline, "the live session never reached the store"
        await asyncio.sleep(0.05)
    status, _, body = await api(server, f"/api/sessions/{live_id}", token=app_token(), method="DELETE")
    assert status == 409 and json.loads(body)["error"] == "session_live"
    status, _, body = await api(server, "/api/sessions?state=active", token=app_token())
    assert live_id in {s["id"] for s in json.loads(body)["sessions"]}
    result = await task
    assert result.handshake
    listed = await ended_session(server, before)
    assert listed["id"] == live_id and listed["recording"] is False
    status, _, body = await api(server, f"/api/sessions/{live_id}/recording/agent", token=app_token())
    assert status == 404 and json.loads(body)["error"] == "no_recording"
    assert not [p for p in recording_dir(server).iterdir() if p.name.startswith(live_id)]


async def test_tokens_and_bad_paths_are_refused(api_node: DuplexServer) -> None:
    server = api_node
    unknown = "0123456789abcdef0123456789abcdef"
    # No token: 401 with a Bearer challenge; a session token: 403; a forged one: 401.
    status, headers, body = await api(server, "/api/sessions")
    assert (
        status == 401
        and json.loads(body)["error"] == "missing"
        and headers["WWW-Authenticate"].startswith("Bearer")
    )
    status, _, body = await api(server, "/api/sessions", token=session_token())
    assert status == 403 and json.loads(body)["error"] == "wrong_token_kind", body
    forged = mint_app_token(SigningKey(APP_KEY.kid, "b" * 32), ttl_s=60, audience=AUDIENCE)
    status, _, body = await api(server, "/api/sessions", token=forged)
    assert status == 401 and json.loads(body)["error"] == "bad_signature"
    # An application token cannot open a session.
    result = await run_session(chat_url(server), np.zeros(1920, np.float32), token=app_token(), tail_s=0)
    assert result.http_status == 403 and "wrong_token_kind" in (result.http_body or "")
    # Unknown session: 404; malformed ids and traversal: 400 before any lookup, or no route at all.
    status, _, body = await api(server, f"/api/sessions/{unknown}", token=app_token())
    assert status == 404 and json.loads(body)["error"] == "unknown_session"
    for target in (
        "/api/sessions/..%2F..%2Fetc%2Fpasswd",
        "/api/sessions/%2e%2e",
        f"/api/sessions/{unknown.upper()}",
        f"/api/sessions/{unknown}0",
        "/api/sessions/0123-4567",
        f"/api/sessions/{unknown}/recording/both",
    ):
        status, body = await raw_get(server, target, app_token())
        assert status == 400, (target, status, body)
        assert json.loads(body)["error"] in ("bad_session_id", "bad_side"), body
    for target in (
        "/api/sessions/../../etc/passwd",
        f"/api/sessions/{unknown}/x/y",
        f"/api/sessions/{unknown}/recording/..%2F..%2Fx",
    ):
        status, body = await raw_get(server, target, app_token())
        assert status in (400, 404), (target, status, body)
        assert b"root:" not in body
    # "%C2%B2" is "²", which str.isdigit() takes and int() does not: it answered 500 (issue 34, item 11).
    for limit in ("0", "%C2%B2", "%D9%A3", "1e3", "-1", "10000000"):
        status, _, body = await api(server, f"/api/sessions?limit={limit}", token=app_token())
        assert status == 400 and "limit" in json.loads(body)["message"], (limit, status, body)
    status, _, body = await api(server, "/api/sessions?state=gone", token=app_token())
    assert status == 400 and "state" in json.loads(body)["message"]
    status, headers, _ = await api(server, "/api/sessions", token=app_token(), method="POST")
    assert status == 405 and headers["Allow"] == "GET"
    # The node still serves sessions after all that.
    result = await run_session(chat_url(server), np.zeros(1920 * 5, np.float32), token=session_token())
    assert result.handshake


async def test_the_sweep_deletes_recordings_past_the_retention(api_node: DuplexServer) -> None:
    server = api_node
    directory = recording_dir(server)
    old = directory / ("f" * 32 + ".caller.opus")
    part = directory / ("e" * 32 + ".agent.opus.part")
    fresh = directory / ("d" * 32 + ".agent.opus")
    for path in (old, part, fresh):
        path.write_bytes(b"OggS")
    past = time.time() - server.config.transcript_ttl_s - 10
    os.utime(old, (past, past))
    os.utime(part, (past, past))
    await wait_until(lambda: not old.exists() and not part.exists(), timeout_s=WAIT_S, what="the sweep")
    assert fresh.exists()
    fresh.unlink()
    assert "duplex_recordings_swept_total" in server.render_metrics().decode()


async def test_the_api_through_the_local_nodes_nginx(api_node: DuplexServer, tmp_path: Path) -> None:
    """The local profile's rendered nginx (TLS) in front of the server: the API passes with its
    Authorization header, refusals keep their status, methods other than GET and DELETE stop at nginx, and a
    dotted path is normalised by nginx before any location matches."""
    from nginx_front import start_nginx

    from infra.node.bundle.nginx import render_nginx
    from infra.node.local.node import free_port_profile

    server = api_node
    profile = free_port_profile()
    profile = profile.model_copy(update={"ports": profile.ports.model_copy(update={"runtime": server.port})})
    process, context, base = start_nginx(profile, tmp_path, render_nginx(profile))

    async def call(path: str, token: str | None = None, method: str = "GET") -> tuple[int, bytes]:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        async with (
            aiohttp.ClientSession() as http,
            http.request(method, base + path, headers=headers, ssl=context) as answer,
        ):
            return answer.status, await answer.read()

    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                status, body = await call("/api/sessions", app_token())
                break
            except aiohttp.ClientConnectionError:
                assert process.poll() is None, (tmp_path / "logs" / "error.log").read_text()
                assert time.monotonic() < deadline, "nginx did not start"
                await asyncio.sleep(0.1)
        assert status == 200 and "sessions" in json.loads(body)
        assert (await call("/api/sessions"))[0] == 401
        assert (await call("/api/sessions", session_token()))[0] == 403
        status, body = await call("/api/sessions/" + "ab" * 16, app_token(), method="DELETE")
        assert status == 404 and json.loads(body)["error"] == "unknown_session"
        assert (await call("/api/sessions", app_token(), method="POST"))[0] == 403  # limit_except
        status, body = await call("/api/sessions/bad-id", app_token())
        assert status == 400 and json.loads(body)["error"] == "bad_session_id"
    finally:
        process.terminate()
        process.wait(10)


async def test_redis_down_answers_503_and_the_api_comes_back(
    api_node: DuplexServer, module_redis: RedisServer
) -> None:
    server = api_node
    module_redis.stop(save=True)
    try:
        status, headers, body = await api(server, "/api/sessions", token=app_token())
        assert status == 503 and json.loads(body)["error"] == "store_unavailable"
        assert headers["Retry-After"] == "1"
    finally:
        module_redis.start()
    status, _, body = await api(server, "/api/sessions", token=app_token())
    assert status == 200, body
