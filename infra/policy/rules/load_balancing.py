"""Rules on the load balancer: backend services (``gcp:compute/backendService:BackendService``) keep
WebSockets open past their timeout and use session affinity only with a hashing locality policy; HTTPS
proxies and their SSL policies refuse TLS before 1.2."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra.policy.rules._common import (
    BACKEND_SERVICE,
    SSL_POLICY,
    TARGET_HTTPS_PROXY,
    _normalize,
    _q,
    is_unknown,
)

# --------------------------------------------------------------------------------------------------------
# Rule 7: HTTP backend services keep WebSockets open
# --------------------------------------------------------------------------------------------------------

MIN_WEBSOCKET_BACKEND_TIMEOUT_S = 600
"""The shortest backend timeout (s) allowed in front of the runtime: a session lasts minutes."""


def backend_timeout_fits_websockets(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """An HTTP(S) backend service (``gcp:compute/backendService:BackendService``, protocol HTTP, HTTPS or
    HTTP2) has ``timeoutSec`` of at least ``MIN_WEBSOCKET_BACKEND_TIMEOUT_S``: for a WebSocket behind a
    Google Application Load Balancer the backend timeout is the longest the connection may live, and the
    default of 30 s cuts every conversation at 30 s.

    A missing ``timeoutSec`` is a violation (the default 30 s); ``protocol`` missing means HTTP (the
    default). Passes when ``protocol`` or ``timeoutSec`` is unknown during preview.
    """
    if resource_type != BACKEND_SERVICE:
        return []
    p = _normalize(props)
    protocol = p.get("protocol")
    if is_unknown(protocol) or (
        protocol is not None and str(protocol).upper() not in ("HTTP", "HTTPS", "HTTP2")
    ):
        return []
    timeout = p.get("timeoutSec")
    if is_unknown(timeout):
        return []
    if (
        isinstance(timeout, (int, float))
        and not isinstance(timeout, bool)
        and timeout >= MIN_WEBSOCKET_BACKEND_TIMEOUT_S
    ):
        return []
    now = "is not set (default 30 s)" if timeout is None else f"is {_q(timeout)} s"
    return [
        f"timeoutSec {now}: the load balancer closes a WebSocket after the backend timeout. Set timeoutSec "
        f"to at least {MIN_WEBSOCKET_BACKEND_TIMEOUT_S} s, and past the longest session (Python: "
        f"timeout_sec=max_session_s + 60)."
    ]


# --------------------------------------------------------------------------------------------------------
# Rule 10: session affinity only with a hashing locality policy
# --------------------------------------------------------------------------------------------------------

HASH_LOCALITY_POLICIES = ("MAGLEV", "WEIGHTED_MAGLEV", "RING_HASH")
"""Locality policies under which a backend service's session affinity takes effect (pulumi-gcp 10.2
``BackendService.locality_lb_policy`` docstring: "If session_affinity is not NONE, and
locality_lb_policy is not set to MAGLEV, WEIGHTED_MAGLEV, or RING_HASH, session affinity settings will not
take effect")."""


def session_affinity_needs_hash_policy(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A backend service that asks for session affinity (``sessionAffinity`` other than NONE) uses a
    locality policy under which it works (``HASH_LOCALITY_POLICIES``); with ROUND_ROBIN or LEAST_REQUEST
    the affinity is silently off. Passes when either value is unknown during preview."""
    if resource_type != BACKEND_SERVICE:
        return []
    p = _normalize(props)
    affinity, policy = p.get("sessionAffinity"), p.get("localityLbPolicy")
    if is_unknown(affinity) or is_unknown(policy) or affinity in (None, "NONE"):
        return []
    if isinstance(policy, str) and policy.upper() in HASH_LOCALITY_POLICIES:
        return []
    now = "is not set (ROUND_ROBIN)" if policy is None else f"is {_q(policy)}"
    return [
        f"sessionAffinity {_q(affinity)} has no effect: localityLbPolicy {now}. Use "
        f"{' or '.join(HASH_LOCALITY_POLICIES)}, or drop the affinity."
    ]


# --------------------------------------------------------------------------------------------------------
# HTTPS proxies refuse TLS before 1.2
# --------------------------------------------------------------------------------------------------------

OLD_TLS_VERSIONS = ("TLS_1_0", "TLS_1_1")
"""``minTlsVersion`` values that let a client in with TLS 1.0 or 1.1 (an SSL policy's default is TLS_1_0)."""


def https_proxy_tls_1_2(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A target HTTPS proxy (``gcp:compute/targetHttpsProxy:TargetHttpsProxy``) names an ``sslPolicy``, and
    an SSL policy (``gcp:compute/sSLPolicy:SSLPolicy``) sets ``minTlsVersion`` TLS_1_2 or later. Without a
    policy the proxy uses Google's default, profile COMPATIBLE from TLS 1.0; a policy without
    ``minTlsVersion`` starts at TLS 1.0 too (cloud.google.com/load-balancing/docs/ssl-policies-concepts).

    Passes when ``sslPolicy`` or ``minTlsVersion`` is unknown during preview.
    """
    p = _normalize(props)
    if resource_type == TARGET_HTTPS_PROXY:
        policy = p.get("sslPolicy")
        if policy is None or policy == "":
            return [
                "target HTTPS proxy without sslPolicy: Google's default policy accepts TLS 1.0 and 1.1. Set "
                'sslPolicy to a compute.SSLPolicy with min_tls_version "TLS_1_2".'
            ]
        return []
    if resource_type == SSL_POLICY:
        version = p.get("minTlsVersion")
        if is_unknown(version):
            return []
        if version is None or version in OLD_TLS_VERSIONS:
            now = "is not set (TLS_1_0)" if version is None else f"is {version}"
            return [
                f'SSL policy minTlsVersion {now}: clients may use TLS 1.0/1.1. Set min_tls_version "TLS_1_2".'
            ]
    return []
