"""One conversation's lifecycle, written once for every transport (issue 31): admit or resume, the persona
prompt, the handshake, the resume metadata, live, detached or held, finished.

A transport is its edges only (:class:`Edge`): it sends audio, text and events (the handshake, the resume
metadata, an error), refuses, closes, and says when it has ended and how (:meth:`Edge.ended`: normal, or
lost without a word from the client, with a reason). Everything between is :func:`run`:

1. **planned**: ``Edge.prepare`` (WebRTC: the token is spent on connect, only checked now), then
   ``ChatSession.admit`` (a slot, the token spent) or ``ChatSession.resume`` (a credential presented),
   abandoned at once if the transport ends meanwhile. A refusal goes to ``Edge.refuse``.
2. **admitted**: ``Edge.admitted`` (WebRTC: the answer, or the caller gone); the persona prompt awaited
   (``prompt_timeout``, 1013, past ``PROMPT_TIMEOUT_S``); ``Edge.connected`` (WebRTC: ICE and DTLS up and the
   token spent).
3. **live**: the handshake, then the resume metadata when the session offers resume; the engine's frames
   and text go out (``ChatSession.send_loop``) until the transport ends or the conversation reaches its
   length (``max_session_length``, a 0x05 naming the limit first).
4. **detached** (a resumable session whose transport was lost): its slot held for ``resume_s``
   (``runtime.frontend.session.resume``) until resumed elsewhere (**moved**), expired, or hung up
   (``Edge.hung_up``: a WebRTC ``DELETE``).
5. **ended**: ``ChatSession.finish`` (the slot, the metrics, the registry), ``Edge.shutdown``, ``Edge.done``.

The slot goes back as soon as the transport ends (``Edge.end``), not when its connection has finished
closing, unless the end is a loss a resume may follow.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TypeVar

from runtime.engine.api import SamplingParams
from runtime.frontend.gate.query import SessionRequest
from runtime.frontend.gate.refusals import CLOSE_TRY_AGAIN_LATER, SessionRefused
from runtime.frontend.gate.tokens import TokenClaims
from runtime.frontend.session.conversation import ChatSession, FrontEnd, SessionOutcome, Transport
from runtime.frontend.session.state import SessionState

__all__ = ["READER_GRACE_S", "Edge", "SessionState", "TransportClosed", "run"]

log = logging.getLogger(__name__)
T = TypeVar("T")

READER_GRACE_S = 5.0
"""After a send found the connection closed, how long the lifecycle waits for the transport to say how it
ended (normal or lost) before it takes a normal end."""


class TransportClosed(Exception):
    """The transport's connection is closed (or closing): nothing more can be sent on it."""


class _Ended(Exception):
    """The transport ended while the lifecycle awaited something else."""


class Edge(Transport):
    """A transport as :func:`run` sees it: its sends, its refusal, its close, and its end.

    The end (:meth:`end`, then :meth:`ended`) is one :class:`SessionOutcome`: the first given stands, except
    that a hang-up (``hang_up``: a ``DELETE``, the server's own close) turns a lost outcome not yet acted on
    into a normal one. Ending releases the session's slot at once unless the outcome is lost and the session
    offers resume (the lifecycle decides then: held, or finished). After :meth:`decide` only a hang-up acts:
    it ends a detached session's hold (:meth:`hung_up`).
    """

    def __init__(self) -> None:
        self.session: ChatSession | None = None
        self.outcome: SessionOutcome | None = None
        self._ended = asyncio.Event()
        self._decided = False
        self._hung_up: SessionOutcome | None = None

    # --- what a transport sends ---------------------------------------------------------------------

    @abc.abstractmethod
    async def send_handshake(self) -> None:
        """The slot is live (Kyutai's 0x00).

        Raises:
            TransportClosed: the connection is gone.
        """

    @abc.abstractmethod
    async def send_metadata(self, body: dict[str, object]) -> None:
        """A JSON object for the client (Kyutai's 0x04: the resume metadata)."""

    @abc.abstractmethod
    async def send_error(self, message: str) -> None:
        """An error sentence (Kyutai's 0x05); never raises."""

    @abc.abstractmethod
    async def refuse(self, exc: SessionRefused, *, counted: bool) -> None:
        """The session is refused before it went live: count it (``RuntimeMetrics.refused``) unless
        ``counted`` (``ChatSession.resume`` counts its own) and tell the client in the transport's terms."""

    # --- the lifecycle's hooks (defaults: nothing to do) --------------------------------------------

    async def prepare(self, session: ChatSession) -> None:
        """Before admission (WebRTC: spend the token on connect; refuse one spent already).

        Raises:
            SessionRefused: the session cannot go on.
        """
        self.session = session

    async def admitted(self, session: ChatSession) -> SessionOutcome | None:
        """The session holds a slot: None to go on, or the outcome it ends with at once (WebRTC: the
        caller left before its answer)."""
        return None

    async def connected(self) -> None:
        """Until media may flow (WebRTC: ICE and DTLS connected and the token spent)."""

    async def shutdown(self, outcome: SessionOutcome, held: bool) -> None:
        """The session is decided (``held``: detached, its slot kept for a resume): close the connection."""

    def done(self) -> None:
        """The session has ended here (finished, or moved): forget it."""

    # --- the end ------------------------------------------------------------------------------------

    def end(self, outcome: SessionOutcome, *, hang_up: bool = False) -> None:
        """The transport has ended with ``outcome`` (see the class doc)."""
        if self._decided:  # decided (detached, or ending): only a hang-up ends the hold
            if hang_up:
                self._hung_up = outcome
                self._ended.set()
            return
        if self.outcome is None or (hang_up and self.outcome.lost):
            self.outcome = outcome
        session = self.session
        if session is not None and not (self.outcome.lost and session.offers_resume):
            session.release()
        self._ended.set()

    @property
    def has_ended(self) -> bool:
        """:meth:`end` was called (before the lifecycle decided)."""
        return self._ended.is_set() and not self._decided

    async def ended(self) -> SessionOutcome:
        """Until the transport ends; how (normal, or ``lost``, with its reason)."""
        await self._ended.wait()
        return self.outcome or SessionOutcome("client_closed")

    def decide(self) -> SessionOutcome:
        """The lifecycle reads the outcome (from now on only a hang-up acts)."""
        self._decided = True
        self._ended.clear()
        return self.outcome or SessionOutcome("client_closed")

    async def hung_up(self) -> SessionOutcome:
        """While a detached session is held: until a hang-up ends the hold; its outcome."""
        await self._ended.wait()
        return self._hung_up or SessionOutcome("client_closed")


async def _unless_ended(awaitable: Awaitable[T], edge: Edge) -> T:
    """Await ``awaitable`` unless ``edge`` ends first.

    Raises:
        _Ended: the transport ended first (``awaitable`` is cancelled).
    """
    task = asyncio.ensure_future(awaitable)
    if not task.done() and not edge.has_ended:
        ended = asyncio.ensure_future(edge._ended.wait())
        try:
            await asyncio.wait({task, ended}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            ended.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise _Ended()


async def _send_until_closed(session: ChatSession) -> None:
    """The session's send loop, ended quietly when the transport closes under it."""
    with contextlib.suppress(TransportClosed):
        await session.send_loop()


async def run(
    front: FrontEnd,
    edge: Edge,
    request: SessionRequest,
    sampling: SamplingParams,
    claims: TokenClaims | None,
    client: str,
) -> None:
    """One conversation over ``edge``, from admission to its end (see the module doc); ``request`` and
    ``sampling`` from ``plan_session``, ``claims`` the token's (None: ``auth_mode=off``, or a resume)."""
    session = ChatSession(front, edge, request, sampling, claims, client)
    counted = bool(request.resume)  # ChatSession.resume counts its refusals (duplex_resume_refused_total)
    try:
        await edge.prepare(session)
        await _unless_ended(session.resume() if request.resume else session.admit(), edge)
    except SessionRefused as exc:
        await edge.refuse(exc, counted=counted)
        return
    except _Ended:  # left while waiting for a slot: the admission, cancelled, gave its place back
        outcome = edge.decide()
        session.finish(outcome)  # a slot granted as the admission was cancelled goes back too
        await edge.shutdown(outcome, False)
        return
    except BaseException:
        session.finish(SessionOutcome("client_closed"))
        await edge.shutdown(edge.decide(), False)
        raise
    early = await edge.admitted(session)
    if early is not None:
        session.finish(early)
        await edge.shutdown(edge.decide(), False)
        edge.done()
        return
    try:
        outcome = await _live(front, edge, session)
    except BaseException:  # cancelled (the server stopping): ended here, nothing held
        session.finish(edge.outcome or SessionOutcome("client_closed"))
        await edge.shutdown(edge.decide(), False)
        edge.done()
        raise
    held = outcome.lost and session.detach()
    if not held:
        session.finish(outcome)
    await edge.shutdown(outcome, held)
    if held:
        try:
            session.finish(await _hold(edge, session))
        finally:
            edge.done()
        return
    edge.done()


async def _live(front: FrontEnd, edge: Edge, session: ChatSession) -> SessionOutcome:
    """From the admission to the transport's end or the conversation's length: how it ended."""
    front.sessions.add(session)
    sender: asyncio.Task[None] | None = None
    outcome: SessionOutcome | None = None
    closed_under = False
    try:
        try:
            await _unless_ended(session.wait_prompt(), edge)
        except TimeoutError:
            outcome = SessionOutcome("prompt_timeout", CLOSE_TRY_AGAIN_LATER)
            edge.end(outcome)
            return outcome
        await _unless_ended(edge.connected(), edge)
        await edge.send_handshake()
        if session.offers_resume:  # resumable=1 or resumed: the session id and the (next) credential
            await edge.send_metadata(session.resume_metadata())
        session.state = SessionState.LIVE
        sender = asyncio.create_task(_send_until_closed(session), name=f"send {session.session_id}")
        try:
            async with asyncio.timeout(session.remaining_s):  # a resumed session keeps the first's
                await edge.ended()
        except TimeoutError:
            limit = session.limit_s
            source = "" if limit == front.config.max_session_s else " (the token's limit)"
            await edge.send_error(f"session reached max_session_s={limit:g}{source}")
            edge.end(SessionOutcome("max_session_length"))
    except _Ended:
        pass
    except TransportClosed:
        closed_under = True
    finally:
        if sender is not None:
            sender.cancel()
        front.sessions.discard(session)
        if outcome is None:
            if closed_under and not edge.has_ended:  # a send failed: the transport's reader names the end
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(edge.ended(), READER_GRACE_S)
            outcome = edge.decide()
        else:
            edge.decide()
    return outcome


async def _hold(edge: Edge, session: ChatSession) -> SessionOutcome:
    """While the detached ``session``'s slot is held: its outcome once resumed elsewhere (that connection
    ends the session: this one counts nothing), the hold ran out (``resume_expired``), or a hang-up came
    meanwhile (a WebRTC ``DELETE``: the held slot is given back)."""
    resumed = asyncio.ensure_future(session.held())
    hung_up = asyncio.ensure_future(edge.hung_up())
    try:
        await asyncio.wait({resumed, hung_up}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not hung_up.done():
            hung_up.cancel()
    if not resumed.done():
        resumed.cancel()
        return hung_up.result()
    if resumed.result():
        return SessionOutcome("resumed_elsewhere")
    return SessionOutcome("resume_expired", lost=True)
