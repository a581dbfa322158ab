"""A fake Kubernetes API server over HTTPS on loopback for the fleet models: it takes the runtime pods'
merge-patches of their own annotations (``PATCH /api/v1/namespaces/<ns>/pods/<name>``,
``runtime.fleet.deletion_cost``) and keeps them (``annotations``), checking the bearer token. Its CA and
token go in ``folder`` as ``ca.crt`` and ``token``, the layout of a pod's projected service-account volume
(``DUPLEX_POD_CREDENTIALS_DIR``); ``env`` is what a pod needs to reach it.

pytest puts ``tests/`` on ``sys.path``::

    from fake_kube_api import FakeKubeApi
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
from pathlib import Path

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["FakeKubeApi"]

TOKEN = "fake-projected-token"  # noqa: S105 - a test value


def _certificate(name: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer, *, ca: bool):  # type: ignore[no-untyped-def]
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
    return builder.sign(signer, hashes.SHA256())


class FakeKubeApi:
    """Start with ``await start()``, stop with ``await close()``; ``annotations[(ns, name)]`` holds each
    pod's annotations as patched, ``refused`` counts requests without the token."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.annotations: dict[tuple[str, str], dict[str, str]] = {}
        self.refused = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    def _tls(self) -> ssl.SSLContext:
        ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake cluster CA")])
        ca = _certificate("fake cluster CA", ca_key, ca_name, ca_key, ca=True)
        leaf = _certificate("kubernetes", key, ca_name, ca_key, ca=False)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        (self.folder / "token").write_text(TOKEN + "\n")
        chain, key_file = self.folder / "server.crt", self.folder / "server.key"
        chain.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(chain, key_file)
        return context

    async def _patch(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.refused += 1
            return web.json_response({"kind": "Status", "reason": "Unauthorized"}, status=401)
        if request.headers.get("Content-Type") != "application/merge-patch+json":
            return web.json_response({"kind": "Status", "reason": "UnsupportedMediaType"}, status=415)
        patch = json.loads(await request.text())
        key = (request.match_info["ns"], request.match_info["name"])
        self.annotations.setdefault(key, {}).update(patch["metadata"]["annotations"])
        return web.json_response({"metadata": {"annotations": self.annotations[key]}})

    async def start(self) -> FakeKubeApi:
        app = web.Application()
        app.router.add_route("PATCH", "/api/v1/namespaces/{ns}/pods/{name}", self._patch)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._tls())
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def env(self) -> dict[str, str]:
        """A pod's settings to keep its deletion cost here (its name and namespace come from ``SimPods``)."""
        return {
            "DUPLEX_POD_DELETION_COST": "true",
            "DUPLEX_POD_CREDENTIALS_DIR": str(self.folder),
            "DUPLEX_DELETION_COST_INTERVAL_S": "1",
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(self.port),
        }
