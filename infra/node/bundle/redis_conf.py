"""Redis for one node: session registry and transcripts (``runtime/frontend/store/redis_store.py``).

``render_redis(profile)`` gives ``redis/redis.conf``: bound to the private side only, one ACL user per
role and the default user off (the ``user`` lines, with their passwords, come from the secret
``secrets/redis-auth.conf`` through ``include``, so the rendered file holds no secret:
``infra.node.bundle.redis_acl`` lists the users and their rights), persistence by the append-only file alone
(fsynced every second; no RDB snapshots: a snapshot is a copy an erasure cannot reach, issue 34 item 6),
memory bounded with ``noeviction`` (issue 34 item 4: with
``volatile-ttl`` a full Redis evicted the minutes-long spent-token markers first, and a spent token opened a
second session; now writes fail when full: the replay check fails closed, the store's writer retries and
counts them, and the ``RedisMemoryNearFull`` alert pages before it comes to that).

Erasure and the files: an erased key leaves the AOF only when the AOF is rewritten. The runtime asks for a
rewrite (``BGREWRITEAOF``) after erasures and once a day (``DUPLEX_AOF_REWRITE_EVERY_S``), so keys expired by
retention leave it too on a quiet node; ``auto-aof-rewrite-percentage`` rewrites it as it grows. With
``aof-use-rdb-preamble`` the rewrite's base is a fresh snapshot of live keys only.

Binding: a ``processes`` node binds ``profile.private_address`` (loopback locally). In ``compose`` Redis
binds every interface of its container, whose only network is the node's private bridge network; its port
is never published on the host.
"""

from __future__ import annotations

from infra.node.bundle.services import SECRET_FILES
from infra.node.profile.profiles import NodeProfile

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
    conf = f"""# Rendered by infra.node.bundle.redis_conf for profile {profile.name!r}: re-render, not edit.
bind {bind}
port {profile.ports.redis}
protected-mode yes
# The ACL users (default off; runtime, events, exporter, admin) and their passwords live in the secrets
# directory, never in this file (infra.node.bundle.redis_acl).
include {auth_include}

daemonize no
logfile ""
dir {data_dir}

# Persistence: the append-only file alone, fsynced every second, rewritten as it doubles. No RDB snapshots:
# a snapshot keeps erased transcripts until the next one (issue 34: erase must reach Redis's files).
appendonly yes
appendfsync everysec
aof-use-rdb-preamble yes
auto-aof-rewrite-percentage 100
auto-aof-rewrite-min-size 16mb
save ""

# Bounded memory, never evicting: every key carries a TTL, and the spent-token markers must outlive a full
# Redis (volatile-ttl evicted them first). Writes fail when full; RedisMemoryNearFull pages before.
maxmemory {profile.retention.redis_max_memory_mb}mb
maxmemory-policy noeviction

# Commands an attacker with the admin password could use to take the host.
rename-command DEBUG ""
rename-command MODULE ""
"""
    return {REDIS_CONF: conf.encode()}
