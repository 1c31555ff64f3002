"""The updater's store on the common store base: a database written before its tables were
versioned like every other store's (`PRAGMA user_version = 1`) opens with its state kept."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from agent.core.clock import SystemClock
from agent.core.errors import StoreError
from firmware_rollout.device.store import UpdaterStore

# The schema exactly as the earlier releases wrote it, versioned by user_version.
LEGACY = """
CREATE TABLE update_state (
    id INTEGER PRIMARY KEY CHECK (id = 1), state TEXT NOT NULL, rollout_id TEXT NOT NULL DEFAULT '',
    signed_manifest BLOB, version TEXT NOT NULL DEFAULT '', from_slot TEXT NOT NULL DEFAULT '',
    to_slot TEXT NOT NULL DEFAULT '', from_version TEXT NOT NULL DEFAULT '',
    chunks_done INTEGER NOT NULL DEFAULT 0, boot_count INTEGER NOT NULL DEFAULT 0,
    health_deadline_ms INTEGER NOT NULL DEFAULT 0, detail TEXT NOT NULL DEFAULT '',
    updated_ms INTEGER NOT NULL DEFAULT 0
);
INSERT INTO update_state (id, state, rollout_id, version, chunks_done) VALUES (1, 'downloading', 'r-7', '1.2.0', 5);
CREATE TABLE slots (slot TEXT PRIMARY KEY, version TEXT NOT NULL);
INSERT INTO slots VALUES ('a', '1.1.0');
CREATE TABLE reports (seq INTEGER PRIMARY KEY AUTOINCREMENT, body BLOB NOT NULL, sent INTEGER NOT NULL DEFAULT 0);
CREATE INDEX reports_unsent ON reports (seq) WHERE sent = 0;
PRAGMA user_version = 1;
"""


def legacy_db(path: Path, version: int = 1) -> Path:
    conn = sqlite3.connect(path)
    conn.executescript(LEGACY.replace("user_version = 1", f"user_version = {version}"))
    conn.close()
    return path


async def test_a_database_of_the_earlier_schema_opens_with_its_state(tmp_path: Path) -> None:
    store = await UpdaterStore.open(legacy_db(tmp_path / "updater.db"), clock=SystemClock())
    try:
        record, slots = await store.load()
        assert (record.state, record.rollout_id, record.version, record.chunks_done) == (
            "downloading", "r-7", "1.2.0", 5)
        assert slots == {"a": "1.1.0"}
    finally:
        await store.aclose()
    again = await UpdaterStore.open(tmp_path / "updater.db", clock=SystemClock())  # now versioned
    await again.aclose()


async def test_an_unknown_schema_version_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="unknown updater schema version 9"):
        await UpdaterStore.open(legacy_db(tmp_path / "updater.db", version=9), clock=SystemClock())


async def test_a_closed_store_says_so(tmp_path: Path) -> None:
    store = await UpdaterStore.open(tmp_path / "updater.db", clock=SystemClock())
    await store.aclose()
    await store.aclose()  # idempotent
    with pytest.raises(StoreError, match="updater store is closed"):
        await store.load()


async def test_a_long_detail_is_clipped_to_what_a_report_may_carry(tmp_path: Path) -> None:
    """The leader refuses a report whose detail is over DETAIL_MAX: the device clips it, so a
    failure with a long health-command output still reaches the rollout."""
    import msgspec

    from rollout_engine.messages import DETAIL_MAX, RolloutReport

    store = await UpdaterStore.open(tmp_path / "updater.db", clock=SystemClock())
    try:
        made = await store.add_report({"device": "d", "rollout_id": "r", "version": "1.1.0", "state": "failed",
                                       "phase": "failed", "detail": "x" * 100_000, "ts_ms": 1})
        assert len(made.detail) == DETAIL_MAX
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(made), type=RolloutReport) == made  # the leader takes it
    finally:
        await store.aclose()
