"""Bad input from a carrier (issue 32), for every carrier's bridge (``/api/carriers/<carrier>``): an
unknown event, a second ``start``, a payload that is not base64, a frame of the wrong length, a huge
message, a binary frame, and a ``media`` before ``start``. Each closes that call only, with a clear code and
a log line naming it on the carrier's logger; its slot is released at once and a neighbour call on the same
node keeps every frame of its audio. Driven by each carrier's side (``runtime.tools.carrier_sides``) over
the fake backend; no timing assertions (waits are bounded, never measured).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import numpy as np
import pytest
from fake_backend import FakeBackend
from test_carrier_twilio import base, refused_count, tone_8k, until
from test_frontend_seam import fake_node
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from runtime.tools.carrier_client import carrier_call
from runtime.tools.carrier_sides import SIDES

SECRETS = {
    "twilio": ("0123456789abcdef0123456789abcdef", "wss://voice.example.com/api/carriers/twilio"),
    "plivo": ("MjA3ZDQ5ZTUtYjM0Yy00ZjVmLWI2NWItZTA4", "wss://voice.example.com/api/carriers/plivo"),
    "telnyx": ("a-stream-secret-of-32-characters", "unsigned"),  # Telnyx signs nothing: no stream URL
    "exotel": ("exotel-key:exotel-token-0123456789", "unsigned"),  # Basic auth: no stream URL either
}
CARRIERS = sorted(SECRETS)


def settings(carrier: str) -> dict[str, object]:
    secret, url = SECRETS[carrier]
    if carrier == "telnyx":
        return {"telnyx_stream_token": secret}
    if carrier == "exotel":
        key, token = secret.split(":")
        return {"exotel_api_key": key, "exotel_api_token": token}
    return {f"{carrier}_auth_token": secret, f"{carrier}_stream_url": url}


def _bad(carrier: str, kind: str) -> str | bytes:
    side = SIDES[carrier]()
    ids = side.ids()
    if kind == "unknown-event":
        return json.dumps({"event": "tap-dance"})
    if kind == "replayed-start":
        return json.dumps(side.opening(ids, {}, None)[-1])
    if kind == "bad-base64":
        return json.dumps(side.media(ids, 0, "not base64!"))
    if kind == "wrong-length":
        return json.dumps(side.media(ids, 0, "//" * 2200))  # 3300 bytes: over 200 ms of G.711 or L16
    if kind == "huge":
        return json.dumps(side.media(ids, 0, "A" * 70_000))
    return b"\x00\x01"


WHY = {
    "unknown-event": (1008, "unknown event 'tap-dance'"),
    "replayed-start": (1008, "a second start message"),
    "bad-base64": (1008, "bad message"),
    "wrong-length": (1008, "a media payload of 3300 bytes; allowed "),
    "huge": (1009, "exceeds limit 65536"),
    "binary": (1008, "a binary frame"),
}


async def _open(server, carrier: str):  # type: ignore[no-untyped-def]
    secret, url = SECRETS[carrier]
    query, headers = SIDES[carrier]().upgrade(secret, url, {})
    path = f"{base(server)}/api/carriers/{carrier}" + (f"?{query}" if query else "")
    return connect(path, additional_headers=headers)


@pytest.mark.parametrize("kind", list(WHY))
@pytest.mark.parametrize("carrier", CARRIERS)
async def test_bad_input_closes_that_call_only_and_frees_its_slot(carrier, kind, caplog):
    code, why = WHY[kind]
    caplog.set_level(logging.INFO, logger=f"runtime.frontend.transports.carriers.{carrier}")
    side = SIDES[carrier]()
    secret, url = SECRETS[carrier]
    backend = FakeBackend(slots=2)
    async with fake_node(backend, max_message_bytes=65536, **settings(carrier)) as server:
        neighbour = asyncio.create_task(
            carrier_call(side, base(server), tone_8k(440, 2.0), secret=secret, stream_url=url)
        )
        ids = side.ids()
        async with await _open(server, carrier) as ws:
            for message in side.opening(ids, {}, None):
                await ws.send(json.dumps(message))
            silence = side.packets(np.zeros(160, dtype=np.float32))[0]
            for index in range(20):  # 400 ms of a live call first
                await ws.send(json.dumps(side.media(ids, index, silence)))
                await asyncio.sleep(0.02)
            await ws.send(_bad(carrier, kind))
            with contextlib.suppress(ConnectionClosed):
                async with asyncio.timeout(5):
                    async for _ in ws:  # the node's audio until it closes
                        pass
            assert ws.close_code == code
        await until(lambda: len(backend.released) == 1, "the bad call's slot released")
        heard = await neighbour
        assert heard.failure == "" and heard.close_code == 1000
        gaps = np.diff(heard.mark_arrival_s)
        assert len(heard.mark_arrival_s) >= 20 and float(np.max(gaps)) < 0.2, gaps  # no frame went missing
        assert len(backend.released) == 2 and backend.leases == {}
    assert why in caplog.text


@pytest.mark.parametrize("carrier", CARRIERS)
async def test_media_before_start_is_refused_before_admission(carrier):
    """A ``media`` where ``start`` belongs: closed 1008 ``bad_request`` naming what came, counted once; no
    slot is asked for."""
    side = SIDES[carrier]()
    backend = FakeBackend(slots=1)
    async with fake_node(backend, **settings(carrier)) as server:
        async with await _open(server, carrier) as ws:
            silence = side.packets(np.zeros(160, dtype=np.float32))[0]
            await ws.send(json.dumps(side.media(side.ids(), 0, silence)))
            with contextlib.suppress(ConnectionClosed):
                async with asyncio.timeout(5):
                    async for _ in ws:
                        pass
            assert ws.close_code == 1008
            assert (
                ws.close_reason.startswith("bad_request: ")
                and "start message, got 'media'" in ws.close_reason
            )
        assert refused_count(server, "bad_request") == 1 and backend.requests == []
