"""WebRTC media of one session, around aiortc's RTP stack but past its codecs and its jitter buffer.

Outbound (:class:`OpusPacketTrack`): the session's 80 ms frames, encoded by our own mono Opus encoder
(``runtime.frontend.codecs.opus_rtp``) into four 20 ms packets, handed to aiortc's RTP sender as pre-encoded
``av.Packet`` objects, paced 20 ms apart: aiortc's sender packs them as they are (no 48 kHz stereo
96 kbps re-encode, which costs a thread and several times the CPU). A frame's first packet is due at
once and each packet is encoded when it is taken, so the first leaves after one encode (~0.5 ms), not
four.

Inbound (:class:`RtpInbound`): every RTP packet of the audio receiver goes straight into our jitter buffer
(``runtime.frontend.transports.webrtc.jitter``) instead of aiortc's (which adds ~80 ms and stays 280 ms
behind after a loss:
aiortc issue 543), then is decoded by libopus at 24 kHz (a missing packet: libopus' concealment) and
handed on as float32 samples (libopus' int16 k as k / 32768), 20 ms at a time: an in-order packet within
the hook's own call, a missing one at its deadline by a playout task. The hook is the receiver's
``_handle_rtp_packet``, replaced on the instance (aiortc 1.16.0 routes each packet to it; aiortc's
decoder thread is started and stays idle).

:class:`FirstAudioTrace` stamps a session's first audio at each step on the node (logged when the session
ends, ``WebRTC session <id> first audio: {...}``): docs/benchmarks.md reads it beside the load generator's
own stamps.
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import Any

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtcrtpreceiver import RTCRtpReceiver

from runtime.engine.model_presets import FRAME_SAMPLES
from runtime.frontend.codecs.opus_rtp import PACKET_SAMPLES, OpusDecoder, OpusEncoder, OpusError
from runtime.frontend.transports.webrtc.jitter import JitterBuffer
from runtime.metrics import RuntimeMetrics

__all__ = ["OUTBOUND_QUEUE_PACKETS", "PACKET_S", "FirstAudioTrace", "OpusPacketTrack", "RtpInbound"]

log = logging.getLogger(__name__)

PACKET_S = 0.02
"""One Opus packet: 20 ms."""
OUTBOUND_QUEUE_PACKETS = 50
"""Packets (1 s) an outbound track holds before it drops the oldest (a peer that cannot keep up)."""
_RTP_TIME_BASE = fractions.Fraction(1, 48_000)
_RTP_STEP = 960  # 20 ms at Opus's 48 kHz RTP clock
_INT16_SCALE = np.float32(1 / 32768)
"""Int16 full scale, as ``runtime.frontend.codecs.kyutai_audio``'s PCM: sample k <-> float k / 32768."""
_TRACED_ARRIVALS = 256
"""Inbound packets whose arrival time is kept (by sequence number) until the first frame is traced."""


@dataclass
class FirstAudioTrace:
    """When one WebRTC session's first audio passed each step on the node (monotonic seconds, the clock
    the load generator's processes read too, so a client's stamps compare with these). None: not yet.

    Attributes:
        connected_at: ICE and DTLS connected; spent_at: the token spent (media may flow from then);
            handshake_at: 0x00 handed to the DataChannel (the prompt has run: the session takes audio).
        first_rtp_at: the first RTP packet arrived (taken or not).
        taken_arrived_at, taken_at: the first packet the session took: its arrival, and when the jitter
            buffer handed its samples to the session (the difference is the buffer's wait, plus decode).
        frame_arrived_at, frame_at: the same for the packet that completed the session's first 1920-sample
            frame (the fourth taken packet: the frame then goes to the engine, as a WebSocket frame does on
            arrival).
        audio_put_at: the first 80 ms of the session's audio handed to the outbound track.
        audio_sent_at: its first packet handed to aiortc's RTP sender (encrypted and sent at once).
    """

    connected_at: float | None = None
    spent_at: float | None = None
    handshake_at: float | None = None
    first_rtp_at: float | None = None
    taken_arrived_at: float | None = None
    taken_at: float | None = None
    frame_arrived_at: float | None = None
    frame_at: float | None = None
    audio_put_at: float | None = None
    audio_sent_at: float | None = None

    def stamps(self) -> dict[str, float | None]:
        """Every stamp by name (monotonic s)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def terms_ms(self) -> dict[str, float | None]:
        """The node's own terms of a WebRTC first audio (ms; None where a stamp is missing): the jitter
        buffer's hold of the frame-completing packet (``jitter_hold``), the frame's way through the engine
        to the outbound track (``engine``: tick phase, ticks, the step, as on ``/api/chat``), and the
        outbound track's first packet (``pacing``: encode and the sender's pick-up)."""

        def ms(later: float | None, earlier: float | None) -> float | None:
            return None if later is None or earlier is None else round((later - earlier) * 1e3, 3)

        return {
            "jitter_hold": ms(self.frame_at, self.frame_arrived_at),
            "frame_assembly": ms(self.frame_at, self.taken_at),
            "engine": ms(self.audio_put_at, self.frame_at),
            "pacing": ms(self.audio_sent_at, self.audio_put_at),
            "node_first_audio": ms(self.audio_sent_at, self.frame_arrived_at),
        }


class OpusPacketTrack(MediaStreamTrack):
    """The session's outbound audio as Opus packets, 20 ms apart.

    Each 80 ms frame is queued as four 20 ms slices due now and 20, 40, 60 ms later; a slice is encoded
    when the RTP sender takes it, so a frame's first packet leaves after one encode, not four.

    Args:
        complexity: libopus complexity 0..10.
        clock: monotonic seconds (the event loop's by default).
        on_dropped: called with a count when packets are dropped (the queue was full).
        trace: where the first frame's put and its first packet's send are stamped.
        sleep: waits that many seconds (``asyncio.sleep``; injected in tests with ``clock``).
    """

    kind = "audio"

    def __init__(
        self,
        complexity: int = 10,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_dropped: Callable[[int], None] | None = None,
        trace: FirstAudioTrace | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        super().__init__()
        self.encoder = OpusEncoder(complexity)
        self.clock = clock
        self.sleep = sleep
        self.on_dropped = on_dropped
        self.trace = trace or FirstAudioTrace()
        self._queue: deque[tuple[np.ndarray, float]] = deque()
        self._ready = asyncio.Event()
        self._pts = 0
        self.packets_sent = 0

    def put_frame(self, frame: np.ndarray) -> None:
        """One ``[1920]`` float32 frame (80 ms at 24 kHz): four packets, due now and 20, 40, 60 ms later.

        Raises:
            ValueError: not 1920 samples.
        """
        flat = np.asarray(frame, dtype=np.float32).reshape(-1)
        if flat.size != FRAME_SAMPLES:
            raise ValueError(f"expected one frame of {FRAME_SAMPLES} samples, got {flat.size}")
        now = self.clock()
        if self.trace.audio_put_at is None:
            self.trace.audio_put_at = now
        dropped = 0
        for index, start in enumerate(range(0, FRAME_SAMPLES, PACKET_SAMPLES)):
            if len(self._queue) >= OUTBOUND_QUEUE_PACKETS:
                self._queue.popleft()
                dropped += 1
            self._queue.append((flat[start : start + PACKET_SAMPLES], now + index * PACKET_S))
        if dropped and self.on_dropped is not None:
            self.on_dropped(dropped)
        self._ready.set()

    async def recv(self) -> av.Packet:  # type: ignore[override]  # aiortc's senders take packets too
        """The next packet at its time, encoded then (aiortc's RTP sender calls this in a loop).

        Raises:
            MediaStreamError: the track was stopped.
        """
        while not self._queue:
            if self.readyState != "live":
                raise MediaStreamError
            self._ready.clear()
            await self._ready.wait()
        pcm, due = self._queue.popleft()
        delay = due - self.clock()
        if delay > 0:
            await self.sleep(delay)
        if self.readyState != "live":
            raise MediaStreamError
        packet = av.Packet(self.encoder.encode_packet(pcm))
        packet.pts = self._pts
        packet.time_base = _RTP_TIME_BASE
        self._pts += _RTP_STEP
        self.packets_sent += 1
        if self.trace.audio_sent_at is None:
            self.trace.audio_sent_at = self.clock()
        return packet

    def stop(self) -> None:
        super().stop()
        self._ready.set()
        self.encoder.close()


class RtpInbound:
    """One session's inbound audio: RTP packets -> jitter buffer -> libopus -> ``on_pcm``.

    Args:
        on_pcm: called with float32 samples ``[T]`` at 24 kHz in [-1, 1) (480 per 20 ms packet), in order,
            on the event loop;
            returns whether the session took them (False: dropped, e.g. before its handshake).
        metrics: where packets received, late, concealed, lost and the buffer's depth are counted.
        clock: monotonic seconds (injected in tests).
        trace: where the first packet, the first taken one and the one completing the first frame are
            stamped (:class:`FirstAudioTrace`).

    Attributes:
        buffer: the jitter buffer.
        last_packet_at: the clock's time of the last RTP packet (None before the first).
    """

    def __init__(
        self,
        on_pcm: Callable[[np.ndarray], bool],
        metrics: RuntimeMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        trace: FirstAudioTrace | None = None,
    ) -> None:
        self.on_pcm = on_pcm
        self.metrics = metrics
        self.clock = clock
        self.trace = trace or FirstAudioTrace()
        self._arrivals: dict[int, float] = {}  # 16-bit seq -> arrival, until the first frame is traced
        self._taken_samples = 0
        self._seq_out = 0  # the extended sequence number of the slot being decoded
        self.buffer = JitterBuffer(clock)
        self.decoder = OpusDecoder()
        self.last_packet_at: float | None = None
        self.bad_packets = 0
        self._payload_types: set[int] = set()
        self._ssrc: int | None = None
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._counted = (0, 0, 0)  # received, late, concealed already added to the metrics

    def attach(self, receiver: RTCRtpReceiver, payload_types: set[int]) -> None:
        """Take ``receiver``'s RTP packets of the Opus ``payload_types`` from now on, and start playout."""
        self._payload_types = payload_types
        receiver._handle_rtp_packet = self._handle_rtp_packet  # type: ignore[method-assign]
        self._task = asyncio.create_task(self._playout(), name="rtp playout")

    async def _handle_rtp_packet(self, packet: Any, arrival_time_ms: int) -> None:
        """aiortc's receiver hook (called on the event loop for each decrypted RTP packet)."""
        if packet.payload_type not in self._payload_types or not packet.payload:
            return
        if self._ssrc is None:
            self._ssrc = packet.ssrc
        elif packet.ssrc != self._ssrc:
            return  # one stream per session: a second SSRC is ignored
        now = self.last_packet_at = self.clock()
        if self.trace.first_rtp_at is None:
            self.trace.first_rtp_at = now
        if self.trace.frame_at is None and len(self._arrivals) < _TRACED_ARRIVALS:
            self._arrivals[packet.sequence_number] = now
        self.buffer.push(packet.sequence_number, packet.timestamp, packet.payload)
        self._deliver()  # in order: handed on now, not one event-loop turn later in the playout task
        self._arrived.set()  # the playout task re-reads the deadline

    def _deliver(self) -> None:
        """Pop whatever is due now; decode and hand it on."""
        for slot in self.buffer.pop():
            self._seq_out = slot.seq
            self._decode(slot.payload)
        self.metrics.rtp_jitter_depth.observe(self.buffer.depth)

    async def _playout(self) -> None:
        """Conceal a missing packet at its deadline (arrivals are delivered by the hook itself)."""
        buffer = self.buffer
        while True:
            self._deliver()
            deadline = buffer.deadline()
            self._arrived.clear()
            if deadline is None:
                await self._arrived.wait()
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - self.clock())):
                    await self._arrived.wait()

    def _decode(self, payload: bytes | None) -> None:
        """Decode (or conceal) the slot ``_seq_out`` and hand it on; stamp the trace."""
        conceal = max(PACKET_SAMPLES // 8, int(round(self.buffer.packet_s * 24_000)))
        try:
            pcm = self.decoder.decode(payload, conceal)
        except OpusError:
            self.bad_packets += 1
            pcm = self.decoder.decode(None, conceal)
        taken = self.on_pcm(pcm.astype(np.float32) * _INT16_SCALE)
        trace = self.trace
        if not taken or trace.frame_at is not None:
            return
        now = self.clock()
        arrived = self._arrivals.get(self._seq_out % (1 << 16)) if payload is not None else None
        if trace.taken_at is None:
            trace.taken_at, trace.taken_arrived_at = now, arrived
        self._taken_samples += len(pcm)
        if self._taken_samples >= FRAME_SAMPLES:  # the session's assembler has its first whole frame
            trace.frame_at, trace.frame_arrived_at = now, arrived
            self._arrivals.clear()

    def count(self) -> None:
        """Add what happened since the last call to the metrics (call now and then, and at the end)."""
        stats = self.buffer.stats
        received, late, concealed = self._counted
        self.metrics.rtp_packets.labels(outcome="received").inc(stats.received - received)
        self.metrics.rtp_packets.labels(outcome="late").inc(stats.late - late)
        self.metrics.rtp_packets.labels(outcome="concealed").inc(stats.concealed - concealed)
        self._counted = (stats.received, stats.late, stats.concealed)

    def close(self) -> None:
        """Stop playout, count the rest (lost: slots concealed whose packet never came), free the decoder."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.count()
        stats = self.buffer.stats
        self.metrics.rtp_packets.labels(outcome="lost").inc(max(0, stats.concealed - stats.late))
        self.decoder.close()
