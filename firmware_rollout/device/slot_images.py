"""An image streamed into a slot target (a block device, a partition, a file) chunk by chunk.

Every backend writes the same way: the signed manifest first (its signature checked against the
installer's own pinned key when it has one), then each chunk at its offset, its sha256 checked
against that manifest before a byte is written and fsynced before the call returns, then the
whole image read back from the target and checked before the slot may be armed. So the updater
needs no second copy of the image (an SD card has no room for one), and an installer that runs
as root trusts nothing its caller sends but the key it loaded itself.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from firmware_rollout.artifact.files import check_image
from firmware_rollout.artifact.keys import VerifyKey
from firmware_rollout.artifact.manifest import Manifest, parse_signed_manifest, verify_signed_manifest
from firmware_rollout.errors import ChunkMismatch, InstallError


def target_capacity(path: Path) -> int:
    """Bytes a slot target holds: a block device's size, or a file's (a file grows if it must)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def write_at(path: Path, offset: int, data: bytes) -> None:
    """Write `data` at `offset` of an existing target and fsync it before returning."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, offset)
            view = view[written:]
            offset += written
        os.fsync(fd)
    finally:
        os.close(fd)


def check_target(path: Path, manifest: Manifest) -> None:
    """The first `manifest.size` bytes of `path` are the image the manifest describes."""
    with path.open("rb") as handle:
        check_image(handle, manifest)


class SlotImages:
    """What is being written into which slot target, and the checks on every write.

    `grow`: the targets are plain files that may be extended (the directory installer and a
    RAUC bundle file); otherwise a target must already hold the whole image (a partition)."""

    def __init__(self, targets: Mapping[str, Path], *, verify_key: VerifyKey | None, grow: bool = False) -> None:
        self.targets = dict(targets)
        self._key = verify_key
        self._grow = grow
        self._manifests: dict[str, Manifest] = {}
        self._checked: dict[str, bytes] = {}  # slot -> the manifest's image hash it was checked against

    def target(self, slot: str) -> Path:
        try:
            return self.targets[slot]
        except KeyError:
            raise InstallError(f"no slot {slot!r} here (slots: {', '.join(sorted(self.targets))})") from None

    def open(self, slot: str, signed_manifest: bytes) -> Manifest:
        """Take the manifest of the image `slot` is to receive; idempotent (a resumed download
        opens the slot again). Raises `ArtifactError` for a manifest the key does not vouch for."""
        path = self.target(slot)
        signed = (verify_signed_manifest(signed_manifest, self._key) if self._key is not None
                  else parse_signed_manifest(signed_manifest))
        manifest = signed.manifest
        try:
            if self._grow:
                path.parent.mkdir(parents=True, exist_ok=True)
                if not path.exists():
                    path.touch()
            capacity = target_capacity(path)
        except OSError as exc:
            raise InstallError(f"cannot open slot {slot} ({path}): {exc.strerror or exc}") from exc
        if not self._grow and manifest.size > capacity:
            raise InstallError(f"the image of {manifest.size} bytes does not fit slot {slot} ({path}, "
                               f"{capacity} bytes)")
        if self._manifests.get(slot) != manifest:
            self._checked.pop(slot, None)
        self._manifests[slot] = manifest
        return manifest

    def manifest(self, slot: str) -> Manifest:
        try:
            return self._manifests[slot]
        except KeyError:
            raise InstallError(f"slot {slot} was not opened for an image") from None

    def write(self, slot: str, index: int, data: bytes) -> None:
        manifest = self.manifest(slot)
        if not 0 <= index < manifest.chunk_count:
            raise ChunkMismatch(f"chunk {index} is not in the image (it has {manifest.chunk_count} chunks)")
        if len(data) != manifest.chunk_length(index) or hashlib.sha256(data).digest() != manifest.chunks[index]:
            raise ChunkMismatch(f"tampered chunk: chunk {index} of {manifest.chunk_count} does not match "
                                "the signed manifest")
        self._checked.pop(slot, None)
        try:
            write_at(self.target(slot), index * manifest.chunk_size, data)
        except OSError as exc:
            raise InstallError(f"cannot write slot {slot}: {exc.strerror or exc}") from exc

    def check(self, slot: str) -> Manifest:
        """Read the whole image back from the target; remembered until the slot is written again."""
        manifest = self.manifest(slot)
        if self._checked.get(slot) == manifest.sha256:
            return manifest
        path = self.target(slot)
        try:
            check_target(path, manifest)
            if self._grow:
                os.truncate(path, manifest.size)
        except OSError as exc:
            raise InstallError(f"cannot read slot {slot} back: {exc.strerror or exc}") from exc
        self._checked[slot] = manifest.sha256
        return manifest

    def checked(self, slot: str) -> bool:
        """The slot holds the whole image of its manifest, read back since its last write."""
        return slot in self._checked


__all__ = ["SlotImages", "check_target", "target_capacity", "write_at"]
