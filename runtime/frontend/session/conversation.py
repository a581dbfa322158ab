"""One conversation, whatever the transport: admission to a slot, the token spent, the persona prompt awaited,
frames in and out, the transcript, the release and how it ended.

Frames in the middle, codecs at the edge: a conversation takes and gives float32 mono samples at the
model's rate (``runtime.engine.model_presets.SAMPLE_RATE_HZ``, 24000 Hz). A transport decodes its own wire
format (the WebSocket: Kyutai's Ogg/Opus or PCM payloads, ``runtime.frontend.codecs.kyutai_audio``; WebRTC:
RTP Opus, ``runtime.frontend.transports.webrtc.media``) and calls :meth:`ChatSession.push_samples` with any
number of samples: the conversation assembles the slot's whole frames (one place, here). The session sends
each frame the engine produced, ``[1920]`` float32, through :meth:`Transport.send_audio`, which encodes it
for its wire. The recording takes the same frames on both sides (``runtime.frontend.store.recordings``), so
it is right whatever the transport.
Refusals are ``runtime.frontend.gate.refusals.SessionRefused`` (the table gives status, close code, message).

The lifecycle around a conversation (admit or resume, prompt, handshake, live, detached or held, ended) is
written once in ``runtime.frontend.session.lifecycle``; a transport is its edges only.

Resume, for any transport (docs/runtime.md, "Resume"): a session admitted with ``resumable=1`` holds a
single-use credential (:meth:`ChatSession.resume_metadata`, sent after the handshake). When its transport
is lost without a normal close, the lifecycle calls :meth:`ChatSession.detach` (the slot is held, paused,
for ``resume_s``) and awaits :meth:`ChatSession.held`; a new connection with the credential builds a new
``ChatSession`` and calls :meth:`ChatSession.resume` instead of :meth:`ChatSession.admit`: the same slot and
session id, through any worker of the node. The old session learns it in ``on_taken_over``.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from runtime.config import RuntimeConfig
from runtime.engine.api import (
    AdmitRequest,
    FirstAudioTiming,
    Refusal,
    ResumeGrant,
    SamplingParams,
    SlotBackend,
    SlotLease,
    replayed_message,
)
from runtime.frontend.gate.access import Access
from runtime.frontend.gate.query import ResumePresented, SessionRequest, parse_session_query
from runtime.frontend.gate.refusals import CLOSE_NORMAL, SessionRefused
from runtime.frontend.gate.slot_load import UpgradeReservations
from runtime.frontend.gate.tokens import TokenClaims, TokenRejected
from runtime.frontend.session.resume import ResumableSession
from runtime.frontend.session.state import SessionState
from runtime.frontend.store.events import prompt_digest
from runtime.frontend.store.recordings import SessionRecorder, start_recording
from runtime.frontend.store.redis_store import SessionRecord, SessionStore
from runtime.metrics import RuntimeMetrics

__all__ = [
    "PROMPT_TIMEOUT_S",
    "ChatSession",
    "FrontEnd",
    "SessionOutcome",
    "Transport",
    "persona_label",
    "plan_session",
    "sampling_from_request",
]

log = logging.getLogger(__name__)

PROMPT_TIMEOUT_S = 120.0
"""Longest wait for a persona prompt to be fed before the handshake."""


class FrontEnd(Protocol):
    """What sessions, transports and routes use of the server (``runtime.frontend.server.FrontEnd``),
    so that they need not import it."""

    config: RuntimeConfig
    backend: SlotBackend
    access: Access
    metrics: RuntimeMetrics
    store: SessionStore | None
    sessions: set[ChatSession]
    draining: bool
    upgrades: UpgradeReservations

    def health(self) -> tuple[bool, str]: ...
    def readiness(self) -> tuple[bool, str]: ...
    def readiness_json(self) -> dict[str, object]: ...
    def render_metrics(self, now: float | None = None) -> bytes: ...


def sampling_from_request(request: SessionRequest) -> SamplingParams:
    """The session's sampling settings: its query values where given, moshi's defaults elsewhere, and a
    random seed when the session names none.

    Raises:
        ValueError: a value out of range (the message names it).
    """
    defaults = SamplingParams()
    return SamplingParams(
        audio_temperature=defaults.audio_temperature
        if request.audio_temperature is None
        else request.audio_temperature,
        audio_top_k=defaults.audio_top_k if request.audio_topk is None else request.audio_topk,
        text_temperature=defaults.text_temperature
        if request.text_temperature is None
        else request.text_temperature,
        text_top_k=defaults.text_top_k if request.text_topk is None else request.text_topk,
        seed=secrets.randbelow(2**31) if request.seed is None else request.seed,
    )


def plan_session(
    front: FrontEnd,
    query: str | SessionRequest,
    text_prompt: str | None = None,
    resume: ResumePresented | None = None,
) -> tuple[SessionRequest, SamplingParams]:
    """What a session's query asks for, checked: the request (``query``: the raw query string, or the
    request the gate parsed once, ``runtime.frontend.gate.admission.Admitted.request``; ``text_prompt``: one
    that came as metadata;
    ``resume``: the credential as the request presented it, header, subprotocol or query) and its sampling
    settings; the persona checked by the backend.

    Raises:
        SessionRefused: ``bad_request`` (a bad parameter, an unknown voice, a text prompt over the limit, a
            sampling value out of range, a malformed resume credential or two different ones), the message
            names it.
    """
    try:
        request = query if isinstance(query, SessionRequest) else parse_session_query(query)
        if text_prompt is not None:
            request = dataclasses.replace(request, text_prompt=text_prompt)
        if resume is not None and resume.given:
            request = dataclasses.replace(request, resume=resume.credential())
        front.backend.check_persona(request.voice_prompt, request.text_prompt)
        sampling = sampling_from_request(request)
    except ValueError as exc:  # ProtocolError and the persona's errors are ValueErrors
        raise SessionRefused("bad_request", f"bad request: {exc}") from None
    return request, sampling


def persona_label(request: SessionRequest) -> str:
    """Short description of the persona for the session registry, its events and listings: the voice's
    name and the text prompt's digest and length in characters (``text_sha256=<16 hex> text_chars=<n>``),
    never its words (issue 34, item 8: the role prompt was copied into records, events and listings; the
    prompt itself stays in the slot). The store reads the digest back (``store.events.persona_fields``)."""
    parts = []
    if request.voice_prompt:
        parts.append(f"voice={request.voice_prompt}")
    if request.text_prompt:
        digest = prompt_digest(request.text_prompt)
        parts.append(f"text_sha256={digest['prompt_sha256']} text_chars={digest['prompt_chars']}")
    return " ".join(parts)


@dataclass
class SessionOutcome:
    """How a session ended, for logs, metrics and the registry. ``lost``: the transport was lost without a
    normal close (no close frame, a failed ICE path): a resumable session is detached, not ended."""

    reason: str
    close_code: int = CLOSE_NORMAL
    lost: bool = False


class Transport(abc.ABC):
    """What a session sends through its connection (the transport frames it)."""

    name = "websocket"
    """The ``transport`` label of the sessions' metrics: ``websocket`` or ``webrtc``."""
    audio_format = "opus"
    """What the wire carries, for the session registry's ``format``: ``opus`` or ``pcm``."""

    @abc.abstractmethod
    async def send_audio(self, pcm: np.ndarray) -> None:
        """One frame the engine produced, ``[1920]`` float32 mono at 24000 Hz in [-1, 1], to encode for the
        wire and send (the transport owns its encoder)."""

    @abc.abstractmethod
    async def send_text(self, piece: str) -> None:
        """One text piece of the model's transcript."""

    @abc.abstractmethod
    async def close(self, code: int, reason: str) -> None:
        """End the connection with ``code`` (WebSocket close codes: ``runtime.frontend.gate.refusals``)."""


class ChatSession(ResumableSession):
    """One conversation: its codecs, its slot lease, its outbound queue.

    Args:
        front: the server (config, metrics, store, backend, access).
        transport: where outputs go.
        request, sampling: from :func:`plan_session`.
        claims: the session token's claims (None with ``auth_mode=off``).
        client: the caller's address.
    """

    front: FrontEnd
    transport: Transport

    def __init__(
        self,
        front: FrontEnd,
        transport: Transport,
        request: SessionRequest,
        sampling: SamplingParams,
        claims: TokenClaims | None,
        client: str,
    ) -> None:
        self.front = front
        self.transport = transport
        self.request = request
        self.sampling = sampling
        self.claims = claims
        self.client = client
        self.session_id = uuid.uuid4().hex
        config = front.config
        self.frame_samples = front.backend.status().frame.samples
        """Samples per model frame, as the backend reports the model's (:class:`FrameFormat`; 1920)."""
        self._pending: np.ndarray = np.zeros(0, dtype=np.float32)
        """Samples pushed that do not fill a frame yet (fewer than :attr:`frame_samples`)."""
        self.outbox: asyncio.Queue[tuple[np.ndarray | None, str | None]] = asyncio.Queue(
            config.max_outbox_frames
        )
        self.ready = asyncio.Event()
        self.first_audio_sent = False
        self.first_audio_timing: FirstAudioTiming | None = None
        """The engine's side of the first audio (``SessionSink.on_first_audio``), on the host's clock."""
        self.clock = time.monotonic
        """Monotonic seconds, the clock the backend stamps the first frame with (injected in tests)."""
        self.frames_in = 0
        self.frames_out = 0
        self.lease: SlotLease | None = None
        self.state = SessionState.PLANNED
        """Where the conversation stands (``runtime.frontend.session.state``)."""
        self._released = False
        self._finished = False
        self.recorder: SessionRecorder | None = None
        """Both sides to disk when the token has ``recording_consent``
        (``runtime.frontend.store.recordings``)."""
        self.record: SessionRecord | None = None
        """What the session store holds of it (None without a store, or before admission)."""
        self.started_at = time.time()
        """Unix s: when the conversation started (a resumed session keeps the first connection's)."""
        self.limit_s = self.max_session_s
        """The conversation's longest length (s) from :attr:`started_at` (a resume keeps the first's)."""
        self.persona = persona_label(request)
        self.resumed: ResumeGrant | None = None
        """How this session took its slot over (None: admitted, not resumed)."""
        self._hold: asyncio.Future[bool] | None = None
        self.spend_on_connect = False
        """Admit without spending the token; the transport calls :meth:`spend_token` once it connects
        (WebRTC: an answered offer whose ICE never connects leaves its token for a WebSocket fallback)."""

    @property
    def max_session_s(self) -> float:
        """The node's longest session, or the token's ``max_session_s`` when shorter."""
        limit = self.front.config.max_session_s
        if self.claims is not None and self.claims.max_session_s is not None:
            limit = min(limit, self.claims.max_session_s)
        return limit

    # --- the backend's sink (on the event loop) -------------------------------------------------------

    def on_output(self, pcm: np.ndarray | None, piece: str | None) -> None:
        if self.outbox.full():
            self.outbox.get_nowait()
            self.front.metrics.frames_dropped.labels(reason="slow_client").inc()
        self.outbox.put_nowait((pcm, piece))

    def on_prompt_done(self) -> None:
        self.ready.set()

    def on_first_audio(self, timing: FirstAudioTiming) -> None:
        self.first_audio_timing = timing

    # --- admission ------------------------------------------------------------------------------------

    async def admit(self) -> int:
        """A slot (at once or after the waiting room), the token spent, the session registered. Cancelling
        it (the caller left) gives the place or the slot back.

        Raises:
            SessionRefused: no slot, or the token was spent meanwhile (the slot is given back then).
        """
        backend = self.front.backend
        token_id, expires_at = "", 0.0
        if backend.spends_tokens and self.claims is not None and not self.spend_on_connect:
            token_id, expires_at = self.claims.token_id, self.claims.expires_at
        resumable = bool(self.request.resumable) and self.front.config.resume_s > 0
        meta = self.resume_meta() if resumable else ""
        request = AdmitRequest(
            self.session_id,
            self.request.voice_prompt,
            self.request.text_prompt,
            self.sampling,
            client=self.client,
            token_id=token_id,
            token_expires_at=expires_at,
            resumable=resumable,
            meta=meta,
        )
        try:
            self.lease = await backend.admit(request, self)
        except Refusal as exc:
            raise SessionRefused(exc.reason, exc.message) from None
        # The token is spent now that the session holds a slot, and not before: a refused upgrade or a
        # full node leaves it unspent (issue 16). With backend.spends_tokens the backend did it on grant.
        if not backend.spends_tokens and not self.spend_on_connect:
            try:
                await self.front.access.spend(self.claims)
            except TokenRejected as exc:
                self.release()
                raise SessionRefused(exc.reason, str(exc)) from None
        self.state = SessionState.ADMITTED
        self.front.metrics.sessions_started.inc()
        consent = self.claims is not None and self.claims.recording_consent
        recordings = getattr(self.front, "recordings", None)
        self.recorder = start_recording(recordings, consent, self.session_id, self.front.metrics)
        self.front.metrics.transport_sessions_started.labels(transport=self.transport.name).inc()
        self.front.metrics.transport_sessions_active.labels(transport=self.transport.name).inc()
        store = self.front.store
        if store is not None:
            self.record = SessionRecord(
                self.session_id,
                self.front.config.node_id,
                self.lease.slot,
                self.started_at,
                self.persona,
                self.transport.audio_format,
                recording=self.recorder is not None,
            )
            store.register_session(self.record)
        return self.lease.slot

    async def spend_token(self, check_only: bool = False) -> None:
        """Spend the token of a session admitted with :attr:`spend_on_connect` (its transport has
        connected): through the backend when it spends tokens (the engine with workers and ``memory``),
        else the front end's replay guard (Redis ``SET NX`` or this process's memory). Of two sessions
        holding one token, the first to spend it carries on; the other gets ``replayed``. ``check_only``:
        spend nothing, only refuse a token spent already (the engine's ledger; the front end's replay
        guard was read by ``Access.check``).

        Raises:
            SessionRefused: ``replayed`` (spent meanwhile), ``replay_check_unavailable`` or ``not_ready``.
        """
        claims = self.claims
        if claims is None:
            return
        backend = self.front.backend
        try:
            if not backend.spends_tokens:
                if not check_only:
                    await self.front.access.spend(claims)
            elif not await backend.spend_token(claims.token_id, claims.expires_at, check_only):
                raise SessionRefused("replayed", replayed_message(claims.token_id))
        except TokenRejected as exc:
            raise SessionRefused(exc.reason, str(exc)) from None
        except Refusal as exc:
            raise SessionRefused(exc.reason, exc.message) from None

    async def wait_prompt(self) -> None:
        """Until the persona prompt has run (the slot is live).

        Raises:
            TimeoutError: not within ``PROMPT_TIMEOUT_S``.
        """
        await asyncio.wait_for(self.ready.wait(), PROMPT_TIMEOUT_S)

    # --- frames ---------------------------------------------------------------------------------------

    @property
    def takes_audio(self) -> bool:
        """The slot is live (the persona prompt has run): :meth:`push_samples` passes audio on."""
        return self.ready.is_set() and self.lease is not None

    def push_samples(self, pcm: np.ndarray) -> None:
        """The caller's audio, decoded by the transport: ``[T]`` float32 mono samples at 24000 Hz in
        [-1, 1], any ``T``. Whole ``[frame_samples]`` (1920) frames go to the slot (and to the recording) as
        they fill; the rest waits for the next push. Dropped before the handshake, as moshi's server does.

        Raises:
            ValueError: ``pcm`` is not one-dimensional.
        """
        if not self.takes_audio:
            return
        assert self.lease is not None
        samples = np.asarray(pcm, dtype=np.float32)
        if samples.ndim != 1:
            raise ValueError(f"push_samples takes mono samples [T], got shape {samples.shape}")
        if self._pending.size:
            samples = np.concatenate([self._pending, samples])
        size = self.frame_samples
        whole = samples.size // size * size
        self._pending = samples[whole:].copy()
        metrics = self.front.metrics
        for start in range(0, whole, size):
            frame = samples[start : start + size]
            self.frames_in += 1
            if self.recorder is not None:
                self.recorder.caller(frame)  # a queue put: the recording is written off the audio path
            if not self.front.backend.push_frame(self.lease, frame):
                metrics.frames_dropped.labels(reason="input_overflow").inc()

    async def send_loop(self) -> None:
        """Send the outputs through the transport (which encodes them), in order, until cancelled."""
        store = self.front.store
        while True:
            pcm, piece = await self.outbox.get()
            if pcm is not None:
                self.frames_out += 1
                if self.recorder is not None:
                    self.recorder.agent(pcm)
                await self.transport.send_audio(pcm)
                lease = self.lease
                if not self.first_audio_sent and lease is not None and lease.first_input_at:
                    self.first_audio_sent = True
                    self._observe_first_audio(lease.first_input_at, self.clock())
            if piece is not None:
                await self.transport.send_text(piece)
                if store is not None:  # after the send: the transcript holds what the client was sent
                    store.append_transcript(self.session_id, piece)

    def _observe_first_audio(self, first_input_at: float, sent_at: float) -> None:
        """The first audio has been encoded and handed to the transport's wire: its latency from the first
        input frame and, with the engine's timing, the budget's terms (docs/benchmarks.md, "First-audio
        latency budget"); once per session."""
        timing = self.first_audio_timing
        if timing is None:  # a backend that gives none (a test's fake)
            self.front.metrics.observe_first_audio(sent_at - first_input_at)
            return
        self.front.metrics.observe_first_audio(
            sent_at - first_input_at,
            ingress_s=timing.arrived_at - first_input_at,
            phase_wait_s=timing.phase_wait_s,
            ticks=timing.ticks,
            tick_compute_s=timing.tick_compute_s,
            egress_s=sent_at - timing.audio_tick_end,
        )

    # --- the end --------------------------------------------------------------------------------------

    def release(self) -> None:
        """Give the slot back (idempotent): as soon as the session is decided over, not when its
        connection has finished closing."""
        if self._released or self.lease is None:
            return
        self._released = True
        self.front.backend.release(self.lease)

    def finish(self, outcome: SessionOutcome) -> None:
        """Release, and count and record how the session ended (when it had started; not when it was
        resumed through another connection, which goes on)."""
        self.release()
        if not self.state.started or self._finished:
            return
        self._finished = True
        if self.recorder is not None:  # a resume elsewhere records no more: the files end at the drop
            self.recorder.close()
        # Active on this transport in this process until now (a resume counts it where it goes on).
        self.front.metrics.transport_sessions_active.labels(transport=self.transport.name).dec()
        if self.moved:  # resumed through another connection: that one ends the session
            return
        self.state = SessionState.ENDED
        self.front.metrics.sessions_ended.labels(reason=outcome.reason).inc()
        if self.front.store is not None:
            self.front.store.end_session(self.session_id, outcome.reason)
        log.info(
            "session %s ended (%s): %d frames in, %d out",
            self.session_id,
            outcome.reason,
            self.frames_in,
            self.frames_out,
        )
