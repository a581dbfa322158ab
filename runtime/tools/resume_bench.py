"""Resume, measured from the client's side: ``python -m runtime.tools.resume_bench --url ws://127.0.0.1:8998``.

Against a node running the ``sim`` model (``DUPLEX_MODEL=sim``: each output frame is its input frame at half
level over a 220 Hz tone, ``runtime.engine.sim``), each trial opens a resumable PCM session
(``resumable=1``), streams frames at real-time pace, drops the TCP connection (no close frame), waits
``--drop-s`` (the caller "goes on talking": those frames are never sent), reconnects with the credential and
streams on, then closes normally. Each input frame carries its index (a constant level per frame), so each
output frame names the input frame it answers.

Per trial: reconnect (the new connection's start) to the ``0x00`` handshake, to the first audio message,
and to the first audio answering a frame sent after the resume; and the share of the conversation's frames
(every frame spoken, the dropped seconds included) never answered. Printed as p50 / p99 over the trials.

``--transport webrtc --url http://127.0.0.1:8998``: the same over ``/api/rtc`` (an aiortc caller whose UDP
path is dropped, then a fresh offer with the credential: ``runtime.tools.resume_bench_rtc``): reconnect to
the answer, to connected, to the 0x00 and to the first audio packet back. Opus does not carry the frames'
levels through, so the share lost is not measured there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from runtime.engine.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.frontend.codecs.kyutai_audio import make_codec
from runtime.frontend.codecs.protocol import AudioFormat, MessageKind, encode_audio
from runtime.frontend.gate.query import RESUME_HEADER
from runtime.tools.loadgen import session_url

if TYPE_CHECKING:
    from runtime.tools.resume_bench_rtc import RtcTrial

__all__ = ["Trial", "frame_index", "indexed_frame", "main", "run_trial"]

FRAME_S = FRAME_SAMPLES / SAMPLE_RATE_HZ
_LEVELS = 256
"""Frame indices are carried modulo this many levels (unwrapped by order)."""
_ENCODER = make_codec(AudioFormat.PCM, 1)[1]


def indexed_frame(index: int) -> np.ndarray:
    """Input frame ``index``: a constant level 0.2 + 0.5 x (index mod 256) / 256 (``[1920]`` float32)."""
    return np.full(FRAME_SAMPLES, 0.2 + 0.5 * (index % _LEVELS) / _LEVELS, dtype=np.float32)


def frame_index(payload: bytes) -> int:
    """The index (mod 256) of the input frame a ``sim`` output frame answers (PCM s16le payload): its mean
    is half the input's level (the tone's mean over its 88 whole periods is 0)."""
    pcm = np.frombuffer(payload, dtype="<i2").astype(np.float32) / 32768.0
    level = 2.0 * float(pcm.mean())
    return round((level - 0.2) * _LEVELS / 0.5) % _LEVELS


@dataclass
class Trial:
    """One drop and resume (ms from the reconnect's start; frame counts)."""

    handshake_ms: float = float("nan")
    first_audio_ms: float = float("nan")
    fresh_audio_ms: float = float("nan")
    gap_ms: float = float("nan")
    spoken: int = 0
    answered: set[int] = field(default_factory=set)

    @property
    def lost_share(self) -> float:
        """Frames spoken (the drop's included) never answered, as a share of all frames spoken."""
        return 1.0 - len(self.answered) / self.spoken if self.spoken else float("nan")


class _Leg:
    """One connection of a trial: sends indexed frames at real-time pace, decodes what comes back."""

    def __init__(self, ws: ClientConnection, trial: Trial, started: float) -> None:
        self.ws, self.trial, self.started = ws, trial, started
        self.handshake_ms = self.first_audio_ms = self.fresh_audio_ms = float("nan")
        self.handshake = asyncio.Event()
        self.metadata: asyncio.Future[dict[str, object]] = asyncio.get_running_loop().create_future()
        self.sent_from: int | None = None  # the first index sent on this connection
        self.last_sent = -1
        self.answered_max = -1
        self.task = asyncio.create_task(self._receive())

    async def _receive(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in self.ws:
                if not isinstance(message, bytes) or not message:
                    continue
                kind, payload = message[0], message[1:]
                now = (time.monotonic() - self.started) * 1e3
                if kind == MessageKind.HANDSHAKE:
                    self.handshake_ms = now
                    self.handshake.set()
                elif kind == MessageKind.METADATA and not self.metadata.done():
                    self.metadata.set_result(json.loads(payload))
                elif kind == MessageKind.AUDIO:
                    index = self._unwrap(frame_index(payload))
                    self.trial.answered.add(index)
                    self.answered_max = max(self.answered_max, index)
                    if np.isnan(self.first_audio_ms):
                        self.first_audio_ms = now
                    fresh = self.sent_from is not None and index >= self.sent_from
                    if fresh and np.isnan(self.fresh_audio_ms):
                        self.fresh_audio_ms = now

    def _unwrap(self, level: int) -> int:
        """The most recent index sent with this level."""
        base = max(self.last_sent, 0)
        return base - ((base - level) % _LEVELS)

    async def stream(self, first: int, frames: int) -> int:
        self.sent_from = first
        next_send = time.monotonic()
        for index in range(first, first + frames):
            await self.ws.send(encode_audio(_ENCODER.encode(indexed_frame(index))))
            self.last_sent = index
            next_send += FRAME_S
            await asyncio.sleep(max(0.0, next_send - time.monotonic()))
        return first + frames


async def run_trial(
    base_url: str, *, before_s: float, drop_s: float, after_s: float, timeout_s: float = 30.0
) -> Trial:
    """One session: stream ``before_s``, drop, wait ``drop_s``, resume, stream ``after_s``, close."""
    trial = Trial()
    ws = await connect(session_url(base_url, resumable=1), max_size=2**20, compression=None, proxy=None)
    leg = _Leg(ws, trial, time.monotonic())
    await asyncio.wait_for(leg.handshake.wait(), timeout_s)
    credential = str((await asyncio.wait_for(leg.metadata, timeout_s))["resume"])
    index = await leg.stream(0, round(before_s / FRAME_S))
    ws.transport.abort()  # no close frame: a lost connection
    leg.task.cancel()
    await asyncio.sleep(drop_s)
    index += round(drop_s / FRAME_S)  # spoken while the connection was down: never sent
    started = time.monotonic()
    headers = {RESUME_HEADER: credential}  # not in the URL: proxies and load balancers log URLs (issue 34)
    ws = await connect(
        session_url(base_url), max_size=2**20, compression=None, proxy=None, additional_headers=headers
    )
    resumed = _Leg(ws, trial, started)
    resumed.last_sent = index - 1
    await asyncio.wait_for(resumed.handshake.wait(), timeout_s)
    metadata = await asyncio.wait_for(resumed.metadata, timeout_s)
    trial.gap_ms = float(str(metadata.get("gap_ms", "nan")))
    index = await resumed.stream(index, round(after_s / FRAME_S))
    deadline = time.monotonic() + timeout_s
    while resumed.answered_max < index - 1 and time.monotonic() < deadline:  # the last frames' answers
        await asyncio.sleep(0.02)
    await ws.close()
    await resumed.task
    trial.spoken = index
    trial.handshake_ms, trial.first_audio_ms = resumed.handshake_ms, resumed.first_audio_ms
    trial.fresh_audio_ms = resumed.fresh_audio_ms
    return trial


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8998", help="the node (running DUPLEX_MODEL=sim)")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--before-s", type=float, default=3.0, help="streamed before the drop (s)")
    parser.add_argument("--drop-s", type=float, default=2.0, help="how long the connection stays down (s)")
    parser.add_argument("--after-s", type=float, default=2.0, help="streamed after the resume (s)")
    parser.add_argument(
        "--transport",
        choices=("websocket", "webrtc"),
        default="websocket",
        help="websocket: /api/chat at --url ws://...; webrtc: /api/rtc at --url http://...",
    )
    args = parser.parse_args(argv)
    if args.transport == "webrtc":
        _main_rtc(args)
        return

    async def run() -> list[Trial]:
        return [
            await run_trial(args.url, before_s=args.before_s, drop_s=args.drop_s, after_s=args.after_s)
            for _ in range(args.trials)
        ]

    trials = asyncio.run(run())
    shape = f"{args.before_s:g} s + drop {args.drop_s:g} s + {args.after_s:g} s"
    print(f"{len(trials)} trials, {shape}, {args.url}")
    for name, values in (
        ("reconnect -> handshake (ms)", [t.handshake_ms for t in trials]),
        ("reconnect -> first audio (ms)", [t.first_audio_ms for t in trials]),
        ("reconnect -> audio of a new frame (ms)", [t.fresh_audio_ms for t in trials]),
        ("gap the server measured (ms)", [t.gap_ms for t in trials]),
        ("frames never answered (% of spoken)", [100 * t.lost_share for t in trials]),
    ):
        print(f"  {name:40s} p50 {_pct(values, 50):8.1f}   p99 {_pct(values, 99):8.1f}")
    drop_share = 100 * round(args.drop_s / FRAME_S) / max(1, trials[0].spoken)
    print(f"  (the drop's own frames, never sent: {drop_share:.1f} % of those spoken)")


def _main_rtc(args: argparse.Namespace) -> None:
    from runtime.tools.resume_bench_rtc import run_rtc_trial
    from runtime.tools.rtc_client import encode_packets

    url = args.url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
    t = np.arange(round(SAMPLE_RATE_HZ * 2.0)) / SAMPLE_RATE_HZ
    packets = encode_packets((0.3 * np.sin(2 * np.pi * 220.0 * t)).astype(np.float32))

    async def run() -> list[RtcTrial]:
        return [
            await run_rtc_trial(
                url, packets, before_s=args.before_s, drop_s=args.drop_s, after_s=args.after_s
            )
            for _ in range(args.trials)
        ]

    trials = asyncio.run(run())
    shape = f"{args.before_s:g} s + drop {args.drop_s:g} s + {args.after_s:g} s"
    print(f"{len(trials)} WebRTC trials, {shape}, {url}")
    for name, values in (
        ("reconnect -> answer (ms)", [t.answer_ms for t in trials]),
        ("reconnect -> connected (ms)", [t.connected_ms for t in trials]),
        ("reconnect -> handshake 0x00 (ms)", [t.handshake_ms for t in trials]),
        ("reconnect -> first audio (ms)", [t.first_audio_ms for t in trials]),
        ("gap the server measured (ms)", [t.gap_ms for t in trials]),
    ):
        print(f"  {name:40s} p50 {_pct(values, 50):8.1f}   p99 {_pct(values, 99):8.1f}")


if __name__ == "__main__":
    main()
