"""Persona rollover benchmarks (``runtime.engine.rollover``; docs/benchmarks.md, "Persona rollover").

``python -m runtime.tools.rollover_bench tick``: the tick's wall time (p50, p99, max) with and without
rollovers, tiny model, every slot a session with a persona, the attention window shrunk to ``--context``
steps so that rollovers come every few seconds. The two runs alternate in blocks on the same engine copy
(the machine's drift hits both).

``python -m runtime.tools.rollover_bench soak --model sim --sessions 5 --minutes 60``: one session per slot
for the whole run, each with a persona, ticked in real time (80 ms); reports errors (ticks that raised),
ticks over 80 ms, rollovers, the largest persona age and the process's resident memory each minute (from
``/proc/self/statm``). With ``--model tiny`` (and ``--context``) the rollovers are real; the ``sim`` engine
does not roll over (it reports the age only). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from moshi.modules.transformer import set_attention_context

from runtime.engine.batch import BatchEngine, PromptStep
from runtime.engine.model_presets import FRAME_MS, FRAME_SAMPLES
from runtime.engine.models import build_tiny
from runtime.engine.rollover import RolloverEngine, RolloverPolicy
from runtime.engine.sampling import SamplingParams
from runtime.engine.sim import make_engine


def _persona(engine: BatchEngine, steps: int) -> list[PromptStep]:
    """``steps`` fully forced steps: the prompt's user frame, the agent's silence, text ids 10, 11, ..."""
    user, silence = engine.sine_codes.cpu(), engine.silence_codes.cpu()
    frames = user.shape[1]
    return [PromptStep(user[:, i % frames], 10 + i, silence[:, i % frames]) for i in range(steps)]


def _input(tick: int, slots: int, rng: np.random.Generator) -> np.ndarray:
    """Speech-level noise, each caller quiet 1 s in every 3 s (staggered by slot)."""
    pcm = (rng.standard_normal((slots, FRAME_SAMPLES)) * 0.1).astype(np.float32)
    for slot in range(slots):
        if (tick + 7 * slot) % 36 >= 24:
            pcm[slot] = 0.0
    return pcm


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tiny_engine(slots: int, context: int, policy: RolloverPolicy) -> RolloverEngine:
    bundle = build_tiny(seed=0)
    set_attention_context(bundle.lm.transformer, context)
    return RolloverEngine(bundle, slots, rollover=policy)


def bench_tick(slots: int, context: int, ticks: int, blocks: int, persona_steps: int) -> dict:
    """Tick figures with rollovers on and off, alternating ``blocks`` times (``ticks`` ticks each)."""
    figures: dict[str, list[float]] = {"on": [], "off": []}
    rollovers = 0
    engines = {
        "on": _tiny_engine(slots, context, RolloverPolicy()),
        "off": _tiny_engine(slots, context, RolloverPolicy(enabled=False)),
    }
    rng = np.random.default_rng(0)
    for engine in engines.values():
        engine.warm_up_prefill()
        for slot in range(slots):
            engine.join(slot, SamplingParams(seed=slot), _persona(engine, persona_steps))
        for t in range(10):
            engine.tick(_input(t, slots, rng))
    for block in range(blocks):
        for mode in ("on", "off") if block % 2 == 0 else ("off", "on"):
            engine = engines[mode]
            for t in range(ticks):
                result = engine.tick(_input(t, slots, rng))
                figures[mode].append(result.timings.total_ms)
                if mode == "on":
                    rollovers += result.timings.rollovers_at_pause + result.timings.rollovers_forced
    out: dict = {"slots": slots, "context": context, "persona_steps": persona_steps, "rollovers": rollovers}
    for mode, values in figures.items():
        array = np.array(values)
        out[mode] = {
            "ticks": len(values),
            "p50_ms": round(float(np.percentile(array, 50)), 2),
            "p99_ms": round(float(np.percentile(array, 99)), 2),
            "max_ms": round(float(array.max()), 2),
        }
    out["p99_ratio"] = round(out["on"]["p99_ms"] / out["off"]["p99_ms"], 3)
    return out


def soak(model: str, sessions: int, minutes: float, context: int | None, persona_steps: int) -> dict:
    """``sessions`` sessions with a persona for ``minutes``, in real time (module docstring)."""
    bundle = build_tiny(seed=0)
    if context is not None:
        set_attention_context(bundle.lm.transformer, context)
    engine = make_engine(model, bundle, sessions, "30")
    for slot in range(sessions):
        engine.join(slot, SamplingParams(seed=slot), _persona(engine, persona_steps))
    rng = np.random.default_rng(0)
    frames = [_input(t, sessions, rng) for t in range(36)]
    errors = over = rollovers = max_age = ticks = 0
    rss_mb: list[float] = [round(_rss_bytes() / 2**20, 1)]
    period = FRAME_MS / 1e3
    start = next_tick = time.monotonic()
    next_sample = start + 60.0
    while (now := time.monotonic()) < start + minutes * 60.0:
        try:
            timings = engine.tick(frames[ticks % len(frames)]).timings
            rollovers += timings.rollovers_at_pause + timings.rollovers_forced
            max_age = max(max_age, timings.persona_age_steps)
            over += timings.total_ms > FRAME_MS
        except Exception:  # counted and reported: a soak measures how often this happens
            errors += 1
        ticks += 1
        if now >= next_sample:
            rss_mb.append(round(_rss_bytes() / 2**20, 1))
            next_sample += 60.0
        next_tick += period
        time.sleep(max(0.0, next_tick - time.monotonic()))
    rss_mb.append(round(_rss_bytes() / 2**20, 1))
    return {
        "model": model,
        "sessions": sessions,
        "minutes": minutes,
        "context": context,
        "ticks": ticks,
        "errors": errors,
        "ticks_over_80ms": over,
        "rollovers": rollovers,
        "max_persona_age_steps": max_age,
        "rss_mb_per_minute": rss_mb,
    }


def main(argv: list[str] | None = None) -> None:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m runtime.tools.rollover_bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    tick = sub.add_parser("tick", help="tick p50/p99 with and without rollovers (tiny model)")
    tick.add_argument("--slots", type=int, default=5)
    tick.add_argument("--context", type=int, default=64, help="attention window in steps (tiny: 250)")
    tick.add_argument("--ticks", type=int, default=200, help="ticks per block")
    tick.add_argument("--blocks", type=int, default=4, help="blocks per mode, alternating")
    tick.add_argument("--persona-steps", type=int, default=12)
    run = sub.add_parser("soak", help="sessions for an hour in real time")
    run.add_argument("--model", choices=("sim", "tiny"), default="sim")
    run.add_argument("--sessions", type=int, default=5)
    run.add_argument("--minutes", type=float, default=60.0)
    run.add_argument("--context", type=int, default=None, help="tiny: shrink the window to make rollovers")
    run.add_argument("--persona-steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.command == "tick":
        result = bench_tick(args.slots, args.context, args.ticks, args.blocks, args.persona_steps)
    else:
        result = soak(args.model, args.sessions, args.minutes, args.context, args.persona_steps)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
