"""A config release: named, versioned, immutable, content-addressed and signed with the fleet's
key, holding the documents (files) of one configuration target.

On disk (`.eacfg`), every length big-endian:

    magic "EACFG\\x01" (6) | manifest length (4) | manifest (JSON) | key id (8) | signature (64)
    | the documents, in the manifest's order, each exactly its stated size

The signature is ed25519 over the magic and the manifest's bytes; the manifest states each
document's name, size and sha256. A reader verifies the signature before it parses the manifest,
then checks every document's size and hash, so nothing of a release is used before all of it is
proven. Caps bound everything a hostile file could state: the manifest (`MANIFEST_MAX`), the
number of documents (`DOCUMENTS_MAX`) and each document's size (`max_document_bytes`, 64 KiB by
default). The release's id is the sha256 of the whole file: the same release built twice with the
same clock is the same id; a release is never changed, only replaced by a higher version.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from agent.core.files import atomic_write
from config_rollout.errors import ConfigReleaseError, MalformedRelease, ReleaseSignature
from rollout_engine.errors import InvalidVersion, WrongKey
from rollout_engine.keys import SigningKey, Verifier, signer_of
from rollout_engine.version import parse_version

MAGIC = b"EACFG\x01"
SUFFIX = ".eacfg"
KEY_ID_SIZE, SIGNATURE_SIZE = 8, 64
MANIFEST_MAX = 64 * 1024
DOCUMENTS_MAX = 64
DOCUMENT_MAX = 64 * 1024  # the default cap of one document

ReleaseName = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")]
DocumentName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")]
Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


class Document(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: DocumentName  # a file name of the target, never a path
    size: Annotated[int, msgspec.Meta(ge=0, le=2**31)]
    sha256: Sha256Hex


class ReleaseManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the signature vouches for."""

    name: ReleaseName  # the configuration target it is for ("app", "agent", ...)
    version: Annotated[str, msgspec.Meta(max_length=64)]
    documents: Annotated[tuple[Document, ...], msgspec.Meta(min_length=1, max_length=DOCUMENTS_MAX)]
    created_ms: Annotated[int, msgspec.Meta(ge=0)]
    format: int = 1


@dataclass(frozen=True)
class ConfigRelease:
    """A release whose signature, manifest and every document were checked."""

    manifest: ReleaseManifest
    documents: dict[str, bytes]  # name -> content, in the manifest's order
    release_id: str  # the sha256 of the whole file (hex)
    key_id: str  # the signing key's id (hex)

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> str:
        return self.manifest.version


def _check_version(version: str, source: str) -> None:
    try:
        parse_version(version)
    except InvalidVersion as exc:
        raise ConfigReleaseError(f"{source}: {exc}") from None


def build_release(name: str, version: str, files: Sequence[str | Path], key: SigningKey, *, created_ms: int,
                  max_document_bytes: int = DOCUMENT_MAX) -> bytes:
    """The bytes of a signed release of `files` (each kept under its file name)."""
    source = f"release {name}"
    try:
        msgspec.convert(name, ReleaseName)
    except msgspec.ValidationError:
        raise ConfigReleaseError(f"{source}: the name is 1-64 of a-z 0-9 _ . - (starting with a letter or digit)"
                                 ) from None
    _check_version(version, source)
    if not files:
        raise ConfigReleaseError(f"{source}: give at least one file")
    if len(files) > DOCUMENTS_MAX:
        raise ConfigReleaseError(f"{source}: {len(files)} files, over {DOCUMENTS_MAX}")
    documents: list[Document] = []
    contents: list[bytes] = []
    for file in files:
        path = Path(file)
        data = _read_capped(path, max_document_bytes, ConfigReleaseError, "over the cap of {most} per document")
        try:
            documents.append(Document(name=msgspec.convert(path.name, DocumentName), size=len(data),
                                      sha256=hashlib.sha256(data).hexdigest()))
        except msgspec.ValidationError:
            raise ConfigReleaseError(f"{path}: a document's name is 1-128 of A-Z a-z 0-9 _ . -") from None
        contents.append(data)
    names = [d.name for d in documents]
    if len(set(names)) != len(names):
        twice = sorted(n for n in set(names) if names.count(n) > 1)
        raise ConfigReleaseError(f"{source}: two files share a name ({', '.join(twice)})")
    manifest = msgspec.json.encode(ReleaseManifest(name=name, version=version, documents=tuple(documents),
                                                   created_ms=created_ms))
    if len(manifest) > MANIFEST_MAX:
        raise ConfigReleaseError(f"{source}: the manifest is over {MANIFEST_MAX} bytes")
    signature = key.sign(MAGIC + manifest)
    return b"".join([MAGIC, struct.pack(">I", len(manifest)), manifest, key.key_id, signature, *contents])


def write_release(data: bytes, out: str | Path, *, force: bool = False) -> Path:
    """Write a built release durably; an existing file is refused unless `force`."""
    path = Path(out)
    if path.exists() and not force:
        raise ConfigReleaseError(f"{path}: exists already (give --force to replace it)")
    try:
        atomic_write(path, data)
    except OSError as exc:
        raise ConfigReleaseError(f"{path}: {exc.strerror or exc}") from None
    return path


def parse_release(data: bytes, key: Verifier, *, source: str = "release",
                  max_document_bytes: int = DOCUMENT_MAX) -> ConfigRelease:
    """Verify `data` as a release signed with `key`: the signature first, then the manifest,
    then every document. A `ConfigReleaseError` says why not, naming `source`."""
    head = len(MAGIC) + 4
    if len(data) < head or not data.startswith(MAGIC):
        raise MalformedRelease(f"{source}: not a config release (bad magic)")
    (length,) = struct.unpack(">I", data[len(MAGIC):head])
    if length > MANIFEST_MAX:
        raise MalformedRelease(f"{source}: a manifest of {length} bytes, over {MANIFEST_MAX}")
    body = head + length + KEY_ID_SIZE + SIGNATURE_SIZE
    if len(data) < body:
        raise MalformedRelease(f"{source}: truncated ({len(data)} bytes)")
    manifest_bytes = data[head:head + length]
    key_id = data[head + length:head + length + KEY_ID_SIZE]
    signature = data[head + length + KEY_ID_SIZE:body]
    try:
        signer = signer_of(key, key_id)
    except WrongKey as exc:
        raise ReleaseSignature(f"{source}: {exc}") from None
    if not signer.verify(signature, MAGIC + manifest_bytes):
        raise ReleaseSignature(f"{source}: the signature does not verify (the release was changed after signing)")
    try:  # signed: now it may be parsed
        manifest = msgspec.json.decode(manifest_bytes, type=ReleaseManifest)
    except msgspec.DecodeError as exc:
        raise MalformedRelease(f"{source}: manifest: {exc}") from None
    if manifest.format != 1:
        raise MalformedRelease(f"{source}: release format {manifest.format}, this agent reads format 1")
    _check_version(manifest.version, source)
    documents: dict[str, bytes] = {}
    at = body
    for doc in manifest.documents:
        if doc.size > max_document_bytes:
            raise MalformedRelease(f"{source}: document {doc.name}: {doc.size} bytes, over the cap of "
                                   f"{max_document_bytes}")
        if doc.name in documents:
            raise MalformedRelease(f"{source}: document {doc.name} twice")
        content = data[at:at + doc.size]
        if len(content) != doc.size:
            raise MalformedRelease(f"{source}: truncated in document {doc.name}")
        if hashlib.sha256(content).hexdigest() != doc.sha256:
            raise MalformedRelease(f"{source}: document {doc.name}: its sha256 differs from the signed manifest")
        documents[doc.name] = content
        at += doc.size
    if at != len(data):
        raise MalformedRelease(f"{source}: {len(data) - at} bytes after the last document")
    return ConfigRelease(manifest, documents, hashlib.sha256(data).hexdigest(), key_id.hex())


def peek_release(data: bytes) -> ReleaseManifest:
    """The manifest of a release, NOT verified: only to name a release in a plan or a refusal
    (`parse_release` before using anything of it)."""
    head = len(MAGIC) + 4
    if len(data) < head or not data.startswith(MAGIC):
        raise MalformedRelease("not a config release (bad magic)")
    (length,) = struct.unpack(">I", data[len(MAGIC):head])
    if length > MANIFEST_MAX or len(data) < head + length:
        raise MalformedRelease("a config release cut short or with an oversized manifest")
    try:
        return msgspec.json.decode(data[head:head + length], type=ReleaseManifest)
    except msgspec.DecodeError as exc:
        raise MalformedRelease(f"manifest: {exc}") from None


def read_release(path: str | Path, key: Verifier, *, max_document_bytes: int = DOCUMENT_MAX) -> ConfigRelease:
    """`parse_release` of a file, read within the caps (a larger file is refused unread)."""
    p = Path(path)
    most = len(MAGIC) + 4 + MANIFEST_MAX + KEY_ID_SIZE + SIGNATURE_SIZE + DOCUMENTS_MAX * max_document_bytes
    data = _read_capped(p, most, MalformedRelease, "more than a release can hold ({most})")
    return parse_release(data, key, source=str(p), max_document_bytes=max_document_bytes)


def _read_capped(path: Path, most: int, error: type[ConfigReleaseError], over: str) -> bytes:
    """The bytes of `path`, refused unread (`error`, saying `over`) when it is larger than `most`."""
    try:
        size = path.stat().st_size
        data = path.read_bytes() if size <= most else b""
    except OSError as exc:
        raise ConfigReleaseError(f"{path}: {exc.strerror or exc}") from None
    if max(size, len(data)) > most:  # (also a file that grew between the two)
        raise error(f"{path}: {max(size, len(data))} bytes, " + over.format(most=most))
    return data


__all__ = ["DOCUMENT_MAX", "MAGIC", "SUFFIX", "ConfigRelease", "Document", "ReleaseManifest", "build_release",
           "parse_release", "peek_release", "read_release", "write_release"]
