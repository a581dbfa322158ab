"""The URLs that reach one pod, or one region, again through a multi-region stack's global entry
(docs/deploying.md, "Resume across regions"; docs/protocol.md, "Resume").

A resume must reach the pod whose engine holds the slot; the global entry balances each new connection on
free capacity, so it would land on any pod. The resume metadata therefore names the pod by a path under
``/r/<region>/<pod>/``, which the global URL map sends to that region's resume router (an nginx beside
the runtime, ``infra.k8s.resume_router``), which proxies it to the pod by its DNS name under the runtime's
headless Service. The pod's name in the URL is its IPv4 address with dashes (``10-4-0-12``): the name
CoreDNS answers under a headless Service for each of its endpoints (``<a-b-c-d>.<service>.<ns>.svc``),
and only for them, so the URL cannot aim the router at anything but a runtime pod. Likewise a WebRTC offer
posted to ``/r/<region>/api/rtc`` stays in the region that gave the caller its ICE servers.

Imported by ``runtime.config`` (its checks) and the front end; nothing of the front end here.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

__all__ = [
    "ROUTE_PREFIX",
    "check_public_url",
    "offer_url",
    "pod_label",
    "resume_url",
]

ROUTE_PREFIX = "/r/"
"""The path prefix of every regional route: ``/r/<region>/...`` (the URL map's per-region path rule)."""


def pod_label(pod_ip: str) -> str:
    """The pod's name in a resume URL: its IPv4 address with dashes (``10.4.0.12`` -> ``10-4-0-12``), the
    per-endpoint name a headless Service's DNS answers (CoreDNS ``kubernetes`` plugin, kube-dns alike).

    Raises:
        ValueError: ``pod_ip`` is not an IPv4 address (IPv6 pods are not supported: the router's pattern
            admits the dashed IPv4 form only).
    """
    try:
        address = ipaddress.ip_address(pod_ip.strip())
    except ValueError:
        address = None
    if not isinstance(address, ipaddress.IPv4Address):
        raise ValueError(
            f"DUPLEX_POD_IP must be the pod's IPv4 address (status.podIP), e.g. 10.4.0.12; got {pod_ip!r}"
        )
    return str(address).replace(".", "-")


def check_public_url(url: str) -> str:
    """``url`` without a trailing slash if it is ``https://<host>[:port]`` with no path, query or fragment.

    Raises:
        ValueError: anything else, naming the value and the allowed form.
    """
    parts = urlsplit(url.strip())
    path = parts.path.rstrip("/")
    if parts.scheme not in ("https", "http") or not parts.hostname or path or parts.query or parts.fragment:
        raise ValueError(
            f"DUPLEX_PUBLIC_URL must be https://<domain>[:port] with no path (the stack's public entry); "
            f"got {url!r}"
        )
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as exc:
        raise ValueError(f"DUPLEX_PUBLIC_URL has a bad port: {url!r} ({exc})") from None
    return f"{parts.scheme}://{parts.netloc}"


def resume_url(public_url: str, region: str, pod_ip: str, transport: str) -> str:
    """Where a resume of a session held on this pod goes: ``wss://<domain>/r/<region>/<pod>/api/chat`` for a
    WebSocket session, ``https://<domain>/r/<region>/<pod>/api/rtc`` (the resume's ``POST``) for a WebRTC
    one (``transport``: the transport's name, ``webrtc`` or another). ``http`` public URLs give ``ws``.

    Raises:
        ValueError: a bad ``public_url`` or ``pod_ip`` (see :func:`check_public_url`, :func:`pod_label`).
    """
    base = check_public_url(public_url)
    prefix = f"{ROUTE_PREFIX}{region}/{pod_label(pod_ip)}"
    if transport == "webrtc":
        return f"{base}{prefix}/api/rtc"
    return "ws" + base.removeprefix("http") + f"{prefix}/api/chat"


def offer_url(public_url: str, region: str) -> str:
    """Where a WebRTC caller posts its offer so that it lands in the region that gave it its ICE servers:
    ``https://<domain>/r/<region>/api/rtc``.

    Raises:
        ValueError: a bad ``public_url``.
    """
    return f"{check_public_url(public_url)}{ROUTE_PREFIX}{region}/api/rtc"
