"""The third transport (issue 31, the proof of the seam): raw PCM over a plain TCP stream
(``runtime/frontend/transports/pcm_stream.py``), written against nothing but the lifecycle. An in-process
server (``--workers 0``, the ``sim`` model, whose audio is its input at half level over a quiet tone) serves
it on its own listener: a conversation gets its handshake, its audio back (the echo correlates with what
was sent) and text; its end frees the slot; a bad query is refused; a lost stream holds a resumable
session's slot and its credential resumes it on ``/api/chat``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio
from test_server_e2e import (  # noqa: F401  (fixtures)
    WAIT_S,
    LiveClient,
    bundle,
    chat_url,
    running_server,
    speech,
    wait_until,
)

from runtime.engine.model_presets import FRAME_SAMPLES
from runtime.frontend.server import DuplexServer
from runtime.frontend.session.state import SessionState
from runtime.frontend.transports import pcm_stream

pytestmark = pytest.mark.asyncio(loop_scope="module")
HEADER = pcm_stream.HEADER


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node(bundle) -> AsyncIterator[tuple[DuplexServer, int]]:  # noqa: F811
    async with running_server(
        bundle, workers=0, max_sessions=2, model="sim", sim_step_ms="5", resume_s=5
    ) as srv:
        listener = await asyncio.start_server(lambda r, w: pcm_stream.serve(srv, r, w), "127.0.0.1", 0)
        try:
            yield srv, listener.sockets[0].getsockname()[1]
        finally:
            listener.close()


async def message(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    kind, size = HEADER.unpack(await reader.readexactly(HEADER.size))
    return kind, await reader.readexactly(size)


def audio(pcm: np.ndarray) -> bytes:
    payload = np.clip(np.rint(pcm * 32768), -32768, 32767).astype("<i2").tobytes()
    return HEADER.pack(0x01, len(payload)) + payload


async def free(server: DuplexServer) -> None:
    await wait_until(
        lambda: not server.sessions and server.backend.status().free_slots == server.backend.status().slots,
        timeout_s=WAIT_S,
        what="every session gone and every slot free",
    )


async def test_a_conversation_over_raw_pcm(node, speech) -> None:  # noqa: F811
    server, port = node
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"seed=3\n")
    assert await asyncio.wait_for(message(reader), WAIT_S) == (0x00, b"")
    clip = speech[0][: 30 * FRAME_SAMPLES]
    received, texts = [], []

    async def listen() -> None:
        while True:
            kind, payload = await message(reader)
            if kind == 0x01:
                received.append(np.frombuffer(payload, "<i2").astype(np.float32) / 32768)
            elif kind == 0x02:
                texts.append(payload.decode())

    listening = asyncio.create_task(listen())
    for start in range(0, clip.size, 960):  # half frames, in real time: the conversation assembles them
        writer.write(audio(clip[start : start + 960]))
        await asyncio.sleep(0.04)
    await wait_until(lambda: len(received) >= 25, timeout_s=WAIT_S, what="25 frames back")
    listening.cancel()
    writer.close()
    await free(server)
    assert all(frame.size == FRAME_SAMPLES for frame in received) and texts
    # The sim echoes each frame it is given at half level over a 220 Hz tone that starts afresh each frame
    # (runtime/engine/sim.py SimEngine._tone). Without the tone, each frame that is not silence (a tick the
    # slot had no frame for) is one of the clip's frames, whole and in order: the conversation cut the
    # half-frame pieces into the clip's own frames.
    t = np.arange(FRAME_SAMPLES, dtype=np.float32) / 24000
    echoes = [frame - 0.05 * np.sin(2 * np.pi * 220.0 * t) for frame in received]
    sent = clip.reshape(-1, FRAME_SAMPLES)
    matched = []
    for echo in echoes:
        if np.sqrt(np.mean(echo**2)) < 0.003:
            continue
        scores = [np.corrcoef(echo, frame)[0, 1] if frame.std() > 0 else 0.0 for frame in sent]
        best = int(np.argmax(scores))
        assert scores[best] > 0.99 and np.allclose(echo, 0.5 * sent[best], atol=2e-3), (best, scores[best])
        matched.append(best)
    assert len(matched) >= 20 and matched == sorted(matched), matched
    scrape = server.render_metrics().decode()
    assert 'duplex_transport_sessions_started_total{transport="pcm_stream"} 1.0' in scrape
    assert 'duplex_sessions_ended_total{reason="client_closed"}' in scrape


async def test_a_bad_query_is_refused_with_an_error(node) -> None:
    _, port = node
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"seed=banana\n")
    kind, payload = await asyncio.wait_for(message(reader), WAIT_S)
    assert kind == 0x05 and payload.decode().startswith("bad_request: bad request:") and b"seed" in payload
    assert await asyncio.wait_for(reader.read(), WAIT_S) == b""
    writer.close()


async def test_a_lost_stream_is_held_and_resumed_over_the_websocket(node, speech) -> None:  # noqa: F811
    server, port = node
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"resumable=1\n")
    assert await asyncio.wait_for(message(reader), WAIT_S) == (0x00, b"")
    kind, payload = await asyncio.wait_for(message(reader), WAIT_S)
    meta = json.loads(payload)
    assert kind == 0x04 and meta["resume"] and meta["session_id"]
    writer.write(audio(speech[0][: 4 * FRAME_SAMPLES]))
    await writer.drain()
    (session,) = server.sessions
    writer.write(HEADER.pack(0x01, 100))  # half a message, then the path is gone: lost
    writer.transport.abort()
    await wait_until(lambda: session.state is SessionState.DETACHED, timeout_s=WAIT_S, what="detached")
    assert server.backend.status().free_slots == server.backend.status().slots - 1  # its slot is held
    client = LiveClient(chat_url(server, format="pcm", resume=meta["resume"]), speech[1])
    await client.open()
    try:
        assert client.result.handshake, (client.result.errors, client.result.close_code)
        await wait_until(lambda: session.state is SessionState.MOVED, timeout_s=WAIT_S, what="moved")
        await wait_until(lambda: bool(client.metadata), timeout_s=WAIT_S, what="the WebSocket's 0x04")
        assert client.metadata[0]["session_id"] == meta["session_id"] and client.metadata[0]["resumed"]
    finally:
        await client.finish(tail_s=0.1)
    await free(server)
