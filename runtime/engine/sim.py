"""The ``sim`` model: a stand-in for the batch engine that keeps its interface and its timing, for load tests
of everything around the model without a GPU (after llm-d's inference simulator, ``llm-d-inference-sim``).

:class:`SimEngine` has :class:`runtime.engine.batch.BatchEngine`'s surface (``slots``, ``join``, ``leave``,
``tick``, ``phase``, ``live_slots``, ``prompting_slots``, ``silence_codes``, ``sine_codes``,
``memory_allocated_bytes``). A tick costs the time a real step would, spent in ``time.sleep`` (which
releases the GIL, as a process waiting on its GPU does), and returns cheap results: as every live slot's
audio, its own input at half level over a quiet 220 Hz tone (an echo, so that the Opus encoder works on
speech as it would with a real model: a pure tone encodes several times cheaper), nothing while the
session is inside the real model's acoustic delay (its first step, unless a persona prompt's steps used it
up: the real engine steps a caller's first frame at once and LMGen's first audio comes at its second step,
so the sim's first audio comes at the real engine's tick); and a text piece every fourth tick. Persona
prompts are consumed at one step per step time within the tick's prompt budget, as the real engine does.
Persona rollover (``runtime.engine.rollover``) is a no-op here: nothing is re-prefilled or swapped, only
``TickTimings.persona_age_steps`` is reported (steps since the persona began, never reset), so a soak on
the sim exercises the metrics and the node, not the rollover's compute.

The step time is a :class:`StepTime`: a fixed figure (``"30"`` ms) or a table by batch size
(``"1:28,8:32.6,16:45,32:70.2"``, linearly interpolated on the number of slots stepping, flat past its
ends). The capacity planner computes such tables for a GPU
(``infra.capacity.timing.sim_step_table``); the runtime never imports the planner: the figure is passed in
(``DUPLEX_SIM_STEP_MS``).

It is never a default: ``DUPLEX_MODEL=sim`` must be asked for, and the server logs a warning naming it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.engine.api import MIMI_FRAME, FrameFormat
from runtime.engine.batch import (
    NOT_FORCED,
    BatchEngine,
    PromptStep,
    SlotPhase,
    TickBuffers,
    TickResult,
    TickTimings,
)
from runtime.engine.model_presets import FRAME_MS, FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.engine.models import ModelBundle
from runtime.engine.rollover import RolloverEngine, RolloverPolicy
from runtime.engine.sampling import SamplingParams
from runtime.engine.sim_timing import StepTime, parse_step_time

log = logging.getLogger(__name__)

__all__ = [
    "make_engine",
    "SimEngine",
    "StepTime",
    "parse_step_time",
]  # the last two from runtime.engine.sim_timing

_TEXT_EVERY_TICKS = 4
_TEXT_PADDING = 3
_ACOUSTIC_DELAY_STEPS = 1
"""LM steps a session's row yields nothing for: ``max(delays)`` of every preset (LMGen returns ungenerated
tokens while its offset is within it). Prompt steps count, as they advance LMGen's offset."""


@dataclass
class _SimSlot:
    phase: SlotPhase = SlotPhase.FREE
    prompt: deque[PromptStep] = field(default_factory=deque)
    steps: int = 0
    """LM steps taken, prompt steps included (the acoustic delay)."""
    ticks: int = 0
    prompted: bool = False


class SimEngine:
    """A simulated batch engine (see the module docstring). Not thread-safe, like ``BatchEngine``.

    Args:
        slots: B.
        step_time: the simulated step time.
        text_vocab: the tokenizer's vocabulary size (text ids produced are in [4, text_vocab)).
        user_codebooks: rows of the ``[K, F]`` reference codes that persona prompts are built from.
        prompt_budget_ms: prompt steps run while the tick's elapsed time is below this (at least one).
        sleep: how the step time is spent (``time.sleep``; injected in tests).
    Raises:
        ValueError: ``slots`` < 1.
    """

    def __init__(
        self,
        slots: int,
        step_time: StepTime,
        *,
        text_vocab: int,
        user_codebooks: int = 8,
        prompt_budget_ms: float = 0.6 * FRAME_MS,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.step_time = step_time
        self.text_vocab = text_vocab
        self.prompt_budget_ms = prompt_budget_ms
        self.dep_q = 8
        self.user_codebooks = user_codebooks
        self.device = torch.device("cpu")
        self.silence_codes = torch.zeros(user_codebooks, 8, dtype=torch.int64)
        self.sine_codes = torch.ones(user_codebooks, 8, dtype=torch.int64)
        self._sleep = sleep
        self._slots = [_SimSlot() for _ in range(slots)]
        self._outputs = TickBuffers(slots, self.dep_q)
        t = np.arange(FRAME_SAMPLES, dtype=np.float32) / SAMPLE_RATE_HZ
        self._tone = (0.05 * np.sin(2 * np.pi * 220.0 * t)).astype(np.float32)  # 220 Hz: 17.6 periods a frame

    @property
    def frame(self) -> FrameFormat:
        """The sim's frame: Mimi's (24000 Hz, 1920 samples), as the real models'."""
        return MIMI_FRAME

    def phase(self, slot: int) -> SlotPhase:
        return self._slots[slot].phase

    def join(self, slot: int, sampling: SamplingParams, prompt: list[PromptStep] | None = None) -> None:
        """As ``BatchEngine.join``. Raises ValueError for a slot out of range or not FREE."""
        state = self._check_slot(slot)
        if state.phase is not SlotPhase.FREE:
            raise ValueError(f"slot {slot} is {state.phase.value}, not free")
        state.prompt = deque(prompt or [])
        state.phase = SlotPhase.PROMPTING if state.prompt else SlotPhase.LIVE
        state.steps = 0
        state.ticks = 0
        state.prompted = bool(state.prompt)

    def leave(self, slot: int) -> None:
        state = self._check_slot(slot)
        state.phase = SlotPhase.FREE
        state.prompt.clear()

    def _check_slot(self, slot: int) -> _SimSlot:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in [0, {self.slots}), got {slot}")
        return self._slots[slot]

    @property
    def live_slots(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s.phase is SlotPhase.LIVE]

    @property
    def prompting_slots(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s.phase is SlotPhase.PROMPTING]

    def tick(self, pcm_in: np.ndarray, active: np.ndarray | None = None) -> TickResult:
        """As ``BatchEngine.tick``: ``[B, 1920]`` float32 in -> :class:`TickResult`, after the step time,
        over the engine's :class:`TickBuffers` (the same arrays every tick: copy what you keep).

        Raises:
            ValueError: ``pcm_in`` has the wrong shape.
        """
        if pcm_in.shape != (self.slots, FRAME_SAMPLES):
            raise ValueError(f"pcm_in must be [{self.slots}, {FRAME_SAMPLES}], got {list(pcm_in.shape)}")
        start = time.perf_counter()
        timings = TickTimings()
        out = self._outputs
        out.clear()
        live = [i for i in self.live_slots if active is None or active[i]]
        if live:
            self._sleep(self.step_time.ms(len(live)) / 1e3)
            for i in live:
                state = self._slots[i]
                state.steps += 1
                if state.steps <= _ACOUSTIC_DELAY_STEPS:
                    continue
                state.ticks += 1
                # An echo over a tone (speech-like audio for the codecs), written into the buffer's row.
                np.multiply(pcm_in[i], 0.5, out=out.pcm[i])
                out.pcm[i] += self._tone
                out.audio_ready[i] = True
                out.audio_tokens[i] = 0
                if state.ticks % _TEXT_EVERY_TICKS == 0:
                    out.text_tokens[i] = 4 + (state.ticks // _TEXT_EVERY_TICKS) % max(1, self.text_vocab - 4)
                else:
                    out.text_tokens[i] = _TEXT_PADDING
            timings.lm_ms = (time.perf_counter() - start) * 1e3
        finished = self._prompt_steps(start, timings)
        timings.persona_age_steps = max(
            (s.steps for s in self._slots if s.phase is SlotPhase.LIVE and s.prompted), default=0
        )
        timings.total_ms = (time.perf_counter() - start) * 1e3
        return out.result(finished, timings)

    def _prompt_steps(self, tick_start: float, timings: TickTimings) -> list[int]:
        finished: list[int] = []
        t0 = time.perf_counter()
        while prompting := self.prompting_slots:
            elapsed_ms = (time.perf_counter() - tick_start) * 1e3
            if timings.prompt_steps > 0 and elapsed_ms >= self.prompt_budget_ms:
                break
            self._sleep(self.step_time.ms(len(prompting)) / 1e3)
            for i in prompting:
                state = self._slots[i]
                step = state.prompt.popleft()
                assert step.text_token >= NOT_FORCED
                state.steps += 1
                if not state.prompt:
                    state.phase = SlotPhase.LIVE
                    finished.append(i)
            timings.prompt_steps += 1
        timings.prompt_ms = (time.perf_counter() - t0) * 1e3
        return finished

    def warm_up_prefill(self) -> list[int]:
        """Nothing to warm (``BatchEngine.warm_up_prefill``'s surface): no chunk sizes."""
        return []

    def memory_allocated_bytes(self) -> int | None:
        """None: a simulator holds no GPU memory."""
        return None


def make_engine(
    model: str,
    bundle: ModelBundle,
    slots: int,
    sim_step_ms: str = "30",
    *,
    prefill: bool = True,
    tick_period_ms: float = FRAME_MS,
    rollover: RolloverPolicy | None = None,
) -> BatchEngine:
    """The node's engine: a :class:`BatchEngine` over ``bundle`` with ``slots`` slots (``prefill``: persona
    prompts by prefill), or for ``model == "sim"`` a :class:`SimEngine` with the same surface stepping in
    ``sim_step_ms`` (:func:`runtime.engine.sim_timing.parse_step_time`; ValueError when malformed).

    ``tick_period_ms``: time from one tick to the next (80 ms; 40 ms with two staggered sub-batch groups,
    ``runtime.engine.scheduler``): the prompt budget (60 % of it) and the prefill floor (10 %) scale with
    it, so that persona prompts never push a tick past its period. ``rollover``: the persona rollover's
    policy (default :class:`RolloverPolicy`'s: on); a :class:`RolloverEngine` is built (the sim: a no-op)."""
    if not 0 < tick_period_ms <= FRAME_MS:
        raise ValueError(f"tick_period_ms must be in (0, {FRAME_MS:g}] ms, got {tick_period_ms!r}")
    if model != "sim":
        return RolloverEngine(
            bundle,
            slots,
            rollover=rollover,
            prefill=prefill,
            prompt_budget_ms=0.6 * tick_period_ms,
            prefill_floor_ms=0.1 * tick_period_ms,
        )
    step = parse_step_time(sim_step_ms)
    log.warning("model=sim: a SIMULATED model (step time %s ms, an echo as audio); not for serving", step)
    engine = SimEngine(
        slots,
        step,
        text_vocab=bundle.text_tokenizer.vocab_size(),
        user_codebooks=bundle.lm.num_codebooks - bundle.lm.dep_q - 1,
        prompt_budget_ms=0.6 * tick_period_ms,
    )
    return engine  # type: ignore[return-value]  # the same surface (duck-typed)
