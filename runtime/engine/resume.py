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
- **Resume**: the credential names the session; the slot's outputs go to the new sink from then on (the
  old sink, if it had not noticed its loss, gets ``on_taken_over``).
- **Expiry**: :meth:`SlotHolds.sweep` (every ``SWEEP_S`` on the owner's loop) frees holds past their
  deadline on the injected ``clock`` and tells their sink ``on_hold_expired``; a resume past the deadline
  is refused even before the sweep ran.

Refusals (``runtime.engine.api.RESUME_REFUSAL_REASONS``) say what was wrong and never touch another
session.
"""

from __future__ import annotations

import asyncio
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

__all__ = ["ENDED_MEMORY", "SWEEP_S", "Resumed", "SinkRoute", "SlotHolds", "credential_session"]

log = logging.getLogger(__name__)

SWEEP_S = 0.1
"""How often the holds are checked for expiry (s): a held slot frees at most this late."""
ENDED_MEMORY = 4096
"""Sessions remembered after they ended (for a clear ``resume_expired`` instead of ``resume_invalid``)."""
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
        transcript from it (``runtime.frontend.session_store.SessionStore.adopt_session``)."""
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
    """

    def __init__(
        self,
        hold_s: float,
        release: Callable[[SlotSession], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hold_s = hold_s
        self.clock = clock
        self._release = release
        self._held: dict[str, _Held] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # session id -> why it cannot be resumed
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
        if self._held.pop(session_id, None) is not None:
            self._ended[session_id] = why
            while len(self._ended) > ENDED_MEMORY:
                self._ended.popitem(last=False)

    def detach(self, session_id: str) -> bool:
        """Hold the session's slot, paused, for ``hold_s``; False when it is not resumable (release it)."""
        held = self._held.get(session_id)
        if held is None:
            return False
        held.deadline = self.clock() + self.hold_s
        held.slot_session.paused = True
        held.slot_session.inbox.clear()  # the tick takes no stale frame when the caller is back
        return True

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
        if held is None:
            why = self._ended.get(session_id)
            if why is not None:
                raise Refusal("resume_expired", f"session {session_id} cannot be resumed: {why}")
            raise Refusal("resume_invalid", f"no session {session_id} on this node")
        digest = _digest(secret)
        current = hmac.compare_digest(digest, held.secret)
        retry = held.pending is not None and hmac.compare_digest(digest, held.pending)
        if not current and not retry:
            if any(hmac.compare_digest(digest, spent) for spent in held.spent):
                raise Refusal(
                    "resume_replayed", f"this resume credential of session {session_id} was used already"
                )
            raise Refusal("resume_invalid", f"not a resume credential of session {session_id}")
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
