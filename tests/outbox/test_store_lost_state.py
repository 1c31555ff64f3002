"""Never start silently on lost state: an outbox file whose tables are gone, or whose counters
went back since its mark (`agent.core.marks`), is moved aside as evidence, logged at ERROR, and a
fresh outbox started; `lost_from` says where it went."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from store_support import OpenStore, make_msg

from agent.outbox.store import OutboxStore


async def fill(open_store: OpenStore, db: Path, n: int) -> None:
    store = await open_store(db)
    for _ in range(n):
        await store.enqueue(make_msg())
    await store.close()  # a clean close renews the mark


def evidence(db: Path) -> list[str]:
    return sorted(p.name for p in db.parent.iterdir() if ".lost-" in p.name)


async def test_a_file_whose_counters_went_back_is_moved_aside_and_a_fresh_outbox_starts(
        open_store: OpenStore, db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    await fill(open_store, db_path, 3)
    shutil.copyfile(db_path, db_path.with_name("three.db"))  # an old copy of the file...
    await fill(open_store, db_path, 7)
    shutil.copyfile(db_path.with_name("three.db"), db_path)  # ...put back in its place
    with caplog.at_level(logging.ERROR, logger="agent.outbox"):
        store = await open_store(db_path)
    assert store.lost_from is not None and Path(store.lost_from).exists()
    assert "its enqueued went back to 3 (it was 10 on" in caplog.text
    assert (await store.stats()).pending == 0  # a fresh outbox: it knows nothing it did not hold
    kept = Path(store.lost_from).name
    assert {kept, f"{kept}.mark"} <= set(evidence(db_path))  # the file and its mark, kept
    await store.enqueue(make_msg())
    await store.close()
    again = await open_store(db_path)
    assert again.lost_from is None  # the fresh outbox's own mark agrees with it


@pytest.mark.parametrize("how", ["deleted", "emptied"])
async def test_a_file_whose_tables_are_gone_is_lost_state(open_store: OpenStore, db_path: Path,
                                                          caplog: pytest.LogCaptureFixture, how: str) -> None:
    await fill(open_store, db_path, 2)
    if how == "deleted":
        db_path.unlink()
    else:
        db_path.write_bytes(b"")
    with caplog.at_level(logging.ERROR, logger="agent.outbox"):
        store = await open_store(db_path)
    assert store.lost_from is not None
    assert "its tables are gone (on" in caplog.text and "it held enqueued 2" in caplog.text
    assert (await store.stats()).pending == 0


async def test_a_first_start_and_a_sound_restart_are_not_lost_state(open_store: OpenStore, db_path: Path) -> None:
    store = await open_store(db_path)
    assert store.lost_from is None
    await store.enqueue(make_msg())
    await store.close()
    store = await open_store(db_path)
    assert store.lost_from is None and (await store.stats()).pending == 1


async def test_a_synced_commit_writes_the_mark(db_path: Path, clock: object) -> None:
    store = await OutboxStore.open(db_path, clock=clock)  # type: ignore[arg-type]
    try:
        await store.enqueue(make_msg())
        await store.stats()  # a later round of the writer: the mark after the commit is written
        assert '"enqueued": 1' in db_path.with_name(db_path.name + ".mark").read_text()
    finally:
        await store.close()
