"""Each named scenario, run small, demonstrates its claim."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.cli import main as cli_main
from agent.core.errors import ConfigError
from agent.sim import SimOptions, Simulation
from agent.sim.rollout import run_rollout
from agent.sim.scenarios import SCENARIOS, check, get


async def _run(tmp_path: Path, **kwargs: Any) -> dict[str, Any]:
    kwargs.setdefault("heartbeat_s", 5.0)  # the scenarios' fast pace (their presets)
    return await Simulation(SimOptions(progress=False, **kwargs), workdir=tmp_path).run()


async def test_heartbeat_coalescing_keeps_one_pending_heartbeat_per_device(tmp_path: Path) -> None:
    report = await _run(tmp_path, devices=20, duration_s=300, seed=4, offline_rate=0.25, offline_duration_s=120,
                        scenario="heartbeat-coalescing")
    assert check("heartbeat-coalescing", report) == []
    # five devices offline for two minutes: 24 beats each made, at most one each ever pending
    offline = report["offline_episodes"]
    assert offline == 5
    assert 0 < max(p["heartbeats_pending"] for p in report["timeseries"]) <= offline
    assert report["heartbeats"]["coalesced_in_outboxes"] >= offline * 10
    assert report["leader_mailbox"]["heartbeats"]["high_water"] <= 20
    assert report["lost"] == 0 and report["conservation_ok"] is True


async def test_thundering_herd_never_overflows_the_leader_mailbox(tmp_path: Path) -> None:
    report = await _run(tmp_path, devices=60, duration_s=120, seed=5, leader_mailbox=8, leader_interval_s=0.5,
                        telemetry_s=5, broker_outage=(40.0, 30.0))
    assert check("thundering-herd", report) == []
    for box in report["leader_mailbox"].values():
        assert box["high_water"] <= box["capacity"] == 8
    assert report["leader"]["busy_answers"] > 0
    assert report["lost"] == 0 and report["conservation_ok"] is True


async def test_store_and_forward_loses_nothing_across_offline_periods_and_crashes(tmp_path: Path) -> None:
    report = await _run(tmp_path, devices=30, duration_s=300, seed=6, offline_rate=0.3, offline_duration_s=120,
                        crash_rate=0.2, crash_downtime_s=30, telemetry_s=10, broker_outage=(100.0, 30.0))
    assert check("offline-store-and-forward", report) == []
    assert report["crashes"] == 6 and report["devices"]["crashed_and_restarted"] == 6
    assert report["telemetry"]["via_outbox"] > 0
    assert report["lost"] == 0 and report["conservation_ok"] is True and report["drained"] is True
    assert report["heartbeats"]["stale_devices"] == 0


async def test_work_pulling_confirms_every_job_once_across_crashes(tmp_path: Path) -> None:
    report = await _run(tmp_path, devices=10, duration_s=180, seed=2, jobs=40, crash_rate=0.2, crash_downtime_s=20)
    assert check("work-pulling", report) == []
    assert report["jobs"]["confirmed"] == 40 and report["jobs"]["confirmed_more_than_once"] == 0
    assert report["lost"] == 0


@pytest.mark.slow
async def test_wave_rollout_succeeds_and_aborts_at_the_failure_threshold(tmp_path: Path) -> None:
    opts = SimOptions(devices=60, seed=3, heartbeat_s=5.0, progress=False)
    clean = await run_rollout(opts, workdir=tmp_path / "clean")
    assert clean["rollout"]["state"] == "succeeded" and clean["lost"] == 0 and clean["conservation_ok"]
    assert check("wave-rollout", clean) == []
    failing = await run_rollout(opts, workdir=tmp_path / "failing", fail_rate=0.2)
    assert failing["rollout"]["state"] == "aborted"
    assert failing["rollout"]["devices_offered_after_abort"] == 0
    assert check("wave-rollout", failing) == []
    # the devices the rollout had not reached are left alone
    assert failing["fleet"]["versions"].get("1.0.0", 0) > 0


async def test_a_cancel_mid_rollout_stops_the_fleet(tmp_path: Path) -> None:
    opts = SimOptions(devices=60, seed=3, heartbeat_s=5.0, progress=False)
    plain = await run_rollout(opts, workdir=tmp_path / "plain")
    assert plain["rollout"]["progress_reports"] > 0  # the devices said how far their downloads got
    canceled = await run_rollout(opts, workdir=tmp_path / "canceled", cancel_at_s=90.0)
    ro = canceled["rollout"]
    assert ro["state"] == "canceled" and ro["devices_installed_after_cancel"] == 0 and ro["cancel_pending"] == 0
    assert ro["counts"].get("canceled", 0) > 0 and canceled["lost"] == 0
    assert check("wave-rollout", canceled) == []
    # and the devices that did not install before the cancel still run the old version
    assert canceled["fleet"]["versions"].get("1.0.0", 0) == ro["counts"]["canceled"]


def test_a_claim_that_does_not_hold_is_reported() -> None:
    report = {"jobs": {"confirmed": 3, "submitted": 4, "confirmed_more_than_once": 0}}
    assert check("work-pulling", report) == ["3 of 4 jobs confirmed"]
    with pytest.raises(ConfigError):
        get("no-such-scenario")
    assert set(SCENARIOS) == {"heartbeat-coalescing", "thundering-herd", "wave-rollout", "config-rollout",
                              "app-rollout", "release-rollout", "offline-store-and-forward", "work-pulling"}
    broken = {"rollout": {"devices_offered_after_abort": 0, "state": "succeeded"}, "on_trial": 0,
              "unhealthy": {"devices": 2, "offered": 2, "failed": 1, "other_outcomes": {"d1": "succeeded"}},
              "running": {"1.0.0": 1, "2.0.0": 2, "0.9.0": 1}, "leader_knows": True}
    assert check("app-rollout", broken) == [
        "of 2 devices where the new version fails, 1 took it back by themselves ({'d1': 'succeeded'})",
        "devices run neither the old version nor the new one ({'0.9.0': 1}), or a trial is left (0)",
        "the new version failed on 2 devices, yet the rollout ended succeeded"]


def test_cli_scenario_prints_its_claim(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["simulate", "--scenario", "work-pulling", "--devices", "6", "--jobs", "12",
                     "--duration", "2m", "--quiet", "--report", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "scenario work-pulling: The leader holds a queue of jobs" in out
    assert "claim holds" in out
