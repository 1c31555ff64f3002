"""The fleet's certificate authority: it signs device certificates (subject: the device id, for
mosquitto's `use_identity_as_username`), the broker's server certificate and the leader's own
client certificate, and the revocation list the broker reads (`crlfile`).

    key_pem, cert_pem = new_authority("edge-agent fleet default", now_ms=now)
    ca = FleetAuthority(key_pem, cert_pem)
    cert_pem = ca.issue_device(request, now_ms=now, days=365)
    crl_pem = ca.revocation_list([(serial, revoked_ms)], now_ms=now)

A certificate's life starts `SKEW_S` before it is issued, so a device whose clock lags a few
minutes (a Pi has no RTC) takes it at once. The revocation list expires (`next_update`): the
leader writes it again every day, and a broker holding an expired list refuses every device.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Iterable, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.core.errors import IdentityError
from agent.identity.certificates import CertificateRequest

SKEW_S = 300
CA_DAYS = 3650
CRL_DAYS = 30


def _when(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_authority(common_name: str, *, now_ms: int, days: int = CA_DAYS) -> tuple[bytes, bytes]:
    """A new self-signed CA: (private key PEM, certificate PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(_when(now_ms - SKEW_S * 1000)).not_valid_after(_when(now_ms + days * 86_400_000))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)


class FleetAuthority:
    """The CA's key and certificate, loaded once."""

    def __init__(self, key_pem: bytes, cert_pem: bytes) -> None:
        try:
            key = serialization.load_pem_private_key(key_pem, password=None)
            self.certificate = x509.load_pem_x509_certificate(cert_pem)
        except (ValueError, TypeError) as exc:
            raise IdentityError(f"not the fleet CA's key and certificate ({exc})") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise IdentityError("the fleet CA's key is not an elliptic-curve key")
        if key.public_key() != self.certificate.public_key():
            raise IdentityError("the fleet CA's key does not match its certificate")
        self._key = key
        self.cert_pem = cert_pem

    def _leaf(self, subject: str, public_key: ec.EllipticCurvePublicKey, *, now_ms: int, days: float,
              usage: x509.ObjectIdentifier, hosts: Sequence[str] = (), skew_s: int = SKEW_S) -> x509.Certificate:
        not_after = now_ms + int(days * 86_400_000)
        if not_after > (ca_end := int(self.certificate.not_valid_after_utc.timestamp() * 1000)):
            not_after = ca_end  # never beyond the CA's own life
        builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(self.certificate.subject)
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(_when(now_ms - skew_s * 1000)).not_valid_after(_when(not_after))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                                key_encipherment=False, data_encipherment=False, key_agreement=False,
                                                key_cert_sign=False, crl_sign=False, encipher_only=False,
                                                decipher_only=False), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                                  critical=False))
        if hosts:
            names: list[x509.GeneralName] = []
            for host in hosts:
                try:
                    names.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    names.append(x509.DNSName(host))
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(self._key, hashes.SHA256())

    def issue_device(self, request: CertificateRequest, *, now_ms: int, days: float, skew_s: int = SKEW_S) -> bytes:
        """A client certificate for a checked request (`certificates.read_request`), valid from
        `skew_s` ago (a device clock that lags takes it at once)."""
        cert = self._leaf(request.device_id, request.public_key, now_ms=now_ms, days=days,
                          usage=ExtendedKeyUsageOID.CLIENT_AUTH, skew_s=skew_s)
        return cert.public_bytes(serialization.Encoding.PEM)

    def issue_with_key(self, subject: str, *, now_ms: int, days: float, server_hosts: Sequence[str] = ()
                       ) -> tuple[bytes, bytes]:
        """(key PEM, certificate PEM) made here: the broker's server certificate (`server_hosts`:
        its names and addresses) or, without hosts, a client certificate (the leader's own)."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server_hosts else ExtendedKeyUsageOID.CLIENT_AUTH
        cert = self._leaf(subject, key.public_key(), now_ms=now_ms, days=days, usage=usage, hosts=server_hosts)
        return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)

    def revocation_list(self, revoked: Iterable[tuple[int, int]], *, now_ms: int, days: int = CRL_DAYS) -> bytes:
        """The CRL of `revoked` (serial, revoked at ms), valid `days` from now."""
        builder = (x509.CertificateRevocationListBuilder().issuer_name(self.certificate.subject)
                   .last_update(_when(now_ms - SKEW_S * 1000)).next_update(_when(now_ms + days * 86_400_000)))
        for serial, at_ms in revoked:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(_when(at_ms)).build())
        return builder.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


__all__ = ["CA_DAYS", "CRL_DAYS", "SKEW_S", "FleetAuthority", "new_authority"]
