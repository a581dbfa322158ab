"""Carriers' request signatures, checked at the upgrade of a media stream (before any work).

Twilio (``X-Twilio-Signature``): base64 of HMAC-SHA1, keyed with the account's auth token, over the full URL
Twilio requested followed by the POST parameters sorted by name (none on a WebSocket upgrade). Twilio's own
``twilio.request_validator.RequestValidator`` (the reference, used by the tests) also accepts the URL with
the scheme's default port added or removed; so does :func:`twilio_signature_valid`. Twilio connects a
``<Stream>`` over ``wss`` only and drops a query string from the stream URL (so tokens and personas travel
as ``<Parameter>`` elements, in the ``start`` message), so the URL signed is the stream URL as configured:
the node does not rebuild it from ``Host`` headers a proxy could rewrite.

Plivo (``X-Plivo-Signature-V3`` with ``X-Plivo-Signature-V3-Nonce``): Plivo's "Validation" reference (voice
XML, "All requests Plivo makes to your server URLs include X-Plivo-Signature-V3 and
X-Plivo-Signature-V3-Nonce") and its Audio Streaming overview ("Plivo establishes a WebSocket connection to
your specified URL, validating signatures if configured"): base64 of HMAC-SHA256, keyed with the account's
(or subaccount's) auth token, over ``<url>.<nonce>``, where a GET's URL is ``scheme://host/path`` followed
by ``?`` and its query parameters sorted by name (``name=value`` joined by ``&``; none: no ``?``), as the
``plivo`` SDK's ``plivo.utils.signature_v3.validate_v3_signature`` builds it; the header may hold several
signatures separated by commas (one per auth token in rotation). The URL signed is the stream URL as
configured plus the query string the request came with (Plivo keeps a ``<Stream>`` URL's query: the
session token travels there, as ``extraHeaders`` takes only letters and digits).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from urllib.parse import parse_qs, urlsplit, urlunsplit

__all__ = [
    "PLIVO_NONCE_HEADER",
    "PLIVO_SIGNATURE_HEADER",
    "TWILIO_SIGNATURE_HEADER",
    "plivo_signature",
    "plivo_signature_valid",
    "twilio_signature",
    "twilio_signature_valid",
]

TWILIO_SIGNATURE_HEADER = "X-Twilio-Signature"
PLIVO_SIGNATURE_HEADER = "X-Plivo-Signature-V3"
PLIVO_NONCE_HEADER = "X-Plivo-Signature-V3-Nonce"

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


def _plivo_get_url(url: str) -> str:
    """``url`` as Plivo signs a GET to it: without its query, then ``?`` and the query's parameters sorted
    by name (values decoded; a repeated name's values sorted), or no ``?`` when there are none."""
    parts = urlsplit(url)
    base = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    params = parse_qs(parts.query, keep_blank_values=True)
    query = "&".join("&".join(f"{name}={value}" for value in sorted(params[name])) for name in sorted(params))
    return f"{base}?{query}" if query else base


def plivo_signature(auth_token: str, url: str, nonce: str) -> str:
    """The ``X-Plivo-Signature-V3`` of a GET to ``url`` (its query included) with ``nonce``:
    base64(HMAC-SHA256(token, signed_url + "." + nonce)) (the module doc)."""
    message = f"{_plivo_get_url(url)}.{nonce}".encode()
    return base64.b64encode(hmac.new(auth_token.encode(), message, hashlib.sha256).digest()).decode()


def plivo_signature_valid(auth_token: str, url: str, nonce: str | None, signature: str | None) -> bool:
    """Whether one of the comma-separated signatures in ``signature`` (the header; None when absent) signs
    a WebSocket upgrade to ``url`` with ``nonce`` and ``auth_token``, compared in constant time."""
    if not signature or not nonce:
        return False
    expected = plivo_signature(auth_token, url, nonce).encode()
    return any(hmac.compare_digest(expected, given.strip().encode()) for given in signature.split(","))
