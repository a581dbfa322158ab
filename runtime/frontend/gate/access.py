"""Who may open a session: the caller's address (trusted proxies), the handshake rate limits, the origin,
the session token (signature, persona, replay) and its spending. Transport-neutral: it reads a peer address,
headers and a query, never a socket.

The checks are run, in order and counted once, by ``runtime.frontend.gate.admission`` (``admit``: the
``/api/chat`` upgrade, ``/api/rtc`` and ``/api/admission`` alike); a token is spent by :meth:`Access.spend`,
called once, by the session, when it holds its slot.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping
from urllib.parse import parse_qs

from runtime.config import RuntimeConfig
from runtime.frontend.gate.ratelimit import HandshakeLimiter, RateLimited
from runtime.frontend.gate.replay import MemoryReplayGuard, RedisReplayGuard, ReplayGuard
from runtime.frontend.gate.tokens import (
    SUBPROTOCOL_PREFIX,
    TokenClaims,
    TokenRejected,
    TokenVerifier,
)
from runtime.frontend.gate.verifiers import app_token_verifier, session_token_verifier
from runtime.metrics import RuntimeMetrics

__all__ = ["Access", "RequestView", "bearer_token", "session_token"]

log = logging.getLogger(__name__)


class RequestView:
    """What the access check reads of a request, whatever the transport.

    Args:
        peer: the socket's peer address ("" when unknown).
        headers: name -> values (case-insensitive lookups through :meth:`get` and :meth:`get_all`).
        query: the URL's query string.
    """

    def __init__(self, peer: str, headers: Iterable[tuple[str, str]], query: str) -> None:
        self.peer = peer
        self._headers = [(name.lower(), value) for name, value in headers]
        self.query = query
        self.params: Mapping[str, list[str]] = parse_qs(query)

    def get(self, name: str) -> str | None:
        """The first value of header ``name``, or None."""
        values = self.get_all(name)
        return values[0] if values else None

    def get_all(self, name: str) -> list[str]:
        """Every value of header ``name``."""
        name = name.lower()
        return [value for key, value in self._headers if key == name]

    def param(self, name: str) -> str | None:
        """The first value of query parameter ``name``, or None."""
        values = self.params.get(name)
        return values[0] if values else None


def session_token(request: RequestView) -> str | None:
    """The session token: the ``duplex.token.<jwt>`` subprotocol, else the ``token`` query parameter."""
    for header in request.get_all("Sec-WebSocket-Protocol"):
        for offered in header.split(","):
            offered = offered.strip()
            if offered.startswith(SUBPROTOCOL_PREFIX):
                return offered.removeprefix(SUBPROTOCOL_PREFIX)
    return request.param("token")


def bearer_token(request: RequestView) -> str | None:
    """The token of an ``Authorization: Bearer <jwt>`` header (RFC 6750, 2.1), or None."""
    scheme, _, value = (request.get("Authorization") or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


def _replay_guard(config: RuntimeConfig, metrics: RuntimeMetrics) -> ReplayGuard | None:
    """The replay check that ``DUPLEX_TOKEN_REPLAY_CHECK`` names (None for ``off``)."""
    mode = config.token_replay_check
    if mode == "off":
        return None
    if mode == "memory":
        return MemoryReplayGuard(config.token_leeway_s)
    assert config.redis_url is not None  # check_access_control
    return RedisReplayGuard(
        config.redis_url,
        leeway_s=config.token_leeway_s,
        fallback=MemoryReplayGuard(config.token_leeway_s) if mode == "redis-or-memory" else None,
        on_error=lambda: metrics.redis_errors.labels(op="token_replay_check").inc(),
    )


class Access:
    """The node's access rules (``config``: origins, token mode and keys, replay check, rate limits,
    trusted proxies).

    Args:
        config: the settings.
        metrics: counts Redis errors of the replay check.
    Raises:
        ValueError: token mode without usable keys (``RuntimeConfig.check_access_control``).
    """

    def __init__(self, config: RuntimeConfig, metrics: RuntimeMetrics) -> None:
        self.config = config
        self.verifier: TokenVerifier | None = None
        self.app_verifier: TokenVerifier | None = None  # the sessions API's (gate/app_tokens.py)
        self.replay_guard: ReplayGuard | None = None
        if config.auth_mode == "token":
            config.check_access_control()
            self.verifier = session_token_verifier(config)
            self.app_verifier = app_token_verifier(config)
            self.replay_guard = _replay_guard(config, metrics)
        self.limiter = HandshakeLimiter(
            per_client_rate=config.handshake_rate_per_client,
            per_client_burst=config.handshake_burst_per_client,
            global_rate=config.handshake_rate_global,
            global_burst=config.handshake_burst_global,
        )
        self._trusted_proxies = [ipaddress.ip_network(c, strict=False) for c in config.trusted_proxies]

    async def close(self) -> None:
        if self.replay_guard is not None:
            await self.replay_guard.close()

    # --- the caller's address -------------------------------------------------------------------------

    def client_address(self, request: RequestView) -> str:
        """The caller's address for rate limits, the waiting room and logs: the socket's peer, or, when that
        peer is a trusted proxy (``config.trusted_proxies``: nginx on the node), the ``X-Real-IP`` it set
        when that is an IP address, else the right-most address of ``X-Forwarded-For`` that is not itself a
        trusted proxy. A header that is not an IP address is ignored (the peer is used). With
        ``config.forwarded_by == "google-lb"`` (GKE behind a Google Cloud load balancer, whose front ends are
        the trusted peers): X-Forwarded-For's second-to-last entry, never a header the client could set
        (issue 34, item 9: :func:`_google_lb_client`)."""
        peer = request.peer or "?"
        if not self._trusted(peer):
            return peer
        if self.config.forwarded_by == "google-lb":
            return _google_lb_client(request, peer)
        real_ip = _ip_or_none(request.get("X-Real-IP"))
        if real_ip is not None:
            return real_ip
        forwarded = _forwarded_hops(request)
        for hop in reversed(forwarded):
            ip = _ip_or_none(hop)
            if ip is None:
                return peer  # a forged or broken chain: believe the socket
            if not self._trusted(ip):
                return ip
        return peer

    def _trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self._trusted_proxies)

    def rate_limited(self, request: RequestView) -> RateLimited | None:
        """The handshake rate limits (per client address, then global): None when within them."""
        return self.limiter.check(self.client_address(request))

    # --- the admission check --------------------------------------------------------------------------

    def check_origin(self, origin: str | None) -> None:
        """Raises ``TokenRejected("origin_not_allowed")`` for a browser origin not in the allow-list (None:
        not a browser, not checked)."""
        if origin is not None and not self._origin_allowed(origin):
            raise TokenRejected(
                "origin_not_allowed",
                f"origin {origin!r} may not open sessions on this node (DUPLEX_ALLOWED_ORIGINS)",
            )

    def _origin_allowed(self, origin: str) -> bool:
        allowed = self.config.allowed_origins
        return "*" in allowed or origin.strip().rstrip("/").lower() in allowed

    async def spend(self, claims: TokenClaims | None) -> None:
        """Spend the session's token (single use), when this process spends tokens (Redis, or one process
        with ``memory``); the one place a token is spent in the front end.

        Raises:
            TokenRejected: replayed, or the replay check is unavailable (503).
        """
        if claims is not None and self.replay_guard is not None:
            await self.replay_guard.spend(claims)


def _forwarded_hops(request: RequestView) -> list[str]:
    """Every ``X-Forwarded-For`` entry, left to right, over all the header's lines (RFC 7239's order)."""
    return [hop.strip() for header in request.get_all("X-Forwarded-For") for hop in header.split(",")]


def _google_lb_client(request: RequestView, peer: str) -> str:
    """The client's address as a Google Cloud external Application Load Balancer gives it: the front end
    appends ``<client-ip>,<load-balancer-ip>`` to whatever ``X-Forwarded-For`` the client sent (Google Cloud
    docs, "External Application Load Balancer overview", "X-Forwarded-For header"), so the client's address
    is the second-to-last entry; the entries before it, and ``X-Real-IP``, are the client's own words and are
    never believed. ``peer`` (the front end's address) when the header is missing, has fewer than two
    entries, or that entry is not an IP address."""
    forwarded = _forwarded_hops(request)
    if len(forwarded) < 2:
        return peer
    return _ip_or_none(forwarded[-2]) or peer


def _ip_or_none(value: str | None) -> str | None:
    """``value`` as a normalised IP address, or None when it is not one."""
    if not value:
        return None
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError:
        return None
