"""A monotonic clock for tests that moves only when a test says so: inject it where the code under test
takes a ``clock`` (``time.monotonic``'s signature) or a ``sleep``."""

from __future__ import annotations


class FakeClock:
    """Monotonic seconds that move only when told: ``clock()`` is ``now`` (starts at 1000.0 s, so that
    "time 0" bugs show); ``advance(seconds)`` (also usable as a sim engine's ``sleep``) or setting ``now``
    moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
