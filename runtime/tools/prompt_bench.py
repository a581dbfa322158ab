"""Persona join benchmark: connect-to-handshake time of a session with a long text prompt while others talk.

A real server (``runtime.frontend.server.DuplexServer``, auth off, on loopback) with ``live + 1`` slots:
``live``
sessions stream noise at speech level in real time (``runtime.tools.loadgen.run_session``); once they are all
talking, one more client connects with a text prompt of ``prompt_tokens`` tokens (the ``<system>`` wrapper
included) sent as a 0x04 metadata message (``text_prompt_in=metadata``) and the time from opening the
connection to receiving the 0x00 handshake is measured. Every tick of the engine is recorded meanwhile:
its total time and how many prompt steps (step-by-step) or prefill steps it ran, so the ticks that
carried the prompt are told apart.

Run once with the prompt prefilled (``DUPLEX_PROMPT_PREFILL=true``, the default) and once step by step
(the reference). Wall-clock figures on this machine; nothing here is asserted by the tests.
"""

from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import dataclass, field

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from runtime.config import RuntimeConfig
from runtime.engine.batch import TickResult
from runtime.engine.engine_core import LocalSlots
from runtime.engine.model_presets import FRAME_MS, SAMPLE_RATE_HZ
from runtime.engine.models import ModelBundle
from runtime.engine.persona_limits import TEXT_PROMPT_MAX_CHARS
from runtime.frontend.codecs.protocol import MessageKind, encode_metadata
from runtime.frontend.server import DuplexServer
from runtime.tools.loadgen import run_session, session_url

_SENTENCE = "Please tell me more about your trip, and the weather over the hills. "


def prompt_of_tokens(bundle: ModelBundle, tokens: int) -> str:
    """A text prompt whose ``<system>``-wrapped encoding is exactly ``tokens`` tokens (or as close below as
    whole words allow), within ``TEXT_PROMPT_MAX_CHARS``.

    Raises:
        ValueError: ``tokens`` cannot be reached within the character limit with this tokenizer.
    """
    tokenizer = bundle.text_tokenizer

    def count(text: str) -> int:
        return len(tokenizer.encode(f"<system> {text.strip()} <system>"))

    words = (_SENTENCE * 200).split()
    text = ""
    for word in words:
        candidate = f"{text} {word}".strip()
        if count(candidate) > tokens or len(candidate) > TEXT_PROMPT_MAX_CHARS:
            break
        text = candidate
    for filler in ("a", "I"):  # top up with one-token words
        while count(f"{text} {filler}") <= tokens and len(text) + 2 <= TEXT_PROMPT_MAX_CHARS:
            text = f"{text} {filler}"
    if count(text) < tokens - 5:
        raise ValueError(f"cannot build a {tokens}-token prompt within {TEXT_PROMPT_MAX_CHARS} characters")
    return text


@dataclass
class JoinResult:
    """One run.

    Attributes:
        prefill: whether prompts were prefilled (else step by step).
        prompt_tokens, prompt_chars, prompt_steps: the text prompt and all its teacher-forced steps
            (wrapper and silences included).
        connect_to_handshake_ms: from opening the connection to the 0x00 handshake (or to the server
            closing the session, when ``handshake`` is False: the server's prompt timeout).
        live_at_handshake: the other sessions still live when the handshake came.
        prompt_ticks_ms: total time of each tick that ran prompt work.
        other_ticks_ms: total time of the ticks from the connection on that ran none (live slots only,
            ``after_s`` after the handshake included): the machine's baseline meanwhile.
    """

    prefill: bool
    prompt_tokens: int
    prompt_chars: int
    prompt_steps: int
    connect_to_handshake_ms: float
    live_at_handshake: int
    handshake: bool = True
    prompt_ticks_ms: list[float] = field(default_factory=list)
    other_ticks_ms: list[float] = field(default_factory=list)

    @staticmethod
    def _p(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None

    def summary(self) -> dict[str, object]:
        """The figures as one flat dict (times in ms, rounded to 0.1; None where there were no ticks)."""
        return {
            "mode": "prefill" if self.prefill else "step-by-step",
            "prompt_tokens": self.prompt_tokens,
            "prompt_chars": self.prompt_chars,
            "prompt_steps": self.prompt_steps,
            "connect_to_handshake_ms": round(self.connect_to_handshake_ms, 1),
            "handshake": self.handshake,
            "ticks_with_prompt_work": len(self.prompt_ticks_ms),
            "tick_p50_ms_during_prompt": _round(self._p(self.prompt_ticks_ms, 50)),
            "tick_p99_ms_during_prompt": _round(self._p(self.prompt_ticks_ms, 99)),
            "tick_max_ms_during_prompt": _round(max(self.prompt_ticks_ms, default=None)),
            "tick_p99_ms_other": _round(self._p(self.other_ticks_ms, 99)),
            "ticks_over_80ms_during_prompt": sum(t > FRAME_MS for t in self.prompt_ticks_ms),
            "ticks_other": len(self.other_ticks_ms),
            "ticks_over_80ms_other": sum(t > FRAME_MS for t in self.other_ticks_ms),
            "live_at_handshake": self.live_at_handshake,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


async def measure_join(
    bundle: ModelBundle,
    *,
    prefill: bool,
    live: int = 4,
    prompt_tokens: int = 1000,
    settle_s: float = 2.0,
    after_s: float = 3.0,
    handshake_timeout_s: float = 300.0,
) -> JoinResult:
    """Connect-to-handshake time of a ``prompt_tokens`` text prompt with ``live`` sessions talking.

    Args:
        bundle: the model (copied: the server gets its own streaming state).
        prefill: ``DUPLEX_PROMPT_PREFILL``.
        settle_s: how long the live sessions talk before the prompted client connects.
        after_s: how long they go on after the handshake (live-only ticks, for comparison).
    """
    config = RuntimeConfig(
        host="127.0.0.1", port=0, max_sessions=live + 1, auth_mode="off", prompt_prefill=prefill
    )
    slots = LocalSlots(config, copy.deepcopy(bundle))
    server = DuplexServer(config, slots)
    ticks: list[TickResult] = []
    engine_tick = slots.engine.tick

    def recording_tick(*args, **kwargs) -> TickResult:
        result = engine_tick(*args, **kwargs)
        ticks.append(result)
        return result

    slots.engine.tick = recording_tick  # type: ignore[method-assign]
    text = prompt_of_tokens(bundle, prompt_tokens)
    tokens = len(bundle.text_tokenizer.encode(f"<system> {text.strip()} <system>"))
    await server.start()
    try:
        base = f"ws://127.0.0.1:{server.port}"
        rng = np.random.default_rng(0)
        talk_s = settle_s + handshake_timeout_s
        seconds = int(SAMPLE_RATE_HZ * min(talk_s, settle_s + 200))
        pcm = [(rng.standard_normal(seconds) * 0.05).astype(np.float32) for _ in range(live)]
        sessions = [asyncio.create_task(run_session(session_url(base), p, tail_s=0.2)) for p in pcm]
        await asyncio.sleep(settle_s)
        mark = len(ticks)
        start = time.perf_counter()
        handshake = False
        async with connect(session_url(base, text_prompt_in="metadata"), proxy=None, open_timeout=30) as ws:
            await ws.send(encode_metadata({"text_prompt": text}))
            try:
                while True:
                    message = await asyncio.wait_for(ws.recv(), handshake_timeout_s)
                    if isinstance(message, bytes) and message[:1] == bytes([MessageKind.HANDSHAKE]):
                        handshake = True
                        break
            except ConnectionClosed:
                pass
            elapsed_ms = (time.perf_counter() - start) * 1e3
            live_now = len(slots.engine.live_slots) - (1 if handshake else 0)
        await asyncio.sleep(after_s)  # live-only ticks to compare with
        window = ticks[mark:]
        for task in sessions:
            task.cancel()
        await asyncio.gather(*sessions, return_exceptions=True)
    finally:
        await server.close()
    steps = sum(t.timings.prompt_steps + t.timings.prefill_steps for t in window)
    prompt_ticks = [t.timings.total_ms for t in window if t.timings.prompt_steps or t.timings.prefill_steps]
    other = [t.timings.total_ms for t in window if not (t.timings.prompt_steps or t.timings.prefill_steps)]
    return JoinResult(prefill, tokens, len(text), steps, elapsed_ms, live_now, handshake, prompt_ticks, other)
