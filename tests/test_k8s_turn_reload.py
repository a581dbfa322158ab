"""The regions' certificate reload, for real: coturn (Debian's ``turnserver`` 4.6.1) serving TURN over TLS
from files, and the ``tls-reload`` sidecar's own script (``infra.k8s.turn.tls_reload_script``, run by
``sh`` at a 1 s interval) beside it. Replacing the certificate as the kubelet does on a renewal (the new
files swapped in whole) must make coturn serve the new one without a restart (same pid); an unchanged file
must send no signal."""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from infra.k8s.turn import tls_reload_script
from infra.node.bundle.coturn import coturn_args, render_turnserver_conf
from infra.node.bundle.tls import write_self_signed_certificate
from infra.node.local.node import free_port_profile, stun_binding_ok

SECRET = "coturn-reload-secret-0123456789abcdefghijklmn"
WAIT_S = 60.0
"""Hang guard for coturn and the sidecar to act (not a speed bound)."""


def _served_certificate(port: int) -> str:
    """SHA-256 of the certificate coturn presents on ``port`` (TURN over TLS), hex."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, context.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return hashlib.sha256(der).hexdigest()


def _fingerprint(path: Path) -> str:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(path.read_text())).hexdigest()


def _until(check: Callable[[], bool], what: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert process.poll() is None, f"{what}: process exited: {log.read_text(errors='replace')[-2000:]}"
        assert time.monotonic() < deadline, f"{what}: not after {WAIT_S} s"
        time.sleep(0.2)


def _swap_in(directory: Path, crt: Path, key: Path, domain: str) -> None:
    """A renewal as the kubelet delivers it: the new pair written aside, then moved over the old (key first,
    so that the certificate the sidecar watches changes last)."""
    staged = directory / "staged"
    staged.mkdir(exist_ok=True)
    write_self_signed_certificate(staged / "tls.crt", staged / "tls.key", domain=domain)
    os.replace(staged / "tls.key", key)
    os.replace(staged / "tls.crt", crt)


def test_a_renewed_certificate_reaches_coturn_without_a_restart(tmp_path: Path) -> None:
    directory = tmp_path / "region"
    tls_dir = directory / "tls"
    tls_dir.mkdir(parents=True)
    crt, key, pid_file = tls_dir / "tls.crt", tls_dir / "tls.key", directory / "turnserver.pid"
    write_self_signed_certificate(crt, key, domain="turn-us-central1.example.com")
    profile = free_port_profile()
    profile = profile.model_copy(
        update={
            "tls": profile.tls.model_copy(update={"certificate_path": str(crt), "private_key_path": str(key)})
        }
    )
    (directory / "turnserver.conf").write_text(render_turnserver_conf(profile, SECRET))
    port = profile.relay.tls_port
    log, sidecar_log = directory / "coturn.log", directory / "sidecar.log"
    with open(log, "wb") as out:
        coturn = subprocess.Popen(
            ["turnserver", *coturn_args("turnserver.conf", str(pid_file))],
            cwd=directory,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    sidecar = None
    try:
        _until(
            lambda: stun_binding_ok("127.0.0.1", profile.relay.port) and pid_file.exists(),
            "coturn",
            coturn,
            log,
        )
        first = _fingerprint(crt)
        assert _served_certificate(port) == first
        with open(sidecar_log, "wb") as out:
            script = tls_reload_script(str(crt), str(pid_file), interval_s=1)
            sidecar = subprocess.Popen(["sh", "-c", script], stdout=out, stderr=subprocess.STDOUT)
        time.sleep(3)  # three intervals over an unchanged file: no signal
        assert sidecar.poll() is None and sidecar_log.read_text() == ""
        pid = int(pid_file.read_text().split()[0])

        _swap_in(directory, crt, key, "turn-us-central1.example.com")
        second = _fingerprint(crt)
        assert second != first
        _until(lambda: _served_certificate(port) == second, "the renewed certificate served", coturn, log)
        assert (
            coturn.poll() is None and int(pid_file.read_text().split()[0]) == pid
        )  # reloaded, not restarted
        assert sidecar_log.read_text().count("certificate changed: coturn reloaded") == 1
    finally:
        for process in (sidecar, coturn):
            if process is None:
                continue
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
