"""The waiting room's per-address cap (``runtime.engine.waiting_room.SlotAdmission``, issue 21: one address
could fill the waiting room), over a stand-in scheduler whose slots are all taken.

Planted bug this guards: the cap counting every waiter instead of those of the caller's address (or not
counting at all) passed the suite before this file.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from runtime.engine.scheduler import NodeFull
from runtime.engine.waiting_room import SlotAdmission, TooManyWaitingFromClient, WaitingRoomFull
from runtime.metrics import RuntimeMetrics


class FullScheduler:
    """Every slot taken until :meth:`free_one`; records releases."""

    def __init__(self, slots: int = 1) -> None:
        self.slots = slots
        self.free = 0
        self.on_slot_freed = None
        self.released: list[str] = []

    def admit(self, session: SimpleNamespace) -> int:
        if self.free == 0:
            raise NodeFull("all slots in use")
        self.free -= 1
        return 0

    def release(self, session: SimpleNamespace) -> None:
        self.released.append(session.session_id)


def _session(name: str) -> SimpleNamespace:
    return SimpleNamespace(session_id=name)


async def _queued(admission: SlotAdmission, count: int) -> None:
    async with asyncio.timeout(5):
        while admission.waiting < count:
            await asyncio.sleep(0)


async def test_one_address_cannot_fill_the_waiting_room() -> None:
    scheduler = FullScheduler()
    admission = SlotAdmission(
        scheduler, wait_s=60, max_waiting=5, metrics=RuntimeMetrics(), max_waiting_per_client=2
    )
    first = asyncio.ensure_future(admission.admit(_session("a1"), client="10.0.0.1"))
    second = asyncio.ensure_future(admission.admit(_session("a2"), client="10.0.0.1"))
    await _queued(admission, 2)
    per_address = r"2 callers from your address wait already \(at most 2 per address\)"
    with pytest.raises(TooManyWaitingFromClient, match=per_address):
        await admission.admit(_session("a3"), client="10.0.0.1")
    other = asyncio.ensure_future(admission.admit(_session("b1"), client="10.0.0.2"))
    await _queued(admission, 3)  # another address still gets a place
    assert admission.position("b1") == 3
    scheduler.free = 1
    admission.grant()
    assert await first == 0  # first come, first served
    for task in (second, other):
        task.cancel()
    await asyncio.gather(second, other, return_exceptions=True)
    assert admission.waiting == 0


async def test_without_a_cap_one_address_may_take_every_place() -> None:
    admission = SlotAdmission(FullScheduler(), wait_s=60, max_waiting=3, metrics=RuntimeMetrics())
    tasks = [asyncio.ensure_future(admission.admit(_session(f"a{i}"), client="10.0.0.1")) for i in range(3)]
    await _queued(admission, 3)
    with pytest.raises(WaitingRoomFull) as refused:
        await admission.admit(_session("a4"), client="10.0.0.1")
    assert not isinstance(refused.value, TooManyWaitingFromClient)  # the room is full, not the address
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
