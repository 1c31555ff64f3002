"""The RAUC installer against Debian's RAUC: a bundle and a keyring made by the test, file-backed
slots, RAUC's `custom` bootloader backend (a script keeping its state in files), RAUC's service
on a private D-Bus system bus, and a kernel command line bound over /proc/cmdline in the
service's own mount namespace. A "boot" restarts the service with the command line the backend's
primary slot gives (the old slot when the primary is marked bad, as a bootloader falls back)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fwhelpers import CountingSource, Device, Keys, ScriptedHealth

from firmware_rollout.artifact.files import build_artifact
from firmware_rollout.device import rauc as rauc_module
from firmware_rollout.device.rauc import RaucInstaller
from firmware_rollout.device.slots import Installer
from firmware_rollout.messages import UpdateOffer

pytestmark = pytest.mark.skipif(
    any(shutil.which(t) is None for t in ("rauc", "dbus-daemon", "unshare", "openssl", "mksquashfs")),
    reason="needs Debian's rauc, dbus, squashfs-tools, openssl and util-linux")

SLOT_BYTES = 1024 * 1024
BACKEND = """#!/bin/sh
S="{state}"
[ -f "$S/primary" ] || echo A > "$S/primary"
case "$1" in
  get-primary) cat "$S/primary" ;;
  set-primary) echo "$2" > "$S/primary"; echo good > "$S/state.$2" ;;
  get-state) cat "$S/state.$2" 2>/dev/null || echo good ;;
  set-state) echo "$3" > "$S/state.$2" ;;
  get-current) cat "$S/primary" ;;
  *) exit 1 ;;
esac
"""
DBUS_CONF = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig><type>system</type><listen>unix:path={socket}</listen>
<policy context="default"><allow user="*"/><allow own="*"/><allow send_destination="*"/>
<allow receive_type="method_call"/><allow receive_type="signal"/><allow receive_type="method_return"/>
<allow receive_type="error"/></policy></busconfig>
"""


def run(*argv: str | Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=120, check=True,
                          **kwargs)  # type: ignore[call-overload]


class RaucSystem:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = root / "backend"
        self.state.mkdir(parents=True)
        for name in ("ca", "other"):  # the keyring's signer, and one RAUC does not trust
            run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", root / f"{name}.key.pem",
                "-out", root / f"{name}.cert.pem", "-subj", f"/CN={name}", "-days", "30")
        self.slots = {"A": root / "rootfs-a.img", "B": root / "rootfs-b.img"}
        for path in self.slots.values():
            path.write_bytes(bytes(SLOT_BYTES))
        backend = root / "backend.sh"
        backend.write_text(BACKEND.format(state=self.state))
        backend.chmod(0o755)
        self.conf = root / "system.conf"
        self.conf.write_text(f"""[system]
compatible=edge-agent-test
bootloader=custom
data-directory={root / 'rauc-data'}
[keyring]
path={root / 'ca.cert.pem'}
[handlers]
bootloader-custom-backend={backend}
[slot.rootfs.0]
device={self.slots['A']}
type=raw
bootname=A
[slot.rootfs.1]
device={self.slots['B']}
type=raw
bootname=B
""")
        self.cmdline = root / "cmdline"
        socket = root / "bus.sock"
        (root / "dbus.conf").write_text(DBUS_CONF.format(socket=socket))
        out = run("dbus-daemon", f"--config-file={root / 'dbus.conf'}", "--fork", "--print-pid").stdout
        self.dbus_pid = int(out.split()[0])
        self.env = {**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": f"unix:path={socket}"}
        self.service: subprocess.Popen[bytes] | None = None
        self.booted: list[str] = []

    def bundle(self, version: str, content: bytes, *, signer: str = "ca") -> Path:
        src = self.root / f"bundle-{version}-{signer}"
        src.mkdir()
        (src / "rootfs.img").write_bytes(content)
        (src / "manifest.raucm").write_text(f"[update]\ncompatible=edge-agent-test\nversion={version}\n"
                                            "[bundle]\nformat=plain\n[image.rootfs]\nfilename=rootfs.img\n")
        out = self.root / f"update-{version}-{signer}.raucb"
        run("rauc", "bundle", "--cert", self.root / f"{signer}.cert.pem", "--key", self.root / f"{signer}.key.pem",
            src, out)
        return out

    def boot(self) -> str:
        """Power on: the backend's primary slot, or the other one when it is marked bad."""
        self.stop()
        primary = (self.state / "primary").read_text().strip() if (self.state / "primary").exists() else "A"
        state = self.state / f"state.{primary}"
        slot = primary if not state.exists() or state.read_text().strip() == "good" else "AB".replace(primary, "")
        self.cmdline.write_text(f"console=ttyS0 rauc.slot={slot}\n")
        self.service = subprocess.Popen(
            ["unshare", "-m", "sh", "-c", f"mount --bind {self.cmdline} /proc/cmdline && "
                                          f"exec rauc --conf={self.conf} service"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while subprocess.run(["rauc", "status"], env=self.env, capture_output=True, check=False).returncode != 0:
            assert time.monotonic() < deadline, "the rauc service did not come up"
            time.sleep(0.1)
        self.booted.append(slot)
        return slot

    def stop(self) -> None:
        if self.service is not None:
            self.service.terminate()
            self.service.wait(30)
            self.service = None

    def close(self) -> None:
        self.stop()
        os.kill(self.dbus_pid, signal.SIGTERM)


@pytest.fixture
def rauc_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RaucSystem]:
    system = RaucSystem(tmp_path / "rauc")
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", system.env["DBUS_SYSTEM_BUS_ADDRESS"])
    try:
        yield system
    finally:
        system.close()


class RaucDevice(Device):
    def __init__(self, root: Path, keys: Keys, system: RaucSystem, **kwargs: object) -> None:
        super().__init__(root, keys, **kwargs)  # type: ignore[arg-type]
        self.system = system

    def installer(self) -> Installer:
        self.system.boot()
        return RaucInstaller(state_dir=self.root, clock=self.clock, verify_key=self.keys.verify)


def artifact_of(tmp_path: Path, keys: Keys, bundle: Path, version: str) -> Path:
    out = tmp_path / f"{bundle.stem}.eafw"
    build_artifact(bundle, out, name="system", version=version, key=keys.signing, created_ts=1_700_000_000_000,
                   chunk_size=64 * 1024)
    return out


def offer(source: CountingSource) -> UpdateOffer:
    return UpdateOffer(rollout_id="r1", signed_manifest=source.signed_manifest)


async def test_a_bundle_installed_by_rauc_is_marked_good_after_the_health_check(
        tmp_path: Path, keys: Keys, rauc_system: RaucSystem, monkeypatch: pytest.MonkeyPatch) -> None:
    rootfs = os.urandom(200_000)
    artifact = artifact_of(tmp_path, keys, rauc_system.bundle("1.1.0", rootfs), "1.1.0")
    device = RaucDevice(tmp_path / "dev", keys, rauc_system, hardware=None)
    trial_file_at_sync: list[bool] = []  # RAUC's flags go to the disk before the trial file changes
    monkeypatch.setattr(rauc_module, "flags_on_disk",
                        lambda: trial_file_at_sync.append((device.root / rauc_module.TRIAL_FILE).exists()))
    source = CountingSource(artifact)
    updater = await device.boot()
    report = await updater.offer(offer(source), source)
    assert report.state == "rebooting", report.detail
    assert rauc_system.slots["B"].read_bytes()[:len(rootfs)] == rootfs  # RAUC wrote the inactive slot
    assert rauc_system.slots["A"].read_bytes() == bytes(SLOT_BYTES)
    assert updater.installer.default_slot() == "B" and updater.installer.trial_slot() == "B"
    updater = await device.boot()  # the bootloader boots RAUC's primary: B
    assert rauc_system.booted[-1] == "B"
    status = await updater.resume()
    assert (status.state, status.booted_slot, status.default_slot) == ("committed", "B", "B")
    assert isinstance(updater.installer, RaucInstaller)
    assert updater.installer.boot_status("B") == "good" and updater.installer.trial_slot() is None
    # the first boot's mark-good; the install, synced before the trial file is written; the
    # commit, synced before the file goes
    assert trial_file_at_sync == [False, False, True]
    await updater.close()


async def test_a_bundle_rauc_does_not_trust_is_refused_though_our_signature_holds(
        tmp_path: Path, keys: Keys, rauc_system: RaucSystem) -> None:
    rootfs = os.urandom(100_000)
    artifact = artifact_of(tmp_path, keys, rauc_system.bundle("1.1.0", rootfs, signer="other"), "1.1.0")
    device = RaucDevice(tmp_path / "dev", keys, rauc_system, hardware=None)
    source = CountingSource(artifact)
    updater = await device.boot()
    report = await updater.offer(offer(source), source)
    await updater.close()
    assert report.state == "failed" and "install failed" in report.detail and "rauc install" in report.detail
    assert rauc_system.slots["B"].read_bytes()[:len(rootfs)] != rootfs  # the two checks are independent
    assert device.rebooter.reasons == []


async def test_a_failed_health_check_marks_the_new_slot_bad_and_boots_the_old(
        tmp_path: Path, keys: Keys, rauc_system: RaucSystem) -> None:
    artifact = artifact_of(tmp_path, keys, rauc_system.bundle("1.1.0", os.urandom(100_000)), "1.1.0")
    device = RaucDevice(tmp_path / "dev", keys, rauc_system, hardware=None, health=ScriptedHealth(False))
    source = CountingSource(artifact)
    updater = await device.boot()
    await updater.offer(offer(source), source)
    updater = await device.boot()
    status = await updater.resume()
    assert status.state == "rolled_back" and device.rebooter.reasons[-1] == "back to slot A after a rollback"
    assert isinstance(updater.installer, RaucInstaller) and updater.installer.boot_status("B") == "bad"
    updater = await device.boot()
    assert rauc_system.booted[-1] == "A" and updater.status().state == "rolled_back"
    await updater.close()
