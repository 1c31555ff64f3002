"""The release-rollout scenario: one release of the devices' whole state (firmware, config, an
application) in waves to real workers (the real updater, config applier, application module and
helper on each device's files) on virtual time. The devices where the application fails return
whole to the release before, firmware included, naming the part; the failure threshold aborts the
rollout; every device runs one release or the other, never a mix; the same seed gives the same
report, in two processes of their own."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_determinism import as_text, simulate

from agent.sim.release_rollout import release_rollout_options, release_rollout_scenario, run_release_rollout
from agent.sim.scenarios import check


def test_a_release_whose_application_fails_returns_those_devices_whole_and_aborts(tmp_path: Path) -> None:
    report = asyncio.run(release_rollout_scenario(devices=60, seed=3, fail_rate=0.1, work_dir=tmp_path))
    assert check("release-rollout", report) == []
    unhealthy = report["unhealthy"]
    assert unhealthy["devices"] == 6 and unhealthy["offered"] >= 1
    assert unhealthy["rolled_back"] == unhealthy["offered"] == unhealthy["named_the_part"]
    assert report["rollout"]["state"] == "aborted" and report["rollout"]["devices_offered_after_abort"] == 0
    succeeded = report["outcomes"].get("succeeded", 0)
    assert report["releases"] == {"R1": 60 - succeeded, "R2": succeeded} and report["held"] == 0
    assert report["fleet"]["versions"] == {"1.0.0": 60 - succeeded, "1.1.0": succeeded}  # the firmware with them
    assert report["lost"] == 0 and report["conservation_ok"] is True


def test_a_healthy_release_converges_everywhere(tmp_path: Path) -> None:
    report = asyncio.run(release_rollout_scenario(devices=30, seed=4, fail_rate=0.0, work_dir=tmp_path))
    assert check("release-rollout", report) == []
    assert report["rollout"]["state"] == "succeeded" and report["outcomes"] == {"succeeded": 30}
    assert report["releases"] == {"R2": 30} and report["held"] == 0


def test_the_same_seed_gives_the_same_release_rollout_report(tmp_path: Path) -> None:
    args = ["--scenario", "release-rollout", "--devices", "60", "--seed", "7", "--fail-rate", "0.1"]
    first = simulate(tmp_path, "a", args, hash_seed=31)
    second = simulate(tmp_path, "b", args, hash_seed=32)
    assert first["claim"] == {"holds": True, "problems": []}
    assert as_text(first) == as_text(second)


@pytest.mark.xfail(reason="the report counts a device that crashed again before its restarted updater read the"
                          " slots, and is down at the end, at firmware '' (unknown): a mix in the count, not on"
                          " the device (docs/releases.md 'Not yet')", strict=False)
# Its own bound, not the suite's 120 s: an example takes 2 s alone, and one took 106 s of a loaded
# CI machine (two CPU-bound processes, three boards writing their disks: the fleet's fsyncs waited)
@pytest.mark.timeout(900)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(min_value=0, max_value=10_000), fail_rate=st.sampled_from([0.0, 0.1, 0.3]))
def test_devices_that_crash_while_a_release_converges_still_end_whole(tmp_path: Path, seed: int,
                                                                     fail_rate: float) -> None:
    """Half the devices crash once and start again on their files, at any point of the release
    (the download, the trial boot, a part held, the commits): each still ends on one release or
    the other in every part, nothing held, nothing lost."""
    opts = release_rollout_options(devices=20, seed=seed, crash_rate=0.5, crash_downtime_s=20.0)
    workdir = Path(tempfile.mkdtemp(dir=tmp_path))  # (a fresh fleet for each example, its replay too)
    report = asyncio.run(run_release_rollout(opts, workdir=workdir, fail_rate=fail_rate))
    assert report["mixed"] == {} and report["held"] == 0, report["mixed"]
    assert sum(report["releases"].values()) == 20 and report["lost"] == 0
    assert report["unhealthy"]["rolled_back"] == report["unhealthy"]["offered"], report["unhealthy"]
