"""Tests that kill mutants of runtime/engine/sampling.py (per-slot sampling) that test_sampling.py lets
survive or kills only through its slow engine tests (``make mutation MODULE=runtime/engine/sampling.py``;
docs/mutation.md). Each docstring names the mutants it kills. Fast: no model.

The counter hash is checked against an independent pure-Python version of Murmur3's 32-bit finaliser and
of the docstring's formula: a changed constant keeps the draws uniform (the statistical tests pass) but
changes every seeded session's tokens."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.engine.sampling import (
    SamplingParams,
    SlotSamplingTable,
    _mix32,
    counter_uniform,
    gumbel_noise,
    sample_rows,
)

M = 0xFFFFFFFF


def fmix32(x: int) -> int:
    """Murmur3's fmix32 (Appleby, MurmurHash3.cpp), on Python ints."""
    x &= M
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M
    return x ^ (x >> 16)


def uniform_ref(seed: int, step: int, stream: int, token: int) -> float:
    row = fmix32(seed * 0x9E3779B1 + 0x7F4A7C15)
    row = fmix32(row ^ (step * 0x85EBCA77 + stream * 0xC2B2AE3D))
    x = fmix32(row ^ (token * 0x27D4EB2F + 0x165667B1))
    # float32 arithmetic as the sampler's (x >> 8 < 2**24 is exact; + 0.5 rounds as float32 does)
    return float((torch.tensor(float(x >> 8), dtype=torch.float32) + 0.5) / float(1 << 24))


def test_mix32_is_murmur3s_finaliser():
    """Kills ``_mix32``: each shift (16, 13, 16), multiplier, mask and ``^`` changed. fmix32(0) = 0 and
    fmix32(1) = 0x514E28B7 (Murmur3's finaliser); values above 32 bits are masked first."""
    values = [0, 1, 2, 0x12345678, 0xFFFFFFFF, 0xDEADBEEF, (1 << 40) + 5]
    assert _mix32(torch.tensor(values, dtype=torch.int64)).tolist() == [fmix32(v) for v in values]
    assert fmix32(1) == 0x514E28B7 and fmix32(0) == 0


def test_counter_uniform_is_the_documented_hash():
    """Kills ``counter_uniform``: each constant of the three mixing rounds, ``seed`` / ``step`` /
    ``stream`` / token id swapped or dropped, ``>> 8``, ``+ 0.5``, ``1 << 24``; shapes ``[B, V]`` for an
    int stream and ``[B, S, V]`` for a tensor of streams (``isinstance`` negated, ``[:, 0]``)."""
    seed = torch.tensor([0, 7, 2**31 - 1], dtype=torch.int64)
    step = torch.tensor([0, 3, 1000], dtype=torch.int64)
    u = counter_uniform(seed, step, 2, 5)
    assert u.shape == (3, 5) and u.dtype == torch.float32
    expected = [
        [uniform_ref(int(s), int(t), 2, v) for v in range(5)] for s, t in zip(seed, step, strict=True)
    ]
    assert u.tolist() == expected
    many = counter_uniform(seed, step, torch.tensor([0, 4]), 3)
    assert many.shape == (3, 2, 3)
    for b in range(3):
        for i, stream in enumerate((0, 4)):
            assert many[b, i].tolist() == [
                uniform_ref(int(seed[b]), int(step[b]), stream, v) for v in range(3)
            ]


def test_gumbel_noise_by_hand():
    """Kills ``gumbel_noise``: a sign or a ``log`` dropped. -log(-log(e^-1)) = 0; -log(-log(e^-e^-2)) = 2."""
    u = torch.tensor([math.exp(-1.0), math.exp(-math.exp(-2.0))], dtype=torch.float64)
    assert gumbel_noise(u).tolist() == pytest.approx([0.0, 2.0], abs=1e-9)


def test_sample_rows_with_given_noise_by_hand():
    """Kills ``sample_rows``: the temperature scaling (``/`` -> ``*``), greedy rows (``temperature > 0``
    -> ``>= 0`` or ``> 1``, the greedy argmax), top-k (``k - 1``, ``logits < threshold`` -> ``<=``: the
    k-th candidate kept), ``(scaled + gumbel)`` -> ``-``. Rows: logits [3, 2, 1, 0]."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 4)
    noise = torch.tensor(
        [[0.0, 1.5, 0.0, 0.0], [0.0, 1.5, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0], [0.0, 0.0, 0.0, 9.0]]
    )
    temperature = torch.tensor([1.0, 0.0, 1.0, 0.5])
    top_k = torch.tensor([4, 4, 2, 4])
    seed = step = torch.zeros(4, dtype=torch.int64)
    # row 0: 3 vs 2 + 1.5 -> 1; row 1: greedy -> 0; row 2: token 2 is outside the top 2 -> 0 (3 > 2)
    # row 3: scaled [6, 4, 2, 0] + [0, 0, 0, 9] -> 3
    assert sample_rows(logits, temperature, top_k, seed, step, 0, gumbel=noise).tolist() == [1, 0, 0, 3]
    # top-k 2 keeps the 2nd best: 2 + 1.5 beats 3
    assert sample_rows(
        logits[:1], torch.tensor([1.0]), torch.tensor([2]), seed[:1], step[:1], 0, gumbel=noise[:1]
    ).tolist() == [1]
    # temperature 2: scaled [1.5, 1, .5, 0] + noise [0, 0.6, 0, 0] -> 1 (at temperature 1 it would be 0)
    half = torch.tensor([[0.0, 0.6, 0.0, 0.0]])
    t2 = sample_rows(logits[:1], torch.tensor([2.0]), torch.tensor([4]), seed[:1], step[:1], 0, gumbel=half)
    t1 = sample_rows(logits[:1], torch.tensor([1.0]), torch.tensor([4]), seed[:1], step[:1], 0, gumbel=half)
    assert (t2.tolist(), t1.tolist()) == ([1], [0])
    # a small positive temperature samples (not greedy)
    small = sample_rows(
        logits[:1], torch.tensor([0.5]), torch.tensor([4]), seed[:1], step[:1], 0, gumbel=noise[3:]
    )
    assert small.tolist() == [3]


def test_sample_rows_top_k_is_clamped_to_the_vocabulary_and_the_bound():
    """Kills ``k = top_k.clamp(1, vocab)`` (bounds moved), ``bound = vocab if top_k_bound is None``
    (``is not None``), ``max(1, min(vocab, top_k_bound))`` (``max(2, ...)``, ``min`` -> ``max``) and
    ``k.clamp(max=bound)``."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    noise = torch.tensor([[0.0, 0.0, 0.0, 9.0]])  # only the 4th token, if kept, wins
    one = torch.ones(1)
    zero = torch.zeros(1, dtype=torch.int64)

    def draw(k: int, bound: int | None) -> int:
        return int(sample_rows(logits, one, torch.tensor([k]), zero, zero, 0, bound, noise)[0])

    assert draw(100, None) == 3  # k clamped to V = 4: every token kept
    assert draw(0, None) == 0  # k clamped up to 1: the best only
    assert draw(4, 3) == 0  # the bound keeps three: the 4th is out
    assert draw(4, 100) == 3  # a bound above V is V
    assert draw(4, 0) == 0  # a bound below 1 is 1
    assert draw(3, 4) == 0 and draw(4, 4) == 3


def test_sample_rows_draws_its_own_noise_from_the_stream():
    """Kills ``if gumbel is None`` negated and ``counter_uniform(seed, step, stream, vocab)`` with an
    argument changed: without noise given, the draw is the one with the stream's own noise."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    temperature = torch.ones(3)
    top_k = torch.full((3,), 50)
    seed = torch.tensor([1, 2, 3])
    step = torch.tensor([4, 5, 6])
    for stream in (0, 3):
        noise = gumbel_noise(counter_uniform(seed, step, stream, 50))
        mine = sample_rows(logits, temperature, top_k, seed, step, stream)
        assert torch.equal(mine, sample_rows(logits, temperature, top_k, seed, step, stream, gumbel=noise))
    assert not torch.equal(
        sample_rows(logits, temperature, top_k, seed, step, 0),
        sample_rows(logits, temperature, top_k, seed, step, 3),
    )


def test_table_defaults():
    """Kills ``SlotSamplingTable.__init__``: each default (audio 0.8 / 250, text 0.7 / 25, seed and step
    0), dtypes and the host bounds (250, 25)."""
    t = SlotSamplingTable(2, torch.device("cpu"))
    assert t.slots == 2
    assert t.audio_temperature.tolist() == pytest.approx([0.8, 0.8])
    assert t.text_temperature.tolist() == pytest.approx([0.7, 0.7])
    assert t.audio_top_k.tolist() == [250, 250] and t.audio_top_k.dtype == torch.int64
    assert t.text_top_k.tolist() == [25, 25] and t.text_top_k.dtype == torch.int64
    assert (
        t.seed.tolist() == [0, 0]
        and t.step.tolist() == [0, 0]
        and t.seed.dtype == t.step.dtype == torch.int64
    )
    assert (t.audio_top_k_bound, t.text_top_k_bound) == (250, 25)


def test_table_assign_advance_and_bounds():
    """Kills ``assign`` (each field written to another field or slot, ``step = 0`` -> 1, the bounds'
    ``max`` -> ``min``) and ``advance`` (``+=`` -> ``=``/``-=``, the rows counted)."""
    t = SlotSamplingTable(3, torch.device("cpu"))
    t.advance(torch.tensor([True, True, False]))
    t.advance(torch.tensor([True, False, False]))
    assert t.step.tolist() == [2, 1, 0]
    t.assign(
        0, SamplingParams(audio_temperature=0.1, audio_top_k=300, text_temperature=0.2, text_top_k=7, seed=9)
    )
    assert t.step.tolist() == [0, 1, 0] and t.seed.tolist() == [9, 0, 0]
    assert t.audio_temperature.tolist() == pytest.approx([0.1, 0.8, 0.8])
    assert t.text_temperature.tolist() == pytest.approx([0.2, 0.7, 0.7])
    assert t.audio_top_k.tolist() == [300, 250, 250] and t.text_top_k.tolist() == [7, 25, 25]
    assert (t.audio_top_k_bound, t.text_top_k_bound) == (300, 25)
    t.assign(1, SamplingParams(audio_top_k=10, text_top_k=40))
    assert (t.audio_top_k_bound, t.text_top_k_bound) == (300, 40)


def test_table_sample_text_and_audio_read_their_own_settings_and_streams():
    """Kills ``sample_text`` (stream 0, the text fields and bound swapped for the audio ones) and
    ``sample_audio`` (stream ``1 + codebook``, the audio fields, the bound, ``gumbel`` not passed on), and
    ``audio_noise`` (streams ``1..codebooks``: ``arange(1, codebooks + 1)`` moved)."""
    t = SlotSamplingTable(2, torch.device("cpu"))
    t.assign(
        0, SamplingParams(seed=5, text_temperature=1.0, text_top_k=30, audio_temperature=0.5, audio_top_k=3)
    )
    t.assign(
        1, SamplingParams(seed=6, text_temperature=0.0, text_top_k=1, audio_temperature=2.0, audio_top_k=40)
    )
    t.advance(torch.tensor([True, True]))
    torch.manual_seed(1)
    logits = torch.randn(2, 60)
    text = sample_rows(logits, t.text_temperature, t.text_top_k, t.seed, t.step, 0, t.text_top_k_bound)
    assert torch.equal(t.sample_text(logits), text)
    noise = t.audio_noise(3, 60)
    assert noise.shape == (2, 3, 60)
    for codebook in range(3):
        own = gumbel_noise(counter_uniform(t.seed, t.step, 1 + codebook, 60))
        assert torch.equal(noise[:, codebook], own)
        audio = sample_rows(
            logits, t.audio_temperature, t.audio_top_k, t.seed, t.step, 1 + codebook, 250, own
        )
        assert torch.equal(t.sample_audio(logits, codebook), audio)
        assert torch.equal(t.sample_audio(logits, codebook, noise[:, codebook]), audio)
    assert t.audio_top_k_bound == 250
    logits[1, 59] = logits[1].max() - 0.01  # the second best of row 1: a candidate, not the greedy pick
    fixed = torch.zeros(2, 60)
    fixed[:, 59] = 1e6  # this noise picks the last token wherever it is a candidate
    assert t.sample_audio(logits, 0, fixed).tolist()[1] == 59
    assert t.sample_audio(logits, 0).tolist()[1] != 59


def test_draws_and_the_table_stay_on_the_models_device():
    """Kills the device dropped (``device=None`` or left out) in ``counter_uniform`` (``device =
    seed.device``), ``SlotSamplingTable.__init__`` and ``audio_noise``: on a GPU those tensors would sit on
    the CPU beside a CUDA model. PyTorch's ``meta`` device stands in for the GPU: every tensor made here
    must be on the device it was given."""
    meta = torch.device("meta")
    seed = torch.zeros(2, dtype=torch.int64, device=meta)
    assert counter_uniform(seed, seed, 0, 5).device == meta
    table = SlotSamplingTable(2, meta)
    fields = ("audio_temperature", "audio_top_k", "text_temperature", "text_top_k", "seed", "step")
    assert {name: getattr(table, name).device for name in fields} == dict.fromkeys(fields, meta)
    assert table.audio_noise(3, 7).device == meta


def test_a_temperature_below_one_sharpens_and_a_bound_of_one_keeps_the_best():
    """Kills ``sample_rows``' ``temperature > 0`` -> ``> 1`` in ``safe_temperature`` (a temperature of 0.5
    read as 1) and ``max(1, min(vocab, top_k_bound))`` -> ``max(2, ...)`` (a bound of 1 keeping two)."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    noise = torch.tensor([[0.0, 1.5, 0.0, 0.0]])
    zero = torch.zeros(1, dtype=torch.int64)
    # T = 0.5: [6, 4, 2, 0] + noise -> 0 (at T = 1: [3, 3.5, ...] -> 1)
    assert sample_rows(
        logits, torch.tensor([0.5]), torch.tensor([4]), zero, zero, 0, gumbel=noise
    ).tolist() == [0]
    # a bound of 1: the best token only, whatever the noise favours
    assert sample_rows(logits, torch.ones(1), torch.tensor([4]), zero, zero, 0, 1, noise).tolist() == [0]
