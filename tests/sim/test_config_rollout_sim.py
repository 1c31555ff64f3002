"""The config-rollout scenario: a signed config release in waves to real workers on virtual time.
The devices it cuts off each revert by themselves within confirm_s and get their link back, the
failure threshold aborts the rollout, every device holds the old document or the new one, and
the same seed gives the same report, in two processes of their own."""

from __future__ import annotations

import asyncio
from pathlib import Path

from test_determinism import as_text, simulate

from agent.sim.config_rollout import config_rollout_scenario
from agent.sim.scenarios import check


def test_a_config_that_cuts_devices_off_reverts_on_each_and_aborts_the_rollout(tmp_path: Path) -> None:
    report = asyncio.run(config_rollout_scenario(devices=60, seed=7, cut_rate=0.1, work_dir=tmp_path))
    assert check("config-rollout", report) == []
    cut = report["cut"]
    assert cut["devices"] == 6 and cut["offered"] >= 1 and cut["rolled_back"] == cut["offered"]
    assert cut["revert_s_max"] <= report["confirm_s"] + 1.0 and cut["still_cut_off"] == 0
    assert report["rollout"]["state"] == "aborted" and report["rollout"]["devices_offered_after_abort"] == 0
    docs = report["documents"]
    assert docs["other"] == 0 and docs["new"] == report["outcomes"].get("succeeded", 0)
    assert report["lost"] == 0 and report["conservation_ok"] is True


def test_a_config_that_cuts_no_device_off_commits_everywhere(tmp_path: Path) -> None:
    report = asyncio.run(config_rollout_scenario(devices=30, seed=4, cut_rate=0.0, work_dir=tmp_path))
    assert check("config-rollout", report) == []
    assert report["rollout"]["state"] == "succeeded" and report["outcomes"] == {"succeeded": 30}
    assert report["documents"] == {"old": 0, "new": 30, "other": 0}


def test_the_same_seed_gives_the_same_config_rollout_report(tmp_path: Path) -> None:
    args = ["--scenario", "config-rollout", "--devices", "60", "--seed", "7", "--cut-rate", "0.15"]
    first = simulate(tmp_path, "a", args, hash_seed=31)
    second = simulate(tmp_path, "b", args, hash_seed=32)
    assert first["claim"] == {"holds": True, "problems": []}
    assert as_text(first) == as_text(second)
