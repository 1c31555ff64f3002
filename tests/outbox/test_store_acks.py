"""Deferred ack commits: an ack of OVERWRITE rows the relay holds is done at once in memory (the
rows stay in flight: never handed out again) and committed with the next write, a read,
`close`, a full batch, or after `ack_delay_ms`, so an idle device writes once per heartbeat,
not twice. Other acks commit before they return."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

from store_support import OpenStore, assert_conserved, make_msg

from agent.core.clock import VirtualClock
from agent.outbox.engine import ClassPolicy
from agent.outbox.store import ACK_DELAY_MS, OutboxStore
from agent.outbox.types import OutboxMessage


def hb(seq: int, *, owner: str = "dev-1") -> OutboxMessage:
    return make_msg(owner=owner, kind="heartbeat", key="heartbeat", conflict="overwrite",
                    seq=seq, payload=b"h%d" % seq)


def on_disk(path: Path, sql: str) -> object:
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchone()[0]
    finally:
        conn.close()


def pending_on_disk(path: Path) -> int:
    return int(on_disk(path, "SELECT count(*) FROM outbox WHERE status = 'pending'"))  # type: ignore[call-overload]


async def test_a_heartbeat_costs_one_transaction(store: OutboxStore, db_path: Path) -> None:
    await store.enqueue(hb(1))
    [row] = await store.take_ready(limit=10)
    before = store.write_transactions
    await store.ack([row.row_id])
    assert store.write_transactions == before  # not committed yet
    assert await store.take_ready(limit=10) == []  # but never handed out again
    assert pending_on_disk(db_path) == 1
    result = await store.enqueue(hb(2))  # the delivered one out, the next one in: one commit
    assert result.outcome == "stored"
    assert store.write_transactions == before + 1
    assert pending_on_disk(db_path) == 1
    assert on_disk(db_path, "SELECT seq FROM outbox") == 2
    stats = await assert_conserved(store)
    assert (stats.delivered, stats.pending, stats.in_flight) == (1, 1, 0)


async def test_deferred_ack_is_committed_after_the_delay(
    store: OutboxStore, clock: VirtualClock, db_path: Path
) -> None:
    await store.enqueue(hb(1))
    [row] = await store.take_ready(limit=10)
    await store.ack([row.row_id])
    await clock.advance(ACK_DELAY_MS / 1000 - 0.5)
    assert pending_on_disk(db_path) == 1
    await clock.advance(1)
    assert pending_on_disk(db_path) == 0
    assert store.in_flight == 0
    assert on_disk(db_path, "SELECT value FROM outbox_counters WHERE name = 'delivered'") == 1


async def test_any_store_call_sees_the_deferred_acks(store: OutboxStore, db_path: Path) -> None:
    ids = [(await store.enqueue(hb(1, owner=f"d{i}"))).row_id for i in range(3)]
    await store.take_ready(limit=10)
    await store.ack(ids[:2])
    assert await store.get(ids[0]) is None
    assert pending_on_disk(db_path) == 1
    stats = await assert_conserved(store)
    assert (stats.delivered, stats.pending, stats.in_flight) == (2, 1, 1)


async def test_close_commits_deferred_acks(open_store: OpenStore) -> None:
    store = await open_store()
    rid = (await store.enqueue(hb(1))).row_id
    await store.take_ready(limit=1)
    await store.ack([rid])  # type: ignore[list-item]
    await store.close()
    store = await open_store()
    stats = await assert_conserved(store)
    assert (stats.delivered, stats.pending) == (1, 0)


async def test_a_crash_before_the_commit_delivers_the_row_again(
    open_store: OpenStore, db_path: Path, tmp_path: Path
) -> None:
    """At least once: the disk as a crash would leave it still holds the acked row."""
    store = await open_store()
    rid = (await store.enqueue(hb(1))).row_id
    await store.take_ready(limit=1)
    await store.ack([rid])  # type: ignore[list-item]
    crashed = tmp_path / "crashed.db"
    for suffix in ("", "-wal"):
        shutil.copyfile(str(db_path) + suffix, str(crashed) + suffix)
    reopened = await open_store(crashed)
    [row] = await reopened.take_ready(limit=1)
    assert (row.row_id, row.payload) == (rid, b"h1")
    await assert_conserved(reopened)


async def test_ack_delay_zero_commits_every_ack(open_store: OpenStore, db_path: Path) -> None:
    store = await open_store(ack_delay_ms=0)
    await store.enqueue(hb(1))
    [row] = await store.take_ready(limit=1)
    before = store.write_transactions
    await store.ack([row.row_id])
    assert store.write_transactions == before + 1 and pending_on_disk(db_path) == 0


async def test_append_rows_are_acked_at_once(store: OutboxStore, db_path: Path) -> None:
    await store.enqueue(make_msg())
    [row] = await store.take_ready(limit=1)
    before = store.write_transactions
    await store.ack([row.row_id])
    assert store.write_transactions == before + 1 and pending_on_disk(db_path) == 0


async def test_fifo_rows_and_rows_not_taken_are_acked_at_once(
    open_store: OpenStore, db_path: Path
) -> None:
    store = await open_store(classes={"cmd": ClassPolicy(fifo=True)})
    first = (await store.enqueue(make_msg("dev", kind="cmd", key="a", conflict="overwrite"))).row_id
    second = (await store.enqueue(make_msg("dev", kind="cmd", key="b", conflict="overwrite"))).row_id
    [row] = await store.take_ready(limit=10)
    assert row.row_id == first
    await store.ack([first])  # type: ignore[list-item]
    assert pending_on_disk(db_path) == 1
    [row] = await store.take_ready(limit=10)  # the receiver's next row is not held back
    assert row.row_id == second
    untaken = (await store.enqueue(hb(1))).row_id
    await store.ack([untaken])  # type: ignore[list-item]
    assert await store.take_ready(limit=10) == []  # gone for good, not handed out meanwhile
    await assert_conserved(store)


async def test_a_waiting_heartbeat_is_not_held_back_by_a_deferred_ack(
    store: OutboxStore,
) -> None:
    await store.enqueue(hb(1))
    [flying] = await store.take_ready(limit=10)
    await store.enqueue(hb(2))  # waits behind the one in flight
    await store.ack([flying.row_id])  # committed at once: a newer row waits for it
    [row] = await store.take_ready(limit=10)
    assert row.seq == 2
    await assert_conserved(store)


async def test_a_full_batch_of_acks_is_committed_without_waiting(
    store: OutboxStore, clock: VirtualClock, db_path: Path
) -> None:
    await store.enqueue_many([hb(1, owner=f"d{i}") for i in range(1_100)])
    rows = await store.take_ready(limit=2_000)
    await store.ack([r.row_id for r in rows[:1_050]])
    await clock.settle()  # the writer's work is done; no virtual time has passed
    assert store.in_flight == len(rows) - 1_050
    assert pending_on_disk(db_path) == 50
