"""The per-slot sampler: greedy, top-k, temperature, and draws that depend only on the slot's own counters."""

from __future__ import annotations

import pytest
import torch

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
