"""A slot backend for front-end unit tests: no model, no tick, no ZeroMQ (``runtime.engine.api.SlotBackend``).

Admission is immediate (or the refusal a test sets), the persona prompt is done at once, and every input
frame comes straight back as that tick's output (an echo), so a test sees exactly what it sent.
"""

from __future__ import annotations

import asyncio

import numpy as np

from runtime.engine.api import (
    MIMI_FRAME,
    AdmitRequest,
    BackendStatus,
    Refusal,
    SessionSink,
    SlotBackend,
    SlotLease,
    node_full_message,
)


class FakeBackend(SlotBackend):
    """``slots`` echo slots; ``loaded`` False answers as a model still loading; :meth:`lose` as an engine
    process that died. ``refuse_with``: a :class:`Refusal` every admission raises. ``frame``: the model's
    frame it reports (Mimi's unless a test says otherwise)."""

    def __init__(self, slots: int = 2, *, loaded: bool = True, voices: tuple[str, ...] = ("alice",)) -> None:
        self.slots = slots
        self.loaded = loaded
        self.lost = False
        self.voices = voices
        self.on_lost = []
        self.refuse_with: Refusal | None = None
        self.leases: dict[str, SlotLease] = {}
        self.sinks: dict[str, SessionSink] = {}
        self.requests: list[AdmitRequest] = []
        self.released: list[str] = []
        self.started = False
        self.closes = 0
        self.frame = MIMI_FRAME

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.started = False
        self.closes += 1

    def status(self) -> BackendStatus:
        return BackendStatus(
            loaded=self.loaded,
            slots=self.slots,
            free_slots=0 if self.lost else self.slots - len(self.leases),
            waiting=0,
            tick_alive=not self.lost,
            lost=self.lost,
            voices=self.voices,
            detail={"fake": True},
            frame=self.frame,
        )

    def check_persona(self, voice_prompt: str | None, text_prompt: str | None) -> None:
        if voice_prompt and voice_prompt not in self.voices:
            raise ValueError(f"unknown voice prompt {voice_prompt!r}; this node has: {list(self.voices)}")

    async def admit(self, request: AdmitRequest, sink: SessionSink) -> SlotLease:
        self.requests.append(request)
        if self.refuse_with is not None:
            raise self.refuse_with
        if len(self.leases) >= self.slots:
            raise Refusal("node_full", node_full_message(self.slots))
        lease = SlotLease(request.session_id, slot=len(self.leases))
        self.leases[request.session_id] = lease
        self.sinks[request.session_id] = sink
        asyncio.get_running_loop().call_soon(sink.on_prompt_done)
        return lease

    def push_frame(self, lease: SlotLease, frame: np.ndarray) -> bool:
        sink = self.sinks.get(lease.session_id)
        if sink is not None:
            sink.on_output(frame.copy(), None)
        return True

    def release(self, lease: SlotLease) -> None:
        if self.leases.pop(lease.session_id, None) is not None:
            self.sinks.pop(lease.session_id, None)
            self.released.append(lease.session_id)

    def lose(self) -> None:
        """The engine died: lost, and every ``on_lost`` callback called."""
        self.lost = True
        for callback in self.on_lost:
            callback()
