"""The stacks' TURN relay keys (issue 22, items 4-5), under Pulumi's mocks: ``turnSecret`` (a given TURN
secret used instead of the generated one on every stack that runs a relay, checked without being shown),
``dnsZone`` (the stack's A records in Cloud DNS, or the records to make by hand), ``turnTlsSecret`` (TURN
over TLS in the regions)."""

from __future__ import annotations

import base64
import json

import pytest
from pulumi_harness import FAKE_SECRETS, StackRun, run_stack, stack_config

from infra.node.bundle.services import NodeSecrets
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


@pytest.mark.parametrize("value", ["a" * 32, "A-b_9" * 51 + "x", "a" * 31, "a" * 32 + "!", "a" * 257])
def test_what_the_key_accepts_the_node_accepts(value: str) -> None:
    """The key's rule is NodeSecrets' (the renderer of turnserver.conf and runtime.env): a value the key
    accepts renders, one it refuses would have been refused there too (so no bad value gets that far)."""
    values, secret_keys = stack_config("dev", secrets=_secrets("dev", turnSecret=value))
    try:
        parse_stack_config(values, stack="dev", secret_keys=set(secret_keys))
        key_accepts = True
    except StackConfigError:
        key_accepts = False
    try:
        NodeSecrets(
            redis_password="p" * 16,
            grafana_admin_password="g" * 16,
            token_keys={"k": "s" * 32},
            app_token_keys={"a": "t" * 32},
            turn_secret=value,
        )
        node_accepts = True
    except ValueError:
        node_accepts = False
    assert (
        key_accepts
        == node_accepts
        == (32 <= len(value) <= 256 and value.replace("-", "").replace("_", "").isalnum())
    )


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


# --- DNS records (dnsZone) and TURN over TLS in the regions (turnTlsSecret) -----------------------------

RECORD_SET = "gcp:dns/recordSet:RecordSet"
ZONE = "example-com"


def _records(run: StackRun) -> dict[str, tuple[str, list[str], str]]:
    return {
        r.plain["name"]: (r.plain["type"], r.plain["rrdatas"], r.plain["managedZone"])
        for r in run.of_type(RECORD_SET)
    }


def _dns_api(run: StackRun) -> list[str]:
    return [
        r.name
        for r in run.of_type("gcp:projects/service:Service")
        if r.plain["service"] == "dns.googleapis.com"
    ]


def test_multi_region_makes_its_records_in_the_zone() -> None:
    """The global entry's name at its address, each region's TURN name at its reserved TURN address; the DNS
    API enabled first; the policy pack has nothing to say."""
    from pulumi_harness import MOCK_GLOBAL_IP, MOCK_IP

    from infra.policy.rules import check_resources

    run = run_stack("multi-region", overrides={"duplexops:dnsZone": ZONE})
    assert _records(run) == {
        "duplex.example.com.": ("A", [MOCK_GLOBAL_IP], ZONE),
        "turn-us-central1.duplex.example.com.": ("A", [MOCK_IP], ZONE),
        "turn-europe-west4.duplex.example.com.": ("A", [MOCK_IP], ZONE),
    }
    assert all(
        r.plain["ttl"] == 300 and r.plain["project"] == "my-gcp-project" for r in run.of_type(RECORD_SET)
    )
    assert _dns_api(run) == ["api-dns"]
    assert (
        check_resources([(r.type, r.plain, r.name, r.dependencies) for r in run.resources if r.custom]) == []
    )
    assert run.outputs["dns"]["zone"] == ZONE and run.outputs["dns"]["made"].startswith("by the stack")


def test_without_a_zone_the_stack_lists_the_records_to_make() -> None:
    from pulumi_harness import MOCK_GLOBAL_IP, MOCK_IP

    run = run_stack("multi-region")
    assert run.of_type(RECORD_SET) == [] and _dns_api(run) == []
    dns = run.outputs["dns"]
    assert dns["zone"] is None and dns["made"].startswith("by hand")
    assert dns["records"] == {
        "duplex.example.com": MOCK_GLOBAL_IP,
        "turn-europe-west4.duplex.example.com": MOCK_IP,
        "turn-us-central1.duplex.example.com": MOCK_IP,
    }


def test_gce_node_makes_the_record_its_nginx_and_coturn_share() -> None:
    from pulumi_harness import MOCK_IP

    run = run_stack("dev", overrides={"duplexops:dnsZone": ZONE, "duplexops:domain": "dev.example.com"})
    assert _records(run) == {"dev.example.com.": ("A", [MOCK_IP], ZONE)}
    assert _dns_api(run) == ["api-dns"]
    assert run.outputs["turn"]["urls"][0] == "turn:dev.example.com:3478?transport=udp"
    plain = run_stack("dev").outputs["dns"]
    assert plain["zone"] is None and plain["records"] == {} and plain["made"].startswith("by hand")


def test_dns_zone_problems() -> None:
    values, secret_keys = stack_config("dev", overrides={"duplexops:dnsZone": ZONE})
    with pytest.raises(StackConfigError) as caught:
        parse_stack_config(values, stack="dev", secret_keys=set(secret_keys))
    assert caught.value.problems == [
        "duplexops:dnsZone: the stack makes the A record of duplexops:domain in this zone; allowed: set "
        "duplexops:domain too (a name inside the zone), or leave dnsZone unset"
    ]
    values, secret_keys = stack_config("multi-region", overrides={"duplexops:dnsZone": "example.com."})
    with pytest.raises(StackConfigError) as caught:
        parse_stack_config(values, stack="multi-region", secret_keys=set(secret_keys))
    [problem] = caught.value.problems
    assert problem.startswith(
        "duplexops:dnsZone: 'example.com.' is not valid; allowed: the name (not the DNS"
    )


def test_turn_tls_secret_turns_on_turns_in_every_region() -> None:
    from infra.k8s.manifest import to_manifest, validate_manifests

    run = run_stack("multi-region", overrides={"duplexops:turnTlsSecret": "turn-tls"})
    for region in ("us-central1", "europe-west4"):
        turn = run.outputs["regions"][region]["turn"]
        host = f"turn-{region}.duplex.example.com"
        assert turn["tls"] is True
        assert turn["urls"] == [f"turn:{host}:3478?transport=udp", f"turns:{host}:5349?transport=tcp"]
        manifests = [
            to_manifest(r.type, r.plain)
            for r in run.resources
            if r.type.startswith("kubernetes:") and r.custom and r.name.startswith(f"runtime-{region}-")
        ]
        assert validate_manifests(manifests) == []
        services = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Service"}
        assert (
            services["coturn-tls"]["spec"]["loadBalancerIP"] == services["coturn"]["spec"]["loadBalancerIP"]
        )


def test_the_turn_tls_secret_is_read_before_coturn_and_after_its_namespace() -> None:
    """Issue 33 (latent): the TLS Secret is made outside the stack (cert-manager, or by hand), and coturn's
    pods mount it: the stack reads it first, so a missing one fails the update (or a preview of a running
    cluster) naming it, before coturn is touched, not pods stuck until the rollout's timeout."""
    run = run_stack("multi-region", overrides={"duplexops:turnTlsSecret": "turn-tls"})
    for region in ("us-central1", "europe-west4"):
        prefix = f"runtime-{region}"
        read = run.named(f"{prefix}-requires-secret-duplex-turn-tls")
        assert read.type == "kubernetes:core/v1:Secret" and not read.custom  # a read, not a declaration
        coturn = run.named(f"{prefix}-deployment-duplex-coturn")
        assert read.urn in run.ordered_after(coturn)
        namespace = run.named(f"{prefix}-namespace-cluster-duplex")
        assert namespace.urn in run.ordered_after(read)
    # Without the key nothing is read (every other Secret the pods mount is the stack's own).
    plain_run = run_stack("multi-region")
    assert not [r for r in plain_run.resources if "-requires-secret-" in r.name]


def test_external_secrets_are_the_mounted_ones_not_declared() -> None:
    from infra.components.regional_runtime import external_secrets

    def pod(kind: str, *volumes: dict) -> dict:
        return {
            "kind": kind,
            "metadata": {"name": "p", "namespace": "duplex"},
            "spec": {"template": {"spec": {"containers": [], "volumes": list(volumes)}}},
        }

    objects = [
        {"kind": "Secret", "metadata": {"name": "ours", "namespace": "duplex"}},
        pod("Deployment", {"name": "a", "secret": {"secretName": "ours"}}),
        pod("Deployment", {"name": "b", "secret": {"secretName": "theirs"}}),
        pod("Job", {"name": "c", "secret": {"secretName": "maybe", "optional": True}}),
        pod("StatefulSet", {"name": "d", "emptyDir": {}}),
    ]
    assert external_secrets(objects) == [("duplex", "theirs")]


def test_a_bad_turn_tls_secret_name_is_refused() -> None:
    values, secret_keys = stack_config("multi-region", overrides={"duplexops:turnTlsSecret": "Turn_TLS"})
    with pytest.raises(StackConfigError) as caught:
        parse_stack_config(values, stack="multi-region", secret_keys=set(secret_keys))
    [problem] = caught.value.problems
    assert problem.startswith(
        "duplexops:turnTlsSecret: 'Turn_TLS' is not valid; allowed: the name of a kubernetes.io/tls Secret"
    )


# --- rotation: turnSecretPrevious -------------------------------------------------------------------------

OLD = "OldTurnSecretBeingRotatedOut_0123456789-abcdefgh"


def test_during_a_rotation_coturn_accepts_both_and_the_runtime_mints_with_the_new() -> None:
    run = run_stack(
        "multi-region", secrets=_secrets("multi-region", turnSecret=GIVEN, turnSecretPrevious=OLD)
    )
    for config in [r for r in run.of_type(K8S_SECRET) if r.name.endswith("-coturn-config")]:
        lines = config.plain["stringData"]["turnserver.conf"].splitlines()
        assert [line for line in lines if line.startswith("static-auth-secret=")] == [
            f"static-auth-secret={GIVEN}",
            f"static-auth-secret={OLD}",
        ]
    for runtime in [r for r in run.of_type(K8S_SECRET) if r.name.endswith("-duplex-duplex-secrets")]:
        assert runtime.plain["stringData"]["turn-secret"] == GIVEN
    run = run_stack("dev", secrets=_secrets("dev", turnSecret=GIVEN, turnSecretPrevious=OLD))
    versions = {
        r.name: r.plain["secretData"] for r in run.of_type("gcp:secretmanager/secretVersion:SecretVersion")
    }
    assert f"static-auth-secret={OLD}" in versions["secrets-turnserver-conf-version"].splitlines()
    assert OLD not in versions["secrets-runtime-env-version"]
    assert OLD not in json.dumps(run.outputs)


@pytest.mark.parametrize(
    ("secrets", "expected"),
    [
        ({"turnSecretPrevious": OLD}, "duplexops:turnSecretPrevious: set without duplexops:turnSecret"),
        (
            {"turnSecret": GIVEN, "turnSecretPrevious": GIVEN},
            "duplexops:turnSecretPrevious: the same value (not shown) as turnSecret",
        ),
        (
            {"turnSecret": GIVEN, "turnSecretPrevious": "short"},
            "duplexops:turnSecretPrevious: the value (not",
        ),
    ],
)
def test_rotation_problems(secrets: dict[str, str], expected: str) -> None:
    [problem] = _problems("multi-region", **secrets)
    assert problem.startswith(expected)
    assert GIVEN not in problem and OLD not in problem
