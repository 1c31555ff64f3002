"""`edge-agent leader migrate`: a single gateway's leader.db copied into a real PostgreSQL, then a
leader started on it finds every device, message, reject and processed id where it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.core.clock import VirtualClock
from agent.core.errors import StoreError
from agent.core.sql import ServerUrl
from agent.leader.identities import IdentityStore
from agent.leader.jobs import JobQueue
from agent.leader.messages import MessageLog, read_messages
from agent.leader.migrate import copy_to_server
from agent.leader.registry import DeviceRegistry
from agent.leader.rejects import RejectLog
from agent.protocol import AppMessage, ConfigState, Heartbeat, JobDemand, JobResult, JobSubmit, Telemetry
from agent.service.instance import InstanceLock
from config_rollout.attempt_acks import AttemptAckStore
from config_rollout.layer_store import LayerStore
from rollout_engine.spec import spec_from_dict
from rollout_engine.store import RolloutStore

REPO = Path(__file__).resolve().parents[2]


def _single_gateway(db: Path) -> None:
    clock = VirtualClock()
    with DeviceRegistry.open(db, clock=clock) as reg:
        reg.claim_fleet("plant")
        reg.apply_heartbeats([Heartbeat(device_id=f"pi-{n}", seq=7, uptime_s=1.0, tags=("lab",)) for n in range(3)])
        assert reg.apply_telemetry("t-1", Telemetry(device_id="pi-0", seq=1, name="temp", ts_ms=1, value=21.5))
    with MessageLog.open(db, clock=clock) as log:
        log.apply_batch([("m-1", AppMessage(device_id="pi-1", cls="state", seq=1, ts_ms=1, key="door", overwrite=True,
                                            payload=b'{"open": true}', content_type="application/json"))])
    with RejectLog.open(db, clock=clock) as rejects:
        rejects.record(topic="ea/v1/plant/pi-2/up", reason="junk", payload=b"\xc1", sender="pi-2")
    with IdentityStore.open(db) as identities:
        identities.record_request(device="pi-0", fingerprint="ab" * 32, csr="-----BEGIN CERTIFICATE REQUEST-----",
                                  hw_serial="1000abcd", machine_id="m", agent_version="0.1", claim="claim",
                                  now_ms=1_000)
        identities.add_control("approve", "pi-0", by="op", now_ms=1_000)
    artifact = db.parent / "fw.bin"
    artifact.write_bytes(b"x" * 64)
    spec = spec_from_dict({"rollout": {"name": "fw 2", "artifact": str(artifact), "seed": 1},
                           "waves": {"canary": 1, "counts": [2]}})
    with RolloutStore.open(db, clock=clock) as rollouts:  # a rollout in flight: its canary offered
        rollouts.create_rollout("r1", spec=spec, artifact=str(artifact), version="2.0.0", signed_manifest=b"m",
                                waves=[["pi-0"], ["pi-1", "pi-2"]], from_versions={})
        with rollouts.atomic():
            rollouts.set_device("r1", "pi-0", state="notified", attempts=1, offers=1)
            rollouts.record_offer("r1", "pi-0", 1)
            assert rollouts.claim("report-1")
        rollouts.add_control("r1", "pause")
    with JobQueue.open(db, clock=clock) as jobs:  # j1 done, j2 held by pi-0, j3 waiting
        jobs.submit_many([JobSubmit(job_id=f"j{n}", kind="work", payload=b"p") for n in (1, 2, 3)])
        jobs.demand(JobDemand(worker="pi-0", incarnation="i", window=2))
        jobs.dispatch()
        assert jobs.result(JobResult(job_id="j1", epoch=jobs.epoch, worker="pi-0", ok=True)).outcome == "confirmed"
    with LayerStore.open(db) as layers:  # two groups stated in an order, and a device's own override
        layers.set_value("app", "tag", "lab", "app.toml", "port", 9000, set_by="op", now_ms=1_000)
        layers.set_value("app", "tag", "cold", "app.toml", "port", 9100, set_by="op", now_ms=1_000)
        layers.order("app", ["cold", "lab"], by="test", now_ms=1)
        layers.set_value("app", "device", "pi-2", "app.toml", "log_level", "debug", set_by="op", now_ms=1_000)
    with AttemptAckStore.open(db) as acks:  # an operator saw pi-1's reverted attempt
        acks.acknowledge("pi-1", "app", ConfigState(version="1.0.0", state="rolled_back", attempt=2), by="op",
                         now_ms=1_500)


def test_a_single_gateway_grows_into_postgresql_with_nothing_lost(tmp_path: Path, pg_url: str) -> None:
    db = tmp_path / "leader.db"
    _single_gateway(db)
    copied = copy_to_server(db, ServerUrl(pg_url))
    assert copied["devices"] == 3 and copied["processed_messages"] == 1 and copied["app_messages"] == 1
    assert copied["rejects"] == 1
    clock = VirtualClock()
    with DeviceRegistry.open(pg_url, clock=clock) as reg:
        reg.claim_fleet("plant")  # the same fleet
        assert reg.device("pi-1").hb_seq == 7  # type: ignore[union-attr]
        assert reg.device("pi-1").tags == ("lab",)  # type: ignore[union-attr]
        # a redelivery of what the single gateway applied is still a duplicate
        assert reg.apply_telemetry("t-1", Telemetry(device_id="pi-0", seq=1, name="temp", ts_ms=1, value=21.5)) is False
        assert not reg.apply_heartbeat(Heartbeat(device_id="pi-1", seq=6, uptime_s=1.0))
    total, rows = read_messages(pg_url, cls="state")
    assert total == 1 and rows[0].payload == b'{"open": true}'
    with RejectLog.open(pg_url, clock=clock) as rejects:
        assert [r.reason for r in rejects.list()] == ["junk"]
        assert rejects.record(topic="t", reason="next") > rejects.list()[-1].id  # ids go on after the copied ones
    with IdentityStore.open(pg_url) as identities:  # enrolments and the controls not applied yet
        assert identities.get("pi-0").hw_serial == "1000abcd"  # type: ignore[union-attr]
        assert [c.action for c in identities.controls()] == ["approve"]
        assert identities.add_control("revoke", "pi-0", by="op", now_ms=2_000) == 2
    with RolloutStore.open(pg_url, clock=clock) as rollouts:  # the rollout goes on where it was
        row = rollouts.get("r1")
        assert row is not None and row.spec.to_json() == spec_from_dict(
            {"rollout": {"name": "fw 2", "artifact": str(tmp_path / "fw.bin"), "seed": 1},
             "waves": {"canary": 1, "counts": [2]}}).to_json() and row.signed_manifest == b"m"
        assert [(d.device_id, d.state, d.offers) for d in rollouts.devices("r1")] == [
            ("pi-0", "notified", 1), ("pi-1", "queued", 0), ("pi-2", "queued", 0)]
        assert [(d, a) for d, _, a in rollouts.offers("r1")] == [("pi-0", 1)]
        assert not rollouts.claim("report-1")  # a report applied before is still a duplicate
        assert [c.action for c in rollouts.pending_controls()] == ["pause"]
        assert rollouts.add_control("r1", "resume") == 2  # ids go on after the copied ones
    assert copied["jobs"] == 3
    with JobQueue.open(pg_url, clock=clock, holder="gw1") as jobs:  # every unconfirmed job offered again
        assert jobs.epoch == 2 and jobs.pending_ids() == ["j2", "j3"]
        assert jobs.submit(JobSubmit(job_id="j1", kind="work")).outcome == "duplicate"  # done stays done
        assert jobs.submit(JobSubmit(job_id="j4", kind="work")).store_seq > 3  # numbered after the copied ones
    assert copied["config_layers"] == 3 and copied["config_group_order"] == 2
    with LayerStore.open(pg_url) as layers:  # the same values for the same device, in the same order
        assert layers.group_order("app") == ["cold", "lab"]
        assert [(v.key, v.value, v.source) for v in layers.values_for("app", "pi-2", ["lab", "cold"], now_ms=2_000)
                ] == [("port", "9000", "tag lab"), ("log_level", '"debug"', "device pi-2")]
    assert copied["config_attempt_acks"] == 1
    with AttemptAckStore.open(pg_url) as acks:  # still acknowledged after the move
        assert [(a.device_id, a.attempt, a.by) for a in acks.reads().newest().values()] == [("pi-1", 2, "op")]


def test_a_non_empty_database_a_running_leader_and_another_fleet_are_refused(tmp_path: Path, pg_url: str) -> None:
    db = tmp_path / "leader.db"
    _single_gateway(db)
    copy_to_server(db, ServerUrl(pg_url))
    with pytest.raises(StoreError, match=r"is not empty \(3 devices, 1 processed messages, 1 app messages,"
                                         r" 1 rejects\): pass --into-non-empty"):
        copy_to_server(db, ServerUrl(pg_url))
    assert copy_to_server(db, ServerUrl(pg_url), into_non_empty=True)["devices"] == 3  # rows there win
    with DeviceRegistry.open(pg_url, clock=VirtualClock()) as reg:
        assert len(reg.devices()) == 3
    lock = InstanceLock(tmp_path).acquire()
    try:
        with pytest.raises(StoreError, match=f"a leader runs on {tmp_path} \\(pid {os.getpid()}\\): stop it first"):
            copy_to_server(db, ServerUrl(pg_url), into_non_empty=True)
    finally:
        lock.release()
    other = tmp_path / "other" / "leader.db"
    other.parent.mkdir()
    with DeviceRegistry.open(other, clock=VirtualClock()) as reg:
        reg.claim_fleet("elsewhere")
    MessageLog.open(other, clock=VirtualClock()).close()
    RejectLog.open(other, clock=VirtualClock()).close()
    with pytest.raises(StoreError, match="holds fleet plant, this leader's database fleet elsewhere"):
        copy_to_server(other, ServerUrl(pg_url), into_non_empty=True)


def test_the_command_says_what_it_copied_and_what_to_do_next(tmp_path: Path, pg_url: str) -> None:
    db = tmp_path / "leader.db"
    _single_gateway(db)
    done = subprocess.run([sys.executable, "-m", "agent.cli", "leader", "migrate", "--from", str(db), "--to", pg_url],
                          capture_output=True, text=True, cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)},
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "devices: 3 rows" in done.stdout and "config_layers: 3 rows" in done.stdout
    assert "copied 32 rows of 28 tables into" in done.stdout and "its outbox stays in leader.db" in done.stdout
    again = subprocess.run([sys.executable, "-m", "agent.cli", "leader", "migrate", "--from", str(db), "--to", pg_url],
                           capture_output=True, text=True, cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)},
                           timeout=60)
    assert again.returncode != 0 and again.stderr.count("\n") == 1 and "is not empty" in again.stderr
    assert "Traceback" not in again.stderr


def test_status_and_the_layers_read_the_same_on_postgresql_after_the_move(tmp_path: Path, pg_url: str) -> None:
    """Three devices applied the layers' values: in sync on the single gateway, and still in sync
    read from PostgreSQL (the layers moved with the registry; before, status there said pending),
    with the same values per device and the same list from `config layer list`."""
    from agent.leader.readonly import open_leader_db
    from agent.leader.status import fleet_status
    from agent.protocol import ConfigState

    db = tmp_path / "leader.db"
    clock = VirtualClock()
    tags = {f"pi-{n}": ("lab",) if n else ("lab", "cold") for n in range(3)}
    with LayerStore.open(db) as layers:
        layers.set_value("app", "tag", "lab", "app.toml", "port", 9000, set_by="op", now_ms=1_000)
        layers.set_value("app", "tag", "cold", "app.toml", "port", 9100, set_by="op", now_ms=1_000)
        layers.set_value("app", "device", "pi-2", "app.toml", "log_level", "debug", set_by="op", now_ms=1_000)
        digests = layers.reads().digests("app", tags, now_ms=clock.now_ms())
    with DeviceRegistry.open(db, clock=clock) as reg:
        reg.claim_fleet("plant")
        reg.apply_heartbeats([Heartbeat(device_id=d, seq=1, uptime_s=1.0, tags=t, configs={
            "app": ConfigState(version="1.0.0", state="committed", layers=digests[d])}) for d, t in tags.items()])
    MessageLog.open(db, clock=clock).close()
    RejectLog.open(db, clock=clock).close()

    def read(where: Path | str) -> tuple[object, object]:
        with open_leader_db(where) as leader:
            return (fleet_status(leader, clock.now_ms()).config,
                    {d: leader.layers.values_for("app", d, t, now_ms=clock.now_ms()) for d, t in tags.items()})

    before = read(db)
    assert before[0] == {"app": {"in_sync": 3, "pending": 0, "drifted": 0, "damaged": 0, "not_applied": 0,
                                 "last_attempt_failed": 0}}
    copy_to_server(db, ServerUrl(pg_url))
    assert read(pg_url) == before
    listed = [subprocess.run([sys.executable, "-m", "agent.cli", "config", "layer", "list", "--db", where],
                             capture_output=True, text=True, cwd=str(REPO), timeout=60,
                             env={**os.environ, "PYTHONPATH": str(REPO)}) for where in (str(db), pg_url)]
    assert [p.returncode for p in listed] == [0, 0] and listed[0].stdout == listed[1].stdout
    assert "app: groups in order lab, cold (the last wins), then devices" in listed[1].stdout
