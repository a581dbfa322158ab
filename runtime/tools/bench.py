"""Tick benchmark: the batched engine at B sessions against the stock design (B batch-1 generators).

The stock Moshi/PersonaPlex server runs one conversation per process with a batch-1 generator; serving B
callers that way costs B batch-1 ticks per 80 ms frame. The batched engine serves them with one tick.

Per batch size B the benchmark runs, with every slot live and fed real-time-shaped input (noise at
speech level):
- ``batched``: one :class:`runtime.engine.batch.BatchEngine` with B slots; one full tick (Mimi encode, LM
step,
  Mimi decode) per frame.
- ``stock``: B independent batch-1 engines, each on its own model copy, stepped in turn, as B stock server
  processes would; one "tick" is the B steps together. On a GPU (real 7B size) the copies would not fit,
  so there the stock figure is B times the measured batch-1 tick (``stock_mode="scaled"``).

- ``staggered`` (``stagger=True``): the same B-slot engine ticked as the runtime's two staggered sub-batch
  groups do (``DUPLEX_STAGGER_GROUPS=2``, ``runtime.engine.scheduler``): each tick steps half of the slots
  (even slots, then odd ones), the others frozen by the exec mask; its figure is one sub-tick, which must fit
  40 ms, and two of them serve the B sessions for one frame.

Times are wall-clock on the CPU; on a GPU each tick ends with ``torch.cuda.synchronize`` (the engine
copies its outputs to the host every tick anyway). Warm-up ticks are excluded.
Reported: p50/p99 tick (ms), ``realtime_sessions`` = B x 80 ms / p50 (sessions one such loop could
serve in real time at that cost per tick), and the batched/stock throughput ratio.
"""

from __future__ import annotations

import copy
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
import torch

from runtime.engine.batch import BatchEngine
from runtime.engine.model_presets import FRAME_MS, FRAME_SAMPLES
from runtime.engine.models import ModelBundle
from runtime.engine.sampling import SamplingParams


@dataclass
class BenchRow:
    """One (design, B) measurement; times in ms."""

    design: str
    batch: int
    ticks: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    realtime_sessions: float
    within_budget: bool


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _row(design: str, batch: int, times_ms: list[float], groups: int = 1) -> BenchRow:
    """``groups``: ticks per frame (2 for staggered sub-ticks, each of which must fit 80 / 2 ms)."""
    p50 = statistics.median(times_ms)
    p99 = _percentile(times_ms, 99)
    return BenchRow(
        design,
        batch,
        len(times_ms),
        p50,
        p99,
        statistics.fmean(times_ms),
        batch * FRAME_MS / (groups * p50),
        p99 < FRAME_MS / groups,
    )


def _live_engine(bundle: ModelBundle, slots: int) -> BatchEngine:
    engine = BatchEngine(bundle, slots)
    for slot in range(slots):
        engine.join(slot, SamplingParams(seed=slot))
    return engine


def _time_ticks(step: Callable[[], object], ticks: int, warmup: int, cuda: bool) -> list[float]:
    times: list[float] = []
    for i in range(warmup + ticks):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def run_benchmark(
    make_bundle: Callable[[], ModelBundle],
    batch_sizes: list[int],
    *,
    ticks: int = 200,
    warmup: int = 10,
    stock: bool = True,
    stagger: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    """Measure batched and stock tick times for each B in ``batch_sizes``.

    Args:
        make_bundle: builds a fresh model bundle (each engine needs its own streaming state).
        ticks: measured ticks per configuration (after ``warmup``).
        stock: also measure the stock design.
        stagger: also measure the staggered sub-tick (module docstring).
    Returns:
        One :class:`BenchRow` per (design, B).
    """
    rows: list[BenchRow] = []
    rng = np.random.default_rng(0)
    base = make_bundle()
    cuda = base.device.type == "cuda"
    for batch in batch_sizes:
        if progress:
            progress(f"batched B={batch}")
        pcm = (rng.standard_normal((batch, FRAME_SAMPLES)) * 0.05).astype(np.float32)
        engine = _live_engine(copy.deepcopy(base) if not cuda else make_bundle(), batch)
        rows.append(_row("batched", batch, _time_ticks(partial(engine.tick, pcm), ticks, warmup, cuda)))
        if stagger:
            if progress:
                progress(f"staggered B={batch}")
            masks = itertools.cycle([np.arange(batch) % 2 == g for g in (0, 1)])

            def sub_tick(
                engine: BatchEngine = engine, x: np.ndarray = pcm, masks: Iterator[np.ndarray] = masks
            ) -> None:
                engine.tick(x, next(masks))

            rows.append(_row("staggered", batch, _time_ticks(sub_tick, ticks, warmup, cuda), groups=2))
        del engine
        if not stock:
            continue
        if progress:
            progress(f"stock B={batch}")
        if cuda:
            single = _live_engine(make_bundle(), 1)
            one = _time_ticks(partial(single.tick, pcm[:1]), ticks, warmup, cuda)
            rows.append(_row("stock(scaled)", batch, [t * batch for t in one]))
            del single
        else:
            engines = [_live_engine(copy.deepcopy(base), 1) for _ in range(batch)]

            def step_in_turn(engines: list[BatchEngine] = engines, x: np.ndarray = pcm) -> None:
                for i, engine in enumerate(engines):
                    engine.tick(x[i : i + 1])

            rows.append(_row("stock", batch, _time_ticks(step_in_turn, ticks, warmup, cuda)))
            del engines
    return rows


def speedups(rows: list[BenchRow]) -> dict[int, float]:
    """Batched throughput / stock throughput per B (= stock p50 / batched p50)."""
    batched = {r.batch: r for r in rows if r.design == "batched"}
    stock = {r.batch: r for r in rows if r.design.startswith("stock")}
    return {b: stock[b].p50_ms / batched[b].p50_ms for b in batched if b in stock}


def rows_as_dicts(rows: list[BenchRow]) -> list[dict[str, object]]:
    return [asdict(r) for r in rows]
