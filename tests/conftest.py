"""Shared pytest fixtures.

Real Redis servers
------------------
:class:`RedisServer` runs a throwaway ``redis-server`` (found on PATH) on a free loopback port, without
persistence, with its working dir under the test's ``tmp_path``. It can be stopped and started again on
the SAME port, so clients see an outage and a restart. The function-scoped :func:`redis_server` fixture
yields a started one and stops it at teardown. A missing ``redis-server`` is a test failure, not a skip:
CI installs it (``apt-get install redis-server``).

No silent skips
---------------
A run that skipped a test fails (exit 1, the skipped tests and their reasons listed), unless the reason
matches ``ALLOWED_SKIP_REASONS`` (empty today: a GPU-only test would be listed there, with why). A missing
system program is a failure, not a skip: ``make setup`` installs every one the tests run. For a partial
local environment, ``DUPLEX_ALLOW_SKIPS=1`` turns the check off (CI never sets it).

A region's Kubernetes objects
-----------------------------
The module-scoped :func:`workload` fixture is ``k8s_fixtures.make_workload()`` (a ``RegionWorkload`` with
plain values) and :func:`objects` its ``infra.k8s.region.region_objects``, built once per test module
(``tests/test_k8s_*.py``); imported when first used.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from runtime.tools.local_redis import LocalRedisError, RedisServer

if TYPE_CHECKING:
    from infra.k8s.base import RegionWorkload

__all__ = ["RedisServer", "objects", "promtool", "redis_server", "started", "workload"]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A started :class:`RedisServer` for one test, stopped at teardown."""
    server = RedisServer(tmp_path / "redis")
    try:
        server.start()
    except LocalRedisError as exc:
        pytest.fail(str(exc))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def workload() -> RegionWorkload:
    """``k8s_fixtures.make_workload()``: a region with plain values, one per test module."""
    from k8s_fixtures import make_workload

    return make_workload()


@pytest.fixture(scope="module")
def objects(workload: RegionWorkload) -> list[dict[str, Any]]:
    """Every Kubernetes object of ``workload`` in apply order (``infra.k8s.region.region_objects``)."""
    from infra.k8s.region import region_objects

    return region_objects(workload)


@pytest.fixture
def promtool() -> str:
    """The ``promtool`` binary (Debian's ``prometheus`` package); skipped where it is missing (CI has it)."""
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not on PATH (apt-get install prometheus); CI installs it")
    return path


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A list the test appends the server processes it starts to (Pebble, nginx, Prometheus, Alertmanager
    ...); at teardown each still running is terminated, last started first (killed after 10 s)."""
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for proc in reversed(processes):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


ALLOWED_SKIP_REASONS: tuple[re.Pattern[str], ...] = ()
"""Skip reasons that do not fail the run (regular expressions searched in the reason). Empty: every test
runs on CI's machine (no GPU test exists yet; one would be allowed here by its reason, e.g. "needs CUDA")."""


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def unexpected_skips(reports: list[pytest.TestReport]) -> list[str]:
    """``"<test id>: <reason>"`` for each skipped report whose reason no ``ALLOWED_SKIP_REASONS`` allows."""
    return [
        f"{report.nodeid}: {_skip_reason(report)}"
        for report in reports
        if not any(pattern.search(_skip_reason(report)) for pattern in ALLOWED_SKIP_REASONS)
    ]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail an otherwise green run that skipped a test (see "No silent skips" above)."""
    if os.environ.get("DUPLEX_ALLOW_SKIPS") == "1" or exitstatus != pytest.ExitCode.OK:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    unexpected = unexpected_skips(reporter.stats.get("skipped", []) if reporter is not None else [])
    if unexpected:
        reporter.write_line(
            f"{len(unexpected)} test(s) skipped; the suite allows none (tests/conftest.py):", red=True
        )
        for line in unexpected:
            reporter.write_line(f"  {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
