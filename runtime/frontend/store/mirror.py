"""The session store's records (``runtime.frontend.store.redis_store``): a session as the registry stores it,
the
local mirror of one tracked session (the state Redis must end up with), and one queued write. The writer
that applies them: ``runtime.frontend.store.writer``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from redis.typing import EncodableT, FieldT

from runtime.frontend.store.events import persona_fields

__all__ = ["SessionRecord", "persona_hash_fields"]


@dataclass(frozen=True)
class SessionRecord:
    """One session as the registry stores it.

    Attributes:
        session_id: unique id of the session (a UUID in the runtime).
        node_id: the runtime node serving it.
        slot: batch slot index on that node (0-based).
        started_at_unix_s: wall-clock start time (unix s).
        persona: the persona label (``voice=<name> text=<prompt>``, either part optional; "" when none:
            ``runtime.frontend.session.conversation.persona_label``). The text prompt is kept in the record
            only: events and listings carry its hash and length (``runtime.frontend.store.events``).
        audio_format: client audio format (e.g. ``"opus"``, ``"pcm_s16le_24k"``).
        recording: the caller consented and the session is being recorded.
    """

    session_id: str
    node_id: str
    slot: int
    started_at_unix_s: float
    persona: str
    audio_format: str
    recording: bool = False


@dataclass(eq=False)
class _Session:
    """Local mirror of one tracked session (the state Redis must end up with)."""

    record: SessionRecord
    gen: int = 0
    ended: bool = False
    end_reason: str = ""
    ended_at_unix_s: float = 0.0
    acked: list[str] = field(default_factory=list)
    """Transcript pieces Redis acknowledged, in order (joined every ``_JOIN_EVERY`` pieces)."""
    acked_lines: list[str] = field(default_factory=list)
    """The same pieces as timestamped JSON lines (``session_events.line_entry``)."""
    pending: deque[_Op] = field(default_factory=deque)
    """Queued (not yet acknowledged, not dropped) append ops of this session, oldest first."""

    def fields(self, node_id: str) -> dict[FieldT, EncodableT]:
        rec = self.record
        out: dict[FieldT, EncodableT] = {
            "id": rec.session_id,
            "node": rec.node_id or node_id,
            "slot": str(rec.slot),
            "started_at": repr(float(rec.started_at_unix_s)),
            **persona_hash_fields(rec.persona),
            "format": rec.audio_format,
            "state": "ended" if self.ended else "active",
            "recording": "1" if rec.recording else "0",
        }
        if self.ended:
            out["end_reason"] = self.end_reason
            out["ended_at"] = repr(self.ended_at_unix_s)
        return out


def persona_hash_fields(persona: str) -> dict[FieldT, EncodableT]:
    """The persona as the session hash holds it: ``persona`` (the voice part), ``prompt`` (the text prompt,
    read only with ``?include=persona``), ``prompt_sha256`` and ``prompt_chars``."""
    voice, text, digest = persona_fields(persona)
    out: dict[FieldT, EncodableT] = {"persona": voice, "prompt": text}
    out.update(digest)
    return out


@dataclass(eq=False)
class _Op:
    """One queued write. ``kind`` is ``"register"``, ``"append"``, ``"end"`` or ``"event"`` (an event
    only: ``event_kind`` and ``extra``). A register op of a session adopted on a resume carries its whole
    history (``piece``: the transcript text, ``line``: the timestamped lines), written over what Redis
    holds."""

    kind: str
    session: _Session
    record: SessionRecord | None = None
    piece: str = ""
    line: str = ""
    at_unix_s: float = 0.0
    event_kind: str = ""
    extra: dict[str, str] | None = None
    reason: str = ""
    ended_at_unix_s: float = 0.0
    gen: int = 0
    seq: int = 0
    dropped: bool = False
