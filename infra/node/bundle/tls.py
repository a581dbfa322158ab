"""Self-signed TLS material for a node whose profile says ``tls.mode: self-signed`` (the local node, and a
fresh VM's first boot before an operator installs a real certificate).

Built with ``cryptography`` (no hand-rolled crypto, no ``openssl`` binary needed): an ECDSA P-256 key and
an X.509 certificate that is its own CA, with the node's domain, ``localhost`` and the given IP addresses as
subject alternative names, so clients can verify it by loading the certificate as their trust anchor.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

__all__ = ["SelfSignedCertificate", "write_self_signed_certificate"]


class SelfSignedCertificate:
    """Paths of a written certificate (PEM) and key (PEM, PKCS#8, mode 0600)."""

    def __init__(self, certificate_path: Path, private_key_path: Path) -> None:
        self.certificate_path = certificate_path
        self.private_key_path = private_key_path


def write_self_signed_certificate(
    certificate_path: Path,
    private_key_path: Path,
    *,
    domain: str,
    ip_addresses: tuple[str, ...] = ("127.0.0.1",),
    valid_days: int = 30,
) -> SelfSignedCertificate:
    """Write a fresh self-signed certificate for ``domain`` (+ ``localhost`` and ``ip_addresses``).

    Args:
        valid_days: validity from one hour ago (clock skew) to ``valid_days`` days ahead.

    Raises:
        ValueError: ``valid_days`` < 1 or an entry of ``ip_addresses`` is not an IP address.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if valid_days < 1:
        raise ValueError(f"valid_days must be >= 1, got {valid_days}")
    addresses = [ipaddress.ip_address(a) for a in ip_addresses]
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, domain)])
    dns_names = dict.fromkeys([domain, "localhost"])  # ordered, deduplicated
    now = dt.datetime.now(dt.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=valid_days))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(a) for a in addresses]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    certificate_path.parent.mkdir(parents=True, exist_ok=True)
    private_key_path.parent.mkdir(parents=True, exist_ok=True)
    certificate_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_bytes = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(private_key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key_bytes)
    return SelfSignedCertificate(certificate_path, private_key_path)
