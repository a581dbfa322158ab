"""Application tokens: what an application backend presents to the sessions API (``/api/sessions``).

A session token (``runtime.frontend.gate.tokens``) lets one caller open one conversation; an application token
lets the application's backend read conversations back and erase them. Both are JWTs signed with the
node's keys (same ``kid``, same audience); what tells them apart is the ``scope`` claim (RFC 8693, 4.2: a
space-separated list), which only application tokens carry::

    claims  {"aud": "<audience>", "iat": <unix s>, "nbf": <unix s>, "exp": <unix s>, "jti": "<id>",
             "scope": "sessions:read sessions:erase"}

- ``sessions:read``: list sessions, read one, download its recording.
- ``sessions:erase``: erase one (its record, transcript and recording).

A session token on the API gets 403 ``wrong_token_kind``; an application token without the scope a route
needs gets 403 ``insufficient_scope``; no token or an invalid one gets 401. An application token is not
single-use (a backend reuses it until it expires) and never opens a session (``TokenVerifier.verify``
refuses a token with a ``scope``). Mint one per backend deployment with a short life (``MAX_TTL_S`` at
most) and mint again before it expires. The API: docs/sessions-api.md.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass

import jwt

from runtime.frontend.gate.tokens import ALGORITHM, MAX_TTL_S, SigningKey, TokenRejected, TokenVerifier

__all__ = [
    "SCOPES",
    "SCOPE_ERASE",
    "SCOPE_READ",
    "AppClaims",
    "mint_app_token",
    "verify_app_token",
]

SCOPE_READ = "sessions:read"
SCOPE_ERASE = "sessions:erase"
SCOPES = (SCOPE_READ, SCOPE_ERASE)
"""Every scope an application token may carry."""


@dataclass(frozen=True)
class AppClaims:
    """A verified application token: its id (``jti``, for logs), signing key and scopes."""

    token_id: str
    kid: str
    scopes: frozenset[str]
    expires_at: float


def mint_app_token(
    key: SigningKey,
    *,
    ttl_s: float,
    audience: str,
    scopes: Iterable[str] = SCOPES,
    now: float | None = None,
) -> str:
    """A signed application token for the sessions API.

    Args:
        key: a signing key of the node (its ``kid`` goes into the header).
        ttl_s: lifetime (s), in (0, ``MAX_TTL_S``].
        audience: the node's ``DUPLEX_TOKEN_AUDIENCE``.
        scopes: some of :data:`SCOPES`; default both.
        now: issue time (unix s); default the clock.

    Raises:
        ValueError: ttl out of range, an empty audience, no scope or an unknown one (the message lists
            the allowed ones).
    """
    if not 0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S}] s, got {ttl_s}")
    if not audience:
        raise ValueError("audience must not be empty (the node's DUPLEX_TOKEN_AUDIENCE)")
    wanted = list(dict.fromkeys(scopes))
    unknown = [scope for scope in wanted if scope not in SCOPES]
    if not wanted or unknown:
        raise ValueError(f"scopes must be some of {', '.join(SCOPES)}; got {wanted!r}")
    issued = int(time.time() if now is None else now)
    payload = {
        "aud": audience,
        "iat": issued,
        "nbf": issued,
        "exp": issued + max(1, math.ceil(ttl_s)),
        "jti": secrets.token_urlsafe(16),
        "scope": " ".join(wanted),
    }
    return jwt.encode(payload, key.secret, algorithm=ALGORITHM, headers={"kid": key.kid})


def verify_app_token(verifier: TokenVerifier, token: str | None, scope: str) -> AppClaims:
    """The claims of application token ``token`` when it is valid on this node and carries ``scope``.

    Raises:
        TokenRejected: ``missing`` (no ``Authorization: Bearer`` token), the signature and time reasons of
            :meth:`TokenVerifier.verified_payload` (401), ``wrong_token_kind`` (a session token: no
            ``scope`` claim; 403), ``insufficient_scope`` (403, naming the scope needed).
    """
    if not token:
        raise TokenRejected(
            "missing", "no application token: send Authorization: Bearer <jwt> (`duplex token mint --app`)"
        )
    payload, kid = verifier.verified_payload(token)
    scope_claim = payload.get("scope")
    if scope_claim is None:
        raise TokenRejected(
            "wrong_token_kind",
            "a session token cannot use the sessions API: mint an application token "
            "(`duplex token mint --app`, runtime.frontend.gate.app_tokens.mint_app_token)",
        )
    if not isinstance(scope_claim, str):
        raise TokenRejected("malformed", "scope must be a space-separated string")
    scopes = frozenset(scope_claim.split())
    if scope not in scopes:
        raise TokenRejected(
            "insufficient_scope",
            f"this route needs scope {scope!r}; the token has {', '.join(sorted(scopes)) or 'none'}",
        )
    return AppClaims(str(payload["jti"]), kid, scopes, float(payload["exp"]))
