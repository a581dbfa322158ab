"""The ``sim`` model's step time (runtime/engine/sim.py), parsed without torch so that the configuration can
check ``DUPLEX_SIM_STEP_MS`` when the process starts.

A fixed figure (``"30"`` ms) or a table by batch size (``"1:28,8:32.6,16:45,32:70.2"``: the batched
PersonaPlex ticks on an H100 published in vLLM-Omni issue 7389), linearly interpolated on the number of
slots stepping, flat past its ends. ``infra.capacity.timing.sim_step_table`` writes such a table from the
capacity planner's estimate for a GPU; the runtime never imports the planner.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = ["StepTime", "parse_step_time"]


@dataclass(frozen=True)
class StepTime:
    """Model step time (ms) as a function of the slots stepping together.

    Attributes:
        points: ``((batch, ms), ...)`` sorted by batch; one point means a fixed time.
    """

    points: tuple[tuple[int, float], ...]

    def ms(self, batch: int) -> float:
        """The step time at ``batch`` slots: interpolated between the two nearest points, flat outside."""
        batches = [b for b, _ in self.points]
        if len(self.points) == 1 or batch <= batches[0]:
            return self.points[0][1]
        if batch >= batches[-1]:
            return self.points[-1][1]
        i = bisect.bisect_left(batches, batch)
        (b0, t0), (b1, t1) = self.points[i - 1], self.points[i]
        return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)

    def __str__(self) -> str:
        if len(self.points) == 1:
            return f"{self.points[0][1]:g}"
        return ",".join(f"{b}:{t:g}" for b, t in self.points)


def parse_step_time(text: str) -> StepTime:
    """``"30"`` (fixed ms) or ``"1:28,8:32.6"`` (batch:ms pairs) -> :class:`StepTime`.

    Raises:
        ValueError: not a number, a bad pair, a batch < 1, a time < 0 or > 10000 ms, or a batch twice.
    """
    text = text.strip()
    allowed = 'a time in ms ("30") or batch:ms pairs ("1:28,8:32.6,16:45")'
    try:
        if ":" not in text:
            points = [(1, float(text))]
        else:
            points = []
            for part in text.split(","):
                batch, _, ms = part.strip().partition(":")
                points.append((int(batch), float(ms)))
    except ValueError:
        raise ValueError(f"sim step time {text!r} is not {allowed}") from None
    points.sort()
    batches = [b for b, _ in points]
    if not points or len(set(batches)) != len(batches) or batches[0] < 1:
        raise ValueError(f"sim step time {text!r}: batches must be distinct and >= 1 ({allowed})")
    if any(not 0 <= ms <= 10_000 for _, ms in points):
        raise ValueError(f"sim step time {text!r}: each time must be within [0, 10000] ms")
    return StepTime(tuple(points))
