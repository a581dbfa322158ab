"""A single node says when its certificate is dying (issue 33, "Single nodes fail silently").

The rendered renew script runs for real (``sh``) with ``certbot`` and ``getent`` replaced by stubs on
``PATH`` and a loopback HTTP server standing for nginx on port 80; the textfile it writes is served by the
real ``prometheus-node-exporter`` (Debian package), and the alert rules on those series pass ``promtool test
rules`` (tests/test_node_prometheus.py runs promtool on every profile; here the ACME profile's alerts are
checked by name). The first-issuance retry (a timer every 5 minutes, backing off after failed
validations) and the first-boot installs that wait for the dpkg lock are read from the rendered files, and
the user-data passes ``cloud-init schema``.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from infra.node.bundle.acme import (
    FIRST_SERVICE,
    FIRST_TIMER,
    METRICS_FILE,
    RENEW_SCRIPT,
    SERVICE,
    TIMER,
    acme_dirs,
    render_acme_host_files,
    textfile_dir,
)
from infra.node.bundle.cloud_init import USER_DATA_FILE, render_cloud_init
from infra.node.bundle.compose import COMPOSE_FILE
from infra.node.bundle.first_boot import APT_LOCK_CONF
from infra.node.bundle.render import render_bundle
from infra.node.bundle.services import SECRET_FILES
from infra.node.bundle.tls import write_self_signed_certificate
from infra.node.monitoring.alert_rules import alert_rules
from infra.node.profile.profiles import NodeProfile, get_profile
from runtime.tools.local_redis import free_loopback_port

DOMAIN = "voice.example.com"
CERT_ALERTS = {
    "TlsCertificateExpiringSoon",
    "TlsCertificateExpiryCritical",
    "AcmeRenewalFailed",
    "AcmeRenewalNotRunning",
}


def _profile(tmp_path: Path | None = None, http_port: int = 80) -> NodeProfile:
    fields: dict[str, object] = {
        "domain": DOMAIN,
        "tls": {"mode": "acme", "acme_email": "ops@example.com"},
    }
    if tmp_path is not None:
        fields |= {
            "data_dir": str(tmp_path / "data"),
            "public_address": "127.0.0.1",
            "ports": {"http": http_port},
            "tls": {
                "mode": "acme",
                "acme_email": "ops@example.com",
                "certificate_path": str(tmp_path / "tls" / "node.crt"),
                "private_key_path": str(tmp_path / "tls" / "node.key"),
            },
        }
    return get_profile("a100-80gb", **fields)


# --- alerts ---------------------------------------------------------------------------------------------


def test_acme_node_alerts_on_expiry_and_renewal_failure() -> None:
    """Guards issue 33: an ACME node had no alert on its certificate. The rules read node_exporter's
    textfile series: warning under 14 days, page under 3, a failing renewal, a renewal that stopped
    running; nodes without certbot (self-signed) get none."""
    rules = {r["alert"]: r for r in alert_rules(_profile())["groups"][1]["rules"]}
    assert set(rules) >= CERT_ALERTS
    assert rules["TlsCertificateExpiringSoon"]["expr"] == (
        'duplex_tls_certificate_not_after_timestamp_seconds{job="node-exporter"} - time() < 1209600'
    )
    assert rules["TlsCertificateExpiringSoon"]["labels"] == {"severity": "ticket"}
    assert rules["TlsCertificateExpiryCritical"]["expr"].endswith("- time() < 259200")
    assert rules["TlsCertificateExpiryCritical"]["labels"] == {"severity": "page"}
    assert rules["AcmeRenewalFailed"]["expr"] == 'duplex_acme_renewal_success{job="node-exporter"} == 0'
    self_signed = {r["alert"] for r in alert_rules(get_profile("a100-80gb"))["groups"][1]["rules"]}
    assert not CERT_ALERTS & self_signed


def test_node_exporter_reads_the_textfile_directory_on_acme_nodes() -> None:
    profile = _profile()
    command = yaml.safe_load(render_bundle(profile)[COMPOSE_FILE])["services"]["node-exporter"]["command"]
    assert f"--collector.textfile.directory=/host{textfile_dir(profile)}" in command
    plain = yaml.safe_load(render_bundle(get_profile("a100-80gb"))[COMPOSE_FILE])
    assert not any("textfile" in arg for arg in plain["services"]["node-exporter"]["command"])


# --- the renew script, run ------------------------------------------------------------------------------


@pytest.fixture
def nginx_stand_in() -> Iterator[int]:
    """A loopback HTTP server answering 404 to everything (the renew script only waits for an answer)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_loopback_port()), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_error(404)

    def log_message(self, *args: object) -> None:
        return None


_CERTBOT_STUB = """#!/bin/sh
# certbot stand-in: logs the call; exits $CERTBOT_EXIT; on success writes the lineage and the served
# certificate as the deploy hook would.
echo "$*" >>"$STUBS/certbot.calls"
[ "${CERTBOT_EXIT:-0}" -eq 0 ] || exit "$CERTBOT_EXIT"
mkdir -p "$LIVE_DIR"
cp "$ISSUED" "$LIVE_DIR/fullchain.pem"
cp "$ISSUED" "$SERVED"
"""


class _Node:
    """The rendered renew script, its stubs and its outputs under ``tmp_path``."""

    def __init__(self, tmp_path: Path, http_port: int) -> None:
        self.profile = _profile(tmp_path, http_port)
        self.script = tmp_path / "duplex-certbot"
        self.script.write_text(render_acme_host_files(self.profile, reload_command="true")[RENEW_SCRIPT][1])
        self.stubs = tmp_path / "stubs"
        self.stubs.mkdir()
        (self.stubs / "certbot").write_text(_CERTBOT_STUB)
        (self.stubs / "certbot").chmod(0o755)
        self.served = Path(self.profile.tls.certificate_path)
        self.served.parent.mkdir(parents=True)
        write_self_signed_certificate(self.served, self.served.with_suffix(".key"), domain=DOMAIN)
        self.issued = tmp_path / "issued.pem"
        write_self_signed_certificate(self.issued, tmp_path / "issued.key", domain=DOMAIN)
        self.live_dir = Path(acme_dirs(self.profile).live_dir)
        self.metrics = Path(textfile_dir(self.profile)) / METRICS_FILE

    def resolves(self, yes: bool) -> None:
        """``getent ahosts``: the name resolves (the DNS record exists) or not."""
        (self.stubs / "getent").write_text(f"#!/bin/sh\nexit {0 if yes else 2}\n")
        (self.stubs / "getent").chmod(0o755)

    def run(self, certbot_exit: int = 0) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "PATH": f"{self.stubs}:{os.environ['PATH']}",
            "STUBS": str(self.stubs),
            "CERTBOT_EXIT": str(certbot_exit),
            "LIVE_DIR": str(self.live_dir),
            "ISSUED": str(self.issued),
            "SERVED": str(self.served),
        }
        return subprocess.run(["sh", str(self.script)], env=env, capture_output=True, text=True, timeout=60)

    def certbot_calls(self) -> int:
        calls = self.stubs / "certbot.calls"
        return len(calls.read_text().splitlines()) if calls.exists() else 0

    def samples(self) -> dict[str, float]:
        """The textfile's samples, ``{name{labels}: value}``."""
        lines = self.metrics.read_text().splitlines()
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in lines
            if not line.startswith("#")
        }


def _not_after(path: Path) -> float:
    return x509.load_pem_x509_certificate(path.read_bytes()).not_valid_after_utc.timestamp()


LABELS = f'{{domain="{DOMAIN}"}}'


def test_renew_script_waits_for_dns_backs_off_and_writes_metrics(tmp_path: Path, nginx_stand_in: int) -> None:
    """Guards issue 33: a name pointed after the first boot waited for the twice-daily run, and no run
    left a trace Prometheus could read. Now: no DNS record, no certbot call and success 0; a failed
    validation is counted and the next run within 5 minutes backs off (no second call); a success
    clears the count and reports the served certificate's notAfter."""
    node = _Node(tmp_path, nginx_stand_in)
    node.resolves(False)
    first = node.run()
    assert first.returncode == 1 and "does not resolve yet" in first.stderr, first.stderr
    assert node.certbot_calls() == 0
    samples = node.samples()
    assert samples[f"duplex_acme_renewal_success{LABELS}"] == 0
    assert samples[f"duplex_tls_certificate_not_after_timestamp_seconds{LABELS}"] == _not_after(node.served)
    assert abs(samples[f"duplex_acme_renewal_last_run_timestamp_seconds{LABELS}"] - time.time()) < 600

    node.resolves(True)
    failed = node.run(certbot_exit=1)
    assert failed.returncode == 1 and node.certbot_calls() == 1
    failures = Path(acme_dirs(node.profile).work_dir) / "first-issuance-failures"
    assert failures.read_text().split()[0] == "1"
    backing_off = node.run()
    assert backing_off.returncode == 0 and "next one 300 s after the last" in backing_off.stderr
    assert node.certbot_calls() == 1  # no validation spent within the back-off

    failures.write_text(f"1 {int(time.time()) - 301}\n")  # the 5 minutes have passed
    issued = node.run()
    assert issued.returncode == 0, issued.stderr
    assert node.certbot_calls() == 2 and not failures.exists()
    samples = node.samples()
    assert samples[f"duplex_acme_renewal_success{LABELS}"] == 1
    assert samples[f"duplex_tls_certificate_not_after_timestamp_seconds{LABELS}"] == _not_after(node.issued)
    assert oct(node.metrics.stat().st_mode & 0o777) == "0o644"  # node_exporter runs as nobody


def test_renew_script_backoff_doubles_up_to_an_hour(tmp_path: Path, nginx_stand_in: int) -> None:
    """After 3 failed validations the next waits 20 minutes; after 9, an hour (Let's Encrypt allows 5 failed
    validations per name and hour)."""
    node = _Node(tmp_path, nginx_stand_in)
    node.resolves(True)
    failures = Path(acme_dirs(node.profile).work_dir) / "first-issuance-failures"
    failures.parent.mkdir(parents=True, exist_ok=True)
    failures.write_text(f"3 {int(time.time()) - 900}\n")
    assert "next one 1200 s" in node.run().stderr
    failures.write_text(f"9 {int(time.time()) - 3000}\n")
    assert "next one 3600 s" in node.run().stderr
    assert node.certbot_calls() == 0


def test_node_exporter_serves_the_renew_scripts_textfile(tmp_path: Path, nginx_stand_in: int) -> None:
    """The real node_exporter's textfile collector parses what the script wrote (a malformed file would
    only show as ``node_textfile_scrape_error``)."""
    node = _Node(tmp_path, nginx_stand_in)
    node.resolves(True)
    assert node.run().returncode == 0
    port = free_loopback_port()
    exporter = subprocess.Popen(
        [
            "prometheus-node-exporter",
            f"--web.listen-address=127.0.0.1:{port}",
            "--collector.disable-defaults",
            "--collector.textfile",
            f"--collector.textfile.directory={node.metrics.parent}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    text = response.read().decode()
                break
            except OSError:
                if time.monotonic() > deadline or exporter.poll() is not None:
                    raise
                time.sleep(0.2)
    finally:
        exporter.terminate()
        exporter.wait(timeout=10)
    assert "node_textfile_scrape_error 0" in text
    assert f"duplex_acme_renewal_success{LABELS} 1" in text
    served = [line for line in text.splitlines() if line.startswith("duplex_tls_certificate_not_after")]
    assert len(served) == 1 and float(served[0].split()[-1]) == _not_after(node.issued)


# --- first issuance retried, first-boot installs ----------------------------------------------------------


def test_first_certificate_is_retried_every_five_minutes_until_issued() -> None:
    """Guards issue 33: only the twice-daily timer ran certbot, so a name pointed after the first boot
    waited up to 13 h. A second timer starts the renew service every 5 minutes while certbot's lineage
    has no certificate."""
    profile = _profile()
    files = render_acme_host_files(profile, reload_command="true")
    service = files[f"/etc/systemd/system/{FIRST_SERVICE}"][1]
    timer = files[f"/etc/systemd/system/{FIRST_TIMER}"][1]
    assert f"ConditionPathExists=!{acme_dirs(profile).live_dir}/fullchain.pem" in service
    assert f"ExecStart=-/bin/systemctl start {SERVICE}" in service
    assert "OnCalendar=*:0/5" in timer
    result = subprocess.run(
        ["systemd-analyze", "calendar", "*:0/5"], capture_output=True, text=True, timeout=30, check=False
    )
    if result.returncode == 0:  # systemd's own parser, where the tool runs
        assert "Normalized form: *-*-* *:00/5:00" in result.stdout
    document = yaml.safe_load(render_bundle(profile)[USER_DATA_FILE])
    assert ["systemctl", "enable", "--now", TIMER, FIRST_TIMER] in document["runcmd"]


def test_first_boot_installs_wait_for_the_dpkg_lock_and_retry(tmp_path: Path) -> None:
    """Guards issue 33: certbot's and the Ops Agent's installs failed for good when unattended-upgrades
    held the dpkg lock. apt's lock timeout is written before any install (it covers the Ops Agent's own
    apt-get), each install is retried, and the user-data passes the real ``cloud-init schema``."""
    profile = _profile()
    ids = {role: role.replace("_", "-") for role in SECRET_FILES}
    user_data = render_cloud_init(profile, render_bundle(profile), secret_manager_secrets=ids)[USER_DATA_FILE]
    document = yaml.safe_load(user_data)
    assert document["write_files"][0] == {
        "path": APT_LOCK_CONF,
        "owner": "root:root",
        "permissions": "0644",
        "content": 'DPkg::Lock::Timeout "600";\n',
    }
    commands = [c[-1] for c in document["runcmd"] if c[:2] == ["sh", "-c"]]
    certbot = next(c for c in commands if "install -y -q certbot" in c)
    ops_agent = next(c for c in commands if "add-google-cloud-ops-agent-repo.sh" in c)
    compose = next(c for c in commands if "docker-compose-plugin" in c)
    for command in (certbot, ops_agent, compose):
        assert "until " in command and 'if [ "$n" -ge 5 ]' in command, command
    assert "apt-get -o DPkg::Lock::Timeout=600 update" in certbot
    path = tmp_path / "user-data.yaml"
    path.write_bytes(user_data)
    result = subprocess.run(
        ["cloud-init", "schema", "--config-file", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_retried_install_gives_up_after_five_attempts(tmp_path: Path) -> None:
    """The retry loop itself, run by ``sh`` with a failing command and no pause: five attempts, then exit 1
    naming what failed."""
    from infra.node.bundle import first_boot

    script = first_boot.retried(f"echo try >>{tmp_path}/tries; false", "the test install").replace(
        f"sleep {first_boot.APT_RETRY_PAUSE_S}", "true"
    )
    result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "the test install failed 5 times" in result.stderr
    assert (tmp_path / "tries").read_text().count("try") == 5
