"""Wire protocol of /api/chat: every refusal reason, encoder/parser round trips, fuzzing."""

from __future__ import annotations

import json
import re
import string
import urllib.parse

import numpy as np
import pytest
import sphn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.engine.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.engine.persona_limits import TEXT_PROMPT_LIMIT, TEXT_PROMPT_MAX_CHARS
from runtime.frontend.codecs.kyutai_audio import OpusFrameAssembler, PcmFrameAssembler
from runtime.frontend.codecs.protocol import (
    MAX_ERROR_MESSAGE_BYTES,
    PROTOCOL_ERROR_REASONS,
    AudioFormat,
    AudioMessage,
    ControlAction,
    ControlMessage,
    MessageKind,
    MetadataMessage,
    PingMessage,
    ProtocolError,
    encode_audio,
    encode_error,
    encode_handshake,
    encode_metadata,
    encode_ping,
    encode_text,
    parse_client_message,
)
from runtime.frontend.gate.query import (
    MAX_QUERY_PARAMS,
    SessionRequest,
    parse_prompt_metadata,
    parse_session_query,
)

LIMIT = 64 * 1024
FUZZ = settings(max_examples=2000, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
"""Fuzzing untrusted input: bytes, chunkings, query strings."""
SECONDARY = settings(max_examples=400, deadline=None, database=None)
"""Round trips of valid inputs and secondary properties: fewer examples keep the suite under ~20 s."""


def parse(data: bytes | bytearray | memoryview | str) -> object:
    return parse_client_message(data, max_message_bytes=LIMIT)


def refused(data: bytes | str) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse(data)
    return info.value


# ------------------------------------------------------------------------------------------------
# Message kinds and errors
# ------------------------------------------------------------------------------------------------


def test_message_kind_bytes_match_kyutai() -> None:
    assert [(kind.name, int(kind)) for kind in MessageKind] == [
        ("HANDSHAKE", 0),
        ("AUDIO", 1),
        ("TEXT", 2),
        ("CONTROL", 3),
        ("METADATA", 4),
        ("ERROR", 5),
        ("PING", 6),
    ]
    assert [int(action) for action in ControlAction] == [0, 1, 2, 3]


def test_protocol_error_carries_reason_and_message() -> None:
    error = ProtocolError("oversized", "too big")
    assert isinstance(error, ValueError)
    assert (error.reason, error.message, str(error)) == ("oversized", "too big", "too big")
    with pytest.raises(ValueError, match="unknown ProtocolError reason"):
        ProtocolError("Not A Label", "x")
    assert all(reason.isidentifier() and reason == reason.lower() for reason in PROTOCOL_ERROR_REASONS)


def test_text_frame_is_refused() -> None:
    error = refused("hello")
    assert error.reason == "text_frame"
    assert "binary" in error.message


def test_empty_message_is_refused() -> None:
    error = refused(b"")
    assert error.reason == "empty_message"
    assert "kind byte" in error.message


def test_oversized_message_is_refused() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_client_message(encode_audio(b"x" * 100), max_message_bytes=100)
    assert info.value.reason == "oversized"
    assert "101-byte" in info.value.message and "100 bytes" in info.value.message
    # Exactly at the limit passes.
    assert parse_client_message(encode_audio(b"x" * 99), max_message_bytes=100) == AudioMessage(b"x" * 99)


@pytest.mark.parametrize("kind_byte", [7, 8, 0x10, 0x7F, 0x80, 0xFF])
def test_unknown_kind_is_refused(kind_byte: int) -> None:
    error = refused(bytes([kind_byte]) + b"payload")
    assert error.reason == "unknown_kind"
    assert f"0x{kind_byte:02x}" in error.message


@pytest.mark.parametrize("kind", [MessageKind.HANDSHAKE, MessageKind.TEXT, MessageKind.ERROR])
def test_server_only_kind_from_client_is_refused(kind: MessageKind) -> None:
    error = refused(bytes([kind]) + b"x")
    assert error.reason == "server_only_kind"
    assert kind.name.lower() in error.message


@pytest.mark.parametrize("payload", [b"", b"\x00\x01", b"\x01\x02\x03"])
def test_control_of_wrong_length_is_refused(payload: bytes) -> None:
    error = refused(bytes([MessageKind.CONTROL]) + payload)
    assert error.reason == "bad_control"
    assert "exactly 1" in error.message


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"not json",
        b"\xff\xfe{}",
        b"[1, 2]",
        b'"text"',
        b"42",
        b"null",
        b'{"x": NaN}',
        b'{"x": Infinity}',
        b'{"x": 1e999}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"x": ' + b"9" * 5000 + b"}",
    ],
    ids=lambda payload: repr(payload[:12]),
)
def test_bad_metadata_is_refused(payload: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_client_message(bytes([MessageKind.METADATA]) + payload, max_message_bytes=1 << 20)
    assert info.value.reason == "bad_metadata"
    assert "JSON object" in info.value.message


def test_max_message_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError):
        parse_client_message(b"\x01", max_message_bytes=0)


# ------------------------------------------------------------------------------------------------
# Valid messages and encoders
# ------------------------------------------------------------------------------------------------


def test_handshake_is_a_single_zero_byte() -> None:
    assert encode_handshake() == b"\x00"


def test_client_messages_round_trip() -> None:
    assert parse(encode_audio(b"OggS\x00data")) == AudioMessage(b"OggS\x00data")
    assert parse(encode_audio(b"")) == AudioMessage(b"")
    assert parse(encode_ping(b"abc")) == PingMessage(b"abc")
    assert parse(encode_ping()) == PingMessage(b"")
    assert parse(bytearray(b"\x01ab")) == AudioMessage(b"ab")
    assert parse(memoryview(b"\x06")) == PingMessage(b"")
    metadata = {"name": "é", "n": [1, 2.5, None, True], "nested": {"a": {}}}
    assert parse(encode_metadata(metadata)) == MetadataMessage(metadata)


@pytest.mark.parametrize("action", list(ControlAction))
def test_kyutai_control_actions_parse(action: ControlAction) -> None:
    message = parse(bytes([MessageKind.CONTROL, action]))
    assert message == ControlMessage(int(action))
    assert isinstance(message, ControlMessage) and message.known_action is action


def test_unknown_control_action_is_kept_raw() -> None:
    message = parse(b"\x03\x09")
    assert message == ControlMessage(9)
    assert isinstance(message, ControlMessage) and message.known_action is None


def test_encode_text_is_utf8_after_kind_byte() -> None:
    assert encode_text(" héllo") == b"\x02" + " héllo".encode()


def test_encode_metadata_refuses_what_json_cannot_hold() -> None:
    with pytest.raises(ValueError):
        encode_metadata({"x": float("nan")})
    with pytest.raises(TypeError):
        encode_metadata({"x": object()})
    with pytest.raises(TypeError):
        encode_metadata([1, 2])  # type: ignore[arg-type]


def test_encode_error_short_reason_is_kept() -> None:
    assert encode_error("server full") == b"\x05server full"


def test_encode_error_truncates_at_a_character_boundary() -> None:
    message = encode_error("é" * 2000)  # 2 bytes per character
    assert message[0] == MessageKind.ERROR
    assert len(message) <= MAX_ERROR_MESSAGE_BYTES < 1024
    assert message[1:].decode("utf-8") == "é" * ((MAX_ERROR_MESSAGE_BYTES - 1) // 2)


@SECONDARY
@given(st.text())
def test_encode_error_is_always_short_valid_utf8(reason: str) -> None:
    message = encode_error(reason)
    assert message[0] == MessageKind.ERROR and len(message) < 1024
    text = message[1:].decode("utf-8")  # valid UTF-8: never raises
    if not any("\ud800" <= char <= "\udfff" for char in reason):  # lone surrogates become "?"
        assert reason.startswith(text)


# ------------------------------------------------------------------------------------------------
# Fuzzing the parser
# ------------------------------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_parse_client_message_raises_only_protocol_error(data: bytes) -> None:
    try:
        message = parse_client_message(data, max_message_bytes=200)
    except ProtocolError as error:
        assert error.reason in PROTOCOL_ERROR_REASONS
        assert error.message
        return
    assert isinstance(message, (AudioMessage, PingMessage, ControlMessage, MetadataMessage))


@SECONDARY
@given(st.text(max_size=50))
def test_fuzz_text_frames_always_refused(data: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse(data)
    assert info.value.reason == "text_frame"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=8,
)


@SECONDARY
@given(
    st.one_of(
        st.builds(AudioMessage, st.binary(max_size=200)),
        st.builds(PingMessage, st.binary(max_size=200)),
        st.builds(ControlMessage, st.integers(0, 255)),
        st.builds(MetadataMessage, st.dictionaries(st.text(), json_values, max_size=5)),
    )
)
def test_fuzz_valid_client_messages_round_trip(message: object) -> None:
    if isinstance(message, AudioMessage):
        wire = encode_audio(message.payload)
    elif isinstance(message, PingMessage):
        wire = encode_ping(message.payload)
    elif isinstance(message, ControlMessage):
        wire = bytes([MessageKind.CONTROL, message.action])
    else:
        assert isinstance(message, MetadataMessage)
        wire = encode_metadata(message.data)
    assert parse_client_message(wire, max_message_bytes=1 << 20) == message


# ------------------------------------------------------------------------------------------------
# Fuzzing the audio assemblers with arbitrary chunkings
# ------------------------------------------------------------------------------------------------


def chunk(data: bytes, cuts: list[int], unit: int = 1) -> list[bytes]:
    """Split ``data`` at the given cut points (taken modulo its length, rounded down to ``unit`` bytes)."""
    points = sorted({cut % (len(data) + 1) // unit * unit for cut in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:], strict=False)]


@FUZZ
@given(st.binary(max_size=6000), st.lists(st.integers(0, 10_000), max_size=8))
def test_fuzz_pcm_assembler_raises_only_protocol_error(data: bytes, cuts: list[int]) -> None:
    assembler = PcmFrameAssembler(max_buffered_frames=1)
    for piece in chunk(data, cuts):
        try:
            frames = assembler.push(piece)
        except ProtocolError as error:
            assert error.reason in {"bad_pcm", "too_fast"}
            continue
        for frame in frames:
            assert frame.shape == (FRAME_SAMPLES,) and frame.dtype == np.float32
            assert frame.min() >= -1.0 and frame.max() < 1.0


@SECONDARY
@given(st.lists(st.integers(-32768, 32767), max_size=3 * FRAME_SAMPLES + 7), st.lists(st.integers(0, 10**5)))
def test_fuzz_pcm_assembler_round_trips_any_even_chunking(samples: list[int], cuts: list[int]) -> None:
    data = np.array(samples, dtype="<i2").tobytes()
    assembler = PcmFrameAssembler(max_buffered_frames=4)
    frames = [frame for piece in chunk(data, cuts, unit=2) for frame in assembler.push(piece)]
    whole = len(samples) // FRAME_SAMPLES
    assert len(frames) == whole
    assert assembler.pending_samples == len(samples) - whole * FRAME_SAMPLES
    if frames:
        back = np.rint(np.concatenate(frames) * 32768).astype(np.int64)
        assert back.tolist() == samples[: whole * FRAME_SAMPLES]


def _sine_ogg(seconds: float) -> bytes:
    writer = sphn.OpusStreamWriter(SAMPLE_RATE_HZ)
    t = np.arange(int(seconds * SAMPLE_RATE_HZ)) / SAMPLE_RATE_HZ
    pcm = (0.4 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)
    return b"".join(writer.append_pcm(pcm[i : i + FRAME_SAMPLES]) for i in range(0, pcm.size, FRAME_SAMPLES))


VALID_OGG = _sine_ogg(0.4)


@FUZZ
@given(st.binary(max_size=2000), st.lists(st.integers(0, 10_000), max_size=6))
def test_fuzz_opus_assembler_garbage_raises_only_protocol_error(data: bytes, cuts: list[int]) -> None:
    assembler = OpusFrameAssembler(max_buffered_frames=2)
    for piece in chunk(data, cuts):
        try:
            frames = assembler.push(piece)
        except ProtocolError as error:
            assert error.reason in {"bad_opus", "too_fast"}
            continue
        for frame in frames:
            assert frame.shape == (FRAME_SAMPLES,) and frame.dtype == np.float32


@SECONDARY
@given(
    st.lists(st.tuples(st.integers(0, len(VALID_OGG) - 1), st.integers(0, 255)), min_size=1, max_size=4),
    st.lists(st.integers(0, 10_000), max_size=6),
)
def test_fuzz_opus_assembler_corrupted_stream_raises_only_protocol_error(
    edits: list[tuple[int, int]], cuts: list[int]
) -> None:
    data = bytearray(VALID_OGG)
    for index, value in edits:
        data[index] = value
    assembler = OpusFrameAssembler(max_buffered_frames=10)
    for piece in chunk(bytes(data), cuts):
        try:
            frames = assembler.push(piece)
        except ProtocolError as error:
            assert error.reason == "bad_opus"
            continue
        for frame in frames:
            assert frame.shape == (FRAME_SAMPLES,) and frame.dtype == np.float32
            assert np.all(np.abs(frame) <= 1.0)


@settings(max_examples=100, deadline=None, database=None)
@given(st.lists(st.integers(0, 10_000), max_size=10))
def test_fuzz_opus_assembler_valid_stream_any_chunking(cuts: list[int]) -> None:
    assembler = OpusFrameAssembler(max_buffered_frames=10)
    frames = [frame for piece in chunk(VALID_OGG, cuts) for frame in assembler.push(piece)]
    assert len(frames) == 5  # 0.4 s at 80 ms per frame
    assert assembler.pending_samples == 0


# ------------------------------------------------------------------------------------------------
# Session query string
# ------------------------------------------------------------------------------------------------


def test_empty_query_gives_defaults() -> None:
    assert parse_session_query({}) == SessionRequest()
    assert parse_session_query("") == SessionRequest()
    assert parse_session_query({}).format is AudioFormat.OPUS


def test_full_query_parses() -> None:
    request = parse_session_query(
        "?format=pcm&voice_prompt=NATF2.pt&text_prompt=You+are+a+helpful+assistant.&audio_temperature=0.8"
        "&text_temperature=0.7&audio_topk=250&text_topk=25&seed=42"
    )
    assert request == SessionRequest(
        format=AudioFormat.PCM,
        voice_prompt="NATF2.pt",
        text_prompt="You are a helpful assistant.",
        audio_temperature=0.8,
        text_temperature=0.7,
        audio_topk=250,
        text_topk=25,
        seed=42,
    )


def test_kyutai_and_personaplex_extra_params_are_ignored_and_listed() -> None:
    query = {
        "text_temperature": "0.7",
        "text_topk": "25",
        "audio_temperature": "0.8",
        "audio_topk": "250",
        "pad_mult": "0",
        "repetition_penalty": "1.0",
        "repetition_penalty_context": "64",
        "text_seed": "123",
        "audio_seed": "456",
        "worker_auth_id": "abc",
        "email": "a@b.c",
    }
    request = parse_session_query(query)
    assert request.text_topk == 25 and request.audio_topk == 250
    assert request.ignored_params == (
        "audio_seed",
        "email",
        "pad_mult",
        "repetition_penalty",
        "repetition_penalty_context",
        "text_seed",
        "worker_auth_id",
    )


def test_empty_values_mean_not_given() -> None:
    assert parse_session_query("text_prompt=&voice_prompt=&seed=&format=") == SessionRequest()


def test_format_is_case_insensitive() -> None:
    assert parse_session_query({"format": "PCM"}).format is AudioFormat.PCM


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("format", "wav", "'opus' or 'pcm'"),
        ("voice_prompt", "../etc/passwd", "no path separators"),
        ("voice_prompt", "a/b", "no path separators"),
        ("voice_prompt", "a\\b", "no path separators"),
        ("voice_prompt", "..", "starting with a letter or digit"),
        ("voice_prompt", ".hidden", "starting with a letter or digit"),
        ("voice_prompt", "x" * 65, "1..64"),
        ("voice_prompt", "héllo", "letters, digits"),
        ("text_prompt", "x" * 4001, "at most 4000 characters and at most 1000 tokens"),
        ("text_prompt_in", "body", "expected 'query' or 'metadata'"),
        ("text_prompt", "a\x00b", "NUL"),
        ("text_prompt", "a\ud800b", "surrogate"),
        ("audio_temperature", "-0.1", "[0, 2]"),
        ("audio_temperature", "2.01", "[0, 2]"),
        ("text_temperature", "nan", "[0, 2]"),
        ("text_temperature", "inf", "[0, 2]"),
        ("text_temperature", "1e999", "[0, 2]"),
        ("text_temperature", "0x1", "[0, 2]"),
        ("audio_topk", "0", "[1, 250]"),
        ("audio_topk", "251", "[1, 250]"),
        ("audio_topk", "2.5", "[1, 250]"),
        ("audio_topk", "1_000", "[1, 250]"),
        ("audio_topk", "\u0665", "[1, 250]"),  # an Arabic-Indic digit: int() would accept it
        ("text_topk", "32001", "[1, 32000]"),
        ("text_topk", "-1", "[1, 32000]"),
        ("seed", "-1", f"[0, {2**31 - 1}]"),
        ("seed", str(2**31), f"[0, {2**31 - 1}]"),
        ("seed", "9" * 5000, f"[0, {2**31 - 1}]"),
    ],
)
def test_bad_query_value_is_refused_naming_parameter_value_and_range(
    name: str, value: str, allowed: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_session_query({name: value})
    assert info.value.reason == "bad_query"
    assert f"{name}=" in info.value.message
    assert repr(value[:20])[:-1] in info.value.message
    assert allowed in info.value.message


def test_bad_query_repeated_known_parameter_is_refused() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_session_query("seed=1&seed=2")
    assert info.value.reason == "bad_query" and "'seed'" in info.value.message
    # Repeated unknown parameters are simply ignored.
    assert parse_session_query("x=1&x=2").ignored_params == ("x",)


def test_bad_query_too_many_parameters_is_refused() -> None:
    many = {f"p{i}": "1" for i in range(MAX_QUERY_PARAMS + 1)}
    for query in (many, urllib.parse.urlencode(many)):
        with pytest.raises(ProtocolError) as info:
            parse_session_query(query)
        assert info.value.reason == "bad_query"


def test_bad_query_non_string_value_is_refused() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_session_query({"seed": 3})  # type: ignore[dict-item]
    assert info.value.reason == "bad_query"


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "format",
                "voice_prompt",
                "text_prompt",
                "audio_temperature",
                "text_temperature",
                "audio_topk",
                "text_topk",
                "seed",
            ]
        )
        | st.text(max_size=10),
        st.text(max_size=30)
        | st.integers(-(10**12), 10**12).map(str)
        | st.floats().map(repr)
        | st.sampled_from(["opus", "pcm", "PCM", "NATF2.pt", "..", "a/b", "1e999", "+5", ".5", "5."]),
        max_size=10,
    )
)
def test_fuzz_query_dict_raises_only_protocol_error(query: dict[str, str]) -> None:
    try:
        request = parse_session_query(query)
    except ProtocolError as error:
        assert error.reason == "bad_query"
        return
    assert isinstance(request, SessionRequest)


@FUZZ
@given(st.text(max_size=200))
def test_fuzz_query_string_raises_only_protocol_error(query: str) -> None:
    try:
        parse_session_query(query)
    except ProtocolError as error:
        assert error.reason == "bad_query"


@SECONDARY
@given(
    st.builds(
        SessionRequest,
        format=st.sampled_from(AudioFormat),
        voice_prompt=st.none()
        | st.builds(
            str.__add__,
            st.sampled_from(string.ascii_letters + string.digits),
            st.text(string.ascii_letters + string.digits + "_.-", max_size=63),
        ),
        text_prompt=st.none()
        | st.text(
            st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), min_size=1, max_size=300
        ),
        audio_temperature=st.none() | st.floats(0.0, 2.0),
        text_temperature=st.none() | st.floats(0.0, 2.0),
        audio_topk=st.none() | st.integers(1, 250),
        text_topk=st.none() | st.integers(1, 32000),
        seed=st.none() | st.integers(0, 2**31 - 1),
    )
)
def test_fuzz_valid_session_request_round_trips(request: SessionRequest) -> None:
    params = request.to_query_params()
    assert parse_session_query(params) == request
    assert parse_session_query("?" + urllib.parse.urlencode(params)) == request


def test_session_request_to_query_params_is_json_friendly() -> None:
    params = SessionRequest(format=AudioFormat.PCM, seed=7, text_temperature=0.5).to_query_params()
    assert params == {"format": "pcm", "seed": "7", "text_temperature": "0.5"}
    assert json.loads(json.dumps(params)) == params


def test_a_text_prompt_may_come_as_metadata_with_the_same_limit() -> None:
    request = parse_session_query("text_prompt_in=metadata&format=pcm")
    assert request.text_prompt_in == "metadata" and request.text_prompt is None
    assert parse_session_query("text_prompt_in=query").text_prompt_in is None
    with pytest.raises(ProtocolError, match="cannot also come as metadata"):
        parse_session_query("text_prompt_in=metadata&text_prompt=hi")
    assert parse_prompt_metadata({"text_prompt": "You are a pirate."}) == "You are a pirate."
    with pytest.raises(ProtocolError, match=re.escape(TEXT_PROMPT_LIMIT)) as info:
        parse_prompt_metadata({"text_prompt": "x" * (TEXT_PROMPT_MAX_CHARS + 1)})
    assert info.value.reason == "bad_metadata" and "metadata field text_prompt=" in str(info.value)
    for bad in ({}, {"text_prompt": 3}, {"text_prompt": "hi", "voice_prompt": "x"}):
        with pytest.raises(ProtocolError, match="first message must be 0x04 metadata") as info:
            parse_prompt_metadata(bad)
        assert info.value.reason == "bad_metadata"
