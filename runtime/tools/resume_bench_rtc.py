"""Resume over WebRTC, measured from the caller's side: ``python -m runtime.tools.resume_bench --transport
webrtc --url http://HOST:PORT`` (``runtime.tools.resume_bench`` for the WebSocket and the report).

Each trial: an aiortc call (``runtime.tools.rtc_client``, no token: run the node with
``DUPLEX_AUTH_MODE=off``)
with ``resumable=1`` streams speech (pre-encoded Opus, 20 ms packets) for ``before_s``, loses its UDP path
(:meth:`RtcCall.drop`: its ICE sockets aborted, no DTLS close, no ``DELETE``), waits ``drop_s``, then a new
call with a fresh offer and the credential (``POST /api/rtc`` with ``Duplex-Resume-Credential``) streams
``after_s`` and hangs up. With ``drop_s`` longer than the node's ``DUPLEX_RTC_MEDIA_TIMEOUT_S`` the session
was detached and held; shorter, the resume takes over a call the node had not yet seen lost (both are
resumes).

Times (ms) from the reconnect's start (the new peer connection made, before its offer is gathered): the 201
answer, ICE+DTLS connected, the DataChannel's 0x00, and the first audio packet back (audio flowing again:
the paused slot steps only once the caller's first frame after the resume arrives, so this is a round trip
through the model); and the gap the node measured (``gap_ms`` in the new 0x04).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from runtime.tools.rtc_client import RtcCall

__all__ = ["RtcTrial", "run_rtc_trial"]


@dataclass
class RtcTrial:
    """One WebRTC drop and resume (ms from the reconnect's start)."""

    answer_ms: float = float("nan")
    connected_ms: float = float("nan")
    handshake_ms: float = float("nan")
    first_audio_ms: float = float("nan")
    gap_ms: float = float("nan")


def _since(call: RtcCall, offset_s: float | None, started: float) -> float:
    return float("nan") if offset_s is None else (call.started_at + offset_s - started) * 1e3


async def run_rtc_trial(
    base_url: str,
    packets: list[bytes],
    *,
    before_s: float,
    drop_s: float,
    after_s: float,
    timeout_s: float = 30.0,
) -> RtcTrial:
    """One session over ``/api/rtc`` on ``base_url`` (``http://host:port``): stream ``before_s``, lose the UDP
    path, wait ``drop_s``, resume with a fresh offer, stream ``after_s``, hang up.

    Raises:
        RuntimeError: a POST was refused (its status and sentence), or no metadata/credential came.
        TimeoutError: a step took longer than ``timeout_s``.
    """
    async with aiohttp.ClientSession() as http:
        first = RtcCall(base_url, packets, query="resumable=1")
        second: RtcCall | None = None
        try:
            outcome = await first.start(http)
            if outcome.status != 201:
                raise RuntimeError(f"POST /api/rtc: {outcome.status} {outcome.body.strip()}")
            await asyncio.wait_for(first.got_metadata.wait(), timeout_s)
            credential = first.outcome.metadata[0].get("resume")
            if not isinstance(credential, str):
                raise RuntimeError(
                    f"no resume credential in {first.outcome.metadata[0]} (DUPLEX_RESUME_S=0?)"
                )
            await asyncio.wait_for(first.audio_arrived.wait(), timeout_s)
            await asyncio.sleep(before_s)
            first.drop()
            await asyncio.sleep(drop_s)

            started = time.monotonic()
            second = RtcCall(base_url, packets, resume=credential)  # Duplex-Resume-Credential: not in the URL
            again = await second.start(http)
            if again.status != 201:
                raise RuntimeError(f"POST /api/rtc (a resume): {again.status} {again.body.strip()}")
            await asyncio.wait_for(second.got_metadata.wait(), timeout_s)
            await asyncio.wait_for(second.audio_arrived.wait(), timeout_s)
            trial = RtcTrial(
                answer_ms=_since(second, again.answer_s, started),
                connected_ms=_since(second, again.connected_s, started),
                handshake_ms=_since(second, again.handshake_s, started),
                first_audio_ms=_since(second, again.first_audio_s, started),
                gap_ms=float(str(second.outcome.metadata[0].get("gap_ms", "nan"))),
            )
            await asyncio.sleep(after_s)
            await second.hang_up(http)
            return trial
        finally:
            await first.close()
            if second is not None:
                await second.close()
