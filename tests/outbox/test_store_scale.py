"""Scale: OVERWRITE coalescing of a large fleet's heartbeats, and the query plans that keep the
ready scan independent of how many rows were ever delivered."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from store_support import OpenStore, assert_conserved

from agent.outbox.types import OutboxMessage

SENDERS = 100_000
ROUNDS = 6


@pytest.mark.slow
async def test_600k_heartbeats_from_100k_senders_leave_one_latest_row_each(
    open_store: OpenStore, db_path: Path
) -> None:
    store = await open_store(max_attempts=5)
    payload = b"\x00" * 64
    batch: list[OutboxMessage] = []
    outcomes: dict[str, int] = {}
    for seq in range(1, ROUNDS + 1):
        for i in range(SENDERS):
            dev = f"dev-{i:06d}"
            batch.append(
                OutboxMessage(
                    msg_id=f"{dev}-{seq}", owner=dev, receiver="leader", kind="heartbeat",
                    payload=payload, key="heartbeat", conflict="overwrite", seq=seq,
                )
            )
            if len(batch) == 50_000:
                for r in await store.enqueue_many(batch):
                    outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
                batch = []
    assert outcomes == {"stored": SENDERS, "overwritten": SENDERS * (ROUNDS - 1)}
    stats = await assert_conserved(store)
    assert stats.pending == SENDERS
    assert (stats.enqueued, stats.overwritten) == (SENDERS * ROUNDS, SENDERS * (ROUNDS - 1))
    conn = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        assert conn.execute("SELECT count(*), min(seq), max(seq) FROM outbox").fetchone() == (
            SENDERS, ROUNDS, ROUNDS,
        )
        assert conn.execute("SELECT count(DISTINCT owner) FROM outbox").fetchone() == (SENDERS,)
        assert conn.execute(
            "SELECT count(*) FROM outbox WHERE msg_id != owner || '-' || seq"
        ).fetchone() == (0,)
    finally:
        conn.close()


@pytest.mark.slow
async def test_heartbeats_while_some_are_in_flight_keep_at_most_one_waiting(
    open_store: OpenStore,
) -> None:
    store = await open_store()

    def beat(dev: int, seq: int) -> OutboxMessage:
        return OutboxMessage(
            msg_id=f"d{dev}-{seq}", owner=f"d{dev}", receiver="leader", kind="heartbeat",
            payload=b"", key="heartbeat", conflict="overwrite", seq=seq,
        )

    await store.enqueue_many([beat(d, 1) for d in range(1_000)])
    flying = await store.take_ready(limit=500)
    for seq in range(2, 6):
        await store.enqueue_many([beat(d, seq) for d in range(1_000)])
    stats = await assert_conserved(store)
    assert stats.pending == 1_500  # 500 in flight + their 500 waiting + 500 others
    await store.ack([r.row_id for r in flying])
    rows = await store.take_ready(limit=5_000)
    assert len(rows) == 1_000 and {r.seq for r in rows} == {5}
    await assert_conserved(store)


def _plan(conn: sqlite3.Connection, sql: str, args: tuple[object, ...]) -> str:
    return " | ".join(r[-1] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, args))


async def test_hot_queries_use_their_partial_indexes(open_store: OpenStore, db_path: Path) -> None:
    store = await open_store()
    await store.close()
    from agent.outbox import engine, reads

    conn = sqlite3.connect(db_path)
    try:
        sql = reads.ready_sql(4, ["a", "b"])
        assert "outbox_ready" in _plan(conn, sql, (0, 4, 1, "a", "b"))
        assert "outbox_key" in _plan(conn, engine._KEY_LOOKUP, ("o", "r", "k"))
        assert "outbox_fifo" in _plan(conn, reads.FIFO_HEAD, ("r",))
    finally:
        conn.close()


async def test_delivered_rows_leave_the_table(open_store: OpenStore, db_path: Path) -> None:
    store = await open_store()
    await store.enqueue_many(
        [
            OutboxMessage(msg_id=f"m{i}", owner="o", receiver=f"r{i % 7}", kind="t", payload=b"x")
            for i in range(5_000)
        ]
    )
    while rows := await store.take_ready(limit=700):
        await store.ack([r.row_id for r in rows])
    await assert_conserved(store)
    await store.close()
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
    finally:
        conn.close()
