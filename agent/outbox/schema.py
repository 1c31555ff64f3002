"""The outbox database file: open, check, move a damaged file aside, migrate.

* One file in WAL mode (switched outside any transaction, and the mode SQLite returns is
  checked), `synchronous` NORMAL or FULL, a `busy_timeout`.
* Versioned by `PRAGMA user_version`; `MIGRATIONS` is an ordered list of named functions, each
  applied in the same transaction as the version bump. `PRAGMA application_id` marks the file
  as an outbox so tools can tell it from any other SQLite file.
* Damage: at open a `PRAGMA quick_check` runs. A file that is not SQLite or is corrupt is moved
  aside to `<name>.corrupt-<UTC timestamp>` (with its -wal/-shm), never deleted, and a fresh
  database is started. Other failures (permissions, a newer schema) raise `StoreError` and touch
  nothing.

Rows (table `outbox`): done and expired rows are deleted (the counters remember them), so only
`pending` and `dead` rows are stored. In-flight is not a stored status: the store object keeps it
in memory (see `agent.outbox.types`). The counters, the per-class depths and the id high-water
mark (`next_id`: ids are never reused) live in `outbox_tally`, written in the same transaction
as the rows; `outbox_counters` and `outbox_classes` are views over it.

Write wear (an SD card wears with every page written): a commit writes every page it touched
to the WAL, so version 2 touches as few as it can (no AUTOINCREMENT, one tally page) and new
files use small pages (`PAGE_SIZE`).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from agent.core.errors import StoreError
from agent.core.marks import StoreMark
from agent.core.sqlite import damage_of, describe, is_corruption, move_aside, read_int
from agent.outbox.types import ClassStats

log = logging.getLogger("agent.outbox")

Synchronous = Literal["NORMAL", "FULL"]

# "EAOB": edge-agent outbox.
APPLICATION_ID = 0x45414F42

COUNTER_NAMES = (
    "enqueued",
    "delivered",
    "dead_lettered",
    "expired",
    "dropped",
    "overwritten",
    "replayed",
    "duplicates",
    "rejected_full",
    "purged",
    "corrupt_recoveries",
)

# Page size of a new outbox file. Every commit writes each page it touched (to the WAL, and
# once more at a checkpoint), so smaller pages mean fewer bytes written per message: an idle
# worker's heartbeat touches four pages per commit whatever their size. The price is bulk
# speed (more pages, and WAL frames, per batch): a gateway that drains large backlogs and
# does not run on an SD card may open its outbox with page_size=4096.
PAGE_SIZE = 1024
PAGE_SIZES = frozenset(1 << n for n in range(9, 17))


def _create_outbox(conn: sqlite3.Connection) -> None:
    conn.execute(
        """
        CREATE TABLE outbox (
            id          INTEGER PRIMARY KEY AUTOINCREMENT,
            msg_id      TEXT    NOT NULL,
            owner       TEXT    NOT NULL,
            receiver    TEXT    NOT NULL,
            kind        TEXT    NOT NULL,
            payload     BLOB    NOT NULL,
            key         TEXT,
            conflict    TEXT    NOT NULL CHECK (conflict IN ('append', 'overwrite')),
            seq         INTEGER NOT NULL,
            created_at  INTEGER NOT NULL,
            send_at     INTEGER NOT NULL,
            attempts    INTEGER NOT NULL DEFAULT 0,
            status      TEXT    NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'dead')),
            last_error  TEXT,
            expires_at  INTEGER,
            size        INTEGER NOT NULL,
            rhash       INTEGER NOT NULL,
            fifo        INTEGER NOT NULL DEFAULT 0
        )
        """
    )
    # The ready scan: only pending rows are indexed, so delivered/dead rows never slow it.
    conn.execute("CREATE INDEX outbox_ready ON outbox (send_at, id) WHERE status = 'pending'")
    # Duplicate / overwrite lookups by (owner, receiver, key), pending keyed rows only.
    conn.execute(
        "CREATE INDEX outbox_key ON outbox (owner, receiver, key)"
        " WHERE status = 'pending' AND key IS NOT NULL"
    )
    # Head of line for FIFO classes: the oldest pending row per receiver.
    conn.execute(
        "CREATE INDEX outbox_fifo ON outbox (receiver, id) WHERE status = 'pending' AND fifo = 1"
    )
    # The expiry sweep: pending rows with a TTL only.
    conn.execute(
        "CREATE INDEX outbox_expiry ON outbox (expires_at)"
        " WHERE status = 'pending' AND expires_at IS NOT NULL"
    )
    conn.execute(
        "CREATE TABLE outbox_counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)"
        " WITHOUT ROWID"
    )
    conn.executemany(
        "INSERT INTO outbox_counters (name, value) VALUES (?, 0)", [(n,) for n in COUNTER_NAMES]
    )
    # Depth per message class, kept in the same transactions as the rows (caps, stats).
    conn.execute(
        "CREATE TABLE outbox_classes ("
        " kind TEXT PRIMARY KEY, pending INTEGER NOT NULL, pending_bytes INTEGER NOT NULL,"
        " dead INTEGER NOT NULL) WITHOUT ROWID"
    )


# Version 2 writes fewer pages per commit (an SD card wears with every page written): row ids
# without AUTOINCREMENT (its sqlite_sequence row was one more page per insert), and the
# counters, per-class depths and the id high-water mark in one small table (one page instead
# of two). Ids are still never reused: `next_id` is kept there, in the same transaction as
# the rows, and never goes down.
OUTBOX_COLUMNS = (
    "id, msg_id, owner, receiver, kind, payload, key, conflict, seq, created_at, send_at,"
    " attempts, status, last_error, expires_at, size, rhash, fifo"
)
NEXT_ID = "next_id"
# Per-class depths and flows are tally rows named "<field>:<kind>" (counter names hold no
# colon): the depths (pending, bytes, dead), then what entered and left the class, so the
# conservation law holds per class as it does for the whole outbox.
CLASS_FIELDS = (
    "pending", "bytes", "dead",
    "enqueued", "delivered", "dead_lettered", "expired", "dropped", "overwritten", "replayed",
)
(C_PENDING, C_BYTES, C_DEAD, C_ENQUEUED, C_DELIVERED, C_DEAD_LETTERED, C_EXPIRED, C_DROPPED,
 C_OVERWRITTEN, C_REPLAYED) = range(len(CLASS_FIELDS))


def class_stats(fields: Sequence[int], *, in_flight: int = 0) -> ClassStats:
    """One class's CLASS_FIELDS (in that order) as its `ClassStats`."""
    return ClassStats(in_flight=in_flight, **{
        ("pending_bytes" if name == "bytes" else name): int(v) for name, v in zip(CLASS_FIELDS, fields, strict=True)})


def _outbox_table(conn: sqlite3.Connection, name: str) -> None:
    conn.execute(
        f"""
        CREATE TABLE {name} (
            id          INTEGER PRIMARY KEY,
            msg_id      TEXT    NOT NULL,
            owner       TEXT    NOT NULL,
            receiver    TEXT    NOT NULL,
            kind        TEXT    NOT NULL,
            payload     BLOB    NOT NULL,
            key         TEXT,
            conflict    TEXT    NOT NULL CHECK (conflict IN ('append', 'overwrite')),
            seq         INTEGER NOT NULL,
            created_at  INTEGER NOT NULL,
            send_at     INTEGER NOT NULL,
            attempts    INTEGER NOT NULL DEFAULT 0,
            status      TEXT    NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'dead')),
            last_error  TEXT,
            expires_at  INTEGER,
            size        INTEGER NOT NULL,
            rhash       INTEGER NOT NULL,
            fifo        INTEGER NOT NULL DEFAULT 0
        )
        """
    )


def _outbox_indexes(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE INDEX outbox_ready ON outbox (send_at, id) WHERE status = 'pending'")
    conn.execute(
        "CREATE INDEX outbox_key ON outbox (owner, receiver, key)"
        " WHERE status = 'pending' AND key IS NOT NULL"
    )
    conn.execute(
        "CREATE INDEX outbox_fifo ON outbox (receiver, id) WHERE status = 'pending' AND fifo = 1"
    )
    conn.execute(
        "CREATE INDEX outbox_expiry ON outbox (expires_at)"
        " WHERE status = 'pending' AND expires_at IS NOT NULL"
    )


def _fewer_pages(conn: sqlite3.Connection) -> None:
    """v1 -> v2: rebuild `outbox` without AUTOINCREMENT (every row, dead letter and attempt
    kept), fold `outbox_counters` and `outbox_classes` into `outbox_tally`, and keep both
    names as read-only views for tools that read them."""
    seq = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'").fetchone()
    top = conn.execute("SELECT max(id) FROM outbox").fetchone()[0] or 0
    next_id = max(seq[0] if seq else 0, top) + 1
    counters = conn.execute("SELECT name, value FROM outbox_counters").fetchall()
    classes = conn.execute(
        "SELECT kind, pending, pending_bytes, dead FROM outbox_classes"
    ).fetchall()
    _outbox_table(conn, "outbox_v2")
    conn.execute(
        f"INSERT INTO outbox_v2 ({OUTBOX_COLUMNS}) SELECT {OUTBOX_COLUMNS} FROM outbox ORDER BY id"
    )
    conn.execute("DROP TABLE outbox")  # (its indexes and its sqlite_sequence row go with it)
    conn.execute("ALTER TABLE outbox_v2 RENAME TO outbox")
    _outbox_indexes(conn)
    conn.execute("DROP TABLE outbox_counters")
    conn.execute("DROP TABLE outbox_classes")
    _create_tally(conn)
    rows: list[tuple[str, int]] = [(n, int(v)) for n, v in counters if n in COUNTER_NAMES]
    rows.append((NEXT_ID, next_id))
    for kind, pending, nbytes, dead in classes:
        rows += [(f"pending:{kind}", pending), (f"bytes:{kind}", nbytes), (f"dead:{kind}", dead)]
    conn.executemany(
        "INSERT INTO outbox_tally (name, value) VALUES (?, ?)"
        " ON CONFLICT (name) DO UPDATE SET value = excluded.value",
        rows,
    )


def _create_tally(conn: sqlite3.Connection) -> None:
    conn.execute(
        "CREATE TABLE outbox_tally (name TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID"
    )
    conn.executemany(
        "INSERT INTO outbox_tally (name, value) VALUES (?, 0)",
        [(n,) for n in (*COUNTER_NAMES, NEXT_ID)],
    )
    conn.execute(
        "CREATE VIEW outbox_counters AS SELECT name, value FROM outbox_tally"
        f" WHERE instr(name, ':') = 0 AND name != '{NEXT_ID}'"
    )
    conn.execute(
        "CREATE VIEW outbox_classes AS"
        " SELECT substr(p.name, 9) AS kind, p.value AS pending,"
        " coalesce(b.value, 0) AS pending_bytes, coalesce(d.value, 0) AS dead"
        " FROM outbox_tally AS p"
        " LEFT JOIN outbox_tally AS b ON b.name = 'bytes:' || substr(p.name, 9)"
        " LEFT JOIN outbox_tally AS d ON d.name = 'dead:' || substr(p.name, 9)"
        " WHERE p.name >= 'pending:' AND p.name < 'pending;'"
    )


def _class_flows(conn: sqlite3.Connection) -> None:
    """v2 -> v3: per-class flow counters. What a class holds now is taken as having entered it
    (its pending rows enqueued, its dead rows enqueued and dead-lettered), so the conservation
    law holds per class from here on; the outbox-wide counters keep their whole history."""
    rows: list[tuple[str, int]] = []
    for kind, pending, dead in conn.execute("SELECT kind, pending, dead FROM outbox_classes").fetchall():
        rows += [(f"enqueued:{kind}", int(pending) + int(dead)), (f"dead_lettered:{kind}", int(dead))]
    conn.executemany(
        "INSERT INTO outbox_tally (name, value) VALUES (?, ?)"
        " ON CONFLICT (name) DO UPDATE SET value = excluded.value",
        rows,
    )


Migration = tuple[str, Callable[[sqlite3.Connection], None]]

MIGRATIONS: list[Migration] = [
    ("create_outbox", _create_outbox),
    ("fewer_pages_per_commit", _fewer_pages),
    ("class_flows", _class_flows),
]
SCHEMA_VERSION = len(MIGRATIONS)


def configure(
    conn: sqlite3.Connection, *, synchronous: Synchronous, busy_timeout_ms: int
) -> None:
    """Per-connection settings. WAL is switched outside a transaction and checked."""
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise StoreError(f"journal mode is {mode}, not wal")
    if synchronous not in ("NORMAL", "FULL"):
        raise ValueError(f"synchronous must be NORMAL or FULL, got {synchronous!r}")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    conn.execute("PRAGMA temp_store = MEMORY")
    conn.execute("PRAGMA cache_size = -8192")  # 8 MiB: fits a 1 GB device
    conn.execute("PRAGMA journal_size_limit = 16777216")  # truncate the WAL after checkpoints


def migrate(conn: sqlite3.Connection) -> int:
    """Apply the missing migrations, each in its own transaction with its version bump."""
    while True:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            if app_id not in (0, APPLICATION_ID):
                raise StoreError(f"not an outbox database (application_id {app_id:#x})")
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"outbox schema version {version} is newer than this program "
                    f"({SCHEMA_VERSION})"
                )
            if version == SCHEMA_VERSION:
                conn.execute("COMMIT")
                return version
            name, step = MIGRATIONS[version]
            log.info("outbox: migrating schema to version %d (%s)", version + 1, name)
            step(conn)
            conn.execute(f"PRAGMA user_version = {version + 1}")
            if app_id == 0:
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise


MIN_SQLITE = (3, 35, 0)  # RETURNING


MARK_COUNTER = "enqueued"  # what the outbox's mark (`agent.core.marks`) records: it only grows


def enqueued_in(path: Path) -> int | None:
    """The outbox's `enqueued` counter as the file holds it, None if the file or its tables are
    gone (read-only: nothing is created or changed)."""
    return read_int(path, "SELECT value FROM outbox_tally WHERE name = ?", (MARK_COUNTER,))


def open_database(
    path: str | Path,
    *,
    synchronous: Synchronous = "NORMAL",
    busy_timeout_ms: int = 5_000,
    now_ms: int | None = None,
    page_size: int = PAGE_SIZE,
) -> tuple[sqlite3.Connection, str | None, str | None]:
    """Open (creating if needed) the outbox at `path`; returns the connection (autocommit mode,
    usable from one other thread), the path a damaged file was moved to and the path a file
    that lost state was moved to (see `agent.core.marks`), if any. `page_size` applies to a
    new file only (an existing file keeps its own).

    Raises `StoreError`; no sqlite3 exception leaves this function.
    """
    if page_size not in PAGE_SIZES:
        raise ValueError(f"page_size must be a power of two from 512 to 65536, got {page_size!r}")
    p = Path(path)
    if sqlite3.sqlite_version_info < MIN_SQLITE:
        need = ".".join(map(str, MIN_SQLITE))
        raise StoreError(f"the outbox needs SQLite >= {need}, this Python has {sqlite3.sqlite_version}")
    recovered: str | None = None
    lost: str | None = None
    mark = StoreMark(p)
    when = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    try:
        if p.exists() and p.stat().st_size > 0:
            problem = damage_of(p, busy_timeout_ms)
            if problem is not None:
                dest = move_aside(p, when)
                mark.set_aside(dest)
                recovered = str(dest)
                log.error("outbox: %s is damaged (%s); moved aside to %s", p, problem, dest)
        if recovered is None and mark.path.exists():
            why = mark.lost_state(MARK_COUNTER, enqueued_in(p))
            if why is not None:
                dest = mark.move_lost(when)
                lost = str(dest)
                log.error("outbox: %s lost state: %s; %s, and a fresh outbox started", p, why,
                          f"moved aside to {dest}" if dest.exists() else "the file is gone")
        fresh = not p.exists() or p.stat().st_size == 0
        conn = sqlite3.connect(str(p), isolation_level=None, check_same_thread=False)
        try:
            if fresh:  # only before the first table; an existing file keeps its page size
                conn.execute(f"PRAGMA page_size = {page_size}")
            configure(conn, synchronous=synchronous, busy_timeout_ms=busy_timeout_ms)
            migrate(conn)
            if recovered is not None:
                conn.execute(
                    "UPDATE outbox_tally SET value = value + 1 WHERE name = 'corrupt_recoveries'"
                )
        except BaseException:
            conn.close()
            raise
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open outbox {p}: {describe(exc)}") from exc
    except OSError as exc:
        raise StoreError(f"cannot open outbox {p}: {exc}") from exc
    return conn, recovered, lost


__all__ = [
    "APPLICATION_ID",
    "CLASS_FIELDS",
    "class_stats",
    "C_BYTES",
    "C_DEAD",
    "C_DEAD_LETTERED",
    "C_DELIVERED",
    "C_DROPPED",
    "C_ENQUEUED",
    "C_EXPIRED",
    "C_OVERWRITTEN",
    "C_PENDING",
    "C_REPLAYED",
    "COUNTER_NAMES",
    "MARK_COUNTER",
    "MIGRATIONS",
    "MIN_SQLITE",
    "NEXT_ID",
    "OUTBOX_COLUMNS",
    "PAGE_SIZE",
    "PAGE_SIZES",
    "SCHEMA_VERSION",
    "Synchronous",
    "configure",
    "describe",
    "enqueued_in",
    "is_corruption",
    "migrate",
    "move_aside",
    "open_database",
]
