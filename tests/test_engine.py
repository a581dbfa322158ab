"""The batch engine on the tiny model: isolation between slots, masking, personas, sampling."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from runtime.engine.batch import UNGENERATED_TOKEN, BatchEngine, SlotPhase
from runtime.engine.models import ModelBundle, build_tiny
from runtime.engine.persona import Persona, VoiceCatalog, build_prompt
from runtime.engine.sampling import SamplingParams

SLOTS = 5
TICKS = 40


class FakeClock:
    """A clock that moves ``step_ms`` forward each time it is read: how much prompt work a tick does then
    depends on the engine's budget alone, never on this machine's speed."""

    def __init__(self, step_ms: float = 1.0) -> None:
        self.step_s = step_ms / 1e3
        self.now = 0.0

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def _engine(bundle: ModelBundle, slots: int = SLOTS, **kwargs) -> BatchEngine:
    """A fresh engine on a copy of ``bundle`` with a :class:`FakeClock` (unless given another clock)."""
    kwargs.setdefault("clock", FakeClock())
    return BatchEngine(copy.deepcopy(bundle), slots, **kwargs)


@pytest.fixture(scope="module")
def tiny() -> ModelBundle:
    return build_tiny(seed=0)


@pytest.fixture(scope="module")
def speech_like() -> np.ndarray:
    """[SLOTS, TICKS, 1920] noise frames, a different stream per slot."""
    rng = np.random.default_rng(1)
    return (rng.standard_normal((SLOTS, TICKS, 1920)) * 0.1).astype(np.float32)


def _run(
    bundle: ModelBundle,
    audio: np.ndarray,
    joins: dict[int, int],
    leaves: dict[int, int],
    sampling: SamplingParams,
    prompts: dict[int, list] | None = None,
    **engine_kwargs,
) -> dict[int, list[tuple[int, ...]]]:
    """Drive a fresh engine tick by tick; each slot's (text, audio...) tokens in order."""
    engine = _engine(bundle, **engine_kwargs)
    tokens: dict[int, list[tuple[int, ...]]] = {s: [] for s in range(SLOTS)}
    for t in range(TICKS):
        for slot, at in joins.items():
            if at == t:
                engine.join(slot, sampling, (prompts or {}).get(slot))
        for slot, at in leaves.items():
            if at == t:
                engine.leave(slot)
        pcm = np.zeros((SLOTS, 1920), dtype=np.float32)
        for slot, at in joins.items():
            if t >= at and engine.phase(slot) is SlotPhase.LIVE:
                pcm[slot] = audio[slot, len(tokens[slot]) % TICKS]
        result = engine.tick(pcm)
        for slot in range(SLOTS):
            if result.text_tokens[slot] != UNGENERATED_TOKEN:
                tokens[slot].append((int(result.text_tokens[slot]), *map(int, result.audio_tokens[slot])))
    return tokens


def test_greedy_session_is_identical_alone_and_in_a_busy_batch(tiny, speech_like) -> None:
    alone = _run(tiny, speech_like, {0: 0}, {}, SamplingParams.greedy())
    busy = _run(
        tiny, speech_like, {0: 0, 1: 3, 2: 5, 3: 0, 4: 10}, {1: 20, 2: 12, 3: 30}, SamplingParams.greedy()
    )
    assert len(alone[0]) >= TICKS - 3
    assert busy[0] == alone[0]
    # The others really ran (and differ from slot 0), so the batch was not idle.
    assert len(busy[1]) > 10 and busy[1] != busy[0][: len(busy[1])]


def test_seeded_sampling_is_isolated_too(tiny, speech_like) -> None:
    params = SamplingParams(seed=1234)
    alone = _run(tiny, speech_like, {2: 0}, {}, params)
    busy = _run(tiny, speech_like, {2: 0, 0: 1, 4: 2}, {0: 15}, params)
    assert busy[2] == alone[2]
    assert len({t[0] for t in alone[2]}) > 3  # really sampled, not a constant stream


def test_a_rejoined_slot_starts_fresh(tiny, speech_like) -> None:
    """A session that leaves and a new one joining the same slot: the newcomer matches a fresh start."""
    fresh = _run(tiny, speech_like, {1: 0}, {}, SamplingParams.greedy())
    engine = _engine(tiny)
    engine.join(1, SamplingParams.greedy())
    for t in range(7):
        pcm = np.zeros((SLOTS, 1920), dtype=np.float32)
        pcm[1] = speech_like[3, t]
        engine.tick(pcm)
    engine.leave(1)
    engine.join(1, SamplingParams.greedy())
    got: list[tuple[int, ...]] = []
    for _ in range(TICKS):
        pcm = np.zeros((SLOTS, 1920), dtype=np.float32)
        pcm[1] = speech_like[1, len(got) % TICKS]
        result = engine.tick(pcm)
        if result.text_tokens[1] != UNGENERATED_TOKEN:
            got.append((int(result.text_tokens[1]), *map(int, result.audio_tokens[1])))
    assert got == fresh[1][: len(got)]
    assert len(got) >= TICKS - 3


def test_idle_and_inactive_slots_produce_nothing(tiny) -> None:
    engine = _engine(tiny)
    engine.join(0, SamplingParams.greedy())
    engine.join(1, SamplingParams.greedy())
    active = np.array([True, False, False, False, False])
    for _ in range(5):
        result = engine.tick(np.zeros((SLOTS, 1920), dtype=np.float32), active)
    assert result.audio_ready.tolist() == [True, False, False, False, False]
    assert (result.text_tokens[1:] == UNGENERATED_TOKEN).all()
    assert np.abs(result.pcm[1:]).max() == 0.0


@pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "step-by-step"])
def test_persona_prompt_runs_before_the_conversation_without_touching_others(
    tiny, speech_like, prefill
) -> None:
    engine = _engine(tiny)
    prompt = build_prompt(
        Persona(text_prompt="You are a helpful travel agent."),
        VoiceCatalog(),
        tiny.text_tokenizer,
        silence_codes=engine.silence_codes.cpu(),
        sine_codes=engine.sine_codes.cpu(),
    )
    assert len(prompt) > 12
    baseline = _run(tiny, speech_like, {0: 0}, {}, SamplingParams.greedy())
    with_prompting_neighbour = _run(
        tiny, speech_like, {0: 0, 3: 2}, {}, SamplingParams.greedy(), prompts={3: prompt}, prefill=prefill
    )
    assert with_prompting_neighbour[0] == baseline[0]
    assert len(with_prompting_neighbour[3]) > 0  # went LIVE after its prompt and produced tokens


def test_prompt_steps_share_the_tick_budget(tiny) -> None:
    engine = _engine(tiny, prompt_budget_ms=0.0, prefill=False)  # the step-by-step reference
    codes = engine.silence_codes.cpu()
    voice = VoiceCatalog({"anna": codes[:, :4]})
    prompt = build_prompt(
        Persona(voice_prompt="anna"), voice, tiny.text_tokenizer, silence_codes=codes, sine_codes=codes
    )
    engine.join(2, SamplingParams.greedy(), prompt)
    ticks = 0
    while engine.phase(2) is SlotPhase.PROMPTING:
        result = engine.tick(np.zeros((SLOTS, 1920), dtype=np.float32))
        assert result.timings.prompt_steps == 1  # zero budget: exactly one prompt step per tick
        ticks += 1
    assert ticks == len(prompt)
    assert result.prompt_finished == [2]


def test_teacher_forcing_writes_the_prompt_tokens(tiny) -> None:
    """Forced text tokens are what the model sees: the LMGen cache holds them after the prompt."""
    engine = _engine(tiny, prompt_budget_ms=1e9)
    tokens = [10, 11, 12, 13]
    from runtime.engine.batch import PromptStep

    user = engine.sine_codes[:, 0].cpu()
    engine.join(0, SamplingParams(), [PromptStep(user, tok) for tok in tokens])
    engine.tick(np.zeros((SLOTS, 1920), dtype=np.float32))
    assert engine.phase(0) is SlotPhase.LIVE
    cache = engine.lm_gen._streaming_state.cache  # [B, K, CT], ring of the last CT steps
    ct = cache.shape[-1]
    # Frame i's text sits at position i (NVIDIA's prepare_step_input, delay 0), and the position after the
    # prompt holds the last frame's once more (runtime.engine.batch.prompt_positions).
    written = [int(cache[0, 0, p % ct]) for p in range(len(tokens) + 1)]
    assert written[-ct:] == [*tokens, tokens[-1]][-ct:]


def test_result_buffers_are_allocated_once_and_cleared_every_tick(tiny, speech_like) -> None:
    """Guards issue 21 item 5: ``tick`` returns the same four arrays every tick (allocated once per engine,
    as Kyutai's batched_asr.py), rewritten in place: a slot that stopped producing reads as silence and
    ``UNGENERATED_TOKEN`` again, never as the previous tick's values."""
    engine = _engine(tiny, 2)
    engine.join(0, SamplingParams.greedy())
    engine.join(1, SamplingParams.greedy())
    results = []
    for t in range(6):
        pcm = np.stack([speech_like[0, t], speech_like[1, t]])
        results.append(engine.tick(pcm))
    first, last = results[0], results[-1]
    for name in ("pcm", "audio_ready", "text_tokens", "audio_tokens"):
        assert all(getattr(r, name) is getattr(first, name) for r in results), name
    assert last.audio_ready.tolist() == [True, True] and np.abs(last.pcm).max() > 0
    engine.leave(1)
    after = engine.tick(np.zeros((2, 1920), dtype=np.float32))
    assert after.pcm is first.pcm
    assert after.audio_ready.tolist() == [True, False]
    assert not after.pcm[1].any() and after.text_tokens[1] == UNGENERATED_TOKEN
    assert (after.audio_tokens[1] == UNGENERATED_TOKEN).all()


def test_join_errors_name_the_problem(tiny) -> None:
    engine = _engine(tiny, 2)
    with pytest.raises(ValueError, match=r"slot must be in \[0, 2\)"):
        engine.join(2, SamplingParams())
    engine.join(0, SamplingParams())
    with pytest.raises(ValueError, match="slot 0 is live, not free"):
        engine.join(0, SamplingParams())
    with pytest.raises(ValueError, match=r"pcm_in must be \[2, 1920\]"):
        engine.tick(np.zeros((3, 1920), dtype=np.float32))
    with pytest.raises(ValueError, match="slots must be >= 1"):
        BatchEngine(tiny, 0)


def test_tick_reports_its_timings(tiny) -> None:
    engine = _engine(tiny, 2)
    engine.join(0, SamplingParams())
    for _ in range(3):
        result = engine.tick(np.zeros((2, 1920), dtype=np.float32))
    t = result.timings
    assert t.total_ms > 0 and t.lm_ms > 0 and t.encode_ms > 0 and t.decode_ms > 0
    assert t.total_ms >= t.lm_ms + t.encode_ms
    assert engine.memory_allocated_bytes() is None  # CPU
