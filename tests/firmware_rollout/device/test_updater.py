from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from fwhelpers import CHUNK, CountingSource, Device, Keys, ScriptedHealth, make_artifact

from agent.core.clock import VirtualClock
from agent.core.errors import Capacity, Permanent, Transient
from agent.core.gate import Gate
from firmware_rollout.device.health import ConnectivityCheck
from firmware_rollout.device.updater import Updater, UpdaterSettings
from firmware_rollout.messages import UpdateOffer
from rollout_engine.keys import SigningKey


def offer_for(source: CountingSource, rollout: str = "r1") -> UpdateOffer:
    return UpdateOffer(rollout_id=rollout, signed_manifest=source.signed_manifest)


def bootenv(device: Device) -> dict[str, str | None]:
    return json.loads((device.root / "slots" / "bootenv.json").read_text())  # type: ignore[no-any-return]


async def test_happy_path_commits_after_health_and_reports_success_only_then(tmp_path: Path, keys: Keys) -> None:
    artifact, signed = make_artifact(tmp_path, keys.signing, version="1.1.0", hardware=["rpi4"])
    device = Device(tmp_path / "dev", keys)
    env_when_succeeded: list[dict[str, str | None]] = []
    device.on_sent = lambda r: env_when_succeeded.append(bootenv(device)) if r.state == "succeeded" else None
    source = CountingSource(artifact)

    updater = await device.boot()
    assert updater.status().booted_slot == "a" and updater.active_version == "1.0.0"
    report = await updater.offer(offer_for(source), source)
    assert report.phase == "rebooting" and report.state == "rebooting"
    assert device.rebooter.reasons == ["trying version 1.1.0 in slot b"]
    assert source.fetched == list(range(signed.manifest.chunk_count))
    assert device.states() == ["downloading", "verifying", "installing", "rebooting"]
    assert "succeeded" not in [r.state for r in device.sent]
    assert bootenv(device) == {"default": "a", "trial": "b"}
    image = (tmp_path / "image-1.1.0-1.bin").read_bytes()
    assert (device.root / "slots" / "b" / "image").read_bytes() == image
    assert not (device.root / "staging.img").exists()  # streamed into the slot: no second copy

    updater = await device.boot()  # the process restarted on slot b
    assert updater.status().state == "verifying_health" and updater.status().boot_count == 1
    status = await updater.resume()
    await updater.close()
    assert status.state == "committed"
    assert (status.booted_slot, status.default_slot, status.active_version) == ("b", "b", "1.1.0")
    assert device.states()[-2:] == ["verifying_health", "committed"]
    succeeded = [r for r in device.sent if r.state == "succeeded"]
    assert len(succeeded) == 1 and succeeded[0].active_version == "1.1.0" and succeeded[0].rollout_id == "r1"
    assert env_when_succeeded == [{"default": "b", "trial": None}]  # committed before it was reported
    assert [r.seq for r in device.sent] == sorted({r.seq for r in device.sent})
    assert not (device.root / "staging.img").exists()

    updater = await device.boot()  # a later reboot stays on b
    assert updater.status().booted_slot == "b" and updater.active_version == "1.1.0"
    again = await updater.offer(offer_for(source), source)  # a re-offer after success: no second install
    assert again.state == "succeeded" and "already running" in again.detail
    assert len(source.fetched) == signed.manifest.chunk_count
    await updater.close()


async def test_failed_health_check_reverts_to_the_old_slot(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing)
    device = Device(tmp_path / "dev", keys, health=ScriptedHealth(False))
    source = CountingSource(artifact)
    updater = await device.boot()
    await updater.offer(offer_for(source), source)
    updater = await device.boot()
    status = await updater.resume()
    assert status.state == "rolled_back" and "health check failed: leader not reached" in status.detail
    assert device.rebooter.reasons[-1] == "back to slot a after a rollback"
    assert bootenv(device) == {"default": "a", "trial": None}
    updater = await device.boot()
    status = updater.status()
    assert (status.state, status.booted_slot, status.active_version) == ("rolled_back", "a", "1.0.0")
    assert await updater.resume() == status  # nothing left to do, no further reboot
    assert len(device.rebooter.reasons) == 2
    again = await updater.offer(offer_for(source), source)  # a repeated offer does not reinstall
    assert again.state == "rolled_back" and again.detail.startswith("already rolled back: health check failed")
    assert len(source.fetched) == 6 and len(device.rebooter.reasons) == 2
    await updater.close()
    assert [r.state for r in device.sent][-1] == "rolled_back"
    assert "succeeded" not in [r.state for r in device.sent]


async def test_crash_loop_reverts(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing)
    device = Device(tmp_path / "dev", keys, settings=UpdaterSettings(max_boots=3))
    source = CountingSource(artifact)
    updater = await device.boot()
    await updater.offer(offer_for(source), source)
    for boot in range(1, 4):  # the new image crashes before its health check could pass
        updater = await device.boot()
        assert updater.status().boot_count == boot and updater.status().booted_slot == "b"
        await updater.close()
    updater = await device.boot()
    status = await updater.resume()
    assert status.state == "rolled_back" and "crash loop" in status.detail and "booted 4 times" in status.detail
    updater = await device.boot()
    assert (updater.status().booted_slot, updater.active_version) == ("a", "1.0.0")
    await updater.close()
    assert device.health.checks == 0  # type: ignore[attr-defined]


async def test_tampered_chunk_from_source_is_refused(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing)
    device = Device(tmp_path / "dev", keys)
    source = CountingSource(artifact, tamper=3)
    updater = await device.boot()
    report = await updater.offer(offer_for(source), source)
    assert report.state == "rejected" and "tampered chunk: chunk 3 of 6" in report.detail
    assert source.fetched == [0, 1, 2, 3]
    assert device.rebooter.reasons == []
    assert bootenv(device) == {"default": "a", "trial": None}
    assert not (device.root / "slots" / "b" / "version").exists()  # never checked whole, never armed
    assert not (device.root / "staging.img").exists()
    assert updater.status().booted_slot == "a" and updater.active_version == "1.0.0"
    await updater.close()


@pytest.mark.parametrize("case", ["wrong key", "bad signature", "downgrade", "hardware", "malformed", "image"])
async def test_refusals_before_any_download(tmp_path: Path, keys: Keys, case: str,
                                            caplog: pytest.LogCaptureFixture) -> None:
    key = SigningKey.generate() if case == "wrong key" else keys.signing
    version = "0.9.0" if case == "downgrade" else "1.1.0"
    hardware = ["rpi3"] if case == "hardware" else []
    artifact, _ = make_artifact(tmp_path, key, version=version, hardware=hardware)
    source = CountingSource(artifact)
    manifest = bytearray(source.signed_manifest)
    if case == "bad signature":
        manifest[-1] ^= 1
    if case == "malformed":
        manifest = manifest[:10]
    device = Device(tmp_path / "dev", keys, image="camera" if case == "image" else None)  # the artifact is "fw"
    updater = await device.boot()
    report = await updater.offer(UpdateOffer(rollout_id="r1", signed_manifest=bytes(manifest)), source)
    expected = {"wrong key": "signed by key", "bad signature": "does not verify", "downgrade": "downgrade refused",
                "hardware": "incompatible hardware", "malformed": "truncated",
                "image": "incompatible image: this is a 'fw' image, this device runs 'camera'"}[case]  # fmt: skip
    assert report.state == "rejected" and expected in report.detail
    assert source.fetched == [] and device.rebooter.reasons == []
    assert updater.status().state == "rejected" and updater.active_version == "1.0.0"
    # every refusal is one WARNING line on the device, a second offer's too (the state was "rejected" already)
    await updater.offer(UpdateOffer(rollout_id="r2", signed_manifest=bytes(manifest)), source)
    refusals = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "refused" in r.getMessage()]
    assert len(refusals) == 2 and all(expected in line for line in refusals), refusals
    assert refusals[1].startswith("update r2 refused: ")
    await updater.close()


async def test_signed_rollback_is_installed(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing, version="1.0.0", rollback=True)
    device = Device(tmp_path / "dev", keys, initial_version="1.1.0")
    source = CountingSource(artifact)
    updater = await device.boot()
    assert (await updater.offer(offer_for(source), source)).state == "rebooting"
    updater = await device.boot()
    assert (await updater.resume()).active_version == "1.0.0"
    await updater.close()


async def test_offer_while_busy_is_refused_without_touching_the_update(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing)
    device = Device(tmp_path / "dev", keys)
    source = CountingSource(artifact)
    updater = await device.boot()
    await updater.offer(offer_for(source), source)
    updater = await device.boot()
    report = await updater.offer(offer_for(source, "r2"), source)
    assert report.rollout_id == "r2" and report.state == "rejected" and "busy with rollout r1" in report.detail
    assert report.version == "1.1.0"
    assert updater.status().state == "verifying_health"
    assert (await updater.resume()).state == "committed"
    await updater.close()


async def test_fetch_retries_on_virtual_time_then_gives_up(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing)
    clock = VirtualClock()
    settings = UpdaterSettings(fetch_attempts=3, fetch_backoff_base_s=2.0)
    device = Device(tmp_path / "dev", keys, clock=clock, settings=settings)
    busy = Capacity("config server busy", retry_after_ms=5000)
    source = CountingSource(artifact, failures={1: [Transient("timeout"), busy, Transient("lost")]}, clock=clock)
    updater = await device.boot()
    task = asyncio.create_task(updater.offer(offer_for(source), source))
    await clock.advance(1.9)
    assert source.fetched == [0, 1]  # first failure, waiting 2 s
    await clock.advance(0.2)
    assert source.fetched == [0, 1, 1]  # busy: waits 5 s and the attempt is not spent
    await clock.advance(5.0)
    assert source.fetched[:4] == [0, 1, 1, 1]
    await clock.advance(4.0)  # second transient failure waited 4 s, then it worked
    report = await task
    assert report.state == "rebooting" and source.fetched.count(1) == 4

    device2 = Device(tmp_path / "dev2", keys, clock=clock, settings=settings)
    failing = CountingSource(artifact, failures={0: [Transient("down")] * 5}, clock=clock)
    updater2 = await device2.boot()
    task = asyncio.create_task(updater2.offer(offer_for(failing), failing))
    await clock.advance(60)
    report = await task
    assert report.state == "failed" and "chunk 0 failed after 3 attempts" in report.detail
    permanent = CountingSource(artifact, failures={2: [Permanent("no such rollout")]}, clock=clock)
    report = await updater2.offer(offer_for(permanent, "r3"), permanent)
    assert report.state == "failed" and "refused by the source" in report.detail
    await updater2.close()


async def test_health_deadline_on_virtual_time(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing)
    clock = VirtualClock()
    broker, leader = Gate(), Gate()
    device = Device(tmp_path / "dev", keys, clock=clock, health=ConnectivityCheck(broker, leader),
                    settings=UpdaterSettings(health_timeout_s=30))  # fmt: skip
    source = CountingSource(artifact, clock=clock)
    updater = await device.boot()
    await updater.offer(offer_for(source), source)
    updater = await device.boot()
    task = asyncio.create_task(updater.resume())
    await clock.advance(10)
    broker.open()  # the broker comes, the leader never answers
    await clock.advance(19.9)
    assert not task.done()
    await clock.advance(0.2)
    status = await task
    assert status.state == "rolled_back" and "leader not reached within" in status.detail


async def test_reports_wait_in_the_store_until_the_sink_takes_them(tmp_path: Path, keys: Keys) -> None:
    from agent.core.errors import NotConnected

    artifact, _ = make_artifact(tmp_path, keys.signing)
    device = Device(tmp_path / "dev", keys)
    offline = True

    async def sink(report: object) -> None:
        if offline:
            raise NotConnected("outbox unavailable")
        device.sent.append(report)  # type: ignore[arg-type]

    device.sink = sink  # type: ignore[method-assign]
    source = CountingSource(artifact, tamper=0)
    updater = await device.boot()
    await updater.offer(offer_for(source), source)
    assert device.sent == [] and [r.phase for r in await updater.reports(unsent_only=True)] == [
        "downloading",
        "rejected",
    ]
    offline = False
    assert await updater.flush_reports() == 2
    assert device.states() == ["downloading", "rejected"] and await updater.reports(unsent_only=True) == []
    await updater.close()


async def test_unreadable_state_is_a_typed_error(tmp_path: Path, keys: Keys) -> None:
    from agent.core.errors import StoreError
    from firmware_rollout.errors import InvalidVersion

    device = Device(tmp_path / "dev", keys)
    device.root.mkdir()
    (device.root / "updater.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="updater database"):
        await device.boot()
    with pytest.raises(InvalidVersion):
        await Device(tmp_path / "dev2", keys, initial_version="one").boot()


async def test_a_download_reports_how_far_it_got_at_every_tenth(tmp_path: Path, keys: Keys) -> None:
    artifact, signed = make_artifact(tmp_path, keys.signing, version="1.1.0", hardware=["rpi4"], size=20 * CHUNK)
    device = Device(tmp_path / "dev", keys)
    source = CountingSource(artifact)
    updater = await device.boot()
    await updater.offer(offer_for(source), source)
    got = device.progress()
    total = signed.manifest.chunk_count
    assert got[-1] == (total, total)  # the end of the download, always
    assert [done for done, _ in got] == sorted({done for done, _ in got})  # growing, no repeat
    assert len(got) >= 10  # a tenth of 20 chunks is 2: one report each (or more often)
    last = [r for r in device.sent if r.progress is not None][-1]
    assert last.progress is not None and last.progress.bytes_done == last.progress.bytes_total == 20 * CHUNK
    assert last.detail.startswith("100%: chunk 20 of 20")


async def test_a_cancel_mid_download_discards_the_staging_and_reports_canceled(tmp_path: Path, keys: Keys) -> None:
    artifact, _ = make_artifact(tmp_path, keys.signing, version="1.1.0", hardware=["rpi4"], size=20 * CHUNK)
    device = Device(tmp_path / "dev", keys)
    source = CountingSource(artifact, failures={5: [Transient("slow network")] * 2})
    updater = await device.boot()
    task = asyncio.ensure_future(updater.offer(offer_for(source), source))
    while len(source.fetched) < 5:
        await asyncio.sleep(0)
    task.cancel()  # what the UpdaterActor does when the leader's cancel comes
    with pytest.raises(asyncio.CancelledError):
        await task
    status = await updater.cancel("r1", "canceled by operator")
    assert status.state == "canceled" and status.active_version == "1.0.0"
    assert updater.slot_versions() == {"a": "1.0.0", "b": "partial"}  # b was written in part
    assert not (device.root / "staging.img").exists()
    assert device.sent[-1].state == "canceled" and "canceled by operator" in device.sent[-1].detail
    # never started here: still answered, so the leader hears back
    status = await updater.cancel("r-other", "aborted")
    assert device.sent[-1].rollout_id == "r-other" and device.sent[-1].state == "canceled"
    # a new offer is taken afresh
    again = CountingSource(artifact)
    report = await updater.offer(offer_for(again, rollout="r2"), again)
    assert report.state == "rebooting" and updater.slot_versions() == {"a": "1.0.0", "b": "1.1.0"}
    await updater.close()


async def test_no_reboot_while_an_application_holds_the_update_lock(tmp_path: Path, keys: Keys) -> None:
    import fcntl
    import os

    artifact, _ = make_artifact(tmp_path, keys.signing, version="1.1.0", hardware=["rpi4"])
    lock = tmp_path / "update.lock"
    lock.write_text("")
    clock = VirtualClock()
    device = Device(tmp_path / "dev", keys, clock=clock, settings=UpdaterSettings(update_lock=str(lock)))
    source = CountingSource(artifact, clock=clock)
    updater = await device.boot()
    held = os.open(lock, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # what `flock update.lock critical-work` does
    try:
        task = asyncio.ensure_future(updater.offer(offer_for(source), source))
        for _ in range(200):
            await clock.advance(1)
            if any(r.state == "waiting_lock" for r in device.sent):
                break
        waiting = [r for r in device.sent if r.state == "waiting_lock"]
        assert waiting and str(lock) in waiting[0].detail
        await clock.advance(120)
        assert device.rebooter.reasons == []  # installed and armed, but not rebooted under the lock
        assert len([r for r in device.sent if r.state == "waiting_lock"]) >= 2  # still says it waits
    finally:
        fcntl.flock(held, fcntl.LOCK_UN)
        os.close(held)
    for _ in range(20):
        await clock.advance(1)
        if task.done():
            break
    assert (await task).state == "rebooting"
    assert device.rebooter.reasons == ["trying version 1.1.0 in slot b"]


async def test_max_download_kbps_keeps_the_download_within_its_rate_on_virtual_time(tmp_path: Path,
                                                                                     keys: Keys) -> None:
    artifact, signed = make_artifact(tmp_path, keys.signing, size=40 * 1024)  # 40 chunks of 1 KiB
    clock = VirtualClock()
    device = Device(tmp_path / "dev", keys, clock=clock, settings=UpdaterSettings(max_download_kbps=80))
    source = CountingSource(artifact, clock=clock)  # 80 kbit/s = 10,000 bytes a second
    updater = await device.boot()
    task = asyncio.create_task(updater.offer(offer_for(source), source))
    await clock.advance(2.0)
    assert 19 <= len(source.fetched) <= 21  # 20,480 bytes in 2 s: the cap, not the source, sets the pace
    await clock.advance(2.0)
    assert 39 <= len(source.fetched) <= 40 and not task.done()
    await clock.advance(1.0)
    assert (await task).state == "rebooting"
    await updater.close()


async def test_an_offer_s_manifest_is_decoded_once_by_the_updater_and_once_by_its_installer(
        tmp_path: Path, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    """The updater checks the offer's signed manifest once and carries the checked one (the
    download plan, the status, every step); the installer checks it once more for itself (the
    root helper's installer trusts nothing the agent says)."""
    import firmware_rollout.artifact.manifest as manifest_module

    artifact, _ = make_artifact(tmp_path, keys.signing, version="1.1.0", hardware=["rpi4"])
    device = Device(tmp_path / "dev", keys)
    source = CountingSource(artifact)
    updater = await device.boot()
    decoded = []
    real = manifest_module.decode_manifest

    def counting(data: bytes) -> object:
        decoded.append(data)
        return real(data)

    monkeypatch.setattr(manifest_module, "decode_manifest", counting)
    offer = offer_for(source)
    manifest = updater.checked(offer.signed_manifest)  # what the worker plans its download source with
    report = await updater.offer(offer, source)
    assert report.state == "rebooting" and updater.status().chunks_total == manifest.chunk_count
    assert len(decoded) == 2


async def on_trial_boot(where: Path, keys: Keys, clock: VirtualClock, health: ConnectivityCheck, *,
                        leader_wait_s: float) -> Updater:
    """A device that took an update and booted the new slot (health timeout 30 s): its updater."""
    where.mkdir()
    artifact, _ = make_artifact(where, keys.signing)
    device = Device(where / "dev", keys, clock=clock, health=health,
                    settings=UpdaterSettings(health_timeout_s=30, leader_wait_s=leader_wait_s))
    source = CountingSource(artifact, clock=clock)
    updater = await device.boot()
    await updater.offer(offer_for(source), source)
    return await device.boot()


async def test_a_leader_announced_offline_is_waited_for_instead_of_reverting(tmp_path: Path, keys: Keys) -> None:
    """On the trial boot the broker is there and the leader is not: when the leader announced
    itself offline (its last will) the trial waits for it past the health timeout and commits
    once it answers; the wait is bounded by `leader_wait_s`."""
    clock = VirtualClock()
    broker, leader = Gate(), Gate()
    updater = await on_trial_boot(tmp_path / "a", keys, clock,
                                  ConnectivityCheck(broker, leader, leader_down=lambda since: True), leader_wait_s=600)
    broker.open()
    task = asyncio.create_task(updater.resume())
    await clock.advance(250)  # far past the health timeout: still on trial, waiting
    assert not task.done()
    assert updater.status().state == "verifying_health" and "waiting for the leader" in updater.status().detail
    leader.open()  # the leader is back and answers
    await clock.advance(1)
    status = await task
    assert status.state == "committed" and status.active_version == "1.1.0"
    await updater.close()


async def test_a_leader_that_stays_offline_or_a_device_of_its_own_failing_still_reverts(tmp_path: Path,
                                                                                         keys: Keys) -> None:
    clock = VirtualClock()
    broker = Gate()
    updater = await on_trial_boot(tmp_path / "a", keys, clock,
                                  ConnectivityCheck(broker, Gate(), leader_down=lambda since: True), leader_wait_s=100)
    broker.open()
    task = asyncio.create_task(updater.resume())
    await clock.advance(131)
    status = await task
    assert status.state == "rolled_back" and "the leader was still offline after" in status.detail
    await updater.close()
    # no broker at all is this device's own failure: no wait, whatever the leader announced
    updater = await on_trial_boot(tmp_path / "b", keys, clock,
                                  ConnectivityCheck(Gate(), Gate(), leader_down=lambda since: True), leader_wait_s=100)
    task = asyncio.create_task(updater.resume())
    await clock.advance(31)
    status = await task
    assert status.state == "rolled_back" and "broker not reached within 30s" in status.detail
    await updater.close()


async def test_a_failing_health_command_decides_even_while_the_leader_is_announced_offline() -> None:
    from firmware_rollout.device.health import AllChecks, HealthResult

    class Fixed:
        def __init__(self, result: HealthResult) -> None:
            self.result = result

        async def check(self, clock: object, timeout_s: float) -> HealthResult:
            return self.result

    clock = VirtualClock()
    waiting = HealthResult(False, "the leader announced itself offline: waiting for it", wait=True)
    failed = HealthResult(False, "health command exited 1")
    assert await AllChecks(Fixed(waiting), Fixed(failed)).check(clock, 10) == failed
    assert await AllChecks(Fixed(waiting), Fixed(HealthResult(True, "fine"))).check(clock, 10) == waiting
