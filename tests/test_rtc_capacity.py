"""``python -m runtime.tools.rtc_bench capacity`` (``runtime.tools.rtc_capacity``): the core split, the
pinning of every thread, the verdict's rules (invalid when the generator fell behind or another process held
the worker's core; a loss or a busy worker fails; late input up to one per session passes), and one real
run of 2 sessions on the sim model: the worker alone on its core, the generator off it, both sides counted.
No figure is asserted: the machine's load decides them."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from runtime.tools import rtc_capacity
from runtime.tools.loadgen_rtc import RtcLoadReport
from runtime.tools.rtc_capacity import CountResult, GeneratorShare, WorkerFigures, pin, split_cores


def test_split_cores_gives_the_worker_one_core_and_refuses_a_single_core() -> None:
    assert split_cores({0, 1, 2, 3}) == (3, [0, 1, 2])
    assert split_cores({0, 1}, worker_core=0) == (0, [1])
    with pytest.raises(ValueError, match="at least 2 cores"):
        split_cores({5})
    with pytest.raises(ValueError, match="--worker-core 7 is not among"):
        split_cores({0, 1}, worker_core=7)


def test_pin_moves_every_thread_not_only_the_main_one() -> None:
    own = os.sched_getaffinity(0)
    if len(own) < 2:
        pytest.fail(f"this test needs 2 cores in the affinity, has {sorted(own)}")
    target = {min(own)}
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert pin(os.getpid(), target) >= 2
        tasks = os.listdir(f"/proc/{os.getpid()}/task")
        assert all(os.sched_getaffinity(int(t)) == target for t in tasks)
    finally:
        stop.set()
        thread.join()
        pin(os.getpid(), own)


@dataclass
class _Report:
    """A load report's summary without sessions (the verdict reads only the summary)."""

    served: int
    frames_lost: int
    sessions: tuple[Any, ...] = ()

    def summary(self) -> dict[str, Any]:
        return {"served": self.served, "frames_lost": self.frames_lost}


def _result(
    *,
    served: int = 10,
    client_lost: int = 0,
    late_sends: int = 0,
    loop_lag_ms: float = 5.0,
    wait_pct: float = 0.0,
    steady_pct: float = 50.0,
    dropped: dict[str, float] | None = None,
    rtp_lost: float = 0.0,
) -> CountResult:
    reasons = {
        "late_input": 0.0,
        "input_overflow": 0.0,
        "slow_client": 0.0,
        "slow_worker": 0.0,
        **(dropped or {}),
    }
    server = {f"dropped_{k}": v for k, v in reasons.items()}
    server.update(frames_dropped=sum(reasons.values()), rtp_lost=rtp_lost)
    return CountResult(
        sessions=10,
        report=_Report(served, client_lost),  # type: ignore[arg-type]
        generators=[GeneratorShare(sends=1000, late_sends=late_sends, loop_lag_max_ms=loop_lag_ms)],
        worker=WorkerFigures(steady_pct, steady_pct, steady_pct, wait_pct),
        engine_pct=3.0,
        server=server,
        wall_s=20.0,
    )


def test_the_verdict_blames_the_generator_or_the_machine_before_the_node() -> None:
    assert _result().verdict() == "pass"
    assert _result(late_sends=1, client_lost=50).verdict().startswith("invalid: the generator fell behind")
    assert _result(loop_lag_ms=rtc_capacity.LATE_LIMIT_MS + 1).verdict().startswith("invalid: the generator")
    assert _result(wait_pct=20, client_lost=50).verdict().startswith("invalid: other processes held")
    assert _result(wait_pct=rtc_capacity.MAX_WORKER_WAIT_PCT).verdict() == "pass"


def test_the_verdict_fails_on_any_loss_a_busy_worker_or_repeated_late_input() -> None:
    assert _result(client_lost=1).verdict() == "fail: frames lost: client 1, server 0"
    assert _result(dropped={"slow_client": 2}).verdict() == "fail: frames lost: client 0, server 2"
    assert (
        _result(rtp_lost=5).verdict() == "fail: frames lost: client 0, server 2"
    )  # 20 ms packets, rounded up
    assert _result(served=9).verdict() == "fail: 9/10 served"
    assert _result(steady_pct=rtc_capacity.MAX_WORKER_PCT).verdict() == "fail: worker at 90 % of its core"
    assert _result(dropped={"late_input": 10}).verdict() == "pass"  # one per session: the phase settling
    assert _result(dropped={"late_input": 11}).verdict() == "fail: 1.1 late input frames per session"


@pytest.mark.slow
def test_a_real_run_keeps_the_worker_alone_on_its_core() -> None:
    """2 sessions, 10 s: both served, the worker's threads only ever on the worker core, the generator
    only on the others, the worker's CPU measured, the server's counters read; the row and the table say
    so."""
    clip = (0.1 * np.sin(np.arange(240_000) * 2 * np.pi * 220 / 24_000)).astype(np.float32)
    worker_core, others = split_cores(os.sched_getaffinity(0))
    [result] = rtc_capacity.bench_capacity([2], clip=clip, seconds=10)
    assert os.sched_getaffinity(0) == {worker_core, *others}  # the bench gave its own affinity back
    assert result.report.summary()["served"] == 2
    assert result.worker.cores == (worker_core,)
    assert all(worker_core not in g.cores and g.sends > 0 for g in result.generators)
    assert result.worker.run_pct > 0 and result.server["webrtc_sessions_started"] == 2
    assert result.server["rtp_received"] > 0
    row = result.row()
    assert row["verdict"] == result.verdict() and row["generator"]["processes"] == 1  # type: ignore[index]
    assert "| 2 | 2 |" in rtc_capacity.markdown([result])
    assert isinstance(result.report, RtcLoadReport)
