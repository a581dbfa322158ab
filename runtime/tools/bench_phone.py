"""The latency the Twilio bridge adds over the PCM WebSocket path (issue 32, "Measure and report"), per frame,
on one machine, against a real node on loopback.

One ``duplex serve --model sim`` (``runtime.tools.bench_frontend.node``: one process, ``--workers 0``, the
sim's fixed step time, access control off, the Twilio bridge on with a stand-in auth token) serves at the
same time ``S`` PCM WebSocket sessions (``runtime.tools.loadgen``) and ``S`` Twilio calls
(``runtime.tools.carrier_client``: Twilio's side of a Media Stream, 8 kHz μ-law, 20 ms packets), all of
speech at real-time pace. Every session sits in the same batch, so every tick emits one 80 ms frame to each
of them at once: the WebSocket clients' arrivals of a tick are the reference (their median), and a call's
frame arrives when its ``mark`` does (the bridge sends a frame's four 20 ms ``media`` packets, then its
``mark``: runtime/frontend/transports/carriers/twilio.py). Per call frame, the bridge's added latency is
its mark's arrival minus the median WebSocket arrival of the same tick (:func:`added_latency_ms`): the
24 -> 8 kHz resample, μ-law, base64 and JSON of four packets, and their sends. The WebSocket arrivals
against their own median give the noise floor (the spread of one tick's sends).

The caller -> engine direction is not split here (the bridge's 20 ms packets joined into 80 ms frames:
docs/benchmarks.md, "Phone calls").

``first-audio``: first audio on a call, term by term (:func:`bench_first_audio`): calls one after another
on an idle sim node, from Twilio's ``start`` to the first agent frame the carrier receives (its first
``mark``), split with the runtime's own first-audio histograms (``duplex_first_audio_*``, read from
``/metrics`` before and after) into the caller's pacing, the runtime's terms (ingress, phase wait, ticks,
tick compute, egress: the bridge's resample and μ-law included) and what is left (the gate, admission,
the persona prompt, the hops), with and without a persona text prompt.

``python -m runtime.tools.bench_phone latency --sessions 4 --seconds 20`` and
``python -m runtime.tools.bench_phone first-audio --calls 10``; figures are written down
(docs/benchmarks.md), not asserted. The machine's other load shows in them; report its core count beside
them.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
from collections.abc import Sequence

import numpy as np

from runtime.tools.bench_frontend import _get, node
from runtime.tools.carrier_client import CallResult, carrier_call
from runtime.tools.carrier_sides import TwilioSide
from runtime.tools.loadgen import (
    FIRST_AUDIO_TERMS,
    first_audio_budget,
    parse_histograms,
    run_load,
    session_url,
    synthesize_speech,
)
from runtime.tools.loadgen_phone import phone_speech

__all__ = [
    "added_latency_ms",
    "bench_bridge_latency",
    "bench_first_audio",
    "first_audio_terms",
    "tick_groups",
]

FRAME_S = 0.08
"""One model frame, one tick (s): Mimi's 12.5 Hz frame rate (runtime.engine.model_presets)."""

AUTH_TOKEN = "bench-twilio-auth-token"
"""The stand-in Twilio auth token the bench node checks signatures with (no real account)."""

STREAM_URL = "wss://bench.invalid/api/carriers/twilio"
"""The stream URL the signature covers (what a TwiML ``<Stream url=...>`` would name)."""


def tick_groups(arrivals: Sequence[float], frame_s: float = FRAME_S) -> tuple[list[float], list[float]]:
    """Group arrival times (s, any order) into ticks: a new tick starts where consecutive arrivals are more
    than ``frame_s / 2`` apart. Returns ``(starts, medians)``: each tick's first and median arrival (s).

    Raises:
        ValueError: ``frame_s`` <= 0.
    """
    if frame_s <= 0:
        raise ValueError(f"frame_s must be > 0, got {frame_s}")
    times = sorted(arrivals)
    starts: list[float] = []
    medians: list[float] = []
    group: list[float] = []
    for t in times:
        if group and t - group[-1] > frame_s / 2:
            starts.append(group[0])
            medians.append(float(np.median(group)))
            group = []
        group.append(t)
    if group:
        starts.append(group[0])
        medians.append(float(np.median(group)))
    return starts, medians


def added_latency_ms(
    reference: Sequence[float], bridged: Sequence[float], frame_s: float = FRAME_S
) -> list[float]:
    """Per bridged frame arrival (s), its delay (ms) over the median reference arrival of its tick: the
    last tick (:func:`tick_groups` of ``reference``) that began at most ``frame_s`` before it. Arrivals with
    no such tick (before the reference sessions started, after they ended, or in a tick none of them got a
    frame of) are left out. Valid while the added delay stays under one frame (``frame_s``): a larger one
    would be taken for the next tick's or left out (the caller compares the count with the frames).

    An arrival more than half a frame after its tick began counts only when the reference has the next
    tick (within 1.5 frames): past the reference's last tick, or where it missed one, it is as likely the
    next tick's own frame, which a match to the earlier tick would charge with a whole frame (about 80 ms).
    Those are left out."""
    starts, medians = tick_groups(reference, frame_s)
    delays: list[float] = []
    for t in bridged:
        i = bisect.bisect_right(starts, t) - 1
        if i < 0 or t - starts[i] >= frame_s:
            continue
        next_tick_seen = i + 1 < len(starts) and starts[i + 1] - starts[i] < 1.5 * frame_s
        if t - starts[i] > frame_s / 2 and not next_tick_seen:
            continue
        delays.append((t - medians[i]) * 1e3)
    return delays


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    array = np.asarray(values, dtype=np.float64)
    return {
        "p50": round(float(np.percentile(array, 50)), 2),
        "p99": round(float(np.percentile(array, 99)), 2),
        "max": round(float(array.max()), 2),
    }


def bench_bridge_latency(sessions: int, step_ms: str, seconds: float) -> dict[str, object]:
    """``sessions`` PCM WebSocket sessions and as many Twilio calls at once on one sim node, ``seconds`` of
    speech each; the Twilio frames' added latency p50/p99/max (ms) and the WebSocket noise floor.

    Raises:
        ValueError: ``sessions`` < 1 or ``seconds`` <= 0.
        RuntimeError: the node did not start (its log named).
    """
    if sessions < 1 or seconds <= 0:
        raise ValueError(f"sessions must be >= 1 and seconds > 0, got {sessions} and {seconds}")
    clip = synthesize_speech(
        "Hello, I would like to book a table for two tonight at eight, near the river if possible, "
        "and tell me about the weather tomorrow morning in Paris and the trains back home."
    )
    while len(clip) < seconds * 24000:
        clip = np.concatenate([clip, clip])
    clip = clip[: int(seconds * 24000)]
    env = {"DUPLEX_TWILIO_AUTH_TOKEN": AUTH_TOKEN, "DUPLEX_TWILIO_STREAM_URL": STREAM_URL}

    async def both(port: int) -> tuple[list[list[float]], list[CallResult]]:
        base = f"ws://127.0.0.1:{port}"
        load = asyncio.create_task(
            run_load(session_url(base), [clip], sessions=sessions, max_duration_s=seconds + 60)
        )
        calls = [
            carrier_call(
                TwilioSide(), base, phone_speech(clip), secret=AUTH_TOKEN, stream_url=STREAM_URL, tail_s=0.3
            )
            for _ in range(sessions)
        ]
        results = await asyncio.gather(*calls)
        report = await load
        return [r.audio_arrival_s for r in report.served], list(results)

    with node(0, 2 * sessions, step_ms, env=env) as port:
        websocket, calls = asyncio.run(both(port))
    reference = [t for arrivals in websocket for t in arrivals]
    added = [d for call in calls for d in added_latency_ms(reference, call.mark_arrival_s)]
    floor = added_latency_ms(reference, reference)
    return {
        "sessions": sessions,
        "step_ms": step_ms,
        "seconds": seconds,
        "websocket_served": len(websocket),
        "calls_served": sum(1 for c in calls if not c.failure and c.marks > 0),
        "call_failures": [c.failure for c in calls if c.failure],
        "call_frames": sum(len(call.mark_arrival_s) for call in calls),
        "frames_compared": len(added),
        "twilio_added_ms": _percentiles(added),
        "websocket_noise_floor_ms": _percentiles(floor),
        "host_cores": os.cpu_count(),
    }


CALLER_PACING_MS = 60.0
"""When the caller's first 80 ms frame is complete (ms after its first packet): Twilio sends 20 ms
``media`` packets in real time, and the fourth goes 60 ms after the first (runtime/tools/carrier_client.py
paces them so)."""


def first_audio_terms(
    call_ms: Sequence[float], pacing_ms: Sequence[float], budget: dict[str, float | None]
) -> dict[str, float | None]:
    """A call's first audio (ms, ``start`` -> first agent frame at the carrier), term by term: the mean of
    ``call_ms``, the caller's pacing (mean of ``pacing_ms``), the runtime's terms (``budget``:
    :func:`runtime.tools.loadgen.first_audio_budget` means, the tick count as 80 ms each), and what is
    left: the gate, the admission, the persona prompt and the hops both ways
    (``admission_and_hops_ms_mean``). None where a figure is missing."""

    def mean(values: Sequence[float]) -> float | None:
        return round(float(np.mean(values)), 2) if len(values) else None

    call, pacing, runtime = mean(call_ms), mean(pacing_ms), budget.get("total_ms_mean")
    ticks = budget.get("ticks_mean")
    left = None if None in (call, pacing, runtime) else round(call - pacing - runtime, 2)  # type: ignore[operator]
    return {
        "call_first_audio_ms_mean": call,
        "caller_pacing_ms_mean": pacing,
        "runtime_ms_mean": runtime,
        "ingress_ms_mean": budget.get("ingress_ms_mean"),
        "phase_wait_ms_mean": budget.get("phase_wait_ms_mean"),
        "ticks_ms_mean": None if ticks is None else round(ticks * FRAME_S * 1e3, 2),
        "tick_compute_ms_mean": budget.get("tick_compute_ms_mean"),
        "egress_ms_mean": budget.get("egress_ms_mean"),
        "admission_and_hops_ms_mean": left,
    }


def bench_first_audio(calls: int, step_ms: str, text_prompt: str | None) -> dict[str, object]:
    """``calls`` Twilio calls one after another on an idle sim node (2 s of speech each, ``text_prompt``
    as a ``<Parameter>`` when given): first audio term by term (:func:`first_audio_terms`) and the call's
    first audio p50/p99 (ms).

    Raises:
        ValueError: ``calls`` < 1.
        RuntimeError: the node did not start (its log named).
    """
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    clip = phone_speech(synthesize_speech("Hello, I would like to book a table for two tonight."))[: 2 * 8000]
    env = {"DUPLEX_TWILIO_AUTH_TOKEN": AUTH_TOKEN, "DUPLEX_TWILIO_STREAM_URL": STREAM_URL}
    names = [name for _, name in FIRST_AUDIO_TERMS]
    parameters = {"text_prompt": text_prompt} if text_prompt else {}
    results: list[CallResult] = []
    with node(0, 2, step_ms, env=env) as port:
        before = parse_histograms(_get(port, "/metrics")[1], names)
        for _ in range(calls):
            results.append(
                asyncio.run(
                    carrier_call(
                        TwilioSide(),
                        f"ws://127.0.0.1:{port}",
                        clip,
                        secret=AUTH_TOKEN,
                        stream_url=STREAM_URL,
                        parameters=parameters,
                        tail_s=0.2,
                    )
                )
            )
        after = parse_histograms(_get(port, "/metrics")[1], names)
    call_ms = [r.first_audio_s * 1e3 for r in results if r.first_audio_s is not None]
    budget = first_audio_budget(before, after, call_ms)
    return {
        "calls": calls,
        "step_ms": step_ms,
        "text_prompt": bool(text_prompt),
        "served": len(call_ms),
        "call_failures": [r.failure for r in results if r.failure],
        "call_first_audio_ms": _percentiles(call_ms),
        **first_audio_terms(call_ms, [CALLER_PACING_MS] * len(call_ms), budget),
        "host_cores": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> None:
    """``python -m runtime.tools.bench_phone latency|first-audio``: print the figures as one JSON object."""
    parser = argparse.ArgumentParser(
        prog="python -m runtime.tools.bench_phone", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    latency = sub.add_parser("latency", help="the Twilio bridge's added latency over PCM WebSocket")
    latency.add_argument("--sessions", type=int, default=4, help="WebSocket sessions, and as many calls")
    latency.add_argument("--step-ms", default="30", help="the sim's step time (ms)")
    latency.add_argument("--seconds", type=float, default=20.0, help="speech per session (s)")
    first = sub.add_parser("first-audio", help="first audio on a call, term by term")
    first.add_argument("--calls", type=int, default=10, help="calls, one after another")
    first.add_argument("--step-ms", default="30", help="the sim's step time (ms)")
    first.add_argument("--text-prompt", default=None, help="a persona text prompt for every call")
    args = parser.parse_args(argv)
    if args.command == "latency":
        row = bench_bridge_latency(args.sessions, args.step_ms, args.seconds)
    else:
        row = bench_first_audio(args.calls, args.step_ms, args.text_prompt)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
