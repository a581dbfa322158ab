"""The phone carriers' secrets on every node (issue 32, item 3): the stack keys (``twilioAuthToken``,
``plivoAuthToken``, ``telnyxStreamToken``, ``exotelApiKey`` with ``exotelApiToken``) ->
``NodeSecrets.carrier_secrets`` -> ``secrets/runtime.env`` (a single node) or the runtime Secret and the pods'
env (multi-region), with the stream URLs Twilio and Plivo sign; the runtime's settings accept them as they
are rendered; the local node gets stand-ins for its own check. Under the Pulumi mocks of
``tests/pulumi_harness.py``."""

from __future__ import annotations

import base64
import json

import pytest
from pulumi_harness import FAKE_SECRETS, run_stack

from infra.node.bundle.carriers import CARRIER_SECRETS, carrier_credentials, carrier_stream_url
from infra.node.bundle.services import NodeSecrets, secret_files
from infra.node.profile.profiles import PROFILES, get_profile
from infra.stack_config import StackConfigError
from runtime.config import RuntimeConfig

GIVEN = {
    "twilio_auth_token": "f0e1d2c3b4a5968778695a4b3c2d1e0f",
    "plivo_auth_token": "plivo-auth-token-0123456789",
    "telnyx_stream_token": "telnyx-stream-token-0123456789",
    "exotel_api_key": "exotel-key-0123",
    "exotel_api_token": "exotel-token-0123",
}
STACK_KEYS = {
    "twilioAuthToken": GIVEN["twilio_auth_token"],
    "plivoAuthToken": GIVEN["plivo_auth_token"],
    "telnyxStreamToken": GIVEN["telnyx_stream_token"],
    "exotelApiKey": GIVEN["exotel_api_key"],
    "exotelApiToken": GIVEN["exotel_api_token"],
}
BASE = {
    "redis_password": "p" * 16,
    "grafana_admin_password": "g" * 16,
    "token_keys": {"k": "s" * 32},
    "app_token_keys": {"a": "t" * 32},
}
_SETTING_FIELDS = {
    "DUPLEX_TWILIO_AUTH_TOKEN": "twilio_auth_token",
    "DUPLEX_TWILIO_STREAM_URL": "twilio_stream_url",
    "DUPLEX_PLIVO_AUTH_TOKEN": "plivo_auth_token",
    "DUPLEX_PLIVO_STREAM_URL": "plivo_stream_url",
    "DUPLEX_TELNYX_STREAM_TOKEN": "telnyx_stream_token",
    "DUPLEX_EXOTEL_API_KEY": "exotel_api_key",
    "DUPLEX_EXOTEL_API_TOKEN": "exotel_api_token",
}


def _runtime_env(profile_name: str, carriers: dict[str, str] | None = None) -> dict[str, str]:
    profile = PROFILES[profile_name]
    node_secrets = NodeSecrets(**BASE, turn_secret="x" * 32, carrier_secrets=carriers or {})  # type: ignore[arg-type]
    lines = secret_files(profile, node_secrets)["secrets/runtime.env"].decode().splitlines()
    return dict(line.split("=", 1) for line in lines)


def test_every_carriers_secret_and_stream_url_reach_the_runtime_and_it_accepts_them():
    env = _runtime_env("a100-80gb", GIVEN)
    domain = PROFILES["a100-80gb"].domain
    assert env["DUPLEX_TWILIO_AUTH_TOKEN"] == GIVEN["twilio_auth_token"]
    assert env["DUPLEX_TWILIO_STREAM_URL"] == f"wss://{domain}/api/carriers/twilio"
    assert env["DUPLEX_PLIVO_STREAM_URL"] == f"wss://{domain}/api/carriers/plivo"
    assert env["DUPLEX_TELNYX_STREAM_TOKEN"] == GIVEN["telnyx_stream_token"]
    assert (env["DUPLEX_EXOTEL_API_KEY"], env["DUPLEX_EXOTEL_API_TOKEN"]) == (
        GIVEN["exotel_api_key"],
        GIVEN["exotel_api_token"],
    )
    config = RuntimeConfig(**{field: env[setting] for setting, field in _SETTING_FIELDS.items()})
    assert config.twilio_secret() == GIVEN["twilio_auth_token"]
    assert config.plivo_secret() == GIVEN["plivo_auth_token"]
    assert config.telnyx_secret() == GIVEN["telnyx_stream_token"]
    assert config.exotel_secret() == f"{GIVEN['exotel_api_key']}:{GIVEN['exotel_api_token']}"
    without = _runtime_env("a100-80gb")
    assert not set(_SETTING_FIELDS) & set(without)  # every bridge stays off


def test_only_the_carriers_given_are_turned_on():
    env = _runtime_env("a100-80gb", {"plivo_auth_token": GIVEN["plivo_auth_token"]})
    assert {k for k in env if k in _SETTING_FIELDS} == {"DUPLEX_PLIVO_AUTH_TOKEN", "DUPLEX_PLIVO_STREAM_URL"}


def test_the_stream_url_names_a_port_other_than_443_and_an_unknown_carrier_is_refused():
    profile = get_profile("local")
    assert (
        carrier_stream_url(profile, "twilio")
        == f"wss://{profile.domain}:{profile.ports.https}/api/carriers/twilio"
    )
    assert profile.ports.https != 443
    with pytest.raises(ValueError, match="unknown carrier 'vonage'; known: twilio, plivo, telnyx, exotel"):
        carrier_stream_url(profile, "vonage")


@pytest.mark.parametrize("bad", ["short", "has a space in it", 'quo"ted-token-0123', "x" * 257])
def test_a_secret_that_cannot_go_into_an_env_file_is_refused(bad: str):
    with pytest.raises(ValueError, match="plivo_auth_token must be 8 to 256 printable characters"):
        NodeSecrets(**BASE, carrier_secrets={"plivo_auth_token": bad})  # type: ignore[arg-type]


def test_exotels_key_and_token_go_together_and_unknown_names_are_refused():
    with pytest.raises(ValueError, match="exotel_api_key and exotel_api_token go together"):
        NodeSecrets(**BASE, carrier_secrets={"exotel_api_key": GIVEN["exotel_api_key"]})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unknown carrier secrets \['vonage_token'\]"):
        NodeSecrets(**BASE, carrier_secrets={"vonage_token": "x" * 16})  # type: ignore[arg-type]
    with pytest.raises(StackConfigError, match="exotelApiKey and exotelApiToken go together"):
        run_stack("dev", secrets={**FAKE_SECRETS["gce-node"], "exotelApiKey": GIVEN["exotel_api_key"]})


def test_the_local_node_has_stand_ins_for_every_carrier():
    generated = NodeSecrets.generate()
    assert set(generated.carrier_secrets) == set(CARRIER_SECRETS)
    assert set(carrier_credentials(generated.carrier_secrets)) == {"twilio", "plivo", "telnyx", "exotel"}


def test_every_stack_carries_the_given_secrets_and_multi_region_routes_the_bridges():
    onprem = run_stack("scale5-onprem", secrets={**FAKE_SECRETS["onprem-node"], **STACK_KEYS})
    stdin = onprem.named("node-secrets").plain["stdin"]  # "<path> <mode> <base64>" per file
    files = {path: base64.b64decode(data).decode() for path, _, data in map(str.split, stdin.splitlines())}
    runtime_env = files["secrets/runtime.env"].splitlines()
    assert f"DUPLEX_TWILIO_AUTH_TOKEN={GIVEN['twilio_auth_token']}" in runtime_env
    assert f"DUPLEX_EXOTEL_API_TOKEN={GIVEN['exotel_api_token']}" in runtime_env
    assert not any(value in json.dumps(onprem.outputs) for value in GIVEN.values())
    dev = run_stack("dev", secrets={**FAKE_SECRETS["gce-node"], **STACK_KEYS})
    versions = {
        r.name: r.plain["secretData"] for r in dev.of_type("gcp:secretmanager/secretVersion:SecretVersion")
    }
    assert (
        f"DUPLEX_TELNYX_STREAM_TOKEN={GIVEN['telnyx_stream_token']}"
        in versions["secrets-runtime-env-version"].splitlines()
    )
    region = run_stack("multi-region", secrets={**FAKE_SECRETS["multi-region"], **STACK_KEYS})
    secrets = [
        r
        for r in region.of_type("kubernetes:core/v1:Secret")
        if r.plain.get("metadata", {}).get("name") == "duplex-secrets"
    ]
    assert secrets and all(
        r.plain["stringData"][name.replace("_", "-")] == value
        for r in secrets
        for name, value in GIVEN.items()
    )
    assert all(r.is_secret("stringData") for r in secrets)
    deployments = region.of_type("kubernetes:apps/v1:Deployment")
    runtime_envs = [
        {e["name"]: e for e in c.get("env", [])}
        for d in deployments
        for c in d.plain["spec"]["template"]["spec"]["containers"]
        if c["name"] == "runtime"
    ]
    assert runtime_envs and all(
        env["DUPLEX_PLIVO_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "plivo-auth-token"
        and env["DUPLEX_PLIVO_STREAM_URL"]["value"].endswith("/api/carriers/plivo")
        and env["DUPLEX_EXOTEL_API_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "exotel-api-key"
        for env in runtime_envs
    )
    entry = json.dumps([r.plain for r in region.of_type("gcp:compute/uRLMap:URLMap")])
    assert all(f"/api/carriers/{carrier}" in entry for carrier in ("twilio", "plivo", "telnyx", "exotel"))
    assert not any(value in json.dumps(region.outputs) for value in GIVEN.values())
