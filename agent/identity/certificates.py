"""Reading certificates and certificate requests, and the rules a device's request must meet.

    request = read_request(pem, device_id="pi-0001")   # IdentityError: why not, in one line
    cert = read_certificate(pem)                        # subject, serial, life, key fingerprint

A device's key must be an elliptic-curve key on P-256 or P-384 (what mosquitto's TLS and every
broker take, and what `device_key` makes); RSA and smaller curves are refused as weak or foreign.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent.core.errors import IdentityError

MAX_PEM_BYTES = 8 * 1024  # a P-384 request or certificate is under 1.5 KiB
ACCEPTED_CURVES = ("secp256r1", "secp384r1")


def key_fingerprint(public_key: ec.EllipticCurvePublicKey) -> str:
    """sha256 of the key's SubjectPublicKeyInfo, hex: names a device's key everywhere."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def _ms(when: dt.datetime) -> int:
    return int(when.timestamp() * 1000)


def _common_name(name: x509.Name) -> str:
    values = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(values) != 1:
        return ""
    value = values[0].value
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


def _bounded(pem: bytes | str, what: str) -> bytes:
    data = pem.encode("ascii", "replace") if isinstance(pem, str) else pem
    if len(data) > MAX_PEM_BYTES:
        raise IdentityError(f"{what} of {len(data)} bytes, over {MAX_PEM_BYTES}")
    return data


def _checked_key(key: object, what: str) -> ec.EllipticCurvePublicKey:
    if not isinstance(key, ec.EllipticCurvePublicKey):
        kind = type(key).__name__.removesuffix("PublicKey").removeprefix("_") or "unknown"
        raise IdentityError(f"{what}: weak or foreign key ({kind}):"
                            f" an elliptic-curve key on {' or '.join(ACCEPTED_CURVES)} is required")
    if key.curve.name not in ACCEPTED_CURVES:
        raise IdentityError(f"{what}: weak key (curve {key.curve.name}): {' or '.join(ACCEPTED_CURVES)} is required")
    return key


@dataclass(frozen=True, slots=True)
class CertificateRequest:
    """A device's checked request: its id (the subject's common name) and its public key."""

    device_id: str
    public_key: ec.EllipticCurvePublicKey
    fingerprint: str
    pem: bytes


def read_request(pem: bytes | str, *, device_id: str) -> CertificateRequest:
    """The request in `pem`, checked: well-formed, signed by its own key (the sender holds the
    private key), for `device_id` alone, with a strong key. `IdentityError` says what is wrong."""
    data = _bounded(pem, "certificate request")
    try:
        csr = x509.load_pem_x509_csr(data)
    except ValueError as exc:
        raise IdentityError(f"not a PEM certificate request ({exc})") from None
    if not csr.is_signature_valid:
        raise IdentityError("certificate request not signed by its own key")
    subject = _common_name(csr.subject)
    if subject != device_id:
        raise IdentityError(f"certificate request for device {subject!r}, sent as {device_id!r}")
    key = _checked_key(csr.public_key(), "certificate request")
    return CertificateRequest(device_id=subject, public_key=key, fingerprint=key_fingerprint(key), pem=data)


@dataclass(frozen=True, slots=True)
class CertificateInfo:
    """What a device needs to know of its certificate: who, which, and when."""

    subject: str
    serial: int
    not_before_ms: int
    not_after_ms: int
    fingerprint: str  # of its public key

    @property
    def renew_at_ms(self) -> int:
        """Two thirds into its life: a year's certificate renews after eight months."""
        return self.not_before_ms + (self.not_after_ms - self.not_before_ms) * 2 // 3

    def expired(self, now_ms: int) -> bool:
        return now_ms >= self.not_after_ms


def read_certificate(pem: bytes | str) -> CertificateInfo:
    data = _bounded(pem, "certificate")
    try:
        cert = x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise IdentityError(f"not a PEM certificate ({exc})") from None
    key = cert.public_key()
    fingerprint = key_fingerprint(key) if isinstance(key, ec.EllipticCurvePublicKey) else ""
    return CertificateInfo(subject=_common_name(cert.subject), serial=cert.serial_number,
                           not_before_ms=_ms(cert.not_valid_before_utc), not_after_ms=_ms(cert.not_valid_after_utc),
                           fingerprint=fingerprint)


__all__ = ["ACCEPTED_CURVES", "CertificateInfo", "CertificateRequest", "key_fingerprint", "read_certificate",
           "read_request"]
