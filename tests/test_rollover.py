"""Persona rollover (runtime/engine/rollover.py, issue 30 item 11) on the tiny model with a 20-step context:
over a hundred rollovers in one session, no frame lost, the persona's KV rows after each one equal to a fresh
prefill of the same steps, and the neighbour's token stream bit-identical to a run without rollovers. Every
engine runs on a fake clock (tests/test_engine.py ``FakeClock``): what a tick does depends on its budget,
never on this machine's speed; no timing is asserted (tick figures: docs/benchmarks.md)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from moshi.modules.transformer import _MHAState, _TransformerState, set_attention_context
from test_engine import FakeClock

from runtime.engine.batch import UNGENERATED_TOKEN, BatchEngine, PromptStep
from runtime.engine.models import ModelBundle, build_tiny
from runtime.engine.persona import embeddings_voice_steps
from runtime.engine.rollover import RolloverEngine, RolloverPolicy
from runtime.engine.sampling import SamplingParams
from runtime.engine.voices import EmbeddingsVoice

CONTEXT = 20
"""The attention window in steps (the tiny preset's is 250)."""
POLICY = RolloverPolicy(seek_fraction=0.4, force_fraction=0.9, memory_tokens=8, pause_ticks=2, chunk_steps=2)
"""Seek at 8 steps, forced at 18; persona (3 steps) + memory cut to half of seek (1 token); 2 prefill steps
a tick, so a rollover spans 2 ticks (the slot steps live meanwhile), and a forced one must catch up (2 ticks
left before the window closes)."""
ROLLING, NEIGHBOUR = 0, 1
TICKS = 800


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on 2 cores shared with other work, torch's two threads contend and a tiny tick
    takes 10 times as long. Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny() -> ModelBundle:
    bundle = build_tiny(seed=0)
    set_attention_context(bundle.lm.transformer, CONTEXT)  # moshi's own setter: every layer's window
    return bundle


def _persona(engine: BatchEngine) -> list[PromptStep]:
    """3 fully forced steps: the prompt's user frame, the agent's silence; padding, a text id, padding."""
    user, silence = engine.sine_codes.cpu(), engine.silence_codes.cpu()  # [K, F]: F = 1 for NVIDIA's frames
    return [
        PromptStep(user[:, i % user.shape[1]], token, silence[:, i % silence.shape[1]])
        for i, token in enumerate((3, 40, 3))
    ]


def _input(tick: int, rng: np.random.Generator) -> np.ndarray:
    """Both slots talk; the rolling slot's caller is quiet 12 ticks in every 30 (some rollovers come at a
    pause, the others are forced)."""
    pcm = (rng.standard_normal((2, 1920)) * 0.1).astype(np.float32)
    if tick % 30 >= 18:
        pcm[ROLLING] = 0.0
    return pcm


def _rows(engine: BatchEngine, slot: int) -> dict[str, torch.Tensor]:
    """``slot``'s rows of the temporal transformer's streaming state: each layer's valid KV positions
    ``[2, H, T, D]``, ring write position and offsets, cloned."""
    out: dict[str, torch.Tensor] = {}
    for name, state in engine.bundle.lm.transformer.get_streaming_state().items():
        if isinstance(state, _TransformerState):
            out[f"{name}.offsets"] = state.offsets[slot].clone()
        elif isinstance(state, _MHAState):
            ring = state.kv_cache
            end = int(ring.end_offset[slot])
            valid = torch.arange(max(0, end - ring.capacity), end) % ring.capacity
            out[f"{name}.kv"] = ring.cache[:, slot].index_select(2, valid).clone()
            out[f"{name}.end_offset"] = ring.end_offset[slot].clone()
            out[f"{name}.offset"] = state.offset[slot].clone()
    return out


def _fresh_prefill_rows(reference: BatchEngine, steps: list[PromptStep]) -> dict[str, torch.Tensor]:
    """The rows a newly joined session prefilled with ``steps`` gets (BatchEngine's own join path)."""
    reference.join(0, SamplingParams.greedy(), steps)
    result = reference.tick(np.zeros((1, 1920), dtype=np.float32))
    assert result.prompt_finished == [0]
    rows = _rows(reference, 0)
    reference.leave(0)
    return rows


def _run(engine: BatchEngine, reference: BatchEngine | None = None) -> dict:
    """The rolling slot (persona, seed 1) and its neighbour (no persona, seed 2) for ``TICKS`` ticks. With
    a ``reference`` engine, after every rollover the rolling slot's rows are checked against a fresh
    prefill of the rollover's steps, and its LMGen token cache against the tokens it just produced."""
    rng = np.random.default_rng(5)
    engine.join(ROLLING, SamplingParams(seed=1), _persona(engine))
    engine.join(NEIGHBOUR, SamplingParams(seed=2))
    tokens: dict[int, list[tuple[int, ...]]] = {ROLLING: [], NEIGHBOUR: []}
    frames = {ROLLING: 0, NEIGHBOUR: 0}
    live_ticks = {ROLLING: 0, NEIGHBOUR: 0}
    rollovers = {"pause": 0, "forced": 0}
    checked = prefill_ticks = 0
    for t in range(TICKS):
        live = engine.live_slots
        result = engine.tick(_input(t, rng))
        for slot in (ROLLING, NEIGHBOUR):
            if result.text_tokens[slot] != UNGENERATED_TOKEN:
                tokens[slot].append((int(result.text_tokens[slot]), *map(int, result.audio_tokens[slot])))
            if slot in live:
                live_ticks[slot] += 1
                frames[slot] += int(result.audio_ready[slot])
        prefill_ticks += result.timings.rollover_steps > 0
        rollovers["pause"] += result.timings.rollovers_at_pause
        rollovers["forced"] += result.timings.rollovers_forced
        if not isinstance(engine, RolloverEngine):
            continue
        gen = engine.lm_gen._streaming_state
        assert int(gen.offsets[ROLLING]) == engine.persona_age(ROLLING) <= CONTEXT
        if result.timings.rollovers_at_pause + result.timings.rollovers_forced and reference is not None:
            steps = engine.last_rollover_steps(ROLLING)
            persona = _persona(engine)
            assert len(steps) == int(POLICY.seek_fraction * CONTEXT) // 2  # persona + memory cut to fit
            assert [s.text_token for s in steps[:3]] == [s.text_token for s in persona]
            last = persona[-1]
            for memory in steps[3:]:  # the agent's own text over the persona's closing frame
                assert memory.text_token >= 0 and memory.text_token not in (0, 3)
                assert torch.equal(memory.user_codes, last.user_codes)
                assert memory.agent_codes is not None and last.agent_codes is not None
                assert torch.equal(memory.agent_codes, last.agent_codes)
            expected = _fresh_prefill_rows(reference, steps)
            got = _rows(engine, ROLLING)
            assert set(got) == set(expected)
            for key, value in expected.items():
                if value.dtype.is_floating_point:
                    torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)
                else:
                    assert torch.equal(got[key], value), key
            # LMGen's token cache was rotated, not rebuilt: the tokens this tick returned are read back from
            # where LMGen reads its outputs, ``offset - max_delay + delay_k`` (moshi lm.py ``_step``).
            delays = list(engine.bundle.lm.delays)
            ct = gen.cache.shape[-1]
            returned = [int(result.text_tokens[ROLLING]), *map(int, result.audio_tokens[ROLLING])]
            cached = [
                int(gen.cache[ROLLING, k, (len(steps) - max(delays) + delays[k]) % ct])
                for k in range(engine.dep_q + 1)
            ]
            assert cached == returned
            checked += 1
    return {
        "tokens": tokens,
        "frames": frames,
        "live_ticks": live_ticks,
        "rollovers": rollovers,
        "checked": checked,
        "prefill_ticks": prefill_ticks,
    }


# A hang guard, not a speed bound (about 30 s on 2 shared cores).
@pytest.mark.timeout(600)
def test_a_long_session_rolls_over_and_its_neighbour_never_notices(tiny) -> None:
    rolling = RolloverEngine(copy.deepcopy(tiny), 2, clock=FakeClock(), rollover=POLICY)
    reference = BatchEngine(copy.deepcopy(tiny), 1, clock=FakeClock(), prompt_budget_ms=1e9)
    run = _run(rolling, reference)
    rollovers = run["rollovers"]
    assert rollovers["pause"] + rollovers["forced"] >= 100, rollovers
    assert rollovers["pause"] > 0 and rollovers["forced"] > 0, rollovers  # both triggers were used
    assert run["checked"] == rollovers["pause"] + rollovers["forced"]
    assert run["prefill_ticks"] >= 2 * run["checked"]  # each spanned several live ticks
    assert rolling.rollovers(ROLLING) == run["checked"]
    # 0 frames lost: every live tick of the rolling slot produced its frame (the persona used the acoustic
    # delay up: its first live step yields audio); it went live after its join tick.
    assert run["frames"][ROLLING] == run["live_ticks"][ROLLING] == TICKS - 1
    # The neighbour's tokens are bit-identical to a run without rollovers (a plain BatchEngine).
    plain = _run(BatchEngine(copy.deepcopy(tiny), 2, clock=FakeClock()))
    assert plain["rollovers"] == {"pause": 0, "forced": 0}
    assert len(run["tokens"][NEIGHBOUR]) >= TICKS - 2
    assert run["tokens"][NEIGHBOUR] == plain["tokens"][NEIGHBOUR]
    # The rolling slot itself diverges once its state is rolled (it is not a no-op).
    assert run["tokens"][ROLLING] != plain["tokens"][ROLLING]


def test_without_a_rollover_the_persona_leaves_the_window(tiny) -> None:
    """The old behaviour the rollover fixes: with rollovers off, the age passes the context."""
    engine = RolloverEngine(copy.deepcopy(tiny), 2, clock=FakeClock(), rollover=RolloverPolicy(enabled=False))
    engine.join(ROLLING, SamplingParams(seed=1), _persona(engine))
    ages = [engine.tick(np.zeros((2, 1920), dtype=np.float32)).timings.persona_age_steps for _ in range(30)]
    assert ages[-1] == len(_persona(engine)) + 29 > CONTEXT
    assert engine.rollovers(ROLLING) == 0


def test_a_persona_too_long_for_the_window_is_not_rolled(tiny) -> None:
    engine = RolloverEngine(copy.deepcopy(tiny), 1, clock=FakeClock(), rollover=POLICY)
    user, silence = engine.sine_codes.cpu(), engine.silence_codes.cpu()
    long_persona = [
        PromptStep(user[:, 0], 3, silence[:, 0]) for _ in range(CONTEXT // 4)
    ]  # NVIDIA's one frame
    engine.join(0, SamplingParams.greedy(), long_persona)
    for _ in range(CONTEXT):
        result = engine.tick(np.zeros((1, 1920), dtype=np.float32))
        assert result.timings.rollover_steps == 0
    assert engine.rollovers(0) == 0
    assert (
        result.timings.persona_age_steps == CONTEXT // 4 + CONTEXT - 1 > CONTEXT
    )  # reported, out of the window


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seek_fraction": 0.9, "force_fraction": 0.8}, "0 < seek <= force < 1"),
        ({"force_fraction": 1.0}, "0 < seek <= force < 1"),
        ({"memory_tokens": -1}, "memory_tokens must be >= 0"),
        ({"pause_ticks": 0}, "pause_ticks >= 1"),
    ],
)
def test_policy_bounds_are_checked(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        RolloverPolicy(**kwargs)


def test_the_node_counts_rollovers_and_the_oldest_persona() -> None:
    """The scheduler's share: a tick's rollovers by trigger and the largest age, in /metrics' names."""
    from types import SimpleNamespace

    from runtime.engine.batch import TickTimings
    from runtime.engine.scheduler import SlotScheduler
    from runtime.metrics import RuntimeMetrics

    metrics = RuntimeMetrics()
    count = SlotScheduler._count_rollovers
    count(SimpleNamespace(metrics=metrics), TickTimings(rollovers_forced=2, persona_age_steps=2999))  # type: ignore[arg-type]
    count(SimpleNamespace(metrics=metrics), TickTimings(rollovers_at_pause=1, persona_age_steps=612))  # type: ignore[arg-type]
    text = metrics.render().decode()
    assert 'duplex_persona_rollovers_total{trigger="forced"} 2.0' in text
    assert 'duplex_persona_rollovers_total{trigger="pause"} 1.0' in text
    assert "duplex_persona_age_steps 612.0" in text


def test_the_settings_make_the_engines_policy() -> None:
    from pydantic import ValidationError

    from runtime.config import RuntimeConfig

    config = RuntimeConfig(rollover_seek_fraction=0.5, rollover_memory_tokens=10, rollover_pause_ticks=3)
    policy = RolloverPolicy.from_config(config)
    assert (policy.enabled, policy.seek_fraction, policy.force_fraction) == (True, 0.5, 0.85)
    assert (policy.memory_tokens, policy.pause_ticks, policy.pause_rms) == (10, 3, 0.01)
    with pytest.raises(ValidationError, match="DUPLEX_ROLLOVER_SEEK_FRACTION=0.9 must be <="):
        RuntimeConfig(rollover_seek_fraction=0.9, rollover_force_fraction=0.8)


def test_an_embeddings_voice_persona_rolls_over_with_its_embeddings_replayed(tiny) -> None:
    """NVIDIA's presets (the PersonaPlex case): the rollover re-prefills the stored input embeddings, not
    tokens, so after each rollover the slot's rows equal a fresh join-prefill of the same preset."""
    engine = RolloverEngine(copy.deepcopy(tiny), 1, clock=FakeClock(), rollover=POLICY)
    reference = BatchEngine(copy.deepcopy(tiny), 1, clock=FakeClock(), prompt_budget_ms=1e9)
    gen = torch.Generator().manual_seed(3)
    delays = list(tiny.lm.delays)
    cache = torch.randint(0, 200, (1, len(delays), 4), generator=gen)  # NVIDIA's 4 columns, tiny vocabulary
    voice = EmbeddingsVoice(torch.randn(2, 1, 1, tiny.lm.dim, generator=gen), cache)
    steps = embeddings_voice_steps(
        voice, sine=engine.sine_codes[:, 0].cpu(), silence=engine.silence_codes[:, 0].cpu(), delays=delays
    )
    assert [s.embedding is not None for s in steps] == [True, True, False]
    engine.join(0, SamplingParams(seed=1), steps)
    rng = np.random.default_rng(9)
    checked = 0
    for _ in range(120):
        pcm = (rng.standard_normal((1, 1920)) * 0.1).astype(np.float32)
        result = engine.tick(pcm)
        if not result.timings.rollovers_at_pause + result.timings.rollovers_forced:
            continue
        rolled = engine.last_rollover_steps(0)
        for got_step, persona_step in zip(rolled[:3], steps, strict=True):
            assert (got_step.embedding is None) == (persona_step.embedding is None)
            if persona_step.embedding is not None:
                assert torch.equal(got_step.embedding, persona_step.embedding)
        expected = _fresh_prefill_rows(reference, rolled)
        got = _rows(engine, 0)
        for key, value in expected.items():
            if value.dtype.is_floating_point:
                torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)
            else:
                assert torch.equal(got[key], value), key
        checked += 1
    assert checked >= 5 and engine.rollovers(0) == checked
