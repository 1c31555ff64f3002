"""Operators' acknowledgements of configuration attempts that did not commit: each names the
attempt it saw, so the device's next failure is counted again; kept on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.leader.registry import LAST_ATTEMPT_FAILED, compliance_counts
from agent.protocol import ConfigState
from config_rollout.attempt_acks import AttemptAckReads, AttemptAckStore, acknowledged, attempt_said, open_attempt

REVERTED = ConfigState(version="1.0.0", state="rolled_back", attempt=4)


@pytest.mark.parametrize("leader_store", ["sqlite", "postgresql"], indirect=True)
def test_an_acknowledgement_covers_the_attempt_it_saw_and_no_other(leader_store: Path | str) -> None:
    with AttemptAckStore.open(leader_store) as store:
        assert store.reads().newest() == {}
        ack = store.acknowledge("pi-1", "app", REVERTED, by="alice", now_ms=1_000)
        store.acknowledge("pi-2", "app", ConfigState(version="2.0.0", state="failed", attempt=1), by="bob",
                          now_ms=2_000)
        store.acknowledge("pi-1", "app", ConfigState(version="1.0.0", state="failed", attempt=2), by="carol",
                          now_ms=3_000)  # (an older attempt, acknowledged later: not the newest)
        reads = store.reads()
        newest = reads.newest()
        assert newest[("pi-1", "app")] == ack and set(newest) == {("pi-1", "app"), ("pi-2", "app")}
        assert reads.newest(["pi-2"]).keys() == {("pi-2", "app")}
        assert [(a.device_id, a.by) for a in reads.since(2_000)] == [("pi-2", "bob"), ("pi-1", "carol")]

    assert open_attempt(REVERTED, ack) == "" and acknowledged(REVERTED, ack) == ack
    assert attempt_said(REVERTED, ack) == "its last attempt was rolled back; acknowledged by alice"
    for then in (ConfigState(version="1.0.0", state="rolled_back", attempt=5),  # its next attempt
                 ConfigState(version="1.0.0", state="failed", attempt=4),  # another ending (a wiped record)
                 ConfigState(version="0.9.0", state="rolled_back", attempt=4)):  # another version held
        assert open_attempt(then, ack) == then.last_attempt and acknowledged(then, ack) is None
        assert "acknowledged" not in attempt_said(then, ack)
    committed = ConfigState(version="1.1.0", state="committed", attempt=5)
    assert open_attempt(committed, ack) == "" and attempt_said(committed, ack) == ""


def test_the_fleet_counts_an_attempt_as_failed_until_it_is_acknowledged(tmp_path: Path) -> None:
    states = {"pi-1": ((), {"app": REVERTED}), "pi-2": ((), {"app": REVERTED})}
    with AttemptAckStore.open(tmp_path / "leader.db") as store:
        store.acknowledge("pi-1", "app", REVERTED, by="alice", now_ms=1)
        acks = store.reads().newest()
    assert compliance_counts(states)["app"][LAST_ATTEMPT_FAILED] == 2
    counts = compliance_counts(states, acks=acks)["app"]
    assert (counts["in_sync"], counts[LAST_ATTEMPT_FAILED]) == (2, 1)


def test_a_database_where_nobody_acknowledged_anything_reads_as_none(tmp_path: Path) -> None:
    import sqlite3

    conn = sqlite3.connect(tmp_path / "leader.db")
    reads = AttemptAckReads(conn)
    assert (reads.present, reads.newest(), reads.since()) == (False, {}, [])
    conn.close()
