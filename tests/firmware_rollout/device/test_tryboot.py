"""The Raspberry Pi tryboot installer on files laid out as a Pi's partitions: a FAT partition 1
(a directory here) with autoboot.txt, boot and root partitions per slot, and the device-tree
file the firmware fills with the booted partition. Between the agent's lifetimes the board boots
as the Pi firmware does: `[tryboot] boot_partition` once after `reboot "0 tryboot"`, else
`[all] boot_partition`; every boot gets a new kernel boot id."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from fwhelpers import CountingSource, Device, Keys, ScriptedHealth, make_artifact

from firmware_rollout.device.slots import Installer
from firmware_rollout.device.tryboot import PiSlot, TrybootInstaller, parse_autoboot
from firmware_rollout.device.updater import UpdaterSettings
from firmware_rollout.errors import InstallError
from firmware_rollout.messages import UpdateOffer

BOOT_BYTES = 4 * 1024  # small partitions: the image spans the boot and the root partition
ROOT_BYTES = 64 * 1024


class PiBoard:
    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.bootfs = root / "bootfs"
        self.bootfs.mkdir()
        self.autoboot = self.bootfs / "autoboot.txt"
        self.autoboot.write_text("[all]\ntryboot_a_b=1\nboot_partition=2\n[tryboot]\nboot_partition=3\n")
        self.parts = {n: root / f"mmcblk0p{n}" for n in (2, 3, 5, 6)}
        for n, path in self.parts.items():
            path.write_bytes(bytes(BOOT_BYTES if n in (2, 3) else ROOT_BYTES))
        self.slots = {"A": PiSlot(2, self.parts[2], self.parts[5]), "B": PiSlot(3, self.parts[3], self.parts[6])}
        self.partition = root / "partition"
        self.boot_id = root / "boot_id"
        self.booted: list[int] = []
        self.boot(tryboot=False)

    def boot(self, *, tryboot: bool) -> int:
        sections = parse_autoboot(self.autoboot.read_text())
        part = int(sections["tryboot" if tryboot else "all"]["boot_partition"])
        self.partition.write_bytes(part.to_bytes(4, "big"))
        self.boot_id.write_text(str(uuid.uuid4()))
        self.booted.append(part)
        return part

    def image(self, slot: str) -> bytes:
        s = self.slots[slot]
        assert s.root is not None
        return s.boot.read_bytes() + s.root.read_bytes()


class PiDevice(Device):
    """Every `boot()` after a reboot the updater asked for goes through the board's firmware."""

    def __init__(self, root: Path, keys: Keys, **kwargs: object) -> None:
        self.board = PiBoard(root / "board")
        super().__init__(root, keys, settings=UpdaterSettings(boot_id_path=str(self.board.boot_id)),
                         **kwargs)  # type: ignore[arg-type]
        self._reboots_seen = 0

    def installer(self) -> Installer:
        if len(self.rebooter.reasons) > self._reboots_seen:  # the reboot the updater asked for
            self._reboots_seen = len(self.rebooter.reasons)
            self.board.boot(tryboot=self.rebooter.trials[-1])
        return TrybootInstaller(autoboot_path=self.board.autoboot, slot_a=self.board.slots["A"],
                                slot_b=self.board.slots["B"], state_dir=self.root,
                                partition_path=self.board.partition, clock=self.clock, verify_key=self.keys.verify)


def offer(source: CountingSource) -> UpdateOffer:
    return UpdateOffer(rollout_id="r1", signed_manifest=source.signed_manifest)


async def test_a_healthy_tryboot_is_committed_into_autoboot_txt(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing, size=20 * 1024)
    image = (tmp_path / "image-1.1.0-1.bin").read_bytes()
    device = PiDevice(tmp_path / "dev", keys)
    source = CountingSource(artifact)
    updater = await device.boot()
    report = await updater.offer(offer(source), source)
    assert report.state == "rebooting" and device.rebooter.trials == [True]  # reboot "0 tryboot"
    assert device.board.image("B")[:len(image)] == image  # across the boot and the root partition
    assert image[:BOOT_BYTES] == device.board.parts[3].read_bytes()
    assert device.board.image("A") == bytes(BOOT_BYTES + ROOT_BYTES)  # the running slot untouched
    sections = parse_autoboot(device.board.autoboot.read_text())
    assert (sections["all"]["boot_partition"], sections["tryboot"]["boot_partition"]) == ("2", "3")
    updater = await device.boot()  # the firmware boots partition 3 once
    assert device.board.booted[-1] == 3
    status = await updater.resume()
    await updater.close()
    assert (status.state, status.booted_slot, status.default_slot) == ("committed", "B", "B")
    sections = parse_autoboot(device.board.autoboot.read_text())
    assert (sections["all"]["boot_partition"], sections["tryboot"]["boot_partition"]) == ("3", "2")
    assert sections["all"]["tryboot_a_b"] == "1"


async def test_a_failed_health_check_boots_the_old_partition_again(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing, size=20 * 1024)
    device = PiDevice(tmp_path / "dev", keys, health=ScriptedHealth(False))
    source = CountingSource(artifact)
    updater = await device.boot()
    await updater.offer(offer(source), source)
    updater = await device.boot()
    status = await updater.resume()
    assert status.state == "rolled_back" and device.rebooter.trials == [True, False]  # back: a plain reboot
    updater = await device.boot()
    assert device.board.booted[-1] == 2 and updater.status().state == "rolled_back"
    await updater.close()
    assert parse_autoboot(device.board.autoboot.read_text())["all"]["boot_partition"] == "2"


async def test_a_trial_that_never_comes_up_is_reverted_by_the_firmware(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing, size=20 * 1024)
    device = PiDevice(tmp_path / "dev", keys)
    source = CountingSource(artifact)
    updater = await device.boot()
    await updater.offer(offer(source), source)
    device.board.boot(tryboot=True)  # the new kernel hangs: the watchdog (or a power cycle) resets
    device._reboots_seen = len(device.rebooter.reasons)
    device.board.boot(tryboot=False)  # the flag lasted one boot: partition 2 again
    updater = await device.boot()
    status = updater.status()
    await updater.close()
    assert status.state == "rolled_back" and "reverted by the bootloader" in status.detail
    assert device.sent[-1].state == "rolled_back"
    assert device.installer().trial_slot() is None


def test_a_partition_that_is_no_slot_is_one_clear_error(tmp_path: Path) -> None:
    board = PiBoard(tmp_path)
    board.partition.write_bytes((7).to_bytes(4, "big"))
    with pytest.raises(InstallError, match="partition 7 is neither slot A"):
        TrybootInstaller(autoboot_path=board.autoboot, slot_a=board.slots["A"], slot_b=board.slots["B"],
                         state_dir=tmp_path, partition_path=board.partition)
