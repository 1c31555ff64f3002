"""Firmware artifact files: one file holding a signed manifest followed by the image.

    [ signed manifest: header | manifest | key id | signature ]  (see `firmware_rollout.artifact.manifest`)
    [ image: `manifest.size` bytes, in the manifest's chunks ]

Nothing follows the image: a longer or shorter file is a size mismatch. Every function here
streams the image chunk by chunk, so a 100 MB image needs one chunk of memory, not 100 MB.
Files are written to a temporary name, fsynced and renamed into place.

`build_artifact` hashes the image, writes the manifest and the image; `sign_artifact` (re)signs
an existing artifact after checking its image against the manifest; `verify_artifact` checks the
signature against a pinned key, every chunk, the whole image, then the device policy (hardware,
minimum version, downgrade); `inspect_artifact` parses without trusting.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from agent.core.files import fsync_dir
from firmware_rollout.artifact.manifest import (
    DEFAULT_CHUNK_SIZE,
    HEADER_SIZE,
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    SIGNATURE_BLOCK_SIZE,
    ChunkLayout,
    ImageVerifier,
    Manifest,
    SignedManifest,
    check_policy,
    make_signed_manifest,
    parse_header,
    parse_signed_manifest,
    verify_signed_manifest,
)
from firmware_rollout.errors import ArtifactError, MalformedArtifact
from rollout_engine.keys import SigningKey, Verifier
from rollout_engine.version import Version

_COPY_BLOCK = 1024 * 1024


def _io_error(action: str, path: Path, exc: OSError) -> ArtifactError:
    return ArtifactError(f"cannot {action} {path}: {exc.strerror or exc}")


def _read_exact(handle: BinaryIO, size: int) -> bytes:
    data = handle.read(size)
    return data if data is not None else b""


def read_signed_manifest_from(handle: BinaryIO) -> SignedManifest:
    """Read and parse the signed manifest at the start of an open artifact (no signature check)."""
    header = _read_exact(handle, HEADER_SIZE)
    length = parse_header(header)
    rest = _read_exact(handle, length + SIGNATURE_BLOCK_SIZE)
    return parse_signed_manifest(header + rest)


def _open(path: Path) -> BinaryIO:
    try:
        return path.open("rb")
    except OSError as exc:
        raise _io_error("read", path, exc) from exc


def read_signed_manifest(path: str | Path) -> SignedManifest:
    """The signed manifest of the artifact at `path`, parsed but not yet trusted."""
    path = Path(path)
    with _open(path) as handle:
        try:
            return read_signed_manifest_from(handle)
        except OSError as exc:
            raise _io_error("read", path, exc) from exc


def _image_size_on_disk(path: Path, signed: SignedManifest) -> int:
    try:
        return path.stat().st_size - signed.size
    except OSError as exc:
        raise _io_error("stat", path, exc) from exc


def iter_image_chunks(handle: BinaryIO, manifest: Manifest) -> Iterator[tuple[int, bytes]]:
    """Yield `(index, bytes)` for each chunk the manifest names, reading from the current offset."""
    for index in range(manifest.chunk_count):
        yield index, _read_exact(handle, manifest.chunk_length(index))


def check_image(handle: BinaryIO, manifest: Manifest) -> None:
    """Stream the image from `handle` and raise `ChunkMismatch` at the first difference."""
    verifier = ImageVerifier(manifest)
    for index, data in iter_image_chunks(handle, manifest):
        verifier.check_chunk(index, data)
    verifier.finish()


def verify_artifact(
    path: str | Path,
    key: Verifier,
    *,
    hardware: str | None = None,
    installed_version: str | None = None,
    image: str | None = None,
) -> SignedManifest:
    """Check everything a device checks before installing; return the verified signed manifest.

    Order: header and signature (nothing is trusted before), manifest, device policy, file size,
    then every chunk and the whole image hash. Raises a subclass of `ArtifactError` naming the reason.
    """
    path = Path(path)
    with _open(path) as handle:
        try:
            header = _read_exact(handle, HEADER_SIZE)
            length = parse_header(header)
            signed = verify_signed_manifest(header + _read_exact(handle, length + SIGNATURE_BLOCK_SIZE), key)
            manifest = signed.manifest
            check_policy(manifest, hardware=hardware, installed_version=installed_version, image=image)
            on_disk = _image_size_on_disk(path, signed)
            if on_disk != manifest.size:
                raise MalformedArtifact(
                    f"size mismatch: artifact holds {max(on_disk, 0)} image bytes, manifest says {manifest.size}"
                )
            check_image(handle, manifest)
        except OSError as exc:
            raise _io_error("read", path, exc) from exc
    return signed


@dataclass(frozen=True)
class ArtifactInfo:
    """What `inspect` shows: the manifest, the signer's key id, and the file's own checks."""

    path: Path
    signed: SignedManifest
    file_size: int

    @property
    def manifest(self) -> Manifest:
        return self.signed.manifest

    def to_dict(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "file_size": self.file_size,
            "signed": self.signed.is_signed,
            "key_id": self.signed.key_id.hex() if self.signed.is_signed else None,
            "image_offset": self.signed.size,
            "manifest": self.manifest.to_dict(),
        }


def inspect_artifact(path: str | Path) -> ArtifactInfo:
    """Parse an artifact without a key: structure and manifest only."""
    path = Path(path)
    signed = read_signed_manifest(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise _io_error("stat", path, exc) from exc
    return ArtifactInfo(path=path, signed=signed, file_size=size)


def _hash_image(image: Path, chunk_size: int) -> tuple[int, bytes, tuple[bytes, ...]]:
    whole = hashlib.sha256()
    chunks: list[bytes] = []
    size = 0
    with image.open("rb") as handle:
        while True:
            data = handle.read(chunk_size)
            if not data:
                break
            whole.update(data)
            chunks.append(hashlib.sha256(data).digest())
            size += len(data)
    return size, whole.digest(), tuple(chunks)


@dataclass(frozen=True)
class ContentDefined:
    """FastCDC chunk bounds for `firmware build`. The defaults are casync's (16/64/256 KiB), so a
    delta costs about what RAUC's adaptive updates cost; smaller chunks share more between
    versions but make a longer manifest (36 bytes a chunk)."""

    min_size: int = 16 * 1024
    avg_size: int = 64 * 1024
    max_size: int = 256 * 1024

    def __post_init__(self) -> None:
        if not (MIN_CHUNK_SIZE <= self.min_size <= self.avg_size <= self.max_size <= MAX_CHUNK_SIZE):
            raise ArtifactError(
                f"content-defined chunk sizes must satisfy {MIN_CHUNK_SIZE} <= min <= avg <= max <= "
                f"{MAX_CHUNK_SIZE}: got {self.min_size}/{self.avg_size}/{self.max_size}")


def _hash_image_content_defined(image: Path, cdc: ContentDefined) -> tuple[int, bytes, tuple[bytes, ...],
                                                                          tuple[int, ...]]:
    try:
        from fastcdc import fastcdc  # only `firmware build` needs it: kept off every other import path
    except ImportError:
        raise ArtifactError("content-defined chunking needs the fastcdc package: pip install 'edge-agent[cli]' "
                            "(or build with a fixed --chunk-size)") from None
    whole = hashlib.sha256()
    chunks: list[bytes] = []
    lengths: list[int] = []
    with image.open("rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            return 0, whole.digest(), (), ()
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for chunk in fastcdc(view, min_size=cdc.min_size, avg_size=cdc.avg_size, max_size=cdc.max_size):
                    data = view[chunk.offset: chunk.offset + chunk.length]
                    whole.update(data)
                    chunks.append(hashlib.sha256(data).digest())
                    lengths.append(chunk.length)
                    del data
            finally:
                view.release()
    return size, whole.digest(), tuple(chunks), tuple(lengths)


def _write_artifact(out: Path, signed: SignedManifest, image: BinaryIO, size: int) -> None:
    """Write signed manifest + `size` image bytes to `out` via a temporary file and rename."""
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with tmp.open("wb") as handle:
            handle.write(signed.raw)
            remaining = size
            while remaining:
                block = image.read(min(_COPY_BLOCK, remaining))
                if not block:
                    raise MalformedArtifact(f"image shrank while writing {out}")
                handle.write(block)
                remaining -= len(block)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def build_artifact(
    image: str | Path,
    out: str | Path,
    *,
    name: str,
    version: str,
    key: SigningKey | None,
    created_ts: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    content_defined: ContentDefined | None = None,
    hardware: Sequence[str] = (),
    min_version: str | None = None,
    rollback: bool = False,
    rollback_from: Sequence[str] = (),
    mirrors: Sequence[str] = (),
) -> SignedManifest:
    """Hash `image` and write the artifact `out`, signed with `key` (unsigned when None): in
    content-defined chunks when `content_defined` is given, else in chunks of `chunk_size`."""
    image, out = Path(image), Path(out)
    Version.parse(version)
    if min_version is not None:
        Version.parse(min_version)
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise ArtifactError(f"chunk size {chunk_size} out of range {MIN_CHUNK_SIZE}..{MAX_CHUNK_SIZE}")
    lengths: tuple[int, ...] = ()
    try:
        if content_defined is not None:
            size, digest, chunks, lengths = _hash_image_content_defined(image, content_defined)
            chunk_size = max(lengths, default=MIN_CHUNK_SIZE)
        else:
            size, digest, chunks = _hash_image(image, chunk_size)
    except OSError as exc:
        raise _io_error("read image", image, exc) from exc
    if size == 0:
        raise ArtifactError(f"image {image} is empty")
    manifest = Manifest(
        name=name,
        version=version,
        size=size,
        sha256=digest,
        chunk_size=chunk_size,
        chunks=chunks,
        hardware=tuple(hardware),
        min_version=min_version,
        rollback=rollback,
        rollback_from=tuple(rollback_from),
        created_ts=created_ts,
        chunk_lengths=lengths,
        mirrors=tuple(mirrors),
    )
    signed = make_signed_manifest(manifest, key)
    try:
        with image.open("rb") as handle:
            _write_artifact(out, signed, handle, size)
    except OSError as exc:
        raise _io_error("write", out, exc) from exc
    return signed


def sign_artifact(path: str | Path, key: SigningKey, *, out: str | Path | None = None) -> SignedManifest:
    """(Re)sign the artifact at `path` with `key` after checking its image against the manifest.

    With `out`, a signed copy is written there; without, the 72-byte signature block is replaced
    in place and fsynced (the image is not rewritten).
    """
    path = Path(path)
    with _open(path) as handle:
        try:
            signed = read_signed_manifest_from(handle)
            on_disk = _image_size_on_disk(path, signed)
            if on_disk != signed.manifest.size:
                raise MalformedArtifact(
                    f"size mismatch: artifact holds {max(on_disk, 0)} image bytes, manifest says {signed.manifest.size}"
                )
            check_image(handle, signed.manifest)
            resigned = signed.signed_with(key)
            if out is not None:
                handle.seek(signed.size)
                _write_artifact(Path(out), resigned, handle, signed.manifest.size)
                return resigned
        except OSError as exc:
            raise _io_error("sign", path, exc) from exc
    try:
        with path.open("r+b") as handle:
            handle.write(resigned.raw)  # same length: header and manifest are unchanged
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise _io_error("write", path, exc) from exc
    return resigned


def read_image_chunk(path: str | Path, signed: SignedManifest, index: int, layout: ChunkLayout | None = None) -> bytes:
    """Chunk `index` of the image inside the artifact at `path` (not verified). Pass the
    manifest's `layout` when reading many chunks of a content-defined image."""
    path = Path(path)
    layout = layout or signed.manifest.layout()
    length = layout.length(index)
    with _open(path) as handle:
        try:
            handle.seek(signed.size + layout.offset(index))
            return _read_exact(handle, length)
        except OSError as exc:
            raise _io_error("read", path, exc) from exc


__all__ = [
    "ArtifactInfo",
    "ContentDefined",
    "build_artifact",
    "check_image",
    "inspect_artifact",
    "iter_image_chunks",
    "read_image_chunk",
    "read_signed_manifest",
    "read_signed_manifest_from",
    "sign_artifact",
    "verify_artifact",
]
