"""Session tokens: only callers holding a valid token may open a conversation on a node.

An application backend (which knows its users) mints a short-lived token per conversation with
:func:`mint_token` and hands it to the client; the client presents it when it opens ``/api/chat``; the
runtime checks it (:class:`TokenVerifier`) before a slot is taken. A token is a JWT (RFC 7519, PyJWT),
HS256-signed with one of the node's signing keys, named by the ``kid`` header::

    header  {"alg": "HS256", "typ": "JWT", "kid": "<key id>"}
    claims  {"aud": "<node or fleet audience>", "iat": <unix s>, "nbf": <unix s>, "exp": <unix s>,
             "jti": "<token id>", "personas": ["*"] or ["<voice prompt>", ...],
             "max_session_s": <s, optional>}

- ``personas``: the voice prompts (``voice_prompt`` query parameter) the token allows; ``["*"]`` allows
  any. A session without a voice prompt (the model's own voice) is allowed by every token.
- ``max_session_s``: the session is closed at this length (or at the node's ``DUPLEX_MAX_SESSION_S``,
  whichever is shorter).
- ``jti``: tokens are single-use: the runtime remembers every token id it admitted until the token
  expires (:class:`RedisReplayGuard`, :class:`MemoryReplayGuard`) and refuses a second use.

Key rotation: the verifier holds several keys at once and picks one by ``kid``. Add the new key on every
node, switch the backend to minting with it, and once the old key's tokens have expired (``ttl_s``),
remove the old key: tokens still signed with it are then refused (``unknown_key``).

This module needs only PyJWT (no torch, no Redis client unless :class:`RedisReplayGuard` is used), so a
backend can import :func:`mint_token` alone.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jwt

from runtime.engine.api import replayed_message

__all__ = [
    "ALGORITHM",
    "ANY_PERSONA",
    "MAX_TTL_S",
    "MIN_SECRET_BYTES",
    "REFUSAL_STATUS",
    "SUBPROTOCOL_PREFIX",
    "MemoryReplayGuard",
    "RedisReplayGuard",
    "ReplayGuard",
    "SigningKey",
    "TokenClaims",
    "TokenRejected",
    "TokenVerifier",
    "generate_signing_key",
    "keys_from_mapping",
    "load_key_file",
    "mint_token",
]

ALGORITHM = "HS256"
"""The only signing algorithm minted and accepted (a token naming another one is refused)."""

MIN_SECRET_BYTES = 32
"""Shortest signing secret accepted: 256 bits, the HMAC-SHA256 output size (RFC 7518, 3.2)."""

MAX_TTL_S = 24 * 3600
"""Longest token lifetime :func:`mint_token` signs (s): tokens are meant to live minutes."""

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
    "replayed": 403,
    "persona_not_allowed": 403,
    "origin_not_allowed": 403,
    "replay_check_unavailable": 503,
}
"""Every refusal reason of the access check and the HTTP status the runtime answers it with (before the
WebSocket upgrade): 401 the caller has no valid token, 403 the token (or the page's origin) is valid but
not for this, 503 the replay check cannot be made now (Redis down with
``DUPLEX_TOKEN_REPLAY_CHECK=redis``)."""

_KID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
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


class SigningKey:
    """One HS256 signing key: its id (the token's ``kid`` header) and its secret (bytes; a str is taken as
    UTF-8), hidden from ``repr``.

    Raises:
        ValueError: a kid outside ``[A-Za-z0-9._-]{1,64}``, or a secret shorter than 32 bytes.
    """

    __slots__ = ("kid", "secret")

    def __init__(self, kid: str, secret: bytes | str) -> None:
        if not isinstance(kid, str) or not _KID_RE.match(kid):
            raise ValueError(f"key id {kid!r} must be 1-64 characters of A-Z a-z 0-9 . _ -")
        raw = secret.encode() if isinstance(secret, str) else secret
        if not isinstance(raw, bytes) or len(raw) < MIN_SECRET_BYTES:
            size = len(raw) if isinstance(raw, bytes) else 0
            raise ValueError(
                f"signing key {kid!r}: the secret must be at least {MIN_SECRET_BYTES} bytes, got {size} "
                "(`duplex token keygen` makes one)"
            )
        self.kid = kid
        self.secret = raw

    def __repr__(self) -> str:
        return f"SigningKey(kid={self.kid!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SigningKey) and (self.kid, self.secret) == (other.kid, other.secret)

    def __hash__(self) -> int:
        return hash((self.kid, self.secret))


def generate_signing_key(kid: str | None = None) -> SigningKey:
    """A fresh random key: 32 random bytes as 43 URL-safe characters; ``kid`` default ``key-<8 hex>``."""
    return SigningKey(kid or f"key-{secrets.token_hex(4)}", secrets.token_urlsafe(32))


def keys_from_mapping(mapping: Mapping[str, str], *, source: str = "signing keys") -> list[SigningKey]:
    """``{"kid": "secret", ...}`` (the key file's JSON) as keys.

    Raises:
        ValueError: not a non-empty object of strings, or a bad kid or secret (the message names
            ``source`` and the kid, never a secret).
    """
    if not isinstance(mapping, Mapping) or not mapping:
        raise ValueError(f'{source}: expected a non-empty JSON object {{"<kid>": "<secret>", ...}}')
    keys = []
    for kid, secret in mapping.items():
        if not isinstance(secret, str):
            raise ValueError(f"{source}: the secret of key {kid!r} must be a string")
        try:
            keys.append(SigningKey(kid, secret))
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
    return keys


def load_key_file(path: Path) -> list[SigningKey]:
    """The keys of a key file (JSON ``{"kid": "secret", ...}``, e.g. a node's ``secrets/token_keys.json``).

    Raises:
        ValueError: the file is missing, unreadable, not JSON, or holds a bad key (names the file).
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the key file {path}: {exc.strerror or exc}") from None
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"key file {path} is not JSON (line {exc.lineno}): {exc.msg}") from None
    return keys_from_mapping(mapping, source=f"key file {path}")


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
    """

    token_id: str
    kid: str
    audience: str
    personas: tuple[str, ...]
    issued_at: float
    not_before: float
    expires_at: float
    max_session_s: float | None = None

    def allows_persona(self, voice_prompt: str | None) -> bool:
        """The token allows this voice prompt (None: no voice prompt, always allowed)."""
        return voice_prompt is None or ANY_PERSONA in self.personas or voice_prompt in self.personas


class TokenVerifier:
    """Checks tokens against the node's keys (several at once, chosen by ``kid``) and audience.

    Args:
        keys: the signing keys currently valid (rotation: old and new both listed).
        audience: this node's (or fleet's) audience; a token for another one is refused.
        leeway_s: clock skew tolerated on ``exp``, ``nbf`` and ``iat`` (s).

    Raises:
        ValueError: no keys, two keys with the same kid, an empty audience or a negative leeway.
    """

    def __init__(self, keys: Sequence[SigningKey], audience: str, leeway_s: float = 5.0) -> None:
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
        self._keys = by_kid
        self.audience = audience
        self.leeway_s = float(leeway_s)

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def verify(self, token: str | None) -> TokenClaims:
        """The claims of ``token`` if it is well formed, signed by a known key, for this audience and
        within its validity period.

        Raises:
            TokenRejected: ``missing``, ``malformed``, ``unknown_key``, ``bad_signature``,
                ``wrong_audience``, ``expired`` or ``not_yet_valid`` (the detail says more).
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
        key = self._keys.get(kid)
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
        return _claims_from_payload(claims, kid)

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
    audience = payload["aud"]
    return TokenClaims(
        token_id=jti,
        kid=kid,
        audience=audience if isinstance(audience, str) else ",".join(audience),
        personas=tuple(personas),
        issued_at=float(payload["iat"]),
        not_before=float(payload["nbf"]),
        expires_at=float(payload["exp"]),
        max_session_s=None if max_session_s is None else float(max_session_s),
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

    Raises:
        ValueError: ttl out of (0, MAX_TTL_S], no personas or a bad name, a non-positive
            ``max_session_s``, an empty audience or a bad ``token_id``.
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
    return jwt.encode(payload, key.secret, algorithm=ALGORITHM, headers={"kid": key.kid})


# --- replay --------------------------------------------------------------------------------------------


class ReplayGuard(Protocol):
    """Remembers the ids of tokens already used; ``spend`` admits each id once."""

    async def spend(self, claims: TokenClaims) -> None:
        """Record ``claims.token_id`` as used.

        Raises:
            TokenRejected: ``replayed`` (seen before), or ``replay_check_unavailable``.
        """
        ...

    async def seen(self, claims: TokenClaims) -> bool:
        """Whether ``claims.token_id`` was already spent, without spending it (the admission preflight).

        Raises:
            TokenRejected: ``replay_check_unavailable`` when the check cannot be made now.
        """
        ...

    async def close(self) -> None: ...


class MemoryReplayGuard:
    """Seen token ids in this process's memory, each kept until its token expires (plus the leeway).

    Lost when the process restarts and not shared between processes: a token used before a restart can be
    used once more after it. Use it alone only without Redis (``DUPLEX_TOKEN_REPLAY_CHECK=memory``).
    """

    def __init__(self, leeway_s: float = 5.0, *, clock: Callable[[], float] = time.time) -> None:
        self.leeway_s = leeway_s
        self._clock = clock
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def remember(self, claims: TokenClaims) -> bool:
        """Record the id; False if it was already there (and has not expired)."""
        now = self._clock()
        with self._lock:
            if len(self._seen) > 1024:
                self._seen = {jti: until for jti, until in self._seen.items() if until > now}
            until = self._seen.get(claims.token_id)
            if until is not None and until > now:
                return False
            self._seen[claims.token_id] = claims.expires_at + self.leeway_s
            return True

    def was_used(self, claims: TokenClaims) -> bool:
        """The id is recorded (and its token has not expired); records nothing."""
        with self._lock:
            until = self._seen.get(claims.token_id)
        return until is not None and until > self._clock()

    async def spend(self, claims: TokenClaims) -> None:
        if not self.remember(claims):
            raise TokenRejected("replayed", replayed_message(claims.token_id))

    async def seen(self, claims: TokenClaims) -> bool:
        return self.was_used(claims)

    async def close(self) -> None:
        return None


class RedisReplayGuard:
    """Seen token ids in Redis: ``SET duplex:token:<jti> NX`` expiring when the token does (plus the
    leeway), so a replay is refused across runtime restarts, and by every runtime sharing the Redis.

    Args:
        url: Redis URL (the node's ``DUPLEX_REDIS_URL``).
        leeway_s: the verifier's leeway: an id is kept until no verifier would still accept its token.
        fallback: None (fail closed): when Redis does not answer, refuse with ``replay_check_unavailable``.
            A :class:`MemoryReplayGuard` (fail open to this process's memory): when Redis does not answer,
            check and record the id there instead; ids admitted through Redis are recorded there too, so
            only a token first used before a restart of this process can be replayed during an outage.
        timeout_s: connect and command timeout (s): how long a handshake may wait on Redis.
        on_error: called once per failed Redis call (metrics).
        key_prefix: first component of the key.
    """

    def __init__(
        self,
        url: str,
        *,
        leeway_s: float = 5.0,
        fallback: MemoryReplayGuard | None = None,
        timeout_s: float = 0.5,
        on_error: Callable[[], None] | None = None,
        key_prefix: str = "duplex",
    ) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self._redis = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._errors: tuple[type[BaseException], ...] = (aioredis.RedisError, OSError, TimeoutError)
        self.leeway_s = leeway_s
        self.fallback = fallback
        self.timeout_s = timeout_s
        self._on_error = on_error
        self.key_prefix = key_prefix

    def key(self, token_id: str) -> str:
        """``duplex:token:<jti>``."""
        return f"{self.key_prefix}:token:{token_id}"

    async def spend(self, claims: TokenClaims) -> None:
        ttl_s = max(1, math.ceil(claims.expires_at + self.leeway_s - time.time()))
        try:
            fresh = await self._redis.set(self.key(claims.token_id), claims.kid, nx=True, ex=ttl_s)
        except self._errors as exc:
            self._redis_failed(exc)
            assert self.fallback is not None
            await self.fallback.spend(claims)
            return
        if not fresh:
            raise TokenRejected("replayed", replayed_message(claims.token_id))
        if self.fallback is not None:
            self.fallback.remember(claims)

    async def seen(self, claims: TokenClaims) -> bool:
        """``EXISTS duplex:token:<jti>``: read only. When Redis does not answer, the fallback's memory
        answers, or (without one) ``replay_check_unavailable`` is raised, as ``spend`` would."""
        try:
            return bool(await self._redis.exists(self.key(claims.token_id)))
        except self._errors as exc:
            self._redis_failed(exc)
            assert self.fallback is not None
            return self.fallback.was_used(claims)

    def _redis_failed(self, exc: BaseException) -> None:
        """Count a Redis failure; without a fallback, refuse (fail closed).

        Raises:
            TokenRejected: ``replay_check_unavailable`` when there is no fallback.
        """
        if self._on_error is not None:
            self._on_error()
        if self.fallback is None:
            raise TokenRejected(
                "replay_check_unavailable",
                f"cannot check the token against those already used (Redis: {type(exc).__name__}); "
                "retry in a moment",
            ) from None

    async def close(self) -> None:
        await self._redis.aclose()
