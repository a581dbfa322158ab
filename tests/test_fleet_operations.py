"""Calls survive the fleet's own operations (issue 33), measured on a harness model: P real ``duplex serve
--model sim`` pods on loopback (``tests/sim_pods.py``), each standing for one runtime pod on one GPU of a
pool at its maximum (P GPUs, all in use), callers placed by a balancer model on the pods with a free slot.

(a) A rollout as the Deployment controller runs it under ``infra.k8s.disruption.ROLLOUT_STRATEGY``
(``maxSurge`` 0, ``maxUnavailable`` 1): one old pod at a time is terminated (its preStop: SIGTERM, the
drain), its GPU frees when it exits, the replacement starts on it; the next step follows once the
replacement is ready. (b) A scale-in by one pod: the pod the ReplicaSet controller deletes, by the
``controller.kubernetes.io/pod-deletion-cost`` each pod patches from its live sessions
(``runtime.fleet.deletion_cost``, on: the pods reach a fake API server over HTTPS,
``tests/fake_kube_api.py``), then newest first (``replicaset_victim``).

A call is cut when the node closes it before the caller hangs up. Goal: 0. Figures: docs/benchmarks.md,
"Calls cut by a rollout and a scale-in".
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import websockets
from fake_kube_api import FakeKubeApi
from sim_pods import NAMESPACE, SimPod, SimPods

from infra.k8s.disruption import ROLLOUT_STRATEGY
from runtime.fleet.deletion_cost import ANNOTATION

SLOTS = 3
PODS = 3
LONGEST_CALL_S = 6.0
"""The longest call of the model; the pods' drain grace is 2 s more (on GKE: the longest session + 60 s)."""


def replicaset_victim(pods: Sequence[SimPod], costs: Mapping[str, int]) -> SimPod:
    """The pod a ReplicaSet scaled down by one deletes, among running, ready pods: the lowest
    ``pod-deletion-cost`` (``costs`` by pod name; a pod without the annotation costs 0), then the newer
    (kubernetes/pkg/controller/controller_utils.go ``ActivePodsWithRanks``: rule 4, then the newer
    creation time; rules 1-3 order unscheduled, pending and not-ready pods first, none here)."""
    return min(pods, key=lambda p: (costs.get(p.name, 0), -p.created))


def gpus_needed_by_a_rollout(strategy: Mapping, replicas: int) -> int:
    """The most GPUs a rollout of ``replicas`` one-GPU pods holds at once: ``replicas`` + ``maxSurge``
    (a terminating pod holds its GPU until it exits, and ``maxUnavailable`` does not count it)."""
    return replicas + int(strategy["rollingUpdate"]["maxSurge"])


@dataclass
class Call:
    """One caller: placed on ``pod``, hangs up after ``length_s``; ``cut`` when the node closed first."""

    pod: str
    length_s: float
    admitted: bool = False
    cut: bool = False
    close_code: int | None = None
    refusal: str = ""


@dataclass
class Calls:
    """Every call placed by :meth:`place` (``calls``), and the callers no pod had a slot for."""

    calls: list[Call] = field(default_factory=list)
    no_slot: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    load: dict[str, int] = field(default_factory=dict)

    def place(self, fleet: SimPods, length_s: float, pod: SimPod | None = None) -> Call | None:
        """The balancer model: the least-loaded pod not terminating with a free slot (or ``pod``)."""
        if pod is None:
            free = [p for p in fleet.serving() if self.load.get(p.name, 0) < fleet.slots]
            if not free:
                self.no_slot += 1
                return None
            pod = min(free, key=lambda p: (self.load.get(p.name, 0), p.created))
        call = Call(pod.name, length_s)
        self.calls.append(call)
        self.load[pod.name] = self.load.get(pod.name, 0) + 1
        task = asyncio.create_task(self._run(call, pod))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return call

    async def _run(self, call: Call, pod: SimPod) -> None:
        try:
            async with websockets.connect(pod.chat_url(), max_size=2**20, compression=None, proxy=None) as ws:
                first = await asyncio.wait_for(ws.recv(), 30)
                call.admitted = first == b"\x00"
                if not call.admitted:
                    call.refusal = repr(first)[:120]
                    return

                async def listen() -> None:
                    with contextlib.suppress(websockets.ConnectionClosed):
                        async for _ in ws:
                            pass

                listener = asyncio.create_task(listen())
                done, _ = await asyncio.wait({listener}, timeout=call.length_s)
                if done:  # the node closed it before the caller hung up
                    call.cut = True
                    call.close_code = ws.close_code
                else:
                    await ws.close()
                    listener.cancel()
        except (OSError, websockets.InvalidStatus, websockets.ConnectionClosed) as exc:
            call.cut = call.admitted
            call.refusal = call.refusal or f"{type(exc).__name__}: {exc}"[:120]
        finally:
            self.load[pod.name] -= 1

    async def settle(self, timeout_s: float = 60.0) -> None:
        """Wait until every placed call has ended."""
        if self.tasks:
            await asyncio.wait_for(asyncio.gather(*self.tasks), timeout_s)

    def summary(self) -> dict[str, int]:
        admitted = [c for c in self.calls if c.admitted]
        return {
            "placed": len(self.calls),
            "admitted": len(admitted),
            "cut": sum(c.cut for c in admitted),
            "refused_by_pod": len(self.calls) - len(admitted),
            "no_free_slot": self.no_slot,
        }


async def _reported(
    fleet: SimPods, pods: Sequence[SimPod], expected: Mapping[str, int], placed: object = None
) -> dict[str, int]:
    """Each pod's reported sessions, once they equal ``expected`` (the calls placed on it)."""
    assert fleet.http is not None
    reported: dict[str, int] = {}
    for _ in range(300):
        reported = {p.name: await p.sessions(fleet.http) for p in pods}
        if reported == dict(expected):
            return reported
        await asyncio.sleep(0.1)
    raise AssertionError(f"reported {reported}, placed {dict(expected)}: {placed() if placed else ''}")


def test_the_rollout_strategy_fits_a_pool_at_its_maximum() -> None:
    old = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert gpus_needed_by_a_rollout(old, PODS) == PODS + 1  # a GPU the pool at maxNodes does not have
    assert gpus_needed_by_a_rollout(ROLLOUT_STRATEGY, PODS) == PODS


def test_the_replicaset_deletes_the_cheapest_then_the_newest() -> None:
    pods = [SimPod(f"pod-{i}", i, 0, None, Path()) for i in range(3)]  # type: ignore[arg-type]
    assert replicaset_victim(pods, {}).name == "pod-2"  # no annotation: the newest, whatever its calls
    assert replicaset_victim(pods, {"pod-0": 3, "pod-1": 1, "pod-2": 4}).name == "pod-1"
    assert replicaset_victim(pods, {"pod-0": 0, "pod-1": 2, "pod-2": 0}).name == "pod-2"


async def _annotated(api: FakeKubeApi, expected: Mapping[str, int]) -> dict[str, int]:
    """The deletion cost each pod wrote to the API server, once it equals ``expected`` (by pod name)."""
    costs: dict[str, int] = {}
    for _ in range(300):
        costs = {
            name: int(api.annotations.get((NAMESPACE, name), {}).get(ANNOTATION, "-1")) for name in expected
        }
        if costs == dict(expected):
            return costs
        await asyncio.sleep(0.1)
    raise AssertionError(f"annotated {costs}, expected {dict(expected)}")


@pytest.mark.slow
async def test_no_call_is_cut_by_a_rollout_or_a_scale_in(tmp_path: Path) -> None:
    rng = random.Random(33)
    api = await FakeKubeApi(tmp_path / "kube-api").start()
    # The pool is at its maximum (PODS GPUs, all in use): a surge pod would never get one.
    assert gpus_needed_by_a_rollout(ROLLOUT_STRATEGY, PODS) <= PODS, (
        "the rollout stalls: no GPU for a surge pod"
    )
    async with SimPods(tmp_path, slots=SLOTS, drain_grace_s=LONGEST_CALL_S + 2, **api.env()) as fleet:
        await fleet.start(PODS)
        assert fleet.http is not None

        # (a) The rollout, with callers arriving throughout (1.5-6 s calls, one every 0.4 s).
        calls = Calls()

        async def arrivals() -> None:
            while True:
                calls.place(fleet, rng.uniform(1.5, LONGEST_CALL_S))
                await asyncio.sleep(0.4)

        arriving = asyncio.create_task(arrivals())
        await asyncio.sleep(3.0)
        steps = []
        for old in list(fleet.serving()):
            began = time.monotonic()
            held = calls.load.get(old.name, 0)
            old.terminate()  # the old ReplicaSet scaled down by one: the preStop hook's SIGTERM
            assert await old.wait_exit(LONGEST_CALL_S + 60) == 0
            drained = time.monotonic() - began
            await fleet.start(1)  # the replacement takes the freed GPU (the pool is at its maximum)
            steps.append((old.name, held, drained, time.monotonic() - began))
        await asyncio.sleep(2.0)
        arriving.cancel()
        await calls.settle()
        rollout = calls.summary()
        print(f"rollout of {PODS} pods x {SLOTS} slots: {rollout}")
        for name, held, drained, step in steps:
            print(f"  {name}: {held} calls at SIGTERM, drained in {drained:.1f} s, step {step:.1f} s")
        assert rollout["cut"] == 0, [c for c in calls.calls if c.cut]
        # No caller reached a draining or stopped pod; a "node full" is the balancer model's own race (a slot
        # freed by a hang-up is free on the pod at its next tick), not the rollout's.
        refusals = [c.refusal for c in calls.calls if not c.admitted]
        assert all("node full" in r for r in refusals), refusals
        assert rollout["admitted"] >= 2 * PODS * SLOTS  # calls ran on old and new pods alike

        # (b) Scale-in by one: the newest pod busy (3 calls), the older one light (1 call).
        calls = Calls()
        pods = fleet.serving()
        await _reported(fleet, pods, {p.name: 0 for p in pods})  # the rollout's calls have freed their slots
        # The newest pod full, the others with 1 and 2 calls: the idlest is the oldest.
        placed = {p.name: min(i + 1, SLOTS) for i, p in enumerate(pods)}
        for pod in pods:
            for _ in range(placed[pod.name]):
                calls.place(fleet, rng.uniform(LONGEST_CALL_S / 2, LONGEST_CALL_S), pod=pod)
        reported = await _reported(fleet, pods, placed, lambda: calls.calls)
        older, newest = pods[0], pods[-1]
        costs = await _annotated(api, placed)  # what each pod patched on its own object
        victim = replicaset_victim(fleet.serving(), costs)
        without = replicaset_victim(fleet.serving(), {})
        assert victim is older and without is newest
        began = time.monotonic()
        victim.terminate()
        assert await victim.wait_exit(LONGEST_CALL_S + 60) == 0
        drained = time.monotonic() - began
        await calls.settle()
        scale_in = calls.summary()
        print(
            f"scale-in: reported sessions {reported}, deletion costs {costs}: deleted {victim.name} "
            f"({reported[victim.name]} calls, drained in {drained:.1f} s); without the annotation "
            f"{without.name} ({reported[without.name]} calls); {scale_in}"
        )
        assert scale_in["cut"] == 0 and scale_in["admitted"] == sum(placed.values())
        assert api.refused == 0
    await api.close()


@pytest.mark.slow
async def test_a_split_pod_keeps_its_deletion_cost_at_its_live_sessions(tmp_path: Path) -> None:
    """As the GKE pods run it (an engine process and front-end workers): the engine patches its pod's
    annotation: 0 when idle, 2 with two calls, 0 again once they hung up."""
    api = await FakeKubeApi(tmp_path / "kube-api").start()
    try:
        async with SimPods(
            tmp_path, slots=SLOTS, drain_grace_s=LONGEST_CALL_S + 2, workers=1, **api.env()
        ) as fleet:
            [pod] = await fleet.start(1)
            assert await _annotated(api, {pod.name: 0}) == {pod.name: 0}
            calls = Calls()
            for _ in range(2):
                calls.place(fleet, 4.0, pod=pod)
            assert await _annotated(api, {pod.name: 2}) == {pod.name: 2}
            await calls.settle()
            assert await _annotated(api, {pod.name: 0}) == {pod.name: 0}
            assert calls.summary()["cut"] == 0 and api.refused == 0
    finally:
        await api.close()
