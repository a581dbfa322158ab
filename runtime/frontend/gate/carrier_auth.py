"""Carriers' request signatures, checked at the upgrade of a media stream (before any work).

Twilio (``X-Twilio-Signature``): base64 of HMAC-SHA1, keyed with the account's auth token, over the full URL
Twilio requested followed by the POST parameters sorted by name (none on a WebSocket upgrade). Twilio's own
``twilio.request_validator.RequestValidator`` (the reference, used by the tests) also accepts the URL with
the scheme's default port added or removed; so does :func:`twilio_signature_valid`. Twilio connects a
``<Stream>`` over ``wss`` only and drops a query string from the stream URL (so tokens and personas travel
as ``<Parameter>`` elements, in the ``start`` message), so the URL signed is the stream URL as configured:
the node does not rebuild it from ``Host`` headers a proxy could rewrite.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from urllib.parse import urlsplit, urlunsplit

__all__ = ["TWILIO_SIGNATURE_HEADER", "twilio_signature", "twilio_signature_valid"]

TWILIO_SIGNATURE_HEADER = "X-Twilio-Signature"

_DEFAULT_PORTS = {"https": 443, "wss": 443, "http": 80, "ws": 80}


def twilio_signature(auth_token: str, url: str, params: dict[str, str] | None = None) -> str:
    """The ``X-Twilio-Signature`` of a request to ``url`` with POST ``params``: base64(HMAC-SHA1(token,
    url + name1 + value1 + ...)), names sorted (Twilio's "Webhooks security" algorithm)."""
    data = url + "".join(name + (params or {})[name] for name in sorted(params or {}))
    digest = hmac.new(auth_token.encode(), data.encode(), hashlib.sha1).digest()
    return base64.b64encode(digest).decode()


def _port_variants(url: str) -> list[str]:
    """``url`` as given, without its default port, and with it (as Twilio's validator tries them)."""
    parts = urlsplit(url)
    default = _DEFAULT_PORTS.get(parts.scheme)
    host = parts.hostname or ""
    variants = [url]
    if default is not None and parts.port in (None, default):
        bare = urlunsplit(parts._replace(netloc=host))
        with_port = urlunsplit(parts._replace(netloc=f"{host}:{default}"))
        variants += [v for v in (bare, with_port) if v not in variants]
    return variants


def twilio_signature_valid(auth_token: str, url: str, signature: str | None) -> bool:
    """Whether ``signature`` (the header's value; None when absent) signs a WebSocket upgrade to ``url``
    with ``auth_token``, compared in constant time."""
    if not signature:
        return False
    return any(
        hmac.compare_digest(twilio_signature(auth_token, candidate).encode(), signature.strip().encode())
        for candidate in _port_variants(url)
    )
