from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from fwhelpers import CountingSource, Device, Keys, RecordingRebooter, make_artifact

from agent.core.codec import MessageRegistry, decode
from firmware_rollout.device.reboot import CommandRebooter
from firmware_rollout.errors import UpdaterError
from firmware_rollout.messages import KIND_UPDATE_OFFER, UpdateOffer, register_messages
from rollout_engine.messages import KIND_ROLLOUT_REPORT, RolloutReport, report_message


def test_report_travels_as_an_overwrite_outbox_message() -> None:
    report = RolloutReport(device="dev-1", rollout_id="r7", version="1.1.0", state="succeeded", phase="committed",
                          ts_ms=5, seq=42, active_version="1.1.0")  # fmt: skip
    msg = report_message(report, msg_id="m1", receiver="leader")
    assert (msg.kind, msg.owner, msg.receiver, msg.conflict, msg.seq) == (
        KIND_ROLLOUT_REPORT, "dev-1", "leader", "overwrite", 42,
    )  # fmt: skip
    assert msg.key == "rollout:dev-1:r7" and msg.ttl_ms == 0
    assert decode(msg.payload, RolloutReport) == report and report.final
    registry = MessageRegistry()
    register_messages(registry)
    assert registry.type_of(KIND_UPDATE_OFFER) is UpdateOffer and registry.type_of(KIND_ROLLOUT_REPORT) is RolloutReport


async def test_command_rebooter() -> None:
    # a command that returns and the device stays up: a failed reboot, not a wedged updater
    with pytest.raises(UpdaterError, match="exited 0 but the device was still up"):
        await CommandRebooter([sys.executable, "-c", "pass"], settle_s=0.01).reboot("test")
    with pytest.raises(UpdaterError, match="exited 1"):
        await CommandRebooter([sys.executable, "-c", "raise SystemExit(1)"]).reboot("test")
    with pytest.raises(UpdaterError, match="cannot run"):
        await CommandRebooter(["/nonexistent/reboot"]).reboot("test")


class BlockingSource(CountingSource):
    stuck: asyncio.Event

    def plan(self, indices: Sequence[int]) -> None:
        self.planned = list(indices)

    async def fetch(self, index: int) -> bytes:
        if index == 2:
            self.stuck.set()
            await asyncio.Event().wait()  # the leader went quiet mid-download
        return await super().fetch(index)


async def test_abort_a_canceled_download(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing)
    device = Device(tmp_path / "dev", keys)
    source = BlockingSource(artifact)
    source.stuck = asyncio.Event()
    updater = await device.boot()
    task = asyncio.create_task(updater.offer(UpdateOffer(rollout_id="r1", signed_manifest=source.signed_manifest),
                                             source))  # fmt: skip
    await source.stuck.wait()
    assert updater.status().chunks_done == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    status = await updater.abort("rollout r1 canceled")
    assert (status.state, status.detail, status.booted_slot) == ("failed", "rollout r1 canceled", "a")
    assert not (device.root / "staging.img").exists() and device.states()[-1] == "failed"
    assert (await updater.abort("again")).detail == "rollout r1 canceled"  # a finished update stays as it is
    await updater.close()


class BrokenRebooter(RecordingRebooter):
    async def reboot(self, reason: str, *, trial: bool = False) -> None:
        await super().reboot(reason, trial=trial)
        raise UpdaterError("systemctl reboot exited 1")


async def test_a_reboot_that_fails_ends_the_update_failed_with_the_trial_disarmed(tmp_path: Path,
                                                                                  keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing)
    device = Device(tmp_path / "dev", keys)
    device.rebooter = BrokenRebooter()
    source = CountingSource(artifact)
    updater = await device.boot()
    report = await updater.offer(UpdateOffer(rollout_id="r1", signed_manifest=source.signed_manifest), source)
    assert report.state == "failed" and "reboot failed: systemctl reboot exited 1" in report.detail
    assert updater.installer.trial_slot() is None and updater.installer.default_slot() == "a"  # disarmed
    assert device.installer().booted_slot() == "a"  # an ordinary restart boots the old slot
    # the updater is usable again: the next offer is taken (and fails the same way here)
    again = await updater.offer(UpdateOffer(rollout_id="r2", signed_manifest=source.signed_manifest), source)
    assert again.rollout_id == "r2" and again.state == "failed"
    await updater.close()


async def test_a_failed_reboot_back_after_a_rollback_is_not_retried_in_a_loop(tmp_path: Path, keys: Keys) -> None:
    from fwhelpers import ScriptedHealth

    artifact, _ = make_artifact(tmp_path, keys.signing)
    device = Device(tmp_path / "dev", keys, health=ScriptedHealth(False))
    source = CountingSource(artifact)
    updater = await device.boot()
    await updater.offer(UpdateOffer(rollout_id="r1", signed_manifest=source.signed_manifest), source)
    device.rebooter = BrokenRebooter()  # the trial booted; now the way back fails
    updater = await device.boot()
    status = await updater.resume()
    assert status.state == "rolled_back" and status.default_slot == "a"
    assert device.rebooter.reasons == ["back to slot a after a rollback"]  # tried once, not again and again
    status = await updater.resume()  # the next resume tries once more
    assert len(device.rebooter.reasons) == 2
    await updater.close()
