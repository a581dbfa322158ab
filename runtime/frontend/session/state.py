"""Where a conversation stands: :class:`SessionState`, read and set by
``runtime.frontend.session.conversation.ChatSession``, its resume half and
``runtime.frontend.session.lifecycle``."""

from __future__ import annotations

import enum

__all__ = ["SessionState"]


class SessionState(enum.Enum):
    """A conversation's state (``ChatSession.state``), in the lifecycle's order (docs/runtime.md)."""

    PLANNED = "planned"
    """Made from a checked request; no slot yet."""
    ADMITTED = "admitted"
    """Holds a slot (admitted, or resumed); the persona prompt or the transport's connection awaited."""
    LIVE = "live"
    """Handshake sent: audio flows both ways."""
    DETACHED = "detached"
    """Its transport was lost; the slot is held, paused, for a resume through any connection."""
    ENDED = "ended"
    """Finished here: the slot given back, the end counted."""
    MOVED = "moved"
    """Resumed through another connection, which carries the session on (this one counts no end)."""

    @property
    def started(self) -> bool:
        """The conversation has held a slot (it is counted as started, and its end will be)."""
        return self is not SessionState.PLANNED
