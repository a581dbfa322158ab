"""The node check's resume step: one WebSocket session through nginx over ``wss://`` dropped mid-conversation
and resumed (docs/runtime.md, "Resume").

:func:`check_resume` opens a session with ``resumable=1`` and a fresh session token, streams speech at
real-time pace until audio comes back, reads the session from the sessions API through nginx (an
application token minted from the node's key: its slot), then cuts the TCP connection without a close
frame (``transport.abort()``: nginx sees the reset and closes its upstream connection, so the runtime sees
the stream end with no close frame: a lost connection, held for ``DUPLEX_RESUME_S``). It reconnects at
once with the credential from the first connection's ``0x04`` metadata (no token: the credential is the
right), streams on, closes normally, and reads the session back: the same session id, the same slot, state
``ended``, one transcript.

What it times (ms, the client's monotonic clock, from the reconnect's TCP connect): the ``0x00`` handshake,
and the first audio message on the new connection ("audio again"). The resume bench
(``runtime.tools.resume_bench``) times the same over many trials against a ``sim`` node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from runtime.engine.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.frontend.codecs.kyutai_audio import make_codec
from runtime.frontend.codecs.protocol import AudioFormat, MessageKind, encode_audio
from runtime.frontend.gate.query import RESUME_HEADER
from runtime.frontend.gate.tokens import SUBPROTOCOL_PREFIX
from runtime.tools.loadgen import session_url

__all__ = ["ResumeCheck", "check_resume"]

FRAME_S = FRAME_SAMPLES / SAMPLE_RATE_HZ
"""One frame (s): 80 ms."""
BEFORE_AUDIO_MESSAGES = 5
"""Audio messages the first connection waits for before the cut: the conversation is under way."""
AFTER_FRAMES = 12
"""Frames streamed on the resumed connection (about 1 s) before it closes normally."""
API_WAIT_S = 10.0
"""How long the session is looked for in the sessions API (its writer is asynchronous; s)."""


@dataclass
class ResumeCheck:
    """What the resume step saw.

    Attributes:
        session_id, resumed_session_id: from the first and the resumed connection's ``0x04`` metadata.
        slot, resumed_slot: the session's slot as the sessions API read it before the cut and after the end.
        handshake_ms: reconnect (TCP connect of the new connection) to its ``0x00`` handshake (ms).
        audio_again_ms: reconnect to the first audio message on the new connection (ms).
        gap_ms: the gap the server measured (its last input frame before the cut to the resume; ms).
        audio_before, audio_after: audio messages received on each connection.
        close_code: the resumed connection's close code (1000: normal).
        state, transcript: the session as the sessions API read it after the end.
        problems: what went wrong, in words (empty: resumed).
    """

    session_id: str = ""
    resumed_session_id: str = ""
    slot: int | None = None
    resumed_slot: int | None = None
    handshake_ms: float | None = None
    audio_again_ms: float | None = None
    gap_ms: float | None = None
    audio_before: int = 0
    audio_after: int = 0
    close_code: int | None = None
    state: str = ""
    transcript: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_row(self) -> dict[str, object]:
        """The row ``duplex node up`` prints beside the transports'."""
        return {
            "transport": "websocket",
            "resumed": self.ok,
            "same_session": bool(self.session_id) and self.session_id == self.resumed_session_id,
            "same_slot": self.slot is not None and self.slot == self.resumed_slot,
            "handshake_ms": self.handshake_ms,
            "audio_again_ms": self.audio_again_ms,
            "gap_ms": self.gap_ms,
        }


class _Leg:
    """One connection: counts audio, keeps the 0x04 metadata, notes the handshake and first audio times."""

    def __init__(self, ws: ClientConnection, started: float) -> None:
        self.ws, self.started = ws, started
        self.handshake_ms: float | None = None
        self.first_audio_ms: float | None = None
        self.audio = 0
        self.text = ""
        self.errors: list[str] = []
        self.metadata: asyncio.Future[dict[str, object]] = asyncio.get_running_loop().create_future()
        self.handshake = asyncio.Event()
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
                    self.audio += 1
                    if self.first_audio_ms is None:
                        self.first_audio_ms = now
                elif kind == MessageKind.TEXT:
                    self.text += payload.decode("utf-8", errors="replace")
                elif kind == MessageKind.ERROR:
                    self.errors.append(payload.decode("utf-8", errors="replace"))


async def _handshake(leg: _Leg) -> bool:
    """Until the leg's ``0x00`` handshake (True) or its connection's end without one (False: refused)."""
    waiter = asyncio.ensure_future(leg.handshake.wait())
    await asyncio.wait({waiter, leg.task}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    return leg.handshake.is_set()


def _api_session(
    https_url: str, session_id: str, app_token: str, context: ssl.SSLContext
) -> dict[str, object] | None:
    """``GET /api/sessions/<id>`` through nginx; None on 404 (not written yet) or no answer."""
    request = urllib.request.Request(
        f"{https_url}/api/sessions/{session_id}", headers={"Authorization": f"Bearer {app_token}"}
    )
    https = urllib.request.HTTPSHandler(context=context)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), https)
    try:
        with opener.open(request, timeout=5) as response:
            body: dict[str, object] = json.loads(response.read())
            return body
    except (urllib.error.URLError, OSError, ValueError):
        return None


async def _poll_session(
    https_url: str,
    session_id: str,
    app_token: str,
    context: ssl.SSLContext,
    done: Callable[[dict[str, object]], bool],
) -> dict[str, object] | None:
    """The session from the API once ``done(it)``, or the last answer after :data:`API_WAIT_S`."""
    deadline = time.monotonic() + API_WAIT_S
    body = None
    while time.monotonic() < deadline:
        body = await asyncio.to_thread(_api_session, https_url, session_id, app_token, context)
        if body is not None and done(body):
            return body
        await asyncio.sleep(0.2)
    return body


async def check_resume(
    wss_url: str,
    https_url: str,
    speech: np.ndarray,
    *,
    token: str,
    app_token: str,
    ssl_context: ssl.SSLContext,
    timeout_s: float = 30.0,
) -> ResumeCheck:
    """Drop one session's TCP connection mid-conversation and resume it (the module's docstring).

    Args:
        wss_url, https_url: the node's public ``wss://`` and ``https://`` bases (nginx).
        speech: what the caller says (float32, 24 kHz, ``[T]``, at least a few seconds; looped).
        token: a fresh session token (single-use); app_token: an application token with
            ``sessions:read`` (``runtime.frontend.gate.app_tokens.mint_app_token``).
        ssl_context: trusts the node's certificate.
        timeout_s: hang guard for each wait (s); a wait that runs out is a problem, never an exception.

    Never raises for a node failure: what went wrong is in ``ResumeCheck.problems``.
    """
    check = ResumeCheck()
    encoder = make_codec(AudioFormat.PCM, 1)[1]
    frames = [speech[i : i + FRAME_SAMPLES] for i in range(0, len(speech) - FRAME_SAMPLES + 1, FRAME_SAMPLES)]
    messages = [encode_audio(encoder.encode(frame)) for frame in frames]
    sent = 0

    async def stream(leg: _Leg, until: Callable[[], bool]) -> None:
        nonlocal sent
        next_send = time.monotonic()
        while not until():
            await leg.ws.send(messages[sent % len(messages)])
            sent += 1
            next_send += FRAME_S
            await asyncio.sleep(max(0.0, next_send - time.monotonic()))

    options: dict[str, object] = {"max_size": 2**20, "compression": None, "proxy": None, "ssl": ssl_context}
    try:
        async with asyncio.timeout(timeout_s):
            ws = await connect(
                session_url(wss_url, resumable=1),
                subprotocols=[SUBPROTOCOL_PREFIX + token],  # type: ignore[list-item]
                **options,  # type: ignore[arg-type]
            )
            first = _Leg(ws, time.monotonic())
            if not await _handshake(first):
                check.problems.append(
                    f"resume: the first connection was refused: {first.errors} ({ws.close_code})"
                )
                return check
            metadata = await first.metadata
            check.session_id = str(metadata.get("session_id", ""))
            credential = str(metadata.get("resume", ""))
            if not credential:
                check.problems.append(f"resume: no credential in the 0x04 metadata {metadata}")
                await ws.close()
                return check
            await stream(first, lambda: first.audio >= BEFORE_AUDIO_MESSAGES)
            live = await _poll_session(
                https_url, check.session_id, app_token, ssl_context, lambda b: b.get("slot") is not None
            )
            check.slot = None if live is None else live.get("slot")  # type: ignore[assignment]
            await stream(first, lambda: sent % 3 == 0)  # a moment more: the cut falls mid-conversation
            check.audio_before = first.audio
            ws.transport.abort()  # no close frame: a lost connection, as a phone changing cells
            first.task.cancel()
            started = time.monotonic()
            ws = await connect(  # the credential in a header, not the URL (issue 34: URLs are logged)
                session_url(wss_url),
                additional_headers={RESUME_HEADER: credential},
                **options,  # type: ignore[arg-type]
            )
            second = _Leg(ws, started)
            if not await _handshake(second):
                check.problems.append(f"resume: refused: {second.errors} (closed {ws.close_code})")
                return check
            resumed = await second.metadata
            check.resumed_session_id = str(resumed.get("session_id", ""))
            check.gap_ms = float(str(resumed.get("gap_ms", "nan")))
            check.handshake_ms = second.handshake_ms
            target = sent + AFTER_FRAMES
            await stream(second, lambda: sent >= target and second.audio > 0)
            check.audio_again_ms, check.audio_after = second.first_audio_ms, second.audio
            await ws.close()
            await second.task
            check.close_code = ws.close_code
            ended = await _poll_session(
                https_url, check.session_id, app_token, ssl_context, lambda b: b.get("state") == "ended"
            )
    except TimeoutError:
        check.problems.append(f"resume: no answer within {timeout_s:g} s")
        return check
    except (OSError, ConnectionClosed) as exc:
        check.problems.append(f"resume: connection failed: {exc!r}")
        return check
    if ended is not None:
        check.state = str(ended.get("state", ""))
        check.resumed_slot = ended.get("slot")  # type: ignore[assignment]
        transcript = ended.get("transcript")
        check.transcript = str(transcript.get("text", "")) if isinstance(transcript, dict) else ""
    _judge(check, second.errors)
    return check


def _judge(check: ResumeCheck, errors: list[str]) -> None:
    if not check.session_id or check.resumed_session_id != check.session_id:
        check.problems.append(
            f"resume: session id {check.resumed_session_id!r} after the resume, {check.session_id!r} before"
        )
    if check.slot is None or check.resumed_slot != check.slot:
        check.problems.append(f"resume: slot {check.resumed_slot} after the resume, {check.slot} before")
    if check.audio_after == 0 or check.audio_again_ms is None:
        check.problems.append(f"resume: no audio after the resume (errors: {errors})")
    if check.close_code != 1000:
        check.problems.append(f"resume: the resumed connection closed with {check.close_code}, not 1000")
    if check.state != "ended":
        check.problems.append(f"resume: the sessions API reads state {check.state!r}, not 'ended'")
