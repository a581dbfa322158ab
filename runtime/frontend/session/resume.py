"""The resume half of ``runtime.frontend.session.conversation.ChatSession``, for any transport: detach a
session whose
transport was lost, hold its slot, resume it from another connection (docs/runtime.md, "Resume").

A transport uses four methods and one property:

- after its handshake, when :attr:`ResumableSession.offers_resume`, it sends
  :meth:`ResumableSession.resume_metadata` (the WebSocket: a 0x04 metadata message);
- when its connection is lost without a normal close, it calls :meth:`ResumableSession.detach` and, when
  that says the slot is held, awaits :meth:`ResumableSession.held` (resumed elsewhere, or expired) before
  it finishes the session;
- a connection that presents a credential calls :meth:`ResumableSession.resume` instead of ``admit``.

The slots' owner (``runtime.engine.resume``, in the engine process with ``--workers N``) checks the
credentials and hands the slot over, so a resume may arrive through any worker of the node. The session it
took over learns it in :meth:`ResumableSession.on_taken_over`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import TYPE_CHECKING, Protocol

from runtime.engine.api import Refusal, ResumeGrant, SessionSink, SlotBackend, SlotLease
from runtime.frontend.gate.refusals import CLOSE_NORMAL, SessionRefused
from runtime.frontend.session.state import SessionState
from runtime.frontend.store.redis_store import SessionRecord, SessionStore
from runtime.region_routes import resume_url

if TYPE_CHECKING:
    from runtime.config import RuntimeConfig
    from runtime.frontend.gate.query import SessionRequest
    from runtime.metrics import RuntimeMetrics

__all__ = ["HOLD_MARGIN_S", "ResumableSession"]

log = logging.getLogger(__name__)

HOLD_MARGIN_S = 5.0
"""A detached session waits for its slot owner's word (resumed or expired) at most ``resume_s`` plus this;
then it gives the slot back itself (an engine that stopped answering)."""


class _Front(Protocol):
    config: RuntimeConfig
    backend: SlotBackend
    metrics: RuntimeMetrics
    store: SessionStore | None


class _Closer(Protocol):
    name: str

    async def close(self, code: int, reason: str) -> None: ...


class ResumableSession(SessionSink):
    """Resume for a session (``ChatSession`` sets the attributes below in its constructor and implements
    the rest of the sink)."""

    front: _Front
    transport: _Closer
    request: SessionRequest
    client: str
    session_id: str
    lease: SlotLease | None
    ready: asyncio.Event
    state: SessionState
    first_audio_sent: bool
    _released: bool
    record: SessionRecord | None
    started_at: float
    limit_s: float
    persona: str
    resumed: ResumeGrant | None
    credential_given = False
    """:meth:`resume_metadata` handed the transport a credential (before that, a lost session is ended)."""
    _hold: asyncio.Future[bool] | None

    @property
    def moved(self) -> bool:
        """Resumed through another connection: this one no longer holds the slot or ends the session."""
        return self.state is SessionState.MOVED

    @property
    def remaining_s(self) -> float:
        """Seconds left of the conversation's length (at least 1: a resume gets a moment to close cleanly)."""
        return max(1.0, self.limit_s - (time.time() - self.started_at))

    def resume_meta(self) -> str:
        """What the slot keeps for a resume (``AdmitRequest.meta``): start, length limit, persona, JSON."""
        return json.dumps({"started_at": self.started_at, "limit_s": self.limit_s, "persona": self.persona})

    # --- the slot owner's word (SessionSink) ----------------------------------------------------------

    def on_taken_over(self) -> None:
        """Resumed through another connection: close this transport; the slot and the session are theirs."""
        self.state = SessionState.MOVED
        self._released = True
        if self.record is not None and self.front.store is not None:
            self.front.store.forget_session(self.record)
        if self._hold is not None:
            if not self._hold.done():
                self._hold.set_result(True)
        else:
            asyncio.ensure_future(self.transport.close(CLOSE_NORMAL, "session resumed on another connection"))

    def on_hold_expired(self) -> None:
        self._released = True  # the slot owner freed it
        if self._hold is not None and not self._hold.done():
            self._hold.set_result(False)

    # --- the transport's side -------------------------------------------------------------------------

    @property
    def offers_resume(self) -> bool:
        """The caller asked for resume (``resumable=1``) or resumed: it gets :meth:`resume_metadata`."""
        return bool(self.request.resumable) or self.resumed is not None

    def resume_metadata(self) -> dict[str, object]:
        """What the transport sends right after its handshake when :attr:`offers_resume` (a 0x04 metadata
        JSON object on the WebSocket; docs/protocol.md, "Resume"): ``session_id``; ``node`` (the node that
        holds the slot: ``DUPLEX_NODE_ID``, the pod's name on GKE); ``resume`` (the single-use credential;
        absent when the node holds no slot for resume), ``resume_s`` (the hold, s); ``resume_url`` where
        the resume goes to reach this pod again through a multi-region stack's global entry (only with
        ``DUPLEX_REGION``, ``DUPLEX_PUBLIC_URL`` and ``DUPLEX_POD_IP`` set: ``runtime.region_routes``; a
        WebRTC session's names the ``POST``); after a resume ``resumed`` true and ``gap_ms`` (from the last
        frame before the drop)."""
        lease = self.lease
        config = self.front.config
        body: dict[str, object] = {
            "session_id": self.session_id,
            "node": config.node_id,
            "resume_s": config.resume_s,
        }
        if lease is not None and lease.resume_credential:
            body["resume"] = lease.resume_credential
            self.credential_given = True
            if config.region and config.public_url and config.pod_ip:
                body["resume_url"] = resume_url(
                    config.public_url, config.region, config.pod_ip, self.transport.name
                )
        if self.resumed is not None:
            body["resumed"] = True
            body["gap_ms"] = round(self.resumed.gap_s * 1e3)
        return body

    async def resume(self) -> int:
        """Take over the slot of the session that ``request.resume`` (a credential) names, instead of
        :meth:`admit`: the same slot and session id, its outputs to this session from now on, the next
        credential in the lease. The credential presented is spent by this connection's first frame
        (``runtime.engine.resume``): lost before it, the slot is held again and a retry may present it
        again. No token is spent: the credential is the right.

        Raises:
            SessionRefused: ``resume_off``, ``resume_invalid``, ``resume_replayed``, ``resume_expired``,
                ``resume_live`` (or
                ``not_ready``, ``draining``, ``engine_lost``); counted in ``duplex_resume_refused_total``.
        """
        assert self.request.resume is not None
        metrics = self.front.metrics
        try:
            grant = await self.front.backend.resume(self.request.resume, self, self.client)
        except Refusal as exc:
            metrics.resume_refused.labels(reason=exc.reason).inc()
            raise SessionRefused(exc.reason, exc.message) from None
        self.resumed, self.lease = grant, grant.lease
        self.session_id = grant.lease.session_id
        self.first_audio_sent = True  # the first audio was the first connection's
        self.state = SessionState.ADMITTED
        with contextlib.suppress(ValueError, TypeError, KeyError):
            meta = json.loads(grant.meta)
            self.started_at, self.limit_s = float(meta["started_at"]), float(meta["limit_s"])
            self.persona = str(meta["persona"])
        self.ready.set()  # the slot is live: no persona prompt to wait for
        metrics.sessions_resumed.inc()
        metrics.transport_sessions_active.labels(transport=self.transport.name).inc()  # carried here now
        metrics.resume_gap.observe(grant.gap_s)
        store = self.front.store
        if store is not None:
            self.record = SessionRecord(
                self.session_id,
                self.front.config.node_id,
                grant.lease.slot,
                self.started_at,
                self.persona,
                self.request.format.value,
            )
            extra = {"slot": str(grant.lease.slot), "gap_ms": str(round(grant.gap_s * 1e3))}
            store.adopt_session(self.record, grant.transcript, extra)
        log.info("session %s resumed on slot %d after %.2f s", self.session_id, grant.lease.slot, grant.gap_s)
        return grant.lease.slot

    def detach(self) -> bool:
        """The transport was lost without a normal close: hold the slot, paused, for ``resume_s`` (then
        await :meth:`held`). False when there is nothing to hold (not resumable, no credential given to
        the client yet and not a resume, released or resumed elsewhere already): finish the session as
        usual."""
        lease = self.lease
        if self.moved or self._released or lease is None or not lease.resume_credential:
            return False
        if not self.credential_given and self.resumed is None:  # lost before its credential was sent:
            return False  # nobody can resume it (a resumed one: the credential it presented still can)
        self._hold = asyncio.get_running_loop().create_future()
        if not self.front.backend.detach(lease):
            self._hold = None
            return False
        self.state = SessionState.DETACHED
        self.front.metrics.sessions_detached.inc()
        hold_s = self.front.config.resume_s
        log.info("session %s detached: slot %d held %g s for a resume", self.session_id, lease.slot, hold_s)
        return True

    async def held(self) -> bool:
        """After :meth:`detach`, until the slot owner's word: True once resumed through another connection
        (nothing to end here), False when the hold ran out (the slot is free: finish the session with
        ``resume_expired``). Past ``resume_s`` + :data:`HOLD_MARGIN_S` without a word, False too (the
        session's ``finish`` then gives the slot back itself)."""
        assert self._hold is not None
        try:
            async with asyncio.timeout(self.front.config.resume_s + HOLD_MARGIN_S):
                return await asyncio.shield(self._hold)
        except TimeoutError:
            return self.moved
