"""The slot backend: what the front end asks of whoever owns the model's slots, and nothing of tensors.

After vLLM v1's ``EngineCoreClient`` (``vllm/v1/engine/core_client.py``): one interface, two
implementations chosen at start-up, and a front end written once against the interface:

- in-process (``duplex serve --workers 0``): :class:`runtime.engine.engine_core.LocalSlots`, the model, the
  scheduler and the waiting room in the front end's own process;
- over ZeroMQ (``--workers N``): :class:`runtime.frontend.engine_client.EngineClient` in each worker, to the
  engine process (``runtime.engine.engine_core.EngineCore``, which serves a ``LocalSlots``).

The front end (``runtime.frontend``) imports this module, never the model: it imports neither torch nor
moshi, so a worker process starts without them. Frames are ``[1920]`` float32 numpy arrays (80 ms at
24 kHz).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runtime.engine.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ

if TYPE_CHECKING:  # annotations only: the deploy extra reads the token sentence here without numpy
    import numpy as np

__all__ = [
    "DEFAULT_AUDIO_TEMPERATURE",
    "DEFAULT_AUDIO_TOP_K",
    "DEFAULT_TEXT_TEMPERATURE",
    "DEFAULT_TEXT_TOP_K",
    "MIMI_FRAME",
    "REFUSAL_REASONS",
    "RESUME_REFUSAL_REASONS",
    "AdmitRequest",
    "BackendStatus",
    "FirstAudioTiming",
    "FrameFormat",
    "Refusal",
    "ResumeGrant",
    "SamplingParams",
    "SessionSink",
    "SlotBackend",
    "SlotLease",
    "RESUME_OFF_MESSAGE",
    "node_full_message",
    "replayed_message",
]

DEFAULT_AUDIO_TEMPERATURE = 0.8
DEFAULT_AUDIO_TOP_K = 250
DEFAULT_TEXT_TEMPERATURE = 0.7
DEFAULT_TEXT_TOP_K = 25
"""moshi's ``LMGen`` defaults (audio 0.8 / 250, text 0.7 / 25); PersonaPlex's offline script uses them too."""


@dataclass(frozen=True)
class SamplingParams:
    """One session's sampling settings (plain values: the sampler, ``runtime.engine.sampling``, reads them).

    Attributes:
        audio_temperature: >= 0; 0 is greedy.
        audio_top_k: >= 1 candidates kept per audio codebook.
        text_temperature: >= 0; 0 is greedy.
        text_top_k: >= 1 candidates kept for the text token.
        seed: 0 .. 2**31-1; the same seed and inputs give the same tokens.

    Raises:
        ValueError: a value out of range (the message names it and the allowed range).
    """

    audio_temperature: float = DEFAULT_AUDIO_TEMPERATURE
    audio_top_k: int = DEFAULT_AUDIO_TOP_K
    text_temperature: float = DEFAULT_TEXT_TEMPERATURE
    text_top_k: int = DEFAULT_TEXT_TOP_K
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("audio_temperature", "text_temperature"):
            value = getattr(self, name)
            if not 0.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [0, 2], got {value}")
        for name in ("audio_top_k", "text_top_k"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must be in [0, 2**31), got {self.seed}")

    @classmethod
    def greedy(cls) -> SamplingParams:
        """Argmax decoding for text and audio: deterministic whatever the seed."""
        return cls(audio_temperature=0.0, text_temperature=0.0)

    def as_tuple(self) -> tuple[float, int, float, int, int]:
        """``(audio_temperature, audio_top_k, text_temperature, text_top_k, seed)``, the IPC form."""
        return (self.audio_temperature, self.audio_top_k, self.text_temperature, self.text_top_k, self.seed)


REFUSAL_REASONS: tuple[str, ...] = (
    "node_full",
    "waiting_room_full",
    "wait_timeout",
    "bad_request",
    "draining",
    "not_ready",
    "engine_lost",
    "replayed",
    "resume_off",
    "resume_invalid",
    "resume_replayed",
    "resume_expired",
    "resume_live",
)
"""Every reason a backend refuses an admission with (the front end's refusal table maps each to an HTTP
status, a close code and a message: ``runtime.frontend.gate.refusals``)."""


RESUME_REFUSAL_REASONS: tuple[str, ...] = tuple(r for r in REFUSAL_REASONS if r.startswith("resume_"))
"""Why a resume is refused (``duplex_resume_refused_total``'s ``reason``): ``resume_off`` (the node holds
no slot for resume: ``DUPLEX_RESUME_S=0``), ``resume_invalid`` (not a credential, or not this session's),
``resume_replayed`` (a credential already used: each is single-use), ``resume_expired`` (the hold ran out,
or the session ended), ``resume_live`` (the session's owner is still connected and answering: a resume is
accepted only once its connection is lost; ``runtime.engine.resume.PROBE_S``)."""


class Refusal(Exception):
    """The backend gives no slot.

    Attributes:
        reason: one of :data:`REFUSAL_REASONS`.
        message: the sentence the caller reads (the 0x05 error's text).

    Raises:
        ValueError: (on construction) a reason not in :data:`REFUSAL_REASONS`.
    """

    def __init__(self, reason: str, message: str) -> None:
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}; one of {', '.join(REFUSAL_REASONS)}")
        super().__init__(message)
        self.reason = reason
        self.message = message


def node_full_message(slots: int) -> str:
    """The sentence of a ``node_full`` refusal: all ``slots`` are in use."""
    return f"node full: all {slots} slots in use (max_sessions={slots}); try again later"


@dataclass(frozen=True)
class FrameFormat:
    """What one model frame is: ``samples`` mono float32 samples at ``sample_rate_hz``; one LM step each.

    The model says it (its codec: Mimi's ``sample_rate`` and ``frame_size``, moshi
    ``models/compression.py``), the engine reports it in :class:`BackendStatus`, and the front end, the
    browser client (``/api/personas``) and the tools read it from there. Kyutai's Moshi and NVIDIA's
    PersonaPlex-7B-v1 share Mimi's: 24000 Hz, 1920 samples (80 ms, 12.5 Hz).

    Raises:
        ValueError: a rate or a frame size < 1.
    """

    sample_rate_hz: int
    samples: int

    def __post_init__(self) -> None:
        if self.sample_rate_hz < 1 or self.samples < 1:
            raise ValueError(
                "a frame needs a sample rate and a size >= 1, "
                f"got {self.sample_rate_hz} Hz and {self.samples}"
            )

    @property
    def ms(self) -> float:
        """One frame's duration in milliseconds (80.0 for Mimi's)."""
        return 1000.0 * self.samples / self.sample_rate_hz

    def describe(self) -> str:
        """``"24000 Hz, 1920 samples (80 ms)"``: for errors and logs."""
        return f"{self.sample_rate_hz} Hz, {self.samples} samples ({self.ms:g} ms)"

    def as_json(self) -> dict[str, object]:
        """``{"sample_rate_hz", "samples", "ms"}``: the frame as ``/api/personas`` gives it to clients."""
        return {"sample_rate_hz": self.sample_rate_hz, "samples": self.samples, "ms": self.ms}


MIMI_FRAME = FrameFormat(SAMPLE_RATE_HZ, FRAME_SAMPLES)
"""Mimi's frame (moshi ``models/loaders.py``: ``SAMPLE_RATE = 24000``, ``FRAME_RATE = 12.5``), the one every
Moshi-architecture model this runtime serves has; the codecs at the front end's edges carry this one."""


@dataclass(frozen=True)
class BackendStatus:
    """The slots' state as the front end sees it now.

    Attributes:
        loaded: the model is loaded and warm (False while it loads: the front end answers ``loading``).
        slots: B, the node's slots.
        free_slots: slots free now (0 when the backend is not reachable).
        waiting: callers in the waiting room.
        tick_alive: the tick loop runs.
        lost: the backend was reachable and is not any more (the engine process died): fatal.
        voices: the voice prompts the node has, sorted.
        voices_refused: the voice files refused at start-up, each ``"<file>: <what was wrong>"``.
        detail: extra fields for ``/readyz`` (the engine's pid and the worker's id with ``--workers N``).
        frame: the model's frame (:class:`FrameFormat`), as the engine's model reports it.
    """

    loaded: bool
    slots: int
    free_slots: int
    waiting: int
    tick_alive: bool
    lost: bool = False
    voices: tuple[str, ...] = ()
    voices_refused: tuple[str, ...] = ()
    detail: dict[str, object] = field(default_factory=dict)
    frame: FrameFormat = MIMI_FRAME

    def health(self) -> tuple[bool, str]:
        """(healthy, text): what ``/healthz`` answers (200 or 500)."""
        if self.lost:
            return False, "engine unreachable"
        if not self.loaded:
            return True, "loading"
        return (True, "ok") if self.tick_alive else (False, "tick loop stopped")


@dataclass(frozen=True)
class FirstAudioTiming:
    """Where a session's first audio came from, as the tick thread saw it: monotonic seconds on the
    engine's clock (the scheduler's; ``time.monotonic``, which the engine and the workers of one node share,
    since they run on one host), and a tick count. Delivered once per session, just before its first audio.

    Attributes:
        arrived_at: the first input frame reached the engine (pushed to the slot's inbox).
        taken_at: the start of the tick that took it.
        ticks: ticks from that tick to the one that produced the first audio (0: the same tick).
        audio_tick_at, audio_tick_end: the start and end of the tick that produced the first audio.
    """

    arrived_at: float
    taken_at: float
    ticks: int
    audio_tick_at: float
    audio_tick_end: float

    @property
    def phase_wait_s(self) -> float:
        """From the first frame's arrival to the start of the tick that took it."""
        return self.taken_at - self.arrived_at

    @property
    def tick_compute_s(self) -> float:
        """The wall time of the tick that produced the first audio."""
        return self.audio_tick_end - self.audio_tick_at

    def as_tuple(self) -> tuple[float, float, int, float, float]:
        """``(arrived_at, taken_at, ticks, audio_tick_at, audio_tick_end)``, the IPC form."""
        return (self.arrived_at, self.taken_at, self.ticks, self.audio_tick_at, self.audio_tick_end)


class SessionSink(abc.ABC):
    """Where a backend delivers one session's outputs; called on the front end's event loop."""

    @abc.abstractmethod
    def on_output(self, pcm: np.ndarray | None, piece: str | None) -> None:
        """One tick's output: ``pcm`` ``[1920]`` float32 (or None: no audio this tick), ``piece`` text."""

    @abc.abstractmethod
    def on_prompt_done(self) -> None:
        """The persona prompt has run: the slot is live (send the handshake)."""

    def on_first_audio(self, timing: FirstAudioTiming) -> None:  # noqa: B027 (optional: most sinks ignore it)
        """Once, just before the ``on_output`` that carries the session's first audio: the engine's side of
        its first-audio latency (the front end adds the way out and observes the budget's terms)."""

    def on_taken_over(self) -> None:  # noqa: B027 (optional: only resumable sessions get it)
        """Another transport resumed this session (:meth:`SlotBackend.resume`): the slot now delivers to
        another sink. This one must close its transport and neither release the slot nor end the session."""

    def on_hold_expired(self) -> None:  # noqa: B027 (optional: only detached sessions get it)
        """The session was detached (:meth:`SlotBackend.detach`) and nobody resumed it within the hold: its
        slot is freed; the session has ended (``resume_expired``)."""


@dataclass(frozen=True)
class AdmitRequest:
    """A session asking for a slot.

    Attributes:
        session_id: unique id.
        voice_prompt, text_prompt: the persona (None for none); the backend builds its prompt and refuses
            ``bad_request`` what it cannot build (an unknown voice, a text prompt over the token limit).
        sampling: the session's sampling settings.
        client: the caller's address (the waiting room caps waiters per address).
        token_id, token_expires_at: the session token's id and expiry (Unix s) when the backend spends
            tokens (``DUPLEX_TOKEN_REPLAY_CHECK=memory``: the slot owner's memory is the node's), else "".
        resumable: the caller asked for a resume credential (``resumable=1``); the backend issues one in
            :attr:`SlotLease.resume_credential` when it holds slots for resume (``resume_s`` > 0).
        meta: opaque text the front end keeps with the slot (its session record) and gets back on resume.
    """

    session_id: str
    voice_prompt: str | None
    text_prompt: str | None
    sampling: SamplingParams
    client: str = ""
    token_id: str = ""
    token_expires_at: float = 0.0
    resumable: bool = False
    meta: str = ""


@dataclass(eq=False)
class SlotLease:
    """A session admitted to (or waiting for) a slot: the front end's handle on it.

    Attributes:
        session_id: the request's id.
        slot: the slot index once granted (-1 before).
        first_input_at: monotonic time (s) of the first frame pushed, for the first-audio latency.
        resume_credential: the single-use credential that resumes this session on any worker of the node
            (``<session_id>.<secret>``, URL-safe), "" when not resumable.
    """

    session_id: str
    slot: int = -1
    first_input_at: float | None = None
    resume_credential: str = ""


@dataclass(frozen=True)
class ResumeGrant:
    """A resumed session (:meth:`SlotBackend.resume`).

    Attributes:
        lease: the same slot and session id, with a fresh single-use credential.
        gap_s: seconds from the session's last input frame before the drop to this resume (on the slot
            owner's clock); 0 when no frame had arrived.
        meta: the :attr:`AdmitRequest.meta` the session was admitted with.
        transcript: every text piece the slot produced so far, in order, with when it was produced
            (unix s, on the slot owner's clock): the front end's store rewrites the session's transcript
            from it (``SessionStore.adopt_session``), so nothing queued elsewhere is lost.
    """

    lease: SlotLease
    gap_s: float
    meta: str
    transcript: list[tuple[float, str]]


class SlotBackend(abc.ABC):
    """The slots' owner, as the front end uses it. Methods run on the front end's event loop."""

    on_lost: list[Callable[[], None]]
    """Called once when the backend becomes unreachable (the front end closes its sessions with 1011)."""

    spends_tokens: bool = False
    """The backend records tokens as spent when it grants a slot (the front end's one spending place
    passes them on in :class:`AdmitRequest` instead of spending them itself)."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Open the slots (start the tick, or connect to the engine)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop the tick, or disconnect. Idempotent."""

    @abc.abstractmethod
    def status(self) -> BackendStatus:
        """The slots' state now."""

    @abc.abstractmethod
    def check_persona(self, voice_prompt: str | None, text_prompt: str | None) -> None:
        """Check a persona without taking a slot (``/api/admission`` and before the upgrade).

        Raises:
            ValueError: an unknown voice or a text prompt over the limit (the message says what is allowed).
        """

    @abc.abstractmethod
    async def admit(self, request: AdmitRequest, sink: SessionSink) -> SlotLease:
        """A slot for the session, at once or after the waiting room; its outputs go to ``sink``.
        Cancelling the call (the caller left) gives its place or slot back.

        Raises:
            Refusal: no slot (the reason says why).
        """

    @abc.abstractmethod
    def push_frame(self, lease: SlotLease, frame: np.ndarray) -> bool:
        """Queue one ``[1920]`` float32 input frame; False when it (or an older one) was dropped."""

    @abc.abstractmethod
    def release(self, lease: SlotLease) -> None:
        """The session ended: free its slot at the next tick. Idempotent."""

    on_hangup: Callable[[str, str], bool] | None = None
    """Set by the front end: end this process's session ``(session_id, key)`` if it holds it with that key
    (True when it did). A backend shared by several front ends calls it for a :meth:`hang_up` another
    front end asked for."""

    async def hang_up(self, session_id: str, key: str) -> bool:
        """End a session that another front-end process holds (``DELETE /api/rtc/<session>`` reaching a
        worker that does not hold it); True when its holder ended it. One process (``--workers 0``) holds
        every session itself: False."""
        return False

    async def spend_token(self, token_id: str, expires_at: float, check_only: bool = False) -> bool:
        """Record the session token ``token_id`` (``exp`` ``expires_at``, Unix s) as spent now, apart from
        a grant: a WebRTC session's token is spent when its transport connects. Only called when
        :attr:`spends_tokens` is set. True when it was fresh, False when it was spent already;
        ``check_only``: record nothing (the offer's check before its answer).

        Raises:
            Refusal: ``not_ready`` when the backend does not answer.
        """
        raise NotImplementedError(f"{type(self).__name__} does not spend tokens")

    def detach(self, lease: SlotLease) -> bool:
        """The session's transport was lost without a normal close: hold its slot, paused (not stepped),
        for the node's ``resume_s``, for :meth:`resume`. The sink gets ``on_hold_expired`` when nobody
        resumed it in time, or ``on_taken_over`` when a resume took it. False (nothing held: release it)
        when the session is not resumable or the node holds no slot for resume."""
        return False

    async def resume(self, credential: str, sink: SessionSink, client: str = "") -> ResumeGrant:
        """Attach ``sink`` to the session that ``credential`` names (detached, or still attached to a
        transport that has not noticed its loss but whose input stopped for ``SILENCE_S``: that sink gets
        ``on_taken_over``); spends the credential. A session whose owner is still sending is refused
        (``resume_live``), its owner and credential untouched (``runtime.engine.resume``).

        Raises:
            Refusal: one of :data:`RESUME_REFUSAL_REASONS` (or ``not_ready``, ``engine_lost``).
        """
        raise Refusal("resume_off", RESUME_OFF_MESSAGE)


RESUME_OFF_MESSAGE = "this node holds no slot for resume (DUPLEX_RESUME_S=0): start a new session"
"""The sentence of a ``resume_off`` refusal."""


def replayed_message(token_id: str) -> str:
    """The sentence of a ``replayed`` refusal (written once: the front end's replay guards and the engine's
    ledger both use it)."""
    return f"token {token_id} was already used; tokens are single-use"
