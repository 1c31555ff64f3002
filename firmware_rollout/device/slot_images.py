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
import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO, cast

from firmware_rollout.artifact.files import check_image
from firmware_rollout.artifact.manifest import (
    MAX_CHUNK_SIZE,
    ChunkLayout,
    Manifest,
    parse_signed_manifest,
    verify_signed_manifest,
)
from firmware_rollout.errors import ChunkMismatch, InstallError
from rollout_engine.keys import Verifier

READ_BLOCK = 1024 * 1024


def target_capacity(path: Path) -> int:
    """Bytes a slot target holds: a block device's size, or a file's (a file grows if it must)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def write_at(path: Path, offset: int, data: bytes | memoryview) -> None:
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


class FileTarget:
    """One file or block device; `grow`: a plain file that is created and extended as needed."""

    def __init__(self, path: str | Path, *, grow: bool = False) -> None:
        self.path = Path(path)
        self.grow = grow

    def __str__(self) -> str:
        return str(self.path)

    def prepare(self) -> None:
        if self.grow:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self.path.exists():
                self.path.touch()

    def capacity(self) -> int | None:
        """None: no limit (a growing file)."""
        return None if self.grow else target_capacity(self.path)

    def write(self, offset: int, data: bytes | memoryview) -> None:
        write_at(self.path, offset, data)

    def open_read(self) -> BinaryIO:
        return self.path.open("rb")

    def read(self, offset: int, length: int) -> bytes:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def finish(self, size: int) -> None:
        if self.grow:
            os.truncate(self.path, size)


class PairTarget:
    """Two partitions written as one image: its first `first.capacity()` bytes into `first` (a
    Raspberry Pi slot's boot partition), the rest into `second` (its root partition)."""

    def __init__(self, first: FileTarget, second: FileTarget) -> None:
        self.first = first
        self.second = second

    def __str__(self) -> str:
        return f"{self.first} + {self.second}"

    def prepare(self) -> None:
        pass

    def _split(self) -> int:
        return target_capacity(self.first.path)

    def capacity(self) -> int | None:
        return self._split() + target_capacity(self.second.path)

    def write(self, offset: int, data: bytes | memoryview) -> None:
        split = self._split()
        view = memoryview(data)
        if offset < split:
            head = view[:split - offset]
            self.first.write(offset, head)
            view, offset = view[len(head):], split
        if view:
            self.second.write(offset - split, view)

    def open_read(self) -> BinaryIO:
        return cast(BinaryIO, _Chained(self.first.open_read(), self._split(), self.second.open_read()))

    def read(self, offset: int, length: int) -> bytes:
        split = self._split()
        head = self.first.read(offset, min(length, split - offset)) if offset < split else b""
        rest = length - len(head)
        return head + (self.second.read(max(0, offset - split), rest) if rest > 0 else b"")

    def finish(self, size: int) -> None:
        pass


class _Chained(io.RawIOBase):
    """The first `limit` bytes of `a`, then `b`: one stream over a boot and a root partition."""

    def __init__(self, a: BinaryIO, limit: int, b: BinaryIO) -> None:
        self._a, self._b, self._left = a, b, limit

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        out = b""
        if self._left > 0:
            out = self._a.read(self._left if size < 0 else min(size, self._left))
            self._left -= len(out)
            if size >= 0 and len(out) == size:
                return out
            if self._left > 0:  # the first target ended early
                self._left = 0
        rest = self._b.read(-1 if size < 0 else size - len(out))
        return out + rest

    def close(self) -> None:
        self._a.close()
        self._b.close()
        super().close()


SlotTarget = FileTarget | PairTarget


def _whole_image_matches(handle: BinaryIO, manifest: Manifest) -> bool:
    whole = hashlib.sha256()
    left = manifest.size
    while left:
        block = handle.read(min(READ_BLOCK, left))
        if not block:
            return False
        whole.update(block)
        left -= len(block)
    return whole.digest() == manifest.sha256


class SlotImages:
    """What is being written into which slot target, and the checks on every write.

    `grow`: the targets are plain files that may be extended (the directory installer and a
    RAUC bundle file); otherwise a target must already hold the whole image (a partition)."""

    def __init__(self, targets: Mapping[str, SlotTarget | Path], *, verify_key: Verifier | None,
                 grow: bool = False) -> None:
        self.targets: dict[str, SlotTarget] = {
            slot: FileTarget(t, grow=grow) if isinstance(t, Path) else t for slot, t in targets.items()}
        self._key = verify_key
        self._manifests: dict[str, Manifest] = {}
        self._layouts: dict[str, ChunkLayout] = {}
        self._checked: dict[str, bytes] = {}  # slot -> the manifest's image hash it was checked against
        self._opened: dict[str, tuple[bytes, Manifest]] = {}  # slot -> the signed manifest it was opened for

    def target(self, slot: str) -> SlotTarget:
        try:
            return self.targets[slot]
        except KeyError:
            raise InstallError(f"no slot {slot!r} here (slots: {', '.join(sorted(self.targets))})") from None

    def open(self, slot: str, signed_manifest: bytes) -> Manifest:
        """Take the manifest of the image `slot` is to receive; idempotent (a resumed download
        opens the slot again). Raises `ArtifactError` for a manifest the key does not vouch for."""
        target = self.target(slot)
        opened = self._opened.get(slot)
        if opened is not None and opened[0] == signed_manifest:  # checked when this slot was opened for it
            manifest = opened[1]
        else:
            manifest = (verify_signed_manifest(signed_manifest, self._key) if self._key is not None
                        else parse_signed_manifest(signed_manifest)).manifest
        try:
            target.prepare()
            capacity = target.capacity()
        except OSError as exc:
            raise InstallError(f"cannot open slot {slot} ({target}): {exc.strerror or exc}") from exc
        if capacity is not None and manifest.size > capacity:
            raise InstallError(f"the image of {manifest.size} bytes does not fit slot {slot} ({target}, "
                               f"{capacity} bytes)")
        if self._manifests.get(slot) != manifest:
            self._checked.pop(slot, None)
            self._layouts[slot] = manifest.layout()
        self._manifests[slot] = manifest
        self._opened[slot] = (signed_manifest, manifest)
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
        layout = self._layouts[slot]
        if len(data) != layout.length(index) or hashlib.sha256(data).digest() != manifest.chunks[index]:
            raise ChunkMismatch(f"tampered chunk: chunk {index} of {manifest.chunk_count} does not match "
                                "the signed manifest")
        self._checked.pop(slot, None)
        try:
            self.target(slot).write(layout.offset(index), data)
        except OSError as exc:
            raise InstallError(f"cannot write slot {slot}: {exc.strerror or exc}") from exc

    def check(self, slot: str) -> Manifest:
        """Read the whole image back from the target; remembered until the slot is written again."""
        manifest = self.manifest(slot)
        if self._checked.get(slot) == manifest.sha256:
            return manifest
        target = self.target(slot)
        try:
            with target.open_read() as handle:  # the signed whole-image hash: one pass, one hash
                matches = _whole_image_matches(handle, manifest)
            if not matches:
                with target.open_read() as handle:
                    check_image(handle, manifest)  # which chunk differs, for the message
                raise ChunkMismatch("image sha256 mismatch: the chunks match but the whole image does not")
            target.finish(manifest.size)
        except OSError as exc:
            raise InstallError(f"cannot read slot {slot} back: {exc.strerror or exc}") from exc
        self._checked[slot] = manifest.sha256
        return manifest

    def read(self, slot: str, offset: int, length: int) -> bytes:
        """Bytes `[offset, offset+length)` of a slot as it is (the active slot, for a delta); the
        caller checks them against the hash it expects."""
        if length < 0 or length > MAX_CHUNK_SIZE or offset < 0:
            raise InstallError(f"cannot read {length} bytes at {offset} of slot {slot}: out of bounds")
        try:
            return self.target(slot).read(offset, length)
        except OSError as exc:
            raise InstallError(f"cannot read slot {slot}: {exc.strerror or exc}") from exc

    def checked(self, slot: str) -> bool:
        """The slot holds the whole image of its manifest, read back since its last write."""
        return slot in self._checked


__all__ = ["FileTarget", "PairTarget", "SlotImages", "SlotTarget", "target_capacity", "write_at"]
