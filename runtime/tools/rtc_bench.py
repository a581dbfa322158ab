"""Benchmarks of WebRTC on ``/api/rtc`` (issue 22), on one machine, on loopback. Figures are written down, not
asserted (docs/benchmarks.md, "WebRTC").

- ``latency``: the server's receive path, WebRTC against WebSocket, in one process over an echo slot backend
  (no model): for every input frame pushed to its slot, the time since the network handed the server the
  last of its audio (WebSocket: the 0x01 message that completed the frame; WebRTC: the RTP packet that
  completed it, through the jitter buffer and libopus). p50/p99 each, and the difference: what WebRTC adds.
  Also POST -> answer and POST -> connected over ``--calls`` sequential calls.
- ``capacity``: WebRTC sessions per front-end core on the ``sim`` model, with the front-end worker alone on
  one core and the load generator kept off it (``runtime.tools.rtc_capacity``: the layout, the figures and
  when a run is invalid).

``python -m runtime.tools.rtc_bench latency``;
``python -m runtime.tools.rtc_bench capacity --sessions 16 24 32 40``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
import numpy as np

from runtime.config import RuntimeConfig
from runtime.engine.api import AdmitRequest, BackendStatus, SessionSink, SlotBackend, SlotLease
from runtime.frontend.codecs.protocol import AudioFormat
from runtime.frontend.server import DuplexServer
from runtime.frontend.transports import websocket
from runtime.frontend.transports.webrtc.media import RtpInbound
from runtime.tools import rtc_capacity
from runtime.tools.loadgen import _percentile, run_session, session_url, synthesize_speech
from runtime.tools.rtc_client import RtcCall, encode_packets, local_candidate_nets


class _EchoSlots(SlotBackend):
    """Slots that answer every input frame with itself at once: no model, no tick. ``on_push`` sees each."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.on_lost = []
        self.sinks: dict[str, SessionSink] = {}
        self.on_push: list[float] = []
        self.marks: dict[int, float] = {}

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def status(self) -> BackendStatus:
        return BackendStatus(True, self.slots, self.slots - len(self.sinks), 0, True)

    def check_persona(self, voice_prompt: str | None, text_prompt: str | None) -> None: ...

    async def admit(self, request: AdmitRequest, sink: SessionSink) -> SlotLease:
        self.sinks[request.session_id] = sink
        asyncio.get_running_loop().call_soon(sink.on_prompt_done)
        return SlotLease(request.session_id, slot=len(self.sinks) - 1)

    def push_frame(self, lease: SlotLease, frame: np.ndarray) -> bool:
        arrived = _ARRIVAL.get("now")
        if arrived is not None:
            self.on_push.append(time.monotonic() - arrived)
        sink = self.sinks.get(lease.session_id)
        if sink is not None:
            sink.on_output(frame.copy(), None)
        return True

    def release(self, lease: SlotLease) -> None:
        self.sinks.pop(lease.session_id, None)


_ARRIVAL: dict[str, float | None] = {"now": None}
"""When the network handed the server the audio now being turned into frames (set by the wrappers)."""


def _instrument() -> None:
    """Stamp arrivals: a WebSocket session's audio payload as its transport decodes it (its message just
    arrived), and a WebRTC packet's arrival, carried to the playout slot that decodes it (by the payload's
    identity)."""
    decode_payload = websocket._WsTransport.decode

    def stamped_payload(self: websocket._WsTransport, payload: bytes) -> list[np.ndarray]:
        _ARRIVAL["now"] = time.monotonic()
        return decode_payload(self, payload)

    websocket._WsTransport.decode = stamped_payload  # type: ignore[method-assign]
    arrivals: dict[int, float] = {}
    handle = RtpInbound._handle_rtp_packet
    decode = RtpInbound._decode

    async def stamped_handle(self: RtpInbound, packet: object, arrival_time_ms: int) -> None:
        arrivals[id(packet.payload)] = time.monotonic()  # type: ignore[attr-defined]
        await handle(self, packet, arrival_time_ms)

    def stamped_decode(self: RtpInbound, payload: bytes | None) -> None:
        _ARRIVAL["now"] = None if payload is None else arrivals.pop(id(payload), None)
        decode(self, payload)

    RtpInbound._handle_rtp_packet = stamped_handle  # type: ignore[method-assign]
    RtpInbound._decode = stamped_decode  # type: ignore[method-assign]


def _clip(seconds: float) -> np.ndarray:
    clip = synthesize_speech("Hello, I would like to book a table for two tonight at eight, near the river.")
    while len(clip) < seconds * 24_000:
        clip = np.concatenate([clip, clip])
    return clip[: int(seconds * 24_000)]


def _p(values: list[float], q: float) -> float | None:
    found = _percentile(values, q)
    return None if found is None else round(found, 2)


async def bench_latency(seconds: float, calls: int) -> dict[str, object]:
    """The ``latency`` figures (module docstring)."""
    _instrument()
    backend = _EchoSlots(4)
    config = RuntimeConfig(host="127.0.0.1", port=0, max_sessions=4, auth_mode="off", metrics_cache_s=0,
                           rtc_allowed_candidate_nets=local_candidate_nets())  # fmt: skip
    server = DuplexServer(config, backend)
    await server.start()
    clip = _clip(seconds)
    try:
        backend.on_push.clear()
        await run_session(session_url(f"ws://127.0.0.1:{server.port}", audio_format=AudioFormat.OPUS), clip,
                          audio_format=AudioFormat.OPUS)  # fmt: skip
        websocket = [1e3 * s for s in backend.on_push]
        backend.on_push.clear()
        packets = encode_packets(clip)
        answers, connects = [], []
        async with aiohttp.ClientSession() as http:
            call = RtcCall(f"http://127.0.0.1:{server.port}", packets, loop=False)
            outcome = await call.start(http)
            await asyncio.wait_for(call.connected.wait(), 30)
            while call.track.sent < len(packets):
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            await call.hang_up(http)
            await call.close()
            webrtc = [1e3 * s for s in backend.on_push]
            for _ in range(calls):
                call = RtcCall(f"http://127.0.0.1:{server.port}", packets[:10], loop=False)
                outcome = await call.start(http)
                await asyncio.wait_for(call.connected.wait(), 30)
                assert outcome.answer_s is not None and outcome.connected_s is not None
                answers.append(1e3 * outcome.answer_s)
                connects.append(1e3 * outcome.connected_s)
                await call.hang_up(http)
                await call.close()
    finally:
        await server.close()
    ws50, ws99, rtc50, rtc99 = _p(websocket, 50), _p(websocket, 99), _p(webrtc, 50), _p(webrtc, 99)
    return {
        "frames": {"websocket": len(websocket), "webrtc": len(webrtc)},
        "receive_path_ms": {
            "websocket_p50": ws50,
            "websocket_p99": ws99,
            "webrtc_p50": rtc50,
            "webrtc_p99": rtc99,
        },
        "webrtc_adds_ms": {
            "p50": None if ws50 is None or rtc50 is None else round(rtc50 - ws50, 2),
            "p99": None if ws99 is None or rtc99 is None else round(rtc99 - ws99, 2),
        },
        "post_to_answer_ms": {"p50": _p(answers, 50), "p99": _p(answers, 99), "calls": calls},
        "post_to_connected_ms": {"p50": _p(connects, 50), "p99": _p(connects, 99)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    latency = sub.add_parser("latency")
    latency.add_argument("--seconds", type=float, default=20.0)
    latency.add_argument("--calls", type=int, default=30)
    capacity = sub.add_parser("capacity", description=rtc_capacity.__doc__.split("\n\n")[1])
    capacity.add_argument("--sessions", type=int, nargs="+", default=[16, 24, 32, 40])
    capacity.add_argument("--seconds", type=float, default=30.0, help="speech each session streams (s)")
    capacity.add_argument("--step-ms", default="30", help="the sim model's step (ms)")
    capacity.add_argument("--worker-core", type=int, default=None, help="default: the highest core")
    capacity.add_argument("--worker-nice", type=int, default=None, help="default: the bench's own nice")
    capacity.add_argument("--generator-nice", type=int, default=5, help="added to the bench's nice")
    capacity.add_argument("--stagger-ms", type=float, default=50.0, help="between session starts")
    args = parser.parse_args()
    if args.command == "latency":
        print(json.dumps(asyncio.run(bench_latency(args.seconds, args.calls))))
        return
    try:
        print("machine:", json.dumps(rtc_capacity.describe_machine()), flush=True)
        results = []
        for count in args.sessions:  # one count at a time, each line as soon as it is measured
            [result] = rtc_capacity.bench_capacity(
                [count],
                seconds=args.seconds,
                step_ms=args.step_ms,
                worker_core=args.worker_core,
                worker_nice=args.worker_nice,
                generator_nice=args.generator_nice,
                stagger_s=args.stagger_ms / 1e3,
                clip=_clip(args.seconds),
            )
            results.append(result)
            print(rtc_capacity.dumps(result), flush=True)
    except (ValueError, PermissionError) as error:
        parser.error(str(error))
    print("machine after:", json.dumps(rtc_capacity.describe_machine()))
    print(rtc_capacity.markdown(results))


if __name__ == "__main__":
    main()
