"""Session tokens: only callers holding a valid token may open a conversation on a node.

An application backend (which knows its users) mints a short-lived token per conversation with
:func:`mint_token` and hands it to the client; the client presents it when it opens ``/api/chat``; the
runtime checks it (:class:`TokenVerifier`) before a slot is taken. A token is a JWT (RFC 7519, PyJWT),
HS256-signed with one of the node's signing keys, named by the ``kid`` header::

    header  {"alg": "HS256", "typ": "JWT", "kid": "<key id>"}
    claims  {"aud": "<node or fleet audience>", "iat": <unix s>, "nbf": <unix s>, "exp": <unix s>,
             "jti": "<token id>", "personas": ["*"] or ["<voice prompt>", ...],
             "max_session_s": <s, optional>, "recording_consent": <bool, optional>,
             "tenant": "<tenant, optional>"}

- ``personas``: the voice prompts (``voice_prompt`` query parameter) the token allows; ``["*"]`` allows
  any. A session without a voice prompt (the model's own voice) is allowed by every token.
- ``max_session_s``: the session is closed at this length (or at the node's ``DUPLEX_MAX_SESSION_S``,
  whichever is shorter).
- ``recording_consent``: the caller consented to a recording: the node writes both sides to disk
  (``runtime.frontend.store.recordings``; docs/sessions-api.md). Absent or false: nothing is recorded.
- A token carrying a ``scope`` claim is an *application* token (``runtime.frontend.gate.app_tokens``, for the
  sessions API): it never opens a session (``wrong_token_kind``, 403).
- ``jti``: tokens are single-use: the runtime remembers every token id it admitted until the token
  expires and refuses a second use (the replay guards: :mod:`runtime.frontend.gate.replay`).
- ``tenant``: the application the token belongs to (absent: ``DEFAULT_TENANT``). A key bound to a tenant
  (``runtime.signing_keys``) verifies only its tenant's tokens, an unbound key only the default tenant's
  (``wrong_tenant``, 403): one application's key cannot mint another's tokens.

Lifetime is capped at verify (``exp - iat`` and ``exp - now`` at most ``max_ttl_s``: ``lifetime_too_long``);
:class:`Revocations` refuses a token by its ``jti`` or ``kid`` (``revoked``). The node's verifiers:
``runtime.frontend.gate.verifiers``.

Key rotation: the verifier holds several keys at once and picks one by ``kid``. Add the new key on every
node, switch the backend to minting with it, and once the old key's tokens have expired (``ttl_s``),
remove the old key: tokens still signed with it are then refused (``unknown_key``).

This module needs only PyJWT (no torch, no Redis client), so a backend can import :func:`mint_token` alone.
Operating the tokens: docs/protocol.md, "Access control".
"""

from __future__ import annotations

import math
import re
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jwt

from runtime.engine.persona_limits import voice_name
from runtime.signing_keys import (
    DEFAULT_TENANT,
    MIN_SECRET_BYTES,
    TENANT_RE,
    TENANT_RULE,
    SigningKey,
    generate_signing_key,
    key_tenant,
    keys_from_mapping,
    load_key_file,
)

__all__ = [
    "ALGORITHM",
    "ANY_PERSONA",
    "DEFAULT_TENANT",
    "MAX_TTL_S",
    "MIN_SECRET_BYTES",
    "REFUSAL_STATUS",
    "SESSION_TOKEN_ON_API",
    "SUBPROTOCOL_PREFIX",
    "Revocations",
    "SigningKey",
    "TOKEN_KINDS",
    "TokenClaims",
    "TokenRejected",
    "TokenVerifier",
    "generate_signing_key",
    "key_tenant",
    "keys_from_mapping",
    "load_key_file",
    "mint_token",
]

ALGORITHM = "HS256"
"""The only signing algorithm minted and accepted (a token naming another one is refused)."""

MAX_TTL_S = 24 * 3600
"""Longest session token lifetime (s) :func:`mint_token` signs and :class:`TokenVerifier` accepts by
default (``DUPLEX_TOKEN_MAX_TTL_S`` lowers it): tokens are meant to live minutes."""

ANY_PERSONA = "*"
"""``personas: ["*"]``: the token allows every voice prompt on the node."""

SUBPROTOCOL_PREFIX = "duplex.token."
"""Browsers cannot set an ``Authorization`` header on a WebSocket: they pass the token as the subprotocol
``duplex.token.<jwt>`` (``new WebSocket(url, ["duplex.token." + token])``); the server selects it."""

REFUSAL_STATUS: dict[str, int] = {
    "missing": 401,
    "malformed": 401,
    "expired": 401,
    "not_yet_valid": 401,
    "bad_signature": 401,
    "unknown_key": 401,
    "wrong_audience": 401,
    "lifetime_too_long": 401,
    "revoked": 401,
    "wrong_key_kind": 401,
    "replayed": 403,
    "wrong_token_kind": 403,
    "wrong_tenant": 403,
    "insufficient_scope": 403,
    "persona_not_allowed": 403,
    "origin_not_allowed": 403,
    "replay_check_unavailable": 503,
}
"""Every refusal reason of the access check and the HTTP status the runtime answers it with (before the
WebSocket upgrade): 401 the caller has no valid token (``lifetime_too_long``: ``exp`` further than the cap
from ``iat`` or now; ``revoked``: its ``jti`` or ``kid`` is on the deny-list; ``wrong_key_kind``: signed with
a key of the other kind, e.g. an application token with a session-token key), 403 the token (or the page's
origin) is valid but not for this (``wrong_tenant``: its ``tenant`` claim is not its key's tenant), 503 the
replay check cannot be made now (Redis down with ``DUPLEX_TOKEN_REPLAY_CHECK=redis``)."""

SESSION_TOKEN_ON_API = (
    "a session token cannot use the sessions API: mint an application token "
    "(`duplex token mint --app`, runtime.frontend.gate.app_tokens.mint_app_token)"
)
_APP_TOKEN_ON_CHAT = (
    "this is an application token (it has a scope claim): it reads the sessions API and cannot open a "
    "session; mint a session token (`duplex token mint`)"
)
_JTI_RE = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable ASCII, no spaces: it goes into a Redis key
_PERSONA_RE = re.compile(r"^[\x21-\x7e]{1,128}$")


class TokenRejected(Exception):
    """A session token (or the request carrying it) was refused.

    Attributes:
        reason: one of ``REFUSAL_STATUS`` (the ``reason`` label of ``duplex_admissions_refused_total``).
        detail: what exactly was wrong, for the caller (never contains a secret).
    """

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in REFUSAL_STATUS:
            raise ValueError(f"unknown refusal reason {reason!r}; allowed: {', '.join(REFUSAL_STATUS)}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    @property
    def status(self) -> int:
        """The HTTP status the runtime answers with."""
        return REFUSAL_STATUS[self.reason]


@dataclass(frozen=True)
class TokenClaims:
    """What a verified token allows.

    Attributes:
        token_id: ``jti``, single-use.
        kid: the key that signed it.
        audience: ``aud``.
        personas: allowed voice prompts; ``("*",)`` for any.
        issued_at, not_before, expires_at: ``iat``, ``nbf``, ``exp`` (unix s).
        max_session_s: the session's longest length (s), or None for the node's.
        recording_consent: the caller consented to a recording of the session (both sides).
        tenant: the application the session belongs to (``tenant`` claim; ``DEFAULT_TENANT`` when absent),
            checked against the signing key's tenant; the session's record carries it so that the sessions
            API shows it to that tenant only.
    """

    token_id: str
    kid: str
    audience: str
    personas: tuple[str, ...]
    issued_at: float
    not_before: float
    expires_at: float
    max_session_s: float | None = None
    recording_consent: bool = False
    tenant: str = DEFAULT_TENANT

    def allows_persona(self, voice_prompt: str | None) -> bool:
        """The token allows this voice prompt (None: no voice prompt, always allowed). NVIDIA's file name
        ``NATF2.pt`` and ``NATF2`` are one voice (``runtime.engine.persona_limits.voice_name``)."""
        if voice_prompt is None or ANY_PERSONA in self.personas:
            return True
        return voice_name(voice_prompt) in {voice_name(p) for p in self.personas}


@dataclass(frozen=True)
class Revocations:
    """The deny-list: tokens refused (``revoked``, 401) although validly signed and unexpired.

    Attributes:
        token_ids: revoked ``jti`` values (one leaked application token; its entry may go once it expires).
        key_ids: revoked ``kid`` values (every token of a leaked key, until the key is removed).
    """

    token_ids: frozenset[str] = frozenset()
    key_ids: frozenset[str] = frozenset()

    def check(self, kid: str, jti: object) -> None:
        """Raises ``TokenRejected("revoked")`` when the key or the token id is on the list."""
        if kid in self.key_ids:
            raise TokenRejected("revoked", f"signing key {kid!r} is revoked (DUPLEX_TOKEN_REVOKED_KIDS)")
        if isinstance(jti, str) and jti in self.token_ids:
            raise TokenRejected("revoked", f"token {jti!r} is revoked (DUPLEX_TOKEN_REVOKED_JTIS)")


TOKEN_KINDS = ("session", "app")
"""What a verifier's keys sign: ``session`` tokens (``DUPLEX_TOKEN_KEYS``) or ``app`` tokens for the sessions
API (``DUPLEX_APP_TOKEN_KEYS``)."""


class TokenVerifier:
    """Checks tokens against the node's keys of one kind (several at once, chosen by ``kid``), audience,
    lifetime cap, deny-list and tenant binding.

    Args:
        keys: the signing keys currently valid (rotation: old and new both listed).
        audience: this node's (or fleet's) audience; a token for another one is refused.
        leeway_s: clock skew tolerated on ``exp``, ``nbf`` and ``iat`` (s).
        max_ttl_s: longest lifetime accepted (s): ``exp - iat`` and ``exp - now`` (less ``leeway_s``) must
            each be at most this.
        revoked: the deny-list (default empty).
        kind: what the keys sign (:data:`TOKEN_KINDS`), for the refusal's words.
        other_kind_keys: the node's keys of the other kind. A token signed with one is checked with it
            and then refused: ``wrong_token_kind`` (403) when it is a token of that other kind (a session
            token on the sessions API), ``wrong_key_kind`` (401) when it claims this verifier's kind (an
            application token signed with a session key: what whoever mints callers' tokens could forge).
        clock: the current unix time (s), for the ``exp - now`` cap; injectable for tests.

    Raises:
        ValueError: no keys, two keys with the same kid, an empty audience, a negative leeway, a
            non-positive ``max_ttl_s`` or an unknown kind.
    """

    def __init__(
        self,
        keys: Sequence[SigningKey],
        audience: str,
        leeway_s: float = 5.0,
        *,
        max_ttl_s: float = MAX_TTL_S,
        revoked: Revocations | None = None,
        kind: str = "session",
        other_kind_keys: Sequence[SigningKey] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not keys:
            raise ValueError("a token verifier needs at least one signing key")
        by_kid: dict[str, SigningKey] = {}
        for key in keys:
            if key.kid in by_kid:
                raise ValueError(f"two signing keys share the kid {key.kid!r}; each needs its own")
            by_kid[key.kid] = key
        if not audience:
            raise ValueError("the token audience must not be empty")
        if not leeway_s >= 0:
            raise ValueError(f"leeway_s must be >= 0 s, got {leeway_s}")
        if not 0 < max_ttl_s < math.inf:
            raise ValueError(f"max_ttl_s must be a positive number of seconds, got {max_ttl_s}")
        if kind not in TOKEN_KINDS:
            raise ValueError(f"kind must be one of {', '.join(TOKEN_KINDS)}, got {kind!r}")
        self._keys = by_kid
        self.audience = audience
        self.leeway_s = float(leeway_s)
        self.max_ttl_s = float(max_ttl_s)
        self.revoked = revoked or Revocations()
        self.kind = kind
        self._other_kind = {key.kid: key for key in other_kind_keys if key.kid not in by_kid}
        self._clock = clock

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def verify(self, token: str | None) -> TokenClaims:
        """The claims of session token ``token`` if it is well formed, signed by a known key, for this
        audience, within its validity period and lifetime cap, not revoked, and of its key's tenant.

        Raises:
            TokenRejected: ``missing``, ``malformed``, ``unknown_key``, ``wrong_key_kind``,
                ``bad_signature``, ``wrong_audience``, ``expired``, ``not_yet_valid``,
                ``lifetime_too_long``, ``revoked``, ``wrong_tenant`` or ``wrong_token_kind`` (an
                application token; the detail says more).
        """
        payload, kid = self.verified_payload(token)
        return _claims_from_payload(payload, kid)

    def verified_payload(self, token: str | None) -> tuple[dict[str, Any], str]:
        """The payload and ``kid`` of any token of this verifier's keys (session or application) after the
        checks of signature, key, audience, time, lifetime cap, deny-list and tenant (the payload's
        ``tenant`` is then a valid name: the key's); its other claims are not interpreted.

        Raises:
            TokenRejected: as :meth:`verify`, but never ``wrong_token_kind``.
        """
        if not token:
            raise TokenRejected(
                "missing",
                f"no session token: pass ?token=<jwt> or the WebSocket subprotocol {SUBPROTOCOL_PREFIX}<jwt>",
            )
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise TokenRejected("malformed", f"not a JWT ({exc})") from None
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid:
            raise TokenRejected("malformed", "the token has no kid header naming its signing key")
        key = self._keys.get(kid) or self._other_kind.get(kid)
        if key is None:
            raise TokenRejected(
                "unknown_key", f"no signing key {kid!r} on this node (retired or never added)"
            )
        if header.get("alg") != ALGORITHM:
            raise TokenRejected("bad_signature", f"algorithm {header.get('alg')!r} refused; {ALGORITHM} only")
        try:
            claims = jwt.decode(
                token,
                key.secret,
                algorithms=[ALGORITHM],
                audience=self.audience,
                leeway=self.leeway_s,
                options={"require": ["exp", "iat", "nbf", "jti", "aud"]},
            )
        except jwt.InvalidSignatureError:
            raise TokenRejected("bad_signature", f"signature does not match key {kid!r}") from None
        except jwt.ExpiredSignatureError:
            raise TokenRejected("expired", "the token has expired: mint a new one") from None
        except jwt.ImmatureSignatureError as exc:
            raise TokenRejected("not_yet_valid", f"{exc} (check the minting host's clock)") from None
        except jwt.InvalidAudienceError:
            raise TokenRejected(
                "wrong_audience", f"the token is not for audience {self.audience!r}"
            ) from None
        except jwt.PyJWTError as exc:
            raise TokenRejected("malformed", str(exc)) from None
        self._check_lifetime(claims)
        self.revoked.check(kid, claims["jti"])
        tenant = claims.get("tenant", DEFAULT_TENANT)
        if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
            raise TokenRejected("malformed", f"tenant {tenant!r} is invalid: {TENANT_RULE}")
        if tenant != key.signs_for:
            raise TokenRejected(
                "wrong_tenant",
                f"the token is for tenant {tenant!r} but key {kid!r} signs for tenant {key.signs_for!r} only",
            )
        claims["tenant"] = tenant
        if kid in self._other_kind:
            self._refuse_other_kind(kid, claims)
        return claims, kid

    def _refuse_other_kind(self, kid: str, claims: dict[str, Any]) -> None:
        """A valid token signed with a key of the other kind: always refused (see ``other_kind_keys``)."""
        if ("scope" in claims) == (self.kind == "session"):  # a token of the key's kind, at the wrong door
            raise TokenRejected(
                "wrong_token_kind", _APP_TOKEN_ON_CHAT if "scope" in claims else SESSION_TOKEN_ON_API
            )
        mine = "DUPLEX_TOKEN_KEYS" if self.kind == "session" else "DUPLEX_APP_TOKEN_KEYS"
        raise TokenRejected(
            "wrong_key_kind", f"a {self.kind} token signed with key {kid!r}, not one of this node's {mine}"
        )

    def _check_lifetime(self, claims: dict[str, Any]) -> None:
        """``exp - iat`` and ``exp - now`` at most ``max_ttl_s`` (the latter with ``leeway_s``)."""
        exp, iat = claims["exp"], claims["iat"]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (exp, iat)):
            raise TokenRejected("malformed", "exp and iat must be unix times in seconds")
        cap = self.max_ttl_s
        if exp - iat > cap:
            raise TokenRejected(
                "lifetime_too_long",
                f"the token lives {exp - iat:.0f} s (exp - iat); {self.kind} tokens may live {cap:.0f} s at "
                "most: mint a shorter-lived one",
            )
        left = exp - self._clock()
        if left > cap + self.leeway_s:
            raise TokenRejected(
                "lifetime_too_long",
                f"the token expires in {left:.0f} s; {self.kind} tokens may live {cap:.0f} s at most "
                "(check the minting host's clock)",
            )

    @staticmethod
    def check_persona(claims: TokenClaims, voice_prompt: str | None) -> None:
        """Raises ``TokenRejected("persona_not_allowed")`` when the token does not allow the voice prompt."""
        if not claims.allows_persona(voice_prompt):
            raise TokenRejected(
                "persona_not_allowed",
                f"the token does not allow voice_prompt={voice_prompt!r}; "
                f"it allows {', '.join(claims.personas)}",
            )


def _claims_from_payload(payload: dict[str, Any], kid: str) -> TokenClaims:
    if "scope" in payload:
        raise TokenRejected("wrong_token_kind", _APP_TOKEN_ON_CHAT)
    jti = payload["jti"]
    if not isinstance(jti, str) or not _JTI_RE.match(jti):
        raise TokenRejected("malformed", "jti must be 1-128 printable ASCII characters without spaces")
    personas = payload.get("personas")
    if (
        not isinstance(personas, list)
        or not personas
        or not all(isinstance(p, str) and _PERSONA_RE.match(p) for p in personas)
    ):
        raise TokenRejected("malformed", 'personas must be a non-empty list of voice prompt names, or ["*"]')
    max_session_s = payload.get("max_session_s")
    if max_session_s is not None and (
        isinstance(max_session_s, bool)
        or not isinstance(max_session_s, int | float)
        or not 0 < max_session_s < math.inf
    ):
        raise TokenRejected("malformed", "max_session_s must be a positive number of seconds")
    consent = payload.get("recording_consent", False)
    if not isinstance(consent, bool):
        raise TokenRejected("malformed", "recording_consent must be true or false")
    audience = payload["aud"]
    tenant = payload.get("tenant", DEFAULT_TENANT)
    return TokenClaims(
        token_id=jti,
        kid=kid,
        audience=audience if isinstance(audience, str) else ",".join(audience),
        personas=tuple(personas),
        issued_at=float(payload["iat"]),
        not_before=float(payload["nbf"]),
        expires_at=float(payload["exp"]),
        max_session_s=None if max_session_s is None else float(max_session_s),
        recording_consent=consent,
        tenant=tenant,
    )


def mint_token(
    key: SigningKey,
    *,
    ttl_s: float,
    personas: Iterable[str],
    max_session_s: float | None = None,
    audience: str,
    token_id: str | None = None,
    now: float | None = None,
    recording_consent: bool = False,
    tenant: str | None = None,
) -> str:
    """A signed session token (what an application backend calls, once per conversation).

    Args:
        key: the signing key (its ``kid`` goes into the header).
        ttl_s: lifetime (s) from ``now``; the client must open the session within it. Minutes, at most
            ``MAX_TTL_S``.
        personas: the voice prompts allowed, or ``["*"]`` for any.
        max_session_s: the session's longest length (s); None leaves the node's limit.
        audience: the node's (or fleet's) audience, its ``DUPLEX_TOKEN_AUDIENCE``.
        token_id: ``jti``; default 128 random bits. Each token may open one session.
        now: the issue time (unix s); default the clock.
        recording_consent: the caller consented to a recording (the claim is written only when True).
        tenant: the application the session belongs to; default the key's (written only when it is not
            ``DEFAULT_TENANT``).

    Raises:
        ValueError: ttl out of (0, MAX_TTL_S], no personas or a bad name, a non-positive
            ``max_session_s``, an empty audience, a bad ``token_id``, or a tenant that is not the key's.
    """
    if not 0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S}] s, got {ttl_s}")
    persona_list = list(personas)
    if not persona_list or not all(isinstance(p, str) and _PERSONA_RE.match(p) for p in persona_list):
        raise ValueError(f'personas must be voice prompt names or ["*"], got {persona_list!r}')
    if max_session_s is not None and not 0 < max_session_s < math.inf:
        raise ValueError(f"max_session_s must be a positive number of seconds, got {max_session_s}")
    if not audience:
        raise ValueError("audience must not be empty (the node's DUPLEX_TOKEN_AUDIENCE)")
    jti = secrets.token_urlsafe(16) if token_id is None else token_id
    if not _JTI_RE.match(jti):
        raise ValueError("token_id must be 1-128 printable ASCII characters without spaces")
    tenant_claim = key_tenant(key, tenant)
    issued = int(time.time() if now is None else now)
    payload: dict[str, Any] = {
        "aud": audience,
        "iat": issued,
        "nbf": issued,
        "exp": issued + max(1, math.ceil(ttl_s)),
        "jti": jti,
        "personas": persona_list,
    }
    if max_session_s is not None:
        payload["max_session_s"] = max_session_s
    if recording_consent:
        payload["recording_consent"] = True
    if tenant_claim != DEFAULT_TENANT:
        payload["tenant"] = tenant_claim
    return jwt.encode(payload, key.secret, algorithm=ALGORITHM, headers={"kid": key.kid})
