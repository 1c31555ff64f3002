"""`simulate --leaders N --database URL --leader-crash AT` on a real PostgreSQL: several real
leaders share the fleet's registry and its job queue, the first one crashes, the others carry
the fleet and its jobs, and nothing is lost; the run's own schema is gone afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from postgres import PostgresCluster

from agent.cli import main as cli_main
from agent.sim import SimOptions, Simulation


async def test_three_leaders_on_postgresql_lose_nothing_when_one_crashes(tmp_path: Path,
                                                                        postgres_shared: PostgresCluster) -> None:
    opts = SimOptions(devices=30, duration_s=360.0, seed=5, heartbeat_s=15.0, telemetry_s=10.0, app_every_s=30.0,
                      offline_rate=0.2, progress=False, leaders=3, database=postgres_shared.url(),
                      leader_crash_s=180.0, jobs=60, job_work_s=60.0)
    report = await Simulation(opts, workdir=tmp_path).run()
    assert report["lost"] == 0 and report["conservation_ok"] is True
    # the fleet's one job queue: every job confirmed once, though the leader running it crashed
    jobs = report["jobs"]
    assert jobs["confirmed"] == jobs["submitted"] == 60 and jobs["confirmed_more_than_once"] == 0
    taken = report["leaders"]["job_queue_taken"]  # the first ran it, one of the others took it over
    assert taken["leader-1"] == 1 and taken["leader-2"] + taken["leader-3"] == 1
    assert jobs["results"].get("stale_epoch", 0) > 0  # results of the crashed leader's offers: refused
    assert report["telemetry"]["generated"] == report["telemetry"]["applied_by_leader"] > 0
    leaders = report["leaders"]
    assert leaders["crashed"] == ["leader-1"]
    # after the crash the other two carry every device (each device's newest beat was theirs)
    assert set(leaders["served_last"]) == {"leader-2", "leader-3"}
    assert sum(leaders["served_last"].values()) == 30
    assert report["leader"]["devices_known"] == 30  # the leaders' own rows are not devices
    schemas = postgres_shared.psql("SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'ea_sim_%'")
    assert schemas == "0"  # the run's schema was dropped


async def test_a_rollout_goes_on_when_the_leader_running_it_crashes(tmp_path: Path,
                                                                  postgres_shared: PostgresCluster) -> None:
    """The wave-rollout scenario over three leaders: the first runs the rollout (the orchestrator
    lease) and crashes in the middle of it; another takes the lease and finishes it, every device
    offered the image once."""
    from agent.sim.rollout import rollout_options, run_rollout

    opts = rollout_options(devices=24, seed=3, progress=False, leaders=3, database=postgres_shared.url(),
                           leader_crash_s=150.0, duration_s=600.0)
    report = await run_rollout(opts, workdir=tmp_path)
    rollout = report["rollout"]
    assert rollout["state"] == "succeeded" and report["outcomes"] == {"succeeded": 24}
    assert rollout["offers"] == 24  # each device once, across the hand-over
    assert report["lost"] == 0 and report["conservation_ok"] is True
    assert report["fleet"]["versions"] == {"1.1.0": 24}
    leaders = report["leaders"]
    assert leaders["crashed"] == ["leader-1"]
    assert leaders["orchestrator"]["holder"] in ("leader-2", "leader-3") and leaders["orchestrator"]["token"] == 2
    # the crash fell inside the rollout: it was running, some devices not updated yet
    at_crash = [p for p in report["timeseries"] if p["t"] <= 150.0][-1]
    assert at_crash["state"] == "running" and at_crash["counts"].get("succeeded", 0) < 24, at_crash


@pytest.mark.parametrize(("args", "says"), [
    (["--leaders", "2"], "several leaders share one registry: give --database"),
    (["--leader-crash", "1m"], "a leader's crash needs another to take over"),
    (["--leaders", "2", "--database", "mysql://db/x"], "must be a postgresql:// URL"),
    (["--leaders", "2", "--database", "postgresql://u@h/db", "--processes", "2"], "run in one process"),
])
def test_bad_leader_options_are_one_line_errors(args: list[str], says: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["simulate", "--devices", "4", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_cli_reports_the_leaders(tmp_path: Path, postgres_shared: PostgresCluster,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    assert cli_main(["simulate", "--devices", "12", "--duration", "4m", "--heartbeat", "15s", "--leaders", "2",
                     "--database", postgres_shared.url(), "--leader-crash", "2m", "--quiet", "--report",
                     str(out)]) == 0
    said = capsys.readouterr().out
    assert "leaders: 2 on one PostgreSQL registry, leader-1 crashed at 120s" in said
    assert "lost: 0   conservation_ok: True" in said
    assert json.loads(out.read_text())["scenario"]["leaders"] == 2


def test_a_config_rollout_runs_under_several_leaders_on_one_database(postgres_shared: PostgresCluster,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The configuration layers are in the fleet's database with the rollouts: the scenario runs
    under two leaders (it was refused, the layers being one leader's) and its claim holds."""
    assert cli_main(["simulate", "--scenario", "config-rollout", "--devices", "40", "--leaders", "2",
                     "--database", postgres_shared.url(), "--quiet"]) == 0
    said = capsys.readouterr().out
    assert "lost: 0   conservation_ok: True" in said and "claim holds" in said, said
