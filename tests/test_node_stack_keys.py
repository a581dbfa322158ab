"""The single-node stacks' keys for certificates and alert receivers (issue 20, items 7 and 8), run through
the whole program under Pulumi's mocks (``tests/pulumi_harness.py``): ``domain`` + ``acmeEmail`` give the
node an ACME certificate, the alert receivers reach the node's Alertmanager, and their secrets go to
Secret Manager (GCE) or the host's secret files (on-premises), never into a rendered file or an output."""

from __future__ import annotations

import base64
import gzip
import json
import re
import shlex
import subprocess

import pytest
import yaml
from pulumi_harness import FAKE_SECRETS, run_stack, stack_config

from infra.node.bundle.acme import DEPLOY_HOOK, FIRST_SERVICE, FIRST_TIMER, RENEW_SCRIPT, SERVICE, TIMER
from infra.node.bundle.services import OPTIONAL_SECRET_FILES
from infra.node.monitoring.alertmanager import ALERTMANAGER_CONFIG, PAGE_RECEIVER
from infra.stack_config import StackConfigError, parse_stack_config

K = "duplexops:"
INSTANCE = "gcp:compute/instance:Instance"
DOMAIN = "voice.example.com"
ALERT_SECRETS = {"alertEmailPassword": "SmtpPasswordForTests-123", "alertPagerdutyRoutingKey": "R" * 32}
ALERT_KEYS = {
    K + "alertWebhookUrl": "https://hooks.example.com/duplex",
    K + "alertEmailTo": "oncall@example.com",
    K + "alertEmailFrom": "duplex@example.com",
    K + "alertEmailSmarthost": "smtp.example.com:587",
}


def _files(user_data: str) -> dict[str, str]:
    files = {}
    for entry in yaml.safe_load(user_data)["write_files"]:
        content = entry["content"]
        if entry.get("encoding") == "gz+b64":
            content = gzip.decompress(base64.b64decode(content)).decode()
        files[entry["path"]] = content
    return files


def _problems(stack: str, **overrides: object) -> list[str]:
    values, secret_keys = stack_config(stack, overrides=overrides)
    with pytest.raises(StackConfigError) as caught:
        parse_stack_config(values, stack=stack, secret_keys=set(secret_keys))
    return caught.value.problems


def test_keys_give_the_profile_acme_and_receivers() -> None:
    values, secret_keys = stack_config(
        "dev",
        overrides={K + "domain": DOMAIN, K + "acmeEmail": "ops@example.com", **ALERT_KEYS},
        secrets={**FAKE_SECRETS["gce-node"], **ALERT_SECRETS},
    )
    config = parse_stack_config(values, stack="dev", secret_keys=set(secret_keys))
    tls = config.profile.tls
    assert (tls.mode, tls.acme_email, config.profile.domain) == ("acme", "ops@example.com", DOMAIN)
    alerting = config.profile.alerting
    assert (
        alerting.email_password
        and alerting.pagerduty
        and alerting.webhook_url == ALERT_KEYS[K + "alertWebhookUrl"]
    )
    assert config.secrets.alert_pagerduty_routing_key is not None
    # Without a domain: the self-signed certificate, as before.
    values, secret_keys = stack_config("dev")
    assert (
        parse_stack_config(values, stack="dev", secret_keys=set(secret_keys)).profile.tls.mode
        == "self-signed"
    )


def test_bad_certificate_and_receiver_keys_are_refused() -> None:
    [no_domain] = _problems("dev", **{K + "acmeEmail": "ops@example.com"})
    assert no_domain.startswith("duplexops:acmeEmail: an ACME certificate is for the node's DNS name")
    [email] = _problems("dev", **{K + "acmeEmail": "ops", K + "domain": DOMAIN})
    assert email.startswith("duplexops:acmeEmail: 'ops' is not valid; allowed: the ACME account's contact")
    [partial] = _problems("dev", **{K + "alertEmailTo": "a@example.com"})
    assert partial.startswith("duplexops:alertEmailTo: alert receivers rejected: e-mail alerts need")
    [plain] = _problems("dev", **{K + "alertPagerdutyRoutingKey": "R" * 32})
    assert plain.startswith("duplexops:alertPagerdutyRoutingKey: set in plain text")


def test_gce_node_with_a_domain_gets_certbot_and_its_receivers_secrets() -> None:
    """Guards items 7 and 8 on GCE: the user-data runs certbot for the domain (service, timer, deploy
    hook), and the alert receivers' secrets are Secret Manager secrets the VM may read, fetched at boot."""
    run = run_stack(
        "dev",
        overrides={K + "domain": DOMAIN, K + "acmeEmail": "ops@example.com", **ALERT_KEYS},
        secrets={**FAKE_SECRETS["gce-node"], **ALERT_SECRETS},
    )
    user_data = run.one(INSTANCE).plain["metadata"]["user-data"]
    files = _files(user_data)
    for path in (RENEW_SCRIPT, DEPLOY_HOOK, f"/etc/systemd/system/{TIMER}"):
        assert path in files
    assert f"--domain {DOMAIN}" in files[RENEW_SCRIPT] and "--email ops@example.com" in files[RENEW_SCRIPT]
    assert run.outputs["endpoint"] == f"wss://{DOMAIN}/api/chat"

    config = yaml.safe_load(files[f"/etc/duplex/{ALERTMANAGER_CONFIG}"])
    page = next(r for r in config["receivers"] if r["name"] == PAGE_RECEIVER)
    assert page["pagerduty_configs"][0]["routing_key_file"] == "/run/secrets/alert_pagerduty_routing_key"

    versions = {v.name: v for v in run.of_type("gcp:secretmanager/secretVersion:SecretVersion")}
    email = versions["secrets-alert-email-password-version"]
    routing = versions["secrets-alert-pagerduty-routing-key-version"]
    assert email.plain["secretData"] == ALERT_SECRETS["alertEmailPassword"] and email.is_secret("secretData")
    assert routing.plain["secretData"] == ALERT_SECRETS["alertPagerdutyRoutingKey"]
    grants = {g.name for g in run.of_type("gcp:secretmanager/secretIamMember:SecretIamMember")}
    assert {"node-reads-alert-email-password", "node-reads-alert-pagerduty-routing-key"} <= grants
    prepare = files["/usr/local/sbin/duplex-node-prepare"]
    for role, path in OPTIONAL_SECRET_FILES.items():
        assert f"/etc/duplex/{path} 0640" in prepare, role
    for value in ALERT_SECRETS.values():
        assert value not in user_data and value not in json.dumps(run.outputs)


def test_onprem_node_writes_the_receivers_secrets(tmp_path) -> None:  # noqa: ANN001 (pytest's tmp_path)
    """The on-premises host gets the alert secrets as secret files (0640: Alertmanager reads them)."""
    from infra.components.onprem_node import secrets_script

    run = run_stack(
        "scale5-onprem",
        overrides=ALERT_KEYS,
        secrets={**FAKE_SECRETS["onprem-node"], **ALERT_SECRETS},
        build_dir=tmp_path,
    )
    stdin = run.named("node-secrets").plain["stdin"]  # what the secrets step writes on the host
    lines = {line.split(" ")[0]: line.split(" ") for line in stdin.splitlines()}
    email_path = OPTIONAL_SECRET_FILES["alert_email_password"]
    _, mode, data = lines[email_path]
    assert (mode, base64.b64decode(data).decode()) == ("0640", ALERT_SECRETS["alertEmailPassword"])
    assert run.named("node-secrets").is_secret("stdin")
    script = secrets_script("/opt/duplex")
    assert all(path in script for path in OPTIONAL_SECRET_FILES.values())


def test_without_a_domain_up_warns_and_says_how_to_read_the_fingerprint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guards item 7's fallback: without a domain ``up`` says the certificate is self-signed (a warning and
    the ``certificate`` output, with the command that reads the fingerprint the VM publishes)."""
    import pulumi

    warnings: list[str] = []
    monkeypatch.setattr(pulumi.log, "warn", lambda message, *args, **kwargs: warnings.append(message))
    run = run_stack("dev")
    [warning] = [w for w in warnings if "self-signed certificate" in w]
    assert "get-guest-attributes" in warning and "duplex/tls-sha256" in warning
    assert run.outputs["certificate"].startswith("self-signed; its SHA-256 fingerprint: gcloud compute")
    assert run.one(INSTANCE).plain["metadata"]["enable-guest-attributes"] == "TRUE"
    warnings.clear()
    acme = run_stack("dev", overrides={K + "domain": DOMAIN, K + "acmeEmail": "ops@example.com"})
    assert not [w for w in warnings if "self-signed certificate" in w]
    assert acme.outputs["certificate"].endswith(f"for {DOMAIN}, renewed on the VM")


def _acme_files(script: str) -> dict[str, str]:
    """The files ``acme_install_script`` writes: ``printf '%s' <base64> | base64 -d ><path>.tmp``."""
    found = re.findall(r"printf '%s' (\S+) \| base64 -d >(\S+)\.tmp", script)
    return {path: base64.b64decode(data).decode() for data, path in found}


def test_onprem_node_with_a_domain_installs_certbot_renewal(tmp_path) -> None:  # noqa: ANN001
    """Guards item 7 on-premises (acmeEmail was refused: the deploy installed no certbot): with a domain
    and acmeEmail the deploy has an ``acme`` step, right after the GPU check and before compose-up, that
    requires certbot on the host (naming the package), installs infra.node.bundle.acme's renew script, deploy
    hook (nginx reloaded in Compose with SIGHUP), service and timer, and removes them on delete."""
    from infra.components.onprem_node import CERTBOT_PACKAGE

    run = run_stack(
        "scale5-onprem",
        overrides={K + "domain": DOMAIN, K + "acmeEmail": "ops@example.com"},
        build_dir=tmp_path / "build",
    )
    step = run.named("node-acme")
    create, delete = (shlex.split(step.plain[key])[-1] for key in ("create", "delete"))
    assert step.plain["create"].startswith("sudo -n sh -c ")  # onpremUser is not root
    files = _acme_files(create)
    assert set(files) == {
        RENEW_SCRIPT,
        DEPLOY_HOOK,
        f"/etc/systemd/system/{SERVICE}",
        f"/etc/systemd/system/{TIMER}",
        f"/etc/systemd/system/{FIRST_SERVICE}",
        f"/etc/systemd/system/{FIRST_TIMER}",
    }
    assert f"--domain {DOMAIN}" in files[RENEW_SCRIPT] and "--email ops@example.com" in files[RENEW_SCRIPT]
    compose = "docker compose --project-directory /opt/duplex --file /opt/duplex/compose.yaml"
    assert f"{compose} kill --signal HUP nginx" in files[DEPLOY_HOOK]
    assert "/opt/duplex/tls/node.crt" in files[DEPLOY_HOOK]  # where the on-premises nginx reads it
    assert (
        f"systemctl enable --now {TIMER} {FIRST_TIMER}" in create
        and f"systemctl start --no-block {SERVICE}" in create
    )
    assert (
        all(path in delete for path in files) and f"systemctl disable --now {TIMER} {FIRST_TIMER}" in delete
    )
    # Ordered: after the GPU check, before compose-up.
    assert run.named("node-gpu-check").urn in run.ordered_after(step)
    assert step.urn in run.ordered_after(run.named("node-compose-up"))
    assert run.outputs["endpoint"] == f"wss://{DOMAIN}/api/chat"

    # A host without certbot: the step fails before writing anything, naming the package.
    empty = tmp_path / "empty-path"
    empty.mkdir()
    result = subprocess.run(
        ["/bin/sh", "-c", create], env={"PATH": str(empty)}, capture_output=True, text=True, check=False
    )
    assert result.returncode == 1
    assert f"apt-get install {CERTBOT_PACKAGE}" in result.stderr and "certbot not found" in result.stderr

    # Without acmeEmail: no certbot needed, no step.
    plain = run_stack("scale5-onprem", build_dir=tmp_path / "plain")
    assert not [r for r in plain.resources if r.name == "node-acme"]
