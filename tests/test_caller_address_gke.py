"""Issue 34, item 9: on GKE the caller's address was wrong either way. With the stack's default (loopback
trusted) every caller behind one Google front end was one client (20 of 80 distinct callers refused by the
per-client limit); with the trust list docs/protocol.md advised, a client-sent ``X-Real-IP`` was believed (0
of 500 spoofed handshakes refused). Now the multi-region stack trusts Google's front ends only and takes the
one ``X-Forwarded-For`` entry they append (``DUPLEX_FORWARDED_BY=google-lb``)."""

from __future__ import annotations

from k8s_fixtures import make_workload

from infra.k8s.workload import GOOGLE_FRONT_END_RANGES, runtime_env
from runtime.config import RuntimeConfig
from runtime.frontend.gate.access import Access, RequestView
from runtime.metrics import RuntimeMetrics

FRONT_END = "35.191.7.8"
"""A Google front end's address (in 35.191.0.0/16): the socket peer of every caller on GKE."""


def _gke_access(**overrides: object) -> Access:
    env = {e["name"]: e.get("value") for e in runtime_env(make_workload())}
    settings: dict[str, object] = {
        "trusted_proxies": env["DUPLEX_TRUSTED_PROXIES"],
        "forwarded_by": env["DUPLEX_FORWARDED_BY"],
        "auth_mode": "off",
        "handshake_rate_per_client": 1.0,
        "handshake_burst_per_client": 1,
        "handshake_rate_global": 0.0,
    }
    settings.update(overrides)
    config = RuntimeConfig(host="127.0.0.1", port=0, node_id="n", **settings)  # type: ignore[arg-type]
    return Access(config, RuntimeMetrics())


def _via_front_end(*headers: tuple[str, str], peer: str = FRONT_END) -> RequestView:
    return RequestView(peer, headers, "")


def test_the_stack_trusts_googles_front_ends_and_their_header_only() -> None:
    env = {e["name"]: e.get("value") for e in runtime_env(make_workload())}
    assert env["DUPLEX_TRUSTED_PROXIES"].split(",") == list(GOOGLE_FRONT_END_RANGES)
    assert env["DUPLEX_FORWARDED_BY"] == "google-lb"
    # Its load balancer logs full URLs to Cloud Logging: secrets in URLs are refused (issue 34, item 9).
    assert env["DUPLEX_URL_SECRETS"] == "refuse"
    assert RuntimeConfig(url_secrets=env["DUPLEX_URL_SECRETS"]).url_secrets == "refuse"


def test_distinct_callers_behind_one_front_end_are_distinct_clients() -> None:
    access = _gke_access()
    refused = 0
    for i in range(80):
        caller = f"198.51.100.{i + 1}"
        view = _via_front_end(("X-Forwarded-For", f"{caller},34.120.0.1"))
        assert access.client_address(view) == caller
        refused += access.rate_limited(view) is not None
    assert refused == 0  # one handshake each: none is over its own per-client bucket of 1


def test_a_client_cannot_name_itself() -> None:
    access = _gke_access()
    spoofed = 0
    for i in range(500):
        # The client sends X-Real-IP and its own X-Forwarded-For; the front end appends "<client>,<lb>".
        view = _via_front_end(
            ("X-Real-IP", f"203.0.113.{i % 250 + 1}"),
            ("X-Forwarded-For", f"203.0.113.{i % 250 + 1}, 198.51.100.9,34.120.0.1"),
        )
        assert access.client_address(view) == "198.51.100.9"
        spoofed += access.rate_limited(view) is None
    assert spoofed == 1  # the first handshake of the one real client; the other 499 share its bucket


def test_a_missing_or_broken_header_counts_as_the_front_end() -> None:
    access = _gke_access()
    assert access.client_address(_via_front_end()) == FRONT_END
    assert access.client_address(_via_front_end(("X-Forwarded-For", "34.120.0.1"))) == FRONT_END
    assert access.client_address(_via_front_end(("X-Forwarded-For", "junk,34.120.0.1"))) == FRONT_END


def test_a_peer_outside_the_front_ends_is_itself() -> None:
    access = _gke_access()
    view = _via_front_end(("X-Forwarded-For", "198.51.100.9,34.120.0.1"), peer="10.4.0.7")
    assert access.client_address(view) == "10.4.0.7"


def test_nginx_mode_is_unchanged_behind_the_nodes_nginx() -> None:
    access = _gke_access(trusted_proxies="127.0.0.0/8", forwarded_by="nginx")
    view = _via_front_end(("X-Real-IP", "203.0.113.7"), peer="127.0.0.1")
    assert access.client_address(view) == "203.0.113.7"
