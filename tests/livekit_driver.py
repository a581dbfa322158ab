"""Drives LiveKit's PersonaPlex plugin, unmodified, against a node: run by tests/test_livekit_plugin.py with
the separate virtualenv's Python (``make livekit-deps``: ``.venv-livekit``, ``requirements-livekit.lock``),
since livekit-agents pins versions the project's own environment does not hold (aiohttp, protobuf, numpy).

Its pieces are ``runtime.tools.livekit_agent``'s (which imports only what a LiveKit agent has:
``livekit-agents``, ``livekit-plugins-nvidia[personaplex]`` 1.8.9, aiohttp, numpy; ``duplex node up`` runs
its ``load`` scenario for the LiveKit row); this adds the tests' scenarios. The token travels as that
module says: an aiohttp client middleware on the plugin's ``http_session`` puts a fresh single-use token in
``Authorization: Bearer`` on each connection the plugin opens.

Usage: ``python tests/livekit_driver.py <plan.json>``; the plan names the scenario, the node's URL, the
tokens (one per connection, in order), the voice, text prompts and the speech (a float32 24 kHz ``.npy``).
Prints one JSON object (the scenario's observations) on stdout.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: its LiveKit agent module

from runtime.tools.livekit_agent import (  # noqa: E402 (after the path above)
    SAMPLE_RATE,
    Call,
    RealtimeModel,
    Tokens,
    heard,
    main,
    model,
    wait_for,
)


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


if __name__ == "__main__":
    main(sys.argv, SCENARIOS)
