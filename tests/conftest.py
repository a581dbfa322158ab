"""Shared pytest fixtures.

Real Redis servers
------------------
:class:`RedisServer` runs a throwaway ``redis-server`` (found on PATH) on a free loopback port, without
persistence, with its working dir under the test's ``tmp_path``. It can be stopped and started again on
the SAME port, so clients see an outage and a restart. The function-scoped :func:`redis_server` fixture
yields a started one and stops it at teardown. A missing ``redis-server`` is a test failure, not a skip:
CI installs it (``apt-get install redis-server``).

A region's Kubernetes objects
-----------------------------
The module-scoped :func:`workload` fixture is ``k8s_fixtures.make_workload()`` (a ``RegionWorkload`` with
plain values) and :func:`objects` its ``infra.k8s.region.region_objects``, built once per test module
(``tests/test_k8s_*.py``); imported when first used.
"""

from __future__ import annotations

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
