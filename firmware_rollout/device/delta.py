"""A delta update: the chunks of the new image that the active slot already holds, found by their
sha256 in the signed manifest of the image the updater installed there, and copied instead of
downloaded (the installer checks each copy against the new manifest as it writes it)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from firmware_rollout.artifact.manifest import Manifest
from firmware_rollout.device.slots import Installer
from firmware_rollout.errors import InstallError

log = logging.getLogger(__name__)


class Delta:
    """Chunks the active slot holds: index in the new image -> (offset, length) in the active one."""

    def __init__(self, installer: Installer | None, slot: str, copies: dict[int, tuple[int, int]]) -> None:
        self._installer = installer
        self.slot = slot
        self.copies = copies

    @classmethod
    def none(cls) -> Delta:
        return cls(None, "", {})

    async def read(self, index: int) -> bytes | None:
        """Chunk `index` as the active slot holds it, unchecked (the installer checks it as it
        writes it), or None: it is not there, or the slot cannot be read (then no chunk is)."""
        where = self.copies.get(index)
        if where is None or self._installer is None:
            return None
        try:
            return await self._installer.read_slot(self.slot, *where)
        except (InstallError, OSError) as exc:
            log.warning("delta: cannot read slot %s (%s): downloading every chunk", self.slot, exc)
            self.copies.clear()
            return None


async def find_delta(installer: Installer, manifest: Manifest, *, active_version: str,
                     active_manifest: Callable[[str], Awaitable[Manifest | None]]) -> Delta:
    """The chunks of `manifest` the booted slot holds; `active_manifest(slot)` is the checked
    manifest of the image installed there (None: unknown, no delta). A slot the installer cannot
    read (a backend without `read_slot`, a helper refusing it) gives no delta: the plan the
    device reports is the download it makes."""
    booted = installer.booted_slot()
    active = await active_manifest(booted)
    if active is None or active.version != active_version:
        return Delta.none()
    active_layout = active.layout()
    where = active_layout.by_hash()
    copies: dict[int, tuple[int, int]] = {}
    for index, digest in enumerate(manifest.chunks):
        source = where.get(digest)
        if source is not None:
            copies[index] = (active_layout.offset(source), active_layout.length(source))
    if copies:
        try:  # a backend (or helper) that cannot read its slots plans no delta it cannot make
            await installer.read_slot(booted, 0, 1)
        except (InstallError, OSError) as exc:
            log.warning("no delta: slot %s cannot be read (%s): every chunk is downloaded", booted, exc)
            return Delta.none()
    return Delta(installer, booted, copies)


__all__ = ["Delta", "find_delta"]
