"""The GPU check: one command that measures the served model on a GPU lent for minutes (issue 30, item 12).

Run from a plain checkout on a machine with Python 3.12 and torch with CUDA (no moshi, no internet)::

    python -m runtime.tools.gpu_check --out DIR

It first installs what the runtime imports and the machine lacks (moshi 0.2.13 ``--no-deps``, bitsandbytes,
sentencepiece, ...) from wheels carried in ``wheels/`` (``make gpu-wheels`` downloads them on a machine with
internet; ``--requirements`` prints the pinned list), or says how. Then, on ONE random-weight model in the
served configuration (the preset with ``served_depformer_steps``: ``personaplex-7b`` with 8 depformer steps,
its 8 user codebooks reaching the LM, as ``duplex serve`` builds it), it measures:

- the ``BatchEngine`` tick at each ``--batch`` (default 1, 8, 32): with moshi's CUDA graphs (as served) and
  eagerly (moshi's ``no_cuda_graph()``, the switch ``NO_CUDA_GRAPH=1`` sets: ``CUDAGraphed`` reads it at
  every call, moshi/utils/compile.py, so both run on the same model, in this process); whether each graph
  was captured and replayed (``runtime.tools.cuda_graphs``);
- the largest B whose tick p99 fits the 80 ms frame (bisection between the measured sizes, doubling above
  them up to ``--max-batch``; a size that does not fit in memory counts as over);
- memory per slot: the bytes of the engine's streaming state per slot (KV caches, Mimi state, token cache:
  tensors walked, any device) and on CUDA the allocator's view (allocated per slot, peak of a tick);
  compare them with the planner's per-slot lines (``infra.capacity.memory.memory_plan``, docs/benchmarks.md);
- the persona prefill: one slot joining with a PersonaPlex-sized prompt (30 s voice, 100 text tokens,
  silences: 487 steps) while the other slots talk, ticks and wall time until it is live;
- then the same model in INT8 (moshi's LLM.int8 path, ``build_random(quantize="int8")``), after the bf16
  one is freed: its ticks and memory.

It writes one JSON (``DIR/gpu-check.json``). A wall-clock budget (``--budget-s``, default 330 s: under 6
minutes on an H100-class GPU with the install) is checked between phases; a phase that would not fit is
skipped and named in ``skipped``. ``--preset tiny --device cpu`` runs the same code in seconds (the tests).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "duplexops.gpu_check/1"
MOSHI_VERSION = "0.2.13"
"""moshi as the Makefile pins it (``MOSHI_VERSION``); ``--no-deps`` (its metadata pins torch<2.10)."""
NEEDED: tuple[tuple[str, str], ...] = (
    ("moshi", "moshi"),
    ("bitsandbytes", "bitsandbytes"),
    ("sentencepiece", "sentencepiece"),
    ("safetensors", "safetensors"),
    ("einops", "einops"),
    ("huggingface_hub", "huggingface_hub"),
    ("numpy", "numpy"),
    ("requests", "requests"),
    ("urllib3", "urllib3"),
    ("idna", "idna"),
    ("certifi", "certifi"),
    ("charset_normalizer", "charset-normalizer"),
    ("tqdm", "tqdm"),
    ("yaml", "PyYAML"),
    ("packaging", "packaging"),
    ("filelock", "filelock"),
    ("fsspec", "fsspec"),
)
"""(import name, distribution) of everything ``runtime.engine`` and moshi's model classes import beyond the
standard library and torch (found by importing ``runtime.engine.batch``/``models`` and
``moshi.models.lm``/``compression``/``loaders``/``utils.quantize`` in a clean process), with bitsandbytes
for INT8. Versions: ``requirements.lock``; moshi: :data:`MOSHI_VERSION`."""
FRAME_MS = 80.0
"""The tick budget: one frame (runtime.engine.model_presets.FRAME_MS; not imported: torch-free module)."""
PERSONA_STEPS = (375, 6, 100, 6)
"""A PersonaPlex-sized prompt: a 30 s voice (375 frames), 6 silence steps, 100 text tokens, 6 silence steps
(NVIDIA/personaplex ``lm.py``: voice, silence, ``<system>`` text, silence)."""


class SetupError(RuntimeError):
    """The machine lacks packages and no wheel provides them; the message says how to carry them."""


# --------------------------------------------------------------------------------------------------------
# Packages: install what is missing from carried wheels
# --------------------------------------------------------------------------------------------------------


def pinned_requirements(lock: Path = ROOT / "requirements.lock") -> list[str]:
    """``name==version`` of every :data:`NEEDED` distribution, versions from ``lock`` (moshi: its pin).

    Raises:
        SetupError: a distribution that ``lock`` does not pin (named)."""
    pins = {}
    for line in lock.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            pins[_normalise(name)] = version
    out = []
    for _module, dist in NEEDED:
        pinned = MOSHI_VERSION if dist == "moshi" else pins.get(_normalise(dist))
        if pinned is None:
            raise SetupError(f"{lock} pins no {dist}; allowed: a line '{dist}==<version>'")
        out.append(f"{dist}=={pinned}")
    return out


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def missing_modules(find_spec: Callable[[str], Any] = importlib.util.find_spec) -> list[tuple[str, str]]:
    """The (import name, distribution) pairs of :data:`NEEDED` that cannot be imported here."""
    return [(module, dist) for module, dist in NEEDED if find_spec(module) is None]


def _wheel_for(dist: str, wheels: Path) -> Path | None:
    """The newest-named wheel of ``dist`` in ``wheels`` (a wheel's name starts ``<dist>-<version>-``, with
    ``-`` and ``.`` of the distribution written ``_``, any case: PEP 427)."""
    name = _normalise(dist)
    found = sorted(p for p in wheels.glob("*.whl") if _normalise(p.name.split("-")[0]) == name)
    return found[-1] if found else None


def ensure_packages(
    wheels: Path,
    *,
    run: Callable[..., subprocess.CompletedProcess[Any]] = subprocess.run,
    find_spec: Callable[[str], Any] = importlib.util.find_spec,
) -> list[str]:
    """Install every missing :data:`NEEDED` package from ``wheels`` with ``pip install --no-deps`` (no index:
    the GPU machine has no internet). Returns the wheel file names installed (empty when nothing lacked).

    Raises:
        SetupError: a missing package with no wheel in ``wheels`` (the message names them and says how to
            fetch them), or pip failing (its output)."""
    missing = missing_modules(find_spec)
    if not missing:
        return []
    files, lacking = [], []
    for _module, dist in missing:
        wheel = _wheel_for(dist, wheels) if wheels.is_dir() else None
        (files.append(wheel) if wheel else lacking.append(dist))
    if lacking:
        raise SetupError(
            f"this machine lacks {', '.join(lacking)} and {wheels} has no wheel of them: on a machine with "
            "internet run `make gpu-wheels` (pip download of `python -m runtime.tools.gpu_check "
            "--requirements` for Python 3.12), copy wheels/ into the checkout, and run this again"
        )
    command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", *map(str, files)]
    result = run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SetupError(f"pip install from {wheels} failed: {result.stdout}{result.stderr}")
    importlib.invalidate_caches()
    return [f.name for f in files]


# --------------------------------------------------------------------------------------------------------
# The budget
# --------------------------------------------------------------------------------------------------------


@dataclass
class Budget:
    """A wall-clock budget (s) checked between phases; ``clock`` is injected by the tests."""

    total_s: float
    clock: Callable[[], float] = time.monotonic
    start: float = field(default=0.0)
    skipped: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def allows(self, phase: str, needs_s: float) -> bool:
        """True when ``needs_s`` more seconds fit; otherwise records ``phase`` as skipped and says why."""
        left = self.total_s - self.elapsed()
        if needs_s <= left:
            return True
        self.skipped.append({"phase": phase, "reason": f"needs ~{needs_s:.0f} s, {max(left, 0):.0f} s left"})
        return False


# --------------------------------------------------------------------------------------------------------
# Measurements (torch and the runtime imported here, after the install)
# --------------------------------------------------------------------------------------------------------


def _times(values: list[float]) -> dict[str, float | int]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "ticks": len(values),
        "p50_ms": round(statistics.median(values), 3),
        "p99_ms": round(p99, 3),
        "mean_ms": round(statistics.fmean(values), 3),
    }


def state_bytes(engine: Any) -> int:
    """Bytes of every tensor held by the engine's streaming states (LMGen, the LM, Mimi; KV rings, Mimi's
    buffers, the token cache), each storage counted once; moshi's CUDA graph buffers are not counted."""
    import torch
    from moshi.utils.compile import CUDAGraphed

    seen: set[int] = set()
    total = 0

    def walk(value: Any, depth: int) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            key = value.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += value.untyped_storage().nbytes()
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item, depth)
        elif (
            depth < 3 and hasattr(value, "__dict__") and not isinstance(value, CUDAGraphed | torch.nn.Module)
        ):
            for item in vars(value).values():
                walk(item, depth + 1)

    for module in (engine.lm_gen, engine.bundle.lm, engine.bundle.mimi):
        module._apply_named_streaming(lambda _name, m: walk(m._streaming_state, 0))
    return total


class Checker:
    """The phases of the check on one device; each returns a JSON-ready dict.

    Args:
        device: ``cuda`` or ``cpu``. ticks, eager_ticks, warmup: measured graphed ticks, eager ticks and
        warm-up ticks per size (warm-up: torch.compile on first use, a graph's capture on the second call).
    """

    def __init__(self, device: str, *, ticks: int, eager_ticks: int, warmup: int) -> None:
        import numpy as np
        import torch

        self.torch, self.np = torch, np
        self.device = device
        self.cuda = device.startswith("cuda")
        self.ticks, self.eager_ticks, self.warmup = ticks, eager_ticks, warmup
        self.rng = np.random.default_rng(0)

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def _allocated(self) -> int | None:
        return int(self.torch.cuda.memory_allocated()) if self.cuda else None

    def _run(self, step: Callable[[], object], count: int) -> list[float]:
        times = []
        for _ in range(count):
            start = time.perf_counter()
            step()
            self._sync()
            times.append((time.perf_counter() - start) * 1e3)
        return times

    def build(self, preset: str, quantize: str) -> tuple[Any, dict[str, Any]]:
        """The served model, random weights; with its build time and sizes."""
        from runtime.tools.bench import bench_bundle

        start = time.perf_counter()
        bundle = bench_bundle(preset, device=self.device, quantize=quantize)
        self._sync()
        lm = bundle.lm
        return bundle, {
            "quantize": quantize,
            "build_s": round(time.perf_counter() - start, 2),
            "depformer_steps": lm.dep_q,
            "user_codebooks": lm.num_codebooks - lm.dep_q - 1,
            "lm_parameter_bytes": bundle.lm_parameter_bytes(),
            "allocated_after_build_bytes": self._allocated(),
        }

    def measure(self, bundle: Any, batch: int, *, eager: bool = True) -> dict[str, Any]:
        """Tick times at ``batch`` live slots: eager first (no graph captured yet), then with graphs."""
        from moshi.utils.compile import no_cuda_graph

        from runtime.tools.bench import live_engine, release_engine
        from runtime.tools.cuda_graphs import GraphCounter, graph_summary

        pcm = (self.rng.standard_normal((batch, 1920)) * 0.05).astype(self.np.float32)
        before = self._allocated()
        try:
            engine = live_engine(bundle, batch)
        except BaseException:
            _end_streaming(bundle)
            raise
        try:
            after = self._allocated()
            out: dict[str, Any] = {"batch": batch, "state_bytes_per_slot": state_bytes(engine) // batch}
            if before is not None and after is not None:
                out["allocated_bytes_per_slot"] = (after - before) // batch
                self.torch.cuda.reset_peak_memory_stats()
            step = lambda: engine.tick(pcm)  # noqa: E731
            if eager and self.eager_ticks:
                with no_cuda_graph():
                    out["eager"] = _times(self._run(step, self.warmup + self.eager_ticks)[self.warmup :])
            with GraphCounter() as counter:
                out["graphed"] = _times(self._run(step, self.warmup + self.ticks)[self.warmup :])
            report = counter.report(engine)
            out["cuda_graphs"] = {"summary": graph_summary(report), "graphs": report}
            out["within_frame"] = out["graphed"]["p99_ms"] < FRAME_MS
            if before is not None:
                out["peak_tick_bytes"] = int(self.torch.cuda.max_memory_allocated()) - before
            return out
        finally:
            release_engine(engine)

    def fits(self, bundle: Any, batch: int) -> dict[str, Any]:
        """One probe of the search: the graphed tick at ``batch``, or ``out_of_memory``."""
        try:
            row = self.measure(bundle, batch, eager=False)
        except self.torch.cuda.OutOfMemoryError:
            self.torch.cuda.empty_cache()
            return {"batch": batch, "out_of_memory": True, "within_frame": False}
        return {"batch": batch, "p99_ms": row["graphed"]["p99_ms"], "within_frame": row["within_frame"]}

    def persona_prefill(self, bundle: Any, live: int) -> dict[str, Any]:
        """Ticks and wall time until one slot's PersonaPlex-sized prompt is done, ``live`` others talking."""
        from runtime.engine.batch import PromptStep
        from runtime.engine.sampling import SamplingParams
        from runtime.tools.bench import live_engine, release_engine

        engine = live_engine(bundle, live + 1)
        slot = live
        pcm = (self.rng.standard_normal((live + 1, 1920)) * 0.05).astype(self.np.float32)
        try:
            for _ in range(self.warmup):
                engine.tick(pcm)
            engine.leave(slot)
            engine.tick(pcm)
            voice, silence1, text, silence2 = PERSONA_STEPS
            generator = self.torch.Generator().manual_seed(0)
            card = bundle.lm.card
            voice_codes = self.torch.randint(0, card, (engine.dep_q, voice), generator=generator)
            silence = engine.silence_codes[: engine.dep_q]
            user = engine.sine_codes[: engine.user_codebooks]
            voice_codes = voice_codes.to(silence.device)
            steps = [PromptStep(user[:, i % user.shape[1]], 3, voice_codes[:, i]) for i in range(voice)]
            for n, token in ((silence1, 3), (text, None), (silence2, 3)):
                for i in range(n):
                    text_token = token if token is not None else 10 + i % 200  # within every text_card
                    frame = silence[:, i % silence.shape[1]]
                    steps.append(PromptStep(user[:, (len(steps)) % user.shape[1]], text_token, frame))
            self._sync()
            start = time.perf_counter()
            engine.join(slot, SamplingParams(seed=slot), steps)
            tick_ms: list[float] = []
            while engine.phase(slot).value == "prompting" and len(tick_ms) < 10 * len(steps):
                t0 = time.perf_counter()
                engine.tick(pcm)
                self._sync()
                tick_ms.append((time.perf_counter() - t0) * 1e3)
            return {
                "prompt_steps": len(steps),
                "live_slots": live,
                "ticks_to_live": len(tick_ms),
                "wall_ms": round((time.perf_counter() - start) * 1e3, 1),
                "tick_during_prefill": _times(tick_ms),
                "finished": engine.phase(slot).value == "live",
            }
        finally:
            release_engine(engine)

    def release_memory(self) -> None:
        """Collect what the last model left and give the allocator's cache back (between bf16 and INT8)."""
        import gc

        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


def _end_streaming(bundle: Any) -> None:
    """Drop whatever streaming state an engine that failed half-built left on the model's modules (an
    out-of-memory while its KV caches were allocated), so that the next engine can stream."""
    for module in (bundle.lm, bundle.mimi):
        module._stop_streaming()


def search_largest(
    probe: Callable[[int], dict[str, Any]],
    rows: list[dict[str, Any]],
    max_batch: int,
    budget: Budget,
    probe_s: float,
) -> dict[str, Any]:
    """The largest B whose graphed tick p99 fits the frame: from the measured ``rows``, doubling above the
    largest that fits (up to ``max_batch``), then bisecting between the last fit and the first miss."""
    results = {r["batch"]: r["within_frame"] for r in rows}
    probes: list[dict[str, Any]] = []

    def check(batch: int) -> bool | None:
        if batch in results:
            return results[batch]
        if not budget.allows(f"search B={batch}", probe_s):
            return None
        row = probe(batch)
        probes.append(row)
        results[batch] = row["within_frame"]
        return results[batch]

    fit = max((b for b, ok in results.items() if ok), default=0)
    miss = min((b for b, ok in results.items() if not ok and b > fit), default=None)
    bound = "frame"
    while miss is None and fit and fit < max_batch:
        candidate = min(2 * fit, max_batch)
        ok = check(candidate)
        if ok is None:
            bound = "budget"
            break
        if ok:
            fit = candidate
        else:
            miss = candidate
    if miss is None and fit >= max_batch:
        bound = "max_batch"
    while miss is not None and miss - fit > 1:
        middle = (fit + miss) // 2
        ok = check(middle)
        if ok is None:
            bound = "budget"
            break
        fit, miss = (middle, miss) if ok else (fit, middle)
    return {"batch": fit, "first_over": miss, "bound": bound, "probes": probes}


def environment() -> dict[str, Any]:
    """Versions and switches that decide what ran: torch, CUDA, the GPU, moshi, bitsandbytes, the C compiler
    Triton needs for moshi's compiled kernels, NO_TORCH_COMPILE / NO_CUDA_GRAPH."""
    import torch

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "c_compiler": shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc"),
        "no_torch_compile": os.environ.get("NO_TORCH_COMPILE", ""),
        "no_cuda_graph": os.environ.get("NO_CUDA_GRAPH", ""),
    }
    for name in ("moshi", "bitsandbytes"):
        try:
            out[name] = __import__(name).__version__
        except Exception as exc:  # an import error is a finding, not a crash
            out[name] = f"unavailable: {type(exc).__name__}: {exc}"
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        out["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return out


def run_check(args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    """Every phase in order, within ``budget``; the report (module docstring)."""
    report: dict[str, Any] = {"schema": SCHEMA, "preset": args.preset, "device": args.device}
    report["environment"] = environment()
    report["budget_s"] = budget.total_s
    report["errors"] = []
    checker = Checker(args.device, ticks=args.ticks, eager_ticks=args.eager_ticks, warmup=args.warmup)
    for quantize in ("none", "int8"):
        key = "bf16" if quantize == "none" else "int8"
        report[key] = None
        if quantize == "int8" and (args.no_int8 or not budget.allows("int8", args.int8_s)):
            continue
        try:
            bundle, built = checker.build(args.preset, quantize)
        except Exception as exc:
            report["errors"].append(f"{key} build: {type(exc).__name__}: {exc}")
            continue
        part: dict[str, Any] = {
            **built,
            "ticks": [],
            "largest_batch_within_frame": None,
            "persona_prefill": None,
        }
        report[key] = part
        sizes = args.batch if quantize == "none" else args.batch[:2]
        probe_s = 0.0
        for batch in sizes:
            start = time.perf_counter()
            if part["ticks"] and not budget.allows(f"{key} B={batch}", 2 * probe_s):
                continue
            try:
                part["ticks"].append(checker.measure(bundle, batch))
            except Exception as exc:
                report["errors"].append(f"{key} B={batch}: {type(exc).__name__}: {exc}")
                break
            probe_s = time.perf_counter() - start
        if quantize == "none" and part["ticks"]:
            part["largest_batch_within_frame"] = search_largest(
                functools.partial(checker.fits, bundle),
                part["ticks"],
                args.max_batch,
                budget,
                probe_s,
            )
            if budget.allows("persona prefill", args.persona_s):
                try:
                    part["persona_prefill"] = checker.persona_prefill(bundle, live=min(args.batch[-1], 7))
                except Exception as exc:
                    report["errors"].append(f"persona prefill: {type(exc).__name__}: {exc}")
        del bundle
        checker.release_memory()
    report["skipped"] = budget.skipped
    report["elapsed_s"] = round(budget.elapsed(), 1)
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.tools.gpu_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, help="Folder of gpu-check.json (created)")
    parser.add_argument("--preset", default="personaplex-7b", help="Model preset (tiny for a CPU dry run)")
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--batch", type=int, action="append", help="Batch sizes (repeat; default 1 8 32)")
    parser.add_argument("--max-batch", type=int, default=64, help="Upper bound of the search (slots)")
    parser.add_argument("--ticks", type=int, default=20, help="Measured ticks with CUDA graphs per size")
    parser.add_argument("--eager-ticks", type=int, default=8, help="Measured eager ticks per size (0: none)")
    parser.add_argument("--warmup", type=int, default=3, help="Warm-up ticks (compile; graph capture)")
    parser.add_argument(
        "--budget-s", type=float, default=330.0, help="Wall-clock budget (s), install included"
    )
    parser.add_argument("--int8-s", type=float, default=90.0, help="Time the INT8 phase needs (s)")
    parser.add_argument("--persona-s", type=float, default=30.0, help="Time the persona phase needs (s)")
    parser.add_argument("--no-int8", action="store_true", help="Skip the INT8 phase")
    parser.add_argument(
        "--wheels", type=Path, default=ROOT / "wheels", help="Carried wheels (make gpu-wheels)"
    )
    parser.add_argument("--requirements", action="store_true", help="Print the pinned packages and exit")
    args = parser.parse_args(argv)
    args.batch = args.batch or [1, 8, 32]
    if not args.requirements and args.out is None:
        parser.error("--out DIR is required (where gpu-check.json is written)")
    if min(args.batch) < 1 or args.max_batch < 1 or args.ticks < 1:
        parser.error("--batch, --max-batch and --ticks must be >= 1")
    return args


def main(argv: Sequence[str] | None = None, *, clock: Callable[[], float] = time.monotonic) -> int:
    """Install what lacks, run the check, write ``--out/gpu-check.json``. Exit status 0, or 2 when the
    packages could not be installed (the message says how)."""
    budget = Budget(0.0, clock)
    args = parse_args(argv)
    if args.requirements:
        print("\n".join(pinned_requirements()))
        return 0
    budget.total_s = args.budget_s
    try:
        installed = ensure_packages(args.wheels)
    except SetupError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    report = run_check(args, budget)
    report["installed_wheels"] = installed
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu-check.json"
    path.write_text(json.dumps(report, indent=2, sort_keys=True))
    print(
        f"gpu_check: wrote {path} in {report['elapsed_s']} s; skipped {len(report['skipped'])} phase(s), "
        f"{len(report['errors'])} error(s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
