"""Application tokens: what an application backend presents to the sessions API (``/api/sessions``).

A session token (``runtime.frontend.gate.tokens``) lets one caller open one conversation; an application token
lets the application's backend read its conversations back and erase them. The two are different kinds:

- **Keys**: application tokens are signed with the node's application keys (``DUPLEX_APP_TOKEN_KEYS`` or
  ``DUPLEX_APP_TOKEN_KEYS_FILE``), session tokens with its session keys (``DUPLEX_TOKEN_KEYS``); a kid may be
  in one set only, and a token signed with a key of the other set is refused (``wrong_key_kind``, 401). So
  whatever mints callers' session tokens cannot mint a token that reads or erases sessions. A node without
  application keys has the sessions API off (403 ``api_off``), unless it opts into the deprecated shared
  use (``DUPLEX_APP_TOKENS_USE_SESSION_KEYS=true``, logged as a warning at start): the session keys then
  verify both kinds, told apart by the ``scope`` claim alone.
- **Claims**: the ``scope`` claim (RFC 8693, 4.2: a space-separated list), which only application tokens
  carry, and ``tenant`` (absent: the default tenant)::

    claims  {"aud": "<audience>", "iat": <unix s>, "nbf": <unix s>, "exp": <unix s>, "jti": "<id>",
             "scope": "sessions:read sessions:erase sessions:recordings", "tenant": "<tenant, optional>"}

- ``sessions:read``: list sessions, read one (record and transcript).
- ``sessions:recordings``: download a session's recording (audio of the caller: a scope of its own).
- ``sessions:erase``: erase one (its record, transcript and recording).

An application token sees and erases its own tenant's sessions only: a key bound to a tenant
(``runtime.signing_keys``) signs that tenant's tokens only, and the sessions API passes the token's tenant to
the session reader. A session token on the API gets 403 ``wrong_token_kind``; an application token without
the scope a route needs gets 403 ``insufficient_scope``; no token or an invalid one gets 401 (including
``lifetime_too_long``: ``exp`` more than ``DUPLEX_APP_TOKEN_MAX_TTL_S`` from ``iat`` or now, and
``revoked``: its ``jti`` or ``kid`` on the deny-list). An application token is not single-use (a backend
reuses it until it expires) and never opens a session (``TokenVerifier.verify`` refuses a token with a
``scope``). Mint one per backend deployment with a short life and mint again before it expires; revoke a
leaked one by its ``jti`` (``DUPLEX_TOKEN_REVOKED_JTIS``). The API: docs/sessions-api.md.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass

import jwt

from runtime.frontend.gate.tokens import (
    ALGORITHM,
    DEFAULT_TENANT,
    SESSION_TOKEN_ON_API,
    SigningKey,
    TokenRejected,
    TokenVerifier,
    key_tenant,
)

__all__ = [
    "APP_MAX_TTL_S",
    "SCOPES",
    "SCOPE_ERASE",
    "SCOPE_READ",
    "SCOPE_RECORDINGS",
    "AppClaims",
    "mint_app_token",
    "verify_app_token",
]

SCOPE_READ = "sessions:read"
SCOPE_ERASE = "sessions:erase"
SCOPE_RECORDINGS = "sessions:recordings"
SCOPES = (SCOPE_READ, SCOPE_ERASE, SCOPE_RECORDINGS)
"""Every scope an application token may carry."""

APP_MAX_TTL_S = 24 * 3600
"""Longest application token lifetime (s) :func:`mint_app_token` signs and the sessions API accepts by
default (``DUPLEX_APP_TOKEN_MAX_TTL_S`` lowers it)."""


@dataclass(frozen=True)
class AppClaims:
    """A verified application token: its id (``jti``, for logs and revocation), signing key, scopes,
    expiry (unix s) and tenant (whose sessions it sees)."""

    token_id: str
    kid: str
    scopes: frozenset[str]
    expires_at: float
    tenant: str = DEFAULT_TENANT


def mint_app_token(
    key: SigningKey,
    *,
    ttl_s: float,
    audience: str,
    scopes: Iterable[str] = SCOPES,
    now: float | None = None,
    tenant: str | None = None,
    token_id: str | None = None,
) -> str:
    """A signed application token for the sessions API.

    Args:
        key: an application key of the node (``DUPLEX_APP_TOKEN_KEYS``; its ``kid`` goes into the header).
        ttl_s: lifetime (s), in (0, ``APP_MAX_TTL_S``].
        audience: the node's ``DUPLEX_TOKEN_AUDIENCE``.
        scopes: some of :data:`SCOPES`; default all.
        now: issue time (unix s); default the clock.
        tenant: whose sessions the token sees; default the key's (written only when it is not
            ``DEFAULT_TENANT``).
        token_id: ``jti`` (what revokes it); default 128 random bits.

    Raises:
        ValueError: ttl out of range, an empty audience, no scope or an unknown one (the message lists
            the allowed ones), or a tenant that is not the key's.
    """
    if not 0 < ttl_s <= APP_MAX_TTL_S:
        raise ValueError(f"ttl_s must be in (0, {APP_MAX_TTL_S}] s, got {ttl_s}")
    if not audience:
        raise ValueError("audience must not be empty (the node's DUPLEX_TOKEN_AUDIENCE)")
    wanted = list(dict.fromkeys(scopes))
    unknown = [scope for scope in wanted if scope not in SCOPES]
    if not wanted or unknown:
        raise ValueError(f"scopes must be some of {', '.join(SCOPES)}; got {wanted!r}")
    tenant_claim = key_tenant(key, tenant)
    issued = int(time.time() if now is None else now)
    payload: dict[str, object] = {
        "aud": audience,
        "iat": issued,
        "nbf": issued,
        "exp": issued + max(1, math.ceil(ttl_s)),
        "jti": secrets.token_urlsafe(16) if token_id is None else token_id,
        "scope": " ".join(wanted),
    }
    if tenant_claim != DEFAULT_TENANT:
        payload["tenant"] = tenant_claim
    return jwt.encode(payload, key.secret, algorithm=ALGORITHM, headers={"kid": key.kid})


def verify_app_token(verifier: TokenVerifier, token: str | None, scope: str) -> AppClaims:
    """The claims of application token ``token`` when it is valid on this node and carries ``scope``.

    Args:
        verifier: the node's application-token verifier (:func:`app_token_verifier`).
        token: the ``Authorization: Bearer`` token, or None.
        scope: the scope the route needs, one of :data:`SCOPES`.

    Raises:
        TokenRejected: ``missing`` (no ``Authorization: Bearer`` token), the signature, key, time, lifetime,
            revocation and tenant reasons of :meth:`TokenVerifier.verified_payload` (401; ``wrong_tenant``
            403), ``wrong_token_kind`` (a session token: no ``scope`` claim; 403), ``insufficient_scope``
            (403, naming the scope needed).
    """
    if not token:
        raise TokenRejected(
            "missing", "no application token: send Authorization: Bearer <jwt> (`duplex token mint --app`)"
        )
    payload, kid = verifier.verified_payload(token)
    scope_claim = payload.get("scope")
    if scope_claim is None:
        raise TokenRejected("wrong_token_kind", SESSION_TOKEN_ON_API)
    if not isinstance(scope_claim, str):
        raise TokenRejected("malformed", "scope must be a space-separated string")
    scopes = frozenset(scope_claim.split())
    if scope not in scopes:
        raise TokenRejected(
            "insufficient_scope",
            f"this route needs scope {scope!r}; the token has {', '.join(sorted(scopes)) or 'none'}",
        )
    return AppClaims(str(payload["jti"]), kid, scopes, float(payload["exp"]), str(payload["tenant"]))
