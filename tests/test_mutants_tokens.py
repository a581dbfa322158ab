"""Tests that kill mutants of runtime/frontend/gate/tokens.py that tests/test_tokens.py let survive
(``make mutation MODULE=runtime/frontend/gate/tokens.py``; docs/mutation.md). Each docstring names its
mutants.

Several pin the exact refusal and error texts: they are what a caller or an operator reads (the 401/403
body, ``duplex token`` and the runtime's start-up errors)."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

import jwt
import pytest

from runtime.frontend.gate.tokens import (
    MAX_TTL_S,
    REFUSAL_STATUS,
    SigningKey,
    TokenRejected,
    TokenVerifier,
    generate_signing_key,
    keys_from_mapping,
    load_key_file,
    mint_token,
)

AUDIENCE = "node.example.com"
KEY = SigningKey("k1", "a" * 32)


def signed(headers: dict[str, Any] | None = None, **claims: Any) -> str:
    """A token signed with ``KEY`` whose claims are valid unless overridden (``None`` drops one)."""
    now = int(time.time())
    payload = {"aud": AUDIENCE, "iat": now, "nbf": now, "exp": now + 60, "jti": "j1", "personas": ["*"]}
    payload.update(claims)
    payload = {k: v for k, v in payload.items() if v is not None}
    return jwt.encode(payload, KEY.secret, algorithm="HS256", headers={"kid": "k1", **(headers or {})})


def refusal(token: str) -> TokenRejected:
    with pytest.raises(TokenRejected) as info:
        TokenVerifier([KEY], AUDIENCE).verify(token)
    return info.value


def test_an_unknown_refusal_reason_lists_the_known_ones():
    """Kills ``TokenRejected.__init__``: ``', '.join(REFUSAL_STATUS)`` -> ``'XX, XX'.join``."""
    with pytest.raises(ValueError) as info:
        TokenRejected("nope", "x")
    assert str(info.value) == f"unknown refusal reason 'nope'; allowed: {', '.join(REFUSAL_STATUS)}"


def test_a_key_takes_bytes_and_refuses_a_secret_that_is_neither_bytes_nor_text():
    """Kills ``SigningKey.__init__``: ``secret.encode() if isinstance(secret, str)`` -> ``... or True`` (a
    bytes secret has no ``encode``), ``len(raw) if isinstance(raw, bytes)`` -> ``... or True`` and ``else 0``
    -> ``else 1``, and the changed "(`duplex token keygen` makes one)" text."""
    assert SigningKey("k", b"s" * 32).secret == b"s" * 32
    with pytest.raises(ValueError) as info:
        SigningKey("k", None)  # type: ignore[arg-type]
    assert str(info.value) == (
        "signing key 'k': the secret must be at least 32 bytes, got 0 (`duplex token keygen` makes one)"
    )


def test_keys_compare_and_hash_by_kid_and_secret():
    """Kills ``SigningKey.__eq__``: ``and`` -> ``or`` (comparing with a non-key raises) and ``==`` -> ``!=``,
    and ``SigningKey.__hash__``: ``hash((kid, secret))`` -> ``hash(None)``."""
    same = SigningKey("k1", "a" * 32)
    other = SigningKey("k1", "b" * 32)
    assert same == KEY and other != KEY and KEY != "k1"
    assert hash(KEY) == hash(same) and hash(KEY) != hash(other)
    assert len({KEY, same, other}) == 2


def test_a_generated_key_is_key_8hex_with_43_characters_of_secret():
    """Kills ``generate_signing_key``: ``token_hex(4)`` -> ``token_hex(5)`` and ``token_urlsafe(32)`` ->
    ``token_urlsafe(33)``."""
    key = generate_signing_key()
    assert re.fullmatch(r"key-[0-9a-f]{8}", key.kid)
    assert len(key.secret) == 43


def test_key_mapping_and_key_file_errors_name_their_source(tmp_path: Path):
    """Kills ``keys_from_mapping``: the default ``source="signing keys"`` changed and the non-string secret's
    message -> ``None``; ``load_key_file``: ``exc.strerror or exc`` -> ``and``, the not-JSON message ->
    ``None``, and ``source=f"key file {path}"`` -> ``None`` or left out."""
    with pytest.raises(ValueError) as info:
        keys_from_mapping({"k1": 5})  # type: ignore[dict-item]
    assert str(info.value) == "signing keys: the secret of key 'k1' must be a string"
    missing = tmp_path / "missing.json"
    with pytest.raises(ValueError) as info:
        load_key_file(missing)
    assert str(info.value) == f"cannot read the key file {missing}: No such file or directory"
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError) as info:
        load_key_file(bad)
    assert str(info.value).startswith(f"key file {bad} is not JSON (line 1): ")
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"k1": "short"}))
    with pytest.raises(ValueError) as info:
        load_key_file(short)
    assert str(info.value).startswith(f"key file {short}: signing key 'k1': the secret must be at least 32")


def test_verifier_defaults_and_construction_errors():
    """Kills ``TokenVerifier.__init__``: the default ``leeway_s=5.0`` -> ``6.0`` and the changed texts of
    "at least one signing key", "audience must not be empty" and "leeway_s must be >= 0 s"."""
    assert TokenVerifier([KEY], AUDIENCE).leeway_s == 5.0
    for args, message in (
        (([], AUDIENCE), "a token verifier needs at least one signing key"),
        (([KEY], ""), "the token audience must not be empty"),
        (([KEY], AUDIENCE, -1), "leeway_s must be >= 0 s, got -1"),
    ):
        with pytest.raises(ValueError) as info:
            TokenVerifier(*args)
        assert str(info.value) == message


def test_an_empty_kid_is_malformed_not_an_unknown_key():
    """Kills ``verify``: ``not isinstance(kid, str) or not kid`` -> ``and`` (an empty kid would be looked up
    and refused as ``unknown_key``), and the changed "no kid header" text."""
    exc = refusal(signed(headers={"kid": ""}))
    assert exc.reason == "malformed"
    assert exc.detail == "the token has no kid header naming its signing key"


def test_an_expired_token_says_to_mint_a_new_one():
    """Kills ``verify``: the changed "the token has expired: mint a new one" text."""
    now = int(time.time())
    exc = refusal(signed(iat=now - 600, nbf=now - 600, exp=now - 60))
    assert exc.reason == "expired" and exc.detail == "the token has expired: mint a new one"


def test_a_persona_refusal_lists_the_allowed_ones():
    """Kills ``check_persona``: ``', '.join(claims.personas)`` -> ``'XX, XX'.join``."""
    claims = TokenVerifier([KEY], AUDIENCE).verify(signed(personas=["alice", "bob"]))
    with pytest.raises(TokenRejected) as info:
        TokenVerifier.check_persona(claims, "carol")
    assert info.value.detail == "the token does not allow voice_prompt='carol'; it allows alice, bob"


def test_a_jti_with_a_space_is_malformed():
    """Kills ``_claims_from_payload``: ``not isinstance(jti, str) or not _JTI_RE.match(jti)`` -> ``and``, and
    every change to that refusal's reason and text (no other test had a bad jti)."""
    exc = refusal(signed(jti="has space"))
    assert exc.reason == "malformed"
    assert exc.detail == "jti must be 1-128 printable ASCII characters without spaces"


def test_a_persona_with_a_space_is_malformed():
    """Kills ``_claims_from_payload``: ``isinstance(p, str) and _PERSONA_RE.match(p)`` -> ``or``, and the
    changed personas text."""
    exc = refusal(signed(personas=["has space"]))
    assert exc.reason == "malformed"
    assert exc.detail == 'personas must be a non-empty list of voice prompt names, or ["*"]'


@pytest.mark.parametrize("value", [True, "10", 0, math.inf])
def test_max_session_s_must_be_a_positive_finite_number(value: Any):
    """Kills ``_claims_from_payload``: ``isinstance(bool) or not isinstance(int | float)`` -> ``and`` (True
    and "10"), ``0 < max_session_s`` -> ``0 <=`` (0), ``< math.inf`` -> ``<= math.inf`` (inf), and the
    changed text."""
    exc = refusal(signed(max_session_s=value))
    assert exc.reason == "malformed"
    assert exc.detail == "max_session_s must be a positive number of seconds"


def test_half_a_second_is_a_valid_session_length():
    """Kills ``_claims_from_payload``: ``0 < max_session_s`` -> ``1 <``."""
    claims = TokenVerifier([KEY], AUDIENCE).verify(signed(max_session_s=0.5))
    assert claims.max_session_s == 0.5


def test_a_list_audience_is_joined_with_commas():
    """Kills ``_claims_from_payload``: ``audience if isinstance(audience, str)`` -> ``... or True`` (a list
    would be kept), ``",".join(audience)`` -> ``join(None)`` and ``"XX,XX".join``."""
    claims = TokenVerifier([KEY], AUDIENCE).verify(signed(aud=[AUDIENCE, "other"]))
    assert claims.audience == f"{AUDIENCE},other"


def test_a_half_second_ttl_mints_a_token_of_one_second():
    """Kills ``mint_token``: ``0 < ttl_s`` -> ``1 < ttl_s`` and ``max(1, ceil(ttl_s))`` -> ``max(2, ...)``."""
    token = mint_token(KEY, ttl_s=0.5, personas=["*"], audience=AUDIENCE, now=1000)
    payload = jwt.decode(token, options={"verify_signature": False})
    assert payload["exp"] - payload["iat"] == 1


def test_an_infinite_session_length_is_refused_at_minting():
    """Kills ``mint_token``: ``max_session_s < math.inf`` -> ``<= math.inf``."""
    with pytest.raises(ValueError, match="max_session_s must be a positive number of seconds"):
        mint_token(KEY, ttl_s=60, personas=["*"], audience=AUDIENCE, max_session_s=math.inf)


def test_mint_refusal_texts():
    """Kills ``mint_token``: the changed "audience must not be empty (the node's DUPLEX_TOKEN_AUDIENCE)" and
    "token_id must be 1-128 printable ASCII characters without spaces" texts."""
    for kwargs, message in (
        ({"audience": ""}, "audience must not be empty (the node's DUPLEX_TOKEN_AUDIENCE)"),
        ({"token_id": "a b"}, "token_id must be 1-128 printable ASCII characters without spaces"),
    ):
        args: dict[str, Any] = {"ttl_s": 60, "personas": ["*"], "audience": AUDIENCE, **kwargs}
        with pytest.raises(ValueError) as info:
            mint_token(KEY, **args)
        assert str(info.value) == message


def test_a_default_token_id_is_128_random_bits():
    """Kills ``mint_token``: ``secrets.token_urlsafe(16)`` -> ``token_urlsafe(None)`` (32 bytes) and ``17``:
    16 bytes are 22 URL-safe characters."""
    token = mint_token(KEY, ttl_s=60, personas=["*"], audience=AUDIENCE)
    assert len(jwt.decode(token, options={"verify_signature": False})["jti"]) == 22


def test_the_longest_ttl_and_a_sub_second_session_length_mint():
    """Kills ``mint_token``: ``ttl_s <= MAX_TTL_S`` -> ``<`` and ``0 < max_session_s`` -> ``1 <`` (both
    survived the rerun of 2026-11-26; written after it)."""
    token = mint_token(KEY, ttl_s=MAX_TTL_S, personas=["*"], audience=AUDIENCE, max_session_s=0.5, now=1000)
    payload = jwt.decode(token, options={"verify_signature": False})
    assert payload["exp"] - payload["iat"] == MAX_TTL_S and payload["max_session_s"] == 0.5
