"""Whole rollouts: a leader and simulated devices (real updaters, outboxes, ConfigServers) on the
in-memory broker and a virtual clock."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import msgspec
import pytest

from agent.core.clock import DEFAULT_VIRTUAL_EPOCH_MS, VirtualClock
from agent.sim.devices import DeviceFate
from agent.sim.rollout import default_spec, device_ids, wave_rollout_scenario
from rollout_engine.messages import RolloutReport
from rollout_engine.plan import plan_waves
from rollout_engine.spec import spec_from_dict
from rollout_engine.store import RolloutStore


def open_store(work: Path) -> RolloutStore:
    return RolloutStore.open(work / "leader" / "leader.db", clock=VirtualClock())


def plan_for(work: Path, devices: int, seed: int, **overrides: dict[str, Any]) -> list[list[str]]:
    data = default_spec(work / "unused.eafw", seed=seed, devices=devices)
    for section, values in overrides.items():
        data[section].update(values)
    return plan_waves(spec_from_dict(data), device_ids(devices))


@pytest.mark.slow
async def test_a_clean_four_wave_rollout_of_200_devices_respects_the_download_bound(tmp_path: Path) -> None:
    report = await wave_rollout_scenario(devices=200, seed=3, work_dir=tmp_path)
    rollout = report["rollout"]
    assert rollout["state"] == "succeeded", rollout["detail"]
    assert [w["state"] for w in rollout["waves"]] == ["passed"] * 4
    assert [w["size"] for w in rollout["waves"]] == [10, 57, 66, 67]
    assert report["outcomes"] == {"succeeded": 200}
    assert report["fleet"]["versions"] == {"1.1.0": 200}
    downloads = report["downloads"]
    assert downloads["bound"] == 6
    assert 1 <= downloads["max_concurrent"] <= downloads["bound"]
    assert downloads["mailbox_high_water"] <= downloads["mailbox_capacity"]
    assert downloads["busy"] > 0  # the bound was hit and answered busy, never exceeded
    store = open_store(tmp_path)
    try:
        offers = store.offers("wave-rollout")
        assert sorted(d for d, _, _ in offers) == device_ids(200)  # every device offered exactly once
        waves = store.waves("wave-rollout")
        for before, after in zip(waves, waves[1:], strict=False):
            assert before.finished_ms is not None and after.started_ms is not None
            assert after.started_ms >= before.finished_ms  # no wave started before the previous passed
    finally:
        store.close()


async def test_ten_percent_failing_devices_trip_the_failure_threshold(tmp_path: Path) -> None:
    report = await wave_rollout_scenario(devices=200, seed=3, fail_rate=0.1, work_dir=tmp_path)
    rollout = report["rollout"]
    assert rollout["state"] == "aborted"
    assert "failure threshold" in rollout["detail"]
    assert rollout["devices_offered_after_abort"] == 0
    counts = report["outcomes"]
    assert counts["rolled_back"] >= 1
    offered = rollout["offers"]
    assert counts["canceled"] == 200 - offered  # everything not offered before the abort stays untouched
    assert report["fleet"]["versions"]["1.0.0"] >= 200 - offered
    store = open_store(tmp_path)
    try:
        untouched = [d for d in store.devices("wave-rollout") if d.state == "canceled"]
        assert untouched and all(d.offers == 0 for d in untouched)
        assert all(w.state == "canceled" for w in store.waves("wave-rollout")[2:])
    finally:
        store.close()


async def test_a_failing_canary_stops_everything(tmp_path: Path) -> None:
    overrides = {"gates": {"failure_threshold_pct": 100.0}}
    canary = plan_for(tmp_path, 40, 5, **overrides)[0]
    report = await wave_rollout_scenario(devices=40, seed=5, work_dir=tmp_path, spec_overrides=overrides,
                                         fates={canary[0]: DeviceFate(health_fails=True)})
    rollout = report["rollout"]
    assert rollout["state"] == "aborted"
    assert "canary" in rollout["detail"]
    assert rollout["waves"][0]["state"] == "failed"
    assert [w["state"] for w in rollout["waves"][1:]] == ["canceled"] * 3
    assert rollout["offers"] == len(canary)
    assert report["outcomes"] == {"canceled": 40 - len(canary), "rolled_back": 1, "succeeded": len(canary) - 1}


async def test_a_device_that_never_answers_times_out(tmp_path: Path) -> None:
    overrides: dict[str, dict[str, Any]] = {"gates": {"success_threshold_pct": 80.0, "failure_threshold_pct": 50.0},
                                            "device": {"timeout_s": 300.0}}
    waves = plan_for(tmp_path, 20, 2, **overrides)
    mute = waves[1][0]
    report = await wave_rollout_scenario(devices=20, seed=2, work_dir=tmp_path, spec_overrides=overrides,
                                         fates={mute: DeviceFate(silent=True)})
    assert report["rollout"]["state"] == "succeeded"
    assert report["outcomes"] == {"succeeded": 19, "timed_out": 1}
    store = open_store(tmp_path)
    try:
        row = store.device("wave-rollout", mute)
        assert row is not None and row.state == "timed_out" and "no progress" in row.detail
    finally:
        store.close()


async def test_health_failure_reverts_and_install_failure_fails_through_the_updater(tmp_path: Path) -> None:
    overrides: dict[str, dict[str, Any]] = {"gates": {"success_threshold_pct": 0.0, "failure_threshold_pct": 100.0}}
    waves = plan_for(tmp_path, 12, 1, **overrides)
    sick, broken = waves[1][0], waves[1][1]
    report = await wave_rollout_scenario(
        devices=12, seed=1, work_dir=tmp_path, spec_overrides=overrides,
        fates={sick: DeviceFate(health_fails=True), broken: DeviceFate(install_fails=True)})
    assert report["outcomes"] == {"failed": 1, "rolled_back": 1, "succeeded": 10}
    store = open_store(tmp_path)
    try:
        reverted = store.device("wave-rollout", sick)
        assert reverted is not None and reverted.state == "rolled_back"
        assert "health check failed" in reverted.detail
        failed = store.device("wave-rollout", broken)
        assert failed is not None and failed.state == "failed" and "install failed" in failed.detail
    finally:
        store.close()
    # the reverted device booted its old slot again and runs the old version
    bootenv = (tmp_path / "devices" / sick / "slots" / "bootenv.json").read_text()
    assert '"trial": null' in bootenv and '"default": "a"' in bootenv
    assert report["fleet"]["versions"] == {"1.0.0": 2, "1.1.0": 10}


async def test_installs_start_only_inside_the_device_local_maintenance_window(tmp_path: Path) -> None:
    # The virtual clock starts at 22:13:20 UTC (the simulated devices' local time); the window opens at 23:00.
    # A 10-minute timeout although the window opens 47 minutes after the offer: a waiting device
    # says so, and its timeout runs from the window.
    overrides: dict[str, dict[str, Any]] = {"device": {"timeout_s": 600.0, "maintenance_windows": ["23:00-23:30"]}}
    report = await wave_rollout_scenario(devices=4, seed=1, work_dir=tmp_path, spec_overrides=overrides)
    assert report["rollout"]["state"] == "succeeded", report["rollout"]
    opens_ms = DEFAULT_VIRTUAL_EPOCH_MS + (23 * 3600 - (22 * 3600 + 13 * 60 + 20)) * 1000
    waited = 0
    for device in device_ids(4):
        conn = sqlite3.connect(tmp_path / "devices" / device / "updater.db")
        try:
            bodies = [b for (b,) in conn.execute("SELECT body FROM reports ORDER BY seq")]
        finally:
            conn.close()
        reports = [msgspec.msgpack.decode(b, type=RolloutReport) for b in bodies]
        if reports[0].state == "waiting_window":  # offered before the window opened: it said it waits
            waited += 1
            assert abs(reports[0].until_ms - opens_ms) < 1000 and reports[0].detail == "until 23:00 device time"
            reports = reports[1:]
        assert reports and reports[0].state == "downloading"
        assert reports[0].ts_ms >= opens_ms  # nothing started before the window opened
        assert reports[-1].state == "succeeded"
    assert waited >= 1  # the canary, offered at 22:13


async def test_a_user_spec_and_artifact_can_be_simulated(tmp_path: Path) -> None:
    from firmware_rollout.artifact.fixture import make_artifact

    artifact, public = make_artifact(tmp_path / "user", version="2.0.0", chunk_size=1024, size=3000)
    spec = tmp_path / "user" / "spec.toml"
    spec.write_text(f'[rollout]\nname = "mine"\nartifact = "{artifact.name}"\n'
                    '[waves]\nramp = { base = 2, factor = 2.0 }\n')
    report = await wave_rollout_scenario(devices=9, seed=4, work_dir=tmp_path / "sim", spec_path=spec,
                                         public_key=public)
    assert report["rollout"]["state"] == "succeeded"
    assert [w["size"] for w in report["rollout"]["waves"]] == [2, 4, 3]
    assert report["fleet"]["versions"] == {"2.0.0": 9}
