"""What the browser client relies on from the runtime, over real sockets: ``GET /api/admission`` (why a
session would be refused, without spending the token or taking a slot), ``GET /api/personas`` (the node's
voices) and the echo of a client's 0x06 ping (round-trip time).

One server (one slot, token auth with an in-memory replay check, one allowed origin, one voice) serves
the module; servers and helpers come from ``test_server_e2e``, tokens from ``test_access_control``.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlencode

import pytest
import pytest_asyncio
import torch
from test_access_control import KEY, ORIGIN, auth_settings, token
from test_server_e2e import (  # noqa: F401 (bundle, speech: fixtures)
    bundle,
    chat_url,
    live,
    running_server,
    scrape,
    speech,
    wait_until,
)
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from runtime.engine.model_presets import FRAME_SAMPLES
from runtime.engine.persona_limits import TEXT_PROMPT_LIMIT, TEXT_PROMPT_MAX_CHARS, TEXT_PROMPT_MAX_TOKENS
from runtime.frontend.codecs.protocol import MessageKind, encode_metadata, encode_ping
from runtime.frontend.gate.tokens import REFUSAL_STATUS, SUBPROTOCOL_PREFIX, SigningKey
from runtime.frontend.server import ADMISSION_REASONS, DuplexServer
from runtime.tools.loadgen import run_session

pytestmark = pytest.mark.asyncio(loop_scope="module")

VOICE = "bob"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("voices")
    torch.save(torch.randint(0, 2048, (8, 5)), directory / f"{VOICE}.pt")
    return directory


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node(bundle, voices_dir: Path) -> AsyncIterator[DuplexServer]:  # noqa: F811
    """One slot, so that a single session fills it."""
    settings = auth_settings(None, replay="memory")
    async with running_server(bundle, max_sessions=1, voices_dir=voices_dir, **settings) as server:
        yield server


async def get_json(
    server: DuplexServer, path: str, *, headers: dict[str, str] | None = None, **params: object
) -> tuple[int, dict[str, str], dict]:
    """(HTTP status, headers, decoded JSON body) of ``GET path?params`` on the runtime itself."""
    query = urlencode({k: v for k, v in params.items() if v is not None})
    url = f"http://127.0.0.1:{server.port}{path}" + (f"?{query}" if query else "")

    def fetch() -> tuple[int, dict[str, str], dict]:
        request = urllib.request.Request(url, headers=headers or {})
        try:
            with _NO_PROXY.open(request, timeout=10) as response:
                return response.status, dict(response.headers), json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), json.loads(exc.read())

    return await asyncio.to_thread(fetch)


async def admission(server: DuplexServer, token_value: str | None = None, **params: object) -> dict:
    """The admission check's JSON for a session with ``params``, the token as a Bearer header."""
    headers = {"Authorization": f"Bearer {token_value}"} if token_value is not None else {}
    status, response_headers, body = await get_json(
        server, "/api/admission", headers=headers, format="pcm", **params
    )
    assert status == 200 and response_headers["Content-Type"] == "application/json", (status, body)
    assert response_headers["Cache-Control"] == "no-store"
    assert set(body) == {"ok", "status", "reason", "message"}, body
    assert body["reason"] in ADMISSION_REASONS
    return body


@pytest.mark.slow
async def test_an_admitted_token_is_not_spent_by_the_check(node, speech):  # noqa: F811
    value = token()
    for _ in range(2):  # checked twice: still unspent
        assert await admission(node, value) == {
            "ok": True,
            "status": 200,
            "reason": "ok",
            "message": "a session would be admitted: 1 of 1 slots free",
        }
    result = await run_session(chat_url(node), speech[0][: FRAME_SAMPLES * 3], token=value, tail_s=0.1)
    assert result.handshake, result.refusal_reason  # the check did not use the token up
    await wait_until(lambda: node.backend.status().free_slots == 1, what="the slot to be free")
    spent = await admission(node, value)
    assert (spent["ok"], spent["status"], spent["reason"]) == (False, 403, "replayed")
    assert spent["message"].startswith("replayed: token ") and value not in spent["message"]


_REFUSALS = [
    # (reason, the check's arguments, made when the test runs; the status it reports)
    ("missing", lambda: {}, 401),
    ("malformed", lambda: {"token_value": "not.a-jwt"}, 401),
    ("expired", lambda: {"token_value": token(now=time.time() - 600, ttl_s=60)}, 401),
    ("not_yet_valid", lambda: {"token_value": token(now=time.time() + 600)}, 401),
    ("unknown_key", lambda: {"token_value": token(SigningKey("retired", "r" * 32))}, 401),
    ("bad_signature", lambda: {"token_value": token(SigningKey(KEY.kid, "forged-" * 6))}, 401),
    ("wrong_audience", lambda: {"token_value": token(audience="another-node")}, 401),
    ("persona_not_allowed", lambda: {"token_value": token(personas=["alice"]), "voice_prompt": VOICE}, 403),
    ("origin_not_allowed", lambda: {"token_value": token(), "origin": "https://evil.example.net"}, 403),
    ("bad_request", lambda: {"token_value": token(), "audio_temperature": "9"}, 400),
    ("bad_request", lambda: {"token_value": token(), "voice_prompt": "nobody"}, 400),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("reason", "make_case", "status"), _REFUSALS, ids=[f"{r[0]}-{i}" for i, r in enumerate(_REFUSALS)]
)
async def test_each_refusal_is_explained_as_the_session_would_be_refused(node, reason, make_case, status):
    case = make_case()
    before = await scrape(node)
    answer = await admission(node, **case)
    assert (answer["ok"], answer["status"], answer["reason"]) == (False, status, reason), answer
    if reason in REFUSAL_STATUS:  # the upgrade's own body, without its newline
        assert status == REFUSAL_STATUS[reason] and answer["message"].startswith(f"{reason}: ")
    else:
        assert answer["message"].startswith("bad request: "), answer
    if case.get("voice_prompt") == "nobody":
        assert f"voices on this node: {VOICE}" in answer["message"]
    # A check is not a refusal: no counter moves, no slot is taken.
    after = await scrape(node)
    assert after.total("duplex_admissions_refused_total") == before.total("duplex_admissions_refused_total")
    assert node.backend.status().free_slots == 1


@pytest.mark.slow
async def test_origin_comes_from_the_header_or_the_query(node):
    value = token()
    allowed = await admission(node, value, origin=ORIGIN)
    assert allowed["ok"], allowed
    status, _, body = await get_json(
        node,
        "/api/admission",
        headers={"Authorization": f"Bearer {value}", "Origin": "https://evil.example.net"},
        origin=ORIGIN,  # the header wins: a browser's Origin cannot be overridden from the query
    )
    assert (status, body["reason"]) == (200, "origin_not_allowed")
    assert "https://evil.example.net" in body["message"]


@pytest.mark.slow
async def test_token_in_a_lower_case_bearer_header_or_the_query(node):
    _, _, by_header = await get_json(
        node, "/api/admission", headers={"Authorization": f"bearer {token()}"}, format="pcm"
    )
    _, _, by_query = await get_json(node, "/api/admission", token=token(), format="pcm")
    _, _, other_scheme = await get_json(node, "/api/admission", headers={"Authorization": f"Basic {token()}"})
    assert by_header["reason"] == by_query["reason"] == "ok"
    assert other_scheme["reason"] == "missing"


@pytest.mark.slow
async def test_node_full_then_free_again(node, speech):  # noqa: F811
    async with live(chat_url(node, token=token()), speech[0]) as holder:
        assert holder.result.handshake
        holder.start_streaming()
        full = await admission(node, token())
        assert full == {
            "ok": False,
            "status": 503,
            "reason": "node_full",
            "message": "node full: all 1 slots in use (max_sessions=1); try again later",
        }
        await holder.finish()
    await wait_until(lambda: node.backend.status().free_slots == 1, what="the slot to be free")
    assert (await admission(node, token()))["ok"]


@pytest.mark.slow
async def test_draining_node_says_so(bundle, speech):  # noqa: F811
    async with running_server(bundle, **auth_settings(None, replay="memory")) as server:
        async with live(chat_url(server, token=token()), speech[0]) as running:
            running.start_streaming()
            drain = asyncio.create_task(server.drain(grace_s=5))
            await wait_until(lambda: server.draining, what="the drain to start")
            answer = await admission(server, token())
            assert (answer["reason"], answer["status"], answer["ok"]) == ("draining", 503, False)
            assert answer["message"] == "node is draining for shutdown; connect to another node"
            await running.finish()
        await drain


@pytest.mark.slow
async def test_personas_lists_the_nodes_voices(node):
    status, headers, body = await get_json(node, "/api/personas")
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert body == {
        "voices": [VOICE],
        "voices_refused": [],
        "voice_prompt_max_chars": 64,
        "text_prompt_max_chars": TEXT_PROMPT_MAX_CHARS,
        "text_prompt_max_tokens": TEXT_PROMPT_MAX_TOKENS,
        "frame": {"sample_rate_hz": 24000, "samples": 1920, "ms": 80.0},  # the tiny model's Mimi says it
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("text", "got"),
    [
        ("qz " * 1000, "got 3018 tokens (3000 characters)"),  # within the characters, over the tokens
        ("x" * (TEXT_PROMPT_MAX_CHARS + 1), f"got {TEXT_PROMPT_MAX_CHARS + 1} characters"),  # over both
    ],
    ids=["over-tokens", "over-characters"],
)
async def test_the_text_prompt_limit_is_one_sentence_wherever_it_is_checked(node, text, got):
    """The query parser (characters) and session planning (tokens) refuse with the same statement."""
    answer = await admission(node, token(), text_prompt=text)
    assert (answer["ok"], answer["status"], answer["reason"]) == (False, 400, "bad_request"), answer
    assert TEXT_PROMPT_LIMIT in answer["message"] and got in answer["message"], answer["message"]
    within = "Please tell me more about your trip. " * 60  # 2220 characters, 558 tokens
    assert (await admission(node, token(), text_prompt=within.strip()))["ok"]


@pytest.mark.slow
async def test_a_long_prompt_comes_as_metadata_instead_of_in_the_url(node):
    prompt = ("Please tell me more about your trip. " * 100).strip()  # 3699 characters, 923 tokens
    url = chat_url(node, text_prompt_in="metadata")
    async with connect(url, subprotocols=[SUBPROTOCOL_PREFIX + token()], open_timeout=15, proxy=None) as ws:
        await ws.send(encode_metadata({"text_prompt": prompt}))
        assert await asyncio.wait_for(ws.recv(), 60) == bytes([MessageKind.HANDSHAKE])
    await wait_until(lambda: node.backend.status().free_slots == 1, what="the slot to be free")
    async with connect(url, subprotocols=[SUBPROTOCOL_PREFIX + token()], open_timeout=15, proxy=None) as ws:
        await ws.send(encode_ping(b"too early"))  # anything but the metadata first is refused
        error = await asyncio.wait_for(ws.recv(), 15)
        assert error[0] == MessageKind.ERROR and b"the first message must be 0x04 metadata" in error
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 15)
        assert ws.close_code == 1008
    assert node.backend.status().free_slots == 1  # no slot was taken while waiting


@pytest.mark.slow
async def test_a_client_ping_is_echoed(node):
    async with connect(
        chat_url(node), subprotocols=[SUBPROTOCOL_PREFIX + token()], open_timeout=15, proxy=None
    ) as ws:
        assert await asyncio.wait_for(ws.recv(), 15) == bytes([MessageKind.HANDSHAKE])
        for payload in (b"\x07\x00\x00\x00 sent at 1234.5 ms", b""):
            await ws.send(encode_ping(payload))
            # No audio was sent, so the slot does not step: the echo is the next message.
            assert await asyncio.wait_for(ws.recv(), 5) == encode_ping(payload)
