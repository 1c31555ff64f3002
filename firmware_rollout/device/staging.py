"""The staging file a download is written into: chunks at their offsets, each fsynced before
its progress is recorded, so the recorded progress never runs ahead of the bytes on disk."""

from __future__ import annotations

import os
from pathlib import Path

from firmware_rollout.artifact.files import check_image
from firmware_rollout.artifact.manifest import Manifest
from firmware_rollout.errors import ArtifactError


def prepare_staging(path: Path, chunks_done: int, manifest: Manifest) -> int:
    """Make the staging file hold exactly the recorded chunks; return how many it holds."""
    keep = chunks_done * manifest.chunk_size if chunks_done < manifest.chunk_count else manifest.size
    with path.open("ab") as handle:
        size = handle.tell()
        if size < keep:  # fewer bytes than recorded (cannot happen with fsync first): refetch
            chunks_done = size // manifest.chunk_size
            keep = chunks_done * manifest.chunk_size
        handle.truncate(keep)
        handle.flush()
        os.fsync(handle.fileno())
    return chunks_done


def write_chunk(path: Path, offset: int, data: bytes) -> None:
    with path.open("r+b") as handle:
        handle.seek(offset)
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def check_staging(path: Path, manifest: Manifest) -> None:
    with path.open("rb") as handle:
        check_image(handle, manifest)
        if handle.read(1):
            raise ArtifactError(f"staged image is longer than the {manifest.size} bytes in the manifest")


__all__ = ["check_staging", "prepare_staging", "write_chunk"]
