"""The slots of one model copy in this process (``runtime.engine.api.SlotBackend`` in-process): the model, the
scheduler and its tick thread, the waiting room, persona prompts, the token ledger and the resume holds.

``duplex serve --workers 0`` uses :class:`LocalSlots` directly, behind the front end in the same process; the
engine process of ``--workers N`` (``runtime.engine.engine_core.EngineCore``) serves one to the workers over
ZeroMQ. Engine side only: it imports no front-end module.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np

from runtime.engine.api import (
    AdmitRequest,
    BackendStatus,
    Refusal,
    ResumeGrant,
    SamplingParams,
    SessionSink,
    SlotBackend,
    SlotLease,
    node_full_message,
    replayed_message,
)
from runtime.engine.batch import PromptStep
from runtime.engine.model_presets import DEFAULT_TEXT_PROMPT, DEFAULT_VOICE_PROMPT, FRAME_MS
from runtime.engine.models import ModelBundle
from runtime.engine.persona import (
    Persona,
    PersonaError,
    VoiceCatalog,
    build_prompt,
    with_defaults,
)
from runtime.engine.resume import SinkRoute, SlotHolds
from runtime.engine.rollover import RolloverPolicy
from runtime.engine.scheduler import NodeFull, SlotScheduler, SlotSession
from runtime.engine.sim import make_engine
from runtime.engine.voices import voices_source
from runtime.engine.waiting_room import SlotAdmission, WaitingRoomFull, WaitTimeout, open_slots
from runtime.metrics import RuntimeMetrics

__all__ = ["DRAINING_MESSAGE", "LocalSlots"]

log = logging.getLogger(__name__)

DRAINING_MESSAGE = "node is draining for shutdown; connect to another node"
"""The sentence of a ``draining`` refusal."""


@dataclass(eq=False)
class _LocalLease(SlotLease):
    slot_session: SlotSession | None = None
    unconfirmed: bool = False
    """A resume's lease before its first frame (which spends the credential it presented)."""


class LocalSlots(SlotBackend):
    """The slots of one model copy in this process: ``runtime.engine.api.SlotBackend`` in-process.

    Args:
        config: the node's settings (``max_sessions``, ``model``, ``sim_step_ms``, ``prompt_prefill``,
            ``stagger_groups``, ``voices_dir``, ``rollover*``, waiting room, ``max_inbox_frames``,
            ``token_replay_check``, ``token_leeway_s``).
            Any object with those attributes (a ``RuntimeConfig``).
        bundle: the loaded models.
        metrics: where ticks, slots and the waiting room are counted.
        spends_tokens: record tokens as spent on grant (the engine process with
            ``DUPLEX_TOKEN_REPLAY_CHECK=memory``: one memory for every worker); in one process the front end
            spends them.

    Attributes:
        engine, voices: the batch engine and the voice prompts.
        scheduler, admission: the tick's scheduler and its waiting room (None before :meth:`start`).
        draining: refuse new sessions (``draining``).
        holds: the resumable sessions and their held slots (``runtime.engine.resume``; ``holds.clock`` is
            the hold's clock, injected in tests).
    """

    def __init__(  # type: ignore[no-untyped-def]
        self,
        config,
        bundle: ModelBundle,
        metrics: RuntimeMetrics | None = None,
        *,
        spends_tokens: bool = False,
    ) -> None:
        self.config = config
        self.bundle = bundle
        self.metrics = metrics or RuntimeMetrics()
        # Before make_engine: wav voices are encoded by Mimi, which the engine puts into B-row streaming mode
        self.voices = VoiceCatalog.load(
            voices_source(config.voices_dir, bundle.source, from_hub=bundle.preset.persona_required),
            bundle.mimi,
            lm=bundle.lm,
        )
        self.metrics.voice_files_refused.set(len(self.voices.refused))
        self.engine = make_engine(
            config.model,
            bundle,
            config.max_sessions,
            config.sim_step_ms,
            prefill=config.prompt_prefill,
            tick_period_ms=FRAME_MS / config.stagger_groups,
            rollover=RolloverPolicy.from_config(config),
        )
        self.scheduler: SlotScheduler | None = None
        self.admission: SlotAdmission | None = None
        self.draining = False
        self.warm = False
        self.on_lost = []
        self.spends_tokens = spends_tokens
        self._spent_tokens: dict[str, float] = {}  # token id -> until (Unix s)
        self.holds = SlotHolds(getattr(config, "resume_s", 0.0), self._release_slot)

    def warm_up(self, frames: int = 4) -> None:
        """Run every prefill chunk size once, then ``frames`` silent ticks through slot 0 (then freed):
        first-call costs leave the hot path. Blocking (seconds for a real model)."""
        self.engine.warm_up_prefill()
        self.engine.join(0, SamplingParams())
        silence = np.zeros((self.engine.slots, 1920), dtype=np.float32)
        for _ in range(frames + 1):
            self.engine.tick(silence)
        self.engine.leave(0)
        self.warm = True

    async def start(self) -> None:
        """Warm up (when not done yet) and start the tick thread behind the waiting room."""
        if not self.warm:
            await asyncio.to_thread(self.warm_up)
        self.admission = open_slots(
            self.engine,
            self.bundle.text_tokenizer,
            self.metrics,
            asyncio.get_running_loop(),
            wait_s=self.config.waiting_room_s,
            max_waiting=self.config.waiting_room_size,
            max_waiting_per_client=self.config.waiting_room_per_client,
            stagger_groups=self.config.stagger_groups,
        )
        self.scheduler = self.admission.scheduler
        self.holds.start()

    async def close(self) -> None:
        await self.holds.stop()
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)

    def status(self) -> BackendStatus:
        scheduler = self.scheduler
        return BackendStatus(
            loaded=self.warm and scheduler is not None,
            slots=self.engine.slots,
            free_slots=scheduler.free_slots if scheduler is not None else 0,
            waiting=self.admission.waiting if self.admission is not None else 0,
            tick_alive=scheduler is not None and scheduler.alive,
            voices=tuple(self.voices.names),
            voices_refused=tuple(str(r) for r in self.voices.refused),
            frame=self.engine.frame,
        )

    def prompt(self, voice_prompt: str | None, text_prompt: str | None) -> list[PromptStep]:
        """The persona's teacher-forced steps.

        Raises:
            PersonaError: an unknown voice, a text prompt over the token limit.
        """
        persona = Persona(voice_prompt or None, text_prompt or None)
        if self.bundle.preset.persona_required:  # never live without a voice and a text prompt
            persona = with_defaults(
                persona,
                self.voices,
                default_voice=getattr(self.config, "default_voice", DEFAULT_VOICE_PROMPT),
                default_text=getattr(self.config, "default_text_prompt", DEFAULT_TEXT_PROMPT),
            )
        steps = build_prompt(
            persona,
            self.voices,
            self.bundle.text_tokenizer,
            silence_codes=self.engine.silence_codes.cpu(),
            sine_codes=self.engine.sine_codes.cpu(),
            delays=list(self.bundle.lm.delays),
        )
        if any(s.embedding is not None for s in steps) and not getattr(self.engine, "prefill", True):
            raise PersonaError(
                f"voice_prompt {persona.voice_prompt!r} is one of NVIDIA's embedding presets, which this "
                "node replays only by prefill (DUPLEX_PROMPT_PREFILL=false here)"
            )
        return steps

    def check_persona(self, voice_prompt: str | None, text_prompt: str | None) -> None:
        self.prompt(voice_prompt, text_prompt)

    async def admit(self, request: AdmitRequest, sink: SessionSink) -> SlotLease:
        if self.draining:
            raise Refusal("draining", DRAINING_MESSAGE)
        if self.admission is None or self.scheduler is None:
            raise Refusal("not_ready", "node not ready: the slots are not open yet")
        try:
            prompt = self.prompt(request.voice_prompt, request.text_prompt)
        except PersonaError as exc:
            raise Refusal("bad_request", f"bad request: {exc}") from None
        route = SinkRoute(sink)  # a resume points it at another sink
        slot_session = SlotSession(
            request.session_id,
            request.sampling,
            prompt,
            on_output=route.on_output,
            on_prompt_done=route.on_prompt_done,
            max_inbox_frames=self.config.max_inbox_frames,
            on_first_audio=route.on_first_audio,
        )
        try:
            slot = await self.admission.admit(slot_session, client=request.client)
        except (WaitingRoomFull, WaitTimeout) as exc:
            reason = "waiting_room_full" if isinstance(exc, WaitingRoomFull) else "wait_timeout"
            raise Refusal(reason, f"node full: {exc}") from None
        except NodeFull:
            raise Refusal("node_full", node_full_message(self.engine.slots)) from None
        if request.token_id and not self.record_token(request.token_id, request.token_expires_at):
            self.scheduler.release(slot_session)
            raise Refusal("replayed", replayed_message(request.token_id))
        lease = _LocalLease(request.session_id, slot, slot_session=slot_session)
        if request.resumable:
            lease.resume_credential = self.holds.open(slot_session, route, request.meta)
        return lease

    async def spend_token(self, token_id: str, expires_at: float, check_only: bool = False) -> bool:
        return self.record_token(token_id, expires_at, check_only)

    def record_token(self, token_id: str, expires_at: float, check_only: bool = False) -> bool:
        """Record ``token_id`` as spent until its expiry plus the leeway (``check_only``: record nothing);
        False when it was spent already."""
        now = time.time()
        if len(self._spent_tokens) > 1024:
            self._spent_tokens = {t: until for t, until in self._spent_tokens.items() if until > now}
        until = self._spent_tokens.get(token_id)
        if until is not None and until > now:
            return False
        if check_only:
            return True
        self._spent_tokens[token_id] = expires_at + self.config.token_leeway_s
        return True

    def push_frame(self, lease: SlotLease, frame: np.ndarray) -> bool:
        assert isinstance(lease, _LocalLease) and lease.slot_session is not None
        lease.slot_session.paused = False  # a frame after a resume: the row steps again
        if lease.unconfirmed:  # the new connection has the slot: its resume's credential is spent now
            lease.unconfirmed = False
            self.holds.confirm(lease.session_id)
        kept = lease.slot_session.push_frame(frame)
        if lease.first_input_at is None:  # one process: the front end's first frame is the engine's
            lease.first_input_at = lease.slot_session.first_input_at
        return kept

    def release(self, lease: SlotLease) -> None:
        assert isinstance(lease, _LocalLease) and lease.slot_session is not None
        self.holds.forget(lease.session_id)
        self._release_slot(lease.slot_session)

    def _release_slot(self, slot_session: SlotSession) -> None:
        if self.scheduler is not None:
            self.scheduler.release(slot_session)

    def detach(self, lease: SlotLease) -> bool:
        return self.holds.detach(lease.session_id)

    async def resume(self, credential: str, sink: SessionSink, client: str = "") -> ResumeGrant:
        if self.draining:
            raise Refusal("draining", DRAINING_MESSAGE)
        await self.holds.probe_owner(credential)  # resume_live while the owner is connected and sending
        if self.draining:
            raise Refusal("draining", DRAINING_MESSAGE)
        got = self.holds.resume(credential, sink)
        if got.previous is not sink:
            got.previous.on_taken_over()
        held = got.slot_session
        lease = _LocalLease(held.session_id, held.slot, held.first_input_at, got.credential)
        lease.slot_session, lease.unconfirmed = held, True
        return ResumeGrant(lease, got.gap_s, got.meta, got.transcript)
