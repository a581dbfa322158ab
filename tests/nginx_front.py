"""A real nginx from the node's rendered config, started in a test's directory in front of whatever the
profile's ``ports.runtime`` names (the in-process server, or nothing for static files): TLS with a fresh
self-signed certificate for the profile's domain."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

from infra.node.bundle.nginx import NGINX_CONF
from infra.node.bundle.render import write_bundle
from infra.node.bundle.tls import write_self_signed_certificate
from infra.node.local.node import nginx_global_directives
from infra.node.profile.profiles import NodeProfile


def start_nginx(
    profile: NodeProfile, directory: Path, files: dict[str, bytes]
) -> tuple[subprocess.Popen[bytes], ssl.SSLContext, str]:
    """Write ``files`` (path -> bytes, e.g. ``render_nginx(profile)``) under ``directory`` with its
    ``logs``/``run``/``web`` folders and the profile's certificate, and start nginx there in the
    foreground. Returns (the nginx process, an SSL context that trusts the certificate, the base URL
    ``https://<domain>:<https port>``). It does not wait for nginx to listen: poll, and read
    ``directory/logs/error.log`` if the process has exited. The caller terminates the process."""
    write_bundle(files, directory)
    for sub in ("logs", "run", "web"):
        (directory / sub).mkdir(exist_ok=True)
    cert = directory / profile.tls.certificate_path
    write_self_signed_certificate(cert, directory / profile.tls.private_key_path, domain=profile.domain)
    process = subprocess.Popen(
        ["nginx", "-p", f"{directory}/", "-c", NGINX_CONF, "-e", "logs/error.log"]
        + ["-g", nginx_global_directives(directory)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    context = ssl.create_default_context(cafile=str(cert))
    return process, context, f"https://{profile.domain}:{profile.ports.https}"
