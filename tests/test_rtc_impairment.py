"""The WebRTC receive path under loss, jitter and reordering (issue 22): a real aiortc call through a
user-space impairment relay (tests/udp_impair.py) to the server's own jitter buffer. The receive lag
(packets that have arrived and wait behind a gap) stays at most 3 packets (60 ms) and does not grow over
the call; every lost packet is concealed; the slot gets one frame per four 20 ms slots played, whatever was
lost. Counted in packets and frames, never in time. (aiortc's own jitter buffer stays 14 packets behind
after one loss: aiortc issue 543.)

The slot is a test echo backend (tests/fake_backend.py): the receive path is what is measured, not a model.
"""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest
from fake_backend import FakeBackend
from udp_impair import ImpairedRelay, route_through

from runtime.config import RuntimeConfig
from runtime.frontend.server import DuplexServer
from runtime.frontend.transports.webrtc import signalling as rtc
from runtime.tools.rtc_client import RtcCall, encode_packets, local_candidate_nets

WAIT_S = 30.0
LAG_LIMIT = 3
"""Packets (20 ms each): the issue's 60 ms."""


def _tone_packets(seconds: float) -> list[bytes]:
    t = np.arange(int(24_000 * seconds)) / 24_000
    return encode_packets((0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32))


@pytest.mark.asyncio
@pytest.mark.parametrize(("loss", "seconds"), [(0.01, 20), (0.03, 20), (0.05, 60)])
async def test_receive_lag_stays_within_60_ms_and_flat_under_loss_jitter_and_reorder(
    loss: float, seconds: int
) -> None:
    await measure_receive_lag(loss, seconds)


async def measure_receive_lag(loss: float, seconds: int) -> dict[str, object]:
    """One call through the impairment relay for ``seconds`` of packets (after a 1 s warm-up), asserting
    the lag bounds; returns the figures (lag in packets of 20 ms). Also run from the command line for the
    issue's 10-minute figure:
    ``PYTHONPATH=. python tests/test_rtc_impairment.py --loss 0.05 --seconds 600``."""
    config = RuntimeConfig(host="127.0.0.1", port=0, max_sessions=1, auth_mode="off", rtc_media_timeout_s=30,
                           rtc_allowed_candidate_nets=local_candidate_nets())  # fmt: skip
    backend = FakeBackend(1)
    server = DuplexServer(config, backend)
    await server.start()
    relay: ImpairedRelay | None = None
    call: RtcCall | None = None
    try:
        holder: dict[str, tuple[str, int]] = {}

        def offer_filter(sdp: str) -> str:
            assert relay is not None
            rewritten, holder["client"] = route_through(sdp, relay.address)
            return rewritten

        def answer_filter(sdp: str) -> str:
            assert relay is not None
            rewritten, relay.server = route_through(sdp, relay.address)
            relay.client = holder["client"]
            return rewritten

        call = RtcCall(
            f"http://127.0.0.1:{server.port}",
            _tone_packets(2.0),
            offer_filter=offer_filter,
            answer_filter=answer_filter,
        )
        # the relay listens where the client's candidates are (not loopback: aioice gathers none there)
        host = route_through(await call.offer(), ("0.0.0.0", 0))[1][0]
        relay = await ImpairedRelay.open(host, loss=loss, jitter_s=0.02, reorder=0.05)
        async with aiohttp.ClientSession() as http:
            outcome = await call.start(http)
        assert outcome.status == 201, outcome.body
        await asyncio.wait_for(call.connected.wait(), WAIT_S)
        peer = next(iter(rtc.registry(server).peers.values()))
        buffer = peer.inbound.buffer
        samples: list[int] = []
        warm = 50  # packets: the first second, while the transit estimate fills
        target = warm + seconds * 50
        async with asyncio.timeout(seconds * 4 + WAIT_S):
            while buffer.stats.received < target:
                await asyncio.sleep(0.05)
                if buffer.stats.received > warm:
                    samples.append(buffer.lag)
        third = len(samples) // 3
        figures: dict[str, object] = {
            "loss": loss,
            "seconds": seconds,
            "lag_samples": len(samples),
            "max_lag_packets": max(samples),
            "mean_lag_first_third": round(float(np.mean(samples[:third])), 3),
            "mean_lag_last_third": round(float(np.mean(samples[-third:])), 3),
            "relay_dropped": relay.rtp_dropped,
            "buffer": str(buffer.stats),
        }
        assert max(samples) <= LAG_LIMIT, (max(samples), buffer.stats)
        assert np.mean(samples[-third:]) <= np.mean(samples[:third]) + 0.5, "the lag grew"
        assert relay.rtp_dropped > 0
        stats = buffer.stats
        assert stats.concealed >= relay.rtp_dropped * 0.9  # (a drop in the last deadline may be pending)
        assert stats.max_lag <= LAG_LIMIT + 1  # the warm-up second included
        played = stats.delivered + stats.concealed
        session = next(iter(server.sessions))
        assert abs(session.frames_in - played // 4) <= 1 + 50 // 4  # frames pushed: one per 4 slots played
        await call.close()  # a DTLS close: the server ends the session
        async with asyncio.timeout(WAIT_S):
            while server.sessions or backend.leases:
                await asyncio.sleep(0.05)
        return figures
    finally:
        if call is not None:
            await call.close()
        if relay is not None:
            relay.close()
        await server.close()


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=measure_receive_lag.__doc__)
    parser.add_argument("--loss", type=float, default=0.05, help="random loss, 0-1")
    parser.add_argument("--seconds", type=int, default=600)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure_receive_lag(args.loss, args.seconds))))
