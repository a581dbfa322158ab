"""Persona rollover: a long call keeps its persona in the attention window (issue 30, item 11).

moshi 0.2.13's temporal KV cache is a ring of ``context`` steps (3000 for the 7B = 4 min; moshi
``modules/transformer.py`` ``RingKVCache``, the attention mask keeps ``delta < context``). A persona prompt
(voice, silence, text, silence: ~490 steps for a 30 s voice and ~100 text tokens) is at the start of the
row, so after ``context - len(persona)`` live steps it starts sliding out of the window and the model
forgets who it is. NVIDIA's TensorRT Nemotron voice-chat example rolls over to a fresh state with its
prompt re-prefilled and a bounded text memory about every 90 s; :class:`RolloverEngine` does that per slot.

What a rollover does, for one LIVE slot whose persona was prefilled:

1. **When.** The slot's *age* is the number of LM steps in its rows since its persona's first step (its
   LMGen offset: the persona's length after its prefill, +1 per live step). From ``age >= seek`` it rolls
   over at the first caller pause: the caller's input frames had an RMS below ``pause_rms`` for the last
   ``pause_ticks`` live ticks (the engine's own input, nothing else needed). From ``age >= force`` it
   rolls over whatever the caller does. ``seek`` and ``force`` are fractions of ``context``
   (:class:`RolloverPolicy`).
2. **What is prefilled.** A fresh batch-1 side state of the temporal transformer
   (``BatchEngine._new_side_state``) is fed, in chunks after the live step
   and the persona prompts (``chunk_steps`` a tick, 8 by default: nobody waits for a rollover, so it
   takes little of each tick; more when needed to finish before the persona's first step would leave the
   window), the sequence
   ``BatchEngine._new_prefill`` builds from (NVIDIA's layout, the model's delays; an embeddings voice's
   stored input embeddings replayed as at its join): the persona's own :class:`PromptStep` s, then one step
   per *memory* token: the last ``memory_tokens`` non-padding text tokens the agent produced (ids 0 and 3
   are padding, ``TEXT_PADDING_IDS``), each as a forced text token with the user and agent codes of the
   persona's last step (its closing silence: the agent's silence codes and the prompt's user frame). The
   memory is taken when the prefill starts.
3. **The swap**, at the end of the tick in which the prefill completes (the next tick's live step reads
   the new state): the slot's KV rows, ring write positions and position offsets of every attention
   layer take the side state's (as ``BatchEngine._finish_prefill`` copies a persona), and LMGen's token
   cache row is rotated so that the columns the live step reads next (the agent's last text and audio
   tokens, the caller's latest codes, the delayed codebooks still due) sit at the new offset
   ``len(persona) + len(memory)``. The slot's sampling step counter is not rewound (it indexes the slot's
   random draws, which then never repeat). Mimi's encoder and decoder rows are not touched: the audio
   stream goes on without a seam.

What the new state holds: the persona, the memory tokens, and from then on the conversation. What it
drops: the audio of the conversation before the swap (both sides), including the steps stepped live
while the prefill ran (a few ticks); and the agent's words older than the last ``memory_tokens``. Other
slots' rows are never read or written: their token streams are bit-identical to a run without
rollovers (tests/test_rollover.py).

Not rolled over: slots without a persona (nothing to keep: the ring slides), personas fed step by step
(``prefill=False`` or not fully forced), and a persona so long that persona + memory would exceed half
of ``seek`` (memory is cut to fit; a persona alone past that is never rolled: a rollover would buy
too little).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.engine.batch import (
    TEXT_PADDING_IDS,
    BatchEngine,
    PromptStep,
    SamplingParams,
    TickResult,
    TickTimings,
    _Prefill,
)
from runtime.engine.models import ModelBundle

__all__ = ["RolloverEngine", "RolloverPolicy"]


@dataclass(frozen=True)
class RolloverPolicy:
    """When a slot rolls over and what it keeps (module docstring).

    Attributes:
        enabled: False: the engine only tracks each slot's age (for ``TickTimings.persona_age_steps``).
        seek_fraction: from ``age >= seek_fraction * context`` steps, roll over at the first caller pause.
            0.6: 1800 steps (2.4 min) on the 7B, whose persona of ~490 steps then rolls every ~100 s at
            most, close to NVIDIA's TensorRT example (about every 90 s).
        force_fraction: from ``age >= force_fraction * context``, roll over now (0.85: 2550 steps on the
            7B, 36 s before the window closes; the prefill takes a fraction of a second).
        memory_tokens: N, the most agent text tokens fed back after the persona (one forced step each).
        pause_ticks: live ticks in a row with a quiet caller that make a pause (6 = 480 ms).
        pause_rms: RMS of a quiet input frame, full scale 1.0 (0.01 = -40 dBFS).
        chunk_steps: rollover prefill steps a tick runs (more only to finish before the window closes):
            8, the persona prefill's least chunk; a 554-step rollover of the 7B then spreads over 70 ticks.
    Raises:
        ValueError: fractions not 0 < seek <= force < 1, or a negative count or level.
    """

    enabled: bool = True
    seek_fraction: float = 0.6
    force_fraction: float = 0.85
    memory_tokens: int = 64
    pause_ticks: int = 6
    pause_rms: float = 0.01
    chunk_steps: int = 8

    def __post_init__(self) -> None:
        if not 0.0 < self.seek_fraction <= self.force_fraction < 1.0:
            raise ValueError(
                "rollover fractions must satisfy 0 < seek <= force < 1 (of the model's context), got seek "
                f"{self.seek_fraction!r}, force {self.force_fraction!r}"
            )
        if self.memory_tokens < 0 or self.pause_ticks < 1 or self.pause_rms < 0 or self.chunk_steps < 1:
            raise ValueError(
                "rollover memory_tokens must be >= 0, pause_ticks >= 1, pause_rms >= 0 and chunk_steps >= 1, "
                f"got {self.memory_tokens!r}, {self.pause_ticks!r}, {self.pause_rms!r}, {self.chunk_steps!r}"
            )

    @classmethod
    def from_config(cls, config: object) -> RolloverPolicy:
        """The policy of a ``RuntimeConfig`` (``rollover``, ``rollover_seek_fraction``, ...); an object
        without those attributes gets the defaults."""
        default = cls()
        return cls(
            enabled=getattr(config, "rollover", default.enabled),
            seek_fraction=getattr(config, "rollover_seek_fraction", default.seek_fraction),
            force_fraction=getattr(config, "rollover_force_fraction", default.force_fraction),
            memory_tokens=getattr(config, "rollover_memory_tokens", default.memory_tokens),
            pause_ticks=getattr(config, "rollover_pause_ticks", default.pause_ticks),
            pause_rms=getattr(config, "rollover_pause_rms", default.pause_rms),
        )


@dataclass
class _SlotAge:
    """One slot's persona, age and memory, host-side (no device read per tick)."""

    persona: list[PromptStep] | None = None
    """The persona's steps when it can be rolled over, else None."""
    prompted: bool = False
    """The slot joined with a prompt (its age is reported, rolled over or not)."""
    age: int = 0
    """LM steps in the slot's rows since its persona's first step (= LMGen's offset of the row)."""
    quiet: int = 0
    """Live ticks in a row whose input frame was quiet."""
    memory: deque[int] = field(default_factory=deque)
    prefill: _Prefill | None = None
    forced: bool = False
    rollovers: int = 0
    last_steps: list[PromptStep] = field(default_factory=list)
    """The steps of the last rollover started (persona + memory)."""


class RolloverEngine(BatchEngine):
    """A :class:`BatchEngine` whose slots roll over to a fresh persona state (module docstring).

    Args:
        bundle, slots, clock, prompt_budget_ms, prefill...: as :class:`BatchEngine`.
        rollover: the policy (default :class:`RolloverPolicy`'s).
    Raises:
        ValueError: as :class:`BatchEngine`.

    Attributes:
        context: the attention window in steps (the first layer's ``context``; 3000 for the 7B).
        seek_steps, force_steps: the policy's thresholds in steps.
    """

    def __init__(
        self,
        bundle: ModelBundle,
        slots: int,
        *,
        rollover: RolloverPolicy | None = None,
        clock: Callable[[], float] = time.perf_counter,
        **kwargs: object,
    ) -> None:
        super().__init__(bundle, slots, clock=clock, **kwargs)  # type: ignore[arg-type]
        self.policy = rollover or RolloverPolicy()
        context = getattr(bundle.lm.transformer.layers[0].self_attn, "context", None)
        if not isinstance(context, int):
            raise ValueError("persona rollover needs an attention context (the ring's size), got None")
        self.context = int(context)
        self.seek_steps = max(1, int(self.policy.seek_fraction * self.context))
        self.force_steps = max(self.seek_steps, int(self.policy.force_fraction * self.context))
        self._ages = [_SlotAge() for _ in range(slots)]
        self._rollover_queue: deque[int] = deque()
        self._max_delay = max(bundle.lm.delays)

    # --- slot lifecycle -------------------------------------------------------------------------------

    def join(self, slot: int, sampling: SamplingParams, prompt: list[PromptStep] | None = None) -> None:
        """As :meth:`BatchEngine.join`; a prefilled persona is kept for the slot's rollovers."""
        super().join(slot, sampling, prompt)
        self._cancel(slot)
        state = self._slots[slot]
        persona = list(prompt) if prompt and state.prefill is not None else None
        if persona is not None and not self._max_delay < len(persona) <= self.seek_steps // 2:
            persona = None  # too short to fill the acoustic delay, or too long to be worth rolling
        self._ages[slot] = _SlotAge(
            persona=persona,
            prompted=bool(prompt),
            age=len(prompt or []),
            memory=deque(maxlen=self.policy.memory_tokens),
        )

    def leave(self, slot: int) -> None:
        """As :meth:`BatchEngine.leave`; a rollover in progress is dropped."""
        super().leave(slot)
        self._cancel(slot)
        self._ages[slot] = _SlotAge()

    def _cancel(self, slot: int) -> None:
        if slot in self._rollover_queue:
            self._rollover_queue.remove(slot)
        self._ages[slot].prefill = None

    def persona_age(self, slot: int) -> int:
        """Steps since ``slot``'s persona's first step, rolled over or not (0 for a slot without a prompt, or
        FREE)."""
        return self._ages[slot].age if self._ages[slot].prompted else 0

    def rollovers(self, slot: int) -> int:
        """Rollovers ``slot``'s session has had."""
        return self._ages[slot].rollovers

    def last_rollover_steps(self, slot: int) -> list[PromptStep]:
        """The steps (persona + memory) of ``slot``'s last rollover started (empty before the first)."""
        return list(self._ages[slot].last_steps)

    # --- the tick -------------------------------------------------------------------------------------

    @torch.no_grad()
    def tick(self, pcm_in: np.ndarray, active: np.ndarray | None = None) -> TickResult:
        """As :meth:`BatchEngine.tick`, then the rollovers' work (``chunk_steps`` a tick, after the prompts):
        ages and memories updated from this tick's live step, rollovers started, prefill chunks run and
        complete ones swapped in. ``timings`` counts it (``rollover_steps``, ``rollovers_at_pause``,
        ``rollovers_forced``, ``persona_age_steps``) and its ``total_ms`` includes it.

        Raises:
            ValueError: ``pcm_in`` has the wrong shape.
        """
        start = self.clock()
        live = [i for i in self.live_slots if active is None or active[i]]
        result = super().tick(pcm_in, active)
        timings = result.timings
        self._track(pcm_in, live)
        self._run_rollovers(timings)
        timings.persona_age_steps = max((self.persona_age(i) for i in self.live_slots), default=0)
        timings.total_ms = (self.clock() - start) * 1e3
        return result

    def _track(self, pcm_in: np.ndarray, live: list[int]) -> None:
        """Count this tick's live step in each slot's age, keep its text token, and start the rollovers
        that are due."""
        if not live:
            return
        rms = np.sqrt(np.mean(np.square(pcm_in[live], dtype=np.float32), axis=1))
        for row, slot in enumerate(live):
            state = self._ages[slot]
            state.age += 1
            if state.persona is None:
                continue
            token = int(self._outputs.text_tokens[slot])
            if token >= 0 and token not in TEXT_PADDING_IDS and self.policy.memory_tokens:
                state.memory.append(token)
            state.quiet = state.quiet + 1 if rms[row] < self.policy.pause_rms else 0
            if not self.policy.enabled or state.prefill is not None:
                continue
            forced = state.age >= self.force_steps
            if forced or (state.age >= self.seek_steps and state.quiet >= self.policy.pause_ticks):
                self._start(slot, forced=forced)

    def _start(self, slot: int, *, forced: bool) -> None:
        state = self._ages[slot]
        assert state.persona is not None
        last = state.persona[-1]
        room = self.seek_steps // 2 - len(state.persona)
        tokens = list(state.memory)[-room:] if room > 0 else []
        memory = [PromptStep(last.user_codes, token, last.agent_codes) for token in tokens]
        steps = state.persona + memory
        state.last_steps = steps
        state.prefill = self._new_prefill(steps, self._positions(steps))
        state.forced = forced
        self._rollover_queue.append(slot)

    def _run_rollovers(self, timings: TickTimings) -> None:
        """This tick's rollover prefill work: the head of the queue runs ``chunk_steps`` steps (a rollover
        has nobody waiting for it, so it takes little of each tick: the tick's p99 barely moves); any
        rollover that would otherwise not be swapped in before its persona's first step leaves the window
        (the next live step reads position ``age``, which must stay below ``context``) runs what keeps it
        on time. Complete ones are swapped in."""
        chunk = self.policy.chunk_steps
        for index, slot in enumerate(list(self._rollover_queue)):
            state = self._ages[slot]
            prefill = state.prefill
            assert prefill is not None
            left = prefill.total - prefill.done
            ticks_left = max(1, self.context - state.age)
            owed = math.ceil(left / ticks_left) if math.ceil(left / chunk) >= ticks_left else 0
            steps = min(left, max(chunk if index == 0 else 0, owed))
            if steps <= 0:
                continue
            self._run_side_chunk(prefill, steps)
            timings.rollover_steps += steps
            if prefill.done < prefill.total:
                continue
            self._swap(slot, prefill)
            self._rollover_queue.remove(slot)
            state.prefill = None
            state.age = prefill.total
            state.quiet = 0
            state.rollovers += 1
            if state.forced:
                timings.rollovers_forced += 1
            else:
                timings.rollovers_at_pause += 1

    def _swap(self, slot: int, prefill: _Prefill) -> None:
        """Put the completed rollover state into ``slot``'s rows (module docstring, step 3)."""
        total = prefill.total
        self._copy_side_rows(slot, prefill, self.bundle.lm.transformer.get_streaming_state())
        gen = self.lm_gen._streaming_state
        assert gen is not None
        old = int(gen.offsets[slot])  # one device read per rollover
        # [K, CT] ring of tokens: column (old + j) % CT moves to (total + j) % CT for every j.
        gen.cache[slot] = torch.roll(gen.cache[slot], shifts=total - old, dims=-1)
        gen.offsets[slot] = total
