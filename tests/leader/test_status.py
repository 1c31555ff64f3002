import json
import sqlite3
from pathlib import Path

import msgspec
import pytest

from agent.cli import main as cli
from agent.core.clock import VirtualClock
from agent.core.errors import StoreError
from agent.leader.jobs import JobQueue
from agent.leader.registry import DeviceRegistry
from agent.leader.status import FleetStatus, LeaderView, format_status, summarize
from agent.protocol import DeviceHealth, Heartbeat, JobDemand, JobResult, JobSubmit, Telemetry


def hb(device: str, seq: int, version: str, health: DeviceHealth | None = None) -> Heartbeat:
    return Heartbeat(device_id=device, seq=seq, uptime_s=1.0, firmware_version=version, health=health)


@pytest.fixture
async def fleet_db(tmp_path: Path) -> tuple[Path, VirtualClock]:
    """Five devices: three on 1.1.0, one on 1.0.0, one that never sent a heartbeat."""
    clock = VirtualClock()
    path = tmp_path / "leader.db"
    with DeviceRegistry.open(path, clock=clock, heartbeat_deadline_s=60) as reg:
        reg.apply_heartbeats([hb("pi-old", 1, "1.0.0"), hb("pi-a", 1, "1.1.0")])
        await clock.advance(120)
        reg.apply_heartbeats([hb("pi-b", 1, "1.1.0"), hb("pi-c", 1, "1.1.0")])
        reg.apply_presence("pi-c", False)
        reg.apply_telemetry("m1", Telemetry(device_id="pi-none", seq=1, name="t", ts_ms=1))
        assert reg.expire_overdue() == ["pi-a", "pi-old"]
    with JobQueue.open(path, clock=clock) as queue:
        queue.submit_many([JobSubmit(job_id=f"j{i}", kind="k") for i in range(3)])
        queue.demand(JobDemand(worker="pi-b", incarnation="r", window=2))
        for d in queue.dispatch():
            queue.result(JobResult(job_id=d.offer.job_id, epoch=d.offer.epoch, worker="pi-b",
                                   ok=d.offer.job_id == "j0"))
    return path, clock


def test_summary_counts_versions_stale_and_jobs(fleet_db: tuple[Path, VirtualClock]) -> None:
    path, clock = fleet_db
    summary = summarize(path, clock=clock)
    assert (summary.total, summary.online, summary.offline) == (5, 1, 4)
    assert summary.versions == {"1.1.0": 3, "1.0.0": 1, "unknown": 1}
    assert summary.stale_after_s == 60.0  # the registry's heartbeat deadline
    assert [d.device_id for d in summary.stale] == ["pi-none", "pi-a", "pi-old"]
    assert summary.stale[1].age_s == 120.0 and not summary.stale[1].online
    assert summary.jobs is not None
    assert (summary.jobs.pending, summary.jobs.confirmed, summary.jobs.failed) == (1, 2, 1)
    assert summary.jobs.epoch == 1


def test_stale_limit_and_threshold(fleet_db: tuple[Path, VirtualClock]) -> None:
    path, clock = fleet_db
    summary = summarize(path, clock=clock, stale_after_s=1000, stale_limit=1)
    assert summary.stale_count == 1 and [d.device_id for d in summary.stale] == ["pi-none"]
    summary = summarize(path, clock=clock, stale_limit=1)
    assert summary.stale_count == 3 and len(summary.stale) == 1
    assert "... and 2 more" in format_status(summary)


def test_format_status_text(fleet_db: tuple[Path, VirtualClock]) -> None:
    path, clock = fleet_db
    text = format_status(summarize(path, clock=clock))
    assert text.splitlines()[0].startswith("fleet: 5 devices, 1 online, 4 offline")
    assert "versions: 1.1.0 x3, unknown x1, 1.0.0 x1" in text
    assert "stale (past their heartbeat deadline: 2.5 of their intervals, at least 1m00s): 3" in text
    fixed = format_status(summarize(path, clock=clock, stale_after_s=60))
    assert "stale (not heard from for 1m00s): 3" in fixed
    assert "pi-none  last seen never  offline" in text
    assert "(2m00s ago)" in text
    assert "jobs: 1 pending, 2 confirmed (1 failed), queue epoch 1" in text


def test_status_says_which_leader_runs_the_rollouts_and_when_none_does() -> None:
    """Several leaders on PostgreSQL: the holder of the orchestrator lease, since when; a lease run
    out (its holder stopped or died) says so instead of naming a leader that runs nothing."""
    summary = FleetStatus(generated_ms=1_700_000_100_000, total=0, online=0, offline=0, rollouts_run_by="gw-2",
                          rollouts_since_ms=1_700_000_000_000, rollouts_until_ms=1_700_000_105_000)
    assert "rollouts: run by leader gw-2 since 2023-11-14T22:13:20Z" in format_status(summary)
    dead = msgspec.structs.replace(summary, rollouts_until_ms=1_700_000_090_000)
    assert ("rollouts: no leader runs them now: the orchestrator lease of leader gw-2 ran out at"
            " 2023-11-14T22:14:50Z") in format_status(dead)
    assert "rollouts:" not in format_status(FleetStatus(generated_ms=1, total=0, online=0, offline=0))  # leader.db


def test_status_says_which_of_several_leaders_has_gone_silent() -> None:
    """One leader silent for its quiet time is shown as not running, beside the devices it served
    last (they move to the others at their next heartbeat), and each says what it runs."""
    now = 1_700_000_100_000
    summary = FleetStatus(generated_ms=now, total=10, online=10, offline=0, leader_views=[
        LeaderView(name="gw-1", serves=7, alive_ms=now - 300_000, running=False, silent_s=300.0),
        LeaderView(name="gw-2", serves=3, alive_ms=now - 2_000, runs=["rollouts", "job queue"]),
        LeaderView(name="gw-3", alive_ms=now - 1_000)])
    assert ("leaders: gw-1 serves 7 (silent for 5m00s: not running); gw-2 serves 3, runs the rollouts and the"
            " job queue; gw-3 serves 0") in format_status(summary)


async def test_a_leader_that_stops_beating_is_shown_dead_within_a_lease_time(pg_url: str) -> None:
    """Several leaders on PostgreSQL beat their own row every 3 s: one silent for 9 s (three of its
    beats) is shown as not running, within a lease time (10 s) of its last beat; the one holding
    the orchestrator's and the job queue's leases is named as running them."""
    from agent.leader.readonly import open_leader_db
    from agent.leader.status import fleet_status
    from rollout_engine.lease import OrchestratorLease
    from rollout_engine.store import RolloutStore

    clock = VirtualClock()
    gw1, gw2 = (DeviceRegistry.open(pg_url, clock=clock) for _ in range(2))
    gw1.leader, gw2.leader = "gw-1", "gw-2"
    try:
        gw1.mark_alive()
        gw2.mark_alive()
        gw2.apply_heartbeats([Heartbeat(device_id="pi-1", seq=1, uptime_s=1.0)])
        with RolloutStore.open(pg_url, clock=clock) as rollouts:
            assert OrchestratorLease(rollouts, "gw-2", ttl_s=60.0).hold()
        JobQueue.open(pg_url, clock=clock, holder="gw-2").close()
        for _ in range(3):  # gw-1 died: only gw-2 beats, for 9 s
            await clock.advance(3.0)
            gw2.mark_alive()
        with open_leader_db(pg_url) as db:
            live = {v.name: v for v in fleet_status(db, clock.now_ms()).leader_views}
        assert live["gw-1"].running and live["gw-2"].running  # 9 s: still within three beats
        await clock.advance(0.5)
        gw2.mark_alive()
        with open_leader_db(pg_url) as db:
            summary = fleet_status(db, clock.now_ms())
        views = {v.name: v for v in summary.leader_views}
        assert not views["gw-1"].running and views["gw-1"].silent_s == 9.5
        assert views["gw-2"].running and views["gw-2"].serves == 1 and views["gw-2"].runs == ["rollouts", "job queue"]
        assert "gw-1 serves 0 (silent for 9s: not running)" in format_status(summary), format_status(summary)
    finally:
        gw1.close()
        gw2.close()


def test_status_command_prints_text_and_json(fleet_db: tuple[Path, VirtualClock],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    path, clock = fleet_db
    assert cli(["status", "--db", str(path)]) == 0
    assert capsys.readouterr().out.startswith("fleet: 5 devices")
    assert cli(["status", "--db", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total"] == 5 and data["jobs"]["confirmed"] == 2
    summary = msgspec.convert({k: v for k, v in data.items() if not k.startswith("devices")}, FleetStatus)
    assert summary.versions == summarize(path, clock=clock).versions


def test_empty_registry(tmp_path: Path) -> None:
    path = tmp_path / "leader.db"
    DeviceRegistry.open(path, clock=VirtualClock()).close()
    summary = summarize(path, clock=VirtualClock())
    assert (summary.total, summary.online, summary.stale, summary.jobs) == (0, 0, [], None)
    assert "fleet: 0 devices" in format_status(summary)


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"definitely not sqlite\n" * 200)
    empty_sqlite = tmp_path / "other.db"
    sqlite3.connect(empty_sqlite).execute("CREATE TABLE t (x)").connection.close()
    return {"missing": tmp_path / "missing.db", "junk": junk, "directory": tmp_path,
            "foreign": empty_sqlite}


@pytest.mark.parametrize("case", ["missing", "junk", "directory", "foreign"])
def test_bad_file_is_one_line_on_stderr_exit_2(tmp_path: Path, case: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = _bad_files(tmp_path)[case]
    assert cli(["status", "--db", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and str(path) in err
    with pytest.raises(StoreError):
        summarize(path)
    assert not (tmp_path / "missing.db").exists()  # read-only: never creates a database


async def test_the_running_leader_marks_itself_alive_and_status_says_when_it_stopped(tmp_path: Path) -> None:
    """Every 30 s of the leader's clock at most one write; `status` shows a STALE banner once 90 s
    passed without one, and none while the leader marks."""
    clock = VirtualClock(start_ms=1_700_000_000_000)
    path = tmp_path / "leader.db"
    with DeviceRegistry.open(path, clock=clock) as reg:
        reg.apply_heartbeats([hb("pi-a", 1, "1.0.0")])
        assert summarize(path, clock=clock).leader_alive_ms is None  # no leader ever ran: no banner
        reg.mark_alive()
        await clock.advance(20)
        reg.mark_alive()  # within 30 s: nothing written
        assert summarize(path, clock=clock).leader_alive_ms == 1_700_000_000_000
        await clock.advance(15)
        reg.mark_alive()
        assert summarize(path, clock=clock).leader_alive_ms == 1_700_000_035_000
    fresh = summarize(path, clock=clock)
    assert not fresh.leader_stale and "STALE" not in format_status(fresh)
    await clock.advance(91)
    old = summarize(path, clock=clock)
    assert old.leader_stale
    assert format_status(old).splitlines()[0].startswith(
        "STALE: the leader last marked itself alive at 2023-11-14T22:13:55Z (1m31s ago): is it running?")


def test_status_says_each_releases_healthy_hours_from_its_devices_counts(tmp_path: Path) -> None:
    path = tmp_path / "leader.db"
    with DeviceRegistry.open(path, clock=VirtualClock()) as reg:
        reg.apply_heartbeats([
            hb("pi-a", 1, "1.1.0", health=DeviceHealth(firmware="1.1.0", operating_s=360_000, unexpected_restarts=1)),
            hb("pi-b", 1, "1.1.0", health=DeviceHealth(firmware="1.1.0", operating_s=360_000, unexpected_restarts=0)),
            hb("pi-c", 1, "1.0.0")])
    summary = summarize(path)
    assert [(h.firmware, h.devices, h.hours, h.unexpected_restarts) for h in summary.health] == [("1.1.0", 2, 200, 1)]
    assert "healthy hours: 1.1.0 99.5% of 200 h (1 unexpected restarts, 2 devices)" in format_status(summary)
    assert msgspec.to_builtins(summary)["health"][0]["healthy_ratio"] == 0.995  # status --json
