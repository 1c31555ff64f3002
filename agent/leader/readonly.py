"""The leader's database opened read-only for the commands that only look (`status`, `rejects`).

SQLite's `mode=ro`: nothing is created or migrated, and WAL readers never block the running
leader. A file that is missing, not SQLite, or not a leader database is one `StoreError`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agent.core.errors import StoreError
from agent.core.sqlite import close_quietly, connect_readonly_file


@dataclass(frozen=True, slots=True)
class LeaderDb:
    conn: sqlite3.Connection
    tables: frozenset[str]
    path: Path


@contextmanager
def open_leader_db(db_path: str | Path) -> Iterator[LeaderDb]:
    """Yield the leader database at `db_path` opened read-only; `sqlite3.Error`s inside the
    block become `StoreError` naming the file."""
    path = Path(db_path)
    conn = connect_readonly_file(path)
    try:
        try:
            rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{path}: not an SQLite database ({exc})") from exc
        tables = frozenset(str(r[0]) for r in rows)
        if "devices" not in tables or "registry_meta" not in tables:
            raise StoreError(f"{path}: not an edge-agent leader database (no device registry)")
        yield LeaderDb(conn, tables, path)
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot read: {exc}") from exc
    finally:
        close_quietly(conn)


__all__ = ["LeaderDb", "open_leader_db"]
