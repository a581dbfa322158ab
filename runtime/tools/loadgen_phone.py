"""``duplex loadgen --transport twilio|plivo|telnyx|exotel``: phone calls against a node, each one the
carrier's side of a media stream (``runtime.tools.carrier_client`` with ``runtime.tools.carrier_sides``)
streaming espeak-ng speech at telephone bandwidth (24 kHz speech down to 8 kHz by libswresample, whose
anti-alias filter cuts above 4 kHz, then G.711 or 16-bit PCM), paced in real time.

Each call reports the load generator's usual figures (``runtime.tools.loadgen.SessionResult``): an agent
frame is one checkpoint (Twilio's ``mark``, Plivo's ``checkpoint``; 80 ms: four 20 ms packets), so the gaps
and the frames lost are counted on the checkpoints' arrivals; the handshake is the first checkpoint (the
slot is live and the agent's audio flows). First audio here
is from the ``start`` message to the first agent frame: a caller's wait from the call's pickup, admission
and persona prompt included (the WebSocket generator counts from its first frame after the handshake). A
call the node refuses (HTTP status, or a close before its first mark) or cuts counts as a failure.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Sequence

import numpy as np

from runtime.frontend.codecs.telephony import resample
from runtime.frontend.gate.refusals import CLOSE_NORMAL
from runtime.tools.carrier_client import PACKET_S, CallResult, carrier_call
from runtime.tools.carrier_sides import SIDES
from runtime.tools.loadgen import LoadReport, SessionResult, check_load_args, gather_sessions

__all__ = ["phone_speech", "run_phone_load", "session_result"]

PACKETS_PER_FRAME = 4
"""Carrier packets (20 ms) per model frame (80 ms)."""


def phone_speech(speech_24k: np.ndarray) -> np.ndarray:
    """``[T]`` float32 at 24 kHz -> ``[T / 3]`` float32 at 8 kHz (libswresample, whose low-pass keeps the
    telephone band)."""
    return resample(speech_24k, 24000, 8000)


def session_result(call: CallResult, packets_planned: int) -> SessionResult:
    """A call's figures as a :class:`SessionResult` (the module doc says how each is counted)."""
    result = SessionResult(frames_planned=packets_planned // PACKETS_PER_FRAME)
    result.handshake = call.marks > 0
    result.frames_sent = call.packets_sent // PACKETS_PER_FRAME
    result.audio_messages = call.marks
    result.audio_arrival_s = list(call.mark_arrival_s)
    result.first_audio_ms = call.first_audio_s * 1e3 if call.first_audio_s is not None else None
    result.bytes_received = len(call.received)
    result.bytes_sent = call.packets_sent * (160 if call.encoding == "mulaw" else 320)
    if call.status is not None:
        result.http_status, result.http_body = call.status, call.close_reason
    elif call.failure:
        result.connect_error = call.failure
    # The node's close code; none (this side hung up first and the node had not closed yet) is a normal end.
    result.close_code = call.close_code if call.close_code is not None else CLOSE_NORMAL
    result.close_reason = call.close_reason
    if not result.handshake and call.close_reason:
        result.errors.append(call.close_reason)
    return result


async def run_phone_load(
    carrier: str,
    url: str,
    speech: Sequence[np.ndarray],
    *,
    sessions: int,
    secret: str,
    stream_url: str,
    token: str | Callable[[], str] | None = None,
    parameters: dict[str, str] | None = None,
    max_duration_s: float = 120.0,
    stagger_s: float = 0.0,
    ssl_context: ssl.SSLContext | None = None,
) -> LoadReport:
    """``sessions`` concurrent calls of ``carrier`` (``twilio``, ``plivo``, ``telnyx``, ``exotel``) against
    ``url`` (``ws://host:port`` or ``wss://host``); call ``i`` streams ``speech[i % len(speech)]`` (24 kHz
    float32, made telephone speech here) then hangs up.

    Args:
        secret, stream_url: the carrier account's auth token and the stream URL the node checks the
            signature against (``DUPLEX_<CARRIER>_AUTH_TOKEN``, ``DUPLEX_<CARRIER>_STREAM_URL``); for
            Telnyx the node's stream secret (``DUPLEX_TELNYX_STREAM_TOKEN``) and any URL (unused); for Exotel
            ``<api key>:<api token>`` and any URL (unused).
        token: a session-token factory (one per call, as the call's ``token`` parameter), one token for
            one call, or None for a node without access control.
        parameters: the call's other parameters (``voice_prompt``, ``text_prompt``).
        ssl_context: for ``wss://`` to a node with a self-signed certificate.
    Raises:
        ValueError: an unknown carrier (naming the known ones); as
            :func:`runtime.tools.loadgen.check_load_args`.
    """
    if carrier not in SIDES:
        raise ValueError(f"unknown carrier {carrier!r}; one of {', '.join(SIDES)}")
    side = SIDES[carrier]()
    check_load_args(sessions, speech, max_duration_s, token)
    clips = [phone_speech(clip) for clip in speech[: min(len(speech), sessions)]]
    started, cpu = time.monotonic(), time.process_time()

    async def one(i: int) -> SessionResult:
        await asyncio.sleep(i * stagger_s)
        clip = clips[i % len(clips)]
        params = dict(parameters or {})
        minted = token() if callable(token) else token
        if minted:
            params["token"] = minted
        call = await carrier_call(
            side,
            url,
            clip,
            secret=secret,
            stream_url=stream_url,
            parameters=params,
            ssl_context=ssl_context,
        )
        return session_result(call, int(np.ceil(clip.size / (8000 * PACKET_S))))

    tasks = [asyncio.create_task(one(i)) for i in range(sessions)]
    results: list[SessionResult] = await gather_sessions(tasks, max_duration_s, SessionResult)
    return LoadReport(results, time.monotonic() - started, time.process_time() - cpu)
