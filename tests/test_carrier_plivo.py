"""The Plivo Audio Streams bridge (issue 32): ``/api/carriers/plivo`` on the carrier-generic edge, driven by
Plivo's side (``runtime.tools.carrier_sides.PlivoSide``) over the fake backend (``tests/fake_backend.py``:
each slot echoes the caller's frames), so what the caller hears is what it said.

The V3 signature is checked against the algorithm as Plivo's documentation states it (HMAC-SHA256 of the
URL with its query sorted, a ``.`` and the nonce; base64), computed here with ``hmac`` directly, not with
this project's function. No timing assertions: waits are bounded, never measured.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

import numpy as np
import pytest
from fake_backend import FakeBackend
from test_carrier_twilio import TOKEN_MODE, _TalkingBackend, base, dominant_hz, refused_count, token, tone_8k
from test_frontend_seam import fake_node

from runtime.config import RuntimeConfig
from runtime.frontend.gate.carrier_auth import plivo_signature, plivo_signature_valid
from runtime.frontend.transports.carriers.plivo import extra_headers
from runtime.tools.carrier_client import carrier_call
from runtime.tools.carrier_sides import PlivoSide

AUTH_TOKEN = "MjA3ZDQ5ZTUtYjM0Yy00ZjVmLWI2NWItZTA4"
STREAM_URL = "wss://voice.example.com/api/carriers/plivo"
PLIVO = {"plivo_auth_token": AUTH_TOKEN, "plivo_stream_url": STREAM_URL}


async def plivo_call(server, caller: np.ndarray, **kwargs):  # type: ignore[no-untyped-def]
    return await carrier_call(
        PlivoSide(), base(server), caller, secret=AUTH_TOKEN, stream_url=STREAM_URL, **kwargs
    )


# --- the signature ---------------------------------------------------------------------------------------


def test_the_v3_signature_is_the_one_plivos_documentation_describes():
    """Plivo's "Validation" page: HMAC-SHA256 keyed with the auth token over the URL (a GET's query sorted
    by name) + "." + the nonce, base64; the header may list several signatures, comma-separated."""
    nonce = "05429567804466091622"
    url = STREAM_URL + "?voice_prompt=NATF2.pt&token=abc.def"
    message = f"{STREAM_URL}?token=abc.def&voice_prompt=NATF2.pt.{nonce}".encode()
    expected = base64.b64encode(hmac.new(AUTH_TOKEN.encode(), message, hashlib.sha256).digest()).decode()
    assert plivo_signature(AUTH_TOKEN, url, nonce) == expected
    assert plivo_signature_valid(AUTH_TOKEN, url, nonce, expected)
    assert plivo_signature_valid(AUTH_TOKEN, url, nonce, f"c29tZXRoaW5nIGVsc2U=, {expected}")  # rotation
    assert not plivo_signature_valid(AUTH_TOKEN, url, "05429567804466091623", expected)  # another nonce
    assert not plivo_signature_valid("another-token", url, nonce, expected)
    assert not plivo_signature_valid(AUTH_TOKEN, STREAM_URL + "?token=abc.deg", nonce, expected)
    assert not plivo_signature_valid(AUTH_TOKEN, url, None, expected)
    assert not plivo_signature_valid(AUTH_TOKEN, url, nonce, None)
    bare = base64.b64encode(
        hmac.new(AUTH_TOKEN.encode(), f"{STREAM_URL}.{nonce}".encode(), hashlib.sha256).digest()
    ).decode()
    assert plivo_signature(AUTH_TOKEN, STREAM_URL, nonce) == bare  # no query: no "?"


@pytest.mark.parametrize(
    ("settings", "signature", "status", "reason"),
    [
        (PLIVO, "", 403, "carrier_signature"),  # no headers
        (PLIVO, "bm90IGEgc2lnbmF0dXJl", 403, "carrier_signature"),  # a wrong signature, the right nonce
        ({}, None, 404, "carrier_off"),  # the node has no Plivo secret: the route is off
    ],
    ids=["no-signature", "wrong-signature", "bridge-off"],
)
async def test_a_stream_not_signed_by_the_account_is_refused_before_the_upgrade(
    settings, signature, status, reason
):
    backend = FakeBackend(slots=1)
    async with fake_node(backend, **settings) as server:
        result = await plivo_call(server, tone_8k(440, 0.2), signature=signature)
        assert result.status == status and result.close_reason.startswith(f"{reason}: ")
        assert refused_count(server, reason) == 1
        assert backend.requests == []  # no admission was even tried


async def test_a_query_changed_after_signing_is_refused():
    """The signature covers the stream URL's query (the token and persona travel there)."""
    side = PlivoSide()
    query, headers = side.upgrade(AUTH_TOKEN, STREAM_URL, {"voice_prompt": "alice"})
    backend = FakeBackend(slots=1)
    async with fake_node(backend, **PLIVO) as server:
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidStatus

        with pytest.raises(InvalidStatus) as refused:
            url = f"{base(server)}/api/carriers/plivo?{query.replace('alice', 'mallory')}"
            async with connect(url, additional_headers=headers):
                pass
        assert refused.value.response.status_code == 403


# --- a call ----------------------------------------------------------------------------------------------


async def test_a_call_hears_itself_and_stop_frees_the_slot():
    """The caller's 440 Hz comes back as 440 Hz μ-law in ``playAudio`` messages, one ``checkpoint`` per
    80 ms frame (echoed as ``playedStream``); the persona from the stream URL's query reaches admission;
    ``stop`` ends the call normally and releases the slot."""
    backend = FakeBackend(slots=1)
    async with fake_node(backend, **PLIVO) as server:
        result = await plivo_call(
            server, tone_8k(440, 1.6), parameters={"voice_prompt": "alice"}, keep_messages=400
        )
        assert result.failure == "" and result.close_code == 1000, result
        assert backend.requests[0].voice_prompt == "alice"
        assert len(backend.released) == 1 and backend.leases == {}
        heard = result.received_pcm()[-4000:]
        assert abs(dominant_hz(heard) - 440) < 20 and np.sqrt(np.mean(heard**2)) > 0.1
        assert result.marks >= 15 and len(result.received) >= 160 * 4 * (result.marks - 2)
        play = next(m for m in result.received_messages if m["event"] == "playAudio")
        assert play["media"]["contentType"] == "audio/x-mulaw" and play["media"]["sampleRate"] == 8000
        stream_id = result.sent_messages[0]["start"]["streamId"]
        assert play["streamId"] == stream_id
        checkpoint = next(m for m in result.received_messages if m["event"] == "checkpoint")
        assert checkpoint == {"event": "checkpoint", "streamId": stream_id, "name": "frame-1"}
        samples = server.metrics.registry.get_sample_value
        assert samples("duplex_transport_sessions_started_total", {"transport": "plivo"}) == 1


async def test_the_token_comes_in_the_stream_urls_query_and_extra_headers_name_the_persona():
    """Plivo's ``extraHeaders`` take letters and digits only: the token travels in the signed query; a
    voice named in ``extra_headers`` wins over the query's. A missing token is refused after the upgrade
    with the refusal table's close code, counted once."""

    class _Headers(PlivoSide):
        def opening(self, ids, parameters, media_format):  # type: ignore[no-untyped-def]
            messages = super().opening(ids, parameters, media_format)
            messages[0]["extra_headers"] = "voiceprompt=x;voice_prompt=bob"
            return messages

    backend = FakeBackend(slots=1, voices=("alice", "bob"))
    async with fake_node(backend, **PLIVO, **TOKEN_MODE) as server:
        missing = await plivo_call(server, tone_8k(440, 0.2))
        assert missing.close_code == 1008 and missing.close_reason.startswith("missing:")
        assert refused_count(server, "missing") == 1 and backend.requests == []
        served = await carrier_call(
            _Headers(),
            base(server),
            tone_8k(440, 0.4),
            secret=AUTH_TOKEN,
            stream_url=STREAM_URL,
            parameters={"token": token(), "voice_prompt": "alice", "text_prompt": "You take bookings."},
        )
        assert served.close_code == 1000 and served.marks > 0
        assert backend.requests[0].voice_prompt == "bob"
        assert backend.requests[0].text_prompt == "You take bookings."


def test_extra_headers_parse_both_separators():
    assert extra_headers("userId=12345;sessionId=abcxyz") == {"userId": "12345", "sessionId": "abcxyz"}
    assert extra_headers("test1=12,test2=123") == {"test1": "12", "test2": "123"}
    assert extra_headers("") == {} and extra_headers("novalue;a=1") == {"a": "1"}


async def test_a_media_format_plivo_does_not_offer_is_refused_naming_the_allowed_ones():
    backend = FakeBackend(slots=1)
    async with fake_node(backend, **PLIVO) as server:
        result = await plivo_call(
            server, tone_8k(440, 0.2), media_format={"encoding": "audio/x-alaw", "sampleRate": 8000}
        )
        assert result.close_code == 1008 and "'audio/x-alaw'" in result.close_reason
        assert "audio/x-mulaw at 8000 Hz" in result.close_reason
        assert refused_count(server, "bad_request") == 1 and backend.requests == []


async def test_dtmf_is_counted_and_barge_in_sends_clear_audio_once_per_onset():
    backend = _TalkingBackend(slots=1)
    async with fake_node(backend, **PLIVO) as server:
        silence = np.zeros(4000, dtype=np.float32)
        speech = tone_8k(440, 0.5)
        caller = np.concatenate([silence, speech, silence, speech])
        loud = await plivo_call(server, caller, dtmf=((10, "5"),), keep_messages=2000)
        assert loud.clears == 2
        clear = next(m for m in loud.received_messages if m["event"] == "clearAudio")
        assert clear == {"event": "clearAudio", "streamId": loud.sent_messages[0]["start"]["streamId"]}
        samples = server.metrics.registry.get_sample_value
        assert samples("duplex_carrier_barge_ins_total", {"carrier": "plivo"}) == 2
        assert samples("duplex_carrier_dtmf_total", {"carrier": "plivo"}) == 1


# --- the load generator and the settings -----------------------------------------------------------------


async def test_the_phone_load_generator_places_plivo_calls():
    from runtime.tools.loadgen import synthesize_speech
    from runtime.tools.loadgen_phone import run_phone_load

    speech = synthesize_speech("Hello, I would like to book a table for two tonight.")
    backend = FakeBackend(slots=2)
    async with fake_node(backend, **PLIVO) as server:
        report = await run_phone_load(
            "plivo",
            base(server),
            [speech],
            sessions=2,
            secret=AUTH_TOKEN,
            stream_url=STREAM_URL,
            max_duration_s=60,
        )
    assert report.ok and [r.failure for r in report.served] == ["", ""]
    assert all(r.frames_lost() <= 1 and r.first_audio_ms is not None for r in report.served)
    with pytest.raises(ValueError, match="unknown carrier 'vonage'; one of twilio, plivo"):
        await run_phone_load("vonage", "ws://x", [speech], sessions=1, secret="s", stream_url="wss://x")


def test_the_plivo_settings_come_in_pairs(tmp_path):
    with pytest.raises(ValueError, match="the Plivo bridge needs both DUPLEX_PLIVO_AUTH_TOKEN"):
        RuntimeConfig(plivo_auth_token=AUTH_TOKEN)
    with pytest.raises(ValueError, match="set DUPLEX_PLIVO_AUTH_TOKEN or DUPLEX_PLIVO_AUTH_TOKEN_FILE"):
        RuntimeConfig(
            plivo_auth_token=AUTH_TOKEN, plivo_auth_token_file=tmp_path / "t", plivo_stream_url=STREAM_URL
        )
    with pytest.raises(ValueError, match="without a query string"):
        RuntimeConfig(plivo_auth_token=AUTH_TOKEN, plivo_stream_url=STREAM_URL + "?token=x")
    secret = tmp_path / "plivo"
    secret.write_text(AUTH_TOKEN + "\n")
    assert (
        RuntimeConfig(plivo_auth_token_file=secret, plivo_stream_url=STREAM_URL).plivo_secret() == AUTH_TOKEN
    )
    assert RuntimeConfig().plivo_secret() is None
