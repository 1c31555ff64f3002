"""The skeleton every store shares, on SQLite or on a database server (PostgreSQL).

A subclass names its `COMPONENT`, its `MIGRATIONS` (SQLite: functions) and, when it can live on
a server too, its `SERVER_MIGRATIONS` (per backend of `agent.core.backends`, SQL scripts: one per
version); it opens its connection with `connect_target(target)` in its own `open` (which does
the store's first reads), and inherits `atomic(synced=...)`, `check_open()`, an idempotent
`close()` and the context manager. `dialect` says which database it is on, for the few
statements that differ; `on_server` whether the fleet's leaders may share it.

A store without `SERVER_MIGRATIONS` is kept in SQLite only (the device's own stores).
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Self, cast

from agent.core import sqlite as sqlite_db
from agent.core.backends import Listener, ServerModule
from agent.core.errors import StoreError
from agent.core.sql import Connection, Dialect, Outage, ServerUrl, StoreTarget, dialect_of, is_server_url


class Store:
    """One store's connection: opened and migrated once, `atomic()`, `close()`, `with store:`.

    A closed store raises `StoreError` naming `WHAT` (e.g. "device registry is closed").
    """

    COMPONENT: ClassVar[str]  # the migration bookkeeping name (several stores share a database)
    MIGRATIONS: ClassVar[Sequence[sqlite_db.Migration]]
    # backend name -> its SQL scripts, one per version; empty: this store is kept in SQLite only
    SERVER_MIGRATIONS: ClassVar[Mapping[str, Sequence[str]]] = {}
    WHAT: ClassVar[str]  # what the store is, for error messages

    def __init__(self, conn: Connection | sqlite3.Connection, *, path: str | Path | ServerUrl) -> None:
        self._conn: Any = conn
        self.path = str(path)  # printable: never a password
        # where it was opened, to open another store there (a URL given as text keeps no password)
        self.target: StoreTarget = path if isinstance(path, ServerUrl) else (
            ServerUrl(path) if isinstance(path, str) and is_server_url(path) else Path(path))
        self.dialect = dialect_of(conn)
        # a server's module (its `atomic`), loaded with its connection
        self._module = self.target.backend.load() if isinstance(self.target, ServerUrl) and self.on_server else None
        self._closed = False

    @classmethod
    def connect_migrated(cls, path: str | Path, *, synchronous: sqlite_db.Synchronous = "FULL") -> sqlite3.Connection:
        """A connection to the SQLite file `path` with this store's tables at their newest
        version. FULL (the default): every commit is synced, it survives a power cut; see
        `atomic(synced=False)` for the writes that may lose their last seconds."""
        return sqlite_db.open_migrated(path, cls.COMPONENT, cls.MIGRATIONS, synchronous=synchronous)

    @classmethod
    def connect_target(cls, target: StoreTarget | str, *, synchronous: sqlite_db.Synchronous = "FULL") -> Connection:
        """`connect_migrated` for a store that lives on SQLite or a server (`SERVER_MIGRATIONS`):
        `target` is a path, a `ServerUrl` or a server's URL (`postgresql://...`)."""
        if isinstance(target, str) and is_server_url(target):
            target = ServerUrl(target)
        if isinstance(target, ServerUrl):
            module, steps = cls._server(target)
            return cast("Connection", module.open_migrated(target, cls.COMPONENT, steps))
        return cast("Connection", cls.connect_migrated(target, synchronous=synchronous))

    @classmethod
    def _server(cls, target: ServerUrl) -> tuple[ServerModule, Sequence[str]]:
        """The backend module for `target` and this store's scripts for it."""
        backend = target.backend
        steps = cls.SERVER_MIGRATIONS.get(backend.name)
        if not steps:
            raise StoreError(f"{cls.WHAT} is kept in SQLite only, not in {target}")
        return backend.load(), steps

    @property
    def connection(self) -> Connection:
        """The store's connection, for what writes in its transactions beside it (a lease's fence)."""
        return cast("Connection", self._conn)

    def migrate_also(self, component: str, migrations: Mapping[str, Sequence[str]]) -> None:
        """Bring the tables of `component`, which live beside this store's on its server and are
        written in its transactions (`agent.core.lease`), to their newest version."""
        if self._module is None or not isinstance(self.target, ServerUrl):
            raise StoreError(f"{component} live on a database server, not in {self.path}")
        steps = migrations.get(self.target.backend.name)
        if not steps:
            raise StoreError(f"{component} have no tables for {self.target.backend.name}")
        self._module.migrate(self._conn, component, steps)

    def listener(self, *channels: str) -> Listener | None:
        """A listener of this store's server for the notices sent on `channels` (`notify`), to
        wake on instead of polling; None on a file (one leader writes it: nothing to hear)."""
        if self._module is None or not isinstance(self.target, ServerUrl):
            return None
        return self._module.listen(self.target, channels)

    def notify(self, channel: str, payload: str = "") -> None:
        """Tell every listener of `channel` (delivered when the open transaction commits);
        nothing on a file."""
        if self._module is not None:
            self._module.notify(self._conn, channel, payload)

    @property
    def on_server(self) -> bool:
        """On a database server the fleet's leaders may share (not a leader's own file)."""
        return self.dialect is not Dialect.SQLITE

    def outage(self) -> Outage | None:
        """Since when and why this store's database server cannot be reached (None: it can; a
        local SQLite file never has one: its failures are each call's own error)."""
        if not self.on_server:
            return None
        return cast("Outage | None", self._conn.server.outage)

    def outages(self) -> int:
        """How many times this process lost the store's database server (0 on SQLite)."""
        return int(self._conn.server.outages) if self.on_server else 0

    @classmethod
    def connect_readonly(cls, path: str | Path) -> sqlite3.Connection:
        """A read-only connection (`mode=ro`) to the SQLite file `path`, which must hold this
        store's tables at the version this program reads: nothing is created or migrated.
        `StoreError` says why not in one line (no such file, not SQLite, not this store's, older
        or newer schema)."""
        target = Path(path)
        conn = sqlite_db.connect_readonly_file(target)
        try:
            try:
                row = conn.execute("SELECT version FROM schema_versions WHERE component = ?",
                                   (cls.COMPONENT,)).fetchone()
            except sqlite3.OperationalError:
                row = None
            except sqlite3.DatabaseError as exc:
                raise StoreError(f"{target}: not an SQLite database ({sqlite_db.describe(exc)})") from exc
            if row is None:
                raise StoreError(f"{target}: has no {cls.WHAT.removeprefix('the ')} (no {cls.COMPONENT} tables)")
            version, current = int(row[0]), len(cls.MIGRATIONS)
            if version > current:
                raise StoreError(f"{target}: {cls.WHAT} schema {version} is newer than this program ({current})")
            if version < current:
                raise StoreError(f"{target}: {cls.WHAT} schema {version} is older than this program's ({current}):"
                                 " start the agent that owns it once to upgrade it")
        except BaseException:
            sqlite_db.close_quietly(conn)
            raise
        return conn

    @classmethod
    def connect_reader(cls, target: StoreTarget | str) -> Connection:
        """`connect_readonly` for a store that may live on a server: there a read-only session
        (`default_transaction_read_only`) whose database must hold this store's tables at this
        program's version, else `StoreError` in one line."""
        if isinstance(target, str) and is_server_url(target):
            target = ServerUrl(target)
        if not isinstance(target, ServerUrl):
            return cast("Connection", cls.connect_readonly(target))
        module, steps = cls._server(target)
        conn = module.connect(target)
        try:
            conn.execute("SET default_transaction_read_only = on")
            version, current = module.schema_version(conn, cls.COMPONENT), len(steps)
            if version is None:
                raise StoreError(f"{target}: has no {cls.WHAT.removeprefix('the ')} (no {cls.COMPONENT} tables)")
            if version != current:
                newer = "newer than this program" if version > current else "older than this program's"
                raise StoreError(f"{target}: {cls.WHAT} schema {version} is {newer} ({current})")
        except BaseException:
            conn.close()
            raise
        return cast("Connection", conn)

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.WHAT} is closed")

    @contextlib.contextmanager
    def atomic(self, *, synced: bool = True) -> Iterator[Any]:
        """One transaction (a savepoint when nested); see `agent.core.sqlite.atomic` and
        the server backend's (`agent.core.postgres.atomic`). `synced=False`: its commit is not synced (SQLite NORMAL,
        PostgreSQL `synchronous_commit = off`: it survives the agent's crash, not a power cut or
        the server's crash), for writes worth less than an fsync each: heartbeats, classes of
        durability "crash"."""
        self.check_open()
        if self._module is not None:
            with self._module.atomic(self._conn, synced=synced) as conn:
                yield conn
            return
        with self._sqlite_unsynced(not synced), sqlite_db.atomic(self._conn) as conn:
            yield conn

    @contextlib.contextmanager
    def _sqlite_unsynced(self, really: bool) -> Iterator[None]:
        if not really or self._conn.in_transaction:
            yield
            return
        before = int(self._conn.execute("PRAGMA synchronous").fetchone()[0])
        if before <= 1:  # OFF or NORMAL already
            yield
            return
        self._conn.execute("PRAGMA synchronous = NORMAL")
        try:
            yield
        finally:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute(f"PRAGMA synchronous = {before}")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.on_server:
                self._conn.close()
            else:
                sqlite_db.close_quietly(self._conn)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Store"]
