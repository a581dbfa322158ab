"""The relay's settings and figures (``infra.node.profile.relay``) and what the node's renderers make of them
(``infra.node.bundle.coturn``, ``services``, ``compose``): pure, no coturn running (``test_node_coturn.py``
runs it)."""

from __future__ import annotations

import pydantic
import pytest
import yaml

from infra.node.bundle.compose import COMPOSE_FILE, render_compose
from infra.node.bundle.coturn import peer_ranges, render_turnserver_conf
from infra.node.bundle.services import SECRET_FILES, NodeSecrets, runtime_settings, secret_files, services_of
from infra.node.profile.profiles import PROFILES, get_profile
from infra.node.profile.relay import (
    ALLOCATIONS_PER_SESSION,
    RelaySettings,
    media_firewall_allows,
    relay_port_range,
    relay_quota,
    turn_urls,
)

SECRET = "x" * 40


@pytest.mark.parametrize(("sessions", "ports"), [(1, 32), (4, 32), (5, 40), (12, 96), (256, 2048)])
def test_relay_range_is_two_allocations_rounds_per_session(sessions: int, ports: int) -> None:
    low, high = relay_port_range(RelaySettings(), sessions)
    assert (low, high - low + 1) == (61000, ports)
    assert relay_quota(sessions) == (ALLOCATIONS_PER_SESSION, ports)  # coturn's user- and total-quota


def test_bad_relay_settings_are_refused_with_the_reason() -> None:
    with pytest.raises(pydantic.ValidationError, match="ephemeral port range"):
        RelaySettings(relay_min_port=50000)
    with pytest.raises(pydantic.ValidationError, match="each needs its own"):
        RelaySettings(port=5349)
    with pytest.raises(pydantic.ValidationError, match="every address"):
        RelaySettings(peer_networks=("0.0.0.0/0",))
    with pytest.raises(pydantic.ValidationError, match="not an address"):
        RelaySettings(peer_networks=("runtime",))
    with pytest.raises(pydantic.ValidationError, match="private IPv4 network of /26"):
        RelaySettings(compose_subnet="172.31.254.0/28")
    with pytest.raises(pydantic.ValidationError, match="private IPv4"):
        RelaySettings(compose_subnet="8.8.8.0/24")
    with pytest.raises(ValueError, match="passes 65535"):
        relay_port_range(RelaySettings(relay_min_port=65000), 256)
    with pytest.raises(pydantic.ValidationError, match="relay.tls_port 8443 is also ports.https"):
        get_profile("local", relay={"tls_port": 8443})


def test_runtime_address_and_docker_range_split_the_subnet() -> None:
    relay = RelaySettings(compose_subnet="10.200.0.0/24")
    assert relay.runtime_address == "10.200.0.10"
    assert relay.dynamic_range == "10.200.0.128/25"


def test_urls_and_firewall_name_only_the_two_listeners() -> None:
    relay = RelaySettings()
    assert turn_urls(relay, "voice.example.com") == [
        "turn:voice.example.com:3478?transport=udp",
        "turns:voice.example.com:5349?transport=tcp",
    ]
    assert media_firewall_allows(relay) == [
        {"protocol": "udp", "ports": ["3478"]},
        {"protocol": "tcp", "ports": ["5349"]},
    ]
    assert media_firewall_allows(RelaySettings(enabled=False)) == []


def test_compose_node_relays_to_the_runtime_address_only() -> None:
    profile = PROFILES["l40s"]
    assert peer_ranges(profile) == [profile.relay.runtime_address]
    conf = render_turnserver_conf(profile, SECRET).splitlines()
    assert [line for line in conf if "peer-ip" in line] == [
        "denied-peer-ip=0.0.0.0-255.255.255.255",
        "denied-peer-ip=::-ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        f"allowed-peer-ip={profile.relay.runtime_address}",
    ]
    assert f"cert={profile.tls.certificate_path}" in conf and f"pkey={profile.tls.private_key_path}" in conf
    assert {"prometheus", "no-cli", "use-auth-secret", f"static-auth-secret={SECRET}"} <= set(conf)
    assert not [line for line in conf if line.startswith(("listening-ip", "external-ip", "relay-ip"))]
    # The local node: loopback listener, no exporter (Debian's coturn has none), peers filled in at start.
    local = render_turnserver_conf(get_profile("local"), SECRET).splitlines()
    assert "listening-ip=127.0.0.1" in local and "prometheus" not in local
    assert not [line for line in local if line.startswith("allowed-peer-ip")]


@pytest.mark.parametrize("secret", ["short", "x" * 31, "x" * 40 + " y", "x" * 40 + "#"])
def test_secret_unfit_for_the_configuration_is_refused(secret: str) -> None:
    with pytest.raises(ValueError, match="TURN secret"):
        render_turnserver_conf(PROFILES["l40s"], secret)


def test_runtime_gets_the_urls_and_the_secret_coturn_gets() -> None:
    profile = PROFILES["l40s"]
    settings = runtime_settings(profile)
    assert settings["DUPLEX_TURN_URLS"] == ",".join(turn_urls(profile.relay, profile.domain))
    assert settings["DUPLEX_TURN_TTL_S"] == "3600"
    assert "DUPLEX_TURN_SECRET" not in settings  # secret: in secrets/runtime.env only
    base = {
        "redis_password": "r" * 20,
        "grafana_admin_password": "g" * 20,
        "token_keys": {"k": "s" * 43},
        "app_token_keys": {"a": "t" * 43},
    }
    files = secret_files(profile, NodeSecrets(**base, turn_secret=SECRET))
    assert f"DUPLEX_TURN_SECRET={SECRET}\n" in files[SECRET_FILES["runtime_env"]].decode()
    assert f"\nstatic-auth-secret={SECRET}\n" in files[SECRET_FILES["turnserver_conf"]].decode()
    with pytest.raises(ValueError, match="no TURN secret"):
        secret_files(profile, NodeSecrets(**base))
    with pytest.raises(ValueError, match="turn_secret must be"):
        NodeSecrets(**base, turn_secret="has spaces in it and is long enough....")
    # The local node names its loopback address (whatever localhost resolves to first).
    assert runtime_settings(get_profile("local"))["DUPLEX_TURN_URLS"].startswith("turn:127.0.0.1:3478")


def test_relay_off_means_no_coturn_anywhere() -> None:
    profile = get_profile("l40s", relay={"enabled": False})
    assert "coturn" not in services_of(profile)
    assert not [name for name in runtime_settings(profile) if name.startswith("DUPLEX_TURN")]
    compose = yaml.safe_load(render_compose(profile)[COMPOSE_FILE])
    assert "coturn" not in compose["services"]
    base = {
        "redis_password": "r" * 20,
        "grafana_admin_password": "g" * 20,
        "token_keys": {"k": "s" * 43},
        "app_token_keys": {"a": "t" * 43},
    }
    files = secret_files(profile, NodeSecrets(**base))
    assert files[SECRET_FILES["turnserver_conf"]].startswith(b"# relay.enabled is false")
    assert b"DUPLEX_TURN_SECRET" not in files[SECRET_FILES["runtime_env"]]
