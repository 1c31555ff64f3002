"""The leader's database opened read-only for the commands that only look (`status`, `rejects`,
the console, `doctor`), with each store's reads over it.

SQLite's `mode=ro`: nothing is created or migrated, and WAL readers never block the running
leader. A file that is missing, not SQLite, or not a leader database is one `StoreError`. Every
read goes through the store that owns its table (`db.registry`, `db.rejects`, `db.jobs`,
`db.rollouts`): a view passes values between them instead of joining their tables.

A fleet whose leaders share a PostgreSQL database (`[leader] database`) keeps its registry,
rejects, identities, job queue, rollout tables, configuration layers and acknowledged
configuration attempts there:
`open_leader_db("postgresql://...")` reads the whole fleet from it, and a leader's own view passes
its `leader.db` and `shared=` the database.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.core.errors import StoreError
from agent.core.sql import ServerUrl, StoreTarget, is_server_url
from agent.core.sqlite import close_quietly, connect_readonly_file
from agent.leader.identities import IdentityReads
from agent.leader.jobs import JobReads
from agent.leader.registry import DeviceRegistry, RegistryReads
from agent.leader.rejects import RejectReads

if TYPE_CHECKING:
    from agent.leader.session_log import SessionReads
    from config_rollout.attempt_acks import AttemptAckReads
    from config_rollout.layer_store import LayerReads
    from rollout_engine.store import RolloutReads


class LeaderDb:
    def __init__(self, conn: Any, path: Path | ServerUrl, shared: Any = None) -> None:
        # the leader's own leader.db; with only the fleet's shared database, an empty one in
        # memory: it reads as "no jobs, no rollouts"
        self.conn = conn if conn is not None else sqlite3.connect(":memory:", check_same_thread=False)
        self.path = path
        self.shared = shared if shared is not None else conn
        self.registry = RegistryReads(self.shared)

    @functools.cached_property
    def rejects(self) -> RejectReads:
        return RejectReads(self.shared)

    @functools.cached_property
    def identities(self) -> IdentityReads:
        return IdentityReads(self.shared)

    @functools.cached_property
    def sessions(self) -> SessionReads:
        """The remote sessions' record: on the fleet's database when its leaders share one."""
        from agent.leader.session_log import SessionReads

        return SessionReads(self.shared)

    @functools.cached_property
    def jobs(self) -> JobReads:
        on_shared = JobReads(self.shared) if self.shared is not self.conn else None
        return on_shared if on_shared is not None and on_shared.counts() is not None else JobReads(self.conn)

    @functools.cached_property
    def rollouts(self) -> RolloutReads:
        from rollout_engine.store import RolloutReads

        on_shared = RolloutReads(self.shared) if self.shared is not self.conn else None
        return on_shared if on_shared is not None and on_shared.present else RolloutReads(self.conn)

    @functools.cached_property
    def layers(self) -> LayerReads:
        """The configuration layers: on the fleet's database when its leaders share one."""
        from config_rollout.layer_store import LayerReads

        on_shared = LayerReads(self.shared) if self.shared is not self.conn else None
        return on_shared if on_shared is not None and on_shared.present else LayerReads(self.conn)

    @functools.cached_property
    def attempt_acks(self) -> AttemptAckReads:
        """The operators' acknowledgements of failed configuration attempts: on the fleet's
        database when its leaders share one."""
        from config_rollout.attempt_acks import AttemptAckReads

        on_shared = AttemptAckReads(self.shared) if self.shared is not self.conn else None
        return on_shared if on_shared is not None and on_shared.present else AttemptAckReads(self.conn)


def _shared_reader(target: ServerUrl) -> Any:
    return DeviceRegistry.connect_reader(target)


class FleetReader:
    """One read connection to the fleet's stores that a running leader keeps for its /metrics:
    a scrape reads through it (`reading()`) and never opens a session of its own. On a database
    server a lost session is connected again by the next read; a file is read in WAL, never
    blocking the leader's writes."""

    def __init__(self, target: StoreTarget) -> None:
        self.target = target
        self._conn: Any = None

    @contextmanager
    def reading(self) -> Iterator[LeaderDb]:
        if self._conn is None:
            self._conn = DeviceRegistry.connect_reader(self.target)
        if isinstance(self.target, ServerUrl):
            db = LeaderDb(None, self.target, self._conn)
            try:
                yield db
            finally:
                close_quietly(db.conn)  # (its empty in-memory stand-in for a leader.db)
            return
        yield LeaderDb(self._conn, self.target)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if isinstance(conn, sqlite3.Connection):
            close_quietly(conn)
        elif conn is not None:
            conn.close()


@contextmanager
def open_leader_db(db_path: str | Path | ServerUrl, *, shared: StoreTarget | None = None) -> Iterator[LeaderDb]:
    """Yield the leader database at `db_path` opened read-only (a `postgresql://` URL: the fleet's
    shared database alone); `shared`: the PostgreSQL database holding the registry and rejects
    beside the file. `sqlite3.Error`s inside the block become `StoreError` naming the file."""
    if isinstance(db_path, str) and is_server_url(db_path):
        db_path = ServerUrl(db_path)
    if isinstance(db_path, ServerUrl):
        reader = FleetReader(db_path)
        try:
            with reader.reading() as db:
                yield db
        finally:
            reader.close()
        return
    path = Path(db_path)
    conn = connect_readonly_file(path)
    pg = _shared_reader(shared) if isinstance(shared, ServerUrl) else None
    try:
        db = LeaderDb(conn, path, pg)
        try:
            present = db.registry.present()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{path}: not an SQLite database ({exc})") from exc
        if not present:
            if JobReads(conn).counts() is not None:
                raise StoreError(f"{path}: holds no device registry: this leader keeps it in PostgreSQL"
                                 " ([leader] database); read it with --db postgresql://...")
            raise StoreError(f"{path}: not an edge-agent leader database (no device registry)")
        yield db
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot read: {exc}") from exc
    finally:
        close_quietly(conn)
        if pg is not None:
            pg.close()


__all__ = ["FleetReader", "LeaderDb", "open_leader_db"]
