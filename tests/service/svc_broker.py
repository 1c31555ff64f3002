"""A TLS + ACL mosquitto for the service tests, configured from configs/mosquitto/ itself.

The example config is rendered with the test's port and files (the shipped paths under
/etc/mosquitto are swapped for temporary ones); everything else is used as shipped, so the test
exercises the ACL and the TLS settings a user copies.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from mosquitto import Mosquitto

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "configs" / "mosquitto"


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path  # CN = the device id it was made for
    client_key: Path
    rogue_ca_cert: Path  # a CA nobody trusts


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return path


def _cert(subject_cn: str, key, issuer_cn: str, issuer_key, *, ca: bool, san=None) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_cn)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def make_pki(directory: Path, client_cn: str) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca = _cert("edge-agent test CA", ca_key, "edge-agent test CA", ca_key, ca=True)
    server_key = _key()
    server = _cert("localhost", server_key, "edge-agent test CA", ca_key, ca=False,
                   san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client_key = _key()
    client = _cert(client_cn, client_key, "edge-agent test CA", ca_key, ca=False)
    rogue_key = _key()
    rogue = _cert("rogue CA", rogue_key, "rogue CA", rogue_key, ca=True)
    return Pki(
        ca_cert=_write_cert(ca, directory / "ca.crt"),
        server_cert=_write_cert(server, directory / "server.crt"),
        server_key=_write_key(server_key, directory / "server.key"),
        client_cert=_write_cert(client, directory / "client.crt"),
        client_key=_write_key(client_key, directory / "client.key"),
        rogue_ca_cert=_write_cert(rogue, directory / "rogue-ca.crt"),
    )


def password_line(username: str, password: str) -> str:
    """mosquitto 2.0's `$7$` format: PBKDF2-HMAC-SHA512, 101 iterations, 12-byte salt."""
    salt = os.urandom(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, 101)
    return f"{username}:$7$101${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def render_example(port: int, files: dict[str, Path], overrides: dict[str, str] | None = None) -> str:
    """configs/mosquitto/mosquitto.conf with test paths, a loopback port and no persistence."""
    replace = {
        "listener": f"{port} 127.0.0.1",
        "password_file": str(files["password_file"]),
        "acl_file": str(files["acl_file"]),
        "cafile": str(files["cafile"]),
        "certfile": str(files["certfile"]),
        "keyfile": str(files["keyfile"]),
        "persistence": "false",
        "log_dest": "stderr",
        **(overrides or {}),
    }
    drop = {"persistence_location", "autosave_interval"}
    lines = []
    for line in (EXAMPLE / "mosquitto.conf").read_text().splitlines():
        key = line.split(" ", 1)[0] if line and not line.startswith("#") else ""
        if key in drop:
            continue
        lines.append(f"{key} {replace[key]}" if key in replace else line)
    if os.geteuid() == 0:
        lines.append("user root")  # else mosquitto drops to `mosquitto`, who cannot read tmp
    return "\n".join(lines) + "\n"


class ExampleBroker(Mosquitto):
    """The shared launcher (start/stop by pid), with the shipped example config."""

    def __init__(self, workdir: Path, pki: Pki, users: dict[str, str],
                 overrides: dict[str, str] | None = None) -> None:
        super().__init__(workdir)
        self.pki = pki
        self.passwd = self.workdir / "edge-agent.passwd"
        self.passwd.write_text("".join(password_line(u, p) + "\n" for u, p in users.items()))
        self.passwd.chmod(0o600)
        self.overrides = overrides

    def config_text(self) -> str:
        return render_example(self.port, {
            "password_file": self.passwd,
            "acl_file": EXAMPLE / "acl",
            "cafile": self.pki.ca_cert,
            "certfile": self.pki.server_cert,
            "keyfile": self.pki.server_key,
        }, self.overrides)
