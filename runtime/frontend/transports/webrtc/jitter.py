"""The receive side's jitter buffer for WebRTC audio (``/api/rtc``): RTP packets in, in-order 20 ms packets
(or a concealment mark for a missing one) out. Pure: no socket, no codec, the clock injected.

Why our own: aiortc 1.16's audio jitter buffer (capacity 16, prefetch 4) adds about 80 ms fixed and, after
one lost packet, stays 14 packets (280 ms) behind for the rest of the call (aiortc issue 543, reproduced
on 1.16.0). This one is deadline-based:

- A packet that arrives in order is delivered at once (a clean path adds no wait).
- A missing packet is waited for until its **deadline**: the time it would have arrived on the fastest
  path seen lately (the minimum transit over the last :data:`WINDOW_PACKETS` packets) plus the **target
  delay**. Past it, the caller conceals it (Opus packet-loss concealment, or silence) and playout moves on;
  the packet, should it still come, is dropped as late.
- The target delay is one packet (20 ms) on a clean path; under jitter it grows to one packet plus the
  95th percentile of the recent delay over that fastest transit, rounded up to whole packets, at most
  :data:`MAX_TARGET_MS` (60 ms). Losses do not enter it: only arrivals do.
- The buffer never holds more than :data:`CAP_MS` (120 ms) behind the newest packet: a packet that would
  make it longer flushes the oldest (delivered when present, concealed when missing).
- After more than ``CAP_MS`` of concealment with nothing newer buffered (the sender paused, or the path
  went away), it stops concealing and waits; the next packet newer than the last one delivered restarts
  playout from itself (a stale burst after a long stall is dropped as late).

So the receive lag (packets that have arrived and wait behind a gap) is at most the target delay's worth
less one packet, and a loss never leaves it longer.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "CAP_MS",
    "MAX_TARGET_MS",
    "PACKET_MS",
    "RTP_CLOCK_HZ",
    "WINDOW_PACKETS",
    "JitterBuffer",
    "JitterStats",
    "Playout",
]

RTP_CLOCK_HZ = 48_000
"""Opus's RTP clock (RFC 7587, 4.1): 48 kHz whatever the sample rate."""
PACKET_MS = 20
"""The packet duration assumed for a missing packet until two consecutive packets show the real one."""
MAX_TARGET_MS = 60
"""Most the target delay adapts to under jitter (issue 22)."""
CAP_MS = 120
"""Hard cap: never more than this much audio held behind the next packet out (issue 22)."""
WINDOW_PACKETS = 50
"""Arrivals the transit estimate looks back over (1 s of 20 ms packets)."""
_SEQ_MOD = 1 << 16
_TS_MOD = 1 << 32


@dataclass(frozen=True)
class Playout:
    """One 20 ms slot of playout, in order.

    Attributes:
        seq: the extended (unwrapped) RTP sequence number.
        payload: the packet's payload (an Opus packet), or None: missing, to be concealed.
    """

    seq: int
    payload: bytes | None


@dataclass
class JitterStats:
    """Counters of one buffer (packets, not time).

    Attributes:
        received: packets pushed (duplicates and late ones included).
        delivered: packets handed out with their payload.
        concealed: slots handed out missing (to conceal).
        late: packets dropped because their slot had already been played or concealed.
        duplicates: packets dropped because the same sequence number is already buffered.
        max_lag: the most packets ever held after a :meth:`JitterBuffer.pop` (``JitterBuffer.lag``).
    """

    received: int = 0
    delivered: int = 0
    concealed: int = 0
    late: int = 0
    duplicates: int = 0
    max_lag: int = 0


def _unwrap(value: int, reference: int, modulus: int) -> int:
    """``value`` (mod ``modulus``) as the integer nearest ``reference``."""
    delta = (value - reference) % modulus
    if delta >= modulus // 2:
        delta -= modulus
    return reference + delta


class JitterBuffer:
    """Deadline-based playout of one RTP audio stream.

    Args:
        clock: monotonic seconds (injected; tests drive it by hand).
        max_target_ms: most the target delay grows to (ms; default 60).
        cap_ms: most audio held (ms; default 120).

    Raises:
        ValueError: ``max_target_ms`` under one packet, or ``cap_ms`` under ``max_target_ms``.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        max_target_ms: float = MAX_TARGET_MS,
        cap_ms: float = CAP_MS,
    ) -> None:
        if max_target_ms < PACKET_MS:
            raise ValueError(f"max_target_ms must be >= {PACKET_MS} (one packet), got {max_target_ms}")
        if cap_ms < max_target_ms:
            raise ValueError(f"cap_ms must be >= max_target_ms ({max_target_ms}), got {cap_ms}")
        self.clock = clock
        self.max_target_s = max_target_ms / 1000
        self.cap_s = cap_ms / 1000
        self.stats = JitterStats()
        self._packets: dict[int, tuple[int, bytes]] = {}  # ext seq -> (ext timestamp, payload)
        self._next: int | None = None  # the next extended sequence number out
        self._newest: int | None = None
        self._ref_seq = 0  # the last extended sequence number seen, for unwrapping
        self._ref_ts = 0
        self._last_out: tuple[int, int] | None = None  # (ext seq, ext timestamp) of the last packet out
        self._step = RTP_CLOCK_HZ * PACKET_MS // 1000  # timestamp units per packet
        self._transits: deque[float] = deque(maxlen=WINDOW_PACKETS)
        self._concealed_run = 0
        self.target_s = PACKET_MS / 1000

    # --- state ----------------------------------------------------------------------------------------

    @property
    def packet_s(self) -> float:
        """One packet's duration (s), from the timestamps seen (20 ms until two consecutive packets)."""
        return self._step / RTP_CLOCK_HZ

    @property
    def depth(self) -> int:
        """Packets buffered now (waiting behind a gap)."""
        return len(self._packets)

    @property
    def lag(self) -> int:
        """The receive lag in packets: audio that has arrived and is not out yet (held behind a gap); the
        same as :attr:`depth`. Times the packet duration, it is the delay this buffer adds now."""
        return len(self._packets)

    @property
    def _paused(self) -> bool:
        """Concealment has run for the cap with nothing newer buffered: the sender paused or went away."""
        return not self._packets and self._concealed_run * self.packet_s >= self.cap_s

    def _fastest_transit(self) -> float:
        return min(self._transits)

    def _media_s(self, ext_ts: int) -> float:
        return ext_ts / RTP_CLOCK_HZ

    def _expected_ts(self, seq: int) -> int:
        """The timestamp slot ``seq`` has, or would have had."""
        held = self._packets.get(seq)
        if held is not None:
            return held[0]
        assert self._last_out is not None
        last_seq, last_ts = self._last_out
        return last_ts + (seq - last_seq) * self._step

    def deadline(self) -> float | None:
        """When the next packet out, if it is still missing, is to be concealed (monotonic s); None when
        nothing waits (no packet yet, or concealment has stopped for a pause)."""
        if self._next is None or self._last_out is None or not self._transits:
            return None
        if self._paused:
            return None
        expected = self._media_s(self._expected_ts(self._next)) + self._fastest_transit()
        return expected + self.target_s

    # --- in -------------------------------------------------------------------------------------------

    def push(self, seq: int, timestamp: int, payload: bytes) -> None:
        """One RTP packet arrived now: ``seq`` its 16-bit sequence number, ``timestamp`` its 32-bit RTP
        timestamp (48 kHz), ``payload`` its Opus packet. Late and duplicate packets are counted and dropped.
        """
        now = self.clock()
        self.stats.received += 1
        first = self._next is None
        ext_seq = seq if first else _unwrap(seq, self._ref_seq, _SEQ_MOD)
        ext_ts = timestamp if first else _unwrap(timestamp, self._ref_ts, _TS_MOD)
        if self._next is None or (self._paused and ext_seq >= self._next - self._concealed_run):
            self._restart(ext_seq, ext_ts)
        assert self._next is not None
        if ext_seq < self._next:
            self.stats.late += 1
            return
        if ext_seq in self._packets:
            self.stats.duplicates += 1
            return
        if ext_seq >= self._ref_seq:
            self._ref_seq, self._ref_ts = ext_seq, ext_ts
        self._packets[ext_seq] = (ext_ts, payload)
        if self._newest is None or ext_seq > self._newest:
            self._newest = ext_seq
        self._transits.append(now - self._media_s(ext_ts))
        self._adapt()

    def _restart(self, ext_seq: int, ext_ts: int) -> None:
        """Start (or restart after a pause) playout at this packet."""
        self._next = ext_seq
        self._ref_seq, self._ref_ts = ext_seq, ext_ts
        self._last_out = (ext_seq - 1, ext_ts - self._step)
        self._newest = None
        self._transits.clear()
        self._concealed_run = 0

    def _adapt(self) -> None:
        """The target delay: one packet plus the 95th percentile of the recent delay over the fastest
        transit, in whole packets, at most ``max_target_s``."""
        fastest = self._fastest_transit()
        delays = sorted(transit - fastest for transit in self._transits)
        p95 = delays[min(len(delays) - 1, math.ceil(0.95 * len(delays)) - 1)]
        packet = self.packet_s
        packets = 1 + math.ceil(round(p95 / packet, 6))
        self.target_s = min(self.max_target_s, packets * packet)

    # --- out ------------------------------------------------------------------------------------------

    def pop(self) -> list[Playout]:
        """Every slot due now, in order: buffered packets in sequence, a missing one once its deadline has
        passed (``payload`` None), and whatever the cap forces out."""
        out: list[Playout] = []
        if self._next is None:
            return out
        now = self.clock()
        while True:
            if self._next in self._packets:
                out.append(self._take())
                continue
            if self._newest is not None and self._newest + 1 - self._next > self._cap_packets():
                out.append(self._conceal())
                continue
            deadline = self.deadline()
            if deadline is not None and now >= deadline:
                out.append(self._conceal())
                continue
            break
        self.stats.max_lag = max(self.stats.max_lag, self.lag)
        return out

    def _cap_packets(self) -> int:
        return max(1, int(round(self.cap_s / self.packet_s)))

    def _take(self) -> Playout:
        assert self._next is not None
        seq = self._next
        ts, payload = self._packets.pop(seq)
        if self._last_out is not None and self._last_out[0] == seq - 1 and ts > self._last_out[1]:
            self._step = ts - self._last_out[1]
        self._last_out = (seq, ts)
        self._next = seq + 1
        self._concealed_run = 0
        self.stats.delivered += 1
        return Playout(seq, payload)

    def _conceal(self) -> Playout:
        assert self._next is not None
        seq = self._next
        self._last_out = (seq, self._expected_ts(seq))
        self._next = seq + 1
        self._concealed_run += 1
        self.stats.concealed += 1
        return Playout(seq, None)
