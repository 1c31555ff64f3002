from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from fwhelpers import make_image

from agent.core.clock import SystemClock, VirtualClock
from agent.core.gate import Gate
from firmware_rollout.artifact.manifest import Manifest
from firmware_rollout.device.health import AllChecks, CommandCheck, ConnectivityCheck, HealthResult
from firmware_rollout.device.slots import DirectoryInstaller
from firmware_rollout.errors import InstallError

PY = sys.executable
MANIFEST = Manifest(name="fw", version="2.0.0", size=1, sha256=bytes(32), chunk_size=1024, chunks=(bytes(32),))


async def test_command_check_passes_fails_and_times_out() -> None:
    clock = SystemClock()
    ok = await CommandCheck([PY, "-c", "print('services up')"]).check(clock, 30)
    assert ok == HealthResult(True, "services up")
    bad = await CommandCheck([PY, "-c", "import sys; print('db down'); sys.exit(3)"]).check(clock, 30)
    assert bad == HealthResult(False, "health command exited 3: db down")
    slow = await CommandCheck([PY, "-c", "import time; time.sleep(30)"], timeout_s=0.3).check(clock, 30)
    assert not slow.ok and "timed out after 0.3s" in slow.detail
    missing = await CommandCheck(["/nonexistent/health-check"]).check(clock, 30)
    assert not missing.ok and "did not start" in missing.detail
    with pytest.raises(ValueError):
        CommandCheck([])


async def test_connectivity_and_all_checks_on_virtual_time() -> None:
    clock = VirtualClock()
    broker, leader = Gate(), Gate()
    check = AllChecks(ConnectivityCheck(broker, leader), CommandCheck([PY, "-c", "pass"]))
    task = asyncio.create_task(check.check(clock, 60))
    await clock.advance(5)
    broker.open()
    await clock.advance(5)
    leader.open()
    await clock.settle()
    result = await task
    assert result.ok and "connected to broker and leader" in result.detail
    broker.close()
    task = asyncio.create_task(ConnectivityCheck(broker, leader).check(clock, 10))
    await clock.advance(10)
    assert (await task) == HealthResult(False, "broker not reached within 10s")


async def test_directory_installer_slots_and_flags(tmp_path: Path) -> None:
    image = make_image(tmp_path / "img", 3000)
    installer = DirectoryInstaller(tmp_path / "slots")
    assert (installer.booted_slot(), installer.default_slot(), installer.trial_slot()) == ("a", "a", None)
    with pytest.raises(InstallError, match="running system booted from it"):
        await installer.write("a", image, MANIFEST)
    with pytest.raises(InstallError, match="unknown slot"):
        await installer.mark_trial("c")
    await installer.write("b", image, MANIFEST)
    await installer.write("b", image, MANIFEST)  # idempotent
    assert installer.image_path("b").read_bytes() == image.read_bytes() and installer.slot_version("b") == "2.0.0"
    await installer.mark_trial("b")
    assert DirectoryInstaller(tmp_path / "slots").booted_slot() == "b"  # the next boot tries b
    await installer.revert("a")
    assert DirectoryInstaller(tmp_path / "slots").booted_slot() == "a"
    await installer.commit("b")
    rebooted = DirectoryInstaller(tmp_path / "slots")
    assert (rebooted.booted_slot(), rebooted.default_slot(), rebooted.trial_slot()) == ("b", "b", None)
    (tmp_path / "slots" / "bootenv.json").write_text("{not json")
    with pytest.raises(InstallError, match="unreadable boot environment"):
        DirectoryInstaller(tmp_path / "slots")
