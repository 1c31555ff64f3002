"""A single gateway grows into several leaders: its leader.db, holding devices with their
configuration, configuration layers, enrolments and jobs, is moved into a real PostgreSQL by
`edge-agent leader migrate`; that leader and a second one then run on it (`edge-agent run`, one
real mosquitto). `status`, `config layer list` and `config diff --device` answer as they did on
leader.db, and a SIGKILL of the leader running the job queue loses no layer and no job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.core.clock import SystemClock, VirtualClock
from agent.leader.identities import IdentityStore
from agent.leader.jobs import JobQueue
from agent.leader.messages import MessageLog
from agent.leader.registry import DeviceRegistry
from agent.leader.rejects import RejectLog
from agent.protocol import ConfigState, Heartbeat, JobDemand, JobResult, JobSubmit
from config_rollout.layer_store import LayerStore
from config_rollout.release import build_release
from rollout_engine.keys import generate_keypair, load_signing_key
from tests.e2e.agent_support import (
    FLEET,
    REPO,
    fleet_jobs,
    kill,
    spawn_agent,
    stop_all,
    submit_through_outbox,
    until,
    worker,
)
from tests.postgres import PostgresCluster

pytestmark = pytest.mark.timeout(300)
TAGS = {"w0": ("lab", "cold"), "w1": ("lab",), "w2": ("lab",)}


def _cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, timeout=60,
                          cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _single_gateway(db: Path) -> None:
    """What a gateway's leader.db holds after a while: three devices in sync with the layers of
    target app, a pending enrolment, jobs done and waiting."""
    clock = VirtualClock()
    with LayerStore.open(db) as layers:
        layers.set_value("app", "tag", "lab", "app.toml", "port", 9000, set_by="op", now_ms=1_000)
        layers.set_value("app", "tag", "cold", "app.toml", "port", 9100, set_by="op", now_ms=1_000)
        layers.set_value("app", "device", "w2", "app.toml", "log_level", "debug", set_by="op", now_ms=1_000)
        digests = layers.reads().digests("app", TAGS, now_ms=clock.now_ms())
    with DeviceRegistry.open(db, clock=clock) as reg:
        reg.claim_fleet(FLEET)
        reg.apply_heartbeats([Heartbeat(device_id=d, seq=1, uptime_s=1.0, tags=t, configs={
            "app": ConfigState(version="1.1.0", state="committed", layers=digests[d])}) for d, t in TAGS.items()])
    MessageLog.open(db, clock=clock).close()
    RejectLog.open(db, clock=clock).close()
    with IdentityStore.open(db) as identities:
        identities.record_request(device="pi-9", fingerprint="ab" * 32, csr="csr", hw_serial="1000abcd",
                                  machine_id="m", agent_version="0.1", claim="claim", now_ms=1_000)
    with JobQueue.open(db, clock=clock) as jobs:  # j1 done; j2 held by a worker that went; j3 waiting
        jobs.submit_many([JobSubmit(job_id=f"j{n}", kind="sleep", payload=b"0.1") for n in (1, 2, 3)])
        jobs.demand(JobDemand(worker="gone", incarnation="i", window=2))
        jobs.dispatch()
        assert jobs.result(JobResult(job_id="j1", epoch=jobs.epoch, worker="gone", ok=True)).outcome == "confirmed"


def _answers(where: str, key: Path, release: Path) -> tuple[list[str], str, str]:
    """What an operator reads of the fleet's configuration: status's config line, the layers,
    and one device's diff against a release."""
    status = [line for line in _cli("status", "--db", where).splitlines() if line.lstrip().startswith("config ")]
    return (status, _cli("config", "layer", "list", "--db", where),
            _cli("config", "diff", "--device", "w2", "--db", where, "--key", str(key), "--release", str(release)))


async def test_a_gateway_moved_to_postgresql_answers_the_same_and_a_kill_loses_no_layer_and_no_job(
        mosquitto, postgres: PostgresCluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url = postgres.url()
    keys = generate_keypair(tmp_path / "keys")
    src = tmp_path / "release"
    src.mkdir()
    (src / "app.toml").write_text("port = 1\nlog_level = 'info'\n")
    release = tmp_path / "app-1.1.0.eacfg"
    release.write_bytes(build_release("app", "1.1.0", [src / "app.toml"], load_signing_key(keys.private),
                                      created_ms=1))
    db = tmp_path / "gw1" / "leader.db"  # the single gateway's own data directory
    db.parent.mkdir()
    _single_gateway(db)
    before = _answers(str(db), keys.public, release)
    assert before[0] and "3 in sync" in before[0][0], before
    assert "port  from tag lab" in before[2] and "log_level  from device w2" in before[2], before[2]

    moved = _cli("leader", "migrate", "--from", str(db), "--to", url)
    assert "copied" in moved
    assert _answers(url, keys.public, release) == before  # the same fleet, read from PostgreSQL

    shared = {"leader": {"shared_group": "leaders", "database": url, "job_lease_s": 2.0,
                         "heartbeat_deadline_s": 10.0, "operators": ["w0"]}}
    leaders = {name: spawn_agent(tmp_path, "leader", name, mosquitto.url, **shared) for name in ("gw1", "gw2")}
    clock = SystemClock()
    agents = [await worker(clock, tmp_path, name, url=mosquitto.url,
                           sections={"heartbeat": {"interval_s": 0.5}, "jobs": {"demand_window": 2}})
              for name in ("w0", "w1")]
    try:
        await until(clock, lambda: fleet_jobs(url).run_by in leaders, limit_s=60, step_s=0.1,
                    what="one leader running the job queue")
        await submit_through_outbox(agents[0], [JobSubmit(job_id=f"job-{n:02d}", kind="sleep", payload=b"0.2")
                                                for n in range(20)])
        await until(clock, lambda: fleet_jobs(url).confirmed >= 6, limit_s=90, step_s=0.05,
                    what="some jobs confirmed")
        holder = fleet_jobs(url).run_by
        other = "gw2" if holder == "gw1" else "gw1"
        kill(leaders[holder])  # the leader running the queue dies, jobs in flight
        await until(clock, lambda: fleet_jobs(url).confirmed == 23, limit_s=120, step_s=0.1,
                    what="every job, the gateway's own included, confirmed through the other leader")
        assert fleet_jobs(url).run_by == other and leaders[other].poll() is None
        layers_after, diff_after = _answers(url, keys.public, release)[1:]
        assert (layers_after, diff_after) == before[1:]  # no layer lost, the same values for the device
        with IdentityStore.open(url) as identities:
            found = identities.get("pi-9")
            assert found is not None and found.state == "pending"  # the enrolment waits as it did
    finally:
        for proc in leaders.values():
            kill(proc)
        await stop_all(*agents)
