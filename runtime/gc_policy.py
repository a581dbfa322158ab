"""Python's cyclic garbage collector in a serving process (a front-end worker, or ``--workers 0``'s one
process): freeze what start-up made, and collect less often, so a collection's pause does not open a gap in
every live session's audio.

Why: a front end holds many sessions' objects (aiortc's peer connections, their transports and callbacks,
are full of reference cycles), so CPython's default thresholds (700, 10, 10) run a young collection every
700 net allocations and a full one every 100 young ones; a full collection walks every tracked object,
tens of ms with 24 WebRTC sessions on one core, and every session's outbound packets wait for it. Measured
(docs/benchmarks.md, "WebRTC sessions per front-end core"): 24 sessions on one core lost 6-7 frames a run
at the defaults (3 runs), 0 with ``20000,50,100`` (4 runs of that and the stricter ``20000,50,1000``).

What :func:`tune_gc` does: ``gc.collect()`` then ``gc.freeze()`` (start-up's objects, imports and
configuration, move to the permanent generation and are never walked again; the Python docs' ``gc.freeze``),
then ``gc.set_threshold(gen0, gen1, gen2)``. Garbage is still collected: a full collection now runs every
``gen0 x gen1 x gen2`` net allocations (1e8 at the default) instead of every 7e4, so its pauses are rarer.
Memory held by cyclic garbage grows between full collections accordingly; ``duplex_process_*`` memory
metrics show it (``process_resident_memory_bytes``).
"""

from __future__ import annotations

import gc
import logging

__all__ = ["DEFAULT_GC_THRESHOLDS", "parse_gc_thresholds", "tune_gc"]

log = logging.getLogger(__name__)

DEFAULT_GC_THRESHOLDS = "20000,50,100"
"""``DUPLEX_GC_THRESHOLDS``'s default: the young generation's allocation threshold, then how many young
collections make a middle one, and how many middle ones a full one (``gc.set_threshold``'s three)."""


def parse_gc_thresholds(text: str) -> tuple[int, int, int] | None:
    """``"gen0,gen1,gen2"`` as three integers, or None for ``"default"`` (Python's own, nothing frozen).

    Raises:
        ValueError: not three comma-separated integers, gen0 under 100, or gen1/gen2 under 1, naming what
            is allowed.
    """
    if text.strip().lower() == "default":
        return None
    parts = [p.strip() for p in text.split(",")]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or values[0] < 100 or values[1] < 1 or values[2] < 1:
        raise ValueError(
            f"gc_thresholds {text!r}: give three integers gen0,gen1,gen2 (gen0 >= 100, gen1 and gen2 >= 1; "
            f'e.g. "{DEFAULT_GC_THRESHOLDS}"), or "default" for Python\'s own (700,10,10, nothing frozen)'
        )
    return values[0], values[1], values[2]


def tune_gc(thresholds: tuple[int, int, int] | None) -> None:
    """Once the process has started (its imports and configuration made): collect, freeze, and set the
    thresholds; ``None`` leaves Python's collector as it is."""
    if thresholds is None:
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
    frozen = gc.get_freeze_count()
    log.info("garbage collector: %d start-up objects frozen, thresholds %s", frozen, thresholds)
