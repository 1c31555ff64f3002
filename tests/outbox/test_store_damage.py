"""Damaged files, full disks and files that are not ours: the store never loses the evidence,
never lets a sqlite3 exception out, and keeps working."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from store_support import OpenStore, assert_conserved, make_msg

from agent.core.errors import StoreError
from agent.outbox.schema import APPLICATION_ID, SCHEMA_VERSION


def _corrupt_page(path: Path, page: int) -> None:
    size = 4096
    with path.open("r+b") as f:
        f.seek(page * size + 16)
        f.write(b"\xde\xad\xbe\xef" * 500)


async def test_garbage_file_is_moved_aside_and_a_fresh_outbox_started(
    open_store: OpenStore, db_path: Path
) -> None:
    db_path.write_bytes(b"this is not a database, it is a shopping list\n" * 100)
    (db_path.parent / (db_path.name + "-wal")).write_bytes(b"junk wal")
    store = await open_store()
    assert store.recovered_from is not None
    kept = Path(store.recovered_from)
    assert kept.name.startswith("outbox.db.corrupt-") and kept.exists()
    assert kept.read_bytes().startswith(b"this is not a database")
    assert Path(str(kept) + "-wal").read_bytes() == b"junk wal"
    # the fresh outbox works
    assert (await store.enqueue(make_msg())).outcome == "stored"
    await assert_conserved(store)
    conn = sqlite3.connect(db_path)
    try:
        row = conn.execute(
            "SELECT value FROM outbox_counters WHERE name = 'corrupt_recoveries'"
        ).fetchone()
    finally:
        conn.close()
    assert row == (1,)


async def test_corrupt_pages_are_detected_by_the_integrity_check(
    open_store: OpenStore, db_path: Path
) -> None:
    store = await open_store()
    await store.enqueue_many([make_msg(payload=b"p" * 300) for _ in range(200)])
    await store.close()
    _corrupt_page(db_path, 3)
    original = db_path.read_bytes()
    store = await open_store()
    assert store.recovered_from is not None
    assert Path(store.recovered_from).read_bytes() == original  # evidence kept as it was
    assert (await store.stats()).pending == 0
    await assert_conserved(store)


async def test_sound_file_is_not_moved(open_store: OpenStore, db_path: Path) -> None:
    store = await open_store()
    await store.enqueue(make_msg())
    await store.close()
    store = await open_store()
    assert store.recovered_from is None
    assert list(db_path.parent.glob("*.corrupt-*")) == []
    assert (await store.stats()).pending == 1


async def test_disk_full_raises_store_error_and_recovers(open_store: OpenStore) -> None:
    store = await open_store(max_db_bytes=160 * 1024)
    stored = 0
    with pytest.raises(StoreError) as info:
        for _ in range(1_000):
            await store.enqueue(make_msg(payload=b"x" * 1_000))
            stored += 1
    assert "full" in str(info.value)
    assert not isinstance(info.value.__cause__, type(None))
    assert stored > 10
    # still working: reads, and deliveries free room
    stats = await assert_conserved(store)
    assert stats.pending == stored
    rows = await store.take_ready(limit=1_000)
    assert len(rows) == stored
    await store.ack([r.row_id for r in rows[: stored // 2]])
    assert (await store.enqueue(make_msg(payload=b"y" * 1_000))).outcome == "stored"
    # space returns: everything goes in again
    await store.set_max_db_bytes(64 * 1024 * 1024)
    await store.enqueue_many([make_msg(payload=b"z" * 1_000) for _ in range(300)])
    stats = await assert_conserved(store)
    assert stats.pending == stored - stored // 2 + 1 + 300


async def test_disk_full_enqueue_does_not_fail_acks_committed_with_it(
    open_store: OpenStore,
) -> None:
    import asyncio

    store = await open_store(max_db_bytes=160 * 1024)
    with pytest.raises(StoreError):
        for _ in range(1_000):
            await store.enqueue(make_msg(payload=b"x" * 1_000))
    rows = await store.take_ready(limit=5)
    ack, enq = await asyncio.gather(
        store.ack([r.row_id for r in rows]),
        store.enqueue(make_msg(payload=b"x" * 50_000)),
        return_exceptions=True,
    )
    assert ack is None
    assert isinstance(enq, StoreError)
    stats = await assert_conserved(store)
    assert stats.delivered == 5


async def test_newer_schema_is_refused_and_left_alone(
    open_store: OpenStore, db_path: Path
) -> None:
    store = await open_store()
    await store.close()
    conn = sqlite3.connect(db_path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer"):
        await open_store()
    assert db_path.exists() and list(db_path.parent.glob("*.corrupt-*")) == []


async def test_another_applications_database_is_refused(
    open_store: OpenStore, db_path: Path
) -> None:
    conn = sqlite3.connect(db_path)
    conn.execute("PRAGMA application_id = 1234")
    conn.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="not an outbox"):
        await open_store()
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA application_id").fetchone() == (1234,)
        assert conn.execute("PRAGMA application_id").fetchone() != (APPLICATION_ID,)
    finally:
        conn.close()


async def test_unopenable_path_is_a_store_error(open_store: OpenStore, tmp_path: Path) -> None:
    with pytest.raises(StoreError):
        await open_store(tmp_path / "missing-dir" / "outbox.db")
    with pytest.raises(StoreError):
        await open_store(tmp_path)  # a directory
