"""One list of the runtime's public paths, held in three places (issue 33, "one place, or one test, for the
public paths that ``http.ROUTES``, nginx and the URL map each list"): the runtime's routes
(``runtime.frontend.http.ROUTES``), the node's nginx (``infra.node.bundle.nginx``) and the global entry's URL
map (``infra.components.global_entry.RUNTIME_PATHS``). A route added to the runtime and forgotten in nginx is
served the browser client's 404 on every single node; forgotten in the URL map it is the page's on
multi-region; an internal path (health, readiness, free slots, metrics) forwarded by either is public.

Matching follows each proxy's rules: nginx's ``location = p`` (exact), ``^~ p`` and plain ``p`` (prefix,
the longest wins; regex locations are not used for these paths), and a URL map path rule's trailing ``/*``
(prefix)."""

from __future__ import annotations

import re

import pytest

from infra.components.global_entry import RUNTIME_PATHS
from infra.node.bundle.carriers import CARRIER_PATHS
from infra.node.bundle.nginx import NGINX_CONF, render_nginx
from infra.node.profile.profiles import PROFILES
from runtime.frontend.http import ROUTES

INTERNAL = ("/healthz", "/readyz", "/slotz", "/metrics")
"""Paths for the operator's checks, not callers: the global entry never routes them (its health checks reach
the pods directly). A single node's nginx passes ``/healthz`` and ``/readyz`` (the stack's uptime check,
``infra.components.node_uptime``, asks ``https://<domain>/healthz``) and hides the other two."""
NODE_HIDDEN = ("/slotz", "/metrics")
"""What a single node's nginx answers 404: free slots (the load balancer's business) and the metrics
(Prometheus scrapes the private address)."""
_LOCATION = re.compile(r"^\s*location\s+(=|\^~)?\s*(/[^\s{]*)\s*\{", re.MULTILINE)


def _example(route: str) -> str:
    """A concrete request path for a ``ROUTES`` key (``/x/*`` -> ``/x/example``)."""
    return route[:-1] + "example" if route.endswith("/*") else route


def _public_examples() -> list[str]:
    examples = [_example(p) for p in ROUTES if p not in INTERNAL]
    examples.append("/api/rtc/0123/key")  # http.RTC_RESOURCE: a WebRTC session's resource (DELETE)
    return sorted(examples)


def _nginx_location(conf: str, path: str) -> tuple[str, str]:
    """``(modifier, location)`` nginx picks for ``path``: an exact match, else the longest prefix."""
    locations = _LOCATION.findall(conf)
    exact = [(m, p) for m, p in locations if m == "=" and p == path]
    if exact:
        return exact[0]
    prefixes = [(m, p) for m, p in locations if m != "=" and path.startswith(p)]
    return max(prefixes, key=lambda mp: len(mp[1]))


def _block(conf: str, modifier: str, location: str) -> str:
    """The text of ``location [modifier] location { ... }``, nested blocks included."""
    head = f"location {modifier} {location} {{" if modifier else f"location {location} {{"
    start = conf.index(head) + len(head)
    depth, end = 1, start
    while depth:
        depth += {"{": 1, "}": -1}.get(conf[end], 0)
        end += 1
    return conf[start:end]


def _url_map_matches(path: str) -> bool:
    return any(path == rule or (rule.endswith("/*") and path.startswith(rule[:-1])) for rule in RUNTIME_PATHS)


def _route_matches(rule: str) -> bool:
    """A URL map rule reaches some runtime route (``/api/rtc/*``: the ICE servers and a session's
    resource)."""
    if not rule.endswith("/*"):
        return rule in ROUTES
    return any(p.startswith(rule[:-1]) for p in ROUTES) or rule == "/api/rtc/*"


@pytest.mark.parametrize("profile_name", ["local", "l40s"])
def test_nginx_proxies_every_public_route_and_hides_the_internal_ones(profile_name: str) -> None:
    conf = render_nginx(PROFILES[profile_name])[NGINX_CONF].decode()
    for path in [*_public_examples(), "/healthz", "/readyz"]:
        modifier, location = _nginx_location(conf, path)
        body = _block(conf, modifier, location)
        assert location != "/" and "proxy_pass http://duplex_runtime" in body, f"{path}: not proxied"
    for path in NODE_HIDDEN:
        modifier, location = _nginx_location(conf, path)
        body = _block(conf, modifier, location)
        assert (modifier, location) == ("=", path) and "return 404" in body, path


def test_the_url_map_routes_every_public_route_and_nothing_else() -> None:
    missing = [path for path in _public_examples() if not _url_map_matches(path)]
    assert missing == [], f"public runtime routes the global entry sends to the page: {missing}"
    assert [rule for rule in RUNTIME_PATHS if not _route_matches(rule)] == []
    assert [path for path in INTERNAL if _url_map_matches(path)] == []


def test_the_carriers_paths_infra_names_are_the_runtimes() -> None:
    """``infra.node.bundle.carriers.CARRIER_PATHS`` (written out: the deploy role has no aiohttp) against the
    runtime's dialects, and each one a route of ``ROUTES``."""
    from runtime.frontend.transports.carriers.exotel import ExotelDialect
    from runtime.frontend.transports.carriers.plivo import PlivoDialect
    from runtime.frontend.transports.carriers.telnyx import TelnyxDialect
    from runtime.frontend.transports.carriers.twilio import TwilioDialect

    dialects = (TwilioDialect, PlivoDialect, TelnyxDialect, ExotelDialect)
    assert {d.name: d.path for d in dialects} == CARRIER_PATHS
    assert all(path in ROUTES for path in CARRIER_PATHS.values())
