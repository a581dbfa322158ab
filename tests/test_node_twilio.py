"""The Twilio bridge's secret on every node (issue 32, item 3): ``twilioAuthToken`` (every stack) ->
``NodeSecrets.twilio_auth_token`` -> ``secrets/runtime.env`` with the node's stream URL, which the runtime's
settings accept as they are rendered (both or neither); the local node gets a stand-in token for its own
check. Under the Pulumi mocks of ``tests/pulumi_harness.py``."""

from __future__ import annotations

import base64
import json

import pytest
from pulumi_harness import FAKE_SECRETS, run_stack

from infra.node.profile import PROFILES, get_profile
from infra.node.services import NodeSecrets, secret_files, twilio_stream_url
from runtime.config import RuntimeConfig

GIVEN = "f0e1d2c3b4a5968778695a4b3c2d1e0f"
BASE = {
    "redis_password": "p" * 16,
    "grafana_admin_password": "g" * 16,
    "token_keys": {"k": "s" * 32},
    "app_token_keys": {"a": "t" * 32},
}


def _runtime_env(profile_name: str, **secrets: object) -> dict[str, str]:
    profile = PROFILES[profile_name]
    files = secret_files(profile, NodeSecrets(**BASE, turn_secret="x" * 32, **secrets))  # type: ignore[arg-type]
    lines = files["secrets/runtime.env"].decode().splitlines()
    return dict(line.split("=", 1) for line in lines)


def test_the_token_and_the_stream_url_reach_the_runtime_together_and_it_accepts_them():
    env = _runtime_env("a100-80gb", twilio_auth_token=GIVEN)
    profile = PROFILES["a100-80gb"]
    assert env["DUPLEX_TWILIO_AUTH_TOKEN"] == GIVEN
    assert env["DUPLEX_TWILIO_STREAM_URL"] == f"wss://{profile.domain}/api/carriers/twilio"
    config = RuntimeConfig(
        twilio_auth_token=env["DUPLEX_TWILIO_AUTH_TOKEN"], twilio_stream_url=env["DUPLEX_TWILIO_STREAM_URL"]
    )
    assert config.twilio_secret() == GIVEN
    without = _runtime_env("a100-80gb")
    assert not {"DUPLEX_TWILIO_AUTH_TOKEN", "DUPLEX_TWILIO_STREAM_URL"} & set(without)  # the bridge stays off


def test_the_stream_url_names_a_port_other_than_443():
    profile = get_profile("local")
    url = twilio_stream_url(profile)
    assert url == f"wss://{profile.domain}:{profile.ports.https}/api/carriers/twilio"
    assert profile.ports.https != 443


@pytest.mark.parametrize("bad", ["short", "has a space in it", 'quo"ted-token-0123', "x" * 257])
def test_a_token_that_cannot_go_into_an_env_file_is_refused(bad: str):
    with pytest.raises(ValueError, match="twilio_auth_token must be 8 to 256 printable characters"):
        NodeSecrets(**BASE, twilio_auth_token=bad)  # type: ignore[arg-type]


def test_the_local_node_has_a_stand_in_token_for_its_own_check():
    assert NodeSecrets.generate().twilio_auth_token is not None


def test_every_stack_carries_the_given_token_and_multi_region_routes_the_bridge():
    onprem = run_stack("scale5-onprem", secrets={**FAKE_SECRETS["onprem-node"], "twilioAuthToken": GIVEN})
    stdin = onprem.named("node-secrets").plain["stdin"]  # "<path> <mode> <base64>" per file
    files = {path: base64.b64decode(data).decode() for path, _, data in map(str.split, stdin.splitlines())}
    assert f"DUPLEX_TWILIO_AUTH_TOKEN={GIVEN}" in files["secrets/runtime.env"].splitlines()
    assert GIVEN not in json.dumps(onprem.outputs)
    dev = run_stack("dev", secrets={**FAKE_SECRETS["gce-node"], "twilioAuthToken": GIVEN})
    versions = {
        r.name: r.plain["secretData"] for r in dev.of_type("gcp:secretmanager/secretVersion:SecretVersion")
    }
    assert f"DUPLEX_TWILIO_AUTH_TOKEN={GIVEN}" in versions["secrets-runtime-env-version"].splitlines()
    region = run_stack("multi-region", secrets={**FAKE_SECRETS["multi-region"], "twilioAuthToken": GIVEN})
    secrets = [
        r
        for r in region.of_type("kubernetes:core/v1:Secret")
        if r.plain.get("metadata", {}).get("name") == "duplex-secrets"
    ]
    assert secrets and all(r.plain["stringData"]["twilio-auth-token"] == GIVEN for r in secrets)
    assert all(r.is_secret("stringData") for r in secrets)
    deployments = region.of_type("kubernetes:apps/v1:Deployment")
    runtime_env = [
        {e["name"]: e for e in c.get("env", [])}
        for d in deployments
        for c in d.plain["spec"]["template"]["spec"]["containers"]
        if c["name"] == "runtime"
    ]
    assert runtime_env and all(
        env["DUPLEX_TWILIO_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "twilio-auth-token"
        and env["DUPLEX_TWILIO_STREAM_URL"]["value"].endswith("/api/carriers/twilio")
        for env in runtime_env
    )
    entry = region.of_type("gcp:compute/uRLMap:URLMap")
    assert entry and "/api/carriers/twilio" in json.dumps([r.plain for r in entry])
    assert GIVEN not in json.dumps(region.outputs)
