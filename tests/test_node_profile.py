"""Node profiles: the built-ins, the capacity planner's say on sessions, and the errors for bad fields."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from infra.capacity import max_sessions
from infra.node.bundle.services import NodeSecrets, endpoint, runtime_settings, secret_files, services_of
from infra.node.profile.profiles import PROFILES, get_profile


def test_builtin_profiles_are_the_four_the_stacks_use() -> None:
    assert set(PROFILES) == {"local", "l40s", "a100-80gb", "t4-int8"}
    assert PROFILES["local"].gpu is None and PROFILES["local"].model == "tiny"
    assert PROFILES["local"].deployment == "processes"
    assert PROFILES["local"].public_address == "127.0.0.1"
    assert PROFILES["l40s"].sessions == PROFILES["a100-80gb"].sessions == 5
    assert PROFILES["t4-int8"].precision == "int8" and PROFILES["t4-int8"].gpu == "t4"
    assert PROFILES["t4-int8"].runtime_quantize == "int8" and PROFILES["t4-int8"].runtime_dtype == "float16"
    assert PROFILES["a100-80gb"].runtime_quantize == "none"


def test_t4_sessions_come_from_the_capacity_planner() -> None:
    assert PROFILES["t4-int8"].sessions == max_sessions("personaplex-7b", "t4", "int8") >= 1


def test_sessions_beyond_capacity_are_refused_with_the_planners_figure() -> None:
    allowed = max_sessions("personaplex-7b", "a100-80gb-sxm", "bf16")
    with pytest.raises(ValidationError) as err:
        get_profile("a100-80gb", max_sessions=allowed + 1)
    message = str(err.value)
    assert f"max_sessions={allowed + 1}" in message and f"allows at most {allowed}" in message


@pytest.mark.parametrize(
    ("overrides", "field", "allowed"),
    [
        ({"gpu": "x100"}, "gpu", "a100-80gb-pcie"),
        ({"model": "gpt-5"}, "model", "personaplex-7b"),
        ({"precision": "int3"}, "precision", "'int8'"),
        ({"name": "Local_1"}, "name", "lower case"),
        ({"domain": "bad domain"}, "domain", "DNS name"),
        ({"private_address": "8.8.8.8"}, "private_address", "never listen on a public address"),
        ({"public_address": "localhost"}, "public_address", "is not an IP address"),
        ({"data_dir": "relative/dir"}, "data_dir", "absolute path"),
        ({"ports": {"https": 8443, "http": 8443}}, "ports", "each needs its own"),
        ({"limits": {"first_audio_p99_target_ms": 100}}, "first_audio_p99_target_ms", "greater than 160"),
        ({"unknown_field": 1}, "unknown_field", "Extra inputs are not permitted"),
    ],
)
def test_invalid_fields_name_the_field_and_what_is_allowed(overrides: dict, field: str, allowed: str) -> None:
    with pytest.raises(ValidationError) as err:
        get_profile("local", **overrides)
    message = str(err.value)
    assert field in message and allowed in message, message


def test_int8_on_a_cpu_node_is_refused() -> None:
    with pytest.raises(ValidationError, match="needs a GPU"):
        get_profile("local", precision="int8")


def test_unknown_profile_lists_the_allowed_names() -> None:
    with pytest.raises(KeyError, match="allowed: local, l40s, a100-80gb, t4-int8"):
        get_profile("h100-huge")


def test_endpoints_follow_the_deployment() -> None:
    local, gpu = PROFILES["local"], PROFILES["l40s"]
    assert endpoint(local, "runtime") == f"127.0.0.1:{local.ports.runtime}"
    assert endpoint(gpu, "runtime") == "runtime:8998"
    assert "dcgm-exporter" not in services_of(local) and "dcgm-exporter" in services_of(gpu)
    with pytest.raises(ValueError, match="no GPU"):
        endpoint(local, "dcgm-exporter")


def test_runtime_settings_are_valid_runtime_config() -> None:
    from runtime.config import RuntimeConfig

    for profile in PROFILES.values():
        config = RuntimeConfig(
            **{k.removeprefix("DUPLEX_").lower(): v for k, v in runtime_settings(profile).items()}
        )
        assert config.max_sessions == profile.sessions
        assert config.model == profile.model
        assert config.device == profile.device


def test_secrets_are_random_hidden_and_land_only_in_secret_files() -> None:
    a, b = NodeSecrets.generate(), NodeSecrets.generate()
    assert a.redis_password != b.redis_password
    assert a.redis_password not in repr(a)
    files = secret_files(PROFILES["local"], a)
    assert all(path.startswith("secrets/") for path in files)
    users = files["secrets/redis-auth.conf"].decode()
    assert "requirepass" not in users and "user default off " in users
    assert f"user admin on >{a.redis_password} ~* &* +@all\n" in users
    with pytest.raises(ValueError, match="at least 16 characters"):
        NodeSecrets(redis_password="short", grafana_admin_password="x" * 20)
    with pytest.raises(ValueError, match="no spaces"):
        NodeSecrets(redis_password="has:colon-in-it-123", grafana_admin_password="x" * 20)
