"""TURN REST credentials (runtime/frontend/transports/webrtc/turn.py) and the runtime's TURN settings
(runtime/config.py)."""

from __future__ import annotations

import base64
import shutil
import subprocess

import pytest
from pydantic import ValidationError

from runtime.config import RuntimeConfig
from runtime.frontend.transports.webrtc.turn import (
    IceServer,
    check_turn_url,
    ice_servers,
    mint_turn_credentials,
)

SECRET = b"s" * 32


def test_password_is_hmac_sha1_of_the_username_as_openssl_computes_it():
    """The password checked against an independent implementation (OpenSSL's HMAC), not against itself.
    Planted bugs it catches: SHA-256 instead of SHA-1, secret and message swapped, hex instead of base64."""
    credentials = mint_turn_credentials(SECRET, "abc123", ttl_s=600, now=1_700_000_000.9)
    assert credentials.username == "1700000600:abc123"
    assert credentials.expires_at == 1_700_000_600
    openssl = shutil.which("openssl")
    assert openssl, "openssl (Debian's openssl package) computes the reference HMAC"
    digest = subprocess.run(
        [openssl, "dgst", "-sha1", "-binary", "-hmac", SECRET.decode()],
        input=credentials.username.encode(),
        capture_output=True,
        check=True,
    ).stdout
    assert credentials.password == base64.b64encode(digest).decode()


@pytest.mark.parametrize(
    ("secret", "session_id", "ttl_s", "names"),
    [
        (b"short", "abc", 60, "at least 32 bytes"),
        (SECRET, "a:b", 60, "session id 'a:b'"),
        (SECRET, "", 60, "session id ''"),
        (SECRET, "abc", 0, "ttl_s must be >= 1"),
    ],
)
def test_bad_minting_input_is_refused_by_name(secret, session_id, ttl_s, names):
    with pytest.raises(ValueError, match=names):
        mint_turn_credentials(secret, session_id, ttl_s, now=0)


@pytest.mark.parametrize(
    "url",
    [
        "turn:node.example.com:3478?transport=udp",
        "turns:node.example.com:5349?transport=tcp",
        "turn:[2001:db8::1]:3478",
        "stun:127.0.0.1:3478",
    ],
)
def test_turn_and_stun_urls_are_accepted(url):
    assert check_turn_url(url) == url


@pytest.mark.parametrize(
    "url",
    [
        "http://node:3478",
        "turn:node:70000",
        "turn:node:3478?transport=sctp",
        "stun:node?transport=udp",
        "turn:",
    ],
)
def test_other_urls_are_refused_with_the_allowed_form(url):
    with pytest.raises(ValueError, match="TURN/STUN URL|takes no transport"):
        check_turn_url(url)


def test_ice_servers_give_turn_urls_the_credentials_and_stun_urls_none():
    credentials = mint_turn_credentials(SECRET, "s1", ttl_s=60, now=0)
    servers = ice_servers(
        ["stun:n:3478", "turn:n:3478?transport=udp", "turns:n:5349?transport=tcp"], credentials
    )
    assert servers == [
        IceServer(("stun:n:3478",)),
        IceServer(("turn:n:3478?transport=udp", "turns:n:5349?transport=tcp"), "60:s1", credentials.password),
    ]
    assert servers[0].as_json() == {"urls": ["stun:n:3478"]}
    assert servers[1].as_json()["credential"] == credentials.password
    assert ice_servers(["turn:n:3478"], None) == []  # no secret: no relay offered


def test_runtime_config_reads_turn_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("DUPLEX_TURN_SECRET", "x" * 40)
    monkeypatch.setenv("DUPLEX_TURN_URLS", "turn:n:3478?transport=udp, turns:n:5349?transport=tcp")
    config = RuntimeConfig(auth_mode="off")
    assert config.turn_urls == ["turn:n:3478?transport=udp", "turns:n:5349?transport=tcp"]
    assert config.turn_secret is not None and config.turn_secret.get_secret_value() == "x" * 40


@pytest.mark.parametrize(
    ("field", "value", "names"),
    [("turn_secret", "short", "at least 32 bytes"), ("turn_urls", "http://n", "not a TURN/STUN URL")],
)
def test_runtime_config_refuses_bad_turn_settings_by_name(field, value, names):
    with pytest.raises(ValidationError, match=names) as caught:
        RuntimeConfig(auth_mode="off", **{field: value})
    assert field in str(caught.value)
