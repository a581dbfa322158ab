"""Redis ACL users of one node, one per role (issue 34, item 8: one password did everything).

The default user is ``off``: a client that does not name a user cannot log in at all. Four users remain,
each with its own password (:func:`role_password`) and the least it needs (Redis 7 ACL rules,
https://redis.io/docs/latest/operate/oss_and_stack/management/security/acl/):

``runtime``
    the runtime's session store, replay guard and sessions API: read and write commands, ``MULTI``/``EXEC``,
    ``EVAL``/``EVALSHA`` (``runtime.frontend.store.events.XADD_INDEXED_LUA``), on keys ``duplex:*`` only;
    no ``FUNCTION`` (``@write`` holds ``FUNCTION LOAD``/``FLUSH``; the runtime has no functions), nothing
    ``@dangerous`` (``CONFIG``, ``ACL``, ``FLUSHALL``, ``KEYS``, ``DEBUG``, ``CLIENT KILL``...) but
    ``BGREWRITEAOF`` (the AOF rewrite after an erase and the daily one, ``runtime.frontend.store``) and
    ``INFO``; no pub/sub channels.
``events``
    a consumer of the events stream ``duplex:events`` (docs/sessions-api.md, "Events"): ``XREAD``,
    ``XREADGROUP``, ``XACK``, ``XGROUP CREATE``, ``XINFO``, ``XPENDING``, ``XCLAIM``/``XAUTOCLAIM`` (taking
    over a crashed consumer's entries), ``XRANGE``/``XREVRANGE``, ``XLEN``, ``PING``, on that one key. The
    consumer-group commands write the group's state, as a consumer must; no ``XADD``, ``XDEL``, ``XTRIM``,
    nor any other key (a session's record, a spent-token marker).
``exporter``
    redis_exporter's scrape: ``INFO``, ``CONFIG GET``, ``CLIENT LIST``/``SETNAME``, ``SLOWLOG``,
    ``LATENCY``, ``PING``, ``SELECT``; no key at all (the node runs it without ``--check-keys``). The
    commands are those oliver006/redis_exporter's README lists for a dedicated user, less those that read
    keys (``GET``, ``SCAN``, ``EVAL``, ...) and ``CLIENT KILL``/``PAUSE`` (``+client`` there).
``admin``
    everything, for the operator (``redis-cli --user admin``) and the Redis container's health check.

The ``admin`` password is the node's ``redis_password`` (``NodeSecrets``, ``secrets/redis_password``);
the others are derived from it (HMAC-SHA256, :func:`role_password`), so a stack keeps one Redis secret
and each role still holds a password that tells nothing of another's or of the admin's. Rotating
``redis_password`` rotates all four. The ``user`` lines hold the passwords in clear, so they live in the
secret ``secrets/redis-auth.conf`` that ``redis/redis.conf`` includes (:func:`render_acl_users`).

Not on GKE: Memorystore for Redis has one AUTH string and no ACL users (docs/deploying.md, multi-region).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Literal, get_args

__all__ = [
    "ACL_RULES",
    "EVENTS_STREAM_KEY",
    "RUNTIME_KEY_PATTERN",
    "RedisUser",
    "REDIS_USERS",
    "redis_url",
    "render_acl_users",
    "role_password",
]

RedisUser = Literal["admin", "runtime", "events", "exporter"]
REDIS_USERS: tuple[RedisUser, ...] = get_args(RedisUser)
"""The node's Redis users, one per role (the default user is ``off``)."""

RUNTIME_KEY_PATTERN = "duplex:*"
"""The runtime's keys: every key the store writes starts with the prefix ``duplex``
(``runtime.frontend.store.keys``; the replay guard's spent-token markers ``duplex:token:<jti>`` too)."""

EVENTS_STREAM_KEY = "duplex:events"
"""The events stream (``runtime.frontend.store.keys.events_key("duplex")``), the ``events`` user's one key."""

_CONNECTION = "+@connection -@dangerous"
"""AUTH, HELLO, PING, SELECT, CLIENT SETNAME/SETINFO/ID (redis-py sends CLIENT SETINFO on connect), but not
CLIENT KILL/LIST/PAUSE (``@dangerous``)."""

ACL_RULES: dict[RedisUser, str] = {
    "admin": "~* &* +@all",
    "runtime": (
        f"resetchannels ~{RUNTIME_KEY_PATTERN} -@all {_CONNECTION} +@read +@write +@transaction "
        "+eval +evalsha +script|load +script|exists -@dangerous -function +bgrewriteaof +info"
    ),
    "events": (
        f"resetchannels ~{EVENTS_STREAM_KEY} -@all {_CONNECTION} +xread +xreadgroup +xack +xgroup|create "
        "+xinfo +xpending +xclaim +xautoclaim +xrange +xrevrange +xlen +ping"
    ),
    "exporter": (
        f"resetchannels resetkeys -@all {_CONNECTION} +info +config|get +client|list +client|setname "
        "+slowlog|get +slowlog|len +latency|latest +latency|histogram +memory|stats +ping"
    ),
}
"""Each user's ACL rules after ``on >password`` (Redis 7 syntax; order matters: later rules win)."""

_DERIVATION_LABEL = b"duplex redis acl user "


def role_password(admin_password: str, role: RedisUser) -> str:
    """The password of ``role``: ``admin_password`` itself for ``admin``; for the others
    base64url(HMAC-SHA256(key=admin_password, "duplex redis acl user <role>")) without padding, 43 characters
    (256 bits), safe in a URL and a config line.

    Raises:
        ValueError: ``role`` is not one of :data:`REDIS_USERS` (the message lists them).
    """
    if role not in REDIS_USERS:
        raise ValueError(f"unknown Redis user {role!r}; allowed: {', '.join(REDIS_USERS)}")
    if role == "admin":
        return admin_password
    digest = hmac.new(admin_password.encode(), _DERIVATION_LABEL + role.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def render_acl_users(admin_password: str) -> str:
    """The ``user`` lines of ``secrets/redis-auth.conf`` (secret: they hold the passwords): the default
    user off, with no password, no keys and no commands; then one line per :data:`REDIS_USERS`."""
    lines = [
        "# Rendered by infra.node.bundle.redis_acl: the node's Redis users "
        "(docs/operations.md, 'Redis users').",
        "user default off resetpass resetkeys resetchannels -@all",
    ]
    for role in REDIS_USERS:
        lines.append(f"user {role} on >{role_password(admin_password, role)} {ACL_RULES[role]}")
    return "\n".join(lines) + "\n"


def redis_url(admin_password: str, role: RedisUser, host: str, port: int | str, db: int = 0) -> str:
    """``redis://<role>:<password>@<host>:<port>/<db>`` for ``role`` (the runtime's ``DUPLEX_REDIS_URL``,
    the events consumer's URL).

    Raises:
        ValueError: ``role`` is not one of :data:`REDIS_USERS`.
    """
    return f"redis://{role}:{role_password(admin_password, role)}@{host}:{port}/{db}"
