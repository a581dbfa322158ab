"""Every refusal the gate and the session make before a slot, on every route that opens a session (issue
31): ``/api/chat`` and ``POST /api/rtc``, each as a new session and as a resume (a resume credential
presented). For each: the answer (the HTTP status before the upgrade; after it, the 0x05 text and the close
code), the reason it names, and the one counter that moved: +1 in exactly one of
``duplex_admissions_refused_total`` (a new session) and ``duplex_resume_refused_total`` (a resume), by
reason, and nothing else in either (docs/runtime.md, "Resume": each refusal counts once, where it belongs).

Before the one ``admit()`` (``runtime.frontend.gate.admission``), a WebRTC resume refused by the rate limit
or the origin counted in ``duplex_admissions_refused_total``: the ``rtc-resume`` rows of those reasons
failed. Over the fake backend (``tests/fake_backend.py``): no model, no timing assertions.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from fake_backend import FakeBackend
from test_frontend_seam import fake_node
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from runtime.engine.api import RESUME_REFUSAL_REASONS, Refusal
from runtime.frontend.codecs.protocol import MessageKind
from runtime.frontend.gate.query import RESUME_HEADER, RESUME_SUBPROTOCOL_PREFIX
from runtime.frontend.gate.refusals import REFUSALS
from runtime.frontend.gate.tokens import SigningKey, mint_token
from runtime.frontend.server import DuplexServer
from runtime.tools.rtc_client import RtcCall, encode_packets

pytestmark = pytest.mark.asyncio(loop_scope="module")

AUDIENCE = "gate-test"
KEY = SigningKey("current", "g" * 32)
ORIGIN = "https://app.example.com"
CREDENTIAL = "0123456789abcdef0123456789abcdef." + "A" * 43
COUNTERS = ("duplex_admissions_refused_total", "duplex_resume_refused_total")
ROUTES = ("chat", "chat-resume", "rtc", "rtc-resume")


# Minted when the module is collected, used minutes later in a full run: an hour, not two minutes.
def token(key: SigningKey = KEY, **overrides: object) -> str:
    args: dict = {"ttl_s": 3600, "personas": ["*"], "audience": AUDIENCE, **overrides}
    return mint_token(key, **args)


TOKEN_MODE: dict[str, object] = {
    "auth_mode": "token",
    "token_keys": json.dumps({KEY.kid: KEY.secret.decode()}),
    "token_audience": AUDIENCE,
    "token_replay_check": "memory",
    "allowed_origins": [ORIGIN],
}
TIGHT = 0.001
"""A handshake rate (per s) that refills nothing during a test: one handshake spends the bucket of 1."""


@dataclass
class Case:
    """One row: the setting, what the request adds, and what must come back."""

    reason: str
    settings: dict[str, object] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    query: str = ""
    token: str | Callable[[DuplexServer], Awaitable[str]] | None = None
    prepare: Callable[[DuplexServer], None] | None = None
    spend_bucket: bool = False


def _closed_port() -> int:
    """A local port nothing listens on (Redis down: connection refused at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _replayed(server: DuplexServer) -> str:
    used = token()
    assert server.access.verifier is not None
    await server.access.spend(server.access.verifier.verify(used))
    return used


def _draining(server: DuplexServer) -> None:
    server.draining = True


def _backend_refuses(reason: str) -> Callable[[DuplexServer], None]:
    def prepare(server: DuplexServer) -> None:
        backend = server.backend
        assert isinstance(backend, FakeBackend)
        refusal = Refusal(reason, f"the backend refuses: {reason}")
        backend.refuse_with = refusal

        async def resume(*_: object, **__: object) -> None:
            raise refusal

        backend.resume = resume  # type: ignore[method-assign,assignment]

    return prepare


# Reachable on every route, new or resume: the connection's half of the gate, and the session's checks.
COMMON = [
    Case(
        "rate_limited",
        {"handshake_rate_per_client": TIGHT, "handshake_burst_per_client": 1},
        spend_bucket=True,
    ),
    Case(
        "rate_limited",
        {"handshake_rate_per_client": 0, "handshake_rate_global": TIGHT, "handshake_burst_global": 1},
        spend_bucket=True,
    ),
    Case("origin_not_allowed", TOKEN_MODE, {"Origin": "https://evil.example.com"}, token=token()),
    Case("draining", prepare=_draining),
]
# A new session's only: the token's half of the gate (a resume presents no token) and the query.
NEW_ONLY = [
    Case("missing", TOKEN_MODE),
    Case("malformed", TOKEN_MODE, token="not-a-jwt"),
    Case("expired", TOKEN_MODE, token=token(now=time.time() - 3600, ttl_s=60)),
    Case("not_yet_valid", TOKEN_MODE, token=token(now=time.time() + 3600)),
    Case("bad_signature", TOKEN_MODE, token=token(SigningKey("current", "x" * 32))),
    Case("unknown_key", TOKEN_MODE, token=token(SigningKey("retired", "r" * 32))),
    Case("wrong_audience", TOKEN_MODE, token=token(audience="another-node")),
    Case("persona_not_allowed", TOKEN_MODE, query="voice_prompt=alice", token=token(personas=["bob"])),
    Case("replayed", TOKEN_MODE, token=_replayed),
    Case(
        "replay_check_unavailable",
        {**TOKEN_MODE, "token_replay_check": "redis", "redis_url": f"redis://127.0.0.1:{_closed_port()}/0"},
        token=token(),
    ),
    Case("bad_request", query="audio_topk=9999"),
    Case("not_ready", prepare=_backend_refuses("not_ready")),
]
# A resume's only: what the backend answers a credential.
RESUME_ONLY = [Case(reason, prepare=_backend_refuses(reason)) for reason in RESUME_REFUSAL_REASONS] + [
    Case("bad_request", headers={RESUME_HEADER: "not a credential!"}),
]


def _rows() -> list[tuple[str, Case]]:
    rows = []
    for route in ROUTES:
        resume = route.endswith("-resume")
        for case in COMMON + (RESUME_ONLY if resume else NEW_ONLY):
            rows.append((route, case))
    return rows


def _row_id(row: tuple[str, Case]) -> str:
    route, case = row
    scope = ""
    if case.reason == "rate_limited":
        scope = "-client" if case.settings.get("handshake_rate_per_client") else "-global"
    return f"{route}-{case.reason}{scope}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def offer_sdp() -> AsyncIterator[str]:
    """A real offer (aiortc): the resume rows reach the backend only past the offer's own checks."""
    call = RtcCall("http://127.0.0.1:1", encode_packets(np.zeros(1920, dtype=np.float32)))
    try:
        yield await call.offer()
    finally:
        await call.pc.close()


def counters(server: DuplexServer) -> dict[tuple[str, str], float]:
    """Every sample of both refusal counters: (counter, reason) -> value."""
    values: dict[tuple[str, str], float] = {}
    for family in server.metrics.registry.collect():
        for sample in family.samples:
            if sample.name in COUNTERS:
                values[(sample.name, sample.labels["reason"])] = sample.value
    return values


def moved(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict:
    return {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}


async def attempt_chat(
    server: DuplexServer, case: Case, presented_token: str | None, resume: bool
) -> tuple[str, str]:
    """``/api/chat``: ("http <status>", body) refused before the upgrade, ("close <code>", 0x05 text)
    after it."""
    query = "&".join(part for part in ("format=pcm", case.query) if part)
    headers = dict(case.headers)
    protocols = []
    if presented_token is not None:
        protocols.append(f"duplex.token.{presented_token}")
    if resume and RESUME_HEADER not in headers:
        protocols.append(RESUME_SUBPROTOCOL_PREFIX + CREDENTIAL)
    origin = headers.pop("Origin", None)
    url = f"ws://127.0.0.1:{server.port}/api/chat?{query}"
    try:
        async with connect(
            url,
            additional_headers=headers,
            subprotocols=protocols or None,  # type: ignore[arg-type]
            origin=origin,  # type: ignore[arg-type]
        ) as client:
            text = ""
            try:
                while True:
                    message = await asyncio.wait_for(client.recv(), 10)
                    assert isinstance(message, bytes)
                    assert message[0] == MessageKind.ERROR, f"admitted: {message[:1]!r}"
                    text = message[1:].decode()
            except ConnectionClosed:
                pass
            assert client.close_code is not None
            return f"close {client.close_code}", text
    except InvalidStatus as exc:
        return f"http {exc.response.status_code}", exc.response.body.decode() if exc.response.body else ""


async def attempt_rtc(
    server: DuplexServer, case: Case, presented_token: str | None, resume: bool, sdp: str
) -> tuple[str, str]:
    """``POST /api/rtc``: ("http <status>", body)."""
    headers = {"Content-Type": "application/sdp", **case.headers}
    if presented_token is not None:
        headers["Authorization"] = f"Bearer {presented_token}"
    if resume and RESUME_HEADER not in headers:
        headers[RESUME_HEADER] = CREDENTIAL
    url = f"http://127.0.0.1:{server.port}/api/rtc" + (f"?{case.query}" if case.query else "")
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, data=sdp.encode(), headers=headers) as answer,
    ):
        return f"http {answer.status}", await answer.text()


@pytest.mark.parametrize("row", _rows(), ids=_row_id)
async def test_each_refusal_answers_its_status_and_counts_once_where_it_belongs(
    row: tuple[str, Case], offer_sdp: str
) -> None:
    route, case = row
    resume = route.endswith("-resume")
    async with fake_node(FakeBackend(), **case.settings) as server:
        if case.spend_bucket:  # a probe spends the handshake bucket of 1 and counts nothing
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{server.port}/api/admission") as probe,
            ):
                assert (await probe.json())["ok"] is True
        presented = await case.token(server) if callable(case.token) else case.token
        if case.prepare is not None:
            case.prepare(server)
        before = counters(server)
        if route.startswith("chat"):
            answer, text = await attempt_chat(server, case, presented, resume)
        else:
            answer, text = await attempt_rtc(server, case, presented, resume, offer_sdp)
        after = counters(server)

    kind = REFUSALS[case.reason]
    upgraded = answer.startswith("close")
    expected = f"close {kind.close_code}" if upgraded else f"http {kind.status}"
    if route.startswith("chat") and case.reason in (
        "draining",
        "bad_request",
        "not_ready",
        *RESUME_REFUSAL_REASONS,
    ):
        assert upgraded, f"{case.reason} on /api/chat is refused after the upgrade, got {answer}"
    assert answer == expected, (answer, text)
    if upgraded:
        assert text, "a refusal after the upgrade sends its 0x05 sentence"
    else:
        assert text.startswith(f"{case.reason}: "), text
    counter = COUNTERS[1] if resume else COUNTERS[0]
    assert moved(before, after) == {(counter, case.reason): 1.0}, moved(before, after)


async def test_a_carrier_runs_the_gate_in_two_steps_each_refusal_counted_once() -> None:
    """A carrier (a phone media stream) authenticates after its upgrade: ``admit_connection`` when the
    connection arrives, ``admit_token`` on its first message, with the token that message carries and the
    request parsed once. The same checks and counts as ``admit`` on an HTTP request."""
    from runtime.config import RuntimeConfig
    from runtime.frontend.gate.access import Access, RequestView
    from runtime.frontend.gate.admission import GateRefused, admit_connection, admit_token
    from runtime.frontend.gate.query import parse_session_query
    from runtime.metrics import RuntimeMetrics

    config = RuntimeConfig(host="127.0.0.1", port=0, node_id="carrier", **TOKEN_MODE)  # type: ignore[arg-type]
    metrics = RuntimeMetrics()
    access = Access(config, metrics)
    view = RequestView("192.0.2.7", [("Origin", ORIGIN)], "")
    connection = admit_connection(access, metrics, view, origin=view.get("Origin"), resume=False)
    assert connection.client == "192.0.2.7"
    request = parse_session_query("voice_prompt=alice")
    claims = await admit_token(access, metrics, token(personas=["alice"]), request)
    assert claims is not None and claims.personas == ("alice",)
    with pytest.raises(GateRefused) as refused:
        await admit_token(access, metrics, token(personas=["bob"]), request)
    assert (refused.value.reason, refused.value.status) == ("persona_not_allowed", 403)
    with pytest.raises(GateRefused) as refused:
        admit_connection(access, metrics, view, origin="https://evil.example.com", resume=True)
    assert refused.value.reason == "origin_not_allowed" and refused.value.resume
    samples = {
        (s.name, s.labels["reason"]): s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name in COUNTERS and s.value
    }
    assert samples == {
        ("duplex_admissions_refused_total", "persona_not_allowed"): 1.0,
        ("duplex_resume_refused_total", "origin_not_allowed"): 1.0,
    }
    await access.close()


# --- secrets in URLs (issue 34, item 9) -----------------------------------------------------------------

URL_SECRET_QUERIES = {
    "token": "token=" + token(),
    "resume": "resume=" + CREDENTIAL,
    "text_prompt": "text_prompt=You+are+Ada%2C+the+bank%27s+fraud+agent",
}


@pytest.mark.parametrize("route", ["chat", "rtc"])
@pytest.mark.parametrize("name", list(URL_SECRET_QUERIES))
async def test_with_url_secrets_refused_a_secret_in_the_url_is_a_400_naming_where_it_goes(
    route: str, name: str, offer_sdp: str
) -> None:
    """``DUPLEX_URL_SECRETS=refuse`` (the multi-region stack: Google's load balancer logs full URLs): each
    secret-carrying parameter refused before any upgrade or slot, 400 ``bad_request`` naming it and where
    it goes instead, counted once (a ``resume=`` as a resume's refusal)."""
    from runtime.frontend.gate.admission import URL_SECRETS

    case = Case("bad_request", {"url_secrets": "refuse"}, query=URL_SECRET_QUERIES[name])
    backend = FakeBackend()
    async with fake_node(backend, **case.settings) as server:
        before = counters(server)
        if route == "chat":
            answer, text = await attempt_chat(server, case, None, resume=False)
        else:
            answer, text = await attempt_rtc(server, case, None, False, offer_sdp)
        after = counters(server)
    assert answer == "http 400", (answer, text)
    assert text.startswith(f"bad_request: bad request: {name}= in the URL"), text
    assert URL_SECRETS[name].split(",")[0] in text
    counter = COUNTERS[1] if name == "resume" else COUNTERS[0]
    assert moved(before, after) == {(counter, "bad_request"): 1.0}, moved(before, after)
    assert backend.requests == []


async def test_with_url_secrets_refused_the_prompt_comes_as_a_message_or_a_header(offer_sdp: str) -> None:
    """The same node admits the prompt where it is not logged: the first 0x04 message on ``/api/chat``
    (``text_prompt_in=metadata``) and the ``Duplex-Text-Prompt`` header (percent-encoded UTF-8) on
    ``/api/rtc``; with ``allow`` the query still works (older clients)."""
    from urllib.parse import quote

    from runtime.frontend.gate.query import TEXT_PROMPT_HEADER

    prompt = "Vous êtes Ada, l'agente anti-fraude de la banque."
    backend = FakeBackend()
    async with fake_node(backend, url_secrets="refuse") as server:
        url = f"ws://127.0.0.1:{server.port}/api/chat?format=pcm&text_prompt_in=metadata"
        async with connect(url) as ws:
            await ws.send(bytes([MessageKind.METADATA]) + json.dumps({"text_prompt": prompt}).encode())
            assert await ws.recv() == bytes([MessageKind.HANDSHAKE])
        assert backend.requests[-1].text_prompt == prompt
        headers = {"Content-Type": "application/sdp", TEXT_PROMPT_HEADER: quote(prompt)}
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"http://127.0.0.1:{server.port}/api/rtc", data=offer_sdp.encode(), headers=headers
            ) as answer,
        ):
            assert answer.status == 201, await answer.text()
            location = answer.headers["Location"]
            assert backend.requests[-1].text_prompt == prompt
            async with http.delete(f"http://127.0.0.1:{server.port}{location}") as hang_up:
                assert hang_up.status == 200
        for bad, words in (("%FF%FE", "not percent-encoded UTF-8"),):
            async with (
                aiohttp.ClientSession() as http,
                http.post(
                    f"http://127.0.0.1:{server.port}/api/rtc",
                    data=offer_sdp.encode(),
                    headers={"Content-Type": "application/sdp", TEXT_PROMPT_HEADER: bad},
                ) as refused,
            ):
                assert refused.status == 400 and words in await refused.text()
    async with fake_node(FakeBackend(), url_secrets="allow") as server:
        url = f"ws://127.0.0.1:{server.port}/api/chat?format=pcm&text_prompt=Be+kind"
        async with connect(url) as ws:
            assert await ws.recv() == bytes([MessageKind.HANDSHAKE])
