"""Small SQLite helpers shared by the stores: open, `atomic()`, per-component migrations.

* `connect()` opens in autocommit mode (we write `BEGIN IMMEDIATE` ourselves), sets
  `busy_timeout`, switches to WAL outside any transaction and checks the mode SQLite returned,
  and sets `synchronous` (NORMAL: a commit does not fsync; FULL: it does).
* `atomic(conn)` is one transaction (or a SAVEPOINT when already inside one), rolled back on any
  `BaseException`, so a cancelled task never leaves a half-written change.
* `migrate(conn, component, steps)` applies ordered migration functions, each in the same
  transaction as its bookkeeping row. Several components (registry, job queue, outbox) can
  share one database file, so versions are kept per component rather than in `user_version`.

`sqlite3.Error` is translated to `StoreError` by `store_errors()`; callers let no sqlite3 type
or exception out of their module.

`agent.core.store.Store` is the skeleton every store shares (on SQLite or PostgreSQL). The
outbox keeps a connection per thread (its writer and reader) and uses the functions here
directly.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

from agent.core.errors import StoreError, UnstorableValue

Synchronous = Literal["NORMAL", "FULL", "OFF"]

_savepoints = itertools.count()
log = logging.getLogger(__name__)


@contextlib.contextmanager
def store_errors(what: str) -> Iterator[None]:
    """Translate `sqlite3.Error` raised inside the block into `StoreError` naming `what` (and an
    integer SQLite cannot store into `UnstorableValue`)."""
    try:
        yield
    except sqlite3.Error as exc:
        raise StoreError(f"{what}: {exc}") from exc
    except OverflowError as exc:
        raise UnstorableValue(f"{what}: a value beyond SQLite's 64-bit integers: {exc}") from exc


def connect(
    path: str | Path,
    *,
    synchronous: Synchronous = "FULL",
    busy_timeout_ms: int = 5_000,
    wal: bool = True,
) -> sqlite3.Connection:
    """Open (creating) a database for a store. Raises `StoreError`."""
    name = str(path)
    with store_errors(f"cannot open {name}"):
        conn = sqlite3.connect(name, isolation_level=None, check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            if wal and name != ":memory:":
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise StoreError(f"cannot open {name}: journal mode is {mode}, not wal")
            conn.execute(f"PRAGMA synchronous = {synchronous}")
            conn.execute("PRAGMA foreign_keys = ON")
        except BaseException:
            conn.close()
            raise
    return conn


@contextlib.contextmanager
def atomic(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction (BEGIN IMMEDIATE), or a savepoint when nested. Raises `StoreError`
    for SQLite failures; any other exception rolls back and propagates unchanged."""
    if conn.in_transaction:
        name = f"sp{next(_savepoints)}"
        with store_errors("savepoint"):
            conn.execute(f"SAVEPOINT {name}")
        try:
            yield conn
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute(f"ROLLBACK TO {name}")
                conn.execute(f"RELEASE {name}")
            raise
        with store_errors("release savepoint"):
            conn.execute(f"RELEASE {name}")
        return
    with store_errors("begin"):
        conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException as exc:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        if isinstance(exc, sqlite3.Error):
            raise StoreError(str(exc)) from exc
        if isinstance(exc, OverflowError):  # sqlite3's answer to an integer beyond 64 bits
            raise UnstorableValue(f"a value beyond SQLite's 64-bit integers: {exc}") from exc
        raise
    try:
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise StoreError(f"commit: {exc}") from exc


Migration = Callable[[sqlite3.Connection], None]


def migrate(conn: sqlite3.Connection, component: str, steps: Sequence[Migration]) -> int:
    """Bring `component`'s tables to version `len(steps)`; returns the version.

    Refuses (StoreError) a database written by a newer version of the component.
    """
    with atomic(conn):
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_versions ("
            " component TEXT PRIMARY KEY, version INTEGER NOT NULL) WITHOUT ROWID"
        )
        row = conn.execute(
            "SELECT version FROM schema_versions WHERE component = ?", (component,)
        ).fetchone()
        current = int(row[0]) if row else 0
        if current > len(steps):
            raise StoreError(
                f"{component} schema version {current} is newer than this program ({len(steps)})"
            )
        for version in range(current, len(steps)):
            steps[version](conn)
        if current != len(steps):
            conn.execute(
                "INSERT INTO schema_versions(component, version) VALUES (?, ?)"
                " ON CONFLICT(component) DO UPDATE SET version = excluded.version",
                (component, len(steps)),
            )
    return len(steps)


def open_migrated(
    path: str | Path, component: str, steps: Sequence[Migration], *, synchronous: Synchronous = "FULL"
) -> sqlite3.Connection:
    """`connect` and `migrate` in one step; the connection is closed if the migration fails."""
    conn = connect(path, synchronous=synchronous)
    try:
        migrate(conn, component, steps)
    except BaseException:
        close_quietly(conn)
        raise
    return conn


def close_quietly(conn: sqlite3.Connection) -> None:
    """Close a connection, ignoring errors (used on shutdown and in error paths)."""
    with contextlib.suppress(sqlite3.Error):
        conn.close()


# -- damaged files -------------------------------------------------------------------------
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26


def is_corruption(exc: sqlite3.Error) -> bool:
    """True for 'file is not a database' and 'database disk image is malformed'."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    text = str(exc).lower()
    return "not a database" in text or "malformed" in text


def describe(exc: sqlite3.Error) -> str:
    name = getattr(exc, "sqlite_errorname", None)
    return f"{exc} ({name})" if name else str(exc)


def damage_of(path: Path, busy_timeout_ms: int = 5_000) -> str | None:
    """None if the file is a sound SQLite database, else why it is not. Raises sqlite3.Error
    for failures that are not damage (locked, unreadable).

    The check reads through a read-only connection first: closing it neither checkpoints nor
    deletes a -wal file, so a damaged file's WAL is kept as evidence too."""
    try:
        return _check_with(f"{path.resolve().as_uri()}?mode=ro", busy_timeout_ms)
    except sqlite3.Error:
        return _check_with(str(path), busy_timeout_ms)  # e.g. a hot journal needs writing


def _check_with(target: str, busy_timeout_ms: int) -> str | None:
    conn = sqlite3.connect(
        target, isolation_level=None, check_same_thread=False, uri=target.startswith("file:")
    )
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        try:
            rows = conn.execute("PRAGMA quick_check").fetchall()
        except sqlite3.DatabaseError as exc:
            if is_corruption(exc):
                return describe(exc)
            raise
        if rows != [("ok",)]:
            return "quick_check: " + "; ".join(str(r[0]) for r in rows[:3])
        return None
    finally:
        conn.close()


def aside_name(path: Path, now_ms: int, why: str = "corrupt") -> Path:
    """Where `move_aside` puts `path`: `NAME.{why}-{UTC time}` (numbered when taken)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now_ms / 1000))
    dest = path.with_name(f"{path.name}.{why}-{stamp}")
    n = 1
    while dest.exists():
        dest = path.with_name(f"{path.name}.{why}-{stamp}-{n}")
        n += 1
    return dest


def move_aside(path: Path, now_ms: int, why: str = "corrupt") -> Path:
    """Rename a damaged database (and its -wal, -shm, -journal) out of the way; returns the
    new path (`aside_name`: `why` is "corrupt" or "lost"). The evidence is kept, never deleted."""
    dest = aside_name(path, now_ms, why)
    os.replace(path, dest)
    for suffix in ("-wal", "-shm", "-journal"):
        side = Path(str(path) + suffix)
        if side.exists():
            os.replace(side, Path(str(dest) + suffix))
    return dest



def connect_readonly_file(path: Path, *, busy_timeout_ms: int = 2_000) -> sqlite3.Connection:
    """A `mode=ro` connection to an existing database file: nothing is created or written, and
    a WAL reader never blocks the running writer. `StoreError` naming the file if it is not
    there, not a file, or cannot be opened."""
    if not path.exists():
        raise StoreError(f"{path}: no such file")
    if not path.is_file():
        raise StoreError(f"{path}: not a file")
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None,
                               check_same_thread=False)
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot open: {describe(exc)}") from exc
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    except sqlite3.Error as exc:
        close_quietly(conn)
        raise StoreError(f"{path}: cannot open: {describe(exc)}") from exc
    return conn


def read_int(path: Path, sql: str, params: Sequence[object] = ()) -> int | None:
    """One integer from the database at `path`, read-only (nothing is created or changed); None
    when the file, the table or the row is not there."""
    if not path.exists():
        return None
    conn = connect_readonly_file(path)
    try:
        row = conn.execute(sql, tuple(params)).fetchone()
    except sqlite3.Error:  # no such table (damage is for `damage_report` to say)
        return None
    finally:
        close_quietly(conn)
    return int(row[0]) if row is not None else None


def damage_report(path: Path) -> str | None:
    """Why the database at `path` is damaged, or None (sound, absent or empty). `StoreError`
    when it cannot be checked (locked, unreadable)."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    with store_errors(f"cannot check {path}"):
        return damage_of(path)


def recover_damaged(path: Path, *, now_ms: int, what: str) -> str | None:
    """Move `path` aside if it is damaged (see `damage_of`); the new path, or None if it was
    sound or absent. Logged at ERROR: the state it held is lost to the agent, kept as evidence."""
    problem = damage_report(path)
    if problem is None:
        return None
    dest = move_aside(path, now_ms)
    log.error("%s: %s is damaged (%s); moved aside to %s and started afresh", what, path, problem, dest)
    return str(dest)


__all__ = [
    "Migration",
    "aside_name",
    "Synchronous",
    "atomic",
    "close_quietly",
    "connect",
    "damage_of",
    "damage_report",
    "describe",
    "is_corruption",
    "migrate",
    "move_aside",
    "open_migrated",
    "read_int",
    "recover_damaged",
    "store_errors",
]
