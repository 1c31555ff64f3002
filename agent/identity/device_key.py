"""A device's own key: made on the device, kept there (0600 in its state directory, written by
the worker), never sent. What leaves the device is a certificate request signed with it.

    pem = new_device_key()                  # PKCS#8 PEM of a fresh P-256 key
    csr = certificate_request(pem, "pi-0001")
"""

from __future__ import annotations

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent.core.errors import IdentityError
from agent.identity.certificates import key_fingerprint


def new_device_key() -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load(pem: bytes) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise IdentityError(f"not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise IdentityError("the device key is not an elliptic-curve key")
    return key


def device_key_fingerprint(pem: bytes) -> str:
    return key_fingerprint(_load(pem).public_key())


def certificate_request(pem: bytes, device_id: str) -> bytes:
    """A PEM certificate request for `device_id` (the subject's common name), signed with the key."""
    key = _load(pem)
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, device_id)]))
           .sign(key, hashes.SHA256()))
    return csr.public_bytes(serialization.Encoding.PEM)


__all__ = ["certificate_request", "device_key_fingerprint", "new_device_key"]
