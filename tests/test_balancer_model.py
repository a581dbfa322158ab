"""Issue 33's proof: P pods x S slots (real ``duplex serve --model sim`` processes on loopback) behind the
model of the global load balancer (``tests/balancer_model.py``: balancing on each pod's reported
``slot_utilization``, the route's retry of a 503). Below capacity (P*S - 1 callers arriving in bursts) no
caller is refused, also when the balancer's reports are stale and send callers to a full pod; at P*S + k
exactly k callers wait in the waiting room or get 503 with ``Retry-After``; ``/readyz`` answers 200 on every
pod throughout (a full pod stays ready: no flapping).

On the old code every one of these fails: no pod reported a load (``endpoint-load-metrics`` absent: the
model's ``observe`` keeps 0.0 and ``load_report`` never runs), a full pod answered ``/readyz`` 503, and a
WebSocket reaching a full pod was upgraded and then refused (0x05, 1013), which no retry policy can retry.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
from balancer_model import Balancer, Caller, Pod, ReadinessWatch, burst, poll, running_pods

PODS = 3
SLOTS = 2
CAPACITY = PODS * SLOTS


def _live(callers: list[Caller]) -> list[Caller]:
    return [c for c in callers if c.live.is_set()]


async def _hang_up(callers: list[Caller]) -> None:
    await asyncio.gather(*(c.hang_up() for c in callers))


def test_the_model_skips_full_endpoints_and_takes_turns() -> None:
    balancer = Balancer([1, 2, 3])
    assert [balancer.pick() for _ in range(4)] == [1, 2, 3, 1]
    balancer.observe(1, {"endpoint-load-metrics": "TEXT named_metrics.slot_utilization=1"})
    balancer.observe(2, {"Endpoint-Load-Metrics": "TEXT named_metrics.slot_utilization=0.5"})
    assert {balancer.pick() for _ in range(3)} == {3}  # the least utilised below the maximum
    balancer.observe(3, {"endpoint-load-metrics": "TEXT named_metrics.slot_utilization=1"})
    balancer.observe(2, {"endpoint-load-metrics": "TEXT named_metrics.slot_utilization=1"})
    assert {balancer.pick() for _ in range(3)} == {1, 2, 3}  # every one full: still sent, in turn


@pytest.mark.slow
async def test_below_capacity_no_caller_is_refused_and_above_it_exactly_k_get_retry_after(
    tmp_path: Path,
) -> None:
    async with running_pods(tmp_path, PODS, SLOTS) as pods, ReadinessWatch(pods) as watch:
        ports = [pod.port for pod in pods]

        # 1. P*S - 1 callers in bursts of 3 and 2, placed on the reports the pods gave.
        balancer = Balancer(ports)
        await balancer.health_check()
        callers = await burst(balancer, 3)
        callers += await burst(balancer, CAPACITY - 1 - 3)
        await poll(lambda: len(_live(callers)) == CAPACITY - 1, "every caller below capacity live")
        assert not [c.placement for c in callers if c.refused]
        per_pod = Counter(c.placement.port for c in callers)
        assert max(per_pod.values()) <= SLOTS, per_pod
        assert all(c.placement.tried == [c.placement.port] for c in callers)  # no retry was needed
        await _hang_up(callers)
        await poll(lambda: _all_free(pods), "every slot free again")

        # 2. Stale reports: the balancer last heard from every pod while it was empty; one pod has filled
        # meanwhile (callers through another entry). A burst still loses nobody: the full pod's 503
        # (before the upgrade) reports slot_utilization=1, and the retry goes elsewhere.
        stale = Balancer(ports)
        await stale.health_check()
        direct = await burst(Balancer([ports[0]]), SLOTS)
        await poll(lambda: len(_live(direct)) == SLOTS, "the first pod full")
        callers = await burst(stale, CAPACITY - 1 - SLOTS)
        await poll(lambda: len(_live(callers)) == CAPACITY - 1 - SLOTS, "every caller below capacity live")
        assert not [c.placement for c in callers if c.refused]
        retried = [c.placement for c in callers if len(c.placement.tried) > 1]
        assert retried and all(p.tried[0] == ports[0] and p.port != ports[0] for p in retried), retried
        await _hang_up(direct + callers)
        await poll(lambda: _all_free(pods), "every slot free again")

        # 3. P*S + k: the fleet fills, then exactly k callers get 503 with Retry-After (no waiting room).
        k = 2
        await balancer.health_check()
        callers = await burst(balancer, CAPACITY)
        await poll(lambda: len(_live(callers)) == CAPACITY, "the fleet full")
        extra = await burst(balancer, k)
        refused = [c.placement for c in extra if c.refused]
        assert len(refused) == k, [c.placement for c in extra]
        assert all(p.status == 503 and p.retry_after == "5" for p in refused), refused
        assert all(len(p.tried) == 1 + balancer.num_retries for p in refused), refused
        assert len(_live(callers)) == CAPACITY
        await _hang_up(callers + extra)
    assert watch.flaps() == {}
    assert all(len(seen) >= 1 for seen in watch.answers.values())


@pytest.mark.slow
async def test_above_capacity_the_extra_callers_wait_then_take_a_freed_slot(tmp_path: Path) -> None:
    """The multi-region pods' waiting room (``waitingRoomS``): one place per pod here, so of P*S + k callers
    (k = P + 1) P wait and one gets 503 with Retry-After; a slot that frees goes to its pod's waiting
    caller."""
    room = {"DUPLEX_WAITING_ROOM_S": "120", "DUPLEX_WAITING_ROOM_SIZE": "1"}
    async with running_pods(tmp_path, PODS, SLOTS, **room) as pods, ReadinessWatch(pods) as watch:
        balancer = Balancer([pod.port for pod in pods])
        await balancer.health_check()
        callers = await burst(balancer, 3)
        callers += await burst(balancer, CAPACITY - 3)
        await poll(lambda: len(_live(callers)) == CAPACITY, "the fleet full")
        assert not [c.placement for c in callers if c.refused]

        k = PODS + 1
        extra = await burst(balancer, k)
        refused = [c.placement for c in extra if c.refused]
        waiting = [c for c in extra if not c.refused]

        async def waiting_in_pods() -> int:
            return sum([int(str((await pod.slotz())["waiting"])) for pod in pods])

        await poll(lambda: _equals(waiting_in_pods(), PODS), "one caller waiting on every pod")
        assert len(waiting) == PODS and len(refused) == 1, [c.placement for c in extra]
        assert refused[0].status == 503 and refused[0].retry_after == "5", refused
        assert {c.placement.port for c in waiting} == {pod.port for pod in pods}
        assert not _live(waiting)

        # A slot frees on the first waiting caller's pod: that caller takes it.
        first = waiting[0]
        leaving = next(c for c in callers if c.placement.port == first.placement.port)
        await leaving.hang_up()
        await poll(first.live.is_set, "the waiting caller live on the freed slot")
        await _hang_up(callers + extra)
    assert watch.flaps() == {}


async def _all_free(pods: list[Pod]) -> bool:
    return [(await pod.slotz())["free_slots"] for pod in pods] == [SLOTS] * len(pods)


async def _equals(value: object, expected: int) -> bool:
    return await value == expected  # type: ignore[misc]
