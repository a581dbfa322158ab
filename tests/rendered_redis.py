"""A redis-server started from a node's rendered ``redis/redis.conf`` and secrets (``infra.node``), as a
``processes`` node runs it: its ACL users (``infra.node.bundle.redis_acl``), AOF persistence, bounded
memory."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from infra.node.bundle.redis_conf import REDIS_CONF, render_redis
from infra.node.bundle.render import write_bundle, write_secrets
from infra.node.bundle.services import NodeSecrets
from infra.node.local.node import free_port_profile


@dataclass
class RenderedRedis:
    """The running server: its process, port, the node's secrets and the node directory."""

    process: subprocess.Popen[bytes]
    port: int
    secrets: NodeSecrets
    directory: Path

    def admin(self, socket_timeout: float = 5.0) -> redis.Redis:
        """A client as the ``admin`` user (its password: ``NodeSecrets.redis_password``)."""
        password = self.secrets.redis_password
        return redis.Redis(port=self.port, username="admin", password=password, socket_timeout=socket_timeout)

    def env_value(self, secret_file: str, name: str) -> str:
        """``name``'s value in the node's env file ``secret_file`` (``secrets/runtime.env``...)."""
        for line in (self.directory / secret_file).read_text().splitlines():
            key, _, value = line.partition("=")
            if key == name:
                return value
        raise KeyError(f"{name} not in {secret_file}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


def start_rendered_redis(directory: Path) -> RenderedRedis:
    """Render a free-port ``processes`` node's Redis config and secrets into ``directory`` and start
    redis-server from them; waits until ``admin`` gets PONG (10 s at most).

    Raises:
        AssertionError: redis-server did not answer within 10 s.
    """
    profile = free_port_profile()
    node_secrets = NodeSecrets.generate()
    write_bundle(render_redis(profile), directory)
    write_secrets(profile, node_secrets, directory)
    (directory / "redis" / "data").mkdir(parents=True)
    process = subprocess.Popen(
        ["redis-server", REDIS_CONF], cwd=directory, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    server = RenderedRedis(process, profile.ports.redis, node_secrets, directory)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            server.admin(socket_timeout=0.5).ping()
            return server
        except redis.ConnectionError:
            time.sleep(0.1)
    process.kill()
    raise AssertionError("redis-server did not start from the rendered config")
