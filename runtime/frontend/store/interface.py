"""What the rest of the front end needs of the session store, as two protocols (the model:
``runtime.frontend.gate.replay.ReplayGuard``).

:class:`SessionLog` is what a conversation writes (``runtime.frontend.session``): its registration, its text,
its end, and the hand-over of a resumed session; :class:`SessionReader` is what the sessions API reads and
erases (``runtime.frontend.sessions_api``). The Redis implementations: ``runtime.frontend.store.redis_store.
SessionStore`` and ``runtime.frontend.store.records.RedisSessionReader``; the key layout they share:
``runtime.frontend.store.keys``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from runtime.frontend.store.mirror import SessionRecord

__all__ = ["SessionLive", "SessionLog", "SessionReader"]


class SessionLive(Exception):
    """The session is still going on: it cannot be erased (nor its recording read) before it ends."""


@runtime_checkable
class SessionLog(Protocol):
    """The conversation's side: synchronous, non-blocking, never raising (called from the frame loop);
    failures are counted by the implementation, never raised into the audio path."""

    def register_session(
        self,
        record: SessionRecord,
        event_kind: str = "started",
        extra: dict[str, str] | None = None,
        history: tuple[str, str] = ("", ""),
    ) -> None:
        """Record ``record`` as active (a ``started`` event, or ``event_kind`` with ``extra``)."""
        ...

    def append_transcript(self, session_id: str, piece: str) -> None:
        """Add one text piece (the model's, as sent to the client) to the session's transcript."""
        ...

    def end_session(self, session_id: str, reason: str) -> None:
        """Record the session's end and its ``reason`` (``duplex_sessions_ended_total``'s reasons)."""
        ...

    def record_event(self, session_id: str, kind: str, fields: dict[str, str] | None = None) -> None:
        """Publish an event of a live session alone (``runtime.frontend.store.events.EVENT_KINDS``)."""
        ...

    def adopt_session(
        self,
        record: SessionRecord,
        transcript: Sequence[tuple[float, str]],
        extra: dict[str, str] | None = None,
    ) -> None:
        """A session resumed here: register it again with its whole history (``transcript``: each text
        piece with when it was produced, unix s), written over what the store holds."""
        ...

    def forget_session(self, record: SessionRecord) -> None:
        """Stop tracking a session resumed elsewhere (its new holder writes it from now on)."""
        ...


@runtime_checkable
class SessionReader(Protocol):
    """The sessions API's side (async). Every method raises ``redis.exceptions.RedisError`` (or
    ``OSError``/``TimeoutError``) when the store is unreachable."""

    async def list(
        self,
        *,
        state: str | None = None,
        limit: int = 100,
        before: float | None = None,
        tenant: str | None = None,
    ) -> list[dict[str, Any]]:
        """Sessions newest first, at most ``limit``, started before ``before`` (unix s), in ``state``
        (``active``/``ended``) and of ``tenant`` when given; without transcripts nor prompt text."""
        ...

    async def read(
        self, session_id: str, *, include_persona: bool = False, tenant: str | None = None
    ) -> dict[str, Any] | None:
        """One session with its transcript (its text prompt with ``include_persona``), or None (none of
        ``tenant``'s, when given)."""
        ...

    async def state(self, session_id: str, *, tenant: str | None = None) -> str | None:
        """``active``, ``ended``, or None when the store holds no record of the session (of ``tenant``,
        when given)."""
        ...

    async def erase(self, session_id: str, *, tenant: str | None = None) -> bool:
        """Delete everything the store holds of an ended session; False when it held nothing (of
        ``tenant``'s, when given: another tenant's session is left alone).

        Raises:
            SessionLive: the session has not ended (nothing is deleted).
        """
        ...

    async def close(self) -> None: ...
