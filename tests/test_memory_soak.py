"""The memory soak's own arithmetic and /proc reading (``runtime.tools.memory_soak``); the soak itself is a
benchmark (docs/benchmarks.md), not a test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runtime.tools.memory_soak import SoakReport, group_rss_mb, slope_mb_per_hour, soak


def test_the_slope_is_megabytes_per_hour_of_a_least_squares_line() -> None:
    samples = [(float(m), 100.0 + 0.5 * m) for m in range(10)]  # 0.5 MB a minute
    assert slope_mb_per_hour(samples) == pytest.approx(30.0)
    assert slope_mb_per_hour([(0.0, 1.0), (1.0, 2.0)]) is None
    flat_with_noise = [(float(m), 150.0 + (0.2 if m % 2 else -0.2)) for m in range(60)]
    assert abs(slope_mb_per_hour(flat_with_noise) or 0.0) < 0.5


def test_a_process_group_is_read_from_proc_with_each_role() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; b = b'x' * 40_000_000; time.sleep(30)"],
        start_new_session=True,
    )
    try:
        for _ in range(100):
            found = group_rss_mb(child.pid)
            if found and found[child.pid][1] > 40:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        role, mb = found[child.pid]
        assert role == "supervisor" and mb > 40  # the group's leader; its 40 MB buffer is resident
        assert os.getpid() not in found
    finally:
        child.kill()
        child.wait()


def test_the_report_gives_the_second_half_slope_and_bad_ranges_are_refused() -> None:
    report = SoakReport(2, 16, 10.0, "default")
    warm_then_flat = [(float(m), 120.0 + min(m, 5)) for m in range(11)]
    report.rss[7] = ("worker", warm_then_flat)
    row = report.as_json()["processes"][0]  # type: ignore[index]
    assert row["role"] == "worker" and row["first_mb"] == 120.0 and row["last_mb"] == 125.0
    assert row["second_half_slope_mb_per_h"] == 0.0
    with pytest.raises(ValueError, match="0 < low <= high"):
        soak(workers=0, sessions=1, minutes=1, session_s=(30.0, 10.0))
    with pytest.raises(ValueError, match="must be > 0"):
        soak(workers=0, sessions=1, minutes=0)
