"""A LiveKit agent's side of a call, through LiveKit's PersonaPlex plugin, released and unmodified
(``livekit-plugins-nvidia[personaplex]`` 1.8.9: ``RealtimeModel`` / ``RealtimeSession``), against a node.

It runs in the LiveKit virtualenv (``make livekit-deps``: ``.venv-livekit`` from
``requirements-livekit.lock``), since livekit-agents pins versions the project's own environment does not
hold (aiohttp, protobuf, numpy); so it imports only what a LiveKit agent has (livekit, aiohttp, numpy and
the standard library), nothing else of this repository, and runs as a script:
``<venv>/bin/python runtime/tools/livekit_agent.py <plan.json>``. ``duplex node up`` runs its ``load``
scenario for the LiveKit row (``infra.node.local.livekit_row``); ``tests/livekit_driver.py`` reuses its
pieces.

The one piece of wiring is the token: the plugin builds its URL itself (``realtime_model.py``
``_build_ws_url``: ``/api/chat?voice_prompt=<NAME>.pt&text_prompt=...&seed=...``) but takes an
``http_session``, and an aiohttp client middleware on that session (:class:`Tokens`) puts a fresh
single-use session token in ``Authorization: Bearer`` on each connection the plugin opens (its first, and
each reconnect: ``update_instructions``, a retry). docs/livekit.md.

The ``load`` plan (JSON): ``url`` (``ws://`` or ``wss://`` base), ``cafile`` (optional: a private CA for
``wss://``), ``tokens`` (one per session), ``voice``, ``text_prompts`` (the first is used), ``speech`` (a
float32 24 kHz ``.npy``), ``seconds`` (speech pushed per session, s), ``sessions``. It prints one JSON
object on stdout: ``{"sessions": [{"samples", "first_audio_ms", "errors"}, ...], "wall_s"}``.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import numpy as np
from livekit import rtc
from livekit.agents import llm
from livekit.plugins.nvidia.experimental.realtime import RealtimeModel, RealtimeSession

SAMPLE_RATE = 24000
"""Hz: the plugin's (livekit-plugins-nvidia realtime_model.py SAMPLE_RATE) and the node's."""
FRAME_SAMPLES = 480
"""20 ms at 24 kHz: one ``rtc.AudioFrame`` as a LiveKit room track delivers it (10-20 ms frames)."""
HEAR_TIMEOUT_S = 20.0
"""How long :func:`heard` waits for audio to come back (s)."""


class Tokens:
    """An aiohttp client middleware that gives each request the next token as ``Authorization: Bearer``
    and records the URL the plugin asked for (``requests``). With no token left, the request goes without
    one (the node then refuses it: 401)."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = list(tokens)
        self.requests: list[str] = []

    async def __call__(
        self,
        request: aiohttp.ClientRequest,
        handler: Callable[[aiohttp.ClientRequest], Awaitable[aiohttp.ClientResponse]],
    ) -> aiohttp.ClientResponse:
        self.requests.append(str(request.url))
        if self.tokens:
            request.headers["Authorization"] = f"Bearer {self.tokens.pop(0)}"
        return await handler(request)


class Call:
    """One plugin session and what came out of it: audio samples (24 kHz) received, the first audio's
    latency (ms, from the first ``push_audio`` to the first audio frame the plugin delivered), errors as
    the plugin's ``error`` event gave them, and the sample count at each reconnect."""

    def __init__(self, model: RealtimeModel, clock: Callable[[], float] = time.monotonic) -> None:
        self.session: RealtimeSession = model.session()
        self.samples = 0
        self.samples_at_reconnect: list[int] = []
        self.errors: list[dict[str, Any]] = []
        self.first_push_s: float | None = None
        self.first_audio_s: float | None = None
        self._clock = clock
        self._tasks: set[asyncio.Task[None]] = set()
        self.session.on("generation_created", self._on_generation)
        self.session.on("error", self._on_error)
        self.session.on("session_reconnected", self._on_reconnected)

    def _on_generation(self, event: llm.GenerationCreatedEvent) -> None:
        task = asyncio.create_task(self._consume(event))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _consume(self, event: llm.GenerationCreatedEvent) -> None:
        async for message in event.message_stream:
            async for frame in message.audio_stream:
                if frame.sample_rate != SAMPLE_RATE:
                    raise ValueError(f"the plugin delivered {frame.sample_rate} Hz; expected {SAMPLE_RATE}")
                if self.first_audio_s is None:
                    self.first_audio_s = self._clock()
                self.samples += frame.samples_per_channel

    def _on_error(self, event: llm.RealtimeModelError) -> None:
        self.errors.append(
            {
                "type": type(event.error).__name__,
                "message": str(event.error),
                "recoverable": event.recoverable,
            }
        )

    def _on_reconnected(self, _: object) -> None:
        self.samples_at_reconnect.append(self.samples)

    @property
    def first_audio_ms(self) -> float | None:
        """From the first ``push_audio`` to the first audio frame back (ms); None when none came."""
        if self.first_push_s is None or self.first_audio_s is None:
            return None
        return round((self.first_audio_s - self.first_push_s) * 1000.0, 1)

    async def speak(self, speech: np.ndarray, seconds: float) -> None:
        """Push ``seconds`` of ``speech`` (float32 ``[samples]`` at 24 kHz, looped) as 20 ms
        ``rtc.AudioFrame``s, int16, in real time."""
        pcm = np.clip(speech * 32767, -32768, 32767).astype(np.int16)
        frames = int(seconds * SAMPLE_RATE / FRAME_SAMPLES)
        for i in range(frames):
            start = (i * FRAME_SAMPLES) % (len(pcm) - FRAME_SAMPLES)
            chunk = pcm[start : start + FRAME_SAMPLES]
            if self.first_push_s is None:
                self.first_push_s = self._clock()
            self.session.push_audio(rtc.AudioFrame(chunk.tobytes(), SAMPLE_RATE, 1, FRAME_SAMPLES))
            await asyncio.sleep(FRAME_SAMPLES / SAMPLE_RATE)

    def report(self) -> dict[str, Any]:
        """``samples``, ``samples_at_reconnect``, ``errors``, ``first_audio_ms``: JSON-ready."""
        return {
            "samples": self.samples,
            "samples_at_reconnect": self.samples_at_reconnect,
            "errors": self.errors,
            "first_audio_ms": self.first_audio_ms,
        }


def model(plan: dict[str, Any], tokens: Tokens, text_prompt: str) -> RealtimeModel:
    """The plugin's model on ``plan["url"]`` (``ws://`` or ``wss://``), its ``http_session`` carrying the
    token middleware and, for ``wss://`` with a private CA (``plan["cafile"]``), a connector trusting it."""
    cafile = plan.get("cafile")
    connector = aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=cafile)) if cafile else None
    # aiohttp >= 3.12 (the LiveKit virtualenv has 3.14; .venv's older aiohttp, which mypy reads, has none)
    http = aiohttp.ClientSession(middlewares=(tokens,), connector=connector)  # type: ignore[call-arg]
    return RealtimeModel(
        base_url=plan["url"], voice=plan["voice"], text_prompt=text_prompt, seed=7, http_session=http
    )


async def wait_for(check: Callable[[], bool], seconds: float) -> bool:
    """Poll ``check`` every 50 ms for ``seconds`` (s); its last answer."""
    for _ in range(int(seconds / 0.05)):
        if check():
            return True
        await asyncio.sleep(0.05)
    return check()


async def heard(call: Call, samples: int) -> None:
    """Wait until ``samples`` more samples of audio came back (a full-duplex node streams audio on every
    tick, silence or speech, so it never stops by itself), ``HEAR_TIMEOUT_S`` at most."""
    target = call.samples + samples
    await wait_for(lambda: call.samples >= target, HEAR_TIMEOUT_S)


async def load(plan: dict[str, Any], speech: np.ndarray) -> dict[str, Any]:
    """``plan["sessions"]`` concurrent plugin sessions, one token each: each pushes ``plan["seconds"]`` of
    speech in real time, waits for the audio of its last second to come back, and hangs up."""

    async def one(token: str) -> dict[str, Any]:
        realtime = model(plan, Tokens([token]), plan["text_prompts"][0])
        call = Call(realtime)
        try:
            await call.speak(speech, plan["seconds"])
            if call.samples > 0:  # served: the audio of the last second pushed comes back
                await heard(call, SAMPLE_RATE)
        finally:
            await call.session.aclose()
            await realtime._http_session.close()  # type: ignore[union-attr]
        return call.report()

    if len(plan["tokens"]) < plan["sessions"]:
        have = len(plan["tokens"])
        raise ValueError(f"{plan['sessions']} sessions need as many tokens; the plan has {have}")
    started = time.monotonic()
    sessions = await asyncio.gather(*(one(plan["tokens"][i]) for i in range(plan["sessions"])))
    return {"sessions": list(sessions), "wall_s": round(time.monotonic() - started, 3)}


SCENARIOS: dict[str, Callable[[dict[str, Any], np.ndarray], Awaitable[dict[str, Any]]]] = {"load": load}
"""The scenarios this module runs itself (tests/livekit_driver.py adds its own)."""


async def run_plan(path: str, scenarios: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read the plan at ``path`` (JSON), load its speech and run its ``scenario`` (default ``load``).

    Raises:
        KeyError: an unknown scenario (the message names the known ones).
    """
    with open(path) as file:
        plan = json.load(file)
    known = scenarios or SCENARIOS
    name = plan.get("scenario", "load")
    if name not in known:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(sorted(known))}")
    speech = np.load(plan["speech"])
    result: dict[str, Any] = await known[name](plan, speech)
    return result


def main(argv: list[str], scenarios: dict[str, Any] | None = None) -> None:
    """``<python> livekit_agent.py <plan.json>``: run the plan, print its JSON report on stdout."""
    if len(argv) != 2:
        raise SystemExit(f"usage: {argv[0]} <plan.json>")
    print(json.dumps(asyncio.run(run_plan(argv[1], scenarios))))


if __name__ == "__main__":
    main(sys.argv)
