"""A/B slots: where an image is written and which slot the device boots.

An `Installer` is the hook to the boot machinery. The updater calls it in this order:

    write(inactive, image)   put the verified image into the slot not running now
    mark_trial(inactive)     the next boot tries that slot (U-Boot `upgrade_available`, RAUC
                             `mark-active` with a boot attempt counter)
    ... reboot, health check ...
    commit(new)              the new slot becomes the permanent default
    revert(old)              the old slot is the default again; any trial is dropped

Every call is durable on return and idempotent, so the updater can repeat it after a power loss.
`booted_slot()` is the slot the running system came from; it does not change while the process
runs (a reboot restarts the process).

`DirectoryInstaller` stands two directories in for two partitions and a small JSON file for the
bootloader environment; its "bootloader" runs when the object is made (at process start): it
boots the trial slot while one is marked, else the default. Real bootloaders also count boot
attempts themselves; the updater's own boot counter (in SQLite) covers a crash loop either way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

from agent.core.clock import Clock, SystemClock
from firmware_rollout._fs import atomic_write, durable_copy, fsync_dir, in_thread
from firmware_rollout.artifact.manifest import Manifest
from firmware_rollout.errors import InstallError

SLOTS = ("a", "b")


@runtime_checkable
class Installer(Protocol):
    @property
    def slots(self) -> tuple[str, str]: ...

    def booted_slot(self) -> str: ...

    def default_slot(self) -> str: ...

    def trial_slot(self) -> str | None: ...

    async def write(self, slot: str, image: Path, manifest: Manifest) -> None: ...

    async def mark_trial(self, slot: str) -> None: ...

    async def commit(self, slot: str) -> None: ...

    async def revert(self, slot: str) -> None: ...


def other_slot(installer: Installer, slot: str) -> str:
    first, second = installer.slots
    return second if slot == first else first


class DirectoryInstaller:
    """Two slot directories under `root` (`a/`, `b/`), each holding `image` and `version`, and
    `bootenv.json` with the default and trial slots."""

    def __init__(self, root: str | Path, *, clock: Clock | None = None) -> None:
        self.root = Path(root)
        self._clock = clock or SystemClock()
        self._env_path = self.root / "bootenv.json"
        try:
            for slot in SLOTS:
                (self.root / slot).mkdir(parents=True, exist_ok=True)
            self._default, self._trial = self._load_env()
        except OSError as exc:
            raise InstallError(f"cannot open slots in {self.root}: {exc.strerror or exc}") from exc
        self._booted = self._trial or self._default  # the simulated bootloader's choice

    @property
    def slots(self) -> tuple[str, str]:
        return SLOTS

    def _load_env(self) -> tuple[str, str | None]:
        if not self._env_path.exists():
            atomic_write(self._env_path, json.dumps({"default": SLOTS[0], "trial": None}).encode())
        try:
            env = json.loads(self._env_path.read_bytes())
            default, trial = env["default"], env["trial"]
        except (ValueError, KeyError, TypeError) as exc:
            raise InstallError(f"{self._env_path}: unreadable boot environment ({exc})") from exc
        if default not in SLOTS or (trial is not None and trial not in SLOTS):
            raise InstallError(f"{self._env_path}: unknown slot in boot environment")
        return default, trial

    def _save_env(self, default: str, trial: str | None) -> None:
        atomic_write(self._env_path, json.dumps({"default": default, "trial": trial}).encode())
        self._default, self._trial = default, trial

    def _check(self, slot: str) -> None:
        if slot not in SLOTS:
            raise InstallError(f"unknown slot {slot!r}")

    def booted_slot(self) -> str:
        return self._booted

    def default_slot(self) -> str:
        return self._default

    def trial_slot(self) -> str | None:
        return self._trial

    def slot_path(self, slot: str) -> Path:
        return self.root / slot

    def image_path(self, slot: str) -> Path:
        return self.root / slot / "image"

    def slot_version(self, slot: str) -> str | None:
        try:
            return (self.root / slot / "version").read_text().strip() or None
        except OSError:
            return None

    def _write(self, slot: str, image: Path, version: str) -> None:
        durable_copy(image, self.image_path(slot))
        atomic_write(self.root / slot / "version", version.encode() + b"\n")
        fsync_dir(self.root / slot)

    async def write(self, slot: str, image: Path, manifest: Manifest) -> None:
        self._check(slot)
        if slot == self._booted:
            raise InstallError(f"refusing to write slot {slot}: the running system booted from it")
        try:
            await in_thread(self._clock, self._write, slot, image, manifest.version)
        except OSError as exc:
            raise InstallError(f"cannot write slot {slot}: {exc.strerror or exc}") from exc

    async def _set(self, default: str, trial: str | None) -> None:
        try:
            await in_thread(self._clock, self._save_env, default, trial)
        except OSError as exc:
            raise InstallError(f"cannot update the boot environment: {exc.strerror or exc}") from exc

    async def mark_trial(self, slot: str) -> None:
        self._check(slot)
        await self._set(self._default, slot)

    async def commit(self, slot: str) -> None:
        self._check(slot)
        await self._set(slot, None)

    async def revert(self, slot: str) -> None:
        self._check(slot)
        await self._set(slot, None)


__all__ = ["SLOTS", "DirectoryInstaller", "Installer", "other_slot"]
