"""Redis for one node: session registry and transcripts (``runtime/frontend/store/redis_store.py``).

``render_redis(profile)`` gives ``redis/redis.conf``: bound to the private side only, password required
(``requirepass`` comes from ``secrets/redis-auth.conf`` through ``include``, so the rendered file holds no
secret), persistence on (AOF every second plus RDB snapshots), memory bounded with TTL-first eviction (every
key the runtime writes has a TTL).

Binding: a ``processes`` node binds ``profile.private_address`` (loopback locally). In ``compose`` Redis
binds every interface of its container, whose only network is the node's private bridge network; its port
is never published on the host.
"""

from __future__ import annotations

from infra.node.profile import NodeProfile
from infra.node.services import SECRET_FILES

__all__ = ["REDIS_CONF", "render_redis"]

REDIS_CONF = "redis/redis.conf"
"""The bundle path of the rendered configuration."""


def render_redis(profile: NodeProfile) -> dict[str, bytes]:
    """``{"redis/redis.conf": ...}`` for ``profile``; the same profile always gives the same bytes.

    Paths: in ``processes`` mode the include and data directory are relative to the node directory (Redis
    runs with it as working directory); in ``compose`` they are the container's mounts.
    """
    local = profile.deployment == "processes"
    bind = profile.private_address if local else "0.0.0.0"
    auth_include = SECRET_FILES["redis_auth_conf"] if local else "/usr/local/etc/redis/redis-auth.conf"
    data_dir = "redis/data" if local else "/data"
    conf = f"""# Rendered by infra.node.redis_conf for node profile {profile.name!r}. Do not edit: re-render.
bind {bind}
port {profile.ports.redis}
protected-mode yes
# requirepass lives in the secrets directory, never in this file.
include {auth_include}

daemonize no
logfile ""
dir {data_dir}

# Persistence: append-only file fsynced every second, plus snapshots.
appendonly yes
appendfsync everysec
save 900 1 300 10 60 10000

# Bounded memory: every key the runtime writes carries a TTL; evict the nearest expiry first.
maxmemory {profile.retention.redis_max_memory_mb}mb
maxmemory-policy volatile-ttl

# Commands an attacker with the password could use to take the host.
rename-command DEBUG ""
rename-command MODULE ""
"""
    return {REDIS_CONF: conf.encode()}
