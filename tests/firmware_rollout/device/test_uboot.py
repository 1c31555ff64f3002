"""The U-Boot installer against Debian's libubootenv (`fw_printenv` / `fw_setenv`) on a file-backed
environment and file-backed slots. Between the agent's lifetimes a board "boots" the way RAUC's
U-Boot script does: the first slot in BOOT_ORDER with attempts left, one attempt taken away,
`rauc.slot=X` on the kernel command line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fwhelpers import CountingSource, Device, Keys, ScriptedHealth, make_artifact, sigkill_after
from test_updater_power_loss import run_with_power_losses
from ubootboard import SLOT_BYTES, Board

from firmware_rollout.device.slots import Installer
from firmware_rollout.device.uboot import UBootInstaller
from firmware_rollout.errors import InstallError
from firmware_rollout.messages import UpdateOffer

pytestmark = pytest.mark.skipif(shutil.which("fw_setenv") is None, reason="needs Debian's libubootenv-tool")

REPO = Path(__file__).resolve().parents[3]


class UBootDevice(Device):
    """A device whose every boot (a process start, a power loss) goes through the board's U-Boot."""

    def __init__(self, root: Path, keys: Keys, **kwargs: object) -> None:
        super().__init__(root, keys, **kwargs)  # type: ignore[arg-type]
        self.board = Board(root / "board")
        self.skip_boot = False

    def installer(self) -> Installer:
        if not self.skip_boot:
            self.board.boot()
        return UBootInstaller(fw_env_config=self.board.config, slot_a=self.board.slots["A"],
                              slot_b=self.board.slots["B"], cmdline_path=self.board.cmdline, clock=self.clock,
                              verify_key=self.keys.verify)


def image_of(tmp_path: Path) -> bytes:
    return (tmp_path / "image-1.1.0-1.bin").read_bytes()


async def test_a_trial_boot_that_is_healthy_is_committed(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing)
    device = UBootDevice(tmp_path / "dev", keys)
    source = CountingSource(artifact)
    updater = await device.boot()
    assert device.board.boots == ["A"]
    report = await updater.offer(UpdateOffer(rollout_id="r1", signed_manifest=source.signed_manifest), source)
    assert report.state == "rebooting"
    env = device.board.printenv()
    assert (env["BOOT_ORDER"], env["BOOT_B_LEFT"], env["EA_TRIAL"]) == ("B A", "3", "B")
    image = image_of(tmp_path)
    assert device.board.slots["B"].read_bytes()[:len(image)] == image  # streamed straight into the slot
    assert device.board.slots["A"].read_bytes() == bytes(SLOT_BYTES)  # the running slot untouched
    updater = await device.boot()  # U-Boot tries B: one attempt spent
    assert device.board.boots == ["A", "B"] and device.board.printenv()["BOOT_B_LEFT"] == "2"
    status = await updater.resume()
    await updater.close()
    assert (status.state, status.booted_slot, status.active_version) == ("committed", "B", "1.1.0")
    env = device.board.printenv()
    assert (env["BOOT_ORDER"], env["BOOT_B_LEFT"]) == ("B A", "3") and "EA_TRIAL" not in env
    assert device.sent[-1].state == "succeeded"


async def test_a_failed_health_check_reverts_to_the_old_slot(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing)
    device = UBootDevice(tmp_path / "dev", keys, health=ScriptedHealth(False))
    source = CountingSource(artifact)
    updater = await device.boot()
    await updater.offer(UpdateOffer(rollout_id="r1", signed_manifest=source.signed_manifest), source)
    updater = await device.boot()
    status = await updater.resume()  # health fails: reverted, and a reboot back asked for
    assert status.state == "rolled_back" and device.rebooter.reasons[-1] == "back to slot A after a rollback"
    env = device.board.printenv()
    assert (env["BOOT_ORDER"], env["BOOT_A_LEFT"], env["BOOT_B_LEFT"]) == ("A B", "3", "0") and "EA_TRIAL" not in env
    updater = await device.boot()
    assert device.board.boots[-1] == "A" and updater.status().state == "rolled_back"
    await updater.close()
    assert [r.state for r in device.sent][-1] == "rolled_back"


async def test_the_bootloader_falling_back_is_reported_as_a_revert_by_the_bootloader(tmp_path: Path,
                                                                                       keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing)
    device = UBootDevice(tmp_path / "dev", keys)
    source = CountingSource(artifact)
    updater = await device.boot()
    await updater.offer(UpdateOffer(rollout_id="r1", signed_manifest=source.signed_manifest), source)
    for _ in range(3):  # the new kernel never reaches user space: U-Boot spends every attempt
        device.board.boot()
    device.skip_boot = True
    device.board.boot()  # B has no attempts left: the script boots A
    assert device.board.boots == ["A", "B", "B", "B", "A"]
    updater = await device.boot()
    status = updater.status()
    await updater.close()
    assert status.state == "rolled_back" and "reverted by the bootloader" in status.detail
    assert device.sent[-1].state == "rolled_back" and "reverted by the bootloader" in device.sent[-1].detail
    env = device.board.printenv()
    assert env["BOOT_ORDER"] == "A B" and "EA_TRIAL" not in env


async def test_power_loss_at_every_point_of_a_uboot_install(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing, size=3 * 1024)
    image = (tmp_path / "image-1.1.0-1.bin").read_bytes()
    _, final, clean = await run_with_power_losses(tmp_path / "clean", keys, artifact, [], [True], UBootDevice)
    assert final == "committed"
    cut = 0
    for lifetime, log in enumerate(clean):
        for point in range(1, len(log) + 1):
            points: list[int | None] = [None] * lifetime + [point]
            device, final, logs = await run_with_power_losses(tmp_path / f"p{cut}", keys, artifact, points, [True],
                                                              UBootDevice)
            assert logs[lifetime][-1] == log[point - 1]
            assert final == "committed", (lifetime, point, device.sent[-1])
            assert isinstance(device, UBootDevice)
            env = device.board.printenv()
            assert env["BOOT_ORDER"] == "B A" and env["BOOT_B_LEFT"] == "3" and "EA_TRIAL" not in env
            assert device.board.slots["B"].read_bytes()[:len(image)] == image
            cut += 1
    assert cut >= 11


def test_a_missing_slot_on_the_kernel_command_line_is_one_clear_error(tmp_path: Path) -> None:
    board = Board(tmp_path)
    board.cmdline.write_text("console=ttyS0 root=/dev/mmcblk0p2\n")
    with pytest.raises(InstallError, match=r"names no slot \(rauc.slot=A or rauc.slot=B\)"):
        board.installer()


# -- the operator's console: edge-agent firmware install | status | commit ------------------------
def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", "firmware", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120, check=False)


def worker_config(tmp_path: Path, board: Board, keys: Keys) -> Path:
    path = tmp_path / "worker.toml"
    path.write_text(f"""
[agent]
device_id = "pi-1"
data_dir = "{tmp_path / 'data'}"
firmware_version = "1.0.0"

[firmware]
public_key = "{keys.public_path}"
installer = "uboot"

[firmware.uboot]
fw_env_config = "{board.config}"
slot_a = "{board.slots['A']}"
slot_b = "{board.slots['B']}"
cmdline_path = "{board.cmdline}"
""")
    return path


def test_install_status_and_commit_from_the_console(tmp_path: Path, keys: Keys) -> None:
    board = Board(tmp_path / "board", provisioned=False)  # a blank environment, as the first install finds it
    config = worker_config(tmp_path, board, keys)
    (tmp_path / "u").mkdir()
    unsigned, _ = make_artifact(tmp_path / "u", None)
    tampered, signed = make_artifact(tmp_path, keys.signing)
    good = tmp_path / "good.eafw"
    shutil.copy(tampered, good)
    data = bytearray(tampered.read_bytes())
    data[signed.size + 3 * 1024 + 5] ^= 0xFF  # a byte of the image changed after signing
    tampered.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in (board.env, *board.slots.values())}
    for bad, why in ((unsigned, "unsigned"), (tampered, "tampered chunk")):
        done = cli("install", str(bad), "--config", str(config))
        assert done.returncode == 2 and why in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert {p: p.read_bytes() for p in before} == before  # nothing changed: env and slots

    done = cli("install", str(good), "--config", str(config))
    assert done.returncode == 0, done.stderr
    image = (tmp_path / "image-1.1.0-1.bin").read_bytes()
    assert board.slots["B"].read_bytes()[:len(image)] == image
    assert board.printenv()["BOOT_ORDER"].split()[0] == "B"
    done = cli("status", "--config", str(config), "--json")
    assert done.returncode == 0, done.stderr
    import json
    view = json.loads(done.stdout)
    assert (view["installer"], view["booted_slot"], view["default_slot"], view["trial_slot"]) == (
        "uboot", "A", "B", "B")
    assert view["slot_versions"] == {"A": "1.0.0", "B": "1.1.0"}

    board.boot()  # U-Boot boots the trial
    done = cli("commit", "--config", str(config))
    assert done.returncode == 0, done.stderr
    env = board.printenv()
    assert (env["BOOT_ORDER"], env["BOOT_B_LEFT"]) == ("B A", "3") and "EA_TRIAL" not in env
    view = json.loads(cli("status", "--config", str(config), "--json").stdout)
    assert (view["booted_slot"], view["default_slot"], view["trial_slot"]) == ("B", "B", None)
    again = cli("commit", "--config", str(config))
    assert again.returncode == 2 and "nothing to commit" in again.stderr


def test_a_config_without_its_uboot_table_names_the_key(tmp_path: Path, keys: Keys) -> None:
    board = Board(tmp_path / "board")
    config = worker_config(tmp_path, board, keys)
    config.write_text(config.read_text().split("[firmware.uboot]")[0])
    done = cli("status", "--config", str(config))
    assert done.returncode == 2 and "firmware.uboot" in done.stderr and "Traceback" not in done.stderr


def test_config_check_names_the_uboot_key_that_is_wrong(tmp_path: Path, keys: Keys) -> None:
    board = Board(tmp_path / "board")
    config = worker_config(tmp_path, board, keys)
    ok = subprocess.run([sys.executable, "-m", "agent.cli", "config", "check", str(config)], capture_output=True,
                        text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120, check=False)
    assert ok.returncode == 0, ok.stderr
    board.slots["B"].unlink()
    bad = subprocess.run([sys.executable, "-m", "agent.cli", "config", "check", str(config)], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120, check=False)
    assert bad.returncode != 0 and f"firmware.uboot.slot_b: {board.slots['B']}: not found" in bad.stderr + bad.stdout


@pytest.mark.slow
async def test_a_sigkill_mid_download_into_a_uboot_slot_resumes_there(tmp_path: Path, keys: Keys) -> None:
    """The child streams into the board's slot B until it is SIGKILLed; a new updater resumes at
    the first chunk not yet written, and the image in the slot comes out whole."""
    chunks = 200
    artifact, _ = make_artifact(tmp_path, keys.signing, size=chunks * 1024 - 17)
    board = Board(tmp_path / "board")
    state_dir, log = tmp_path / "dev", tmp_path / "fetches.log"
    child_py = Path(__file__).with_name("update_child.py")
    sigkill_after([sys.executable, str(child_py), str(state_dir), str(artifact), str(keys.public_path), str(log),
                   str(board.config), str(board.slots["A"]), str(board.slots["B"]), str(board.cmdline)],
                  log, 25, cwd=REPO)
    fetched_before = len(log.read_text().split())
    assert fetched_before < chunks and board.printenv()["BOOT_ORDER"] == "A B"  # nothing armed yet

    device = UBootDevice(tmp_path / "dev", keys)
    device.board = board
    device.skip_boot = True  # a SIGKILL is no reboot
    updater = await device.boot()
    done = updater.status().chunks_done
    assert fetched_before - 1 <= done <= fetched_before
    source = CountingSource(artifact)
    status = await updater.resume(source)
    assert status.state == "rebooting" and source.fetched == list(range(done, chunks))
    image = (tmp_path / "image-1.1.0-1.bin").read_bytes()
    assert board.slots["B"].read_bytes()[:len(image)] == image
    device.skip_boot = False
    updater = await device.boot()
    assert (await updater.resume()).state == "committed"
    await updater.close()
    assert board.printenv()["BOOT_ORDER"] == "B A"


def test_doctor_reads_the_slots_from_the_uboot_environment(tmp_path: Path, keys: Keys) -> None:
    board = Board(tmp_path / "board")
    config = worker_config(tmp_path, board, keys)
    done = subprocess.run([sys.executable, "-m", "agent.cli", "doctor", "--config", str(config), "--broker",
                           "memory://", "--json"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120, check=False)
    assert "installer" in done.stdout, done.stdout + done.stderr
    assert "uboot: booted A, default A, no trial" in done.stdout, done.stdout
