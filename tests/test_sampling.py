"""The per-slot sampler: greedy, top-k, temperature, and draws that depend only on the slot's own counters."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_engine import FakeClock

from runtime.engine.batch import UNGENERATED_TOKEN, BatchEngine
from runtime.engine.models import ModelBundle, build_tiny
from runtime.engine.sampling import SamplingParams, SlotSamplingTable, counter_uniform, sample_rows


def _rows(b: int, value: float, dtype=torch.float32) -> torch.Tensor:
    return torch.full((b,), value, dtype=dtype)


def test_temperature_zero_is_argmax() -> None:
    logits = torch.randn(4, 100)
    got = sample_rows(
        logits,
        _rows(4, 0.0),
        _rows(4, 50, torch.int64),
        _rows(4, 1, torch.int64),
        _rows(4, 0, torch.int64),
        0,
    )
    assert torch.equal(got, logits.argmax(-1))


def test_top_k_keeps_only_the_k_best() -> None:
    logits = torch.arange(50, dtype=torch.float32).repeat(3, 1)  # best ids are 49, 48, 47 ...
    top_k = torch.tensor([1, 3, 10])
    seen: list[set[int]] = [set(), set(), set()]
    for step in range(300):
        got = sample_rows(
            logits, _rows(3, 2.0), top_k, _rows(3, 7, torch.int64), _rows(3, step, torch.int64), 1
        )
        for row in range(3):
            seen[row].add(int(got[row]))
    assert seen[0] == {49}
    assert seen[1] == {47, 48, 49}
    assert seen[2] <= set(range(40, 50)) and len(seen[2]) >= 8


def test_sampling_follows_the_softmax() -> None:
    """Gumbel-max draws match softmax(logits / T) within sampling error."""
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    counts = torch.zeros(3)
    n = 4000
    for step in range(n):
        got = sample_rows(
            logits,
            _rows(1, 1.0),
            _rows(1, 3, torch.int64),
            _rows(1, 3, torch.int64),
            _rows(1, step, torch.int64),
            2,
        )
        counts[int(got)] += 1
    expected = torch.softmax(logits[0], -1)
    assert torch.allclose(counts / n, expected, atol=0.03)


def test_draws_depend_only_on_the_row_counters() -> None:
    seed = torch.tensor([5, 5, 9])
    step = torch.tensor([3, 3, 3])
    u = counter_uniform(seed, step, stream=4, vocab=64)
    assert torch.equal(u[0], u[1])
    assert not torch.equal(u[0], u[2])
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    alone = counter_uniform(seed[2:], step[2:], stream=4, vocab=64)
    assert torch.equal(alone[0], u[2])
    assert not torch.equal(counter_uniform(seed, step + 1, 4, 64), u)
    assert not torch.equal(counter_uniform(seed, step, 5, 64), u)


def test_table_assigns_per_slot_settings_and_counts_steps() -> None:
    table = SlotSamplingTable(3, torch.device("cpu"))
    table.assign(1, SamplingParams(audio_temperature=0.0, audio_top_k=400, text_temperature=0.3, seed=42))
    assert table.audio_temperature.tolist()[1] == 0.0
    assert table.audio_top_k_bound == 400
    table.advance(torch.tensor([True, True, False]))
    table.advance(torch.tensor([False, True, False]))
    assert table.step.tolist() == [1, 2, 0]
    table.assign(1, SamplingParams())
    assert table.step.tolist() == [1, 0, 0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"audio_temperature": -0.1}, r"audio_temperature must be in \[0, 2\]"),
        ({"text_temperature": 2.5}, r"text_temperature must be in \[0, 2\]"),
        ({"audio_top_k": 0}, "audio_top_k must be >= 1"),
        ({"seed": 2**31}, r"seed must be in \[0, 2\*\*31\)"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_batched_audio_noise_equals_per_codebook_draws() -> None:
    table = SlotSamplingTable(3, torch.device("cpu"))
    table.assign(0, SamplingParams(seed=11))
    table.assign(2, SamplingParams(seed=12))
    table.advance(torch.tensor([True, False, True]))
    noise = table.audio_noise(4, 64)
    for codebook in range(4):
        one = counter_uniform(table.seed, table.step, 1 + codebook, 64)
        assert torch.equal(noise[:, codebook], -torch.log(-torch.log(one)))


# --------------------------------------------------------------------------------------------------
# Per-slot settings (issue 25): every row samples with its own settings, whatever its neighbours have
# --------------------------------------------------------------------------------------------------

VOCAB = 64
STEPS = 40
JOIN_ORDER = (2, 0, 3, 1)
"""The order the slots of the table tests join in: slot 1 joins last, slot 0 neither first nor last."""
OWN_SETTINGS = {
    0: SamplingParams(audio_temperature=0.0, audio_top_k=7, text_temperature=1.5, text_top_k=64, seed=202),
    1: SamplingParams(audio_temperature=1.5, audio_top_k=64, text_temperature=0.0, text_top_k=9, seed=404),
    2: SamplingParams(audio_temperature=1.0, audio_top_k=2, text_temperature=1.0, text_top_k=3, seed=101),
    3: SamplingParams(audio_temperature=0.5, audio_top_k=300, text_temperature=0.75, text_top_k=60, seed=303),
}
"""Four slots' settings, every field different in every slot. Text: slot 0 hot, slot 1 greedy, slot 2 top-3;
audio: slot 0 greedy, slot 1 hot, slot 2 top-2 (the other way round, so text and audio cannot share)."""


def _table(settings: dict[int, SamplingParams], order: tuple[int, ...] = JOIN_ORDER) -> SlotSamplingTable:
    """A 4-slot table the slots of ``settings`` joined in ``order``, one step apart (each join after the
    rows already in it stepped once, as slots join a running batch)."""
    table = SlotSamplingTable(4, torch.device("cpu"))
    joined: list[int] = []
    for slot in order:
        table.assign(slot, settings[slot])
        joined.append(slot)
        table.advance(torch.tensor([s in joined for s in range(4)]))
    return table


def _flat_logits(rows: int) -> torch.Tensor:
    """The same gently sloped logits in every row (each token likely at temperature 1, id 63 the best)."""
    return torch.linspace(0.0, 2.0, VOCAB).repeat(rows, 1)


def _draw(table: SlotSamplingTable, steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` steps of every row: text ``[steps, B]`` and audio ``[steps, B, 2]`` (two codebooks, their
    noise drawn at once as the engine's depformer does), every row stepping each time."""
    logits = _flat_logits(table.slots)
    text, audio = [], []
    for _ in range(steps):
        text.append(table.sample_text(logits))
        noise = table.audio_noise(2, VOCAB)
        audio.append(torch.stack([table.sample_audio(logits, cb, noise[:, cb]) for cb in range(2)], dim=1))
        table.advance(torch.ones(table.slots, dtype=torch.bool))
    return torch.stack(text), torch.stack(audio)


def test_table_holds_every_field_of_every_joiners_own_settings() -> None:
    """Every field of every row after four joins (in the order 2, 0, 3, 1), and after a rejoin of slot 3:
    the row holds its own joiner's values, the others keep theirs, the rejoined row's step restarts.

    Planted bug: ``SlotSamplingTable.assign`` writes the seed into every row (every slot given the last
    joiner's seed) — this test fails on it. Planted bug: ``assign`` writes the text temperature into
    every row — this test fails on it."""
    table = _table(OWN_SETTINGS)

    def expect(settings: dict[int, SamplingParams], name: str) -> list:
        return [getattr(settings[slot], name) for slot in range(4)]

    for name in ("audio_temperature", "audio_top_k", "text_temperature", "text_top_k", "seed"):
        assert getattr(table, name).tolist() == expect(OWN_SETTINGS, name), name
    assert table.audio_temperature.dtype == table.text_temperature.dtype == torch.float32
    assert table.audio_top_k.dtype == table.text_top_k.dtype == table.seed.dtype == torch.int64
    assert table.step.tolist() == [3, 1, 4, 2]  # joined 2nd, 4th, 1st, 3rd; one step after each join
    assert table.audio_top_k_bound == 300 and table.text_top_k_bound == 64  # the largest asked for

    rejoined = {**OWN_SETTINGS, 3: SamplingParams(0.25, 11, 1.25, 5, seed=999)}
    table.assign(3, rejoined[3])
    for name in ("audio_temperature", "audio_top_k", "text_temperature", "text_top_k", "seed"):
        assert getattr(table, name).tolist() == expect(rejoined, name), name
    assert table.step.tolist() == [3, 1, 4, 0]
    assert table.audio_top_k_bound == 300  # bounds only grow: no device-to-host sync to shrink them


def test_each_row_samples_text_and_audio_with_its_own_temperature_and_top_k() -> None:
    """Four rows over the same logits, each with its own settings (``OWN_SETTINGS``): a greedy row always
    gives the argmax while a hot row spreads over many tokens, a top-k row stays within its k best; and
    every row's tokens equal what that row's own settings give it sampled alone (``sample_rows`` on one
    row, batch of one).

    Planted bug: ``SlotSamplingTable.sample_text`` samples every row with slot 0's text temperature — this
    test fails on it (slot 1's greedy text row is sampled hot). Planted bug: every slot given the last
    joiner's seed — this test fails on it (rows differ from their own seed's draws)."""
    text, audio = _draw(_table(OWN_SETTINGS))
    best = VOCAB - 1
    # Text: slot 0 hot over all 64, slot 1 greedy, slot 2 top-3, slot 3 at 0.75 over its top 60.
    assert len(set(text[:, 0].tolist())) >= 15
    assert set(text[:, 1].tolist()) == {best}
    assert set(text[:, 2].tolist()) <= {best, best - 1, best - 2} and len(set(text[:, 2].tolist())) > 1
    assert len(set(text[:, 3].tolist())) >= 10
    # Audio (both codebooks): slot 0 greedy, slot 1 hot, slot 2 top-2.
    assert set(audio[:, 0].flatten().tolist()) == {best}
    assert len(set(audio[:, 1].flatten().tolist())) >= 15
    assert set(audio[:, 2].flatten().tolist()) == {best, best - 1}

    # Each row alone, from its own settings only: same seed, same step counter (joined as in _table).
    logits = _flat_logits(1)
    start_step = {
        2: 4,
        0: 3,
        3: 2,
        1: 1,
    }  # steps stepped since its join (joined 1st to 4th) at the first draw
    for slot, params in OWN_SETTINGS.items():
        for step in range(STEPS):
            counters = (torch.tensor([params.seed]), torch.tensor([start_step[slot] + step]))
            alone_text = sample_rows(
                logits,
                torch.tensor([params.text_temperature]),
                torch.tensor([params.text_top_k]),
                *counters,
                0,
            )
            assert int(alone_text) == int(text[step, slot]), f"slot {slot} text at step {step}"
            for codebook in range(2):
                alone_audio = sample_rows(
                    logits,
                    torch.tensor([params.audio_temperature]),
                    torch.tensor([params.audio_top_k]),
                    *counters,
                    1 + codebook,
                )
                assert int(alone_audio) == int(audio[step, slot, codebook]), (
                    f"slot {slot} audio codebook {codebook} at step {step}"
                )


def test_rows_with_the_same_seed_draw_alike_and_other_seeds_differ() -> None:
    """Slots 0 and 2 share seed 5 and settings, slot 1 has seed 6, slot 3 (the last to join) seed 7; all
    join together, so their step counters agree. Same seed: the same text and audio tokens, step by
    step; different seeds: different tokens.

    Planted bug: ``SlotSamplingTable.assign`` writes the seed into every row (every slot given the last
    joiner's seed) — this test fails on it (slots 0 and 1 draw alike)."""
    seeds = {0: 5, 1: 6, 2: 5, 3: 7}
    settings = {slot: SamplingParams(1.0, 64, 1.0, 64, seed=seed) for slot, seed in seeds.items()}
    table = SlotSamplingTable(4, torch.device("cpu"))
    for slot in range(4):
        table.assign(slot, settings[slot])
    text, audio = _draw(table)
    assert torch.equal(text[:, 0], text[:, 2]) and torch.equal(audio[:, 0], audio[:, 2])
    for a, b in ((0, 1), (0, 3), (1, 3)):
        assert not torch.equal(text[:, a], text[:, b]), f"slots {a} and {b}: same text tokens"
        assert not torch.equal(audio[:, a], audio[:, b]), f"slots {a} and {b}: same audio tokens"


def test_a_rows_tokens_do_not_change_when_its_neighbours_settings_change() -> None:
    """Slots 2 and 3 keep their settings while slot 0 (the first row) and slot 1 (the last to join) change
    every field of theirs: slots 2 and 3 draw exactly the same text and audio tokens either way, and slots
    0 and 1 do not (the change was real).

    Planted bug: ``SlotSamplingTable.sample_text`` samples every row with slot 0's text temperature — this
    test fails on it. Planted bug: ``assign`` writes the seed into every row (every slot given the last
    joiner's seed) — this test fails on it."""
    changed = {
        **OWN_SETTINGS,
        0: SamplingParams(audio_temperature=1.25, audio_top_k=30, text_temperature=0.5, text_top_k=8, seed=7),
        1: SamplingParams(audio_temperature=0.5, audio_top_k=5, text_temperature=1.0, text_top_k=50, seed=8),
    }
    text, audio = _draw(_table(OWN_SETTINGS))
    text_changed, audio_changed = _draw(_table(changed))
    for slot in (2, 3):
        assert torch.equal(text[:, slot], text_changed[:, slot]), f"slot {slot}'s text changed"
        assert torch.equal(audio[:, slot], audio_changed[:, slot]), f"slot {slot}'s audio changed"
    for slot in (0, 1):
        assert not torch.equal(text[:, slot], text_changed[:, slot]), f"slot {slot}'s text did not change"
        assert not torch.equal(audio[:, slot], audio_changed[:, slot]), f"slot {slot}'s audio did not change"


ENGINE_TICKS = 12


def _engine_tokens(
    bundle: ModelBundle, settings: dict[int, SamplingParams], frames: np.ndarray
) -> dict[int, list[tuple[int, ...]]]:
    """A fresh 4-slot engine on a copy of ``bundle``; the slots of ``settings`` join in its order before
    the first tick, every row is fed the same ``frames``; each slot's (text, audio...) tokens, tick by
    tick."""
    engine = BatchEngine(copy.deepcopy(bundle), 4, clock=FakeClock())
    for slot, params in settings.items():
        engine.join(slot, params)
    tokens: dict[int, list[tuple[int, ...]]] = {slot: [] for slot in settings}
    for frame in frames:
        result = engine.tick(np.repeat(frame[None], 4, axis=0))
        for slot in settings:
            if result.text_tokens[slot] != UNGENERATED_TOKEN:
                tokens[slot].append((int(result.text_tokens[slot]), *map(int, result.audio_tokens[slot])))
    return tokens


def test_engine_rows_sample_with_their_own_seed_and_temperature() -> None:
    """The batch engine on the tiny model, every row fed the same audio: slot 3 greedy joins first, slots
    0 and 1 with seed 11, slot 2 (last to join) with seed 12, at the default temperatures. Slots 0 and 1
    give the same tokens, slot 2 others; slot 3 gives what it gives when every slot is greedy (its
    neighbours' temperatures and seeds do not reach it).

    Planted bug: every slot given the last joiner's seed (``SlotSamplingTable.assign`` writes every row's
    seed) — this test fails on it (slots 0 and 2 draw alike). Planted bug: slot 0's text temperature used
    for all rows (``SlotSamplingTable.sample_text``) — this test fails on it (slot 3's text is sampled)."""
    bundle = build_tiny(seed=0)
    frames = (np.random.default_rng(3).standard_normal((ENGINE_TICKS, 1920)) * 0.1).astype(np.float32)
    busy = _engine_tokens(
        bundle,
        {
            3: SamplingParams.greedy(),
            0: SamplingParams(seed=11),
            1: SamplingParams(seed=11),
            2: SamplingParams(seed=12),
        },
        frames,
    )
    # The reference: every slot greedy (a free row of the table keeps the default temperatures, so a greedy
    # slot alone would not show a row sampled with another row's temperature).
    all_greedy = _engine_tokens(bundle, {slot: SamplingParams.greedy() for slot in range(4)}, frames)
    assert all_greedy[0] == all_greedy[1] == all_greedy[2] == all_greedy[3]
    assert len(busy[0]) >= ENGINE_TICKS - 3
    assert busy[0] == busy[1], "the same seed and input gave different tokens"
    assert busy[0] != busy[2], "different seeds gave the same tokens"
    assert len({t[0] for t in busy[0]}) > 2  # really sampled, not a constant stream
    assert busy[3] == all_greedy[3], "the greedy slot's tokens depend on its neighbours' settings"
