"""`FleetReader`: a running leader's /metrics read the fleet's stores through one kept connection,
with the same answers as a command's `open_leader_db`, on leader.db and on PostgreSQL."""

from __future__ import annotations

from pathlib import Path

from agent.core.clock import VirtualClock
from agent.core.sql import ServerUrl, store_target
from agent.leader.config_pending import fleet_compliance
from agent.leader.messages import MessageLog
from agent.leader.readonly import FleetReader, open_leader_db
from agent.leader.registry import DeviceRegistry
from agent.leader.rejects import RejectLog
from agent.protocol import ConfigState, Heartbeat
from config_rollout.layer_store import LayerStore


def _fleet(where: Path | str) -> None:
    """Three devices: two in sync with their layers, one holding what a layer set since changed."""
    clock = VirtualClock()
    tags = {"pi-0": ("lab",), "pi-1": ("lab",), "pi-2": ("cold",)}
    with LayerStore.open(where) as layers:
        layers.set_value("app", "tag", "lab", "app.toml", "port", 9000, set_by="op", now_ms=1_000)
        digests = layers.reads().digests("app", tags, now_ms=clock.now_ms())
        layers.set_value("app", "tag", "cold", "app.toml", "port", 9100, set_by="op", now_ms=2_000)
    with DeviceRegistry.open(where, clock=clock) as reg:
        reg.apply_heartbeats([Heartbeat(device_id=d, seq=1, uptime_s=1.0, tags=t, configs={
            "app": ConfigState(version="1.0.0", state="committed", layers=digests[d])}) for d, t in tags.items()])
    MessageLog.open(where, clock=clock).close()
    RejectLog.open(where, clock=clock).close()


def test_every_scrape_reads_what_a_command_reads_through_one_connection(leader_store: Path | str) -> None:
    _fleet(leader_store)
    target = store_target(str(leader_store), source="test")
    with open_leader_db(target) as db:
        expected = fleet_compliance(db, 3_000)
    assert expected == {"app": {"in_sync": 2, "pending": 1, "drifted": 0, "damaged": 0, "not_applied": 0,
                                "last_attempt_failed": 0}}
    reader = FleetReader(target)
    sessions = set()
    try:
        for _ in range(3):
            with reader.reading() as db:
                assert fleet_compliance(db, 3_000) == expected
                if isinstance(target, ServerUrl):
                    sessions.add(db.shared.execute("SELECT pg_backend_pid()").fetchone()[0])
    finally:
        reader.close()
    if isinstance(target, ServerUrl):
        assert len(sessions) == 1  # one server session for every scrape, not one a scrape
