"""A/B slots: where an image is written and which slot the device boots.

An `Installer` is the hook to the boot machinery. The updater calls it in this order:

    open_slot(inactive, signed manifest)   the slot is to receive this image (checked signature)
    write_chunk(inactive, i, bytes) ...    each chunk checked against the manifest, fsynced
    check_slot(inactive)                   the whole image read back from the slot and checked
    mark_trial(inactive)                   the next boot tries that slot, once or a few times
    ... reboot, health check ...
    commit(new)                            the new slot becomes the permanent default
    revert(old)                            the old slot is the default again; any trial is dropped

Every call is durable on return and idempotent, so the updater can repeat it after a power loss.
`booted_slot()` is the slot the running system came from, read from what the bootloader told the
kernel; it does not change while the process runs (a reboot restarts the process).
`fell_back()` says the bootloader booted the old slot because the trial slot ran out of attempts.
`read_slot(active, offset, length)` reads the running image, so a delta update copies the chunks
it already has instead of downloading them (a backend that cannot read its slots raises
`InstallError`, and every chunk is downloaded).

The backends: `DirectoryInstaller` (here: two directories and a JSON "bootloader", for the
simulator and application payloads; it does not change what a device boots), `UBootInstaller`,
`TrybootInstaller`, `RaucInstaller`, and `HelperInstaller` (any of them in a root helper).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Protocol, runtime_checkable

from agent.core.clock import Clock, SystemClock
from agent.core.files import atomic_write, fsync_dir
from agent.core.tasks import in_thread
from firmware_rollout.device.backends import Backend, BackendSettings, InstallerContext
from firmware_rollout.device.slot_images import SlotImages
from firmware_rollout.errors import InstallError
from rollout_engine.keys import Verifier

SLOTS = ("a", "b")
SLOTS_DIR = "slots"  # the directory backend's slots, under the updater's state directory

#: What `Installer.describe()` adds to `edge-agent firmware status` besides the slots.
SlotView = dict[str, object]


@runtime_checkable
class Installer(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def slots(self) -> tuple[str, str]: ...

    def booted_slot(self) -> str: ...

    def default_slot(self) -> str: ...

    def trial_slot(self) -> str | None: ...

    def fell_back(self) -> bool: ...

    async def open_slot(self, slot: str, signed_manifest: bytes) -> None: ...

    async def write_chunk(self, slot: str, index: int, data: bytes) -> None: ...

    async def check_slot(self, slot: str) -> None: ...

    async def read_slot(self, slot: str, offset: int, length: int) -> bytes: ...

    async def mark_trial(self, slot: str) -> None: ...

    async def commit(self, slot: str) -> None: ...

    async def revert(self, slot: str) -> None: ...

    def describe(self) -> SlotView: ...


def other_slot(installer: Installer, slot: str) -> str:
    first, second = installer.slots
    return second if slot == first else first


class StreamingInstaller(ABC):
    """`open_slot`, `write_chunk` and `check_slot` of a backend whose slots are files or block
    devices: the booted slot is refused, the rest is `SlotImages`' checks, run in a thread. A
    subclass sets `_images` and `_clock`, and arms a slot only after `_require_checked`."""

    _images: SlotImages
    _clock: Clock

    @property
    @abstractmethod
    def slots(self) -> tuple[str, str]: ...

    @abstractmethod
    def booted_slot(self) -> str: ...

    def other(self, slot: str) -> str:
        """The slot that is not `slot`; an `InstallError` for a slot this backend does not have."""
        first, second = self.slots
        if slot not in (first, second):
            raise InstallError(f"unknown slot {slot!r} (slots: {first}, {second})")
        return second if slot == first else first

    def _refuse_booted(self, slot: str) -> None:
        if slot == self.booted_slot():
            raise InstallError(f"refusing to write slot {slot}: the running system booted from it")

    def _require_checked(self, slot: str) -> None:
        if not self._images.checked(slot):
            raise InstallError(f"refusing to arm slot {slot}: its image was not written and checked")

    async def open_slot(self, slot: str, signed_manifest: bytes) -> None:
        self.other(slot)
        self._refuse_booted(slot)
        await in_thread(self._clock, self._images.open, slot, signed_manifest)

    async def write_chunk(self, slot: str, index: int, data: bytes) -> None:
        self._refuse_booted(slot)
        await in_thread(self._clock, self._images.write, slot, index, data)

    async def check_slot(self, slot: str) -> None:
        await in_thread(self._clock, self._images.check, slot)

    async def read_slot(self, slot: str, offset: int, length: int) -> bytes:
        self.other(slot)
        return await in_thread(self._clock, self._images.read, slot, offset, length)


class DirectoryInstaller(StreamingInstaller):
    """Two slot directories under `root` (`a/`, `b/`), each holding `image` and `version`, and
    `bootenv.json` with the default and trial slots. Its "bootloader" runs when the object is
    made (at process start): it boots the trial slot while one is marked, else the default."""

    def __init__(self, root: str | Path, *, clock: Clock | None = None, verify_key: Verifier | None = None) -> None:
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
        self._images = SlotImages({s: self.image_path(s) for s in SLOTS}, verify_key=verify_key, grow=True)

    @property
    def name(self) -> str:
        return "directory"

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

    def booted_slot(self) -> str:
        return self._booted

    def default_slot(self) -> str:
        return self._default

    def trial_slot(self) -> str | None:
        return self._trial

    def fell_back(self) -> bool:
        return False  # this "bootloader" boots a marked trial every time

    def slot_path(self, slot: str) -> Path:
        return self.root / slot

    def image_path(self, slot: str) -> Path:
        return self.root / slot / "image"

    def slot_version(self, slot: str) -> str | None:
        try:
            return (self.root / slot / "version").read_text().strip() or None
        except OSError:
            return None

    def _record_version(self, slot: str) -> None:
        version = self._images.manifest(slot).version
        atomic_write(self.root / slot / "version", version.encode() + b"\n")
        fsync_dir(self.root / slot)

    async def check_slot(self, slot: str) -> None:
        await super().check_slot(slot)
        try:
            await in_thread(self._clock, self._record_version, slot)
        except OSError as exc:
            raise InstallError(f"cannot write slot {slot}: {exc.strerror or exc}") from exc

    async def _set(self, default: str, trial: str | None) -> None:
        if (default, trial) == (self._default, self._trial):
            return
        try:
            await in_thread(self._clock, self._save_env, default, trial)
        except OSError as exc:
            raise InstallError(f"cannot update the boot environment: {exc.strerror or exc}") from exc

    async def mark_trial(self, slot: str) -> None:
        self.other(slot)
        self._require_checked(slot)
        await self._set(self._default, slot)

    async def commit(self, slot: str) -> None:
        self.other(slot)
        await self._set(slot, None)

    async def revert(self, slot: str) -> None:
        self.other(slot)
        await self._set(slot, None)

    def describe(self) -> SlotView:
        return {"root": str(self.root), "versions": {s: self.slot_version(s) for s in SLOTS},
                "boots_what": "nothing: a directory stands in for each slot (simulator, application payloads)"}


class DirectorySettings(BackendSettings, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`[firmware.directory]`: nothing to set; the slots are directories of the state directory."""


def _build(_settings: DirectorySettings, context: InstallerContext) -> DirectoryInstaller:
    return DirectoryInstaller(context.state_dir / SLOTS_DIR, clock=context.clock, verify_key=context.verify_key)


# The simulator's and application payloads' backend: an update changes nothing the device
# boots, so it needs no reboot (the agent restarts in place).
BACKEND = Backend(name="directory", settings=DirectorySettings, build=_build, reboots=False)


__all__ = ["BACKEND", "SLOTS", "SLOTS_DIR", "DirectoryInstaller", "DirectorySettings", "Installer", "SlotView",
           "StreamingInstaller", "other_slot"]
