"""The app-rollout scenario: a signed application bundle in waves to real workers (the real
application module and helper on each device's files) on virtual time. The devices where the new
version fails take it back by themselves and run the old one again, the failure threshold aborts
the rollout, the leader's registry learns what every device runs from its heartbeats, and the
same seed gives the same report, in two processes of their own."""

from __future__ import annotations

import asyncio
from pathlib import Path

from test_determinism import as_text, simulate

from agent.sim.app_rollout import app_rollout_scenario
from agent.sim.scenarios import check


def test_a_version_that_fails_on_some_devices_is_taken_back_there_and_aborts_the_rollout(tmp_path: Path) -> None:
    report = asyncio.run(app_rollout_scenario(devices=60, seed=7, fail_rate=0.1, work_dir=tmp_path))
    assert check("app-rollout", report) == []
    unhealthy = report["unhealthy"]
    assert unhealthy["devices"] == 6 and unhealthy["offered"] >= 1 and unhealthy["failed"] == unhealthy["offered"]
    assert report["rollout"]["state"] == "aborted" and report["rollout"]["devices_offered_after_abort"] == 0
    succeeded = report["outcomes"].get("succeeded", 0)
    assert report["running"] == {"1.0.0": 60 - succeeded, "2.0.0": succeeded} and report["on_trial"] == 0
    assert report["leader_knows"] is True
    assert report["lost"] == 0 and report["conservation_ok"] is True


def test_a_healthy_version_goes_everywhere(tmp_path: Path) -> None:
    report = asyncio.run(app_rollout_scenario(devices=30, seed=4, fail_rate=0.0, work_dir=tmp_path))
    assert check("app-rollout", report) == []
    assert report["rollout"]["state"] == "succeeded" and report["outcomes"] == {"succeeded": 30}
    assert report["running"] == {"2.0.0": 30}


def test_the_same_seed_gives_the_same_app_rollout_report(tmp_path: Path) -> None:
    args = ["--scenario", "app-rollout", "--devices", "60", "--seed", "7", "--fail-rate", "0.1"]
    first = simulate(tmp_path, "a", args, hash_seed=31)
    second = simulate(tmp_path, "b", args, hash_seed=32)
    assert first["claim"] == {"holds": True, "problems": []}
    assert as_text(first) == as_text(second)
