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
  so there the stock figure is B times the measured batch-1 tick of the one model (``stock(scaled)``).

- ``staggered`` (``stagger=True``): the same B-slot engine ticked as the runtime's two staggered sub-batch
  groups do (``DUPLEX_STAGGER_GROUPS=2``, ``runtime.engine.scheduler``): each tick steps half of the slots
  (even slots, then odd ones), the others frozen by the exec mask; its figure is one sub-tick, which must fit
  40 ms, and two of them serve the B sessions for one frame.

The model is built once (:func:`bench_bundle`: the served configuration, ``duplex serve``'s depformer steps,
so that the user's codebooks reach the LM) and every engine runs on it in turn, its streaming state released
before the next (:func:`release_engine`); only the CPU's stock design copies it (tiny sizes). On CUDA each
row says whether moshi's CUDA graphs were captured and replayed during its ticks
(``runtime.tools.cuda_graphs``).

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
from runtime.engine.model_presets import FRAME_MS, FRAME_SAMPLES, get_preset, served_depformer_steps
from runtime.engine.models import ModelBundle, build_random, build_tiny
from runtime.engine.sampling import SamplingParams
from runtime.tools.cuda_graphs import GraphCounter, graph_summary


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
    cuda_graphs_replayed: bool | None = None
    """Every CUDA graph called during the row's ticks was captured and replayed (None off CUDA)."""


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _row(
    design: str, batch: int, times_ms: list[float], groups: int = 1, graphs: bool | None = None
) -> BenchRow:
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
        graphs,
    )


def bench_bundle(model: str, device: str = "cpu", quantize: str = "none") -> ModelBundle:
    """The model the benchmark runs: ``tiny`` seeded, any other preset with random weights in the served
    configuration (``served_depformer_steps``: 8 for ``personaplex-7b``, whose checkpoints store 16, as
    ``duplex serve`` builds it), so that ``n_q - dep_q`` user codebooks reach the LM.

    Raises:
        ValueError: unknown preset. QuantizationError: ``int8`` where bitsandbytes cannot run."""
    if model == "tiny":
        return build_tiny(device=device, quantize=quantize)
    steps = served_depformer_steps(get_preset(model))
    return build_random(model, device=device, dep_q=steps, quantize=quantize)


def live_engine(bundle: ModelBundle, slots: int) -> BatchEngine:
    """A :class:`BatchEngine` of ``slots`` slots on ``bundle``, every slot joined (no prompt) and LIVE."""
    engine = BatchEngine(bundle, slots)
    for slot in range(slots):
        engine.join(slot, SamplingParams(seed=slot))
    return engine


def _exit_state(_name: str, module: torch.nn.Module) -> None:
    state = getattr(module, "_streaming_state", None)
    if state is not None:
        state.__exit__(None, None, None)


def release_engine(engine: BatchEngine) -> None:
    """End ``engine``'s streaming state (its LMGen with the LM's KV caches, and Mimi's), as leaving
    moshi's ``streaming()`` context does, so that another engine can stream on the same model; the CUDA
    memory is returned to the allocator's cache (``torch.cuda.empty_cache`` gives it back)."""
    for module in (engine.lm_gen, engine.bundle.mimi):
        # What leaving ``module.streaming()`` does: exit each state (LMGen's closes the LM's own streaming,
        # which it entered detached), then drop them.
        module._apply_named_streaming(_exit_state)
        module._stop_streaming()
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()


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
    bundle: ModelBundle,
    batch_sizes: list[int],
    *,
    ticks: int = 200,
    warmup: int = 10,
    stock: bool = True,
    stagger: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    """Measure batched and stock tick times for each B in ``batch_sizes``, all on ``bundle``.

    Args:
        bundle: the one model (:func:`bench_bundle`); each engine streams on it in turn.
        ticks: measured ticks per configuration (after ``warmup``).
        stock: also measure the stock design.
        stagger: also measure the staggered sub-tick (module docstring).
    Returns:
        One :class:`BenchRow` per (design, B).
    """
    rows: list[BenchRow] = []
    rng = np.random.default_rng(0)
    cuda = bundle.device.type == "cuda"

    def timed(
        engine: BatchEngine, step: Callable[[], object], design: str, groups: int = 1, scale: int = 1
    ) -> BenchRow:
        with GraphCounter() as counter:
            times = _time_ticks(step, ticks, warmup, cuda)
        graphs = graph_summary(counter.report(engine))["all_replayed"] if cuda else None
        return _row(design, batch, [t * scale for t in times], groups, graphs)

    for batch in batch_sizes:
        if progress:
            progress(f"batched B={batch}")
        pcm = (rng.standard_normal((batch, FRAME_SAMPLES)) * 0.05).astype(np.float32)
        engine = live_engine(bundle, batch)
        rows.append(timed(engine, partial(engine.tick, pcm), "batched"))
        if stagger:
            if progress:
                progress(f"staggered B={batch}")
            masks = itertools.cycle([np.arange(batch) % 2 == g for g in (0, 1)])

            def sub_tick(
                engine: BatchEngine = engine, x: np.ndarray = pcm, masks: Iterator[np.ndarray] = masks
            ) -> None:
                engine.tick(x, next(masks))

            rows.append(timed(engine, sub_tick, "staggered", groups=2))
        release_engine(engine)
        del engine
        if not stock:
            continue
        if progress:
            progress(f"stock B={batch}")
        if cuda:
            single = live_engine(bundle, 1)
            rows.append(timed(single, partial(single.tick, pcm[:1]), "stock(scaled)", scale=batch))
            release_engine(single)
            del single
        else:
            engines = [live_engine(copy.deepcopy(bundle), 1) for _ in range(batch)]

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
