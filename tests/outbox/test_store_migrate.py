"""Schema version 2 (fewer pages per commit) and the migration from version 1.

A version-1 file is made here the way version 1 made it: its own schema step
(`MIGRATIONS[0]`, AUTOINCREMENT ids, `outbox_counters` and `outbox_classes` tables) and rows
inserted without an id, so SQLite's AUTOINCREMENT numbered them. Opening it with the store
must keep every row, dead letter, attempt count and counter, and never hand out an id
version 1 had used.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from store_support import OpenStore, assert_conserved, make_msg

from agent.outbox import commands
from agent.outbox.schema import APPLICATION_ID, MIGRATIONS, PAGE_SIZE, SCHEMA_VERSION, configure


def _insert_v1(conn: sqlite3.Connection, **row: object) -> int:
    cols = {
        "msg_id": "m", "owner": "dev-1", "receiver": "leader", "kind": "telemetry",
        "payload": b"x", "key": None, "conflict": "append", "seq": 0, "created_at": 1_000,
        "send_at": 1_000, "attempts": 0, "status": "pending", "last_error": None,
        "expires_at": None, "size": 1, "rhash": 0, "fifo": 0,
    }
    cols.update(row)
    cols["size"] = len(cols["payload"])  # type: ignore[arg-type]
    names = ", ".join(cols)
    marks = ", ".join("?" * len(cols))
    cur = conn.execute(f"INSERT INTO outbox ({names}) VALUES ({marks})", tuple(cols.values()))
    return int(cur.lastrowid)  # type: ignore[arg-type]


def make_v1_file(path: Path) -> dict[str, object]:
    """A version-1 outbox: 3 pending rows (one an OVERWRITE heartbeat, one tried twice), 2 dead
    letters, and 2 delivered rows at the top of the id range (deleted, so only
    sqlite_sequence remembers their ids). Counters consistent with that history."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA page_size = 4096")
        configure(conn, synchronous="NORMAL", busy_timeout_ms=1_000)
        conn.execute("BEGIN IMMEDIATE")
        MIGRATIONS[0][1](conn)
        conn.execute("PRAGMA user_version = 1")
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        ids = {
            "tel": _insert_v1(conn, msg_id="tel", payload=b"telemetry-1"),
            "hb": _insert_v1(conn, msg_id="hb", kind="heartbeat", key="heartbeat",
                             conflict="overwrite", seq=7, payload=b"hb-7"),
            "tried": _insert_v1(conn, msg_id="tried", payload=b"tried", attempts=2,
                                last_error="timeout", send_at=5_000),
            "dead1": _insert_v1(conn, msg_id="dead1", payload=b"poison-1", status="dead",
                                attempts=3, last_error="refused"),
            "dead2": _insert_v1(conn, msg_id="dead2", payload=b"poison-2", status="dead",
                                attempts=1, last_error="malformed"),
        }
        gone = [_insert_v1(conn, msg_id=f"done{i}") for i in range(2)]
        conn.execute("DELETE FROM outbox WHERE id IN (?, ?)", gone)
        counters = {"enqueued": 8, "delivered": 2, "dead_lettered": 2, "overwritten": 1,
                    "duplicates": 4, "replayed": 0, "corrupt_recoveries": 1}
        conn.executemany(
            "UPDATE outbox_counters SET value = ? WHERE name = ?",
            [(v, k) for k, v in counters.items()],
        )
        conn.executemany(
            "INSERT INTO outbox_classes (kind, pending, pending_bytes, dead) VALUES (?, ?, ?, ?)",
            [("telemetry", 2, len(b"telemetry-1") + len(b"tried"),
              2), ("heartbeat", 1, len(b"hb-7"), 0)],
        )
        conn.execute("COMMIT")
        top = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'").fetchone()[0]
    finally:
        conn.close()
    return {"ids": ids, "top": top, "counters": counters}


async def test_v1_file_migrates_keeping_rows_dead_letters_and_counters(
    open_store: OpenStore, db_path: Path
) -> None:
    v1 = make_v1_file(db_path)
    ids: dict[str, int] = v1["ids"]  # type: ignore[assignment]
    store = await open_store(max_attempts=5)
    conn = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
        sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'outbox'").fetchone()[0]
        assert "AUTOINCREMENT" not in sql.upper()
        assert conn.execute("SELECT count(*) FROM sqlite_sequence").fetchone()[0] == 0
        assert conn.execute("PRAGMA page_size").fetchone()[0] == 4096  # an old file keeps it
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        assert {"outbox_ready", "outbox_key", "outbox_fifo", "outbox_expiry"} <= names
    finally:
        conn.close()
    stats = await assert_conserved(store)
    counters: dict[str, int] = v1["counters"]  # type: ignore[assignment]
    assert (stats.enqueued, stats.delivered, stats.dead_lettered, stats.overwritten) == (
        counters["enqueued"], counters["delivered"], counters["dead_lettered"],
        counters["overwritten"],
    )
    assert (stats.pending, stats.dead, stats.duplicates) == (3, 2, 4)
    assert stats.by_class["heartbeat"].pending_bytes == len(b"hb-7")
    # per-class flows start from what each class holds: two pending and two dead telemetry rows
    assert (stats.by_class["telemetry"].enqueued, stats.by_class["telemetry"].dead_lettered) == (4, 2)
    tried = await store.get(ids["tried"])
    assert tried is not None and (tried.attempts, tried.last_error) == (2, "timeout")
    dead = await store.list_dead()
    assert [(d.row_id, d.attempts, d.last_error) for d in dead] == [
        (ids["dead1"], 3, "refused"), (ids["dead2"], 1, "malformed"),
    ]
    # ids are never reused: above every id version 1 handed out, even the deleted top ones
    new = await store.enqueue(make_msg(payload=b"after"))
    assert new.row_id is not None and new.row_id > v1["top"]  # type: ignore[operator]
    # OVERWRITE still finds the migrated heartbeat by its key
    hb = await store.enqueue(make_msg(kind="heartbeat", key="heartbeat", conflict="overwrite",
                                      seq=8, payload=b"hb-8"))
    assert hb.outcome == "overwritten"
    # and the migrated rows go through the relay's path as before
    rows = await store.take_ready(limit=10)
    assert {r.msg_id for r in rows} >= {"tel"}
    await store.ack([r.row_id for r in rows])
    assert await store.replay([ids["dead1"]]) == 1
    await assert_conserved(store)
    await store.close()
    # the CLI reads the migrated file (its counters are a view now)
    assert commands.outbox_stats(str(db_path), True) == commands.EXIT_OK


def test_cli_replay_on_a_v1_file_migrates_it_first(tmp_path: Path, capsys) -> None:
    db = tmp_path / "outbox.db"
    v1 = make_v1_file(db)
    ids: dict[str, int] = v1["ids"]  # type: ignore[assignment]
    assert commands.outbox_stats(str(db), True) == commands.EXIT_OK  # read-only: stays v1
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 1
    finally:
        conn.close()
    assert commands.dlq_replay(str(db), [ids["dead1"]]) == commands.EXIT_OK
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        status = conn.execute("SELECT status, attempts FROM outbox WHERE id = ?",
                              (ids["dead1"],)).fetchone()
        assert status == ("pending", 0)
        counters = dict(conn.execute("SELECT name, value FROM outbox_counters").fetchall())
        assert (counters["replayed"], counters["enqueued"]) == (1, 8)
    finally:
        conn.close()
    capsys.readouterr()


async def test_ids_stay_unique_across_reopen_after_the_top_rows_are_gone(
    open_store: OpenStore,
) -> None:
    store = await open_store()
    ids = [(await store.enqueue(make_msg(f"r{i}"))).row_id for i in range(3)]
    await store.take_ready(limit=10)
    await store.ack(ids)  # every row gone: only the tally remembers the ids
    await store.close()
    store = await open_store()
    again = (await store.enqueue(make_msg())).row_id
    assert again is not None and again > max(ids)  # type: ignore[type-var]
    await assert_conserved(store)


async def test_new_file_has_small_pages_and_one_tally_table(
    open_store: OpenStore, db_path: Path
) -> None:
    store = await open_store()
    await store.enqueue(make_msg())
    conn = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA page_size").fetchone()[0] == PAGE_SIZE == 1024
        kinds = dict(conn.execute("SELECT name, type FROM sqlite_master WHERE name LIKE 'outbox_%'"
                                  " AND type IN ('table', 'view')").fetchall())
        assert kinds == {"outbox_tally": "table", "outbox_counters": "view",
                         "outbox_classes": "view"}
    finally:
        conn.close()
    await assert_conserved(store)


async def test_a_heartbeat_cycle_writes_few_pages(open_store: OpenStore, db_path: Path) -> None:
    """Enqueue an OVERWRITE heartbeat, take it, ack it: the WAL frames this costs are the wear
    an idle device puts on its SD card every heartbeat. Version 1 wrote 11 of 4 KiB (six
    pages per enqueue: row, sqlite_sequence, two indexes, counters, classes; five per ack).
    Now one transaction (the ack's commit waits for the next enqueue) of four 1 KiB pages:
    the row, two index pages and the tally."""
    store = await open_store()
    wal = Path(str(db_path) + "-wal")

    async def cycle(seq: int) -> None:
        await store.enqueue(make_msg(kind="heartbeat", key="heartbeat", conflict="overwrite",
                                     seq=seq, payload=b"h" * 300))
        rows = await store.take_ready(limit=10)
        await store.ack([r.row_id for r in rows])

    for seq in range(5):
        await cycle(seq)
    before = wal.stat().st_size
    for seq in range(5, 25):
        await cycle(seq)
    frames = (wal.stat().st_size - before) / (PAGE_SIZE + 24)
    assert frames <= 20 * 4, frames


async def test_page_size_is_chosen_for_new_files_only(open_store: OpenStore, tmp_path: Path) -> None:
    big = tmp_path / "gateway.db"
    store = await open_store(big, page_size=4096)
    await store.enqueue(make_msg())
    await store.close()
    assert on_disk_page_size(big) == 4096
    store = await open_store(big, page_size=1024)  # an existing file keeps its own
    await assert_conserved(store)
    assert on_disk_page_size(big) == 4096
    with pytest.raises(ValueError):
        await open_store(tmp_path / "odd.db", page_size=1000)
    assert not (tmp_path / "odd.db").exists()


def on_disk_page_size(path: Path) -> int:
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return int(conn.execute("PRAGMA page_size").fetchone()[0])
    finally:
        conn.close()
