from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from fwhelpers import Keys, make_artifact, stream_into

from agent.core.clock import SystemClock, VirtualClock
from agent.core.errors import BadSignature
from agent.core.gate import Gate
from firmware_rollout.artifact.files import read_image_chunk, read_signed_manifest
from firmware_rollout.device.health import AllChecks, CommandCheck, ConnectivityCheck, HealthResult
from firmware_rollout.device.slots import DirectoryInstaller
from firmware_rollout.errors import ChunkMismatch, InstallError

PY = sys.executable


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


async def test_directory_installer_slots_and_flags(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing, version="2.0.0")
    signed = read_signed_manifest(artifact)
    installer = DirectoryInstaller(tmp_path / "slots", verify_key=keys.verify)
    assert (installer.booted_slot(), installer.default_slot(), installer.trial_slot()) == ("a", "a", None)
    with pytest.raises(InstallError, match="running system booted from it"):
        await installer.open_slot("a", signed.raw)
    with pytest.raises(InstallError, match="unknown slot 'c'"):
        await installer.open_slot("c", signed.raw)
    await installer.open_slot("b", signed.raw)
    with pytest.raises(InstallError, match="not written and checked"):
        await installer.mark_trial("b")
    with pytest.raises(ChunkMismatch, match="tampered chunk"):  # checked by the installer too
        await installer.write_chunk("b", 0, b"x" * signed.manifest.chunk_length(0))
    await stream_into(installer, "b", artifact)
    await stream_into(installer, "b", artifact)  # idempotent
    assert installer.image_path("b").read_bytes() == artifact.read_bytes()[signed.size:]
    assert installer.slot_version("b") == "2.0.0"
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


async def test_an_installer_with_a_key_refuses_an_unsigned_manifest(tmp_path: Path, keys: Keys) -> None:
    unsigned = read_signed_manifest(make_artifact(tmp_path, None, version="2.0.0")[0])
    installer = DirectoryInstaller(tmp_path / "slots", verify_key=keys.verify)
    with pytest.raises(BadSignature):
        await installer.open_slot("b", unsigned.raw)
    assert not installer.image_path("b").exists() or installer.image_path("b").stat().st_size == 0


async def test_a_slot_corrupted_after_its_writes_fails_the_read_back_naming_the_chunk(tmp_path: Path,
                                                                                       keys: Keys) -> None:
    artifact, signed = make_artifact(tmp_path, keys.signing, version="2.0.0")
    installer = DirectoryInstaller(tmp_path / "slots", verify_key=keys.verify)
    await installer.open_slot("b", signed.raw)
    for index in range(signed.manifest.chunk_count):
        await installer.write_chunk("b", index, read_image_chunk(artifact, signed, index))
    image = installer.image_path("b")
    data = bytearray(image.read_bytes())
    data[3 * signed.manifest.chunk_size + 7] ^= 0x01  # a sector that went bad after the write
    image.write_bytes(bytes(data))
    with pytest.raises(ChunkMismatch, match="chunk 3 of"):
        await installer.check_slot("b")
    with pytest.raises(InstallError, match="not written and checked"):
        await installer.mark_trial("b")
