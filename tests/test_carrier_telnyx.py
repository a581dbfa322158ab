"""The Telnyx media-streaming bridge (issue 32): ``/api/carriers/telnyx`` on the carrier-generic edge,
driven by Telnyx's side (``runtime.tools.carrier_sides.TelnyxSide``) over the fake backend (each slot
echoes the caller's frames). Telnyx signs no stream upgrade, so the route's gate is the node's stream secret
in the stream URL (or ``Authorization: Bearer``). G.711 A-law (PCMA) goes through ``audioop``, like μ-law.
No timing assertions: waits are bounded, never measured.
"""

from __future__ import annotations

import numpy as np
import pytest
from fake_backend import FakeBackend
from test_carrier_twilio import TOKEN_MODE, _TalkingBackend, base, dominant_hz, refused_count, token, tone_8k
from test_frontend_seam import fake_node
from websockets.asyncio.client import connect

from runtime.config import RuntimeConfig
from runtime.tools.carrier_client import carrier_call
from runtime.tools.carrier_sides import TelnyxSide

STREAM_TOKEN = "a-stream-secret-of-32-characters"
TELNYX = {"telnyx_stream_token": STREAM_TOKEN}


async def telnyx_call(server, caller: np.ndarray, **kwargs):  # type: ignore[no-untyped-def]
    return await carrier_call(
        TelnyxSide(), base(server), caller, secret=STREAM_TOKEN, stream_url="unsigned", **kwargs
    )


@pytest.mark.parametrize(
    ("settings", "signature", "status", "reason"),
    [
        (TELNYX, "", 403, "carrier_signature"),  # no stream secret in the URL
        (TELNYX, "a-stream-secret-of-32-characterz", 403, "carrier_signature"),  # the wrong one
        ({}, None, 404, "carrier_off"),  # the node has no Telnyx secret: the route is off
    ],
    ids=["no-secret", "wrong-secret", "bridge-off"],
)
async def test_a_stream_without_the_nodes_secret_is_refused_before_the_upgrade(
    settings, signature, status, reason
):
    backend = FakeBackend(slots=1)
    async with fake_node(backend, **settings) as server:
        result = await telnyx_call(server, tone_8k(440, 0.2), signature=signature)
        assert result.status == status and result.close_reason.startswith(f"{reason}: ")
        assert refused_count(server, reason) == 1
        assert backend.requests == []


@pytest.mark.parametrize("encoding", ["PCMU", "PCMA"])
async def test_a_call_hears_itself_in_its_own_codec_and_stop_frees_the_slot(encoding):
    """The caller's 440 Hz comes back as 440 Hz in the stream's codec (PCMA: A-law both ways), one ``mark``
    per 80 ms frame; ``stop`` ends the call normally and releases the slot."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop

    class _Side(TelnyxSide):
        def packets(self, caller_8k):  # type: ignore[no-untyped-def]
            if encoding == "PCMU":
                return super().packets(caller_8k)
            import base64

            samples = np.pad(np.asarray(caller_8k, dtype=np.float32), (0, -len(caller_8k) % 160))
            alaw = audioop.lin2alaw(np.rint(samples * 32767).astype("<i2").tobytes(), 2)
            return [base64.b64encode(alaw[i : i + 160]).decode() for i in range(0, len(alaw), 160)]

    backend = FakeBackend(slots=1)
    async with fake_node(backend, **TELNYX) as server:
        result = await carrier_call(
            _Side(),
            base(server),
            tone_8k(440, 1.6),
            secret=STREAM_TOKEN,
            stream_url="unsigned",
            parameters={"voice_prompt": "alice"},
            media_format={"encoding": encoding, "sample_rate": 8000, "channels": 1},
            keep_messages=400,
        )
        assert result.failure == "" and result.close_code == 1000, result
        assert backend.requests[0].voice_prompt == "alice"
        assert len(backend.released) == 1 and backend.leases == {}
        coded = bytes(result.received)
        linear = audioop.alaw2lin(coded, 2) if encoding == "PCMA" else audioop.ulaw2lin(coded, 2)
        heard = (np.frombuffer(linear, "<i2").astype(np.float32) / 32768)[-4000:]
        assert abs(dominant_hz(heard) - 440) < 20 and np.sqrt(np.mean(heard**2)) > 0.1
        media = next(m for m in result.received_messages if m["event"] == "media")
        assert set(media) == {"event", "media"} and set(media["media"]) == {"payload"}
        assert {"event": "mark", "mark": {"name": "frame-1"}} in result.received_messages
        samples = server.metrics.registry.get_sample_value
        assert samples("duplex_transport_sessions_started_total", {"transport": "telnyx"}) == 1


async def test_the_token_comes_from_custom_parameters_and_the_secret_may_be_a_bearer_header():
    backend = FakeBackend(slots=1)
    async with fake_node(backend, **TELNYX, **TOKEN_MODE) as server:
        missing = await telnyx_call(server, tone_8k(440, 0.2))
        assert missing.close_code == 1008 and missing.close_reason.startswith("missing:")
        assert refused_count(server, "missing") == 1
        served = await telnyx_call(server, tone_8k(440, 0.4), parameters={"token": token()})
        assert served.close_code == 1000 and served.marks > 0
        # Authorization: Bearer instead of the query: the upgrade passes (then no start within the test).
        headers = {"Authorization": f"Bearer {STREAM_TOKEN}"}
        async with connect(f"{base(server)}/api/carriers/telnyx", additional_headers=headers) as ws:
            await ws.close()
        assert refused_count(server, "carrier_signature") == 0


async def test_a_codec_the_bridge_does_not_carry_is_refused_naming_the_carried_ones():
    backend = FakeBackend(slots=1)
    async with fake_node(backend, **TELNYX) as server:
        result = await telnyx_call(
            server, tone_8k(440, 0.2), media_format={"encoding": "G722", "sample_rate": 16000, "channels": 1}
        )
        assert result.close_code == 1008 and "'G722' at 16000 Hz" in result.close_reason
        assert "PCMU at 8000 Hz" in result.close_reason
        assert refused_count(server, "bad_request") == 1 and backend.requests == []


async def test_dtmf_is_counted_and_barge_in_clears_once_per_onset():
    backend = _TalkingBackend(slots=1)
    async with fake_node(backend, **TELNYX) as server:
        silence = np.zeros(4000, dtype=np.float32)
        speech = tone_8k(440, 0.5)
        loud = await telnyx_call(
            server, np.concatenate([silence, speech, silence, speech]), dtmf=((10, "5"),), keep_messages=2000
        )
        assert loud.clears == 2
        assert {"event": "clear"} in loud.received_messages
        samples = server.metrics.registry.get_sample_value
        assert samples("duplex_carrier_barge_ins_total", {"carrier": "telnyx"}) == 2
        assert samples("duplex_carrier_dtmf_total", {"carrier": "telnyx"}) == 1


def test_the_telnyx_secret_is_one_setting_and_long_enough(tmp_path):
    with pytest.raises(ValueError, match="set DUPLEX_TELNYX_STREAM_TOKEN or DUPLEX_TELNYX_STREAM_TOKEN_FILE"):
        RuntimeConfig(telnyx_stream_token=STREAM_TOKEN, telnyx_stream_token_file=tmp_path / "t")
    with pytest.raises(ValueError, match="at least 16 characters"):
        RuntimeConfig(telnyx_stream_token="short")
    secret = tmp_path / "telnyx"
    secret.write_text("")
    with pytest.raises(ValueError, match="DUPLEX_TELNYX_STREAM_TOKEN_FILE: .* is empty"):
        RuntimeConfig(telnyx_stream_token_file=secret).telnyx_secret()
    secret.write_text(STREAM_TOKEN + "\n")
    assert RuntimeConfig(telnyx_stream_token_file=secret).telnyx_secret() == STREAM_TOKEN
