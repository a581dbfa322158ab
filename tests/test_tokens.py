"""Session tokens without a server: minting, every refusal reason of the verifier, key rotation, the
in-memory replay guard, the access settings of ``RuntimeConfig``, the ``duplex token`` commands and the
node's token secrets. Also both sides of every leeway boundary, and single use under concurrency: spends of
one token at the same time on a real Redis, and (the one server here, in-process over
``tests/fake_backend.py``) two handshakes at once with one token."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import jwt
import pytest
from fake_backend import FakeBackend
from pydantic import ValidationError
from test_frontend_seam import chat, fake_node
from typer.testing import CliRunner
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from infra.node.bundle.services import (
    SECRET_FILES,
    NodeSecrets,
    runtime_settings,
    secret_files,
    token_audience,
)
from infra.node.profile.profiles import PROFILES
from runtime.config import RuntimeConfig
from runtime.engine.api import AdmitRequest, SessionSink, SlotLease
from runtime.frontend.codecs.protocol import MessageKind
from runtime.frontend.gate.replay import MemoryReplayGuard, RedisReplayGuard
from runtime.frontend.gate.tokens import (
    REFUSAL_STATUS,
    SigningKey,
    TokenClaims,
    TokenRejected,
    TokenVerifier,
    generate_signing_key,
    load_key_file,
    mint_token,
)
from runtime.metrics import ACCESS_REFUSAL_REASONS
from runtime.tools.cli import app

AUDIENCE = "node.example.com"
KEY = SigningKey("k1", "a" * 32)
OTHER = SigningKey("k2", "b" * 40)


def verifier(*keys: SigningKey, leeway_s: float = 5.0) -> TokenVerifier:
    return TokenVerifier(list(keys) or [KEY], AUDIENCE, leeway_s)


def rejected(token: str | None, *keys: SigningKey, leeway_s: float = 5.0) -> TokenRejected:
    with pytest.raises(TokenRejected) as info:
        verifier(*keys, leeway_s=leeway_s).verify(token)
    return info.value


def test_a_minted_token_verifies_with_its_claims() -> None:
    token = mint_token(KEY, ttl_s=300, personas=["alice", "bob"], max_session_s=90, audience=AUDIENCE)
    assert jwt.get_unverified_header(token) == {"alg": "HS256", "typ": "JWT", "kid": "k1"}
    claims = verifier().verify(token)
    assert claims.kid == "k1" and claims.audience == AUDIENCE
    assert claims.personas == ("alice", "bob") and claims.max_session_s == 90
    assert claims.expires_at - claims.issued_at == 300 and claims.not_before == claims.issued_at
    assert abs(claims.issued_at - time.time()) < 5
    assert len(claims.token_id) >= 16
    assert (
        claims.token_id
        != verifier().verify(mint_token(KEY, ttl_s=300, personas=["*"], audience=AUDIENCE)).token_id
    )
    assert (
        claims.allows_persona("alice") and claims.allows_persona(None) and not claims.allows_persona("carol")
    )
    TokenVerifier.check_persona(claims, "bob")
    with pytest.raises(TokenRejected) as info:
        TokenVerifier.check_persona(claims, "carol")
    assert info.value.reason == "persona_not_allowed" and info.value.status == 403
    assert "carol" in info.value.detail and "alice" in info.value.detail
    anyone = verifier().verify(mint_token(KEY, ttl_s=60, personas=["*"], audience=AUDIENCE))
    assert anyone.allows_persona("carol") and anyone.max_session_s is None


def _signed(payload: dict, key: SigningKey = KEY, **headers: object) -> str:
    return jwt.encode(payload, key.secret, algorithm="HS256", headers={"kid": key.kid, **headers})


def _payload(**overrides: object) -> dict:
    now = int(time.time())
    payload = {"aud": AUDIENCE, "iat": now, "nbf": now, "exp": now + 60, "jti": "id-1", "personas": ["*"]}
    payload.update(overrides)
    return {k: v for k, v in payload.items() if v is not None}


_REFUSALS: dict[str, tuple[Callable[[], str | None], str, str]] = {
    # id: (the token, minted when the test runs; the reason; a word of the detail)
    "none": (lambda: None, "missing", "no session token"),
    "empty": (lambda: "", "missing", "duplex.token."),
    "garbage": (lambda: "not-a-jwt", "malformed", "not a JWT"),
    "three-parts": (lambda: "a.b.c", "malformed", "not a JWT"),
    "no-kid": (lambda: jwt.encode(_payload(), KEY.secret, algorithm="HS256"), "malformed", "no kid"),
    "no-jti": (lambda: _signed(_payload(jti=None)), "malformed", "jti"),
    "personas-str": (lambda: _signed(_payload(personas="alice")), "malformed", "personas"),
    "personas-empty": (lambda: _signed(_payload(personas=[])), "malformed", "personas"),
    "max-session-negative": (lambda: _signed(_payload(max_session_s=-1)), "malformed", "max_session_s"),
    "no-exp": (lambda: _signed(_payload(exp=None)), "malformed", "exp"),
    "expired": (lambda: _minted(now=time.time() - 600), "expired", "mint a new"),
    "not-yet-valid": (lambda: _minted(now=time.time() + 600), "not_yet_valid", "not yet valid"),
    # Issue 34, item 7: the 24 h cap held only in mint_token; a token signed elsewhere for ten years passed.
    "ten-years": (
        lambda: _signed(_payload(exp=int(time.time()) + 10 * 365 * 86400)),
        "lifetime_too_long",
        "may live 86400 s at most",
    ),
    "issued-long-ago-for-long": (
        lambda: _signed(
            _payload(iat=int(time.time()) - 86400, nbf=int(time.time()) - 86400)
            | {"exp": int(time.time()) + 3600}
        ),
        "lifetime_too_long",
        "mint a shorter-lived one",
    ),
    "bad-signature": (lambda: _minted(SigningKey("k1", "z" * 32)), "bad_signature", "k1"),
    "other-algorithm": (
        lambda: jwt.encode(_payload(), "a" * 64, algorithm="HS512", headers={"kid": "k1"}),
        "bad_signature",
        "HS512",
    ),
    "unknown-key": (lambda: _minted(OTHER), "unknown_key", "'k2'"),
    "wrong-audience": (lambda: _minted(audience="other.example.com"), "wrong_audience", AUDIENCE),
}


def _minted(key: SigningKey = KEY, **overrides: object) -> str:
    args: dict = {"ttl_s": 60, "personas": ["*"], "audience": AUDIENCE, **overrides}
    return mint_token(key, **args)


@pytest.mark.parametrize(("make_token", "reason", "needle"), _REFUSALS.values(), ids=_REFUSALS.keys())
def test_each_refusal_reason(make_token: Callable[[], str | None], reason: str, needle: str) -> None:
    exc = rejected(make_token())
    assert exc.reason == reason, exc
    assert needle in exc.detail, exc.detail
    assert exc.status == REFUSAL_STATUS[reason] == 401
    assert str(exc) == f"{reason}: {exc.detail}"


def test_unsigned_token_is_refused() -> None:
    header = jwt.utils.base64url_encode(json.dumps({"alg": "none", "kid": "k1"}).encode()).decode()
    body = jwt.utils.base64url_encode(json.dumps(_payload()).encode()).decode()
    assert rejected(f"{header}.{body}.").reason == "bad_signature"


def test_leeway_covers_small_clock_skew() -> None:
    token = mint_token(KEY, ttl_s=10, personas=["*"], audience=AUDIENCE, now=time.time() - 12)
    assert verifier(leeway_s=5).verify(token).token_id
    assert rejected(token, leeway_s=0).reason == "expired"
    early = mint_token(KEY, ttl_s=60, personas=["*"], audience=AUDIENCE, now=time.time() + 3)
    assert verifier(leeway_s=5).verify(early).token_id
    assert rejected(early, leeway_s=0).reason == "not_yet_valid"


def test_key_rotation() -> None:
    old, new = SigningKey("2024-old", "o" * 32), SigningKey("2025-new", "n" * 32)
    old_token = mint_token(old, ttl_s=60, personas=["*"], audience=AUDIENCE)
    new_token = mint_token(new, ttl_s=60, personas=["*"], audience=AUDIENCE)
    both = TokenVerifier([old, new], AUDIENCE)
    assert both.verify(old_token).kid == "2024-old" and both.verify(new_token).kid == "2025-new"
    assert both.key_ids == ["2024-old", "2025-new"]
    only_new = TokenVerifier([new], AUDIENCE)
    assert only_new.verify(new_token).kid == "2025-new"
    with pytest.raises(TokenRejected) as info:
        only_new.verify(old_token)
    assert info.value.reason == "unknown_key" and "2024-old" in info.value.detail


def test_signing_key_rules() -> None:
    with pytest.raises(ValueError, match="at least 32 bytes, got 31"):
        SigningKey("k", "x" * 31)
    with pytest.raises(ValueError, match="key id"):
        SigningKey("has space", "x" * 32)
    assert "x" * 32 not in repr(SigningKey("k", "x" * 32))
    assert SigningKey("k", "x" * 32).secret == b"x" * 32
    key = generate_signing_key()
    assert key.kid.startswith("key-") and len(key.secret) >= 32
    assert generate_signing_key().secret != key.secret
    with pytest.raises(ValueError, match="share the kid"):
        TokenVerifier([KEY, SigningKey("k1", "c" * 32)], AUDIENCE)
    with pytest.raises(ValueError, match="at least one signing key"):
        TokenVerifier([], AUDIENCE)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ttl_s": 0}, "ttl_s"),
        ({"ttl_s": 2 * 86400}, "ttl_s"),
        ({"personas": []}, "personas"),
        ({"personas": ["has space"]}, "personas"),
        ({"max_session_s": 0}, "max_session_s"),
        ({"audience": ""}, "audience"),
        ({"token_id": "with space"}, "token_id"),
    ],
)
def test_mint_refuses_bad_input(kwargs: dict, message: str) -> None:
    args = {"ttl_s": 60, "personas": ["*"], "audience": AUDIENCE, **kwargs}
    with pytest.raises(ValueError, match=message):
        mint_token(KEY, **args)


async def test_memory_replay_guard_admits_each_id_once_until_it_expires() -> None:
    now = [1000.0]
    guard = MemoryReplayGuard(leeway_s=5, clock=lambda: now[0])
    claims = verifier().verify(mint_token(KEY, ttl_s=60, personas=["*"], audience=AUDIENCE, token_id="once"))
    await guard.spend(claims)
    with pytest.raises(TokenRejected) as info:
        await guard.spend(claims)
    assert info.value.reason == "replayed" and info.value.status == 403
    now[0] = claims.expires_at + 6  # the token itself is refused as expired by now: the id may go
    await guard.spend(claims)


async def test_seen_reports_a_spent_id_without_spending_one() -> None:
    now = [1000.0]
    guard = MemoryReplayGuard(leeway_s=5, clock=lambda: now[0])
    claims = verifier().verify(mint_token(KEY, ttl_s=60, personas=["*"], audience=AUDIENCE, token_id="peek"))
    assert not await guard.seen(claims) and not await guard.seen(claims)  # looking twice spends nothing
    assert len(guard) == 0
    await guard.spend(claims)
    assert await guard.seen(claims)
    now[0] = claims.expires_at + 6
    assert not await guard.seen(claims)


async def test_redis_seen_reads_only_and_fails_like_spend(redis_server) -> None:
    from runtime.frontend.gate.replay import RedisReplayGuard

    claims = verifier().verify(
        mint_token(KEY, ttl_s=60, personas=["*"], audience=AUDIENCE, token_id="r-peek")
    )
    errors: list[int] = []
    closed = RedisReplayGuard(redis_server.url, on_error=lambda: errors.append(1))
    fallback = MemoryReplayGuard()
    open_ = RedisReplayGuard(redis_server.url, fallback=fallback)
    try:
        assert not await closed.seen(claims)
        assert not await closed.seen(claims)
        await closed.spend(claims)  # the id was not recorded by looking: the first use goes through
        assert await closed.seen(claims) and await open_.seen(claims)
        redis_server.stop()
        with pytest.raises(TokenRejected) as info:
            await closed.seen(claims)
        assert info.value.reason == "replay_check_unavailable" and errors == [1]
        assert not await open_.seen(claims)  # Redis down: the fallback's memory answers (it never saw it)
        fallback.remember(claims)
        assert await open_.seen(claims)
    finally:
        await closed.close()
        await open_.close()


def test_refusal_reasons_are_the_metric_labels() -> None:
    assert set(REFUSAL_STATUS) == set(ACCESS_REFUSAL_REASONS)
    with pytest.raises(ValueError, match="unknown refusal reason"):
        TokenRejected("nope", "x")


# --- both sides of each leeway boundary -------------------------------------------------------------------
# PyJWT reads its own clock (datetime.now), so, as in test_leeway_covers_small_clock_skew, tokens are signed
# with times relative to time.time(). Each case sits SLACK_S inside or outside the boundary: a case holds as
# long as minting and verifying take less than SLACK_S - 1 s (the claims are whole seconds).

LEEWAY_S = 60
SLACK_S = 5


def _timed(*, iat: int = 0, nbf: int = 0, exp: int = 60) -> str:
    """A token whose ``iat``, ``nbf`` and ``exp`` are these offsets (s) from now."""
    now = int(time.time())
    return _signed(_payload(iat=now + iat, nbf=now + nbf, exp=now + exp))


def test_exp_leeway_holds_on_both_sides_of_its_boundary() -> None:
    """A token expired by less than the leeway is accepted, one expired by more is refused.

    Planted bug: the verifier passing ``leeway_s * 100`` to PyJWT — fails on it: the token expired by
    leeway + 5 s verifies instead of raising ``expired``."""
    assert verifier(leeway_s=LEEWAY_S).verify(_timed(iat=-600, nbf=-600, exp=-(LEEWAY_S - SLACK_S)))
    exc = rejected(_timed(iat=-600, nbf=-600, exp=-(LEEWAY_S + SLACK_S)), leeway_s=LEEWAY_S)
    assert exc.reason == "expired", exc


@pytest.mark.parametrize("claim", ["nbf", "iat"])
def test_nbf_and_iat_leeway_hold_on_both_sides_of_their_boundary(claim: str) -> None:
    """A token whose ``nbf`` (or ``iat``) is less than the leeway ahead is accepted (the minting host's
    clock runs fast), one more than the leeway ahead is refused as ``not_yet_valid``, naming the claim.

    Planted bug: the verifier passing ``leeway_s * 100`` to PyJWT — fails on it: the token leeway + 5 s
    ahead verifies instead of raising ``not_yet_valid``."""
    assert verifier(leeway_s=LEEWAY_S).verify(_timed(**{claim: LEEWAY_S - SLACK_S}))
    exc = rejected(_timed(**{claim: LEEWAY_S + SLACK_S}), leeway_s=LEEWAY_S)
    assert exc.reason == "not_yet_valid" and f"({claim})" in exc.detail, exc


async def test_memory_replay_guard_keeps_an_id_until_expiry_plus_leeway_and_no_longer() -> None:
    """The in-memory guard refuses a replay until ``exp + leeway`` (until then some verifier may still
    accept the token) and forgets the id after it.

    Planted bug: the guard keeping an id until ``exp + leeway * 100`` (or ``exp + leeway / 100``) — fails
    on it: half a second past ``exp + leeway`` the id is still refused as ``replayed`` (on ``/ 100``: half a
    second before it, the replay is admitted)."""
    now = [0.0]
    guard = MemoryReplayGuard(leeway_s=5, clock=lambda: now[0])
    claims = verifier().verify(mint_token(KEY, ttl_s=60, personas=["*"], audience=AUDIENCE, token_id="edge"))
    now[0] = claims.issued_at
    await guard.spend(claims)
    now[0] = claims.expires_at + 5 - 0.5
    assert await guard.seen(claims)
    with pytest.raises(TokenRejected) as info:
        await guard.spend(claims)
    assert info.value.reason == "replayed"
    now[0] = claims.expires_at + 5 + 0.5
    assert not await guard.seen(claims)
    await guard.spend(claims)  # forgotten: recorded afresh
    assert len(guard) == 1


async def test_redis_replay_key_lives_until_expiry_plus_leeway(redis_server) -> None:
    """``RedisReplayGuard`` keeps ``duplex:token:<jti>`` (its value the kid) for the token's remaining
    lifetime plus the leeway: no longer (Redis memory), no shorter (a replay within the leeway).

    Planted bug: the guard's TTL using ``leeway_s * 100`` — fails on it: the key's TTL is 3060 s, not 90 s."""
    import redis.asyncio as aioredis

    claims = verifier().verify(mint_token(KEY, ttl_s=60, personas=["*"], audience=AUDIENCE, token_id="r-ttl"))
    guard = RedisReplayGuard(redis_server.url, leeway_s=30)
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        await guard.spend(claims)
        assert await raw.get("duplex:token:r-ttl") == b"k1"
        assert 60 + 30 - SLACK_S <= await raw.ttl("duplex:token:r-ttl") <= 60 + 30
    finally:
        await guard.close()
        await raw.aclose()


# --- single use under concurrency -------------------------------------------------------------------------


def _race_claims(token_id: str) -> TokenClaims:
    return verifier().verify(mint_token(KEY, ttl_s=60, personas=["*"], audience=AUDIENCE, token_id=token_id))


def _one_admitted(outcomes: list[object]) -> None:
    """Exactly one ``spend`` returned; every other raised ``replayed`` (403)."""
    admitted = [o for o in outcomes if o is None]
    refused = [o for o in outcomes if isinstance(o, TokenRejected)]
    assert len(admitted) == 1, f"{len(admitted)} of {len(outcomes)} concurrent spends admitted: {outcomes}"
    assert len(refused) == len(outcomes) - 1, outcomes
    assert {(exc.reason, exc.status) for exc in refused} == {("replayed", 403)}


@pytest.mark.parametrize("spenders", [2, 8])
async def test_concurrent_spends_of_one_token_admit_exactly_one(redis_server, spenders: int) -> None:
    """``spenders`` spends of one token at the same time (each on its own pooled Redis connection): one is
    admitted, the rest refused as ``replayed``; ``SET NX``'s answer decides, not a read before it.

    Planted bug: ``RedisReplayGuard.spend`` ignoring ``SET NX``'s answer — fails on it: all ``spenders``
    spends are admitted."""
    guard = RedisReplayGuard(redis_server.url)
    try:
        claims = _race_claims(f"race-{spenders}")
        _one_admitted(
            await asyncio.gather(*(guard.spend(claims) for _ in range(spenders)), return_exceptions=True)
        )
        with pytest.raises(TokenRejected, match="^replayed"):
            await guard.spend(claims)  # and the winner's record stays
    finally:
        await guard.close()


async def test_two_runtimes_sharing_a_redis_admit_one_use_of_a_token(redis_server) -> None:
    """Two guards (two runtimes on one Redis: one failing closed, one with the memory fallback of
    ``redis-or-memory``) spending one token at the same time, twice each: one use in all.

    Planted bug: ``RedisReplayGuard.spend`` ignoring ``SET NX``'s answer — fails on it: each runtime admits
    the token (4 of 4 spends)."""
    closed = RedisReplayGuard(redis_server.url)
    fallback = MemoryReplayGuard()
    open_ = RedisReplayGuard(redis_server.url, fallback=fallback)
    try:
        claims = _race_claims("shared")
        spends = [closed.spend(claims), open_.spend(claims), closed.spend(claims), open_.spend(claims)]
        _one_admitted(await asyncio.gather(*spends, return_exceptions=True))
    finally:
        await closed.close()
        await open_.close()


class _HeldAdmissions(FakeBackend):
    """The fake backend, holding every admission until ``expected`` have arrived: each handshake has then
    passed the access check (whose ``seen`` preflight spends nothing) before any session spends the token."""

    def __init__(self, expected: int) -> None:
        super().__init__(slots=expected)
        self.expected = expected
        self._all_here = asyncio.Event()
        self._arrived = 0

    async def admit(self, request: AdmitRequest, sink: SessionSink) -> SlotLease:
        self._arrived += 1
        if self._arrived >= self.expected:
            self._all_here.set()
        await self._all_here.wait()
        return await super().admit(request, sink)


async def _first_message_and_close(client: ClientConnection) -> tuple[bytes, int | None]:
    """The client's first message, and the close code when the server then closes (None: still open)."""
    first = await client.recv()
    if first != bytes([MessageKind.HANDSHAKE]):
        with contextlib.suppress(ConnectionClosed):
            while True:
                await client.recv()
    return first, client.close_code


async def test_two_handshakes_at_once_with_one_token_open_one_session(redis_server) -> None:
    """Two upgrades with one token, both past the access check before either spends it (the backend holds
    the admissions until both are there): one session opens, the other is refused after the upgrade with
    a 0x05 ``replayed`` error and 1008, and its slot is given back.

    Planted bug: ``RedisReplayGuard.spend`` ignoring ``SET NX``'s answer — fails on it: both sessions open
    (two 0x00 handshakes)."""
    backend = _HeldAdmissions(2)
    settings = {
        "auth_mode": "token",
        "token_keys": json.dumps({KEY.kid: KEY.secret.decode()}),
        "token_audience": AUDIENCE,
        "token_replay_check": "redis",
        "redis_url": redis_server.url,
    }
    value = mint_token(KEY, ttl_s=60, personas=["*"], audience=AUDIENCE)
    async with fake_node(backend, **settings) as server:
        clients = await asyncio.gather(*(connect(chat(server, token=value)) for _ in range(2)))
        try:
            async with asyncio.timeout(30):  # a bound on a hang, not a latency
                outcomes = await asyncio.gather(*(_first_message_and_close(c) for c in clients))
            released_while_open = list(backend.released)  # before the live session's client leaves
        finally:
            await asyncio.gather(*(c.close() for c in clients))
        opened = [o for o in outcomes if o[0] == bytes([MessageKind.HANDSHAKE])]
        assert len(opened) == 1, f"{len(opened)} sessions opened with one token: {outcomes}"
        ((error, code),) = [o for o in outcomes if o not in opened]
        assert error.startswith(bytes([MessageKind.ERROR]) + b"replayed: ") and code == 1008, (error, code)
        assert len(backend.requests) == 2 and len(released_while_open) == 1  # the refused one's slot
        refused = server.metrics.registry.get_sample_value(
            "duplex_admissions_refused_total", {"reason": "replayed"}
        )
        assert refused == 1
        assert server.metrics.registry.get_sample_value("duplex_sessions_started_total") == 1


# --- settings ---------------------------------------------------------------------------------------------


def test_config_reads_keys_from_env_or_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUPLEX_TOKEN_KEYS", json.dumps({"a": "s" * 32, "b": "t" * 32}))
    monkeypatch.setenv("DUPLEX_ALLOWED_ORIGINS", "https://App.example.com/, http://localhost:3000")
    config = RuntimeConfig()
    assert config.auth_mode == "token" and config.token_replay_check == "redis"
    assert [k.kid for k in config.signing_keys()] == ["a", "b"]
    assert "s" * 32 not in repr(config) and "s" * 32 not in str(config.model_dump())
    assert config.allowed_origins == ["https://app.example.com", "http://localhost:3000"]
    monkeypatch.delenv("DUPLEX_TOKEN_KEYS")
    key_file = tmp_path / "keys.json"
    key_file.write_text(json.dumps({"file-key": "f" * 32}))
    monkeypatch.setenv("DUPLEX_TOKEN_KEYS_FILE", str(key_file))
    assert [k.kid for k in RuntimeConfig().signing_keys()] == ["file-key"]
    assert [k.kid for k in load_key_file(key_file)] == ["file-key"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "DUPLEX_AUTH_MODE=token needs signing keys"),
        ({"token_keys_file": "/nonexistent/keys.json"}, "DUPLEX_TOKEN_KEYS_FILE: cannot read"),
        ({"token_keys": json.dumps({"k": "s" * 32})}, "needs DUPLEX_REDIS_URL"),
        (
            {
                "token_keys": json.dumps({"k": "s" * 32}),
                "token_keys_file": "/x.json",
                "token_replay_check": "off",
            },
            "not both",
        ),
    ],
)
def test_access_settings_are_checked_when_a_server_is_built(settings: dict, message: str) -> None:
    config = RuntimeConfig(**settings)  # parses: a config without keys can be built and inspected
    with pytest.raises(ValueError, match=message):
        config.check_access_control()


def test_access_settings_that_pass() -> None:
    keys = json.dumps({"k": "s" * 32})
    RuntimeConfig(auth_mode="off").check_access_control()
    RuntimeConfig(token_keys=keys, token_replay_check="memory").check_access_control()
    RuntimeConfig(token_keys=keys, redis_url="redis://127.0.0.1:6379/0").check_access_control()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("token_keys", "{not json", "must be JSON"),
        ("token_keys", json.dumps({"k": "short"}), "at least 32 bytes"),
        ("token_keys", json.dumps({}), "non-empty JSON object"),
        ("auth_mode", "maybe", "'token' or 'off'"),
        ("token_replay_check", "disk", "'redis', 'redis-or-memory', 'memory' or 'off'"),
        ("allowed_origins", "ftp://files.example.com", "scheme http or https"),
        ("allowed_origins", "https://app.example.com/path", "scheme://host[:port]"),
    ],
)
def test_bad_access_settings_name_the_field(field: str, value: str, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        RuntimeConfig(**{field: value})
    assert field in str(info.value) and message in str(info.value)
    assert "short" not in str(info.value)  # a rejected secret is never echoed


def test_serve_without_keys_exits_2_naming_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DUPLEX_TOKEN_KEYS", "DUPLEX_TOKEN_KEYS_FILE", "DUPLEX_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(app, ["serve"])
    assert result.exit_code == 2
    assert "DUPLEX_TOKEN_KEYS" in result.output and "DUPLEX_AUTH_MODE=off" in result.output


# --- the duplex token commands ----------------------------------------------------------------------------


def test_keygen_then_mint(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["token", "keygen", "--kid", "rotation-2"])
    assert result.exit_code == 0, result.output
    generated = json.loads(result.stdout)
    assert list(generated) == ["rotation-2"] and len(generated["rotation-2"]) >= 32
    key_file = tmp_path / "token_keys.json"
    key_file.write_text(json.dumps({"rotation-1": "r" * 32, **generated}))

    args = ["token", "mint", "--key-file", str(key_file), "--kid", "rotation-2", "--audience", AUDIENCE]
    result = runner.invoke(app, [*args, "--ttl-s", "120", "--persona", "alice", "--max-session-s", "30"])
    assert result.exit_code == 0, result.output
    keys = load_key_file(key_file)
    claims = TokenVerifier(keys, AUDIENCE).verify(result.stdout.strip())
    assert claims.kid == "rotation-2" and claims.personas == ("alice",) and claims.max_session_s == 30
    assert claims.expires_at - claims.issued_at == 120

    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert TokenVerifier(keys, AUDIENCE).verify(result.stdout.strip()).personas == ("*",)  # default: any

    single = tmp_path / "one.json"
    single.write_text(json.dumps(generated))
    result = runner.invoke(app, ["token", "mint", "--key-file", str(single), "--audience", AUDIENCE])
    assert (
        result.exit_code == 0
        and TokenVerifier(keys, AUDIENCE).verify(result.stdout.strip()).kid == "rotation-2"
    )


def test_mint_with_bad_input_exits_2(tmp_path: Path) -> None:
    runner = CliRunner()
    two = tmp_path / "two.json"
    two.write_text(json.dumps({"a": "a" * 32, "b": "b" * 32}))
    result = runner.invoke(app, ["token", "mint", "--key-file", str(two)])
    assert result.exit_code == 2 and "--kid" in result.output
    result = runner.invoke(app, ["token", "mint", "--key-file", str(two), "--kid", "c"])
    assert result.exit_code == 2 and "no key 'c'" in result.output
    result = runner.invoke(app, ["token", "mint", "--key-file", str(tmp_path / "missing.json")])
    assert result.exit_code == 2 and "cannot read" in result.output
    result = runner.invoke(app, ["token", "mint", "--key-file", str(two), "--kid", "a", "--ttl-s", "0"])
    assert result.exit_code == 2 and "ttl_s" in result.output


# --- the node's token secrets -----------------------------------------------------------------------------


def test_node_secrets_carry_a_signing_key_the_runtime_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node_secrets = NodeSecrets.generate()
    (kid, secret), *_ = node_secrets.token_keys.items()
    assert secret not in repr(node_secrets) and len(secret) >= 32
    assert NodeSecrets.generate().token_keys != node_secrets.token_keys
    with pytest.raises(ValueError, match="at least one session-token signing key"):
        NodeSecrets(redis_password="p" * 20, grafana_admin_password="g" * 20)
    with pytest.raises(ValueError, match="at least 32 bytes"):
        NodeSecrets(redis_password="p" * 20, grafana_admin_password="g" * 20, token_keys={"k": "short"})

    profile = PROFILES["local"]
    files = secret_files(profile, node_secrets)
    assert json.loads(files[SECRET_FILES["token_keys"]]) == {kid: secret}
    settings = runtime_settings(profile)
    assert settings["DUPLEX_AUTH_MODE"] == "token"
    assert settings["DUPLEX_TOKEN_KEYS_FILE"] == SECRET_FILES["token_keys"]  # relative to the node dir
    assert settings["DUPLEX_TOKEN_AUDIENCE"] == token_audience(profile) == profile.domain
    assert settings["DUPLEX_ALLOWED_ORIGINS"] == f"https://localhost:{profile.ports.https}"
    assert secret not in json.dumps(settings)
    # The runtime, started in the node directory with these settings, loads the key.
    (tmp_path / "secrets").mkdir()
    (tmp_path / SECRET_FILES["token_keys"]).write_bytes(files[SECRET_FILES["token_keys"]])
    (tmp_path / SECRET_FILES["app_token_keys"]).write_bytes(files[SECRET_FILES["app_token_keys"]])
    monkeypatch.chdir(tmp_path)
    config = RuntimeConfig(
        **{k.removeprefix("DUPLEX_").lower(): v for k, v in settings.items()},
        redis_url="redis://127.0.0.1:6390/0",
    )
    config.check_access_control()
    token = mint_token(
        node_secrets.signing_keys()[0], ttl_s=60, personas=["*"], audience=token_audience(profile)
    )
    assert TokenVerifier(config.signing_keys(), config.token_audience).verify(token).kid == kid
    assert config.allowed_origins == [f"https://localhost:{profile.ports.https}"]
    assert runtime_settings(PROFILES["l40s"])["DUPLEX_TOKEN_KEYS_FILE"] == "/run/secrets/token_keys"
    # The sessions API's keys are the node's own, not the session keys (issue 34, item 8): an application
    # token minted with the session key is refused, one minted with the application key read.
    from runtime.frontend.gate.app_tokens import mint_app_token, verify_app_token
    from runtime.frontend.gate.tokens import TokenRejected
    from runtime.frontend.gate.verifiers import app_token_verifier

    assert settings["DUPLEX_APP_TOKEN_KEYS_FILE"] == SECRET_FILES["app_token_keys"]
    assert set(node_secrets.app_token_keys).isdisjoint(node_secrets.token_keys)
    app_verifier = app_token_verifier(config)
    assert app_verifier is not None
    app_key, session_key = node_secrets.app_signing_keys()[0], node_secrets.signing_keys()[0]
    good = mint_app_token(app_key, ttl_s=60, audience=token_audience(profile))
    assert verify_app_token(app_verifier, good, "sessions:read").kid == app_key.kid
    forged = mint_app_token(session_key, ttl_s=60, audience=token_audience(profile))
    with pytest.raises(TokenRejected):
        verify_app_token(app_verifier, forged, "sessions:read")
    with pytest.raises(ValueError, match="must not be a session key"):
        NodeSecrets(
            redis_password="p" * 20,
            grafana_admin_password="g" * 20,
            token_keys={kid: secret},
            app_token_keys={"app": secret},
        )


def test_an_application_token_past_the_lifetime_cap_is_refused() -> None:
    """Issue 34, item 7, for the sessions API's tokens too: a ten-year application token was accepted."""
    from runtime.frontend.gate.app_tokens import verify_app_token

    forever = _signed(_payload(exp=int(time.time()) + 10 * 365 * 86400, scope="sessions:read"))
    with pytest.raises(TokenRejected) as exc:
        verify_app_token(TokenVerifier([KEY], AUDIENCE), forever, "sessions:read")
    assert exc.value.reason == "lifetime_too_long"
    day = _signed(_payload(exp=int(time.time()) + 3600, scope="sessions:read"))
    assert verify_app_token(TokenVerifier([KEY], AUDIENCE), day, "sessions:read").scopes == {"sessions:read"}
