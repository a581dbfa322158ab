"""The Twilio Media Streams bridge (issue 32): ``/api/carriers/twilio`` on the lifecycle's seam, driven by
Twilio's side (``runtime.tools.carrier_client``) over the fake backend (``tests/fake_backend.py``: each slot
echoes the caller's frames), so what the caller hears is what it said, through both resamplers and G.711.

The signature is checked against Twilio's own ``RequestValidator`` (the ``twilio`` package), not only
against this project's function. No timing assertions: waits are bounded, never measured.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from fake_backend import FakeBackend
from test_frontend_seam import fake_node
from twilio.request_validator import RequestValidator

from runtime.engine.api import AdmitRequest, SessionSink, SlotLease
from runtime.frontend.codecs.telephony import CarrierEncoding, PhoneAudioIn, PhoneAudioOut
from runtime.frontend.gate.carrier_auth import twilio_signature, twilio_signature_valid
from runtime.frontend.gate.tokens import SigningKey, mint_token
from runtime.frontend.server import DuplexServer
from runtime.tools.carrier_client import carrier_call
from runtime.tools.carrier_sides import TwilioSide

AUTH_TOKEN = "0123456789abcdef0123456789abcdef"
STREAM_URL = "wss://voice.example.com/api/carriers/twilio"
TWILIO = {"twilio_auth_token": AUTH_TOKEN, "twilio_stream_url": STREAM_URL}
KEY = SigningKey("current", "t" * 32)
AUDIENCE = "twilio-test"
TOKEN_MODE: dict[str, object] = {
    "auth_mode": "token",
    "token_keys": json.dumps({KEY.kid: KEY.secret.decode()}),
    "token_audience": AUDIENCE,
    "token_replay_check": "memory",
}


def token(**overrides: object) -> str:
    args: dict = {"ttl_s": 3600, "personas": ["*"], "audience": AUDIENCE, **overrides}
    return mint_token(KEY, **args)


def tone_8k(hz: float, seconds: float, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(int(8000 * seconds), dtype=np.float32) / 8000
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def dominant_hz(pcm: np.ndarray, rate_hz: int = 8000) -> float:
    spectrum = np.abs(np.fft.rfft(pcm * np.hanning(pcm.size)))
    return float(np.fft.rfftfreq(pcm.size, 1 / rate_hz)[int(np.argmax(spectrum))])


def base(server: DuplexServer) -> str:
    return f"ws://127.0.0.1:{server.port}"


def refused_count(server: DuplexServer, reason: str) -> float:
    value = server.metrics.registry.get_sample_value("duplex_admissions_refused_total", {"reason": reason})
    return value or 0.0


async def until(predicate, what: str, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


# --- the signature ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", [STREAM_URL, "wss://voice.example.com:443/api/carriers/twilio"])
def test_the_signature_is_twilios(url):
    """This project's signature is the one Twilio's validator computes and accepts, port or no port."""
    validator = RequestValidator(AUTH_TOKEN)
    assert twilio_signature(AUTH_TOKEN, url) == validator.compute_signature(url, {})
    assert validator.validate(url, {}, twilio_signature(AUTH_TOKEN, url))
    assert twilio_signature_valid(AUTH_TOKEN, STREAM_URL, validator.compute_signature(url, {}))
    assert not twilio_signature_valid(
        "another-token-xxxxxxxxxxxxxxxxxx", STREAM_URL, twilio_signature(AUTH_TOKEN, url)
    )
    assert not twilio_signature_valid(AUTH_TOKEN, STREAM_URL + "x", twilio_signature(AUTH_TOKEN, url))
    assert not twilio_signature_valid(AUTH_TOKEN, STREAM_URL, None)


@pytest.mark.parametrize(
    ("settings", "signature", "status", "reason"),
    [
        (TWILIO, "", 403, "carrier_signature"),  # no header
        (TWILIO, twilio_signature("the-wrong-token-xxxxxxxxxxxxxxxxx", STREAM_URL), 403, "carrier_signature"),
        (
            TWILIO,
            twilio_signature(AUTH_TOKEN, "wss://elsewhere.example.com/api/carriers/twilio"),
            403,
            "carrier_signature",
        ),
        ({}, None, 404, "carrier_off"),  # the node has no Twilio secret: the route is off
    ],
    ids=["no-signature", "wrong-token", "wrong-url", "bridge-off"],
)
async def test_a_stream_not_signed_by_the_account_is_refused_before_the_upgrade(
    settings, signature, status, reason
):
    backend = FakeBackend(slots=1)
    async with fake_node(backend, **settings) as server:
        result = await carrier_call(
            TwilioSide(),
            base(server),
            tone_8k(440, 0.2),
            secret=AUTH_TOKEN,
            stream_url=STREAM_URL,
            signature=signature,
        )
        assert result.status == status and result.close_reason.startswith(f"{reason}: ")
        assert refused_count(server, reason) == 1
        assert backend.requests == []  # no admission was even tried


# --- a call ----------------------------------------------------------------------------------------------


async def test_a_call_hears_itself_through_the_echo_slot_and_stop_frees_the_slot():
    """The caller's 440 Hz comes back as 440 Hz μ-law (8 kHz -> 24 kHz -> the slot -> 8 kHz), one mark per
    80 ms frame; ``stop`` ends the call normally and releases the slot."""
    backend = FakeBackend(slots=1)
    async with fake_node(backend, **TWILIO) as server:
        result = await carrier_call(
            TwilioSide(),
            base(server),
            tone_8k(440, 1.6),
            secret=AUTH_TOKEN,
            stream_url=STREAM_URL,
            parameters={"voice_prompt": "alice"},
        )
        assert result.failure == "" and result.close_code == 1000, result
        assert backend.requests[0].voice_prompt == "alice"
        assert len(backend.released) == 1 and backend.leases == {}
        heard = result.received_pcm()[-4000:]  # the last half second, past the resamplers' delay
        assert abs(dominant_hz(heard) - 440) < 20
        assert np.sqrt(np.mean(heard**2)) > 0.1  # about the 0.3 amplitude sent (0.21 RMS), not silence
        # Each frame (1920 samples at 24 kHz) is 640 μ-law bytes at 8 kHz: 4 packets of 160, then a mark.
        assert result.marks >= 15 and len(result.received) >= 160 * 4 * (result.marks - 2)
        assert result.clears == 0  # the caller speaking all along: no onset over queued agent speech
        samples = server.metrics.registry.get_sample_value
        assert samples("duplex_transport_sessions_started_total", {"transport": "twilio"}) == 1


async def test_a_dropped_socket_frees_the_slot_at_once():
    backend = FakeBackend(slots=1)
    async with fake_node(backend, **TWILIO) as server:
        result = await carrier_call(
            TwilioSide(),
            base(server),
            tone_8k(440, 0.4),
            secret=AUTH_TOKEN,
            stream_url=STREAM_URL,
            hang_up="drop",
            tail_s=0.1,
        )
        assert result.failure == ""
        await until(lambda: len(backend.released) == 1, "the slot released")


async def test_the_token_and_persona_come_from_the_start_messages_parameters():
    """Twilio sends no Authorization header: the gate admits on the ``start`` message. A missing token is
    refused there, counted once, with the close code of the refusal table; a token spent once is replayed."""
    backend = FakeBackend(slots=2)
    async with fake_node(backend, **TWILIO, **TOKEN_MODE) as server:
        missing = await carrier_call(
            TwilioSide(), base(server), tone_8k(440, 0.2), secret=AUTH_TOKEN, stream_url=STREAM_URL
        )
        assert missing.close_code == 1008 and missing.close_reason.startswith("missing:")
        assert refused_count(server, "missing") == 1 and backend.requests == []
        once = token()
        first = await carrier_call(
            TwilioSide(),
            base(server),
            tone_8k(440, 0.4),
            secret=AUTH_TOKEN,
            stream_url=STREAM_URL,
            parameters={"token": once, "text_prompt": "You are a helpful receptionist."},
        )
        assert first.close_code == 1000 and first.marks > 0
        assert backend.requests[0].text_prompt == "You are a helpful receptionist."
        again = await carrier_call(
            TwilioSide(),
            base(server),
            tone_8k(440, 0.2),
            secret=AUTH_TOKEN,
            stream_url=STREAM_URL,
            parameters={"token": once},
        )
        assert again.close_code == 1008 and again.close_reason.startswith("replayed:")
        assert refused_count(server, "replayed") == 1


async def test_a_start_message_with_another_media_format_is_refused_naming_it():
    backend = FakeBackend(slots=1)
    async with fake_node(backend, **TWILIO) as server:
        result = await carrier_call(
            TwilioSide(),
            base(server),
            tone_8k(440, 0.2),
            secret=AUTH_TOKEN,
            stream_url=STREAM_URL,
            media_format={"encoding": "audio/x-alaw", "sampleRate": 8000, "channels": 1},
        )
        assert result.close_code == 1008 and "audio/x-alaw" in result.close_reason
        assert refused_count(server, "bad_request") == 1 and backend.requests == []


class _TalkingBackend(FakeBackend):
    """Each slot talks all the time (a 300 Hz tone at -14 dBFS), whatever the caller says."""

    def push_frame(self, lease: SlotLease, frame: np.ndarray) -> bool:
        sink = self.sinks.get(lease.session_id)
        if sink is not None:
            t = np.arange(1920, dtype=np.float32) / 24000
            sink.on_output((0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), None)
        return True


async def test_dtmf_is_counted_and_barge_in_clears_the_carriers_queue_once_per_onset():
    """While the agent talks (its audio queued at Twilio, marks not played back yet), a caller who starts
    speaking gets one ``clear`` per onset; a caller who stays quiet gets none."""
    backend = _TalkingBackend(slots=1)
    async with fake_node(backend, **TWILIO) as server:
        quiet = await carrier_call(
            TwilioSide(),
            base(server),
            tone_8k(440, 1.0, amplitude=0.001),
            secret=AUTH_TOKEN,
            stream_url=STREAM_URL,
            dtmf=((10, "5"),),
        )
        assert quiet.clears == 0 and quiet.marks > 0
        silence = np.zeros(4000, dtype=np.float32)  # half a second, then speech, twice
        speech = tone_8k(440, 0.5)
        caller = np.concatenate([silence, speech, silence, speech])
        loud = await carrier_call(
            TwilioSide(), base(server), caller, secret=AUTH_TOKEN, stream_url=STREAM_URL
        )
        assert loud.clears == 2
        samples = server.metrics.registry.get_sample_value
        assert samples("duplex_carrier_barge_ins_total", {"carrier": "twilio"}) == 2
        assert samples("duplex_carrier_dtmf_total", {"carrier": "twilio"}) == 1


class _WaitingBackend(FakeBackend):
    """Admission waits until :attr:`open` is set (a waiting room's wait)."""

    def __init__(self) -> None:
        super().__init__(slots=1)
        self.open = asyncio.Event()

    async def admit(self, request: AdmitRequest, sink: SessionSink) -> SlotLease:
        await self.open.wait()
        return await super().admit(request, sink)


async def test_a_caller_waiting_for_a_slot_hears_the_hold_tone_not_silence():
    """A caller waiting for a slot hears, after a second of silence, the 425 Hz hold tone; one admitted at
    once hears no beep before the agent."""
    backend = _WaitingBackend()
    async with fake_node(backend, **TWILIO) as server:
        call = asyncio.create_task(
            carrier_call(
                TwilioSide(),
                base(server),
                tone_8k(440, 3.0, amplitude=0.001),
                secret=AUTH_TOKEN,
                stream_url=STREAM_URL,
            )
        )
        await asyncio.sleep(1.8)
        backend.open.set()
        result = await call
        assert result.packets_before_live >= 60  # 1.2 s and more before the slot
        held = result.received_pcm()[: result.packets_before_live * 160]
        assert np.max(np.abs(held[:6400])) < 0.01  # the first 0.8 s: silence
        beep = held[8000:11200]  # 1.0-1.4 s: the tone
        assert abs(dominant_hz(beep) - 425) < 20 and np.max(np.abs(beep)) > 0.05
        assert result.marks > 0  # then the call went live
        at_once = await carrier_call(
            TwilioSide(),
            base(server),
            tone_8k(440, 0.6, amplitude=0.001),
            secret=AUTH_TOKEN,
            stream_url=STREAM_URL,
        )
        before = at_once.received_pcm()[: at_once.packets_before_live * 160]
        assert before.size == 0 or np.max(np.abs(before)) < 0.01  # no beep for a caller admitted at once


# --- the edge's audio ------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", list(CarrierEncoding))
@pytest.mark.parametrize("amplitude", [0.1, 0.5])
def test_a_telephone_band_sweep_survives_the_bridges_conversions_without_clicks(encoding, amplitude):
    """Issue 32: a 300-3400 Hz sweep as the carrier sends it (G.711 or L16 at 8 kHz, 20 ms packets) -> 24 kHz
    (the model's frames) -> 8 kHz packets -> decoded: SNR >= 35 dB against what the caller's line carried
    (measured: 56-60 dB with G.711 and libswresample; against the analogue sweep, G.711's own quantization
    included, 36.5-38 dB), and no click at the 80 ms frame edges: the error next to an edge is no larger
    than the error elsewhere."""
    from scipy.signal import chirp

    from runtime.frontend.codecs.telephony import _from_linear, _to_linear  # the library's G.711

    t = np.arange(8000 * 3) / 8000
    sweep = (amplitude * chirp(t, 300, 3, 3400)).astype(np.float32)
    carrier = _from_linear(np.rint(sweep * 32767).astype("<i2").tobytes(), encoding)
    line = (
        np.frombuffer(_to_linear(carrier, encoding), "<i2").astype(np.float32) / 32768
    )  # what the line carried
    audio_in, audio_out = PhoneAudioIn(encoding), PhoneAudioOut(encoding)
    width = 160 * encoding.bytes_per_sample
    model_rate = np.concatenate(
        [audio_in.decode(carrier[i : i + width]) for i in range(0, len(carrier), width)]
    )
    packets = [p for i in range(0, model_rate.size, 1920) for p in audio_out.encode(model_rate[i : i + 1920])]
    assert all(len(p) == width for p in packets)
    back = np.frombuffer(_to_linear(b"".join(packets), encoding), "<i2").astype(np.float32) / 32768
    steady = slice(2000, 22000)  # past the resamplers' start-up, before their tail
    error = back[steady] - line[steady]
    snr = 10 * np.log10(np.sum(line[steady] ** 2) / max(float(np.sum(error**2)), 1e-20))  # L16: exact
    assert snr >= 35, snr
    offsets = np.arange(steady.start, steady.stop)
    near_edge = np.abs((offsets % 640) - 0) <= 2  # 640 samples = one 80 ms frame at 8 kHz
    near_edge |= np.abs((offsets % 640) - 640) <= 2
    assert np.max(np.abs(error[near_edge])) <= 2 * np.max(np.abs(error[~near_edge])) + 1e-4


def test_an_encoding_the_bridge_does_not_carry_is_named():
    with pytest.raises(
        ValueError, match="unsupported carrier audio encoding 'G729'; one of audio/x-mulaw, PCMU"
    ):
        CarrierEncoding.parse("G729")
    assert CarrierEncoding.parse("pcma") is CarrierEncoding.PCMA
    with pytest.raises(ValueError, match="carrier sample rate must be 8000..48000 Hz, got 4000"):
        PhoneAudioIn(CarrierEncoding.PCMU, 4000)


# --- the load generator ----------------------------------------------------------------------------------


async def test_the_phone_load_generator_reports_calls_like_the_other_transports():
    """``duplex loadgen --transport twilio``'s core: espeak-ng speech at 8 kHz, three calls on two slots.
    Two are served whole (no frame lost by the echo slots), the third is refused and counted a failure
    with the node's words."""
    from runtime.tools.loadgen import synthesize_speech
    from runtime.tools.loadgen_phone import run_phone_load

    speech = synthesize_speech("Hello, I would like to book a table for two tonight.")
    backend = FakeBackend(slots=2)
    async with fake_node(backend, **TWILIO) as server:
        report = await run_phone_load(
            "twilio",
            base(server),
            [speech],
            sessions=3,
            secret=AUTH_TOKEN,
            stream_url=STREAM_URL,
            max_duration_s=60,
        )
    served = report.served
    assert len(served) == 2 and not report.ok
    assert [r.failure for r in served] == ["", ""]
    assert all(r.frames_lost() <= 1 and r.first_audio_ms is not None for r in served), [
        (r.frames_lost(), r.frames_planned, r.audio_messages) for r in served
    ]
    (refused,) = [r for r in report.sessions if not r.handshake]
    assert "node_full" in refused.failure
