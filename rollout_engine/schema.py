"""The rollout tables of the leader's database, as ordered migrations (component "rollout").

`MIGRATIONS` for SQLite (`leader.db`); for a fleet's PostgreSQL database the SQL files under
`rollout_engine/sql/postgresql/rollout/` (their own versions: the same tables, created whole;
who runs the orchestrator of several leaders is a row of the fleet's `leases`,
`rollout_engine.lease`).
`rollout_offers` and `rollout_device_events` have a `rowid` column there, so both databases order
them by it. See `rollout_engine.store` for what each table holds.
"""

from __future__ import annotations

import sqlite3


def _v1(conn: sqlite3.Connection) -> None:
    conn.execute(
        """CREATE TABLE rollouts (
            id TEXT PRIMARY KEY,
            seq INTEGER NOT NULL,
            name TEXT NOT NULL,
            state TEXT NOT NULL,
            spec BLOB NOT NULL,
            artifact TEXT NOT NULL,
            version TEXT NOT NULL,
            signed_manifest BLOB NOT NULL,
            current_wave INTEGER NOT NULL DEFAULT 0,
            wave_count INTEGER NOT NULL,
            detail TEXT NOT NULL DEFAULT '',
            rollback_of TEXT NOT NULL DEFAULT '',
            fail_base_finished INTEGER NOT NULL DEFAULT 0,
            fail_base_failed INTEGER NOT NULL DEFAULT 0,
            created_ms INTEGER NOT NULL,
            updated_ms INTEGER NOT NULL,
            finished_ms INTEGER
        )"""
    )
    conn.execute(
        """CREATE TABLE rollout_waves (
            rollout_id TEXT NOT NULL,
            idx INTEGER NOT NULL,
            size INTEGER NOT NULL,
            state TEXT NOT NULL DEFAULT 'pending',
            started_ms INTEGER,
            finished_ms INTEGER,
            soak_started_ms INTEGER,
            soak_until_ms INTEGER,
            detail TEXT NOT NULL DEFAULT '',
            PRIMARY KEY (rollout_id, idx)
        ) WITHOUT ROWID"""
    )
    conn.execute(
        """CREATE TABLE rollout_devices (
            rollout_id TEXT NOT NULL,
            device_id TEXT NOT NULL,
            wave INTEGER NOT NULL,
            state TEXT NOT NULL DEFAULT 'queued',
            detail TEXT NOT NULL DEFAULT '',
            attempts INTEGER NOT NULL DEFAULT 0,
            deadline_ms INTEGER,
            next_try_ms INTEGER,
            offers INTEGER NOT NULL DEFAULT 0,
            last_offer_ms INTEGER,
            report_seq INTEGER NOT NULL DEFAULT -1,
            from_version TEXT NOT NULL DEFAULT '',
            updated_ms INTEGER NOT NULL,
            PRIMARY KEY (rollout_id, device_id)
        ) WITHOUT ROWID"""
    )
    conn.execute("CREATE INDEX rollout_devices_wave ON rollout_devices(rollout_id, wave, state)")
    conn.execute(
        "CREATE TABLE rollout_offers (rollout_id TEXT NOT NULL, device_id TEXT NOT NULL,"
        " at_ms INTEGER NOT NULL, attempt INTEGER NOT NULL)"
    )
    conn.execute("CREATE INDEX rollout_offers_device ON rollout_offers(rollout_id, device_id)")
    conn.execute("CREATE TABLE rollout_processed (msg_id TEXT PRIMARY KEY, at_ms INTEGER NOT NULL) WITHOUT ROWID")
    conn.execute(
        """CREATE TABLE rollout_controls (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            rollout_id TEXT NOT NULL,
            action TEXT NOT NULL,
            arg TEXT NOT NULL DEFAULT '',
            created_ms INTEGER NOT NULL,
            applied_ms INTEGER,
            result TEXT NOT NULL DEFAULT ''
        )"""
    )
    conn.execute("CREATE INDEX rollout_controls_pending ON rollout_controls(id) WHERE applied_ms IS NULL")


def _v2(conn: sqlite3.Connection) -> None:
    # Timers are found by deadline; terminal devices have none, so the index stays small.
    conn.execute("CREATE INDEX rollout_devices_deadline ON rollout_devices(deadline_ms) WHERE deadline_ms IS NOT NULL")


def _v3(conn: sqlite3.Connection) -> None:
    # Housekeeping forgets old report ids by age (`RolloutStore.prune_processed`).
    conn.execute("CREATE INDEX rollout_processed_at ON rollout_processed(at_ms)")


def _v4(conn: sqlite3.Connection) -> None:
    # Housekeeping deletes a finished rollout's controls by rollout (`RolloutStore.prune_finished`).
    conn.execute("CREATE INDEX rollout_controls_rollout ON rollout_controls(rollout_id)")


def _v5(conn: sqlite3.Connection) -> None:
    # What the leader's ConfigServers served per rollout, added up across leader restarts
    # (`RolloutStore.add_serving`): one small row per rollout, kept with its summary.
    conn.execute(
        """CREATE TABLE rollout_serving (
            rollout_id TEXT PRIMARY KEY,
            chunks INTEGER NOT NULL DEFAULT 0,
            bytes INTEGER NOT NULL DEFAULT 0,
            busy INTEGER NOT NULL DEFAULT 0,
            rejected INTEGER NOT NULL DEFAULT 0,
            max_concurrent INTEGER NOT NULL DEFAULT 0,
            updated_ms INTEGER NOT NULL
        ) WITHOUT ROWID"""
    )


def _v6(conn: sqlite3.Connection) -> None:
    # When the leader queued its cancel to a device still updating in a canceled or aborted
    # rollout (NULL: not yet; the orchestrator sends it on its next tick).
    conn.execute("ALTER TABLE rollout_devices ADD COLUMN cancel_sent_ms INTEGER")


def _v7(conn: sqlite3.Connection) -> None:
    # How far each device's download got, from its newest progress report, and how many it sent.
    for column in ("bytes_done INTEGER NOT NULL DEFAULT 0", "bytes_total INTEGER NOT NULL DEFAULT 0",
                   "rate_bytes_per_s REAL NOT NULL DEFAULT 0", "progress_reports INTEGER NOT NULL DEFAULT 0"):
        conn.execute(f"ALTER TABLE rollout_devices ADD COLUMN {column}")


def _v8(conn: sqlite3.Connection) -> None:
    # A download-only rollout's wave: 1 once the operator approved installing what it downloaded.
    conn.execute("ALTER TABLE rollout_waves ADD COLUMN install_approved INTEGER NOT NULL DEFAULT 0")


def _v9(conn: sqlite3.Connection) -> None:
    # What each device's download fetches over the network (the rest it copies from its active
    # slot) and how much of that it fetched.
    for column in ("bytes_to_fetch INTEGER NOT NULL DEFAULT 0", "bytes_fetched INTEGER NOT NULL DEFAULT 0"):
        conn.execute(f"ALTER TABLE rollout_devices ADD COLUMN {column}")


def _v10(conn: sqlite3.Connection) -> None:
    # A control's outcome as a value ('applied' or 'refused'), not a prefix of its result text.
    conn.execute("ALTER TABLE rollout_controls ADD COLUMN outcome TEXT")
    conn.execute("UPDATE rollout_controls SET outcome = 'refused', result = ltrim(substr(result, 7))"
                 " WHERE applied_ms IS NOT NULL AND result LIKE 'error:%'")
    conn.execute("UPDATE rollout_controls SET outcome = 'applied' WHERE applied_ms IS NOT NULL AND outcome IS NULL")


def _v11(conn: sqlite3.Connection) -> None:
    # The audit record: who asked for each control (the console's operator and address, the
    # CLI's user); and each device's state changes in a rollout with when (its timeline, the
    # rollout's chart of devices by state over time).
    conn.execute("ALTER TABLE rollout_controls ADD COLUMN actor TEXT NOT NULL DEFAULT ''")
    conn.execute(
        """CREATE TABLE rollout_device_events (
            rollout_id TEXT NOT NULL,
            device_id TEXT NOT NULL,
            at_ms INTEGER NOT NULL,
            state TEXT NOT NULL,
            detail TEXT NOT NULL DEFAULT ''
        )"""
    )
    conn.execute("CREATE INDEX rollout_device_events_rollout ON rollout_device_events(rollout_id, at_ms)")
    conn.execute("CREATE INDEX rollout_device_events_device ON rollout_device_events(device_id, at_ms)")


def _v12(conn: sqlite3.Connection) -> None:
    # The log lines a device's newest failure report in a rollout carried (its excerpt, redacted
    # on the device): one row per device and rollout, kept and pruned with the device's row.
    conn.execute(
        """CREATE TABLE rollout_device_logs (
            rollout_id TEXT NOT NULL,
            device_id TEXT NOT NULL,
            at_ms INTEGER NOT NULL,
            state TEXT NOT NULL,
            lines TEXT NOT NULL,
            PRIMARY KEY (rollout_id, device_id)
        ) WITHOUT ROWID"""
    )


MIGRATIONS = (_v1, _v2, _v3, _v4, _v5, _v6, _v7, _v8, _v9, _v10, _v11, _v12)




__all__ = ["MIGRATIONS"]
