"""Signing keys (HS256 secrets named by a key id): what session and application tokens are signed with,
read from ``DUPLEX_TOKEN_KEYS`` or a key file. Apart from ``runtime.frontend.gate.tokens`` so that the
settings
(``runtime.config``) can check them without importing the front end; PyJWT is not needed here.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "MIN_SECRET_BYTES",
    "SigningKey",
    "generate_signing_key",
    "keys_from_mapping",
    "load_key_file",
]

MIN_SECRET_BYTES = 32
"""Shortest signing secret accepted: 256 bits, the HMAC-SHA256 output size (RFC 7518, 3.2). TURN's shared
secret (coturn's ``static-auth-secret``) is held to the same floor."""

_KID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


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
