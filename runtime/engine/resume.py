"""Resume on the slots' side: single-use credentials, the paused hold of a detached slot, the hand-over of a
slot from one sink (a transport, a worker) to another.

It lives with the slots (``runtime.engine.local_slots.LocalSlots``): in one process (``--workers 0``) and in
the engine process (``--workers N``), where it is the one place that knows every slot's session, so a
resume may arrive through any worker of the node and no worker needs Redis to check a credential.

- **Credentials**: ``<session_id>.<secret>``, the secret 32 random bytes (``secrets.token_urlsafe``); only
  its SHA-256 is kept. Each is single-use: a resume issues the next, and the one it presented is spent
  once the new connection has the slot, i.e. at its first audio frame (:meth:`SlotHolds.confirm`). Until
  then the presented credential stays **pending**: a resume cancelled mid-flight (the reconnecting client
  left before its first frame: before or after the hand-over, before or after it was sent the next
  credential) leaves the slot held and the client's retry with the same credential is granted, as is a
  retry with the next one (which then spends the pending one). Random rather
  than HMAC-signed: the slot owner must remember what was spent anyway (single use), and a random secret
  needs no key to distribute or rotate. Nothing survives a restart of the slot owner, and nothing needs to:
  the slots (the model's state) do not survive it either.
- **Detach**: the transport was lost without a normal close. The slot is held, **paused**
  (``SlotSession.paused``: the tick freezes the row, neither stepping it nor feeding it silence), for
  ``hold_s``; the first frame after a resume unpauses it. Why paused: docs/runtime.md, "Resume".
- **Resume**: the credential names the session; the slot's outputs go to the new sink from then on. Only
  a session whose connection is lost can be resumed: detached (the transport's own signal), or still
  attached but **failing the liveness probe**: no input frame from its owner for :data:`SILENCE_S` within
  :data:`PROBE_S` of the resume (:meth:`SlotHolds.probe_owner`; a connected caller sends one every 80 ms,
  over the same connection a ping would use). Then the old sink, which had not noticed its loss, gets
  ``on_taken_over``. An owner still sending keeps its call and its credential: the resume is refused
  ``resume_live`` (a takeover with a stolen credential, or a client that opened a second connection while
  the first still streams).
- **Expiry**: :meth:`SlotHolds.sweep` (every ``SWEEP_S`` on the owner's loop) frees holds past their
  deadline on the injected ``clock`` and tells their sink ``on_hold_expired``; a resume past the deadline
  is refused even before the sweep ran.

Refusals (``runtime.engine.api.RESUME_REFUSAL_REASONS``) say what was wrong and never touch another
session.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from runtime.engine.api import (
    RESUME_OFF_MESSAGE,
    FirstAudioTiming,
    Refusal,
    SessionSink,
)
from runtime.engine.scheduler import SlotSession

__all__ = [
    "ENDED_MEMORY",
    "PROBE_S",
    "SILENCE_S",
    "SWEEP_S",
    "Resumed",
    "SinkRoute",
    "SlotHolds",
    "credential_session",
]

log = logging.getLogger(__name__)

SWEEP_S = 0.1
"""How often the holds are checked for expiry (s): a held slot frees at most this late."""
SILENCE_S = 0.5
"""The liveness probe of a resume whose session is still attached: an owner whose input frames stopped for
this long (s) is taken for lost (a TCP connection that died silently: the WebSocket heartbeat would see it
only after 20-30 s; a WebRTC path: after ``rtc_media_timeout_s``). A connected caller sends a frame every
80 ms (Kyutai's protocol: 1920 samples at 24 kHz; WebRTC: 20 ms Opus packets, silence included), so this is
6 missed frames; a dropped WebRTC path still yields frames for up to ~0.3 s (the jitter buffer's 120 ms of
concealment, ``runtime.frontend.transports.webrtc.jitter.CAP_MS``, and a frame's assembly)."""
PROBE_S = 2.0
"""The longest a resume probes a still-attached owner (s): still sending by then, it is live and the resume
is refused ``resume_live``. A silent drop adds at most :data:`SILENCE_S` after the owner's last frame to a
resume; a refusal takes this long (issue 34 asked for "a liveness probe of about one second")."""
ENDED_MEMORY = 4096
"""Sessions remembered after they ended (for a clear ``resume_expired`` instead of ``resume_invalid``, to the
holder of one of its credentials only)."""
NOT_A_CREDENTIAL_MESSAGE = "not a resume credential of a session on this node"
"""The one answer to a credential whose secret is not one of its session's, whatever the session id names: a
held session, an ended one or none (issue 34, item 11: "no session <id>" against "not a credential of
<id>", and ``resume_expired`` for any secret, told a prober which ids had been sessions)."""
_CREDENTIAL_RE = re.compile(r"([0-9a-f]{32})\.([A-Za-z0-9_-]{43})")
"""A session id (a UUID's 32 hex digits) and the secret (32 bytes, base64url without padding: 43 chars)."""
_SPENT_KEPT = 64
"""Spent credentials kept per session (each resume spends one): a replay of any of them says so."""


def credential_session(credential: str) -> tuple[str, str] | None:
    """``(session_id, secret)`` of a well-formed credential, else None."""
    match = _CREDENTIAL_RE.fullmatch(credential)
    return (match[1], match[2]) if match else None


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class SinkRoute(SessionSink):
    """The sink a slot session delivers to, switchable: a resume points it at the new sink (the slot session
    keeps calling the same bound methods)."""

    def __init__(self, sink: SessionSink) -> None:
        self.sink = sink
        self.transcript: list[tuple[float, str]] = []
        """The text pieces delivered so far, each with when it was delivered (unix s): kept for resumable
        sessions only (``keep_text``); the store of the front end that resumes the session rewrites the
        transcript from it (``runtime.frontend.store.redis_store.SessionStore.adopt_session``)."""
        self.keep_text = False

    def on_output(self, pcm: np.ndarray | None, piece: str | None) -> None:
        if piece is not None and self.keep_text:
            self.transcript.append((time.time(), piece))
        self.sink.on_output(pcm, piece)

    def on_prompt_done(self) -> None:
        self.sink.on_prompt_done()

    def on_first_audio(self, timing: FirstAudioTiming) -> None:
        self.sink.on_first_audio(timing)


@dataclass(eq=False)
class _Held:
    """One resumable session."""

    slot_session: SlotSession
    route: SinkRoute
    meta: str
    secret: bytes
    spent: list[bytes] = field(default_factory=list)
    pending: bytes | None = None
    """The credential a resume presented, until the new connection's first frame (:meth:`SlotHolds.confirm`)
    spends it: a retry of a resume cancelled mid-flight presents it again."""
    deadline: float | None = None
    """While detached: when the hold ends (``clock`` s); None while attached."""
    probe: asyncio.Future[None] | None = None
    """While a resume probes the attached owner (:meth:`SlotHolds.probe_owner`): done once the session is
    detached or ended."""


@dataclass(frozen=True)
class Resumed:
    """What :meth:`SlotHolds.resume` hands over.

    Attributes:
        slot_session: the session's slot, now delivering to the new sink.
        previous: the sink it delivered to before (not told yet: the caller calls its ``on_taken_over``).
        gap_s: from the session's last input frame to now, on the scheduler's clock (0: no frame yet).
        meta: the admission's ``meta``.
        transcript: every text piece produced so far, in order, with when it was produced (unix s).
        credential: the next single-use credential.
    """

    slot_session: SlotSession
    previous: SessionSink
    gap_s: float
    meta: str
    transcript: list[tuple[float, str]]
    credential: str


class SlotHolds:
    """The resumable sessions of one set of slots.

    Args:
        hold_s: how long a detached slot is held (``DUPLEX_RESUME_S``); 0: no resume at all.
        release: frees a slot session's slot (the scheduler's ``release``).
        clock: monotonic seconds (injected in tests: the hold never depends on the wall clock).
        probe_s: the liveness probe's longest wait (s; :data:`PROBE_S`).
        silence_s: the owner's silence that the probe takes for a lost connection (s; :data:`SILENCE_S`).
    """

    def __init__(
        self,
        hold_s: float,
        release: Callable[[SlotSession], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        probe_s: float = PROBE_S,
        silence_s: float = SILENCE_S,
    ) -> None:
        self.hold_s = hold_s
        self.clock = clock
        self.probe_s = probe_s
        self.silence_s = silence_s
        self._release = release
        self._held: dict[str, _Held] = {}
        # session id -> (why it cannot be resumed, the digests of its credentials: current, pending, spent)
        self._ended: OrderedDict[str, tuple[str, tuple[bytes, ...]]] = OrderedDict()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        """Resumable sessions now (attached or held)."""
        return len(self._held)

    def slot_session(self, session_id: str) -> SlotSession | None:
        """The slot session of a resumable session (None when it is not, or no more)."""
        held = self._held.get(session_id)
        return None if held is None else held.slot_session

    @property
    def detached(self) -> int:
        """Sessions held for a resume now."""
        return sum(1 for held in self._held.values() if held.deadline is not None)

    # --- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the expiry sweep on the running loop (nothing when resume is off)."""
        if self.hold_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._sweep_forever(), name="resume-holds")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self.sweep()

    # --- the slots' side ------------------------------------------------------------------------------

    def open(self, slot_session: SlotSession, route: SinkRoute, meta: str) -> str:
        """Make an admitted session resumable; its first credential ("" when resume is off)."""
        if self.hold_s <= 0:
            return ""
        secret = secrets.token_urlsafe(32)
        route.keep_text = True
        self._held[slot_session.session_id] = _Held(slot_session, route, meta, _digest(secret))
        return f"{slot_session.session_id}.{secret}"

    def forget(self, session_id: str, why: str = "the session has ended") -> None:
        """The session ended (released): its credentials are void from now on."""
        held = self._held.pop(session_id, None)
        if held is not None:
            _settle(held)
            known = (held.secret, *held.spent, *(() if held.pending is None else (held.pending,)))
            self._ended[session_id] = (why, known)
            while len(self._ended) > ENDED_MEMORY:
                self._ended.popitem(last=False)

    def detach(self, session_id: str) -> bool:
        """Hold the session's slot, paused, for ``hold_s``; False when it is not resumable (release it)."""
        held = self._held.get(session_id)
        if held is None:
            return False
        held.deadline = self.clock() + self.hold_s
        _settle(held)  # a resume probing the owner: the transport says it is lost
        held.slot_session.paused = True
        held.slot_session.inbox.clear()  # the tick takes no stale frame when the caller is back
        return True

    async def probe_owner(self, credential: str) -> None:
        """Before :meth:`resume`: when ``credential``'s session is still attached to a connection, watch its
        owner's input for up to ``probe_s``. Silent for ``silence_s`` (no input frame reached the slot; a
        connection that has not sent one yet counts from the probe's start) or the transport's loss signal
        (:meth:`detach`): lost, go on. Still sending after ``probe_s``: the owner is live, the resume refused.
        Nothing of the session changes here: a refused resume leaves the owner's call and credential as
        they were. On the slot session's clock (the scheduler's, injected in tests).

        Raises:
            Refusal: ``resume_live``; the refusals of :meth:`resume` for a credential that is not good
                (checked first, so a wrong credential learns nothing of the owner).
        """
        session_id, held, _ = self._check(credential)
        slot_session = held.slot_session
        clock = slot_session.clock
        start = clock()
        until = start + self.probe_s
        while held.deadline is None and self._held.get(session_id) is held:
            now = clock()
            last = slot_session.last_input_at
            quiet_at = (start if last is None else last) + self.silence_s
            if now >= quiet_at:
                return  # silent: the connection died without the transport noticing yet
            if now >= until:
                log.warning(
                    "session %s: a resume while its owner is connected and sending refused", session_id
                )
                raise Refusal(
                    "resume_live",
                    f"session {session_id} is live on its connection: a resume is accepted only once that "
                    "connection is lost (its owner keeps the call and its credential)",
                )
            if held.probe is None or held.probe.done():
                held.probe = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(quiet_at, until) - now):
                    await asyncio.shield(held.probe)  # detached or ended meanwhile

    def confirm(self, session_id: str) -> None:
        """The resumed connection's first frame reached the slot: the credential its resume presented is
        spent from now on (a replay of it is ``resume_replayed``)."""
        held = self._held.get(session_id)
        if held is not None and held.pending is not None:
            held.spent = [*held.spent[-(_SPENT_KEPT - 1) :], held.pending]
            held.pending = None

    def sweep(self) -> list[str]:
        """Free the holds past their deadline (their sinks get ``on_hold_expired``); their session ids."""
        now = self.clock()
        expired = [sid for sid, h in self._held.items() if h.deadline is not None and now >= h.deadline]
        for sid in expired:
            held = self._held[sid]
            self.forget(sid, f"its hold of {self.hold_s:g} s ran out")
            self._release(held.slot_session)
            log.info("session %s: not resumed within %g s; its slot freed", sid, self.hold_s)
            held.route.sink.on_hold_expired()
        return expired

    def resume(self, credential: str, sink: SessionSink) -> Resumed:
        """Point the slot of ``credential``'s session at ``sink`` and issue the next credential (the slot
        stays paused until a frame arrives; that frame spends ``credential``: :meth:`confirm`).

        ``credential`` is the session's current one, or the pending one of a resume not confirmed yet (a
        retry: the credential that resume issued is void from then on). The current one presented while
        another is pending spends the pending one (the client got the next credential, so it needs the
        older one no more).

        Raises:
            Refusal: ``resume_off``, ``resume_invalid``, ``resume_replayed`` or ``resume_expired``.
        """
        session_id, held, current = self._check(credential)
        if current:
            self.confirm(session_id)  # a pending one, if any, is spent: the client holds the next
            held.pending = held.secret
        next_secret = secrets.token_urlsafe(32)
        held.secret = _digest(next_secret)
        held.deadline = None
        previous, held.route.sink = held.route.sink, sink
        last = held.slot_session.last_input_at  # on the scheduler's clock, as the gap's end
        gap_s = 0.0 if last is None else max(0.0, held.slot_session.clock() - last)
        transcript = list(held.route.transcript)
        credential = f"{session_id}.{next_secret}"
        return Resumed(held.slot_session, previous, gap_s, held.meta, transcript, credential)

    def _check(self, credential: str) -> tuple[str, _Held, bool]:
        """``(session_id, held, current)`` of a good credential (``current``: the session's current one,
        else the pending one of a resume not confirmed yet).

        Raises:
            Refusal: ``resume_off``, ``resume_invalid``, ``resume_replayed`` or ``resume_expired``.
        """
        if self.hold_s <= 0:
            raise Refusal("resume_off", RESUME_OFF_MESSAGE)
        parsed = credential_session(credential)
        if parsed is None:
            raise Refusal(
                "resume_invalid",
                "resume credential malformed: expected <session id>.<secret> as sent in the 0x04 metadata",
            )
        session_id, secret = parsed
        self.sweep()  # a resume past the deadline is refused even if the sweep has not run yet
        held = self._held.get(session_id)
        digest = _digest(secret)
        if held is None:
            ended = self._ended.get(session_id)
            if ended is not None and any(hmac.compare_digest(digest, known) for known in ended[1]):
                raise Refusal("resume_expired", f"session {session_id} cannot be resumed: {ended[0]}")
            raise Refusal("resume_invalid", NOT_A_CREDENTIAL_MESSAGE)
        current = hmac.compare_digest(digest, held.secret)
        retry = held.pending is not None and hmac.compare_digest(digest, held.pending)
        if not current and not retry:
            if any(hmac.compare_digest(digest, spent) for spent in held.spent):
                raise Refusal(
                    "resume_replayed", f"this resume credential of session {session_id} was used already"
                )
            raise Refusal("resume_invalid", NOT_A_CREDENTIAL_MESSAGE)
        return session_id, held, current


def _settle(held: _Held) -> None:
    """Wake a resume probing ``held``'s owner (:meth:`SlotHolds.probe_owner`), if any: detached or ended."""
    if held.probe is not None and not held.probe.done():
        held.probe.set_result(None)
