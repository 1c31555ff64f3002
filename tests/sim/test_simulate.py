"""The fleet simulator: reproducible reports, zero loss across faults, the thundering herd."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.cli import main as cli_main
from agent.core.errors import ConfigError
from agent.sim import SimOptions, Simulation, parse_duration, parse_outage


async def _run(tmp_path: Path, **kwargs: object) -> dict:  # type: ignore[type-arg]
    opts = SimOptions(progress=False, **kwargs)  # type: ignore[arg-type]
    return await Simulation(opts, workdir=tmp_path).run()


def _without_wall(report: dict) -> dict:  # type: ignore[type-arg]
    return {k: v for k, v in report.items() if k != "wall"}


async def test_same_seed_same_report(tmp_path: Path) -> None:
    first = await _run(tmp_path / "a", devices=20, duration_s=120, seed=11, jobs=10)
    second = await _run(tmp_path / "b", devices=20, duration_s=120, seed=11, jobs=10)
    assert _without_wall(first) == _without_wall(second)
    assert first["lost"] == 0 and first["conservation_ok"] is True
    assert first["jobs"]["confirmed"] == 10 and first["jobs"]["confirmed_more_than_once"] == 0
    # the leader rests 30 s between rounds while devices beat every 5 s: about 6 to 1
    assert first["heartbeats"]["coalescing_ratio"] > 3


async def test_different_seeds_give_different_offline_patterns(tmp_path: Path) -> None:
    a = Simulation(SimOptions(devices=30, duration_s=300, seed=1, offline_rate=0.3, progress=False),
                   workdir=tmp_path / "a")
    b = Simulation(SimOptions(devices=30, duration_s=300, seed=2, offline_rate=0.3, progress=False),
                   workdir=tmp_path / "b")
    assert a.offline_plan() and len(a.offline_plan()) == 9
    assert a.offline_plan() == a.offline_plan()
    assert a.offline_plan() != b.offline_plan()


async def test_store_and_forward_loses_nothing_across_outages(tmp_path: Path) -> None:
    report = await _run(tmp_path, devices=40, duration_s=360, seed=3, offline_rate=0.25,
                        offline_duration_s=120, broker_outage=(150.0, 60.0), telemetry_s=10, jobs=20)
    assert report["lost"] == 0
    assert report["conservation_ok"] is True
    assert report["drained"] is True
    assert report["telemetry"]["via_outbox"] > 0  # some records waited in an outbox
    assert report["heartbeats"]["coalesced_in_outboxes"] > 0  # offline devices held one beat each
    assert report["heartbeats"]["stale_devices"] == 0
    assert report["jobs"]["confirmed"] == 20


@pytest.mark.slow
async def test_thundering_herd_stays_within_the_leader_mailbox(tmp_path: Path) -> None:
    report = await _run(tmp_path, devices=200, duration_s=180, seed=5, leader_mailbox=32,
                        leader_interval_s=0.5, telemetry_s=5, broker_outage=(60.0, 60.0))
    boxes = report["leader_mailbox"]
    for box in boxes.values():
        assert box["high_water"] <= box["capacity"] == 32
    assert report["leader"]["busy_answers"] > 0
    assert report["relay"]["capacity_rejections"] > 0  # busy answers slowed the relays down
    assert report["lost"] == 0 and report["conservation_ok"] is True


def test_cli_writes_a_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    code = cli_main(["simulate", "--devices", "5", "--duration", "1m", "--seed", "2", "--quiet",
                     "--report", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["lost"] == 0 and report["conservation_ok"] is True and "wall" in report
    assert "lost: 0" in capsys.readouterr().out


def test_bad_options_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["simulate", "--duration", "ten minutes"]) == 2
    assert "duration" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        parse_outage("3m")
    assert parse_duration("1.5h") == 5400.0 and parse_outage("3m:1m") == (180.0, 60.0)
    with pytest.raises(ConfigError):
        SimOptions(devices=0)
