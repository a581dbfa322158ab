"""Signing keys (HS256 secrets named by a key id, optionally bound to a tenant): what session tokens
(``DUPLEX_TOKEN_KEYS``) and application tokens (``DUPLEX_APP_TOKEN_KEYS``) are signed with, read from JSON
or a key file. Apart from ``runtime.frontend.gate.tokens`` so that the settings (``runtime.config``) and the
session store can use them without importing the front end; PyJWT is not needed here.

Key JSON: ``{"<kid>": "<secret>"}`` (a key of the default tenant) or ``{"<kid>": {"secret": "<secret>",
"tenant": "<tenant>"}}`` (a key bound to a tenant: it signs that tenant's tokens only, so one application's
key cannot mint another's; docs/protocol.md, "Access control").
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "DEFAULT_TENANT",
    "MIN_SECRET_BYTES",
    "TENANT_RE",
    "TENANT_RULE",
    "check_tenant",
    "key_json",
    "key_tenant",
    "SigningKey",
    "generate_signing_key",
    "keys_from_mapping",
    "load_key_file",
]

MIN_SECRET_BYTES = 32
"""Shortest signing secret accepted: 256 bits, the HMAC-SHA256 output size (RFC 7518, 3.2). TURN's shared
secret (coturn's ``static-auth-secret``) is held to the same floor."""

_KID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
TENANT_RULE = "1-64 characters of a-z 0-9 . _ -, starting with a letter or digit"
"""What a tenant name is (it is compared byte for byte and may go into a Redis key)."""

DEFAULT_TENANT = "default"
"""The tenant of a token without a ``tenant`` claim and of a key bound to none: a deployment with one
application (every deployment before tenants) is this one tenant."""


def check_tenant(tenant: object, *, what: str = "tenant") -> str:
    """``tenant`` when it is a tenant name: 1-64 characters of ``a-z 0-9 . _ -``, starting with a letter or
    digit (it is compared byte for byte and may go into a Redis key).

    Raises:
        ValueError: anything else (names ``what`` and the rule).
    """
    if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
        raise ValueError(f"{what} {tenant!r} is invalid: {TENANT_RULE}")
    return tenant


class SigningKey:
    """One HS256 signing key: its id (the token's ``kid`` header), its secret (bytes; a str is taken as
    UTF-8), hidden from ``repr``, and the tenant it is bound to (None: the default tenant,
    :data:`DEFAULT_TENANT`). A key signs and verifies tokens of its own tenant only.

    Raises:
        ValueError: a kid outside ``[A-Za-z0-9._-]{1,64}``, a secret shorter than 32 bytes, or a bad tenant
            name (:func:`check_tenant`).
    """

    __slots__ = ("kid", "secret", "tenant")

    def __init__(self, kid: str, secret: bytes | str, tenant: str | None = None) -> None:
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
        self.tenant = None if tenant is None else check_tenant(tenant, what=f"signing key {kid!r}: tenant")

    @property
    def signs_for(self) -> str:
        """The tenant whose tokens this key signs: its own, or :data:`DEFAULT_TENANT` when bound to none."""
        return self.tenant or DEFAULT_TENANT

    def __repr__(self) -> str:
        bound = "" if self.tenant is None else f", tenant={self.tenant!r}"
        return f"SigningKey(kid={self.kid!r}{bound})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SigningKey) and (self.kid, self.secret, self.tenant) == (
            other.kid,
            other.secret,
            other.tenant,
        )

    def __hash__(self) -> int:
        return hash((self.kid, self.secret, self.tenant))


def generate_signing_key(kid: str | None = None, tenant: str | None = None) -> SigningKey:
    """A fresh random key: 32 random bytes as 43 URL-safe characters; ``kid`` default ``key-<8 hex>``;
    bound to ``tenant`` when given."""
    return SigningKey(kid or f"key-{secrets.token_hex(4)}", secrets.token_urlsafe(32), tenant)


def key_json(key: SigningKey) -> dict[str, object]:
    """The key as the key file's JSON entry: ``{kid: secret}``, or ``{kid: {"secret", "tenant"}}`` for a key
    bound to a tenant (what :func:`keys_from_mapping` reads back)."""
    secret = key.secret.decode()
    return {key.kid: secret if key.tenant is None else {"secret": secret, "tenant": key.tenant}}


def keys_from_mapping(mapping: Mapping[str, object], *, source: str = "signing keys") -> list[SigningKey]:
    """``{"kid": "secret", ...}`` or ``{"kid": {"secret": "...", "tenant": "..."}, ...}`` (the key file's
    JSON) as keys.

    Raises:
        ValueError: not a non-empty object of strings or ``{secret, tenant}`` objects, or a bad kid, secret
            or tenant (the message names ``source`` and the kid, never a secret).
    """
    if not isinstance(mapping, Mapping) or not mapping:
        raise ValueError(f'{source}: expected a non-empty JSON object {{"<kid>": "<secret>", ...}}')
    keys = []
    for kid, entry in mapping.items():
        tenant = None
        if isinstance(entry, Mapping):
            extra = sorted(set(entry) - {"secret", "tenant"})
            if extra:
                raise ValueError(
                    f"{source}: key {kid!r} has unknown field {extra[0]!r}; allowed: secret, tenant"
                )
            secret, tenant = entry.get("secret"), entry.get("tenant")
        else:
            secret = entry
        if not isinstance(secret, str):
            raise ValueError(f"{source}: the secret of key {kid!r} must be a string")
        try:
            keys.append(SigningKey(kid, secret, tenant))  # type: ignore[arg-type]  # checked by check_tenant
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
    return keys


def load_key_file(path: Path) -> list[SigningKey]:
    """The keys of a key file (JSON as :func:`keys_from_mapping`, e.g. a node's ``secrets/token_keys.json``).

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


def key_tenant(key: SigningKey, tenant: str | None) -> str:
    """The ``tenant`` claim a token signed with ``key`` carries: ``tenant``, or the key's when None.

    Raises:
        ValueError: a bad tenant name, or one that is not the key's (a key signs its own tenant's tokens
            only; an unbound key the default tenant's).
    """
    if tenant is None:
        return key.signs_for
    check_tenant(tenant)
    if tenant != key.signs_for:
        raise ValueError(
            f"key {key.kid!r} signs for tenant {key.signs_for!r} only, not {tenant!r}: use that tenant's key"
        )
    return tenant
