"""The WebRTC receive side's jitter buffer (runtime/frontend/transports/webrtc/jitter.py) on synthetic
arrival patterns: a clean
path, loss, reorder, 20 ms jitter, a delay spike, a pause, wraparound. Time is an injected clock; every
bound is counted in packets (20 ms each)."""

from __future__ import annotations

import random

import pytest

from runtime.frontend.transports.webrtc.jitter import CAP_MS, JitterBuffer, Playout

STEP = 960  # 20 ms at 48 kHz


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def simulate(arrivals: list[tuple[float, int, int]], *, seed_seq: int = 0) -> tuple[JitterBuffer, list, list]:
    """Feed ``(arrival_s, seq, ts)`` in arrival order, popping at every arrival and at every deadline in
    between (what the session's playout task does). Returns the buffer, ``[(time, Playout)]`` and the lag
    after each pop ``[(time, lag)]``."""
    clock = Clock()
    buffer = JitterBuffer(clock)
    out: list[tuple[float, Playout]] = []
    lags: list[tuple[float, int]] = []

    def pop_at(t: float) -> None:
        clock.now = t
        for item in buffer.pop():
            out.append((t, item))
        lags.append((t, buffer.lag))

    for arrival, seq, ts in sorted(arrivals, key=lambda a: a[0]):
        while True:
            deadline = buffer.deadline()
            if deadline is None or deadline >= arrival:
                break
            pop_at(deadline)
        clock.now = arrival
        buffer.push(seq % 65536, ts % 2**32, seq.to_bytes(4, "big"))
        pop_at(arrival)
    while buffer.depth:  # what is still held comes out at its deadlines (not the end of stream's silence)
        deadline = buffer.deadline()
        assert deadline is not None
        pop_at(deadline)
    return buffer, out, lags


def stream(count: int, *, start: int = 0, t0: float = 100.0) -> list[tuple[float, int, int]]:
    return [(t0 + i * 0.02, start + i, (start + i) * STEP) for i in range(count)]


def test_clean_path_delivers_every_packet_on_arrival() -> None:
    buffer, out, lags = simulate(stream(500))
    assert [p.seq for _, p in out] == list(range(500))
    assert all(p.payload is not None for _, p in out)
    assert all(t == pytest.approx(100.0 + p.seq * 0.02) for t, p in out)  # no wait at all
    assert max(lag for _, lag in lags) == 0
    assert buffer.target_s == pytest.approx(0.02)  # one packet
    assert buffer.stats.concealed == 0 and buffer.stats.late == 0


def test_a_lost_packet_is_concealed_at_its_deadline_and_lag_does_not_grow_after() -> None:
    arrivals = [a for a in stream(500) if a[1] != 100]
    buffer, out, lags = simulate(arrivals)
    assert [p.seq for _, p in out] == list(range(500))
    concealed = [(t, p) for t, p in out if p.payload is None]
    assert [p.seq for _, p in concealed] == [100]
    # deadline: its on-time arrival (100 + 100 * 20 ms) plus the one-packet target
    assert concealed[0][0] == pytest.approx(100.0 + 100 * 0.02 + 0.02)
    assert max(lag for t, lag in lags if t > 100.0 + 101 * 0.02) == 0  # aiortc stays 14 packets behind here
    assert buffer.stats.concealed == 1


def test_reordered_pairs_come_out_in_order_without_concealment() -> None:
    """Every even packet from 2 on arrives 15 ms early, ahead of the odd one before it (0 2 1 4 3 ...)."""
    arrivals = [(t - 0.015 if seq and seq % 2 == 0 else t, seq, ts) for t, seq, ts in stream(400)]
    buffer, out, lags = simulate(arrivals)
    assert [p.seq for _, p in out] == list(range(400))
    assert buffer.stats.concealed == 0
    assert max(lag for _, lag in lags) <= 1


def test_a_packet_after_its_deadline_is_dropped_as_late() -> None:
    arrivals = stream(50)
    late = arrivals.pop(20)
    arrivals.append((late[0] + 0.5, late[1], late[2]))  # 500 ms late
    buffer, out, _ = simulate(arrivals)
    assert [p.seq for _, p in out] == list(range(50))
    assert buffer.stats.late == 1 and buffer.stats.concealed == 1


def test_duplicates_are_dropped() -> None:
    arrivals = stream(30)
    arrivals[10] = (100.0 + 10 * 0.02 + 0.008, 10, 10 * STEP)  # 10 comes after 11 (early) ...
    arrivals[11] = (100.0 + 10 * 0.02 + 0.005, 11, 11 * STEP)
    arrivals.append((100.0 + 10 * 0.02 + 0.006, 11, 11 * STEP))  # ... which arrives twice, while held
    buffer, out, _ = simulate(arrivals)
    assert [p.seq for _, p in out] == list(range(30))
    assert buffer.stats.duplicates == 1


@pytest.mark.parametrize("loss", [0.01, 0.03, 0.05])
def test_jitter_loss_and_reorder_for_60_s_keep_the_lag_at_most_60_ms_and_flat(loss: float) -> None:
    """20 ms of uniform jitter (which reorders packets too) and random loss for 60 s (3000 packets)."""
    rng = random.Random(22)
    arrivals = [(t + rng.uniform(0, 0.02), seq, ts) for t, seq, ts in stream(3000) if rng.random() >= loss]
    buffer, out, lags = simulate(arrivals)
    assert [p.seq for _, p in out] == list(range(3000))  # every slot out once, in order
    assert 0.02 < buffer.target_s <= 0.06
    assert max(lag for _, lag in lags) <= 3  # 60 ms
    first, last = [lag for t, lag in lags if t < 110.0], [lag for t, lag in lags if t > 150.0]
    assert max(last) <= max(first)  # no growth
    lost = 3000 - len(arrivals)
    assert buffer.stats.concealed >= lost
    assert buffer.stats.concealed == lost + buffer.stats.late  # a concealed packet that came later was late


def test_a_delay_spike_never_holds_more_than_the_cap() -> None:
    """A 400 ms stall, its 20 packets arriving together just after the next one: the buffer conceals for
    the cap (6 packets), then waits; playout restarts at the newest packet and the stale burst is dropped
    as late: nothing held past the cap, no lag after it."""
    arrivals = []
    for t, seq, ts in stream(300):
        if 100 <= seq < 120:
            t = 100.0 + 120 * 0.02 + 0.001
        arrivals.append((t, seq, ts))
    buffer, out, lags = simulate(arrivals)
    assert [p.seq for _, p in out] == list(range(106)) + list(range(120, 300))
    assert [p.seq for _, p in out if p.payload is None] == list(range(100, 106))
    assert buffer.stats.late == 20
    assert max(lag for _, lag in lags) <= CAP_MS // 20
    assert max(lag for t, lag in lags if t > 100.0 + 120 * 0.02) == 0


def test_a_pause_stops_concealment_after_the_cap_and_playout_restarts() -> None:
    arrivals = stream(100) + stream(100, start=100, t0=100.0 + 100 * 0.02 + 2.0)  # 2 s pause
    buffer, out, _ = simulate(arrivals)
    concealed = [p for _, p in out if p.payload is None]
    # the pause is concealed for at most the cap (6 packets), then nothing until the sender comes back
    assert len(concealed) <= CAP_MS // 20
    assert [p.seq for _, p in out if p.payload is not None] == list(range(200))


def test_sequence_and_timestamp_wraparound() -> None:
    start = 65536 - 50
    arrivals = [(t, seq, (seq * STEP) + (2**32 - 10 * STEP)) for t, seq, _ in stream(100, start=start)]
    arrivals = [a for a in arrivals if a[1] != 65536 + 3]  # lose one just after the wrap
    buffer, out, lags = simulate(arrivals)
    assert [p.seq for _, p in out] == list(range(start, start + 100))
    assert [p.seq for _, p in out if p.payload is None] == [65536 + 3]
    assert max(lag for _, lag in lags) <= 2


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_target_ms must be >= 20"):
        JitterBuffer(Clock(), max_target_ms=10)
    with pytest.raises(ValueError, match="cap_ms must be >= max_target_ms"):
        JitterBuffer(Clock(), max_target_ms=60, cap_ms=40)
