"""Real certificates on a node (issue 20, item 7): ACME HTTP-01 through the node's own nginx, tested offline
against Pebble, Let's Encrypt's test ACME server (Debian ``pebble``).

The end-to-end test renders a node whose profile says ``tls.mode: acme``, starts the rendered nginx with
the self-signed certificate a node starts with, starts Pebble (its HTTP-01 validation port is the node's
plain HTTP port; ``pebble-challtestsrv`` answers its DNS queries for the node's name with 127.0.0.1, so no
/etc/hosts entry is needed), runs the rendered certbot command with the rendered deploy hook, and reads
the certificate nginx then serves: issued by Pebble's intermediate, the serial of certbot's certificate,
and verifiable for the node's name against Pebble's root.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from infra.node.bundle.acme import (
    ACME_CHALLENGE_PREFIX,
    CERT_NAME,
    DEPLOY_HOOK,
    FIRST_TIMER,
    RENEW_SCRIPT,
    SERVICE,
    TIMER,
    acme_dirs,
    certbot_command,
    deploy_hook_script,
    render_acme_host_files,
)
from infra.node.bundle.cloud_init import USER_DATA_FILE
from infra.node.bundle.compose import COMPOSE_FILE
from infra.node.bundle.nginx import NGINX_CONF
from infra.node.bundle.render import render_bundle, write_bundle
from infra.node.bundle.tls import write_self_signed_certificate
from infra.node.local.node import free_port_profile, nginx_global_directives
from infra.node.profile.profiles import LETSENCRYPT_DIRECTORY, NodeProfile, get_profile
from runtime.tools.local_redis import free_loopback_port

DOMAIN = "node.duplex.test"
EMAIL = "ops@duplex.test"
WAIT_S = 60.0


def _acme_profile(**overrides: object) -> NodeProfile:
    fields: dict[str, object] = {
        "domain": "voice.example.com",
        "tls": {"mode": "acme", "acme_email": "ops@example.com"},
    }
    return get_profile("a100-80gb", **(fields | overrides))


# --- the profile and the rendered parts -------------------------------------------------------------------


def test_acme_needs_an_email_and_a_public_name() -> None:
    """A profile cannot ask for ACME without a contact address or with a name no CA can validate."""
    with pytest.raises(ValueError, match="acme_email"):
        get_profile("a100-80gb", domain="voice.example.com", tls={"mode": "acme"})
    with pytest.raises(ValueError, match="public DNS name"):
        get_profile("a100-80gb", domain="localhost", tls={"mode": "acme", "acme_email": "ops@example.com"})
    with pytest.raises(ValueError, match="not an e-mail address"):
        _acme_profile(tls={"mode": "acme", "acme_email": "ops"})
    with pytest.raises(ValueError, match="https:// URL"):
        _acme_profile(tls={"mode": "acme", "acme_email": "a@example.com", "acme_directory": "http://x/dir"})
    assert _acme_profile().tls.acme_directory == LETSENCRYPT_DIRECTORY
    with pytest.raises(ValueError, match="certbot runs only for 'acme'"):
        certbot_command(get_profile("a100-80gb"), acme_dirs(get_profile("a100-80gb")), deploy_hook="true")


def test_nginx_answers_challenges_on_plain_http_and_redirects_the_rest() -> None:
    """The HTTP server serves the ACME webroot before its catch-all 301 (the CA fetches over plain HTTP)."""
    conf = render_bundle(_acme_profile())[NGINX_CONF].decode()
    http_server = conf.split("server {")[1]
    assert f"location ^~ {ACME_CHALLENGE_PREFIX} {{" in http_server
    assert http_server.index(ACME_CHALLENGE_PREFIX) < http_server.index("return 301")
    assert "root /var/www/acme;" in http_server
    nginx = yaml.safe_load(render_bundle(_acme_profile())[COMPOSE_FILE])["services"]["nginx"]
    assert f"{acme_dirs(_acme_profile()).webroot}:/var/www/acme:ro" in nginx["volumes"]


def test_cloud_init_installs_certbot_its_service_and_timer() -> None:
    """The GCE user-data carries the renew script, the deploy hook, the service and the timer, enables the
    timer, installs certbot, and starts the service once the node unit is up."""
    document = yaml.safe_load(render_bundle(_acme_profile())[USER_DATA_FILE])
    written = {entry["path"]: entry for entry in document["write_files"]}
    for path in (RENEW_SCRIPT, DEPLOY_HOOK, f"/etc/systemd/system/{SERVICE}", f"/etc/systemd/system/{TIMER}"):
        assert path in written, path
    assert written[RENEW_SCRIPT]["permissions"] == "0755"
    assert "certbot certonly" in written[RENEW_SCRIPT]["content"]
    assert "--keep-until-expiring" in written[RENEW_SCRIPT]["content"]
    assert "OnCalendar=*-*-* 00,12:00:00" in written[f"/etc/systemd/system/{TIMER}"]["content"]
    commands = [" ".join(c) for c in document["runcmd"]]
    assert any("apt-get -o DPkg::Lock::Timeout=600 install -y -q certbot" in c for c in commands)
    assert f"systemctl enable --now {TIMER} {FIRST_TIMER}" in commands
    unit = written["/etc/systemd/system/duplex-node.service"]["content"]
    assert f"ExecStartPost=-/bin/systemctl start --no-block {SERVICE}" in unit
    self_signed = yaml.safe_load(render_bundle(get_profile("a100-80gb"))[USER_DATA_FILE])
    assert RENEW_SCRIPT not in {entry["path"] for entry in self_signed["write_files"]}


def test_acme_host_files_only_for_compose_nodes() -> None:
    with pytest.raises(ValueError, match="compose nodes"):
        render_acme_host_files(_local_acme_profile(), reload_command="true")
    with pytest.raises(ValueError, match="absolute"):
        deploy_hook_script("tls/node.crt", "/k", "true")


# --- end to end against Pebble ----------------------------------------------------------------------------


def _local_acme_profile(directory: str = "https://127.0.0.1:14000/dir") -> NodeProfile:
    return free_port_profile(
        domain=DOMAIN,
        tls={
            "mode": "acme",
            "acme_email": EMAIL,
            "acme_directory": directory,
            "certificate_path": "tls/node.crt",
            "private_key_path": "tls/node.key",
        },
    )


def _wait(what: str, ready: object, procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():  # type: ignore[operator]
        for proc, log in zip(procs, logs, strict=True):
            if proc.poll() is not None:
                raise AssertionError(f"{what}: {proc.args[0]} exited {proc.returncode}: {log.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {WAIT_S} s: " + " | ".join(p.read_text() for p in logs))
        time.sleep(0.1)


def _served_certificate(port: int) -> x509.Certificate:
    """The leaf certificate nginx presents for ``DOMAIN`` (SNI), read without verifying it."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
        context.wrap_socket(sock, server_hostname=DOMAIN) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def _common_name(name: x509.Name) -> str:
    return str(name.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


def test_certbot_gets_a_pebble_certificate_through_the_rendered_nginx(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    """Guards item 7 (single-node stacks could only serve a self-signed certificate): the rendered nginx
    starts on its self-signed certificate, answers Pebble's HTTP-01 validation on its plain HTTP port, and
    after the rendered certbot command and deploy hook serves the certificate Pebble issued (its issuer,
    its serial), which a client trusting Pebble's root verifies for the node's name."""
    acme_port, management_port, dns_port, pebble_tls_port = (free_loopback_port() for _ in range(4))
    profile = _local_acme_profile(f"https://127.0.0.1:{acme_port}/dir")
    node_dir = tmp_path / "node"
    for sub in ("logs", "run", "tls"):
        (node_dir / sub).mkdir(parents=True)
    write_bundle(render_bundle(profile), node_dir)
    crt, key = node_dir / profile.tls.certificate_path, node_dir / profile.tls.private_key_path
    write_self_signed_certificate(crt, key, domain=DOMAIN)  # what a node serves until the first issuance

    nginx_argv = ["nginx", "-p", f"{node_dir}/", "-c", NGINX_CONF, "-e", "logs/error.log"]
    nginx_log = node_dir / "logs" / "nginx.stdout"
    with open(nginx_log, "wb") as out:
        started.append(
            subprocess.Popen([*nginx_argv, "-g", nginx_global_directives(node_dir)], stdout=out, stderr=out)
        )
    _wait("nginx", lambda: _listening(profile.ports.https), started[-1:], [nginx_log])
    before = _served_certificate(profile.ports.https)
    assert before.issuer == before.subject  # self-signed

    # Pebble with its own TLS certificate; its VA validates HTTP-01 on the node's plain HTTP port and
    # resolves names through pebble-challtestsrv's DNS stub (every A query: 127.0.0.1).
    pebble_dir = tmp_path / "pebble"
    pebble_dir.mkdir()
    write_self_signed_certificate(pebble_dir / "pebble.crt", pebble_dir / "pebble.key", domain="localhost")
    config = {
        "pebble": {
            "listenAddress": f"127.0.0.1:{acme_port}",
            "managementListenAddress": f"127.0.0.1:{management_port}",
            "certificate": str(pebble_dir / "pebble.crt"),
            "privateKey": str(pebble_dir / "pebble.key"),
            "httpPort": profile.ports.http,
            "tlsPort": pebble_tls_port,
            "ocspResponderURL": "",
            "externalAccountBindingRequired": False,
        }
    }
    (pebble_dir / "pebble.json").write_text(json.dumps(config))
    dns_log, pebble_log = pebble_dir / "dns.log", pebble_dir / "pebble.log"
    with open(dns_log, "wb") as out:
        started.append(
            subprocess.Popen(
                [
                    "pebble-challtestsrv",
                    "-dns01",
                    f"127.0.0.1:{dns_port}",
                    "-http01",
                    "",
                    "-https01",
                    "",
                    "-tlsalpn01",
                    "",
                    "-management",
                    f"127.0.0.1:{free_loopback_port()}",
                    "-defaultIPv4",
                    "127.0.0.1",
                    "-defaultIPv6",
                    "",
                ],  # fmt: skip
                stdout=out,
                stderr=out,
            )
        )
    env = {**os.environ, "PEBBLE_VA_NOSLEEP": "1", "PEBBLE_WFE_NONCEREJECT": "0"}
    with open(pebble_log, "wb") as out:
        started.append(
            subprocess.Popen(
                ["pebble", "-config", str(pebble_dir / "pebble.json"), "-dnsserver", f"127.0.0.1:{dns_port}"],
                stdout=out,
                stderr=out,
                env=env,
            )
        )
    _wait("pebble", lambda: _listening(acme_port) and _listening(management_port), started, [
        nginx_log, dns_log, pebble_log
    ])  # fmt: skip

    # The rendered deploy hook, reloading this nginx, and the rendered certbot command.
    dirs = acme_dirs(profile, str(node_dir))
    Path(dirs.webroot).mkdir(parents=True)  # as LocalNode.prepare and the renew script do
    hook = tmp_path / "deploy-hook.sh"
    reload_command = " ".join([*nginx_argv, "-s", "reload"])
    hook.write_text(deploy_hook_script(str(crt), str(key), reload_command))
    hook.chmod(0o755)

    def run_certbot() -> subprocess.CompletedProcess[str]:
        """The rendered certbot command against Pebble (trusting Pebble's own HTTPS certificate)."""
        return subprocess.run(
            certbot_command(profile, dirs, deploy_hook=str(hook)),
            env={**os.environ, "REQUESTS_CA_BUNDLE": str(pebble_dir / "pebble.crt")},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    certbot = run_certbot()
    assert certbot.returncode == 0, certbot.stdout + certbot.stderr + pebble_log.read_text()
    issued = x509.load_pem_x509_certificate((Path(dirs.live_dir) / "fullchain.pem").read_bytes())
    assert _common_name(issued.issuer).startswith("Pebble Intermediate CA")
    names = issued.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [DOMAIN]

    # nginx reloads asynchronously, and its old workers finish their connections with the old certificate:
    # wait (bounded) until two handshakes in a row get the issued one, from its issuer.
    def serving_issued() -> bool:
        return all(
            (served.serial_number, served.issuer) == (issued.serial_number, issued.issuer)
            for served in (_served_certificate(profile.ports.https) for _ in range(2))
        )

    _wait("nginx serving the issued certificate", serving_issued, started[:1], [nginx_log])
    assert (node_dir / profile.tls.private_key_path).stat().st_mode & 0o077 == 0

    # A client trusting Pebble's root (and the intermediate nginx sends in the chain) verifies the node.
    context = ssl.create_default_context(cafile=str(pebble_dir / "pebble.crt"))
    with urllib.request.urlopen(
        f"https://127.0.0.1:{management_port}/roots/0", context=context, timeout=10
    ) as response:
        root_pem = response.read().decode()
    client = ssl.create_default_context(cadata=root_pem)
    with (
        socket.create_connection(("127.0.0.1", profile.ports.https), timeout=5) as sock,
        client.wrap_socket(sock, server_hostname=DOMAIN) as tls,
    ):
        assert ("DNS", DOMAIN) in tls.getpeercert()["subjectAltName"]  # verified: chain and name

    # Pebble's validation went through nginx's challenge location on plain HTTP (200), not the redirect.
    access = (node_dir / "logs" / "access.log").read_text()
    assert f'"GET {ACME_CHALLENGE_PREFIX}' in access and " 200 " in access.split(ACME_CHALLENGE_PREFIX)[1]
    with pytest.raises(urllib.error.HTTPError) as missing:
        opener = urllib.request.build_opener(_NoRedirect)
        opener.open(f"http://127.0.0.1:{profile.ports.http}{ACME_CHALLENGE_PREFIX}nothing", timeout=5)
    assert missing.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as redirect:
        urllib.request.build_opener(_NoRedirect).open(f"http://127.0.0.1:{profile.ports.http}/", timeout=5)
    assert redirect.value.code == 301

    # A second run is a no-op until the certificate is due: the lineage is unchanged.
    again = run_certbot()
    assert again.returncode == 0, again.stdout + again.stderr
    assert "not yet due for renewal" in again.stdout + again.stderr
    assert sorted(p.name for p in (Path(dirs.config_dir) / "archive" / CERT_NAME).iterdir()) == [
        "cert1.pem",
        "chain1.pem",
        "fullchain1.pem",
        "privkey1.pem",
    ]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def test_cloud_init_schema_accepts_the_acme_and_alerting_user_data(tmp_path: Path) -> None:
    """The user-data with certbot's files, the alert receivers' secrets and the Ops Agent passes the real
    ``cloud-init schema``."""
    from infra.node.bundle.cloud_init import render_cloud_init
    from infra.node.bundle.services import OPTIONAL_SECRET_FILES, SECRET_FILES

    profile = _acme_profile(alerting={"webhook_url": "https://hooks.example.com/x", "pagerduty": True})
    ids = {role: role.replace("_", "-") for role in [*SECRET_FILES, "alert_pagerduty_routing_key"]}
    assert "alert_pagerduty_routing_key" in OPTIONAL_SECRET_FILES
    user_data = render_cloud_init(profile, render_bundle(profile), secret_manager_secrets=ids)[USER_DATA_FILE]
    path = tmp_path / "user-data.yaml"
    path.write_bytes(user_data)
    result = subprocess.run(
        ["cloud-init", "schema", "--config-file", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    commands = [" ".join(c) for c in yaml.safe_load(user_data)["runcmd"]]
    assert any("add-google-cloud-ops-agent-repo.sh --also-install" in c for c in commands)
