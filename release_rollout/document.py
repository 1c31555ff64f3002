"""A release document: a device's whole desired state, signed with the fleet's key.

It names each part by what it is (a firmware, a configuration target's release, an application),
its version, and the sha256 and size of the file that carries it (the part's own signed
artifact: a `.eafw`, an `.eacfg`, an `.eaapp`, kept beside the document), and the order a device
converges in: stages, one after the other, the parts of one stage side by side (Mender's
orchestrator manifests are the model). A firmware goes alone in the first stage: the other parts
converge on its trial boot, and it is committed only when all of them are healthy.

On disk (`.earel`), every length big-endian:

    magic "EAREL\\x01" (6) | document length (4) | document (JSON) | key id (8) | signature (64)

The signature is ed25519 over the magic and the document's bytes. A reader verifies the
signature before it parses the document; every field is bounded (`PARTS_MAX` parts,
`STAGES_MAX` stages, names, versions, file names that are never paths).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

from release_rollout.errors import MalformedRelease, ReleaseSignature
from rollout_engine.errors import InvalidVersion, WrongKey
from rollout_engine.keys import SigningKey, Verifier, signer_of
from rollout_engine.version import parse_version

MAGIC = b"EAREL\x01"
SUFFIX = ".earel"
KEY_ID_SIZE, SIGNATURE_SIZE = 8, 64
DOCUMENT_MAX = 64 * 1024
FILE_MAX = len(MAGIC) + 4 + DOCUMENT_MAX + KEY_ID_SIZE + SIGNATURE_SIZE
PARTS_MAX = 32
STAGES_MAX = 8

PartKind = Literal["firmware", "config", "app"]
PART_KINDS: tuple[PartKind, ...] = ("firmware", "config", "app")
ReleaseName = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")]
PartName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")]
FileName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$")]
PartId = Annotated[str, msgspec.Meta(pattern=r"^(firmware|(config|app):[A-Za-z0-9][A-Za-z0-9_.+-]{0,63})$")]
VersionText = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


class Part(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One part of a release: what it is, its version, and the file that carries it."""

    kind: PartKind
    name: PartName  # the firmware's name, the configuration target, the application
    version: VersionText
    file: FileName  # the part's artifact, beside the document (a file name, never a path)
    sha256: Sha256Hex
    size: Annotated[int, msgspec.Meta(ge=0, le=2**40)]

    @property
    def id(self) -> str:
        """How the order names it: `firmware`, `config:TARGET`, `app:NAME`."""
        return part_id(self.kind, self.name)


class ReleaseDocument(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the signature vouches for."""

    name: ReleaseName  # the release line ("gateway", "kiosk")
    version: VersionText
    parts: Annotated[tuple[Part, ...], msgspec.Meta(min_length=1, max_length=PARTS_MAX)]
    order: Annotated[tuple[Annotated[tuple[PartId, ...], msgspec.Meta(min_length=1, max_length=PARTS_MAX)], ...],
                     msgspec.Meta(min_length=1, max_length=STAGES_MAX)]
    created_ms: Annotated[int, msgspec.Meta(ge=0)]
    format: int = 1

    def part(self, pid: str) -> Part:
        return next(p for p in self.parts if p.id == pid)

    @property
    def firmware(self) -> Part | None:
        return next((p for p in self.parts if p.kind == "firmware"), None)

    def says(self) -> str:
        """Its parts in a few words: "firmware 1.1.0, config app 1.1.0, app hello 2.0.0"."""
        return ", ".join(f"{p.kind} {p.version}" if p.kind == "firmware" else f"{p.kind} {p.name} {p.version}"
                         for p in self.parts)


@dataclass(frozen=True)
class SignedRelease:
    """A release document whose signature and fields were checked."""

    document: ReleaseDocument
    raw: bytes  # the whole signed file
    release_id: str  # the sha256 of `raw` (hex)

    @property
    def name(self) -> str:
        return self.document.name

    @property
    def version(self) -> str:
        return self.document.version


def part_id(kind: str, name: str) -> str:
    return "firmware" if kind == "firmware" else f"{kind}:{name}"


def default_order(parts: Sequence[Part]) -> tuple[tuple[str, ...], ...]:
    """The firmware first, then the configuration, then the applications."""
    stages = [tuple(p.id for p in parts if p.kind == kind) for kind in PART_KINDS]
    return tuple(s for s in stages if s)


def check_document(document: ReleaseDocument, source: str) -> None:
    """The rules the types cannot say: a `MalformedRelease` naming `source` and the first broken."""
    try:
        parse_version(document.version)
        for p in document.parts:
            parse_version(p.version)
    except InvalidVersion as exc:
        raise MalformedRelease(f"{source}: {exc}") from None
    ids = [p.id for p in document.parts]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise MalformedRelease(f"{source}: parts: {', '.join(twice)} named twice (one version of each part)")
    ordered = [i for stage in document.order for i in stage]
    unknown = sorted(set(ordered) - set(ids))
    if unknown:
        raise MalformedRelease(f"{source}: order: {', '.join(unknown)} is no part of the release")
    if len(ordered) != len(set(ordered)) or set(ordered) != set(ids):
        missing = sorted(set(ids) - set(ordered))
        raise MalformedRelease(f"{source}: order: each part once" + (f" ({', '.join(missing)} missing)"
                                                                      if missing else " (one is named twice)"))
    if "firmware" in ids and document.order[0] != ("firmware",):
        raise MalformedRelease(f"{source}: order: the firmware goes alone in the first stage (the other parts"
                               " converge on its trial boot)")


def build_document(name: str, version: str, parts: Sequence[Part], key: SigningKey, *, created_ms: int,
                   order: Sequence[Sequence[str]] | None = None, source: str = "release") -> bytes:
    """The bytes of a signed release document."""
    try:
        document = msgspec.convert({"name": name, "version": version, "parts": [msgspec.to_builtins(p) for p in parts],
                                    "order": [list(s) for s in order] if order is not None
                                    else [list(s) for s in default_order(parts)],
                                    "created_ms": created_ms}, type=ReleaseDocument)
    except msgspec.ValidationError as exc:
        raise MalformedRelease(f"{source}: {exc}") from None
    check_document(document, source)
    body = msgspec.json.encode(document)
    if len(body) > DOCUMENT_MAX:
        raise MalformedRelease(f"{source}: the document is over {DOCUMENT_MAX} bytes")
    return b"".join([MAGIC, struct.pack(">I", len(body)), body, key.key_id, key.sign(MAGIC + body)])


def _split(data: bytes, source: str) -> tuple[bytes, bytes, bytes]:
    head = len(MAGIC) + 4
    if len(data) < head or not data.startswith(MAGIC):
        raise MalformedRelease(f"{source}: not a release document (bad magic)")
    (length,) = struct.unpack(">I", data[len(MAGIC):head])
    if length > DOCUMENT_MAX:
        raise MalformedRelease(f"{source}: a document of {length} bytes, over {DOCUMENT_MAX}")
    end = head + length + KEY_ID_SIZE + SIGNATURE_SIZE
    if len(data) != end:
        raise MalformedRelease(f"{source}: {len(data)} bytes, a document of {length} takes {end}")
    return data[head:head + length], data[head + length:head + length + KEY_ID_SIZE], data[end - SIGNATURE_SIZE:end]


def _decode(body: bytes, source: str) -> ReleaseDocument:
    try:
        document = msgspec.json.decode(body, type=ReleaseDocument)
    except msgspec.DecodeError as exc:
        raise MalformedRelease(f"{source}: document: {exc}") from None
    if document.format != 1:
        raise MalformedRelease(f"{source}: release format {document.format}, this agent reads format 1")
    return document


def parse_release(data: bytes, key: Verifier, *, source: str = "release") -> SignedRelease:
    """Verify `data` as a release document signed with `key`: the signature first, then the
    document. A `ReleaseError` says why not, naming `source`."""
    body, key_id, signature = _split(data, source)
    try:
        signer = signer_of(key, key_id)
    except WrongKey as exc:
        raise ReleaseSignature(f"{source}: {exc}") from None
    if not signer.verify(signature, MAGIC + body):
        raise ReleaseSignature(f"{source}: the signature does not verify (the release was changed after signing)")
    document = _decode(body, source)
    check_document(document, source)
    return SignedRelease(document, data, hashlib.sha256(data).hexdigest())


def peek_release(data: bytes, *, source: str = "release") -> ReleaseDocument:
    """The document, NOT verified: only to name a release in a plan or a report."""
    return _decode(_split(data, source)[0], source)


__all__ = ["FILE_MAX", "MAGIC", "PART_KINDS", "SUFFIX", "Part", "PartKind", "ReleaseDocument", "SignedRelease",
           "build_document", "check_document", "default_order", "parse_release", "part_id", "peek_release"]
