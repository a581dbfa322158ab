"""Drives LiveKit's PersonaPlex plugin, unmodified, against a node: run by tests/test_livekit_plugin.py with
the separate virtualenv's Python (``make livekit-deps``: ``.venv-livekit``, ``requirements-livekit.lock``),
since livekit-agents pins versions the project's own environment does not hold (aiohttp, protobuf, numpy).

It imports nothing from this repository: what it uses is what a LiveKit agent has (``livekit-agents``,
``livekit-plugins-nvidia[personaplex]`` 1.8.9, aiohttp). The one piece of wiring is the token: the plugin
builds its URL itself (``realtime_model.py`` ``_build_ws_url``) but takes an ``http_session``, and an aiohttp
client middleware on that session puts a fresh single-use session token in ``Authorization: Bearer`` on each
connection the plugin opens (its first, and each reconnect: ``update_instructions``, a retry).

Usage: ``python tests/livekit_driver.py <plan.json>``; the plan names the scenario, the node's URL, the
tokens (one per connection, in order), the voice, text prompts and the speech (a float32 24 kHz ``.npy``).
Prints one JSON object (the scenario's observations) on stdout.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import numpy as np
from livekit import rtc
from livekit.agents import llm
from livekit.plugins.nvidia.experimental.realtime import RealtimeModel, RealtimeSession

SAMPLE_RATE = 24000
"""Hz: the plugin's (realtime_model.py SAMPLE_RATE) and the node's."""
FRAME_SAMPLES = 480
"""20 ms at 24 kHz: one ``rtc.AudioFrame`` as a LiveKit room track delivers it (10-20 ms frames)."""


class Tokens:
    """An aiohttp client middleware that gives each request the next token as ``Authorization: Bearer``
    and records the URL the plugin asked for (``requests``)."""

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
    """One plugin session and what came out of it: audio samples per connection, errors, reconnects."""

    def __init__(self, model: RealtimeModel) -> None:
        self.session: RealtimeSession = model.session()
        self.samples = 0
        self.samples_at_reconnect: list[int] = []
        self.errors: list[dict[str, Any]] = []
        self.text: list[str] = []
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
                assert frame.sample_rate == SAMPLE_RATE, frame.sample_rate
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

    async def speak(self, speech: np.ndarray, seconds: float) -> None:
        """Push ``seconds`` of ``speech`` (looped) as 20 ms ``rtc.AudioFrame``s, int16, in real time."""
        pcm = np.clip(speech * 32767, -32768, 32767).astype(np.int16)
        frames = int(seconds * SAMPLE_RATE / FRAME_SAMPLES)
        for i in range(frames):
            start = (i * FRAME_SAMPLES) % (len(pcm) - FRAME_SAMPLES)
            chunk = pcm[start : start + FRAME_SAMPLES]
            self.session.push_audio(rtc.AudioFrame(chunk.tobytes(), SAMPLE_RATE, 1, FRAME_SAMPLES))
            await asyncio.sleep(FRAME_SAMPLES / SAMPLE_RATE)

    def report(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "samples_at_reconnect": self.samples_at_reconnect,
            "errors": self.errors,
        }


def model(plan: dict[str, Any], tokens: Tokens, text_prompt: str) -> RealtimeModel:
    """The plugin's model on ``plan["url"]`` (``ws://`` or ``wss://``), its ``http_session`` carrying the
    token middleware and, for ``wss://`` with a private CA (``plan["cafile"]``), a connector trusting it."""
    cafile = plan.get("cafile")
    connector = aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=cafile)) if cafile else None
    http = aiohttp.ClientSession(middlewares=(tokens,), connector=connector)
    return RealtimeModel(
        base_url=plan["url"], voice=plan["voice"], text_prompt=text_prompt, seed=7, http_session=http
    )


async def wait_for(check: Callable[[], bool], seconds: float) -> bool:
    for _ in range(int(seconds / 0.05)):
        if check():
            return True
        await asyncio.sleep(0.05)
    return check()


async def heard(call: Call, samples: int) -> None:
    """Wait until ``samples`` more samples of audio came back (a full-duplex node streams audio on every
    tick, silence or speech, so it never stops by itself), 20 s at most."""
    target = call.samples + samples
    await wait_for(lambda: call.samples >= target, 20)


async def one_call(plan: dict[str, Any], speech: np.ndarray) -> dict[str, Any]:
    """One call: speech in, a second of audio back; then ``update_instructions`` (the plugin reconnects with
    the new text prompt), speech again and another second back."""
    tokens = Tokens(plan["tokens"])
    realtime = model(plan, tokens, plan["text_prompts"][0])
    call = Call(realtime)
    await call.speak(speech, plan["seconds"])
    await heard(call, SAMPLE_RATE)
    await call.session.update_instructions(plan["text_prompts"][1])
    await wait_for(lambda: bool(call.samples_at_reconnect), 10)
    await call.speak(speech, plan["seconds"])
    await heard(call, SAMPLE_RATE)
    await call.session.aclose()
    await realtime._http_session.close()  # type: ignore[union-attr]
    return call.report() | {"requests": tokens.requests}


async def fixed_token(plan: dict[str, Any], speech: np.ndarray) -> dict[str, Any]:
    """One token as a fixed header of the ``http_session`` (``headers=``, no middleware): the first
    connection is admitted; the reconnect of ``update_instructions`` presents the spent token again."""
    http = aiohttp.ClientSession(headers={"Authorization": f"Bearer {plan['tokens'][0]}"})
    realtime = RealtimeModel(
        base_url=plan["url"], voice=plan["voice"], text_prompt=plan["text_prompts"][0], http_session=http
    )
    call = Call(realtime)
    await call.speak(speech, plan["seconds"])
    await heard(call, SAMPLE_RATE)
    await call.session.update_instructions(plan["text_prompts"][1])
    await wait_for(lambda: bool(call.errors), 10)
    await call.session.aclose()
    await http.close()
    return call.report()


async def waiting_sessions(metrics_url: str) -> float:
    """The node's ``duplex_waiting_sessions`` gauge (callers in its waiting room), from its ``/metrics``."""
    async with aiohttp.ClientSession() as http, http.get(metrics_url) as answer:
        text = await answer.text()
    for line in text.splitlines():
        if line.startswith("duplex_waiting_sessions "):
            return float(line.split()[1])
    return 0.0


async def at_the_cap(plan: dict[str, Any], speech: np.ndarray) -> dict[str, Any]:
    """``cap`` calls hold every slot; one more waits (the waiting room: the node's gauge says so, and it hears
    nothing for ``wait_s``); one more again is refused. Then the first call hangs up and the waiting one is
    served."""
    cap = plan["cap"]
    tokens = [Tokens([t]) for t in plan["tokens"]]
    models = [model(plan, tokens[i], plan["text_prompts"][0]) for i in range(cap + 2)]
    holders = [Call(m) for m in models[:cap]]
    speaking = [asyncio.create_task(c.speak(speech, 60)) for c in holders]
    held = await wait_for(lambda: all(c.samples > 0 for c in holders), 20)
    waiting = Call(models[cap])
    speaking.append(asyncio.create_task(waiting.speak(speech, 60)))
    in_room = False
    for _ in range(200):  # the node's gauge of callers in its waiting room, 20 s at most
        if in_room := await waiting_sessions(plan["metrics_url"]) == 1:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(plan["wait_s"])
    waiting_before = waiting.samples
    refused = Call(models[cap + 1])
    await wait_for(lambda: bool(refused.errors), 10)
    refused_report = refused.report()
    await refused.session.aclose()
    speaking[0].cancel()
    await holders[0].session.aclose()
    served = await wait_for(lambda: waiting.samples > 0, 20)
    for task in speaking:
        task.cancel()
    for call in [*holders[1:], waiting]:
        await call.session.aclose()
    for m in models:
        await m._http_session.close()  # type: ignore[union-attr]
    return {
        "holders_served": held,
        "waited_in_room": in_room,
        "waiting_samples_while_full": waiting_before,
        "waiting_served_after_a_hangup": served,
        "waiting_errors": waiting.errors,
        "refused": refused_report,
    }


SCENARIOS = {"one_call": one_call, "at_the_cap": at_the_cap, "fixed_token": fixed_token}


async def main(path: str) -> None:
    with open(path) as file:
        plan = json.load(file)
    speech = np.load(plan["speech"])
    result = await SCENARIOS[plan["scenario"]](plan, speech)
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
