"""What the settings check of the TURN relay before the front end starts: the ``turn:``/``turns:``/``stun:``
URLs (RFC 7064, RFC 7065) and the length of the secret shared with coturn. Apart from
``runtime.frontend.transports.webrtc.turn`` (which mints the credentials) so that ``runtime.config`` imports
nothing of the front end.
"""

from __future__ import annotations

import re

__all__ = ["MIN_SECRET_BYTES", "check_turn_url"]

MIN_SECRET_BYTES = 32
"""Shortest shared secret accepted (bytes): HMAC-SHA1's block is 64 bytes; 32 random bytes is 256 bits."""

_TURN_URL_RE = re.compile(
    r"(?P<scheme>turns?|stun):(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253})(?::(?P<port>[0-9]{1,5}))?"
    r"(?:\?transport=(?P<transport>udp|tcp))?"
)


def check_turn_url(url: str) -> str:
    """``url`` if it is a ``turn:``, ``turns:`` or ``stun:`` URI (RFC 7064/7065) with a valid port.

    Raises:
        ValueError: anything else; the message names the URL and the allowed form.
    """
    match = _TURN_URL_RE.fullmatch(url.strip())
    port = match and match.group("port")
    if match is None or (port is not None and not 1 <= int(port) <= 65535):
        raise ValueError(
            f"{url!r} is not a TURN/STUN URL: use turn:host[:port][?transport=udp|tcp], "
            "turns:host[:port][?transport=tcp] or stun:host[:port]"
        )
    if match.group("scheme") == "stun" and match.group("transport"):
        raise ValueError(f"{url!r}: a stun: URL takes no transport parameter (RFC 7064)")
    return url.strip()
