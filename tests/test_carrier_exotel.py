"""The Exotel voicebot bridge (issue 32): ``/api/carriers/exotel`` on the carrier-generic edge, driven by
Exotel's side (``runtime.tools.carrier_sides.ExotelSide``: 16-bit PCM at 8 kHz) over the fake backend (each
slot echoes the caller's frames). Exotel's Basic auth admits the call (its stream URL's 256 characters hold
no session token), with ``DUPLEX_EXOTEL_PERSONAS`` as the per-carrier persona policy. No timing
assertions: waits are bounded, never measured.
"""

from __future__ import annotations

import numpy as np
import pytest
from fake_backend import FakeBackend
from test_carrier_twilio import TOKEN_MODE, _TalkingBackend, base, dominant_hz, refused_count, tone_8k
from test_frontend_seam import fake_node

from runtime.config import RuntimeConfig
from runtime.tools.carrier_client import carrier_call
from runtime.tools.carrier_sides import ExotelSide

KEY, TOKEN = "exotel-key", "exotel-token-0123456789"
EXOTEL = {"exotel_api_key": KEY, "exotel_api_token": TOKEN, "exotel_personas": "alice"}


async def exotel_call(server, caller: np.ndarray, **kwargs):  # type: ignore[no-untyped-def]
    return await carrier_call(
        ExotelSide(), base(server), caller, secret=f"{KEY}:{TOKEN}", stream_url="unsigned", **kwargs
    )


@pytest.mark.parametrize(
    ("settings", "signature", "status", "reason"),
    [
        (EXOTEL, "", 403, "carrier_signature"),  # no Basic auth
        (EXOTEL, "Basic ZXhvdGVsLWtleTp3cm9uZw==", 403, "carrier_signature"),  # exotel-key:wrong
        (EXOTEL, f"Bearer {TOKEN}", 403, "carrier_signature"),  # not Basic
        ({}, None, 404, "carrier_off"),
    ],
    ids=["no-auth", "wrong-token", "not-basic", "bridge-off"],
)
async def test_a_stream_without_the_accounts_basic_auth_is_refused_before_the_upgrade(
    settings, signature, status, reason
):
    backend = FakeBackend(slots=1)
    async with fake_node(backend, **settings) as server:
        result = await exotel_call(server, tone_8k(440, 0.2), signature=signature)
        assert result.status == status and result.close_reason.startswith(f"{reason}: ")
        assert refused_count(server, reason) == 1
        assert backend.requests == []


async def test_a_call_hears_itself_in_pcm_admitted_on_the_credential_with_access_control_on():
    """With tokens required on the node, an Exotel call holds none and is admitted on the account's Basic
    auth; the caller's 440 Hz comes back as 440 Hz 16-bit PCM, one ``mark`` per frame; ``stop`` frees the
    slot."""
    backend = FakeBackend(slots=1)
    async with fake_node(backend, **EXOTEL, **TOKEN_MODE) as server:
        result = await exotel_call(
            server, tone_8k(440, 1.6), parameters={"voice_prompt": "alice"}, keep_messages=400
        )
        assert result.failure == "" and result.close_code == 1000, result
        assert backend.requests[0].voice_prompt == "alice"
        assert len(backend.released) == 1 and backend.leases == {}
        heard = result.received_pcm()[-4000:]
        assert abs(dominant_hz(heard) - 440) < 20 and np.sqrt(np.mean(heard**2)) > 0.1
        media = next(m for m in result.received_messages if m["event"] == "media")
        stream_sid = result.sent_messages[1]["stream_sid"]
        assert media["stream_sid"] == stream_sid and len(media["media"]["payload"]) == 428  # 320 bytes
        assert {
            "event": "mark",
            "stream_sid": stream_sid,
            "mark": {"name": "frame-1"},
        } in result.received_messages
        samples = server.metrics.registry.get_sample_value
        assert samples("duplex_transport_sessions_started_total", {"transport": "exotel"}) == 1


async def test_the_persona_policy_refuses_a_voice_it_does_not_list():
    backend = FakeBackend(slots=1, voices=("alice", "bob"))
    async with fake_node(backend, **EXOTEL) as server:
        refused = await exotel_call(server, tone_8k(440, 0.2), parameters={"voice_prompt": "bob"})
        assert refused.close_code == 1008 and refused.close_reason.startswith("persona_not_allowed:")
        assert "may not use voice 'bob'" in refused.close_reason
        assert refused_count(server, "persona_not_allowed") == 1 and backend.requests == []
        default = await exotel_call(server, tone_8k(440, 0.4))  # no voice named: the node's default
        assert default.close_code == 1000 and default.marks > 0


async def test_a_media_format_other_than_pcm_is_refused_naming_the_rates():
    backend = FakeBackend(slots=1)
    async with fake_node(backend, **EXOTEL) as server:
        result = await exotel_call(
            server,
            tone_8k(440, 0.2),
            media_format={"encoding": "audio/x-mulaw", "sample_rate": "8000", "bit_rate": "8"},
        )
        assert result.close_code == 1008 and "'audio/x-mulaw'" in result.close_reason
        assert refused_count(server, "bad_request") == 1 and backend.requests == []


async def test_dtmf_is_counted_and_barge_in_clears_once_per_onset():
    backend = _TalkingBackend(slots=1)
    async with fake_node(backend, **EXOTEL) as server:
        silence = np.zeros(4000, dtype=np.float32)
        speech = tone_8k(440, 0.5)
        loud = await exotel_call(
            server, np.concatenate([silence, speech, silence, speech]), dtmf=((10, "5"),), keep_messages=2000
        )
        assert loud.clears == 2
        stream_sid = loud.sent_messages[1]["stream_sid"]
        assert {"event": "clear", "stream_sid": stream_sid} in loud.received_messages
        samples = server.metrics.registry.get_sample_value
        assert samples("duplex_carrier_barge_ins_total", {"carrier": "exotel"}) == 2
        assert samples("duplex_carrier_dtmf_total", {"carrier": "exotel"}) == 1


def test_the_exotel_settings_come_in_pairs(tmp_path):
    with pytest.raises(ValueError, match="the Exotel bridge needs both DUPLEX_EXOTEL_API_KEY"):
        RuntimeConfig(exotel_api_key=KEY)
    with pytest.raises(ValueError, match="the Exotel bridge needs both"):
        RuntimeConfig(exotel_api_token=TOKEN)
    with pytest.raises(ValueError, match="set DUPLEX_EXOTEL_API_TOKEN or DUPLEX_EXOTEL_API_TOKEN_FILE"):
        RuntimeConfig(exotel_api_key=KEY, exotel_api_token=TOKEN, exotel_api_token_file=tmp_path / "t")
    secret = tmp_path / "exotel"
    secret.write_text(TOKEN + "\n")
    config = RuntimeConfig(
        exotel_api_key=KEY, exotel_api_token_file=secret, exotel_personas="alice, NATF2.pt"
    )
    assert config.exotel_secret() == f"{KEY}:{TOKEN}" and config.exotel_personas == ["alice", "NATF2.pt"]
    assert RuntimeConfig().exotel_secret() is None
