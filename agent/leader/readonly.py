"""The leader's database opened read-only for the commands that only look (`status`, `rejects`,
the console, `doctor`), with each store's reads over it.

SQLite's `mode=ro`: nothing is created or migrated, and WAL readers never block the running
leader. A file that is missing, not SQLite, or not a leader database is one `StoreError`. Every
read goes through the store that owns its table (`db.registry`, `db.rejects`, `db.jobs`,
`db.rollouts`): a view passes values between them instead of joining their tables.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from agent.core.errors import StoreError
from agent.core.sqlite import close_quietly, connect_readonly_file
from agent.leader.jobs import JobReads
from agent.leader.registry import RegistryReads
from agent.leader.rejects import RejectReads

if TYPE_CHECKING:
    from firmware_rollout.orchestration.store import RolloutReads


class LeaderDb:
    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self.conn = conn
        self.path = path
        self.registry = RegistryReads(conn)

    @functools.cached_property
    def rejects(self) -> RejectReads:
        return RejectReads(self.conn)

    @functools.cached_property
    def jobs(self) -> JobReads:
        return JobReads(self.conn)

    @functools.cached_property
    def rollouts(self) -> RolloutReads:
        from firmware_rollout.orchestration.store import RolloutReads

        return RolloutReads(self.conn)


@contextmanager
def open_leader_db(db_path: str | Path) -> Iterator[LeaderDb]:
    """Yield the leader database at `db_path` opened read-only; `sqlite3.Error`s inside the
    block become `StoreError` naming the file."""
    path = Path(db_path)
    conn = connect_readonly_file(path)
    try:
        db = LeaderDb(conn, path)
        try:
            present = db.registry.present()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{path}: not an SQLite database ({exc})") from exc
        if not present:
            raise StoreError(f"{path}: not an edge-agent leader database (no device registry)")
        yield db
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot read: {exc}") from exc
    finally:
        close_quietly(conn)


__all__ = ["LeaderDb", "open_leader_db"]
