"""The signed manifest: what an image is, who it is for, and the hashes that pin its bytes.

Byte layout of a signed manifest (the first part of every artifact file, and what the leader
sends a device before any chunk; integers big-endian):

    offset   size  field
    0        4     magic b"EAFW"
    4        2     format version (1)
    6        2     flags, reserved: 0
    8        4     manifest length M (1 .. 4 MiB)
    12       4     reserved: 0
    16       M     manifest: msgpack of `Manifest`
    16+M     8     key id: sha256(raw ed25519 public key)[:8]; all zero when unsigned
    24+M     64    ed25519 signature of SIGNING_DOMAIN + bytes[0:16+M]; all zero when unsigned

The signature covers the header and the manifest, so no byte of either can change unnoticed;
the manifest's chunk hashes and whole-image sha256 then pin every image byte.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
from typing import Annotated

import msgspec

from firmware_rollout.errors import (
    BadSignature,
    ChunkMismatch,
    Downgrade,
    Incompatible,
    InvalidVersion,
    MalformedArtifact,
    Unsigned,
    WrongKey,
)
from rollout_engine.keys import KEY_ID_SIZE, SIGNATURE_SIZE, SigningKey, Verifier, VerifyKey
from rollout_engine.version import Version

MAGIC = b"EAFW"
FORMAT_VERSION = 1
SIGNING_DOMAIN = b"edge-agent firmware manifest v1\x00"
HEADER = struct.Struct(">4sHHII")
HEADER_SIZE = HEADER.size  # 16
SIGNATURE_BLOCK_SIZE = KEY_ID_SIZE + SIGNATURE_SIZE  # 72
MAX_MANIFEST_SIZE = 4 * 1024 * 1024
MIN_CHUNK_SIZE = 256
MAX_CHUNK_SIZE = 16 * 1024 * 1024
DEFAULT_CHUNK_SIZE = 128 * 1024  # fits an MQTT payload with room to spare

Digest = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.+-]+$")]
HardwareName = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class Manifest(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What the signature vouches for. `chunks[i]` is the sha256 of chunk `i` of the image.

    Two layouts. Fixed: chunk `i` is image bytes `[i*chunk_size, (i+1)*chunk_size)`, the last
    one may be shorter. Content-defined (`chunk_lengths` set, what `firmware build` makes): chunk
    `i` is `chunk_lengths[i]` bytes long and starts where chunk `i-1` ended, and `chunk_size` is
    the largest chunk. Content-defined boundaries survive an insertion, so two versions of an
    image share most chunks and a device copies those from its active slot (a delta).

    Fields at their defaults are left out of the encoding: an agent that does not know a field
    added later still reads every manifest that does not use it (and refuses one that does)."""

    name: Name
    version: str
    size: Annotated[int, msgspec.Meta(ge=1)]
    sha256: Digest
    chunk_size: Annotated[int, msgspec.Meta(ge=MIN_CHUNK_SIZE, le=MAX_CHUNK_SIZE)]
    chunks: tuple[Digest, ...]
    hardware: tuple[HardwareName, ...] = ()  # empty: any hardware
    min_version: str | None = None  # the installed version must be at least this
    rollback: bool = False  # signed as an explicit rollback: may go below the installed version
    # a rollback replaces only these versions (empty: the leader refuses to roll it out)
    rollback_from: tuple[Annotated[str, msgspec.Meta(max_length=64)], ...] = ()
    created_ts: Annotated[int, msgspec.Meta(ge=0)] = 0  # ms since the Unix epoch
    # content-defined chunks: the length of each (empty: every chunk is `chunk_size` bytes)
    chunk_lengths: tuple[Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNK_SIZE)], ...] = ()
    # static HTTP(S) mirrors that serve this artifact as `{mirror}/{sha256}.eafw` (never trusted)
    mirrors: Annotated[tuple[Annotated[str, msgspec.Meta(min_length=8, max_length=512)], ...],
                       msgspec.Meta(max_length=16)] = ()

    @property
    def chunk_count(self) -> int:
        return len(self.chunks)

    @property
    def content_defined(self) -> bool:
        return bool(self.chunk_lengths)

    def chunk_length(self, index: int) -> int:
        """Size in bytes of chunk `index`."""
        if not 0 <= index < len(self.chunks):
            raise IndexError(f"chunk {index} out of range 0..{len(self.chunks) - 1}")
        if self.chunk_lengths:
            return self.chunk_lengths[index]
        return min(self.chunk_size, self.size - index * self.chunk_size)

    def layout(self) -> ChunkLayout:
        """Where each chunk lies in the image (computed once; keep it beside the manifest)."""
        return ChunkLayout(self)

    def parsed_version(self) -> Version:
        return Version.parse(self.version)

    def to_dict(self) -> dict[str, object]:
        """A JSON-friendly view (hashes as hex)."""
        return {
            "name": self.name,
            "version": self.version,
            "size": self.size,
            "sha256": self.sha256.hex(),
            "chunk_size": self.chunk_size,
            "chunk_count": len(self.chunks),
            "chunks": [c.hex() for c in self.chunks],
            "hardware": list(self.hardware),
            "min_version": self.min_version,
            "rollback": self.rollback,
            "rollback_from": list(self.rollback_from),
            "created_ts": self.created_ts,
            "chunking": "content-defined" if self.chunk_lengths else "fixed",
            "mirrors": list(self.mirrors),
        }


class ChunkLayout:
    """Offsets of a manifest's chunks, and which chunk holds a given hash: what a delta and a
    range request need, made once per manifest rather than summed per chunk."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        lengths = manifest.chunk_lengths or [manifest.chunk_length(i) for i in range(manifest.chunk_count)]
        self.lengths: tuple[int, ...] = tuple(lengths)
        self.offsets: tuple[int, ...] = (0, *itertools.accumulate(self.lengths))[:-1]

    def offset(self, index: int) -> int:
        return self.offsets[index]

    def length(self, index: int) -> int:
        return self.lengths[index]

    def span(self, first: int, last: int) -> tuple[int, int]:
        """Image bytes `[start, end)` of chunks `first..last` inclusive."""
        return self.offsets[first], self.offsets[last] + self.lengths[last]

    def by_hash(self) -> dict[bytes, int]:
        """sha256 -> the first chunk index with it."""
        found: dict[bytes, int] = {}
        for index, digest in enumerate(self.manifest.chunks):
            found.setdefault(digest, index)
        return found


_manifest_encoder = msgspec.msgpack.Encoder()
_manifest_decoder = msgspec.msgpack.Decoder(Manifest)


def validate_manifest(manifest: Manifest) -> Manifest:
    """Check what a Struct type cannot: versions parse, hash count matches the size."""
    try:
        Version.parse(manifest.version)
        if manifest.min_version is not None:
            Version.parse(manifest.min_version)
        for version in manifest.rollback_from:
            Version.parse(version)
    except InvalidVersion as exc:
        raise MalformedArtifact(f"manifest: {exc}") from exc
    if manifest.rollback_from and not manifest.rollback:
        raise MalformedArtifact("manifest: rollback_from is set but the image is not signed as a rollback")
    for mirror in manifest.mirrors:
        if not mirror.startswith(("http://", "https://")):
            raise MalformedArtifact(f"manifest: mirror {mirror!r} is not an http:// or https:// URL")
    if manifest.chunk_lengths:
        _validate_content_defined(manifest)
        return manifest
    expected = math.ceil(manifest.size / manifest.chunk_size)
    if len(manifest.chunks) != expected:
        raise MalformedArtifact(
            f"manifest: {len(manifest.chunks)} chunk hashes for {manifest.size} bytes in chunks of "
            f"{manifest.chunk_size} (expected {expected})"
        )
    return manifest


def _validate_content_defined(manifest: Manifest) -> None:
    lengths = manifest.chunk_lengths
    if len(lengths) != len(manifest.chunks):
        raise MalformedArtifact(f"manifest: {len(manifest.chunks)} chunk hashes but {len(lengths)} chunk lengths")
    if sum(lengths) != manifest.size:
        raise MalformedArtifact(f"manifest: the chunk lengths add up to {sum(lengths)} bytes, the image has "
                                f"{manifest.size}")
    if max(lengths) != manifest.chunk_size:
        raise MalformedArtifact(f"manifest: chunk_size {manifest.chunk_size} is not the largest chunk "
                                f"({max(lengths)} bytes)")


def encode_manifest(manifest: Manifest) -> bytes:
    """Encode `manifest`, checking every field constraint on the way (Struct init does not)."""
    data = _manifest_encoder.encode(manifest)
    decode_manifest(data)
    return data


def decode_manifest(data: bytes) -> Manifest:
    try:
        manifest = _manifest_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedArtifact(f"malformed manifest: {exc}") from exc
    return validate_manifest(manifest)


def _check_signature(signed_part: bytes, key_id: bytes, signature: bytes, key: Verifier) -> None:
    if not any(key_id) and not any(signature):
        raise Unsigned("artifact is unsigned (sign it with `edge-agent firmware sign`)")
    if not isinstance(key, VerifyKey):  # the key the trust document lists for that id, or WrongKey
        signer = key.signer(key_id)
        if not signer.verify(signature, SIGNING_DOMAIN + signed_part):
            raise BadSignature(f"bad signature: manifest signature does not verify against key {signer.key_id_hex}")
        return
    valid = key.verify(signature, SIGNING_DOMAIN + signed_part)
    if valid and key_id == key.key_id:
        return
    if valid:  # the pinned key signed it, but the key id beside the signature was altered
        raise BadSignature(f"bad signature: key id field {key_id.hex()} does not match signer {key.key_id_hex}")
    if key_id != key.key_id:
        raise WrongKey(f"bad signature: signed by key {key_id.hex()}, the pinned key is {key.key_id_hex}")
    raise BadSignature(f"bad signature: manifest signature does not verify against key {key.key_id_hex}")


class SignedManifest(msgspec.Struct, frozen=True):
    """A parsed signed manifest. `raw` is its exact byte form (header to signature)."""

    raw: bytes
    manifest_length: int
    manifest: Manifest

    @property
    def size(self) -> int:
        """Bytes of the signed manifest; the image starts at this offset in an artifact."""
        return len(self.raw)

    @property
    def signed_part(self) -> bytes:
        return self.raw[: HEADER_SIZE + self.manifest_length]

    @property
    def key_id(self) -> bytes:
        start = HEADER_SIZE + self.manifest_length
        return self.raw[start : start + KEY_ID_SIZE]

    @property
    def signature(self) -> bytes:
        start = HEADER_SIZE + self.manifest_length + KEY_ID_SIZE
        return self.raw[start : start + SIGNATURE_SIZE]

    @property
    def is_signed(self) -> bool:
        return any(self.key_id) or any(self.signature)

    def verify(self, key: Verifier) -> SignedManifest:
        """Raise `BadSignature` (or `WrongKey`, `Unsigned`) unless `key` signed it; return self."""
        _check_signature(self.signed_part, self.key_id, self.signature, key)
        return self

    def signed_with(self, key: SigningKey) -> SignedManifest:
        """The same manifest with a fresh signature by `key`."""
        part = self.signed_part
        raw = part + key.key_id + key.sign(SIGNING_DOMAIN + part)
        return SignedManifest(raw, self.manifest_length, self.manifest)


def make_signed_manifest(manifest: Manifest, key: SigningKey | None) -> SignedManifest:
    """Encode `manifest` with its header and sign it (all-zero signature block when `key` is None)."""
    body = encode_manifest(manifest)
    if len(body) > MAX_MANIFEST_SIZE:
        raise MalformedArtifact(f"manifest is {len(body)} bytes, over {MAX_MANIFEST_SIZE}; use a larger chunk size")
    header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(body), 0)
    unsigned = SignedManifest(header + body + bytes(SIGNATURE_BLOCK_SIZE), len(body), manifest)
    return unsigned.signed_with(key) if key is not None else unsigned


def parse_header(header: bytes) -> int:
    """Check the 16-byte header; return the manifest length M."""
    if len(header) < HEADER_SIZE:
        raise MalformedArtifact(f"truncated header: {len(header)} of {HEADER_SIZE} bytes")
    magic, fmt, flags, length, reserved = HEADER.unpack(header[:HEADER_SIZE])
    if magic != MAGIC:
        raise MalformedArtifact("not a firmware artifact (bad magic)")
    if fmt != FORMAT_VERSION:
        raise MalformedArtifact(f"unsupported artifact format {fmt} (this agent reads {FORMAT_VERSION})")
    if flags != 0 or reserved != 0:
        raise MalformedArtifact("malformed header: reserved fields are not zero")
    if not 1 <= length <= MAX_MANIFEST_SIZE:
        raise MalformedArtifact(f"malformed header: manifest length {length} out of range")
    return int(length)


def parse_signed_manifest(data: bytes) -> SignedManifest:
    """Parse the structure (no signature check). `data` may be followed by image bytes."""
    length = parse_header(data)
    total = HEADER_SIZE + length + SIGNATURE_BLOCK_SIZE
    if len(data) < total:
        raise MalformedArtifact(f"truncated signed manifest: {len(data)} of {total} bytes")
    manifest = decode_manifest(bytes(data[HEADER_SIZE : HEADER_SIZE + length]))
    return SignedManifest(bytes(data[:total]), length, manifest)


def verify_signed_manifest(data: bytes, key: Verifier) -> SignedManifest:
    """Parse and check the signature. The signature is checked before the manifest is trusted;
    a manifest that does not decode is reported as malformed either way."""
    length = parse_header(data)
    total = HEADER_SIZE + length + SIGNATURE_BLOCK_SIZE
    if len(data) < total:
        raise MalformedArtifact(f"truncated signed manifest: {len(data)} of {total} bytes")
    end = HEADER_SIZE + length
    _check_signature(
        bytes(data[:end]), bytes(data[end : end + KEY_ID_SIZE]), bytes(data[end + KEY_ID_SIZE : total]), key
    )
    return parse_signed_manifest(data)


def check_policy(manifest: Manifest, *, hardware: str | None = None, installed_version: str | None = None,
                 image: str | None = None) -> None:
    """Refuse another image than this device runs (a router's image on a camera), one for other
    hardware, one that needs a newer installed version first, or a downgrade that is not signed
    as a rollback. `None` skips the check that needs it."""
    if image is not None and manifest.name != image:
        raise Incompatible(f"incompatible image: this is a {manifest.name!r} image, this device runs {image!r}")
    if hardware is not None and manifest.hardware and hardware not in manifest.hardware:
        raise Incompatible(
            f"incompatible hardware: image is for {', '.join(manifest.hardware)}, this device is {hardware}"
        )
    if installed_version is None:
        return
    installed = Version.parse(installed_version)
    if manifest.min_version is not None and installed < Version.parse(manifest.min_version):
        raise Incompatible(
            f"incompatible: image needs at least version {manifest.min_version} installed, "
            f"this device runs {installed_version}"
        )
    if manifest.rollback and manifest.rollback_from and installed_version not in manifest.rollback_from:
        raise Downgrade(
            f"rollback refused: this rollback replaces only version {', '.join(manifest.rollback_from)}, "
            f"this device runs {installed_version}"
        )
    if manifest.parsed_version() < installed and not manifest.rollback:
        raise Downgrade(
            f"downgrade refused: image version {manifest.version} is lower than installed {installed_version} "
            "and is not signed as a rollback"
        )


class ImageVerifier:
    """Checks image bytes chunk by chunk against a manifest, in order, with bounded memory."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._whole = hashlib.sha256()
        self._next = 0
        self._seen = 0

    @property
    def next_index(self) -> int:
        return self._next

    def check_chunk(self, index: int, data: bytes) -> None:
        """Raise `ChunkMismatch` if `data` is not chunk `index` (chunks must come in order)."""
        manifest = self.manifest
        if index != self._next:
            raise ChunkMismatch(f"chunk {index} out of order (expected {self._next})")
        if index >= manifest.chunk_count:
            raise ChunkMismatch(f"size mismatch: more image data than the {manifest.size} bytes in the manifest")
        expected_length = manifest.chunk_length(index)
        if len(data) != expected_length:
            raise ChunkMismatch(
                f"size mismatch: chunk {index} of {manifest.chunk_count} has {len(data)} bytes, "
                f"expected {expected_length}"
            )
        if hashlib.sha256(data).digest() != manifest.chunks[index]:
            raise ChunkMismatch(f"tampered chunk: chunk {index} of {manifest.chunk_count} sha256 mismatch")
        self._whole.update(data)
        self._next += 1
        self._seen += len(data)

    def finish(self) -> None:
        """Raise `ChunkMismatch` unless every chunk was seen and the whole image hash matches."""
        manifest = self.manifest
        if self._next != manifest.chunk_count or self._seen != manifest.size:
            raise ChunkMismatch(f"size mismatch: image has {self._seen} bytes, manifest says {manifest.size}")
        if self._whole.digest() != manifest.sha256:
            raise ChunkMismatch("image sha256 mismatch: the chunks match but the whole image does not")


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "ChunkLayout",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_CHUNK_SIZE",
    "MIN_CHUNK_SIZE",
    "SIGNATURE_BLOCK_SIZE",
    "ImageVerifier",
    "Manifest",
    "SignedManifest",
    "check_policy",
    "decode_manifest",
    "encode_manifest",
    "make_signed_manifest",
    "parse_header",
    "parse_signed_manifest",
    "verify_signed_manifest",
]
