"""Our U-Boot backend against Debian's real U-Boot: each boot of the device runs U-Boot for QEMU
(`qemu-system-aarch64 -M virt`), which loads the environment our backend wrote with `fw_setenv`
from its flash bank and runs RAUC's BOOT_ORDER / BOOT_x_LEFT logic from `bootcmd`; the slot it
chooses is the slot the device runs. Armed, committed, reverted, and a trial that never reaches
user space: U-Boot itself falls back."""

from __future__ import annotations

from pathlib import Path

import pytest
from fwhelpers import CountingSource, Keys, ScriptedHealth, make_artifact
from test_uboot import UBootDevice
from ubootboard import QemuBoard, UBootBench

from firmware_rollout.messages import UpdateOffer

pytestmark = [pytest.mark.skipif(bool(UBootBench.missing()), reason=f"needs {UBootBench.missing()}"
                                 " (scripts/test.sh installs qemu-system-arm and u-boot-qemu)"),
              pytest.mark.timeout(300)]


class RealUBootDevice(UBootDevice):
    def __init__(self, root: Path, keys: Keys, **kwargs: object) -> None:
        super().__init__(root, keys, **kwargs)
        self.board = QemuBoard(root / "board")


async def test_real_uboot_boots_the_armed_slot_then_keeps_it_once_committed(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing)
    device = RealUBootDevice(tmp_path / "dev", keys)
    source = CountingSource(artifact)
    updater = await device.boot()  # U-Boot: A, the factory default
    assert device.board.boots == ["A"] and "Loading Environment from Flash... OK" in device.board.consoles[0]
    report = await updater.offer(UpdateOffer(rollout_id="r1", signed_manifest=source.signed_manifest), source)
    assert report.state == "rebooting"
    updater = await device.boot()  # our backend armed B: U-Boot boots it, spending an attempt
    assert device.board.boots == ["A", "B"] and "EA-BOOT slot=B left=2" in device.board.consoles[-1]
    status = await updater.resume()
    await updater.close()
    assert (status.state, status.booted_slot, status.active_version) == ("committed", "B", "1.1.0")
    for _ in range(4):  # committed: every later power-cycle boots B (its attempts counted afresh each boot)
        updater = await device.boot()
        await updater.close()
    assert device.board.boots == ["A", "B", "B", "B", "B", "B"]


async def test_real_uboot_boots_the_old_slot_after_our_revert(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing)
    device = RealUBootDevice(tmp_path / "dev", keys, health=ScriptedHealth(False))
    source = CountingSource(artifact)
    updater = await device.boot()
    await updater.offer(UpdateOffer(rollout_id="r1", signed_manifest=source.signed_manifest), source)
    updater = await device.boot()  # the trial of B
    status = await updater.resume()  # its health check fails: our backend reverts
    assert status.state == "rolled_back"
    updater = await device.boot()
    await updater.close()
    assert device.board.boots == ["A", "B", "A"]  # U-Boot goes back to A: B has no attempts
    assert device.board.printenv()["BOOT_B_LEFT"] == "0"


async def test_real_uboot_falls_back_by_itself_when_the_trial_never_comes_up(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing)
    device = RealUBootDevice(tmp_path / "dev", keys)
    source = CountingSource(artifact)
    updater = await device.boot()
    await updater.offer(UpdateOffer(rollout_id="r1", signed_manifest=source.signed_manifest), source)
    for _ in range(3):  # the new kernel never reaches user space: power-cycled three times
        device.board.boot()
    device.skip_boot = True
    device.board.boot()  # B spent every attempt: U-Boot chooses A on its own
    assert device.board.boots == ["A", "B", "B", "B", "A"]
    assert "EA-BOOT slot=A" in device.board.consoles[-1]
    updater = await device.boot()
    status = updater.status()
    await updater.close()
    assert status.state == "rolled_back" and "reverted by the bootloader" in status.detail


def test_the_bench_board_command_makes_a_board_and_power_cycles_it(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[3] / "scripts" / "bench_board.py"

    def bench(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script), str(tmp_path / "board"), *args], capture_output=True,
                              text=True, timeout=120, check=False)

    nothing = bench("boot")
    assert nothing.returncode == 1 and "no board here (make it first)" in nothing.stderr
    made = bench()
    assert made.returncode == 0 and 'installer = "uboot"' in made.stdout
    assert f'fw_env_config = "{tmp_path / "board" / "fw_env.config"}"' in made.stdout
    assert [bench("boot").stdout.strip() for _ in range(2)] == ["U-Boot chose slot A (2 attempts left)",
                                                                 "U-Boot chose slot A (1 attempts left)"]
    env = bench("env").stdout
    assert "BOOT_A_LEFT=1\n" in env and "BOOT_ORDER=A B\n" in env and "bootcmd" not in env
