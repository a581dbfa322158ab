"""The serving process's garbage-collector policy (runtime/gc_policy.py, ``DUPLEX_GC_THRESHOLDS``): parsed
and checked with clear errors, applied once the process has started (start-up objects frozen, thresholds
set), and ``default`` leaves Python's collector alone. Each test restores the interpreter's collector.

Planted bugs: ``tune_gc`` without ``gc.freeze()`` fails ``test_tune_gc_freezes_and_sets_the_thresholds``;
a validator that accepts any text fails ``test_bad_thresholds_are_refused_by_name``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from runtime.config import RuntimeConfig
from runtime.gc_policy import DEFAULT_GC_THRESHOLDS, parse_gc_thresholds, tune_gc


@pytest.fixture
def collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_parse_gives_three_integers_or_none_for_default() -> None:
    assert parse_gc_thresholds(DEFAULT_GC_THRESHOLDS) == (20_000, 50, 100)
    assert parse_gc_thresholds(" 5000, 20 ,3") == (5_000, 20, 3)
    assert parse_gc_thresholds("default") is None
    assert parse_gc_thresholds("DEFAULT") is None


@pytest.mark.parametrize(
    "text", ["", "20000", "20000,50", "a,b,c", "99,10,10", "700,0,10", "700,10,-1", "1,2,3,4"]
)
def test_bad_thresholds_are_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="gen0,gen1,gen2") as caught:
        parse_gc_thresholds(text)
    assert repr(text) in str(caught.value) and '"default"' in str(caught.value)
    with pytest.raises(ValidationError, match="gc_thresholds"):
        RuntimeConfig(gc_thresholds=text)


def test_the_config_default_is_the_policy_default() -> None:
    assert RuntimeConfig().gc_thresholds == DEFAULT_GC_THRESHOLDS


def test_tune_gc_freezes_and_sets_the_thresholds(collector: None) -> None:
    gc.unfreeze()
    made_at_start_up = [[object()] for _ in range(1_000)]  # tracked container objects
    tune_gc((12_345, 7, 3))
    assert gc.get_threshold() == (12_345, 7, 3)
    assert gc.get_freeze_count() >= len(made_at_start_up)
    assert gc.isenabled()


def test_default_leaves_the_collector_alone(collector: None) -> None:
    gc.unfreeze()
    before = gc.get_threshold()
    tune_gc(parse_gc_thresholds("default"))
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
