"""Ed25519 signing keys for firmware, as PEM files.

`edge-agent firmware keygen` writes `private.pem` (PKCS#8, mode 0600) and `public.pem`
(SubjectPublicKeyInfo). Devices pin the public key. A key's id is the first 8 bytes of the
sha256 of its raw 32-byte public key; artifacts carry it next to the signature so a refusal can
say "signed by another key" instead of only "bad signature".

The `cryptography` types stay inside this module: callers hold a `SigningKey` or a `VerifyKey`.
They load with the first signature checked or made: a pinned key is read from its fixed
SubjectPublicKeyInfo form (RFC 8410), so an idle device never loads the library.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Union

from agent.core.files import atomic_write
from rollout_engine.errors import KeyFileError, WrongKey

KEY_ID_SIZE = 8
SIGNATURE_SIZE = 64
PRIVATE_KEY_FILE = "private.pem"
PUBLIC_KEY_FILE = "public.pem"
_MAX_KEY_FILE = 64 * 1024
RAW_KEY_SIZE = 32
#: The DER of an ed25519 SubjectPublicKeyInfo before its 32 raw bytes (RFC 8410, section 4).
_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")
_PEM_PUBLIC = (b"-----BEGIN PUBLIC KEY-----", b"-----END PUBLIC KEY-----")

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


def _key_id(raw_public: bytes) -> bytes:
    return hashlib.sha256(raw_public).digest()[:KEY_ID_SIZE]


def _spki_raw(data: bytes) -> bytes | None:
    """The raw key of a PEM ed25519 public key in its one DER form; None for any other text."""
    text = data.strip()
    if not (text.startswith(_PEM_PUBLIC[0]) and text.endswith(_PEM_PUBLIC[1])):
        return None
    try:
        der = base64.b64decode(b"".join(text[len(_PEM_PUBLIC[0]):-len(_PEM_PUBLIC[1])].split()), validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(der) != len(_SPKI_PREFIX) + RAW_KEY_SIZE or not der.startswith(_SPKI_PREFIX):
        return None
    return der[len(_SPKI_PREFIX):]


class VerifyKey:
    """A pinned ed25519 public key: its 32 raw bytes, and the library's key once it verifies."""

    __slots__ = ("_key", "raw", "key_id")

    def __init__(self, raw: bytes) -> None:
        if len(raw) != RAW_KEY_SIZE:
            raise KeyFileError(f"not a raw ed25519 public key ({len(raw)} bytes, not {RAW_KEY_SIZE})")
        self._key: Ed25519PublicKey | None = None
        self.raw = bytes(raw)
        self.key_id = _key_id(self.raw)

    @classmethod
    def from_pem(cls, data: bytes, *, source: str = "public key") -> VerifyKey:
        raw = _spki_raw(data)
        if raw is not None:
            return cls(raw)
        # anything else: the library says what it is (another algorithm, not PEM at all)
        from cryptography.exceptions import UnsupportedAlgorithm
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            key = serialization.load_pem_public_key(data)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise KeyFileError(f"{source}: not a PEM public key ({exc})") from exc
        if not isinstance(key, Ed25519PublicKey):
            raise KeyFileError(f"{source}: not an ed25519 public key")
        return cls(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))

    @classmethod
    def from_raw(cls, raw: bytes) -> VerifyKey:
        return cls(raw)

    def _public(self) -> Ed25519PublicKey:
        if self._key is None:
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

            try:
                self._key = Ed25519PublicKey.from_public_bytes(self.raw)
            except ValueError as exc:
                raise KeyFileError(f"not a raw ed25519 public key ({exc})") from exc
        return self._key

    def verify(self, signature: bytes, data: bytes) -> bool:
        """True when `signature` is this key's signature of `data`."""
        from cryptography.exceptions import InvalidSignature

        try:
            self._public().verify(signature, data)
        except InvalidSignature:
            return False
        return True

    def to_pem(self) -> bytes:
        b64 = base64.encodebytes(_SPKI_PREFIX + self.raw).replace(b"\n", b"")
        return _PEM_PUBLIC[0] + b"\n" + b64 + b"\n" + _PEM_PUBLIC[1] + b"\n"

    @property
    def key_id_hex(self) -> str:
        return self.key_id.hex()


class KeySource(Protocol):
    """Keys chosen by the key id a signature names: the fleet's trust document
    (`rollout_engine.trust.TrustedKeys`)."""

    def signer(self, key_id: bytes) -> VerifyKey:
        """The key that must have signed; `WrongKey` saying why there is none."""
        ...


#: What checks a signature: one pinned key, or the keys a trust document lists.
Verifier = Union["VerifyKey", KeySource]


def signer_of(key: Verifier, key_id: bytes) -> VerifyKey:
    """The key that must have made a signature naming `key_id`: the pinned one, or the one the
    trust document lists for that id; `WrongKey` saying why there is none."""
    if not isinstance(key, VerifyKey):
        return key.signer(key_id)
    if key_id != key.key_id:
        raise WrongKey(f"signed by key {key_id.hex()}, not the fleet's key {key.key_id.hex()}")
    return key


class SigningKey:
    """An ed25519 private key that signs manifests."""

    __slots__ = ("_key", "public")

    def __init__(self, key: Ed25519PrivateKey) -> None:
        from cryptography.hazmat.primitives import serialization

        self._key = key
        self.public = VerifyKey(key.public_key().public_bytes(serialization.Encoding.Raw,
                                                              serialization.PublicFormat.Raw))

    @classmethod
    def generate(cls) -> SigningKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, data: bytes, *, source: str = "private key") -> SigningKey:
        from cryptography.exceptions import UnsupportedAlgorithm
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        try:
            key = serialization.load_pem_private_key(data, password=None)
        except TypeError as exc:  # the key is encrypted
            raise KeyFileError(f"{source}: encrypted private keys are not supported ({exc})") from exc
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise KeyFileError(f"{source}: not a PEM private key ({exc})") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"{source}: not an ed25519 private key")
        return cls(key)

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def to_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    @property
    def key_id(self) -> bytes:
        return self.public.key_id


def _read_key_file(path: str | Path) -> bytes:
    path = Path(path)
    try:
        with path.open("rb") as handle:
            data = handle.read(_MAX_KEY_FILE + 1)
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror or exc}") from exc
    if len(data) > _MAX_KEY_FILE:
        raise KeyFileError(f"{path}: too large for a key file")
    return data


def load_signing_key(path: str | Path) -> SigningKey:
    """Read a PEM ed25519 private key, or raise `KeyFileError` naming the file."""
    return SigningKey.from_pem(_read_key_file(path), source=str(path))


def load_verify_key(path: str | Path) -> VerifyKey:
    """Read a PEM ed25519 public key, or raise `KeyFileError` naming the file."""
    return VerifyKey.from_pem(_read_key_file(path), source=str(path))


@dataclass(frozen=True)
class KeyPairPaths:
    private: Path
    public: Path
    key_id: str


def _write_new(path: Path, data: bytes, mode: int, *, force: bool) -> None:
    """Write `data` to a temporary file with `mode`, fsync it and rename it over `path`."""
    if path.exists() and not force:
        raise KeyFileError(f"{path} already exists (use --force to replace it)")
    atomic_write(path, data, mode=mode)


def generate_keypair(out_dir: str | Path, *, force: bool = False) -> KeyPairPaths:
    """Create `out_dir/private.pem` (0600) and `out_dir/public.pem`; refuse to overwrite unless `force`."""
    out = Path(out_dir)
    key = SigningKey.generate()
    private, public = out / PRIVATE_KEY_FILE, out / PUBLIC_KEY_FILE
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not force:
            for path in (private, public):
                if path.exists():
                    raise KeyFileError(f"{path} already exists (use --force to replace it)")
        _write_new(private, key.to_pem(), 0o600, force=force)
        _write_new(public, key.public.to_pem(), 0o644, force=force)
    except OSError as exc:
        raise KeyFileError(f"cannot write keys to {out}: {exc.strerror or exc}") from exc
    return KeyPairPaths(private=private, public=public, key_id=key.public.key_id_hex)


__all__ = [
    "KEY_ID_SIZE",
    "PRIVATE_KEY_FILE",
    "PUBLIC_KEY_FILE",
    "SIGNATURE_SIZE",
    "KeyPairPaths",
    "KeySource",
    "SigningKey",
    "Verifier",
    "VerifyKey",
    "generate_keypair",
    "load_signing_key",
    "load_verify_key",
]
