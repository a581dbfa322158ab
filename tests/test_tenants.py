"""Tenants, token kinds, scopes, lifetimes and revocation (issue 34, items 7 and 8).

Item 7: a token's lifetime is capped when it is verified (``exp - iat`` and ``exp - now``), not only when it
is minted, for session and application tokens alike; a token can be revoked by its ``jti`` or its key.
Item 8: application tokens have keys of their own (a session key cannot sign one), a key may be bound to a
tenant (it signs that tenant's tokens only), the sessions API passes the token's tenant to the session reader
(a tenant sees and erases its own sessions only) and downloading a recording needs its own scope. The API is
served by its real handlers over a real redis-server; clocks are injected, nothing waits on time.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jwt
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from typer.testing import CliRunner

from runtime.config import RuntimeConfig
from runtime.frontend.gate.app_tokens import (
    SCOPE_ERASE,
    SCOPE_READ,
    SCOPE_RECORDINGS,
    mint_app_token,
    verify_app_token,
)
from runtime.frontend.gate.tokens import (
    DEFAULT_TENANT,
    MAX_TTL_S,
    REFUSAL_STATUS,
    Revocations,
    SigningKey,
    TokenRejected,
    TokenVerifier,
    mint_token,
)
from runtime.frontend.gate.verifiers import app_token_verifier, session_token_verifier
from runtime.frontend.sessions_api import sessions_collection, sessions_item
from runtime.frontend.store.keys import index_key
from runtime.frontend.store.records import RedisSessionReader
from runtime.signing_keys import keys_from_mapping, load_key_file
from runtime.tools.cli import app as cli_app
from runtime.tools.local_redis import RedisServer

AUDIENCE = "tenants-test"
SESSION_KEY = SigningKey("sess-1", "s" * 32)
APP_KEY = SigningKey("app-1", "a" * 32)
ACME_APP_KEY = SigningKey("acme-app", "m" * 32, tenant="acme")
ACME_SESSION_KEY = SigningKey("acme-sess", "n" * 32, tenant="acme")
TEN_YEARS_S = 10 * 365 * 24 * 3600


def _hand_minted(key: SigningKey, *, lifetime_s: int, now: int | None = None, **claims: Any) -> str:
    """A token signed with a real key but minted without ``mint_token``'s checks (what any JWT library
    can do with the key): ``iat`` ``now`` (default the clock), ``exp`` ``lifetime_s`` later."""
    now = int(time.time()) if now is None else now
    payload = {"aud": AUDIENCE, "iat": now, "nbf": now, "exp": now + lifetime_s, "jti": "hand-1", **claims}
    return jwt.encode(payload, key.secret, algorithm="HS256", headers={"kid": key.kid})


def _config(**settings: Any) -> RuntimeConfig:
    base: dict[str, Any] = {
        "auth_mode": "token",
        "token_audience": AUDIENCE,
        "token_keys": json.dumps({SESSION_KEY.kid: SESSION_KEY.secret.decode()}),
        "token_replay_check": "memory",
    }
    return RuntimeConfig(**{**base, **settings})


def _app_keys(*keys: SigningKey) -> str:
    mapping: dict[str, Any] = {}
    for key in keys:
        secret = key.secret.decode()
        mapping[key.kid] = secret if key.tenant is None else {"secret": secret, "tenant": key.tenant}
    return json.dumps(mapping)


def _reason(call: Any) -> tuple[str, int]:
    with pytest.raises(TokenRejected) as refused:
        call()
    return refused.value.reason, refused.value.status


# --- item 7: lifetime capped at verify ----------------------------------------------------------------


def test_a_session_token_living_ten_years_is_refused_at_verify():
    """Today's verifier accepts it: the 24 h cap is only in ``mint_token``."""
    verifier = TokenVerifier([SESSION_KEY], AUDIENCE)
    token = _hand_minted(SESSION_KEY, lifetime_s=TEN_YEARS_S, personas=["*"])
    assert _reason(lambda: verifier.verify(token)) == ("lifetime_too_long", 401)
    with pytest.raises(
        TokenRejected, match=r"lives 315360000 s \(exp - iat\); session tokens may live 86400"
    ):
        verifier.verify(token)
    # Exactly the cap is still accepted.
    assert verifier.verify(_hand_minted(SESSION_KEY, lifetime_s=MAX_TTL_S, personas=["*"])).kid == "sess-1"


def test_an_application_token_living_ten_years_is_refused_at_verify():
    verifier = TokenVerifier([APP_KEY], AUDIENCE, kind="app")
    token = _hand_minted(APP_KEY, lifetime_s=TEN_YEARS_S, scope=SCOPE_READ)
    assert _reason(lambda: verify_app_token(verifier, token, SCOPE_READ)) == ("lifetime_too_long", 401)


def test_the_cap_also_holds_against_the_clock_and_the_settings():
    """``exp - now``: a verifier whose clock says the token was issued long before it claims (an ``iat`` set
    late to pass the first check) refuses it; ``DUPLEX_TOKEN_MAX_TTL_S`` and ``DUPLEX_APP_TOKEN_MAX_TTL_S``
    lower the caps."""
    now = int(time.time())
    token = _hand_minted(SESSION_KEY, lifetime_s=3000, now=now, personas=["*"])
    early = TokenVerifier([SESSION_KEY], AUDIENCE, max_ttl_s=3600, clock=lambda: now - 1000)
    with pytest.raises(TokenRejected, match="expires in 4000 s; session tokens may live 3600 s"):
        early.verify(token)
    config = _config(token_max_ttl_s=600, app_token_max_ttl_s=60, app_token_keys=_app_keys(APP_KEY))
    assert _reason(lambda: session_token_verifier(config).verify(token)) == ("lifetime_too_long", 401)
    verifier = app_token_verifier(config)
    assert verifier is not None
    app_token = mint_app_token(APP_KEY, ttl_s=120, audience=AUDIENCE)
    assert _reason(lambda: verify_app_token(verifier, app_token, SCOPE_READ))[0] == "lifetime_too_long"
    with pytest.raises(ValueError, match="max_ttl_s must be a positive number of seconds"):
        TokenVerifier([SESSION_KEY], AUDIENCE, max_ttl_s=0)


# --- item 7: revocation -------------------------------------------------------------------------------


def test_app_tokens_are_revoked_by_jti_or_by_key_from_the_settings():
    """Today an application token cannot be revoked short of rotating the key."""
    leaked = mint_app_token(APP_KEY, ttl_s=600, audience=AUDIENCE, token_id="leaked-1")
    other = mint_app_token(APP_KEY, ttl_s=600, audience=AUDIENCE, token_id="fine-1")
    config = _config(app_token_keys=_app_keys(APP_KEY), token_revoked_jtis="leaked-1, gone-2")
    verifier = app_token_verifier(config)
    assert verifier is not None
    assert _reason(lambda: verify_app_token(verifier, leaked, SCOPE_READ)) == ("revoked", 401)
    assert verify_app_token(verifier, other, SCOPE_READ).token_id == "fine-1"
    by_key = app_token_verifier(_config(app_token_keys=_app_keys(APP_KEY), token_revoked_kids='["app-1"]'))
    assert by_key is not None
    with pytest.raises(TokenRejected, match="signing key 'app-1' is revoked"):
        verify_app_token(by_key, other, SCOPE_READ)
    session = mint_token(SESSION_KEY, ttl_s=60, personas=["*"], audience=AUDIENCE, token_id="s-leak")
    revoked = TokenVerifier([SESSION_KEY], AUDIENCE, revoked=Revocations(frozenset({"s-leak"})))
    assert _reason(lambda: revoked.verify(session)) == ("revoked", 401)


# --- item 8: two kinds, two key sets ------------------------------------------------------------------


def test_whoever_holds_the_session_keys_cannot_mint_a_sessions_api_token():
    """Today both kinds share keys: a session key signs an application token that reads and erases every
    session. With application keys of their own it is refused, and each kind is refused on the other's
    door with the reason that says which."""
    config = _config(app_token_keys=_app_keys(APP_KEY))
    app_verifier, session_verifier = app_token_verifier(config), session_token_verifier(config)
    assert app_verifier is not None
    forged = mint_app_token(SESSION_KEY, ttl_s=60, audience=AUDIENCE)
    assert _reason(lambda: verify_app_token(app_verifier, forged, SCOPE_ERASE)) == ("wrong_key_kind", 401)
    session = mint_token(SESSION_KEY, ttl_s=60, personas=["*"], audience=AUDIENCE)
    assert _reason(lambda: verify_app_token(app_verifier, session, SCOPE_READ)) == ("wrong_token_kind", 403)
    app_token = mint_app_token(APP_KEY, ttl_s=60, audience=AUDIENCE)
    assert verify_app_token(app_verifier, app_token, SCOPE_ERASE).kid == "app-1"
    assert _reason(lambda: session_verifier.verify(app_token)) == ("wrong_token_kind", 403)
    session_by_app_key = mint_token(APP_KEY, ttl_s=60, personas=["*"], audience=AUDIENCE)
    assert _reason(lambda: session_verifier.verify(session_by_app_key)) == ("wrong_key_kind", 401)
    assert session_verifier.verify(session).kid == "sess-1"


def test_without_app_keys_the_api_is_off_unless_the_deprecated_fallback_is_asked_for(
    caplog: pytest.LogCaptureFixture,
):
    assert app_token_verifier(_config()) is None
    with caplog.at_level(logging.WARNING, logger="runtime.frontend.gate.verifiers"):
        shared = app_token_verifier(_config(app_tokens_use_session_keys=True))
    assert shared is not None and shared.key_ids == ["sess-1"]
    assert "DUPLEX_APP_TOKENS_USE_SESSION_KEYS=true (deprecated)" in caplog.text
    token = mint_app_token(SESSION_KEY, ttl_s=60, audience=AUDIENCE)
    assert verify_app_token(shared, token, SCOPE_READ).kid == "sess-1"
    with pytest.raises(ValueError, match="unset it, since DUPLEX_APP_TOKEN_KEYS is set"):
        _config(app_tokens_use_session_keys=True, app_token_keys=_app_keys(APP_KEY)).check_access_control()
    same_kid = SigningKey(SESSION_KEY.kid, "z" * 32)
    with pytest.raises(ValueError, match="key id 'sess-1' is in both DUPLEX_TOKEN_KEYS and DUPLEX_APP"):
        _config(app_token_keys=_app_keys(same_kid)).check_access_control()


# --- item 8: tenants ----------------------------------------------------------------------------------


def test_a_tenant_key_signs_its_own_tenant_only():
    """Today there is no tenant: any key mints for anyone. A key bound to ``acme`` puts ``acme`` in its
    tokens, refuses to mint another tenant's, and a hand-made token claiming another tenant is refused."""
    verifier = TokenVerifier([ACME_SESSION_KEY, SESSION_KEY], AUDIENCE)
    claims = verifier.verify(mint_token(ACME_SESSION_KEY, ttl_s=60, personas=["*"], audience=AUDIENCE))
    assert claims.tenant == "acme"
    assert verifier.verify(mint_token(SESSION_KEY, ttl_s=60, personas=["*"], audience=AUDIENCE)).tenant == (
        DEFAULT_TENANT
    )
    with pytest.raises(ValueError, match="key 'acme-sess' signs for tenant 'acme' only, not 'beta'"):
        mint_token(ACME_SESSION_KEY, ttl_s=60, personas=["*"], audience=AUDIENCE, tenant="beta")
    with pytest.raises(ValueError, match="signs for tenant 'default' only, not 'acme'"):
        mint_app_token(APP_KEY, ttl_s=60, audience=AUDIENCE, tenant="acme")
    other = _hand_minted(ACME_SESSION_KEY, lifetime_s=60, personas=["*"], tenant="beta")
    assert _reason(lambda: verifier.verify(other)) == ("wrong_tenant", 403)
    unbound = _hand_minted(SESSION_KEY, lifetime_s=60, personas=["*"], tenant="acme")
    assert _reason(lambda: verifier.verify(unbound)) == ("wrong_tenant", 403)
    bad = _hand_minted(SESSION_KEY, lifetime_s=60, personas=["*"], tenant="Bad Name")
    assert _reason(lambda: verifier.verify(bad)) == ("malformed", 401)


def test_keys_bound_to_tenants_load_from_json_and_files(tmp_path: Path):
    keys = keys_from_mapping({"a": "x" * 32, "b": {"secret": "y" * 32, "tenant": "acme"}})
    assert [(k.kid, k.tenant, k.signs_for) for k in keys] == [("a", None, "default"), ("b", "acme", "acme")]
    with pytest.raises(ValueError, match="key 'b' has unknown field 'scope'; allowed: secret, tenant"):
        keys_from_mapping({"b": {"secret": "y" * 32, "scope": "all"}})
    with pytest.raises(ValueError, match="tenant 'ACME' is invalid: 1-64 characters of a-z 0-9"):
        keys_from_mapping({"b": {"secret": "y" * 32, "tenant": "ACME"}})
    path = tmp_path / "app_keys.json"
    path.write_text(_app_keys(ACME_APP_KEY))
    assert load_key_file(path) == [ACME_APP_KEY]
    assert repr(ACME_APP_KEY) == "SigningKey(kid='acme-app', tenant='acme')"


def test_new_refusal_reasons_have_statuses():
    assert {
        r: REFUSAL_STATUS[r] for r in ("lifetime_too_long", "revoked", "wrong_key_kind", "wrong_tenant")
    } == {
        "lifetime_too_long": 401,
        "revoked": 401,
        "wrong_key_kind": 401,
        "wrong_tenant": 403,
    }


# --- the sessions API: tenant filter and scopes, over its real handlers and a real redis-server --------

ACME_SID = "a" * 32
DEFAULT_SID = "d" * 32
ACME_LIVE_SID = "b" * 32


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


class _Recordings:
    """A recording store that only counts its erases (the files are another test's business)."""

    def __init__(self) -> None:
        self.erased: list[str] = []

    def erase(self, session_id: str) -> int:
        self.erased.append(session_id)
        return 2

    def local_path(self, session_id: str, side: str) -> Path | None:
        return None


@pytest_asyncio.fixture
async def api(redis_server: RedisServer) -> AsyncIterator[tuple[TestClient, SimpleNamespace]]:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await client.flushall()
    now = time.time()
    for n, (sid, tenant, state) in enumerate(
        [(ACME_SID, "acme", "ended"), (DEFAULT_SID, "", "ended"), (ACME_LIVE_SID, "acme", "active")]
    ):
        fields = {"id": sid, "node": "t", "state": state, "started_at": str(now - 100 + n)}
        if tenant:
            fields["tenant"] = tenant
        await client.hset(f"duplex:session:{sid}", mapping=fields)
        await client.zadd(index_key("duplex"), {sid: now - 100 + n})
    await client.aclose()
    config = _config(app_token_keys=_app_keys(APP_KEY, ACME_APP_KEY))
    front = SimpleNamespace(
        access=SimpleNamespace(
            verifier=session_token_verifier(config), app_verifier=app_token_verifier(config)
        ),
        records=RedisSessionReader(redis_server.url),
        recordings=_Recordings(),
    )

    async def collection(request: web.Request) -> web.StreamResponse:
        return await sessions_collection(front, request)  # type: ignore[arg-type]

    async def item(request: web.Request) -> web.StreamResponse:
        return await sessions_item(front, request)  # type: ignore[arg-type]

    app = web.Application()
    app.router.add_route("GET", "/api/sessions", collection)
    app.router.add_route("*", "/api/sessions/{rest:.*}", item)
    http = TestClient(TestServer(app))
    await http.start_server()
    try:
        yield http, front
    finally:
        await http.close()
        await front.records.close()


def _bearer(key: SigningKey, *scopes: str) -> dict[str, str]:
    token = mint_app_token(key, ttl_s=300, audience=AUDIENCE, scopes=scopes or (SCOPE_READ,))
    return {"Authorization": f"Bearer {token}"}


async def test_an_app_token_lists_reads_and_erases_its_own_tenants_sessions_only(
    api: tuple[TestClient, SimpleNamespace],
):
    """Today every application token sees and erases every session of the Redis."""
    http, front = api
    answer = await http.get("/api/sessions", headers=_bearer(ACME_APP_KEY))
    assert answer.status == 200
    assert [s["id"] for s in (await answer.json())["sessions"]] == [ACME_LIVE_SID, ACME_SID]
    answer = await http.get("/api/sessions", headers=_bearer(APP_KEY))
    assert [s["id"] for s in (await answer.json())["sessions"]] == [DEFAULT_SID]  # no tenant: the default
    # Another tenant's session is as unknown as one never started: no read, no erase, no recording erase.
    answer = await http.get(f"/api/sessions/{DEFAULT_SID}", headers=_bearer(ACME_APP_KEY))
    assert answer.status == 404 and (await answer.json())["error"] == "unknown_session"
    answer = await http.delete(f"/api/sessions/{DEFAULT_SID}", headers=_bearer(ACME_APP_KEY, SCOPE_ERASE))
    assert answer.status == 404 and front.recordings.erased == []
    answer = await http.get(f"/api/sessions/{ACME_SID}", headers=_bearer(ACME_APP_KEY))
    assert answer.status == 200 and (await answer.json())["id"] == ACME_SID
    answer = await http.delete(f"/api/sessions/{ACME_SID}", headers=_bearer(ACME_APP_KEY, SCOPE_ERASE))
    assert answer.status == 204 and front.recordings.erased == [ACME_SID]
    # The default tenant's session is still there for the default tenant's token.
    answer = await http.get(f"/api/sessions/{DEFAULT_SID}", headers=_bearer(APP_KEY))
    assert answer.status == 200


async def test_recordings_need_their_own_scope_and_records_gone_leave_other_tenants_files(
    api: tuple[TestClient, SimpleNamespace],
):
    http, front = api
    path = f"/api/sessions/{ACME_SID}/recording/caller"
    answer = await http.get(path, headers=_bearer(ACME_APP_KEY, SCOPE_READ))
    assert answer.status == 403 and (await answer.json())["error"] == "insufficient_scope"
    assert "sessions:recordings" in (await answer.json())["message"]
    answer = await http.get(path, headers=_bearer(ACME_APP_KEY, SCOPE_RECORDINGS))
    assert answer.status == 404 and (await answer.json())["error"] == "no_recording"  # the scope let it in
    answer = await http.get(path, headers=_bearer(APP_KEY, SCOPE_RECORDINGS))
    assert answer.status == 404 and (await answer.json())["error"] == "unknown_session"  # not its tenant's
    # A session whose record is gone (past retention): its files carry no tenant; only the default
    # tenant's token erases them.
    gone = "c" * 32
    answer = await http.delete(f"/api/sessions/{gone}", headers=_bearer(ACME_APP_KEY, SCOPE_ERASE))
    assert answer.status == 404 and front.recordings.erased == []
    answer = await http.delete(f"/api/sessions/{gone}", headers=_bearer(APP_KEY, SCOPE_ERASE))
    assert answer.status == 204 and front.recordings.erased == [gone]


async def test_the_api_refuses_forged_and_session_tokens_and_is_off_without_app_keys(
    api: tuple[TestClient, SimpleNamespace],
):
    http, front = api
    forged = mint_app_token(SESSION_KEY, ttl_s=60, audience=AUDIENCE)
    answer = await http.get("/api/sessions", headers={"Authorization": f"Bearer {forged}"})
    assert answer.status == 401 and (await answer.json())["error"] == "wrong_key_kind"
    assert answer.headers["WWW-Authenticate"] == 'Bearer realm="duplex", error="invalid_token"'
    front.access.app_verifier = app_token_verifier(_config())  # a node without application keys
    answer = await http.get("/api/sessions", headers=_bearer(APP_KEY))
    body = await answer.json()
    assert answer.status == 403 and body["error"] == "api_off" and "DUPLEX_APP_TOKEN_KEYS" in body["message"]


# --- the CLI ------------------------------------------------------------------------------------------


def test_duplex_token_keygen_and_mint_carry_the_tenant(tmp_path: Path):
    result = CliRunner().invoke(cli_app, ["token", "keygen", "--kid", "acme-1", "--tenant", "acme"])
    assert result.exit_code == 0, result.output
    entry = json.loads(result.stdout)
    assert entry["acme-1"]["tenant"] == "acme" and len(entry["acme-1"]["secret"]) == 43
    keys = tmp_path / "app_keys.json"
    keys.write_text(result.stdout)
    base = ["token", "mint", "--key-file", str(keys), "--audience", AUDIENCE, "--app"]
    result = CliRunner().invoke(cli_app, [*base, "--scope", SCOPE_RECORDINGS])
    assert result.exit_code == 0, result.output
    verifier = TokenVerifier(load_key_file(keys), AUDIENCE, kind="app")
    claims = verify_app_token(verifier, result.stdout.strip(), SCOPE_RECORDINGS)
    assert claims.tenant == "acme" and claims.scopes == {SCOPE_RECORDINGS}
    result = CliRunner().invoke(cli_app, [*base, "--tenant", "beta"])
    assert result.exit_code == 2 and "signs for tenant 'acme' only, not 'beta'" in result.output
    result = CliRunner().invoke(cli_app, ["token", "keygen", "--tenant", "Not Valid"])
    assert result.exit_code == 2 and "is invalid" in result.output
