"""Session tokens without a server: minting, every refusal reason of the verifier, key rotation, the
in-memory replay guard, the access settings of ``RuntimeConfig``, the ``duplex token`` commands and the
node's token secrets."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import jwt
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from infra.node.profile import PROFILES
from infra.node.services import SECRET_FILES, NodeSecrets, runtime_settings, secret_files, token_audience
from runtime.config import RuntimeConfig
from runtime.frontend.replay import MemoryReplayGuard
from runtime.frontend.tokens import (
    REFUSAL_STATUS,
    SigningKey,
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
    from runtime.frontend.replay import RedisReplayGuard

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
