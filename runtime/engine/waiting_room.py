"""Admission to the slots with a bounded waiting room: a caller arriving while every slot is taken waits, in
order, for at most ``wait_s`` seconds, behind at most ``max_waiting - 1`` others; past either bound it is
refused with a clear reason.

Kyutai's stock server keeps a caller waiting for a slot, and its clients simply wait for the 0x00 handshake
(the web client shows "Waiting for a slot"); this runtime refused at once with a 0x05 error that Kyutai's
Python client shows only as "unknown message kind 5" (issue 16). With a waiting room those clients wait as
they do against Kyutai's server.

Engine side: it knows the scheduler's slots and nothing of sockets. It runs on the event loop of the
process that owns the slots (the only process in ``--workers 0``; the engine process otherwise), so the
queue, the positions and the cap are exact for the whole node. The scheduler tells it, through
``SlotScheduler.on_slot_freed``, when a slot frees.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runtime.engine.scheduler import NodeFull, SlotScheduler, SlotSession
from runtime.metrics import RuntimeMetrics

if TYPE_CHECKING:
    import sentencepiece

    from runtime.engine.batch import BatchEngine

__all__ = ["SlotAdmission", "TooManyWaitingFromClient", "WaitTimeout", "WaitingRoomFull", "open_slots"]

log = logging.getLogger(__name__)


class WaitingRoomFull(NodeFull):
    """Every slot is taken and the waiting room holds ``max_waiting`` callers already."""


class WaitTimeout(NodeFull):
    """The caller waited ``wait_s`` seconds and no slot freed for it."""


class TooManyWaitingFromClient(WaitingRoomFull):
    """Every slot is taken and ``max_waiting_per_client`` callers from the same address wait already."""


@dataclass(eq=False)
class _Waiter:
    session: SlotSession
    future: asyncio.Future[int]
    client: str = ""
    since: float = field(default_factory=time.monotonic)


class SlotAdmission:
    """FIFO admission to ``scheduler``'s slots.

    Args:
        scheduler: the slot owner; its ``on_slot_freed`` is set here.
        wait_s: longest wait for a slot (s); 0 refuses at once when the node is full.
        max_waiting: callers that may wait at once; 0 refuses at once.
        max_waiting_per_client: callers from one address that may wait at once (0: no cap), so that one
            address cannot fill the waiting room.
        metrics: ``duplex_waiting_sessions``, ``duplex_waiting_room_total{outcome}``,
            ``duplex_waiting_room_wait_seconds``.
    """

    def __init__(
        self,
        scheduler: SlotScheduler,
        *,
        wait_s: float,
        max_waiting: int,
        metrics: RuntimeMetrics,
        max_waiting_per_client: int = 0,
    ) -> None:
        self.scheduler = scheduler
        self.wait_s = wait_s
        self.max_waiting = max_waiting
        self.max_waiting_per_client = max_waiting_per_client
        self.metrics = metrics
        self._queue: deque[_Waiter] = deque()
        self._loop = asyncio.get_running_loop()
        scheduler.on_slot_freed = self._slot_freed_threadsafe

    @property
    def waiting(self) -> int:
        """Callers waiting now."""
        return len(self._queue)

    def position(self, session_id: str) -> int | None:
        """1-based place of ``session_id`` in the queue (1: next to get a slot), or None if not waiting."""
        for index, waiter in enumerate(self._queue):
            if waiter.session.session_id == session_id:
                return index + 1
        return None

    async def admit(self, session: SlotSession, client: str = "") -> int:
        """A slot for ``session``: at once when one is free and nobody waits, else after waiting its turn.
        ``client``: the caller's address ("" for unknown: not counted against a per-client cap).

        Cancelling the call (the caller left) takes it out of the queue; a slot granted meanwhile, even in
        the same loop step as the cancellation, is released again.

        Returns:
            the slot index.
        Raises:
            NodeFull: every slot is taken and the waiting room is off (``wait_s`` or ``max_waiting`` 0).
            WaitingRoomFull: every slot is taken and ``max_waiting`` callers wait already.
            TooManyWaitingFromClient: ``max_waiting_per_client`` callers from ``client`` wait already.
            WaitTimeout: no slot freed for this caller within ``wait_s``.
        """
        if not self._queue:
            try:
                return self.scheduler.admit(session)
            except NodeFull:
                if self.wait_s <= 0 or self.max_waiting <= 0:
                    raise
        if len(self._queue) >= self.max_waiting:
            self.metrics.waiting_room.labels(outcome="full").inc()
            raise WaitingRoomFull(
                f"all {self.scheduler.slots} slots are in use and {len(self._queue)} callers wait already "
                f"(waiting room size {self.max_waiting})"
            )
        if client and self.max_waiting_per_client > 0:
            same = sum(1 for waiter in self._queue if waiter.client == client)
            if same >= self.max_waiting_per_client:
                self.metrics.waiting_room.labels(outcome="full").inc()
                raise TooManyWaitingFromClient(
                    f"all {self.scheduler.slots} slots are in use and {same} callers from your address wait "
                    f"already (at most {self.max_waiting_per_client} per address)"
                )
        waiter = _Waiter(session, self._loop.create_future(), client)
        self._queue.append(waiter)
        self.grant()  # a slot may have freed just now, before this caller queued
        log.info("session %s waits for a slot: position %d", session.session_id, len(self._queue))
        outcome = "left"
        try:
            slot = await asyncio.wait_for(asyncio.shield(waiter.future), self.wait_s)
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # Granted in the very step the caller left: Python 3.11's wait_for returns the result and
                # swallows the cancellation (its inner future was done). Honour it: the slot goes back below.
                raise asyncio.CancelledError
            outcome = "admitted"
            return slot
        except TimeoutError:
            outcome = "timeout"
            raise WaitTimeout(
                f"no slot freed within the waiting room's {self.wait_s:g} s (all {self.scheduler.slots} "
                "slots in use)"
            ) from None
        finally:
            if waiter in self._queue:
                self._queue.remove(waiter)
            if outcome != "admitted" and waiter.future.done() and not waiter.future.cancelled():
                self.scheduler.release(session)  # granted while it was leaving: give the slot back
            if not waiter.future.done():
                waiter.future.cancel()
            self._update_gauge()
            self.metrics.waiting_room.labels(outcome=outcome).inc()
            self.metrics.waiting_room_wait.observe(time.monotonic() - waiter.since)

    def _slot_freed_threadsafe(self) -> None:
        """Called by the tick thread after it freed a slot."""
        self._loop.call_soon_threadsafe(self.grant)

    def grant(self) -> None:
        """Give free slots to the waiters at the head of the queue (on the event loop)."""
        while self._queue:
            waiter = self._queue[0]
            if waiter.future.done():
                self._queue.popleft()
                continue
            try:
                slot = self.scheduler.admit(waiter.session)
            except NodeFull:
                break
            self._queue.popleft()
            waiter.future.set_result(slot)
        self._update_gauge()

    def _update_gauge(self) -> None:
        self.metrics.waiting_sessions.set(len(self._queue))


def open_slots(
    engine: BatchEngine,
    tokenizer: sentencepiece.SentencePieceProcessor,
    metrics: RuntimeMetrics,
    loop: asyncio.AbstractEventLoop,
    *,
    wait_s: float,
    max_waiting: int,
    max_waiting_per_client: int = 0,
    stagger_groups: int = 1,
) -> SlotAdmission:
    """The slots of ``engine`` opened for sessions: a :class:`SlotScheduler` with its tick thread started
    (``stagger_groups``: its sub-tick groups, ValueError outside ``STAGGER_GROUPS``), behind a
    :class:`SlotAdmission` (its ``scheduler``) with the waiting room's bounds. What the single process and
    the engine process both start with."""
    scheduler = SlotScheduler(engine, tokenizer, metrics, loop, stagger_groups=stagger_groups)
    admission = SlotAdmission(
        scheduler,
        wait_s=wait_s,
        max_waiting=max_waiting,
        metrics=metrics,
        max_waiting_per_client=max_waiting_per_client,
    )
    scheduler.start()
    return admission
