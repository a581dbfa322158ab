"""Shared pytest fixtures.

Real Redis servers
------------------
:class:`RedisServer` runs a throwaway ``redis-server`` (found on PATH) on a free loopback port, without
persistence, with its working dir under the test's ``tmp_path``. It can be stopped and started again on
the SAME port, so clients see an outage and a restart. The function-scoped :func:`redis_server` fixture
yields a started one and stops it at teardown. A missing ``redis-server`` is a test failure, not a skip:
CI installs it (``apt-get install redis-server``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.local_redis import LocalRedisError, RedisServer

__all__ = ["RedisServer", "redis_server"]


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
