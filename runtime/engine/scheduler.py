"""The slot scheduler: which session holds which slot, and the tick thread that drives the engine.

Threads: the asyncio event loop (sockets) and one tick thread (the model). They meet here only:

- admission and release: a lock-guarded free-slot list; joins and leaves are queued and applied by the
  tick thread at the start of the next tick (so a disconnect frees its slot at the next tick);
- input: each session's inbox is a deque the event loop appends frames to and the tick thread pops one
  frame per tick from (deque append/popleft are atomic);
- output: the tick thread hands each produced frame and text piece to the event loop with
  ``loop.call_soon_threadsafe``; it never waits on a socket.

The tick thread paces itself on a monotonic clock at one tick per 80 ms frame. A session whose frame has
not arrived gets silence for that tick; a tick that overruns the frame is counted and the next starts at
once; a tick loop that falls more than a frame behind re-anchors its clock rather than bursting.

First-audio budget: on the scheduler's clock (injected; ``time.monotonic`` by default), each session keeps
when its first frame arrived and the start and number of the tick that took it; the tick that produces its
first audio hands a ``runtime.engine.api.FirstAudioTiming`` to the event loop just before that audio
(docs/benchmarks.md, "First-audio latency budget"). A few timestamps per session, two clock reads per tick.

Staggered sub-batches (``stagger_groups`` G > 1, issue 24 item 3; off by default): the tick loop runs every
80 / G ms and each of these sub-ticks steps one group of slots, the groups taking turns, so each session is
still stepped once per 80 ms frame. A session joins the group of the first sub-tick that finds its first
frame in the inbox (the nearest tick after its arrival), so its phase wait is 0 to 80 / G ms instead of 0 to
80 ms; every later frame of it is taken by its group's sub-ticks. The other groups' rows are frozen with the
engine's ``active`` mask, which moshi applies with ``torch.where``: a sub-tick computes every row, so it
costs about a whole tick and the node steps G times as often (docs/capacity.md, "Staggered sub-batches").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import sentencepiece

from runtime.engine.api import FirstAudioTiming
from runtime.engine.batch import TEXT_PADDING_IDS, BatchEngine, PromptStep, TickTimings
from runtime.engine.model_presets import FRAME_MS, FRAME_SAMPLES
from runtime.engine.sampling import SamplingParams
from runtime.metrics import RuntimeMetrics

log = logging.getLogger(__name__)

STAGGER_GROUPS = (1, 2)
"""Allowed sub-tick group counts: 1 (one tick per 80 ms frame) or 2 (two groups stepped 40 ms apart)."""


@dataclass(eq=False)
class SlotSession:
    """A session as the scheduler sees it. Created by the server, one per admitted connection.

    Attributes:
        session_id: unique id (registry key).
        sampling: the session's sampling settings.
        prompt: persona prompt steps to feed before the conversation.
        on_output: called on the event loop with ``(pcm [1920] float32 or None, text piece or None)``.
        on_prompt_done: called on the event loop once the slot is LIVE (send the handshake then).
        max_inbox_frames: input frames held before the oldest are dropped (client faster than real time).
        on_first_audio: called on the event loop with the session's :class:`FirstAudioTiming`, just before
            the ``on_output`` carrying its first audio (None: not wanted).
        clock: monotonic seconds; the scheduler sets its own on admission.
        first_input_at: when the first frame arrived (``clock``, read once it is in the inbox);
            ``taken_at``, ``taken_tick``: the start and the number of the tick that took it.
        group: the sub-tick group whose ticks take its frames (0 without staggering; -1 until its first
            frame is taken).
        last_input_at: when the latest frame arrived (``clock``): a resume's gap is measured from it.
        paused: the session's transport is lost and its slot held for a resume: the tick freezes the row
            (neither stepped nor fed: the model's state stays where the caller left it) until a frame
            arrives again (``runtime.engine.resume``).
    """

    session_id: str
    sampling: SamplingParams
    prompt: list[PromptStep]
    on_output: Callable[[np.ndarray | None, str | None], None]
    on_prompt_done: Callable[[], None]
    max_inbox_frames: int = 8
    slot: int = -1
    inbox: deque[np.ndarray] = field(default_factory=deque)
    first_input_at: float | None = None
    on_first_audio: Callable[[FirstAudioTiming], None] | None = None
    clock: Callable[[], float] = time.monotonic
    taken_at: float | None = None
    taken_tick: int = -1
    first_audio_done: bool = False
    group: int = -1
    last_input_at: float | None = None
    paused: bool = False

    @property
    def started_input(self) -> bool:
        """The client has sent its first frame: from then on the slot steps every tick."""
        return self.first_input_at is not None

    def push_frame(self, frame: np.ndarray) -> bool:
        """Queue one ``[1920]`` float32 input frame; returns False if the oldest frame was dropped."""
        self.inbox.append(frame)
        self.last_input_at = now = self.clock()
        if self.first_input_at is None:  # after the append: a tick that sees the session started finds it
            self.first_input_at = now
        if len(self.inbox) > self.max_inbox_frames:
            with contextlib.suppress(IndexError):
                self.inbox.popleft()
            return False
        return True


class NodeFull(Exception):
    """Every slot is taken."""


class SlotScheduler:
    """Assigns slots and runs the tick thread.

    Args:
        engine: the batch engine; only the tick thread touches it after :meth:`start`.
        tokenizer: to turn text tokens into pieces (ids 0 and 3 are padding and dropped).
        metrics: where ticks, drops and latencies are counted.
        loop: the event loop that owns the sessions' sockets.
        frame_ms: the tick period (80 ms at 12.5 Hz).
        clock: monotonic seconds: the ticks' pace and the first-audio timestamps (injected in tests, which
            call :meth:`tick_once` themselves instead of starting the thread).
        stagger_groups: G, sub-tick groups (module docstring): 1 steps every slot in every tick of the
            80 ms clock; 2 runs a sub-tick every 40 ms, each stepping half of the sessions.
    Raises:
        ValueError: ``stagger_groups`` is not in ``STAGGER_GROUPS``.
    """

    def __init__(
        self,
        engine: BatchEngine,
        tokenizer: sentencepiece.SentencePieceProcessor,
        metrics: RuntimeMetrics,
        loop: asyncio.AbstractEventLoop,
        *,
        frame_ms: float = FRAME_MS,
        clock: Callable[[], float] = time.monotonic,
        stagger_groups: int = 1,
    ) -> None:
        if stagger_groups not in STAGGER_GROUPS:
            raise ValueError(
                f"stagger_groups must be one of {', '.join(map(str, STAGGER_GROUPS))}, got {stagger_groups!r}"
            )
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.loop = loop
        self.frame_s = frame_ms / 1e3
        self.groups = stagger_groups
        self.period_s = self.frame_s / stagger_groups
        """Time from one tick to the next: the frame, or the frame / G with staggered sub-batches."""
        self.clock = clock
        self.ticks = 0
        """Ticks (sub-ticks when staggered) run with at least one slot busy (the first-audio budget counts
        ticks with it; tick ``n`` steps group ``n % G``)."""
        self.slots = engine.slots
        self._vocab_size = tokenizer.vocab_size()
        self._lock = threading.Lock()
        self._free = list(range(self.slots))
        self._sessions: list[SlotSession | None] = [None] * self.slots
        self._commands: queue.SimpleQueue[tuple[str, SlotSession]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tick-loop", daemon=True)
        self._pcm_in = np.zeros((self.slots, FRAME_SAMPLES), dtype=np.float32)
        self._active = np.zeros(self.slots, dtype=bool)
        self.on_slot_freed: Callable[[], None] | None = None
        """Called on the tick thread after a slot was freed (``runtime.engine.waiting_room`` sets it)."""
        metrics.slots_total.set(self.slots)

    # --- event-loop side ------------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def admit(self, session: SlotSession) -> int:
        """Give ``session`` a slot; it joins the batch at the next tick.

        Raises:
            NodeFull: no slot is free (the caller refuses the session).
        """
        with self._lock:
            if not self._free:
                raise NodeFull(f"all {self.slots} slots are in use")
            session.slot = self._free.pop(0)
        session.clock = self.clock
        self._commands.put(("join", session))
        self._wake.set()
        self.metrics.active_sessions.set(self.slots - self.free_slots)
        return session.slot

    def release(self, session: SlotSession) -> None:
        """Free ``session``'s slot at the next tick. Idempotent."""
        if session.slot >= 0:
            self._commands.put(("leave", session))
            self._wake.set()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    # --- tick thread ----------------------------------------------------------------------------------

    def _apply_commands(self) -> None:
        while True:
            try:
                action, session = self._commands.get_nowait()
            except queue.Empty:
                return
            slot = session.slot
            if action == "join":
                self._sessions[slot] = session
                self.engine.join(slot, session.sampling, session.prompt)
                if not session.prompt:
                    self.loop.call_soon_threadsafe(session.on_prompt_done)
            elif self._sessions[slot] is session:
                self.engine.leave(slot)
                self._sessions[slot] = None
                session.slot = -1
                with self._lock:
                    self._free.append(slot)
                    self._free.sort()
                self.metrics.active_sessions.set(self.slots - len(self._free))
                if self.on_slot_freed is not None:
                    self.on_slot_freed()

    def _text_piece(self, token: int) -> str | None:
        if token < 0 or token in TEXT_PADDING_IDS or token >= self._vocab_size:
            return None
        return self.tokenizer.id_to_piece(int(token)).replace("\u2581", " ")

    def _run(self) -> None:
        next_tick = self.clock()
        while not self._stop.is_set():
            if not self.tick_once():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                next_tick = self.clock()
                continue
            next_tick += self.period_s
            delay = next_tick - self.clock()
            if delay > 0:
                self._stop.wait(delay)
            elif -delay > self.period_s:
                next_tick = self.clock()

    def tick_once(self) -> bool:
        """One tick now (the tick thread's step; tests call it directly): apply joins and leaves, take one
        frame per started session of this tick's group (every started session without staggering; a session
        whose first frame this tick finds joins its group), step the engine, hand the outputs to the event
        loop. False when no slot was busy (nothing ran)."""
        self._apply_commands()
        busy = [s for s in self._sessions if s is not None]
        if not busy:
            return False
        pcm_in, active = self._pcm_in, self._active
        pcm_in[:] = 0.0
        active[:] = False
        tick = self.ticks
        group = tick % self.groups
        first_taken: list[SlotSession] = []
        for session in busy:
            if not session.started_input or session.paused:
                continue
            if session.group < 0:
                session.group = group
            if session.group != group:
                continue
            active[session.slot] = True
            try:
                pcm_in[session.slot] = session.inbox.popleft()
            except IndexError:
                self.metrics.frames_dropped.labels(reason="late_input").inc()
            if session.taken_tick < 0:
                first_taken.append(session)
        # The tick starts once it has taken its frames: every frame it took arrived before this reading.
        started_at = self.clock()
        for session in first_taken:
            session.taken_at, session.taken_tick = started_at, tick
        try:
            result = self.engine.tick(pcm_in, active)
        except BaseException:  # a model failure must be loud, not a silent dead thread
            log.exception("tick failed; the tick loop stops and /healthz turns unhealthy")
            raise
        ended_at = self.clock()
        self.ticks += 1
        tick_s = result.timings.total_ms / 1e3
        self.metrics.ticks_total.inc()
        self.metrics.tick_duration.observe(tick_s)
        if tick_s > self.period_s:
            self.metrics.ticks_over_budget.inc()
        self._count_rollovers(result.timings)
        for session in busy:
            slot = session.slot
            if slot < 0:
                continue
            pcm = result.pcm[slot].copy() if result.audio_ready[slot] else None
            piece = self._text_piece(int(result.text_tokens[slot]))
            if pcm is not None and not session.first_audio_done:
                session.first_audio_done = True
                self._first_audio(session, tick, started_at, ended_at)
            if pcm is not None or piece is not None:
                self.loop.call_soon_threadsafe(session.on_output, pcm, piece)
        for slot in result.prompt_finished:
            finished = self._sessions[slot]
            if finished is not None:
                self.loop.call_soon_threadsafe(finished.on_prompt_done)
        memory = self.engine.memory_allocated_bytes()
        if memory is not None:
            self.metrics.gpu_memory_allocated.set(memory)
        return True

    def _count_rollovers(self, timings: TickTimings) -> None:
        """The tick's persona rollovers and the oldest persona's age (``runtime.engine.rollover``)."""
        if timings.rollovers_at_pause:
            self.metrics.persona_rollovers.labels(trigger="pause").inc(timings.rollovers_at_pause)
        if timings.rollovers_forced:
            self.metrics.persona_rollovers.labels(trigger="forced").inc(timings.rollovers_forced)
        self.metrics.persona_age.set(timings.persona_age_steps)

    def _first_audio(self, session: SlotSession, tick: int, started_at: float, ended_at: float) -> None:
        """Hand ``session``'s :class:`FirstAudioTiming` to the event loop (before its first audio)."""
        if session.on_first_audio is None or session.first_input_at is None or session.taken_at is None:
            return
        timing = FirstAudioTiming(
            arrived_at=session.first_input_at,
            taken_at=session.taken_at,
            ticks=(tick - session.taken_tick) // self.groups,
            audio_tick_at=started_at,
            audio_tick_end=ended_at,
        )
        self.loop.call_soon_threadsafe(session.on_first_audio, timing)
