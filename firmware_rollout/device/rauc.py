"""Updates handed to RAUC: the artifact's image is a RAUC bundle.

The updater streams the bundle into a file of its state directory with the same checks as any
slot (the signed manifest, every chunk, the whole image), then `mark_trial` runs
`rauc install BUNDLE`: RAUC checks the bundle's own signature with its keyring (a second,
independent check), writes the inactive slot of `slot_class` and makes it the primary through
its bootloader backend, whose attempt counting is the trial. After the agent's health check,
commit is `rauc status mark-good booted`; revert is `mark-active` of the old slot and `mark-bad`
of the new one. The booted slot is what RAUC read from the kernel command line (`rauc.slot=`).
RAUC has no "trial" of its own to read back, so the slot installed and not yet committed is
remembered in a file of the state directory. The `rauc` CLI talks to RAUC's service on D-Bus.

RAUC installs from a whole bundle, so the state directory needs room for it; RAUC's HTTP
streaming installs are not used here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Annotated, Any

import msgspec

from agent.core.clock import Clock, SystemClock
from agent.core.files import atomic_write, fsync_dir
from agent.core.tasks import in_thread
from firmware_rollout.device.backends import Backend, BackendSettings, Fail, InstallerContext
from firmware_rollout.device.slot_images import FileTarget, SlotImages
from firmware_rollout.device.slots import SlotView, StreamingInstaller
from firmware_rollout.errors import InstallError
from rollout_engine.keys import Verifier

BUNDLE_FILE = "rauc-bundle.raucb"
TRIAL_FILE = "rauc-trial"
STATUS_TIMEOUT_S = 60.0
INSTALL_TIMEOUT_S = 3600.0


def flags_on_disk() -> None:
    """RAUC's boot flags (grubenv, U-Boot's environment, ...) written to the disk before the
    trial file says what they are: a power cut between the two must not leave the file ahead of
    the flags. RAUC does not sync its bootloader backend's writes, so the whole system is synced
    (after a slot write, that data is due on the disk anyway)."""
    os.sync()


class RaucInstaller(StreamingInstaller):
    def __init__(self, *, state_dir: str | Path, rauc: str = "rauc", slot_class: str = "rootfs",
                 clock: Clock | None = None, verify_key: Verifier | None = None) -> None:
        self._rauc = rauc
        self._class = slot_class
        self._clock = clock or SystemClock()
        state = Path(state_dir)
        self._bundle = state / BUNDLE_FILE
        self._trial_file = state / TRIAL_FILE
        self._status = self._read_status()
        self._names = self._slot_names()  # bootname -> RAUC slot name ("A" -> "rootfs.0")
        if len(self._names) != 2:
            raise InstallError(f"RAUC has {len(self._names)} slots of class {slot_class!r} with a bootname; "
                               "an A/B update needs two")
        first, second = sorted(self._names)
        self._slots = (first, second)
        booted = self._status.get("booted")
        if booted not in self._names:
            raise InstallError(f"RAUC says it booted {booted!r}, not a slot of class {slot_class!r} "
                               "(is rauc.slot= on the kernel command line?)")
        self._booted: str = booted
        # every slot's image goes into the one bundle file: RAUC picks the slot it writes
        self._images = SlotImages({s: FileTarget(self._bundle, grow=True) for s in self._slots},
                                  verify_key=verify_key)

    # -- RAUC's CLI --------------------------------------------------------------------------
    def _run(self, *args: str, timeout_s: float = STATUS_TIMEOUT_S) -> str:
        argv = [self._rauc, *args]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        except FileNotFoundError:
            raise InstallError(f"{self._rauc} not found: install rauc") from None
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise InstallError(f"{' '.join(argv)} did not finish: {exc}") from exc
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [""])[-1][:300]
            raise InstallError(f"{' '.join(argv)} exited {done.returncode}: {last}")
        return done.stdout

    def _read_status(self) -> dict[str, Any]:
        out = self._run("status", "--output-format=json")
        try:
            status = json.loads(out)
        except ValueError as exc:
            raise InstallError(f"rauc status printed no JSON: {exc}") from exc
        if not isinstance(status, dict):
            raise InstallError("rauc status printed no JSON object")
        return status

    def _slot_entries(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for entry in self._status.get("slots") or []:
            if isinstance(entry, dict):
                for name, info in entry.items():
                    if isinstance(info, dict):
                        out[name] = info
        return out

    def _slot_names(self) -> dict[str, str]:
        return {str(info["bootname"]): name for name, info in self._slot_entries().items()
                if info.get("class") == self._class and info.get("bootname")}

    def _refresh(self) -> None:
        self._status = self._read_status()

    def boot_status(self, slot: str) -> str | None:
        info = self._slot_entries().get(self._names.get(slot, ""), {})
        value = info.get("boot_status")
        return str(value) if value is not None else None

    # -- the Installer protocol --------------------------------------------------------------
    @property
    def name(self) -> str:
        return "rauc"

    @property
    def slots(self) -> tuple[str, str]:
        return self._slots

    def booted_slot(self) -> str:
        return self._booted

    def default_slot(self) -> str:
        primary = self._status.get("boot_primary")
        for bootname, name in self._names.items():
            if name == primary:
                return bootname
        return self._booted

    def trial_slot(self) -> str | None:
        try:
            slot = self._trial_file.read_text().strip()
        except OSError:
            return None
        return slot if slot in self._names else None

    def fell_back(self) -> bool:
        trial = self.trial_slot()
        return trial is not None and trial != self._booted and self.boot_status(trial) == "bad"

    def _install(self, slot: str) -> None:
        if self.trial_slot() == slot and self.default_slot() == slot:
            return  # installed before a power loss: RAUC made it primary already
        self._run("install", str(self._bundle), timeout_s=INSTALL_TIMEOUT_S)
        self._refresh()
        if self.default_slot() != slot:
            raise InstallError(f"rauc installed into slot {self.default_slot()}, not the inactive slot {slot}")
        flags_on_disk()
        atomic_write(self._trial_file, slot.encode())

    def _mark(self, *steps: tuple[str, str]) -> None:
        for action, target in steps:
            self._run("status", action, target)
        self._refresh()
        flags_on_disk()
        self._trial_file.unlink(missing_ok=True)
        fsync_dir(self._trial_file.parent)

    async def read_slot(self, slot: str, offset: int, length: int) -> bytes:
        raise InstallError("RAUC's slots hold what RAUC installed, not our image: every chunk is downloaded "
                           "(RAUC's own adaptive updates are the delta for RAUC bundles)")

    async def mark_trial(self, slot: str) -> None:
        self.other(slot)
        self._require_checked(slot)
        await in_thread(self._clock, self._install, slot)

    async def commit(self, slot: str) -> None:
        self.other(slot)
        if slot == self._booted:
            await in_thread(self._clock, self._mark, ("mark-good", "booted"))
        else:
            await in_thread(self._clock, self._mark, ("mark-active", self._names[slot]))
        self._bundle.unlink(missing_ok=True)

    async def revert(self, slot: str) -> None:
        other = self.other(slot)
        await in_thread(self._clock, self._mark, ("mark-active", self._names[slot]), ("mark-bad", self._names[other]))

    def describe(self) -> SlotView:
        return {"compatible": self._status.get("compatible"), "boot_primary": self._status.get("boot_primary"),
                "slot_names": dict(self._names),
                "boot_status": {s: self.boot_status(s) for s in self._slots}, "bundle": str(self._bundle)}


class RaucSettings(BackendSettings, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`[firmware.rauc]`: the artifact's image is a RAUC bundle, installed by RAUC's service."""

    rauc: str = "rauc"  # RAUC's command line tool (it talks to the rauc service on D-Bus)
    slot_class: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] = "rootfs"  # the A/B pair of system.conf


def _preflight(r: RaucSettings, fail: Fail) -> None:
    if shutil.which(r.rauc) is None:
        fail("rauc", f"{r.rauc!r} is not an executable on PATH (Debian: apt install rauc)")


def _build(r: RaucSettings, context: InstallerContext) -> RaucInstaller:
    return RaucInstaller(state_dir=context.state_dir, rauc=r.rauc, slot_class=r.slot_class, clock=context.clock,
                         verify_key=context.verify_key)


BACKEND = Backend(name="rauc", settings=RaucSettings, build=_build, preflight=_preflight)


__all__ = ["BACKEND", "RaucInstaller", "RaucSettings"]
