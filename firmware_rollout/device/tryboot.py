"""Raspberry Pi's own A/B boot (Pi 4, Pi 5, CM4, CM5): `autoboot.txt` on the first FAT
partition and the firmware's one-shot `tryboot` flag.

    [all]
    tryboot_a_b=1
    boot_partition=2      the slot that boots normally
    [tryboot]
    boot_partition=3      the slot that boots once after `reboot "0 tryboot"`

A slot is a boot partition (config.txt, kernel, cmdline.txt naming its root) and, optionally,
a root partition: the image is written into the boot partition up to its size and the rest into
the root partition. Arming a trial sets `[tryboot] boot_partition` to the new slot (the reboot
into it is `reboot "0 tryboot"`: the flag is the firmware's and lasts one boot, so any failure
of the trial boot, a hang or a power cut, boots `[all]` again); commit rewrites
`[all] boot_partition`. The booted partition is read from the firmware's device tree
(`/proc/device-tree/chosen/bootloader/partition`, a big-endian u32), never from our records.
The armed trial is remembered in a file of the updater's state directory: the flag itself is
not readable before the reboot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from agent.core.clock import Clock, SystemClock
from agent.core.files import atomic_write
from agent.core.tasks import in_thread
from firmware_rollout.device.backends import Backend, BackendSettings, Fail, InstallerContext
from firmware_rollout.device.slot_images import FileTarget, PairTarget, SlotImages, SlotTarget
from firmware_rollout.device.slots import SlotView, StreamingInstaller
from firmware_rollout.errors import InstallError
from rollout_engine.keys import Verifier

TRYBOOT_SLOTS = ("A", "B")
AUTOBOOT_MAX_BYTES = 512  # the firmware reads no more of autoboot.txt
TRIAL_FILE = "tryboot-trial"


@dataclass(frozen=True)
class PiSlot:
    partition: int  # the MBR/GPT partition number the firmware boots (boot_partition=N)
    boot: Path  # that boot partition's block device (or a file standing for it)
    root: Path | None = None  # its root partition, written after the boot partition


def read_partition(path: Path) -> int:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InstallError(f"cannot read the booted partition from {path}: {exc.strerror or exc}") from exc
    if len(data) != 4:
        raise InstallError(f"{path}: expected a 4-byte big-endian partition number, found {len(data)} bytes")
    return int.from_bytes(data, "big")


def parse_autoboot(text: str) -> dict[str, dict[str, str]]:
    """Sections of autoboot.txt and their `key=value` lines (before the first section: [all])."""
    sections: dict[str, dict[str, str]] = {"all": {}}
    current = "all"
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1].strip().lower()
            sections.setdefault(current, {})
            continue
        key, sep, value = line.partition("=")
        if sep:
            sections.setdefault(current, {})[key.strip()] = value.strip()
    return sections


def format_autoboot(sections: dict[str, dict[str, str]]) -> str:
    out = []
    for name, values in sections.items():
        out.append(f"[{name}]")
        out.extend(f"{k}={v}" for k, v in values.items())
    return "\n".join(out) + "\n"


class TrybootInstaller(StreamingInstaller):
    def __init__(self, *, autoboot_path: str | Path, slot_a: PiSlot, slot_b: PiSlot, state_dir: str | Path,
                 partition_path: str | Path = "/proc/device-tree/chosen/bootloader/partition",
                 clock: Clock | None = None, verify_key: Verifier | None = None) -> None:
        if slot_a.partition == slot_b.partition:
            raise InstallError("slot_a and slot_b must boot different partitions")
        self._autoboot = Path(autoboot_path)
        self._pi = {"A": slot_a, "B": slot_b}
        self._trial_file = Path(state_dir) / TRIAL_FILE
        self._clock = clock or SystemClock()
        self._partition_path = Path(partition_path)
        self._booted = self._slot_of(read_partition(self._partition_path), str(self._partition_path))
        targets: dict[str, SlotTarget] = {
            name: PairTarget(FileTarget(s.boot), FileTarget(s.root)) if s.root else FileTarget(s.boot)
            for name, s in self._pi.items()}
        self._images = SlotImages(targets, verify_key=verify_key)
        self._sections = self._read()

    def _slot_of(self, partition: int, where: str) -> str:
        for name, slot in self._pi.items():
            if slot.partition == partition:
                return name
        raise InstallError(f"{where}: partition {partition} is neither slot A ({self._pi['A'].partition}) "
                           f"nor slot B ({self._pi['B'].partition})")

    def _read(self) -> dict[str, dict[str, str]]:
        try:
            return parse_autoboot(self._autoboot.read_text())
        except FileNotFoundError:
            return {"all": {}}
        except (OSError, UnicodeDecodeError) as exc:
            raise InstallError(f"cannot read {self._autoboot}: {exc}") from exc

    def _write(self, default: str, tryboot: str) -> None:
        sections = {name: dict(values) for name, values in self._sections.items()}
        sections.setdefault("all", {})
        sections["all"]["tryboot_a_b"] = "1"
        sections["all"]["boot_partition"] = str(self._pi[default].partition)
        sections.setdefault("tryboot", {})["boot_partition"] = str(self._pi[tryboot].partition)
        if sections == self._sections:
            return
        text = format_autoboot(sections)
        if len(text.encode()) > AUTOBOOT_MAX_BYTES:
            raise InstallError(f"{self._autoboot} would be {len(text.encode())} bytes; the firmware reads "
                               f"{AUTOBOOT_MAX_BYTES}")
        atomic_write(self._autoboot, text.encode())
        self._sections = self._read()

    def _set_trial(self, slot: str | None) -> None:
        if slot is None:
            self._trial_file.unlink(missing_ok=True)
        elif self.trial_slot() != slot:
            self._trial_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self._trial_file, slot.encode())

    def _partition_in(self, section: str) -> str | None:
        value = self._sections.get(section, {}).get("boot_partition")
        try:
            return self._slot_of(int(value), str(self._autoboot)) if value is not None else None
        except (ValueError, InstallError):
            return None

    # -- the Installer protocol --------------------------------------------------------------
    @property
    def name(self) -> str:
        return "tryboot"

    @property
    def slots(self) -> tuple[str, str]:
        return TRYBOOT_SLOTS

    def booted_slot(self) -> str:
        return self._booted

    def default_slot(self) -> str:
        return self._partition_in("all") or self._booted

    def trial_slot(self) -> str | None:
        try:
            slot = self._trial_file.read_text().strip()
        except OSError:
            return None
        return slot if slot in TRYBOOT_SLOTS else None

    def fell_back(self) -> bool:
        return False  # the one-shot flag leaves no trace; the updater's boot id check tells

    async def _apply(self, default: str, tryboot: str, trial: str | None) -> None:
        def apply() -> None:
            self._write(default, tryboot)
            self._set_trial(trial)

        try:
            await in_thread(self._clock, apply)
        except OSError as exc:
            raise InstallError(f"cannot update {self._autoboot}: {exc.strerror or exc}") from exc

    async def mark_trial(self, slot: str) -> None:
        self.other(slot)
        self._require_checked(slot)
        await self._apply(self.default_slot(), slot, slot)

    async def commit(self, slot: str) -> None:
        other = self.other(slot)
        await self._apply(slot, other, None)

    async def revert(self, slot: str) -> None:
        other = self.other(slot)
        await self._apply(slot, other, None)

    def describe(self) -> SlotView:
        return {"autoboot": str(self._autoboot),
                "partitions": {n: s.partition for n, s in self._pi.items()},
                "tryboot_partition": self._sections.get("tryboot", {}).get("boot_partition"),
                "slot_targets": {n: str(self._images.target(n)) for n in TRYBOOT_SLOTS}}


class PiSlotSettings(BackendSettings, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One Raspberry Pi slot: the partition the firmware boots, its device, its root partition."""

    partition: Annotated[int, msgspec.Meta(ge=1, le=127)]
    boot: str  # the boot partition's block device, e.g. /dev/mmcblk0p2
    root: str = ""  # its root partition (empty: the image is the boot partition alone)


class TrybootSettings(BackendSettings, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`[firmware.tryboot]`: Raspberry Pi 4/5 A/B through autoboot.txt and `reboot "0 tryboot"`."""

    autoboot_path: str = "/boot/firmware/autoboot.txt"  # on the first (FAT) partition, mounted read-write
    partition_path: str = "/proc/device-tree/chosen/bootloader/partition"
    slot_a: PiSlotSettings | None = None
    slot_b: PiSlotSettings | None = None
    trial_reboot_command: list[str] = msgspec.field(default_factory=lambda: ["systemctl", "reboot", "0 tryboot"])


def _check(t: TrybootSettings, fail: Fail) -> None:
    if t.slot_a is None or t.slot_b is None:
        fail("slot_a" if t.slot_a is None else "slot_b", "required: { partition = N, boot = DEVICE, root = DEVICE }")
    if t.slot_a.partition == t.slot_b.partition:
        fail("slot_b.partition", "must differ from slot_a's")
    if not t.trial_reboot_command:
        fail("trial_reboot_command", "must not be empty")


def _preflight(t: TrybootSettings, fail: Fail) -> None:
    assert t.slot_a is not None and t.slot_b is not None  # _check
    files = [("autoboot_path", str(Path(t.autoboot_path).parent)), ("partition_path", t.partition_path)]
    for name, slot in (("slot_a", t.slot_a), ("slot_b", t.slot_b)):
        files += [(f"{name}.boot", slot.boot), (f"{name}.root", slot.root)]
    for key, file in files:
        if file and not Path(file).exists():
            fail(key, f"{file}: not found")


def _build(t: TrybootSettings, context: InstallerContext) -> TrybootInstaller:
    assert t.slot_a is not None and t.slot_b is not None  # _check
    slots = [PiSlot(partition=s.partition, boot=Path(s.boot), root=Path(s.root) if s.root else None)
             for s in (t.slot_a, t.slot_b)]
    return TrybootInstaller(autoboot_path=t.autoboot_path, partition_path=t.partition_path, slot_a=slots[0],
                            slot_b=slots[1], state_dir=context.state_dir, clock=context.clock,
                            verify_key=context.verify_key)


BACKEND = Backend(name="tryboot", settings=TrybootSettings, build=_build, table_required=True, check=_check,
                  preflight=_preflight, trial_reboot_command=lambda t: list(t.trial_reboot_command))


__all__ = ["BACKEND", "TRYBOOT_SLOTS", "PiSlot", "PiSlotSettings", "TrybootInstaller", "TrybootSettings",
           "format_autoboot", "parse_autoboot", "read_partition"]
