"""Live progress of a wave rollout (`simulate --scenario wave-rollout` / `--rollout`): the
current wave, its state and per-state device counts, as plain lines off a terminal and as a
rich panel on one; the final report keeps its per-wave results."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from agent.cli import main as cli_main
from agent.sim import SimOptions
from agent.sim.progress import ProgressDisplay, rollout_line
from agent.sim.rollout import rollout_summary, run_rollout


def sample(**rollout: Any) -> dict[str, Any]:
    ro: dict[str, Any] = {
        "state": "running", "detail": "wave 2 of 4 running", "wave": 2, "wave_count": 4,
        "waves": [
            {"number": 1, "canary": True, "size": 3, "state": "passed", "counts": {"succeeded": 3}},
            {"number": 2, "canary": False, "size": 17, "state": "running",
             "counts": {"downloading": 6, "queued": 9, "succeeded": 2}},
            {"number": 3, "canary": False, "size": 20, "state": "pending", "counts": {"queued": 20}},
            {"number": 4, "canary": False, "size": 20, "state": "pending", "counts": {"queued": 20}},
        ],
        "counts": {"downloading": 6, "queued": 49, "succeeded": 5}, "targeted": 60, "finished": 5,
    }
    ro.update(rollout)
    return {"kind": "rollout", "t": 125.0, "devices": 60, "online": 59, "leader_sees_online": 60,
            "in_flight": 1, "outbox_pending": 2, "downloads": 6, "download_bound": 6, "rollout": ro}


def seconds(line: str) -> int:
    h, m, s = line.split(" ", 1)[0].removeprefix("t=").split(":")
    return int(h) * 3600 + int(m) * 60 + int(s)


def test_a_rollout_sample_is_one_plain_line() -> None:
    assert rollout_line(sample()) == (
        "t=0:02:05 online=59/60 leader_sees=60 in_flight=1 outbox_pending=2 downloads=6/6"
        " rollout=running wave=2/4 wave_state=running wave_devices=17 [downloading 6, queued 9, succeeded 2]"
        " done=5/60")
    before = sample()
    before["rollout"] = None
    assert rollout_line(before).endswith("downloads=6/6 rollout=not-started (devices registering)")
    stream = io.StringIO()
    with ProgressDisplay(duration_s=None, stream=stream) as display:
        assert not display.live
        display(sample())
    assert stream.getvalue() == rollout_line(sample()) + "\n"


def test_the_live_panel_shows_every_wave_with_its_counts() -> None:
    stream = io.StringIO()
    with ProgressDisplay(duration_s=None, stream=stream, live=True) as panel:
        assert panel.live
        panel(sample())
    screen = stream.getvalue()
    assert "running, wave 2 of 4" in screen
    assert "6 downloads (bound 6)" in screen and "outbox depth" in screen
    rows = [line.split() for line in screen.splitlines() if line.split()[:1] in (["1"], ["2"], ["3"], ["4"])]
    assert rows[0] == ["1", "canary", "3", "passed", "succeeded", "3"]
    assert rows[1] == ["2", "17", "running", "downloading", "6,", "queued", "9,", "succeeded", "2"]


async def test_a_small_rollout_prints_its_waves_and_states(tmp_path: Path) -> None:
    stream = io.StringIO()
    opts = SimOptions(devices=20, seed=3, heartbeat_s=5.0, progress=False)
    with ProgressDisplay(duration_s=None, stream=stream, live=False) as display:
        report = await run_rollout(opts, workdir=tmp_path / "shown", progress=display, progress_every_s=30.0,
                                   progress_idle_s=300.0)
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("rollout=not-started (devices registering)")
    assert any(" rollout=running wave=1/4 wave_state=running wave_devices=1 [" in line for line in lines)
    for n in (2, 3, 4):
        assert any(f" rollout=running wave={n}/4 wave_state=running " in line for line in lines), n
    assert any(" wave_state=soaking " in line for line in lines)
    # a line repeats the one before (but for its time) only after 5 minutes of fleet time
    for before, after in zip(lines, lines[1:], strict=False):
        if before.split(" ", 1)[1] == after.split(" ", 1)[1]:
            assert seconds(after) - seconds(before) >= 300, (before, after)
    assert lines[-1].endswith("rollout=succeeded wave=4/4 wave_state=passed wave_devices=6 [succeeded 6] done=20/20")
    assert report["rollout"]["state"] == "succeeded"
    # the per-wave results stay in the final report, numbered as in the progress
    summary = rollout_summary(report).splitlines()
    assert summary[1:5] == ["  wave 1 (canary): 1 device, passed: succeeded 1",
                            "  wave 2: 6 devices, passed: succeeded 6",
                            "  wave 3: 7 devices, passed: succeeded 7",
                            "  wave 4: 6 devices, passed: succeeded 6"]
    assert [(w["index"], w["number"]) for w in report["rollout"]["waves"]] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # watching does not change the run
    quiet = await run_rollout(opts, workdir=tmp_path / "quiet")
    report.pop("wall")
    quiet.pop("wall")
    assert json.dumps(report, sort_keys=True) == json.dumps(quiet, sort_keys=True)


async def test_an_aborted_rollout_shows_the_failed_wave(tmp_path: Path) -> None:
    stream = io.StringIO()
    with ProgressDisplay(duration_s=None, stream=stream, live=False) as display:
        report = await run_rollout(SimOptions(devices=40, seed=3, heartbeat_s=5.0, progress=False), workdir=tmp_path,
                                   fail_rate=0.2, progress=display)
    assert report["rollout"]["state"] == "aborted"
    last = stream.getvalue().splitlines()[-1]
    # the three devices still downloading at the abort were told to stop, and did
    assert last.endswith(" rollout=aborted wave=2/4 wave_state=failed wave_devices=11"
                         " [canceled 3, rolled_back 3, succeeded 5] done=40/40")


def test_simulate_wave_rollout_prints_progress_lines_when_piped(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["simulate", "--scenario", "wave-rollout", "--devices", "20", "--seed", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    progress = [line for line in out if line.startswith("t=")]
    assert any(" rollout=running wave=2/4 wave_state=running " in line for line in progress)
    assert "  wave 1 (canary): 1 device, passed: succeeded 1" in out
    assert out[-1] == "claim holds"
    assert cli_main(["simulate", "--scenario", "wave-rollout", "--devices", "20", "--seed", "3", "--quiet"]) == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("t=")]


def test_the_fleet_panel_says_when_it_drains_past_the_duration() -> None:
    fleet = {"t": 601.0, "online": 4, "devices": 4, "leader_sees_online": 4, "crashed": 0, "in_flight": 0,
             "outbox_pending": 0, "heartbeats_pending": 0, "leader_mailbox": 0, "leader_mailbox_capacity": 8,
             "aimd_limit_min": 50, "aimd_limit_mean": 50.0, "jobs_confirmed": 0, "jobs_submitted": 0}
    from rich.console import Console

    panel = ProgressDisplay(duration_s=600, stream=io.StringIO(), live=True)
    screens = []
    for t in (601.0, 300.0):
        out = io.StringIO()
        Console(file=out, width=100).print(panel.render({**fleet, "t": t}))
        screens.append(out.getvalue())
    assert "0:10:01 / 0:10:00 (draining: every outbox empties)" in screens[0]
    assert "0:05:00 / 0:10:00" in screens[1] and "draining" not in screens[1]
