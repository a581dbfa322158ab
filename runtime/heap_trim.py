"""Give the C heap's free memory back to the operating system on a period: glibc's ``malloc_trim(0)``.

Why (issue 31, the worker memory soak): a front-end worker's resident memory grew about 25 MB an hour under
churning sessions and never came down, yet the Python objects allocated since warm-up and still alive
(``tracemalloc`` between two points of a soak) came to 0.4-0.5 MB. The growth was the main arena's
``[heap]`` (``/proc/<pid>/smaps``: 236 of 337 MB): memory freed by Python and the codecs, kept by glibc
because a live block sits above it (fragmentation), not a leak. ``malloc_trim(0)`` (glibc >= 2.8 also
``madvise``s free pages inside the heap, not only its top) called once in that worker by hand took it
from 337 MB to 178 MB. Measured with ``python -m runtime.tools.memory_soak --workers 2 --sessions 16
--session-s 5 10``, 2026-11-29: docs/benchmarks.md, "Worker memory".

:class:`HeapTrimmer` calls it every ``period_s`` (``DUPLEX_MALLOC_TRIM_S``, default 60 s; 0: never) in a
thread (``asyncio.to_thread``; ctypes releases the GIL), so the event loop keeps serving while glibc walks
its arenas, and counts what it gave back (``duplex_heap_trimmed_bytes_total``) and how long it took
(``duplex_heap_trim_seconds``). On a C library without ``malloc_trim`` (musl, macOS) it does nothing and
says so once.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["HeapTrimmer", "TrimResult", "glibc_malloc_trim", "resident_bytes"]

log = logging.getLogger(__name__)

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident memory in bytes (``/proc/self/statm``'s second field x the page size), or
    None where ``/proc`` is not there."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


def glibc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim(size_t pad) -> int`` (1: memory was released), or None when the C library has
    none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


@dataclass(frozen=True)
class TrimResult:
    """One trim: ``released_bytes`` (resident memory before minus after, never negative) and
    ``duration_s`` (wall-clock seconds of the call)."""

    released_bytes: int
    duration_s: float


class HeapTrimmer:
    """``malloc_trim(0)`` every ``period_s`` seconds (the module doc).

    Args:
        period_s: seconds between trims; 0 turns the trimmer off.
        on_trim: called with each :class:`TrimResult` (the metrics).
        malloc_trim: the trim function (default glibc's; tests inject one).
        rss: reads resident bytes (default :func:`resident_bytes`).
        clock: monotonic seconds.
    Raises:
        ValueError: ``period_s`` < 0.
    """

    def __init__(
        self,
        period_s: float,
        on_trim: Callable[[TrimResult], None] | None = None,
        *,
        malloc_trim: Callable[[int], int] | None = None,
        rss: Callable[[], int | None] = resident_bytes,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if period_s < 0:
            raise ValueError(f"the heap trim period must be >= 0 s (0: off), got {period_s}")
        self.period_s = period_s
        self.on_trim = on_trim
        self._trim = malloc_trim if malloc_trim is not None else glibc_malloc_trim()
        self._rss = rss
        self._clock = clock

    @property
    def available(self) -> bool:
        """The C library has ``malloc_trim`` and the period is not 0."""
        return self._trim is not None and self.period_s > 0

    def trim(self) -> TrimResult | None:
        """One trim now (blocking: call it from a thread); None when no trim function exists."""
        if self._trim is None:
            return None
        before = self._rss()
        started = self._clock()
        self._trim(0)
        duration = self._clock() - started
        after = self._rss()
        released = max(0, before - after) if before is not None and after is not None else 0
        result = TrimResult(released, duration)
        if self.on_trim is not None:
            self.on_trim(result)
        return result

    async def run(self) -> None:
        """Trim every ``period_s`` until cancelled; returns at once when not :attr:`available`."""
        if not self.available:
            if self.period_s > 0:
                log.info("heap trim: the C library has no malloc_trim; freed memory stays with the allocator")
            return
        while True:
            await asyncio.sleep(self.period_s)
            result = await asyncio.to_thread(self.trim)
            if result is not None and result.released_bytes:
                log.debug(
                    "heap trim: %.1f MB given back in %.1f ms",
                    result.released_bytes / 1e6,
                    result.duration_s * 1e3,
                )
