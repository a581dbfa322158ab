"""The slot backend over ZeroMQ (``runtime.frontend.engine_client.EngineClient``) against a stand-in engine
process: a ROUTER socket that answers every ``Hello`` with a ``Status`` (no model)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from runtime.engine.api import AdmitRequest, Refusal, SamplingParams, SessionSink
from runtime.frontend.engine_client import EngineClient

STAND_IN_ENGINE = textwrap.dedent(
    """
    import sys, zmq
    from runtime import ipc
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(sys.argv[1])
    print("bound", flush=True)
    while True:
        identity, data = sock.recv_multipart()
        message = ipc.decode(data)
        if isinstance(message, ipc.Hello):
            status = ipc.Status(2, 2, 0, True, False, ["alice"], 4242)
            sock.send_multipart([identity, ipc.encode(status)])
        elif isinstance(message, ipc.Admit):
            sock.send_multipart([identity, ipc.encode(ipc.Refused(message.session_id, "node_full", "full"))])
    """
)


class _Sink(SessionSink):
    def on_output(self, pcm, piece):  # type: ignore[no-untyped-def]
        pass

    def on_prompt_done(self) -> None:
        pass


async def test_the_engine_process_exit_is_seen_at_once_through_the_socket(tmp_path: Path):
    """Guards issue 21: a worker noticed a dead engine only after 5 s without a Status. Here the client's
    clock never advances, so its silence timeout can never fire: only the socket's disconnection can
    report the loss."""
    address = f"ipc://{tmp_path}/engine.sock"
    engine = subprocess.Popen(
        [sys.executable, "-c", STAND_IN_ENGINE, address], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    try:
        assert engine.stdout is not None and engine.stdout.readline().strip() == "bound"
        client = EngineClient(address, "worker-0", slots=2, clock=lambda: 100.0)
        lost = asyncio.Event()
        client.on_lost.append(lost.set)
        await client.start()
        try:
            async with asyncio.timeout(20):
                while not client.status().loaded:
                    await asyncio.sleep(0.01)
            status = client.status()
            assert (status.slots, status.free_slots, status.voices, status.lost) == (2, 2, ("alice",), False)
            assert status.detail == {"worker": "worker-0", "engine_pid": 4242}
            refused = None
            try:
                await client.admit(AdmitRequest("s1", None, None, SamplingParams()), _Sink())
            except Refusal as exc:
                refused = exc
            assert refused is not None and (refused.reason, refused.message) == ("node_full", "full")

            engine.send_signal(signal.SIGKILL)
            async with asyncio.timeout(20):  # a bound for a broken test, not a latency figure
                await lost.wait()
            status = client.status()
            assert status.lost and status.health() == (False, "engine unreachable") and status.free_slots == 0
        finally:
            await client.close()
    finally:
        engine.kill()
        engine.wait()
