"""Tests written to kill the mutants that survived TURN's first mutation run (issue 31:
``make mutation MODULE=runtime/frontend/transports/webrtc/turn.py``): the browser's ``RTCIceServer`` shape
exactly, and the shortest validity allowed. The other two survivors are equivalent (``"ASCII"`` and
``"ascii"`` name one codec): docs/mutation.md."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from runtime.frontend.transports.webrtc.turn import IceServer, mint_turn_credentials


def test_an_ice_server_has_the_browsers_shape() -> None:
    turn = IceServer(("turn:relay.example.com:3478?transport=udp",), "1800000000:abc", "c3VwZXI=")
    assert turn.as_json() == {
        "urls": ["turn:relay.example.com:3478?transport=udp"],
        "username": "1800000000:abc",
        "credential": "c3VwZXI=",
    }
    assert IceServer(("stun:relay.example.com:3478",)).as_json() == {"urls": ["stun:relay.example.com:3478"]}


def test_credentials_may_live_one_second_and_no_less() -> None:
    credentials = mint_turn_credentials(b"s" * 32, "abc", 1, 1_800_000_000.5)
    assert credentials.username == "1800000001:abc" and credentials.expires_at == 1_800_000_001
    expected = hmac.new(b"s" * 32, b"1800000001:abc", hashlib.sha1).digest()
    assert credentials.password == base64.b64encode(expected).decode()
    with pytest.raises(ValueError, match="ttl_s must be >= 1 s, got 0"):
        mint_turn_credentials(b"s" * 32, "abc", 0, 1_800_000_000.0)
