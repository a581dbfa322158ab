"""The node's slot load as the edge sees it (issue 33, "slot-aware admission at the edge"): ``/slotz`` (has
the node a free slot?), the ORCA load report on every response (what the global load balancer balances on),
and the check that answers a ``/api/chat`` upgrade 503 before the upgrade when no slot and no waiting-room
place is left (so the URL map's retry policy sends the caller to another pod).

Two readinesses, two paths: ``/readyz`` means "serving" (the model loaded, the tick alive, not draining): a
full node stays ready, so a pod at capacity does not leave the Service's endpoints and the NEG, does not flap
back a health check later when a slot frees, and is not counted unavailable by the PodDisruptionBudget.
``/slotz`` means "has a free slot": 200 with one, 503 without, JSON either way. Neither is public (the node's
nginx and the global entry's URL map keep both off the internet).

The utilisation counts every slot not free (a WebSocket's and a WebRTC call's alike: a WebRTC ``POST`` returns
while its call holds the slot; a slot held for a resume is not free either) plus the ``/api/chat`` upgrades
admitted at the edge but not yet holding a slot (:class:`UpgradeReservations`): two upgrades racing for the
last slot do not both pass. Format: the ``endpoint-load-metrics`` response header, ``TEXT`` form, with one
named metric (the header and its ``named_metrics.<name>=<value>`` form: xDS ORCA, cncf/xds
``xds/data/orca/v3/orca_load_report.proto`` ``named_metrics``; Google Cloud, "Custom metrics for Application
Load Balancers"; the metric name's rule, ``[a-z]([-_.a-z0-9]*[a-z0-9])?`` of 1-64 characters, and the value's
range ``[0.0, 1.0]``: the Compute API's ``backends[].customMetrics[]``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from runtime.config import RuntimeConfig
from runtime.engine.api import BackendStatus

__all__ = [
    "LOAD_REPORT_HEADER",
    "SLOTZ_PATH",
    "SLOT_UTILIZATION",
    "Reservation",
    "SlotLoad",
    "UpgradeReservations",
    "load_report",
]

SLOTZ_PATH = "/slotz"
LOAD_REPORT_HEADER = "endpoint-load-metrics"
"""The ORCA per-response load report header (Google Cloud's Application Load Balancers read it)."""
SLOT_UTILIZATION = "slot_utilization"
"""The named metric: slots not free (and upgrades reserving one) over the node's slots, in ``[0.0, 1.0]``.
The global entry's backend service balances on it (``infra.components.global_entry``)."""
_METRIC_NAME = re.compile(r"[a-z]([-_.a-z0-9]{0,62}[a-z0-9])?")
assert _METRIC_NAME.fullmatch(SLOT_UTILIZATION)


class Reservation:
    """One ``/api/chat`` upgrade admitted at the edge, counted until its session holds a slot, is refused or
    ends (:meth:`release`: idempotent). ``owner`` None: counted nowhere (a resume's)."""

    def __init__(self, owner: UpgradeReservations | None) -> None:
        self._owner: UpgradeReservations | None = owner

    def release(self) -> None:
        """Stop counting this upgrade (the session holds a slot now, or never will). Idempotent."""
        if self._owner is not None:
            self._owner.count -= 1
            self._owner = None


class UpgradeReservations:
    """The upgrades admitted at the edge whose sessions do not hold a slot yet (the event loop's count, one
    per front-end process: with ``--workers N`` another worker's are not seen, and the engine's admission
    stays the exact one)."""

    def __init__(self) -> None:
        self.count = 0

    def reserve(self) -> Reservation:
        """Count one more upgrade until the returned reservation is released."""
        self.count += 1
        return Reservation(self)


@dataclass(frozen=True)
class SlotLoad:
    """The slots' load at one instant.

    Attributes:
        slots: the node's slots (B).
        in_use: slots not free (live sessions of every transport, slots held for a resume).
        waiting: callers in the waiting room.
        upgrading: upgrades admitted at the edge not yet holding a slot (:class:`UpgradeReservations`).
    """

    slots: int
    in_use: int
    waiting: int
    upgrading: int = 0

    @classmethod
    def of(cls, status: BackendStatus, upgrading: int = 0) -> SlotLoad:
        """The load of ``status`` (a backend not loaded or lost has no free slot) with ``upgrading``
        reservations."""
        free = status.free_slots if status.loaded and not status.lost else 0
        return cls(status.slots, max(0, status.slots - free), status.waiting, upgrading)

    @property
    def free(self) -> int:
        """Slots a new caller could take: free ones less the reserved."""
        return max(0, self.slots - self.in_use - self.upgrading)

    @property
    def utilization(self) -> float:
        """``(in_use + upgrading) / slots`` capped at 1.0 (1.0 with no slots): the ORCA metric's value."""
        if self.slots <= 0:
            return 1.0
        return min(1.0, (self.in_use + self.upgrading) / self.slots)

    def takes_upgrade(self, config: RuntimeConfig) -> bool:
        """Whether one more ``/api/chat`` upgrade has somewhere to go: a free slot, or a place in the waiting
        room (``waiting_room_s`` and ``waiting_room_size`` both set). A reserved upgrade that waits is in
        ``waiting`` too, so the reserved ones not yet placed are ``upgrading - waiting`` (with ``--workers
        N``, ``waiting`` is the whole node's and ``upgrading`` this worker's: the engine's admission stays
        exact, and an upgrade that finds the room full after all is refused after the upgrade)."""
        room = 0
        if config.waiting_room_s > 0 and config.waiting_room_size > 0:
            room = max(0, config.waiting_room_size - self.waiting)
        unplaced = max(0, self.upgrading - self.waiting)
        return unplaced < max(0, self.slots - self.in_use) + room

    def header(self) -> str:
        """The ``endpoint-load-metrics`` value: ``TEXT named_metrics.slot_utilization=<0..1>``."""
        return f"TEXT named_metrics.{SLOT_UTILIZATION}={self.utilization:.4g}"

    def as_json(self) -> dict[str, object]:
        """``/slotz``'s body: slots, in_use, free_slots (less the reserved), waiting, upgrading,
        slot_utilization."""
        return {
            "slots": self.slots,
            "in_use": self.in_use,
            "free_slots": self.free,
            "waiting": self.waiting,
            "upgrading": self.upgrading,
            SLOT_UTILIZATION: round(self.utilization, 4),
        }


def load_report(value: str) -> dict[str, float]:
    """Parse an ``endpoint-load-metrics`` ``TEXT`` value into ``{"named_metrics.<name>": value}`` (what a load
    balancer reads; the tests' model of one uses it).

    Raises:
        ValueError: not ``TEXT <key>=<float>[, <key>=<float>...]``, naming the part that was wrong.
    """
    form, _, body = value.strip().partition(" ")
    if form != "TEXT":
        raise ValueError(f"endpoint-load-metrics: the form must be TEXT, got {form!r}")
    report: dict[str, float] = {}
    for part in body.split(","):
        key, sep, number = part.strip().partition("=")
        if not sep or not key:
            raise ValueError(f"endpoint-load-metrics: {part.strip()!r} is not <key>=<value>")
        try:
            report[key] = float(number)
        except ValueError:
            raise ValueError(f"endpoint-load-metrics: {key}'s value {number!r} is not a number") from None
    return report
