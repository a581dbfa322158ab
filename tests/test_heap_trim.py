"""The periodic heap trim (runtime/heap_trim.py): what it measures and counts, with an injected trim
function, resident-memory reader and clock; and glibc's own call on this machine."""

from __future__ import annotations

import asyncio

import pytest

from runtime.heap_trim import HeapTrimmer, TrimResult, glibc_malloc_trim, resident_bytes


def test_a_trim_counts_what_it_gave_back_and_how_long_it_took():
    readings = iter([300_000_000, 180_000_000])
    ticks = iter([10.0, 10.004])
    calls: list[int] = []
    seen: list[TrimResult] = []
    trimmer = HeapTrimmer(
        60,
        seen.append,
        malloc_trim=lambda pad: calls.append(pad) or 1,
        rss=lambda: next(readings),
        clock=lambda: next(ticks),
    )
    result = trimmer.trim()
    assert calls == [0]  # malloc_trim(0): no padding kept at the heap's top
    assert result == seen[0] and result.released_bytes == 120_000_000
    assert result.duration_s == pytest.approx(0.004)


def test_memory_that_grew_meanwhile_is_not_counted_as_released():
    readings = iter([100, 150])
    trimmer = HeapTrimmer(60, malloc_trim=lambda pad: 0, rss=lambda: next(readings))
    assert trimmer.trim().released_bytes == 0


async def test_it_runs_on_its_period_and_not_at_all_when_off_or_missing():
    calls: list[int] = []
    trimmer = HeapTrimmer(0.01, malloc_trim=lambda pad: calls.append(pad) or 1, rss=lambda: 0)
    task = asyncio.create_task(trimmer.run())
    async with asyncio.timeout(5):
        while len(calls) < 2:
            await asyncio.sleep(0.005)
    task.cancel()
    off = HeapTrimmer(0, malloc_trim=lambda pad: calls.append(pad) or 1)
    assert not off.available
    await asyncio.wait_for(off.run(), 1)  # returns at once
    missing = HeapTrimmer(60, malloc_trim=None)
    missing._trim = None  # a C library without malloc_trim (musl)
    assert not missing.available and missing.trim() is None
    await asyncio.wait_for(missing.run(), 1)
    with pytest.raises(ValueError, match="the heap trim period must be >= 0 s"):
        HeapTrimmer(-1)


def test_glibcs_trim_gives_back_freed_fragments_on_this_machine():
    """The real call (Debian's glibc): after many small blocks freed around a few that stay, the trim gives
    memory back (resident bytes go down) without touching what is alive."""
    trim = glibc_malloc_trim()
    assert trim is not None
    blocks = [bytearray(50_000) for _ in range(4000)]  # 200 MB in blocks under the mmap threshold
    keep = blocks[::400]  # a few stay alive, pinning the heap's top above the freed ones
    del blocks
    before = resident_bytes()
    result = HeapTrimmer(60, malloc_trim=trim).trim()
    assert before is not None and result is not None
    assert result.released_bytes > 50_000_000, result
    assert all(len(b) == 50_000 for b in keep)
