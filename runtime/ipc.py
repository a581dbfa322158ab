"""Messages between the engine process and the front-end worker processes (``duplex serve --workers N``).

After vLLM v1's engine-core / API-server split (``vllm/v1/engine/core_client.py``, ``core.py``): one
engine process owns the model, the slots, the waiting room and the 80 ms tick, and no socket to a caller;
N front-end workers own the WebSockets, the codecs, tokens, Redis and HTTP. They talk over ZeroMQ
(pyzmq): the engine binds one ROUTER socket, each worker connects one DEALER (its identity is its worker
id). Every message is one frame, a msgspec-msgpack encoding of the tagged union :data:`Message`.

Bounds (nothing here may block the tick): the tick thread never touches a socket; the engine's event loop
sends with ``zmq.NOBLOCK`` under a high-water mark and counts what it had to drop (``slow_worker``); a
session's input is bounded by its inbox in the engine (``max_inbox_frames``), as in one process.

This module imports neither side: both import it.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "Admit",
    "Admitted",
    "Detach",
    "FirstAudio",
    "Frame",
    "Hangup",
    "HangupResult",
    "SpendToken",
    "TokenSpent",
    "Hello",
    "HoldExpired",
    "Message",
    "Moved",
    "Outputs",
    "PromptDone",
    "Refused",
    "Release",
    "Resume",
    "Resumed",
    "Status",
    "decode",
    "encode",
]


class Hello(msgspec.Struct, tag=True):
    """Worker -> engine, first message and every heartbeat: ``worker`` is its id, ``pid`` its process."""

    worker: str
    pid: int


class Admit(msgspec.Struct, tag=True):
    """Worker -> engine: a session asks for a slot (it may wait in the waiting room).

    The worker has parsed and checked the query; the engine builds the persona prompt (it alone holds the
    tokenizer and the voice prompts) and refuses with ``bad_request`` what it cannot build.

    Attributes:
        voice_prompt, text_prompt: the persona ("" for none).
        sampling: ``(audio_temperature, audio_top_k, text_temperature, text_top_k, seed)``.
        max_inbox_frames: the session's input bound in the engine (the engine applies its own setting;
            kept for the message's shape).
        client: the caller's address (the waiting room caps waiters per address).
        token_id, token_expires_at: with ``DUPLEX_TOKEN_REPLAY_CHECK=memory``, the session token's id and
            expiry (Unix s): the engine spends it when the slot is taken, so that a token is single-use
            across every worker ("" when the workers spend tokens in Redis themselves).
        resumable, meta: ``runtime.engine.api.AdmitRequest``'s: issue a resume credential; the front end's
            opaque record, handed back on resume.
    """

    session_id: str
    voice_prompt: str
    text_prompt: str
    sampling: tuple[float, int, float, int, int]
    max_inbox_frames: int
    token_id: str = ""
    token_expires_at: float = 0.0
    client: str = ""
    resumable: bool = False
    meta: str = ""


class Admitted(msgspec.Struct, tag=True):
    """Engine -> worker: the session holds ``slot``; its prompt runs, ``PromptDone`` follows.
    ``credential``: its first resume credential ("" when not resumable)."""

    session_id: str
    slot: int
    credential: str = ""


class Detach(msgspec.Struct, tag=True):
    """Worker -> engine: the session's transport was lost without a normal close: hold its slot, paused,
    for ``resume_s`` (or release it when it is not resumable)."""

    session_id: str


class Resume(msgspec.Struct, tag=True):
    """Worker -> engine: a caller presents a resume ``credential``; ``ref`` names the request in the answer
    (``Resumed``, or ``Refused`` with ``session_id=ref``)."""

    ref: str
    credential: str
    client: str = ""


class Resumed(msgspec.Struct, tag=True):
    """Engine -> worker: the session's slot now delivers to this worker (``runtime.engine.api.ResumeGrant``:
    ``gap_s``, ``meta``, ``transcript``; ``credential`` the next one)."""

    ref: str
    session_id: str
    slot: int
    credential: str
    gap_s: float
    meta: str
    transcript: list[tuple[float, str]]


class Moved(msgspec.Struct, tag=True):
    """Engine -> the worker that held a session: it was resumed through another worker: close its transport,
    neither release nor end it."""

    session_id: str


class HoldExpired(msgspec.Struct, tag=True):
    """Engine -> the worker of a detached session: nobody resumed it in time; its slot is freed."""

    session_id: str


class Refused(msgspec.Struct, tag=True):
    """Engine -> worker: no slot. ``reason``: node_full, waiting_room_full, wait_timeout, bad_request,
    draining; ``message``: the sentence for the caller's 0x05 error."""

    session_id: str
    reason: str
    message: str


class PromptDone(msgspec.Struct, tag=True):
    """Engine -> worker: the session's slot is LIVE: send the handshake."""

    session_id: str


class Frame(msgspec.Struct, tag=True):
    """Worker -> engine: one input frame, 1920 float32 little-endian samples (7680 bytes)."""

    session_id: str
    pcm: bytes


class Release(msgspec.Struct, tag=True):
    """Worker -> engine: the session ended (or its caller left while waiting): free its slot or place."""

    session_id: str


class Outputs(msgspec.Struct, tag=True):
    """Engine -> worker: one tick's output for that worker's sessions, as ``(session_id, pcm, piece)``
    with ``pcm`` 1920 float32 LE samples or empty (no audio this tick) and ``piece`` text or ``""``."""

    items: list[tuple[str, bytes, str]]


class FirstAudio(msgspec.Struct, tag=True):
    """Engine -> worker, once per session, just before the ``Outputs`` carrying its first audio: the engine's
    side of its first-audio latency (``runtime.engine.api.FirstAudioTiming``; monotonic seconds, the host's
    clock the worker shares), for the budget the worker observes when that audio leaves."""

    session_id: str
    arrived_at: float
    taken_at: float
    ticks: int
    audio_tick_at: float
    audio_tick_end: float


class Status(msgspec.Struct, tag=True):
    """Engine -> every worker, about every 100 ms: the slots' state, for readiness, metrics and health, and
    the model's frame (``frame_sample_rate_hz``, ``frame_samples``: ``runtime.engine.api.FrameFormat``)."""

    slots: int
    free_slots: int
    waiting: int
    tick_alive: bool
    draining: bool
    voices: list[str]
    engine_pid: int = 0
    voices_refused: list[str] = []
    frame_sample_rate_hz: int = 24_000
    frame_samples: int = 1920


class Hangup(msgspec.Struct, tag=True):
    """End a session whichever worker holds it (WebRTC's ``DELETE /api/rtc/<session>``, which may reach any
    worker through ``SO_REUSEPORT``). Worker -> engine: ``requester`` empty; the engine forwards it to the
    worker holding ``session_id`` with ``requester`` set to the asking worker's identity, or answers
    ``HangupResult(ended=False)`` itself when no worker holds it. The holder checks ``key`` (the session
    resource's secret, which only it knows) and answers with :class:`HangupResult`.

    Attributes:
        request_id: the asking worker's number for this request (echoed in the result).
    """

    request_id: int
    session_id: str
    key: str
    requester: bytes = b""


class HangupResult(msgspec.Struct, tag=True):
    """Holder -> engine -> asking worker: whether :class:`Hangup` ended the session (False: no such session,
    or a wrong key). The engine forwards it to ``requester``."""

    request_id: int
    session_id: str
    ended: bool
    requester: bytes = b""


class SpendToken(msgspec.Struct, tag=True):
    """Worker -> engine: record a session token as spent now (``DUPLEX_TOKEN_REPLAY_CHECK=memory`` with
    workers: the engine keeps the node's one memory). A WebRTC session's token is spent when its transport
    connects, not when its slot is granted (docs/protocol.md, "WebRTC"). Answered with :class:`TokenSpent`.

    Attributes:
        request_id: the asking worker's number for this request (echoed in the answer).
        token_id: the token's ``jti``.
        expires_at: the token's ``exp`` (Unix s): kept spent until then plus the leeway.
        check_only: only ask whether it is unspent (record nothing): the offer's check before its answer.
    """

    request_id: int
    token_id: str
    expires_at: float
    check_only: bool = False


class TokenSpent(msgspec.Struct, tag=True):
    """Engine -> worker: whether :class:`SpendToken` spent the token (False: it was spent already)."""

    request_id: int
    fresh: bool


Message = (
    Hello
    | Admit
    | Admitted
    | Refused
    | PromptDone
    | Frame
    | Release
    | Outputs
    | FirstAudio
    | Status
    | Hangup
    | HangupResult
    | SpendToken
    | TokenSpent
    | Detach
    | Resume
    | Resumed
    | Moved
    | HoldExpired
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    """One message as msgpack bytes."""
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    """The message ``data`` holds.

    Raises:
        msgspec.DecodeError: not a message of this module (a version mismatch between processes).
    """
    return _decoder.decode(data)
