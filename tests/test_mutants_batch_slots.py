"""Tests that kill mutants of the batch engine's slot bookkeeping (runtime/engine/batch.py: ``TickBuffers``,
``_Forcing``, ``BatchEngine.__init__``'s checks and settings, ``phase``, ``join``, ``leave``,
``_check_slot``, ``_mask``, ``_chunk_steps``; ``make mutation MODULE=runtime/engine/batch.py``;
docs/mutation.md). Each docstring names the mutants it kills. Fast: the tiny model, no tick (the engine's
ticks are tested in test_engine.py, too slow to run per mutant on 2 cores)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from runtime.engine.batch import (
    NOT_FORCED,
    UNGENERATED_TOKEN,
    BatchEngine,
    PromptStep,
    SlotPhase,
    TickBuffers,
    TickTimings,
    _Forcing,
    _Prefill,
)
from runtime.engine.models import ModelBundle, build_tiny
from runtime.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny() -> ModelBundle:
    return build_tiny(seed=0)


def engine(bundle: ModelBundle, slots: int = 4, **kwargs) -> BatchEngine:
    return BatchEngine(copy.deepcopy(bundle), slots, **kwargs)


def forced_prompt(e: BatchEngine, steps: int) -> list[PromptStep]:
    """A fully forced prompt (text and every agent codebook): the kind that is prefilled."""
    user = torch.zeros(e.user_codebooks, dtype=torch.int64)
    return [PromptStep(user, text_token=3, agent_codes=torch.zeros(e.dep_q, dtype=torch.int64))] * steps


def free_prompt(e: BatchEngine, steps: int) -> list[PromptStep]:
    """A prompt whose text is not forced: run step by step, never prefilled."""
    return [PromptStep(torch.zeros(e.user_codebooks, dtype=torch.int64))] * steps


# ------------------------------------------------------------------------------------------------------
# TickBuffers and _Forcing
# ------------------------------------------------------------------------------------------------------


def test_tick_buffers_start_as_nothing_produced():
    """Kills ``TickBuffers.__init__``: each array's shape, dtype and fill (``UNGENERATED_TOKEN`` -2, not
    ready, silence) and the ``slots < 1 or dep_q < 1`` check (``<=``, ``and``, ``< 2``) with its text."""
    b = TickBuffers(3, 2)
    assert b.pcm.shape == (3, 1920) and b.pcm.dtype == np.float32 and not b.pcm.any()
    assert b.audio_ready.shape == (3,) and b.audio_ready.dtype == bool and not b.audio_ready.any()
    assert b.text_tokens.dtype == np.int64 and b.text_tokens.tolist() == [-2, -2, -2]
    assert b.audio_tokens.dtype == np.int64 and b.audio_tokens.tolist() == [[-2, -2]] * 3
    assert TickBuffers(1, 1).audio_tokens.shape == (1, 1)
    for slots, dep_q in ((0, 1), (1, 0)):
        with pytest.raises(ValueError) as info:
            TickBuffers(slots, dep_q)
        assert str(info.value) == f"slots and dep_q must be >= 1, got slots {slots}, dep_q {dep_q}"


def test_tick_buffers_clear_in_place_and_result_wraps_them():
    """Kills ``TickBuffers.clear`` (each ``fill`` dropped or given another value) and ``result`` (the
    arrays, ``prompt_finished`` and ``timings`` swapped, dropped or copied)."""
    b = TickBuffers(2, 3)
    pcm, ready, text, audio = b.pcm, b.audio_ready, b.text_tokens, b.audio_tokens
    pcm.fill(0.5)
    ready.fill(True)
    text.fill(7)
    audio.fill(9)
    b.clear()
    assert b.pcm is pcm and not pcm.any() and not ready.any()
    assert text.tolist() == [UNGENERATED_TOKEN] * 2 and audio.tolist() == [[UNGENERATED_TOKEN] * 3] * 2
    timings = TickTimings()
    r = b.result([1], timings)
    assert r.pcm is pcm and r.audio_ready is ready and r.text_tokens is text and r.audio_tokens is audio
    assert r.prompt_finished == [1] and r.timings is timings


def test_forcing_starts_and_clears_to_not_forced():
    """Kills ``_Forcing.__init__`` and ``clear``: shapes, ``NOT_FORCED`` (-1) everywhere, int64."""
    f = _Forcing(3, 2, torch.device("cpu"))
    assert f.text.tolist() == [NOT_FORCED] * 3 and f.text.dtype == torch.int64
    assert f.audio.tolist() == [[NOT_FORCED] * 2] * 3 and f.audio.dtype == torch.int64
    f.text.fill_(5)
    f.audio.fill_(6)
    f.clear()
    assert f.text.tolist() == [-1] * 3 and f.audio.tolist() == [[-1, -1]] * 3


# ------------------------------------------------------------------------------------------------------
# BatchEngine: construction
# ------------------------------------------------------------------------------------------------------


def test_engine_refuses_no_slot_and_bad_chunk_bounds(tiny):
    """Kills ``__init__``'s checks: ``slots < 1`` (-> ``<= 1``, ``< 2``), ``1 <= min <= max`` (each bound
    moved), and both texts."""
    with pytest.raises(ValueError) as info:
        engine(tiny, 0)
    assert str(info.value) == "slots must be >= 1, got 0"
    for low, high in ((0, 8), (9, 8)):
        with pytest.raises(ValueError) as info:
            engine(tiny, 1, prefill_min_chunk=low, prefill_max_chunk=high)
        assert str(info.value) == (
            f"prefill chunk bounds must satisfy 1 <= min <= max, got min {low}, max {high}"
        )
    one = engine(tiny, 1, prefill_min_chunk=1, prefill_max_chunk=1)
    assert (one.slots, one.prefill_min_chunk, one.prefill_max_chunk) == (1, 1, 1)
    assert engine(tiny, 2, prefill_min_chunk=8, prefill_max_chunk=8).prefill_max_chunk == 8


def test_engine_defaults_and_settings(tiny):
    """Kills ``__init__``'s defaults and assignments: the prompt budget (0.6 x 80 = 48 ms), prefill on,
    chunks 8..256, the floor (0.1 x 80 = 8 ms), the per-step cost (1 ms, measured unless given), the
    codebook counts (user = num_codebooks - dep_q - 1), every slot FREE, the sampling table's and the
    buffers' rows."""
    e = engine(tiny, 3)
    assert e.prompt_budget_ms == pytest.approx(48.0) and e.prefill is True
    assert (e.prefill_min_chunk, e.prefill_max_chunk) == (8, 256)
    assert e.prefill_floor_ms == pytest.approx(8.0)
    assert e.prefill_ms_per_step == 1.0 and e._prefill_cost_fixed is False
    lm = tiny.lm
    assert (e.dep_q, e.user_codebooks) == (lm.dep_q, lm.num_codebooks - lm.dep_q - 1)
    assert e.mimi_codebooks == tiny.mimi.num_codebooks
    assert [e.phase(s) for s in range(3)] == [SlotPhase.FREE] * 3
    assert e.sampling.slots == 3 and e._outputs.pcm.shape == (3, 1920)
    assert e._forcing.audio.shape == (3, e.dep_q) and list(e._prefill_queue) == []
    given = engine(
        tiny, 2, prompt_budget_ms=10.0, prefill=False, prefill_floor_ms=3.0, prefill_ms_per_step=2.5
    )
    assert (given.prompt_budget_ms, given.prefill, given.prefill_floor_ms) == (10.0, False, 3.0)
    assert given.prefill_ms_per_step == 2.5 and given._prefill_cost_fixed is True
    assert engine(tiny, 1, clock=lambda: 42.0).clock() == 42.0


# ------------------------------------------------------------------------------------------------------
# join, leave, phase, _check_slot, _mask
# ------------------------------------------------------------------------------------------------------


def test_join_without_prompt_goes_live_with_its_own_sampling(tiny):
    """Kills ``join``: the phase without a prompt (``LIVE``, ``if state.prompt`` negated), ``preroll``
    True, ``prefill`` None, the sampling assigned to this slot alone (``assign(None, ...)``, another
    slot), the FREE check (``is not`` -> ``is``) and its text."""
    e = engine(tiny, 3)
    e.join(1, SamplingParams(seed=77, text_temperature=0.3))
    assert [e.phase(s) for s in range(3)] == [SlotPhase.FREE, SlotPhase.LIVE, SlotPhase.FREE]
    state = e._slots[1]
    assert state.preroll is True and state.prefill is None and list(state.prompt) == []
    assert e._slots[0].preroll is False
    assert e.sampling.seed.tolist()[1] == 77 and e.sampling.seed.tolist()[0] != 77
    assert e.sampling.text_temperature.tolist()[1] == pytest.approx(0.3)
    with pytest.raises(ValueError) as info:
        e.join(1, SamplingParams())
    assert str(info.value) == "slot 1 is live, not free"
    assert e.live_slots == [1] and e.prompting_slots == []


def test_join_with_a_step_by_step_prompt_prompts(tiny):
    """Kills ``join``: ``deque(prompt or [])`` (-> ``and``), the PROMPTING phase, ``state.prompt and
    self.prefill and ...`` (-> ``or``): a prompt whose text is not forced is kept for the step-by-step
    path, not prefilled; the same with prefill switched off for a forced prompt."""
    e = engine(tiny, 2)
    prompt = free_prompt(e, 3)
    e.join(0, SamplingParams(), prompt)
    assert e.phase(0) is SlotPhase.PROMPTING and list(e._slots[0].prompt) == prompt
    assert e._slots[0].prefill is None and list(e._prefill_queue) == []
    assert e.prompting_slots == [0]
    off = engine(tiny, 2, prefill=False)
    off.join(1, SamplingParams(), forced_prompt(off, 4))
    assert off.phase(1) is SlotPhase.PROMPTING and len(off._slots[1].prompt) == 4
    assert off._slots[1].prefill is None and list(off._prefill_queue) == []


def test_join_with_a_forced_prompt_queues_a_prefill(tiny):
    """Kills ``join``'s prefill branch: the ``_Prefill`` built from the prompt (``list(state.prompt)``,
    the sequence), the prompt cleared (else stepped twice), the slot queued (``append`` dropped); the
    phase stays PROMPTING until the prefill is done."""
    e = engine(tiny, 3)
    prompt = forced_prompt(e, 5)
    e.join(2, SamplingParams(), prompt)
    e.join(0, SamplingParams(), forced_prompt(e, 2))
    state = e._slots[2]
    assert e.phase(2) is SlotPhase.PROMPTING and list(state.prompt) == []
    assert isinstance(state.prefill, _Prefill) and state.prefill.steps == prompt and state.prefill.done == 0
    assert state.prefill.total == 5 and tuple(state.prefill.sequence.shape) == (1, tiny.lm.num_codebooks, 5)
    assert list(e._prefill_queue) == [2, 0]


def test_leave_frees_the_slot_and_only_its_prefill(tiny):
    """Kills ``leave``: the phase (``FREE``), ``prompt.clear()`` and ``prefill = None`` dropped, the queue
    (``slot in`` -> ``not in``, ``remove`` dropped); leaving a free slot is a no-op, and the slot can
    join again."""
    e = engine(tiny, 3)
    e.join(0, SamplingParams(), forced_prompt(e, 2))
    e.join(1, SamplingParams(), forced_prompt(e, 2))
    e.join(2, SamplingParams(), free_prompt(e, 2))
    e.leave(0)
    assert e.phase(0) is SlotPhase.FREE and e._slots[0].prefill is None and list(e._prefill_queue) == [1]
    e.leave(2)
    assert e.phase(2) is SlotPhase.FREE and list(e._slots[2].prompt) == [] and list(e._prefill_queue) == [1]
    e.leave(2)  # already free
    assert e.phase(2) is SlotPhase.FREE and list(e._prefill_queue) == [1]
    e.join(0, SamplingParams())
    assert e.phase(0) is SlotPhase.LIVE and e.prompting_slots == [1]


@pytest.mark.parametrize("slot", [-1, 3, 4])
def test_slots_out_of_range_are_refused_by_name(tiny, slot):
    """Kills ``_check_slot``: ``0 <= slot < self.slots`` (``<=`` at either end, ``and``), and its text, in
    ``join``, ``leave`` and the phase check."""
    e = engine(tiny, 3)
    for call in (lambda: e.join(slot, SamplingParams()), lambda: e.leave(slot)):
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == f"slot must be in [0, 3), got {slot}"
    e.join(0, SamplingParams())
    e.join(2, SamplingParams())
    assert e.live_slots == [0, 2]


def test_mask_marks_the_given_rows_only(tiny):
    """Kills ``_mask``: ``zeros`` -> ``ones``, ``True`` -> ``False``, the dtype, the rows."""
    e = engine(tiny, 4)
    mask = e._mask([1, 3])
    assert mask.dtype == torch.bool and mask.tolist() == [False, True, False, True]
    assert e._mask([]).tolist() == [False] * 4


# ------------------------------------------------------------------------------------------------------
# _chunk_steps
# ------------------------------------------------------------------------------------------------------


def chunk(e: BatchEngine, total: int, done: int, spare_ms: float, at_least_min: bool = False) -> int:
    prefill = _Prefill([], torch.zeros(1, 1, total, dtype=torch.int64), torch.zeros(1, total + 1), done=done)
    return e._chunk_steps(prefill, spare_ms, at_least_min=at_least_min)


@pytest.mark.parametrize(
    "total, done, spare_ms, at_least_min, steps",
    [
        (1000, 0, 100.0, False, 32),  # 100 ms / 2 ms = 50 steps -> 32 (power of two)
        (1000, 0, 128.0, False, 64),  # exactly 64 steps
        (1000, 0, 126.0, False, 32),  # 63 steps -> 32
        (1000, 0, 1000.0, False, 256),  # 500 fit; capped at max 256
        (1000, 990, 1000.0, False, 8),  # 10 left -> 8
        (1000, 0, 15.0, False, 0),  # 7 steps < min 8: none
        (1000, 0, 15.0, True, 8),  # ... unless at least the minimum
        (1000, 0, -5.0, True, 8),  # no time left at all
        (1000, 0, 16.0, False, 8),  # exactly the minimum
        (1000, 997, 15.0, False, 2),  # 3 left < min: all 3 fit -> 2
        (1000, 997, 4.0, False, 0),  # 2 fit, fewer than the 3 left (the minimum here): none
        (1000, 997, 4.0, True, 2),  # ... unless at least the minimum: the 3 left -> 2
        (1000, 1000, 100.0, True, 0),  # nothing left
    ],
)
def test_chunk_steps(tiny, total, done, spare_ms, at_least_min, steps):
    """Kills ``_chunk_steps``: ``left`` (``-`` -> ``+``), ``fits`` (``max(spare_ms, 0.0)``, the cost
    divisor), ``min`` of fits/max/left, the minimum test (``<`` -> ``<=``, ``min(min_chunk, left)``), the
    ``at_least_min`` choice, and the power of two (``1 << (bit_length - 1)``, ``steps > 0``). At 2 ms a
    step, chunks 8..256."""
    e = engine(tiny, 1, prefill_ms_per_step=2.0)
    assert chunk(e, total, done, spare_ms, at_least_min) == steps


def streaming_offsets(module, slots: int) -> dict[str, torch.Tensor]:
    """The per-row integer offsets of ``module``'s streaming states (name -> ``[slots]`` tensor)."""
    found = {}
    for name, state in module.get_streaming_state().items():
        for key, value in vars(state).items():
            if (
                isinstance(value, torch.Tensor)
                and "offset" in key
                and value.shape == (slots,)
                and not value.dtype.is_floating_point
                and value.dtype != torch.bool
            ):
                found[f"{name}.{key}"] = value
    return found


def test_join_resets_the_joining_slots_rows_alone(tiny):
    """Kills ``join``'s reset: ``mask = self._mask([slot])`` (None, ``_mask(None)``) and
    ``reset_streaming(mask)`` -> ``reset_streaming(None)`` for the LM and for Mimi: a joiner must not
    reset its neighbours' KV caches and conv states (every live conversation would lose its context).
    Each per-row streaming offset is set to 7; after slot 1 joins, only row 1 is back to 0."""
    e = engine(tiny, 3)
    offsets = {**streaming_offsets(e.lm_gen, 3), **streaming_offsets(e.bundle.mimi, 3)}
    assert any(name.startswith(".") for name in offsets) and len(offsets) >= 2  # the LM's and Mimi's
    for value in offsets.values():
        value.fill_(7)
    e.join(1, SamplingParams())
    assert {name: v.tolist() for name, v in offsets.items()} == {name: [7, 0, 7] for name in offsets}


@pytest.mark.parametrize(
    "per_step, total, done, spare_ms, steps",
    [
        (0.1, 1000, 0, 0.0, 0),  # no time: nothing, however cheap a step (max(spare, 0.0), not 1.0)
        (0.5, 1000, 0, 8.0, 16),  # 16 steps fit at 0.5 ms (the cost divisor is not floored at 1 ms)
        (2.0, 1000, 0, 1200.0, 256),  # 600 fit: capped at the 256 maximum, not rounded to 512
        (2.0, 1000, 999, 100.0, 1),  # one step left: one, not none
    ],
)
def test_chunk_steps_bounds(tiny, per_step, total, done, spare_ms, steps):
    """Kills ``_chunk_steps``: ``max(spare_ms, 0.0)`` -> ``1.0``, ``max(prefill_ms_per_step, 1e-6)`` ->
    ``1.000001``, ``min(fits, prefill_max_chunk, left)`` without the maximum, and ``steps > 0`` -> ``> 1``."""
    e = engine(tiny, 1, prefill_ms_per_step=per_step)
    assert chunk(e, total, done, spare_ms) == steps


def test_engine_wires_its_parts_together(tiny):
    """Kills ``__init__``: ``self.device`` (None), the LM generator built without the engine's sampling
    table or forcing tensors (``SlotLMGen(lm, None, ...)``, ``(..., None)``), the pre-roll's silence
    (None, or shaped other than ``[B, 1, 1920]``) and the empty exec mask (``_no_rows``: bool, one row per
    slot, all False; ``dtype`` dropped)."""
    e = engine(tiny, 3)
    assert e.device == tiny.lm.device
    assert e.lm_gen.sampling is e.sampling and e.lm_gen.forcing is e._forcing
    assert tuple(e._silence.shape) == (3, 1, 1920) and not e._silence.any()
    assert e._no_rows.dtype == torch.bool and e._no_rows.tolist() == [False] * 3


def test_forcing_and_masks_stay_on_the_engines_device(tiny):
    """Kills the device dropped in ``_Forcing.__init__`` (``device=None`` or left out) and ``_mask``
    (``.to(None)``): on a GPU they would sit on the CPU beside a CUDA model. PyTorch's ``meta`` device
    stands in for the GPU."""
    meta = torch.device("meta")
    f = _Forcing(2, 3, meta)
    assert f.text.device == meta and f.audio.device == meta
    e = engine(tiny, 2)
    e.device = meta
    assert e._mask([1]).device == meta
