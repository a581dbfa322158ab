"""The stacks' TURN relay keys (issue 22, items 4-5): ``turnSecret`` (a given TURN secret used instead of
the generated one on every stack that runs a relay, checked without being shown), under Pulumi's mocks."""

from __future__ import annotations

import base64
import json

import pytest
from pulumi_harness import FAKE_SECRETS, StackRun, run_stack, stack_config

from infra.node.services import NodeSecrets
from infra.stack_config import StackConfigError, parse_stack_config

GIVEN = "GivenTurnSecretSharedWithTheFleet_0123456789-abc"
RANDOM_PASSWORD = "random:index/randomPassword:RandomPassword"
K8S_SECRET = "kubernetes:core/v1:Secret"
TOPOLOGY = {"dev": "gce-node", "scale5-onprem": "onprem-node", "multi-region": "multi-region"}


def _secrets(stack: str, **more: str) -> dict[str, str]:
    return {**FAKE_SECRETS[TOPOLOGY[stack]], **more}


def _problems(stack: str, **secrets: str) -> list[str]:
    values, secret_keys = stack_config(stack, secrets=_secrets(stack, **secrets))
    with pytest.raises(StackConfigError) as caught:
        parse_stack_config(values, stack=stack, secret_keys=set(secret_keys))
    return caught.value.problems


@pytest.mark.parametrize(
    "bad",
    [
        "short_but_valid_alphabet_0123",  # 29 characters
        "has spaces in it and is long enough to pass the length",
        "quote'd-secret-that-is-long-enough-0123456789",
        "hash#secret-that-is-long-enough-0123456789abcd",
        "x" * 257,
    ],
)
def test_a_bad_turn_secret_is_refused_without_being_shown(bad: str) -> None:
    [problem] = _problems("dev", turnSecret=bad)
    assert problem.startswith("duplexops:turnSecret: the value (not shown) is not valid; allowed: 32 to 256")
    assert bad not in problem and bad[:12] not in problem


def test_a_turn_secret_in_plain_text_is_refused() -> None:
    values, secret_keys = stack_config("dev", overrides={"duplexops:turnSecret": GIVEN})
    with pytest.raises(StackConfigError) as caught:
        parse_stack_config(values, stack="dev", secret_keys=set(secret_keys))
    [problem] = caught.value.problems
    assert problem.startswith("duplexops:turnSecret: set in plain text")
    assert "pulumi config set --secret turnSecret" in problem and GIVEN not in problem


def test_what_the_key_accepts_the_node_accepts() -> None:
    """The key's rule is NodeSecrets' (the renderer of turnserver.conf and runtime.env): 32 characters pass
    both, the shortest the key refuses is refused by neither check alone."""
    values, secret_keys = stack_config("dev", secrets=_secrets("dev", turnSecret="a" * 32))
    config = parse_stack_config(values, stack="dev", secret_keys=set(secret_keys))
    assert config.secrets.turn_secret is not None
    NodeSecrets(redis_password="p" * 16, grafana_admin_password="g" * 16, token_keys={"k": "s" * 32},
                turn_secret=config.secrets.turn_secret.get_secret_value())  # fmt: skip


def _turn_passwords(run: StackRun) -> list[str]:
    return [r.name for r in run.of_type(RANDOM_PASSWORD) if r.name.endswith("turn-secret")]


def test_without_the_key_each_stack_generates_its_turn_secret() -> None:
    assert _turn_passwords(run_stack("dev")) == ["secrets-turn-secret"]


def test_gce_node_stores_the_given_secret_for_coturn_and_the_runtime() -> None:
    run = run_stack("dev", secrets=_secrets("dev", turnSecret=GIVEN))
    assert _turn_passwords(run) == []
    versions = {
        r.name: r.plain["secretData"] for r in run.of_type("gcp:secretmanager/secretVersion:SecretVersion")
    }
    assert f"static-auth-secret={GIVEN}" in versions["secrets-turnserver-conf-version"].splitlines()
    assert f"DUPLEX_TURN_SECRET={GIVEN}" in versions["secrets-runtime-env-version"].splitlines()
    for version in run.of_type("gcp:secretmanager/secretVersion:SecretVersion"):
        assert version.is_secret("secretData")
    assert GIVEN not in json.dumps(run.outputs)


def test_onprem_node_writes_the_given_secret_into_its_files() -> None:
    run = run_stack("scale5-onprem", secrets=_secrets("scale5-onprem", turnSecret=GIVEN))
    assert _turn_passwords(run) == []
    stdin = run.named("node-secrets").plain["stdin"]  # "<path> <mode> <base64>" per file
    files = {path: base64.b64decode(data).decode() for path, _, data in map(str.split, stdin.splitlines())}
    assert f"static-auth-secret={GIVEN}" in files["secrets/turnserver.conf"].splitlines()
    assert f"DUPLEX_TURN_SECRET={GIVEN}" in files["secrets/runtime.env"].splitlines()
    assert GIVEN not in json.dumps(run.outputs)


def test_multi_region_gives_every_region_the_given_secret() -> None:
    run = run_stack("multi-region", secrets=_secrets("multi-region", turnSecret=GIVEN))
    assert _turn_passwords(run) == []
    configs = [r for r in run.of_type(K8S_SECRET) if r.name.endswith("-coturn-config")]
    assert len(configs) == 2
    for config in configs:
        assert f"static-auth-secret={GIVEN}" in config.plain["stringData"]["turnserver.conf"].splitlines()
        assert config.is_secret("stringData")
    runtime = [r for r in run.of_type(K8S_SECRET) if r.name.endswith("-duplex-duplex-secrets")]
    assert runtime and all(r.plain["stringData"]["turn-secret"] == GIVEN for r in runtime)
    assert GIVEN not in json.dumps(run.outputs)
