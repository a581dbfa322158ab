"""TURN relay credentials minted per token: the TURN REST scheme coturn checks with ``use-auth-secret``.

A WebRTC caller reaches the node's media through its TURN relay (coturn): the worker's ICE agent binds
random ephemeral UDP ports, so the node exposes only the relay's ports (3478/udp, 5349/tcp and a fixed relay
range). The caller needs credentials before it makes its offer; they are minted here, per token (its
``jti``: one coturn user, so ``user-quota`` binds per token; a resume's per session id), from a secret the
node shares with coturn, and expire on their own. No state: coturn recomputes the password from
the username.

The scheme (draft-uberti-behave-turn-rest-00, section 2.2; coturn's ``turnserver.conf``, ``use-auth-secret``
and ``static-auth-secret``)::

    username = "<expiry, unix seconds>:<token id or session id>"
    password = base64(HMAC-SHA1(secret, username))

Pure: no sockets. The URL forms are RFC 7065's ``turn:``/``turns:`` URIs.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from dataclasses import dataclass

from runtime.turn_urls import MIN_SECRET_BYTES, check_turn_url

__all__ = [
    "MIN_SECRET_BYTES",
    "IceServer",
    "TurnCredentials",
    "check_turn_url",
    "ice_servers",
    "mint_turn_credentials",
    "turn_username_basis",
]

_SESSION_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")


@dataclass(frozen=True)
class TurnCredentials:
    """One session's relay credentials.

    Attributes:
        username: ``"<expiry>:<session id>"``.
        password: base64 of HMAC-SHA1(secret, username): 28 ASCII characters.
        expires_at: unix seconds after which coturn refuses them (an allocation made before lives on).
    """

    username: str
    password: str
    expires_at: int


@dataclass(frozen=True)
class IceServer:
    """One entry of ``RTCConfiguration.iceServers`` (W3C WebRTC 1.0, ``RTCIceServer``).

    Attributes:
        urls: ``turn:``/``turns:``/``stun:`` URIs (RFC 7064, RFC 7065).
        username, credential: the TURN credentials; empty for STUN.
    """

    urls: tuple[str, ...]
    username: str = ""
    credential: str = ""

    def as_json(self) -> dict[str, object]:
        """The browser's shape: ``{"urls": [...], "username": ..., "credential": ...}`` (no empty keys)."""
        entry: dict[str, object] = {"urls": list(self.urls)}
        if self.username:
            entry["username"] = self.username
            entry["credential"] = self.credential
        return entry


def mint_turn_credentials(secret: bytes, session_id: str, ttl_s: int, now: float) -> TurnCredentials:
    """Credentials for ``session_id`` valid ``ttl_s`` seconds from ``now`` (unix seconds).

    Raises:
        ValueError: a secret under ``MIN_SECRET_BYTES`` bytes, a session id that is not 1-128 characters of
            ``[A-Za-z0-9_-]`` (a ``:`` would break the username's form), or ``ttl_s`` < 1.
    """
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the TURN secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    if not _SESSION_ID_RE.fullmatch(session_id):
        raise ValueError(f"session id {session_id!r}: 1-128 characters of letters, digits, '_' and '-'")
    if ttl_s < 1:
        raise ValueError(f"ttl_s must be >= 1 s, got {ttl_s}")
    expires_at = int(now) + ttl_s
    username = f"{expires_at}:{session_id}"
    digest = hmac.new(secret, username.encode("ascii"), hashlib.sha1).digest()
    return TurnCredentials(username, base64.b64encode(digest).decode("ascii"), expires_at)


MIN_TURN_VALIDITY_S = 60
"""Shortest validity left on credentials minted from a token's ``iat`` (s): an older basis is replaced by
now (config's ``turn_ttl_s`` floor)."""


def turn_username_basis(issued_at: float, ttl_s: int, now: float) -> float:
    """The mint time of a token's TURN credentials (unix s): its ``issued_at``, so that every mint for one
    token gives one username ``"<issued_at + ttl_s>:<token id>"`` and coturn's ``user-quota`` (counted per
    username) caps that token's allocations however many offers it makes (issue 34, item 2); ``now`` when
    that would leave under :data:`MIN_TURN_VALIDITY_S` (a token older than ``ttl_s``) or lies ahead of
    ``now`` (a clock ahead of this node's)."""
    if issued_at > now or issued_at + ttl_s < now + MIN_TURN_VALIDITY_S:
        return now
    return issued_at


def ice_servers(urls: list[str], credentials: TurnCredentials | None) -> list[IceServer]:
    """The ICE servers a caller is given: the ``turn:``/``turns:`` URLs with ``credentials``, the ``stun:``
    URLs without. No credentials (no secret configured): the STUN URLs only.

    Raises:
        ValueError: a URL that :func:`check_turn_url` refuses.
    """
    checked = [check_turn_url(url) for url in urls]
    stun = tuple(url for url in checked if url.startswith("stun:"))
    turn = tuple(url for url in checked if not url.startswith("stun:"))
    servers: list[IceServer] = []
    if stun:
        servers.append(IceServer(stun))
    if turn and credentials is not None:
        servers.append(IceServer(turn, credentials.username, credentials.password))
    return servers
