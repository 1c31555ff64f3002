"""A store's connection to PostgreSQL (psycopg 3), shaped like the `sqlite3.Connection` the
stores already use (`agent.core.sql.Connection`).

* Imported only when a leader is configured with `database = "postgresql://..."`: psycopg is a
  gateway-only dependency (the `postgresql` extra) and a device never loads it.
* Statements are written once with `?` placeholders; they become psycopg's `%s` here (outside
  string literals; a literal `%` is doubled). Values are bound on the client (`ClientCursor`):
  PostgreSQL types each literal from its context, as SQLite does, so one statement serves both.
* The connection is in autocommit; `atomic()` writes `BEGIN`/`COMMIT` (a savepoint when nested),
  like `agent.core.sqlite.atomic`.
* psycopg's errors never leave this module: a lost server is `StoreUnavailable` (the leader
  answers busy and its devices keep their outboxes; the next call outside a transaction connects
  again), a value out of range is `UnstorableValue`, anything else `StoreError`.
* The server is one state for the whole process (`server_state`): every connection to it that
  finds it lost marks it lost, the first connect that reaches it again marks it back, and each
  change is one log line (never one a failed call); `Store.outage()` reads it.
* `listen()` is a session of its own that hears `NOTIFY`s without a poll (`PgListener`);
  `notify()` sends one from a store's transaction, delivered when it commits.
* `migrate()` keeps per-component versions in `schema_versions` as SQLite does, under an
  advisory lock so that two leaders starting together migrate once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from agent.core.clock import Clock
from agent.core.errors import StoreError, StoreUnavailable, UnstorableValue
from agent.core.sql import Cursor, Dialect, Notice, Outage, ServerUrl

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5  # unless the URL says `connect_timeout`
# After a failed connect, calls fail at once for this long instead of each trying again: a
# server that does not answer must not hold the leader's event loop for a connect timeout a call.
RECONNECT_PAUSE_S = 1.0
STATEMENT_TIMEOUT_MS = 30_000  # a statement never holds the leader's event loop longer
# A leader frozen inside a transaction (SIGSTOP, a VM paused) holds its rows' locks: the server
# ends its session after this long, so the other leaders wait at most this, never for ever.
IDLE_IN_TRANSACTION_MS = 10_000
LOCK_TIMEOUT_MS = 5_000  # a statement waiting longer for a lock fails (the devices are answered busy)
_MIGRATION_LOCK = 0x6561_6d69  # pg_advisory_xact_lock key: "eami", edge-agent migrations
_savepoints = itertools.count()


def _rewritten(sql: str, mark: Callable[[int], str], percent: str) -> str:
    """`sql` with its n-th `?` outside a quoted literal as `mark(n)` and every `%` as `percent`."""
    out: list[str] = []
    quote = ""
    n = 0
    for ch in sql:
        if quote:
            if ch == quote:
                quote = ""
        elif ch in ("'", '"'):
            quote = ch
        elif ch == "?":
            n += 1
            out.append(mark(n))
            continue
        out.append(percent if ch == "%" else ch)
    return "".join(out)


@functools.lru_cache(maxsize=1024)
def placeholders(sql: str) -> str:
    """`sql` with each `?` outside a quoted literal as psycopg's `%s`, and every `%` doubled."""
    return _rewritten(sql, lambda _: "%s", "%%")


def _numbered(sql: str) -> str:
    """`sql` with each `?` outside a quoted literal as `$1`, `$2`, ... (libpq's own)."""
    return _rewritten(sql, lambda n: f"${n}", "%")


def _check(result: Any, ok: tuple[Any, ...]) -> None:
    """Raise the psycopg error of a libpq result that is not one of `ok`."""
    if result.status not in ok:
        from psycopg.errors import error_from_result

        raise error_from_result(result, encoding="utf-8")


def _element(value: Any) -> str:
    """One element of an array literal in PostgreSQL's text form."""
    if value is None:
        return "NULL"
    if isinstance(value, bytes | bytearray | memoryview):
        return '"\\\\x' + bytes(value).hex() + '"'
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _array_text(values: Sequence[Any]) -> bytes:
    """An array literal (`{1,NULL,"a b"}`) of `values`, for an `ARRAY`-typed parameter. A column
    of one type (a batch's column almost always is) is written without a call per element."""
    kinds = set(map(type, values))
    if kinds == {int}:
        body = ",".join(map(str, values))
    elif kinds == {str}:
        body = ",".join(['"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values])
    elif kinds == {bytes}:
        body = ",".join(['"\\\\x' + v.hex() + '"' for v in values])
    elif kinds == {float}:
        body = ",".join(map(repr, values))
    else:
        body = ",".join(map(_element, values))
    return ("{" + body + "}").encode()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class ServerState:
    """One PostgreSQL server as this process finds it, over all of its connections: reachable or
    lost (since when, why). Losing it and reaching it again are one log line each; a process that
    never reached it says nothing here (its first connect's error is the caller's to say)."""

    def __init__(self, target: ServerUrl) -> None:
        self.target = target
        self.reached_once = False
        self.outage: Outage | None = None
        self.outages = 0
        self._lost_at = 0.0  # time.monotonic() when lost

    def lost(self, why: str) -> None:
        if self.outage is not None or not self.reached_once:
            return
        self.outages += 1
        self._lost_at = time.monotonic()
        self.outage = Outage(since_ms=int(time.time() * 1000), why=why, count=self.outages)
        log.warning("the database %s is unreachable (%s): its stores answer busy until it is back", self.target, why)

    def reached(self) -> None:
        self.reached_once = True
        if self.outage is not None:
            log.warning("the database %s is back after %.1fs", self.target, time.monotonic() - self._lost_at)
            self.outage = None


_servers: dict[str, ServerState] = {}


def server_state(target: ServerUrl) -> ServerState:
    """The state of the server at `target`, shared by every connection of this process to it."""
    found = _servers.get(target.url)
    if found is None:
        found = _servers[target.url] = ServerState(target)
    return found


class PgConnection:
    """One store's PostgreSQL session. Connects again, on the next call outside a transaction,
    after the server was lost."""

    dialect = Dialect.POSTGRESQL

    def __init__(self, target: ServerUrl) -> None:
        self.target = target
        self._conn: psycopg.Connection[Any] | None = None
        self._closed = False
        self._txn = False  # between `begin` and `commit`/`rollback`
        self._lost_transaction = False  # the server went away inside a transaction: `rollback` first
        self._next_connect = 0.0  # time.monotonic() before which no new connect is tried
        self._why = ""  # why the last connect failed
        self._prepared: set[bytes] = set()  # the statements prepared in this session
        self.server = server_state(target)
        self._connect()

    # -- the connection ------------------------------------------------------------------------
    def _connect(self) -> psycopg.Connection[Any]:
        import psycopg

        extra = _connect_params(self.target)
        if time.monotonic() < self._next_connect:
            raise StoreUnavailable(f"cannot connect to {self.target}: {self._why} (trying again shortly)")
        try:
            conn = psycopg.connect(self.target.url, autocommit=True, **extra)
        except psycopg.Error as exc:
            self._next_connect = time.monotonic() + RECONNECT_PAUSE_S
            self._why = _first_line(exc)
            raise self._unavailable(f"cannot connect to {self.target}: {self._why}", self._why) from exc
        try:
            conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}; SET lock_timeout = {LOCK_TIMEOUT_MS};"
                         f" SET idle_in_transaction_session_timeout = {IDLE_IN_TRANSACTION_MS}")
        except psycopg.Error as exc:
            conn.close()
            raise self._unavailable(f"{self.target}: {_first_line(exc)}", _first_line(exc)) from exc
        self._conn = conn
        self.server.reached()
        return conn

    def _unavailable(self, said: str, why: str) -> StoreUnavailable:
        """The error to raise for a server lost, having marked it lost for the whole process."""
        self.server.lost(why)
        return StoreUnavailable(said)

    def _live(self) -> psycopg.Connection[Any]:
        if self._closed:
            raise StoreError(f"{self.target}: the connection is closed")
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            self._drop()
            return self._connect()
        return conn

    def _drop(self) -> None:
        self._prepared.clear()
        if self._txn:
            self._lost_transaction = True
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    @contextlib.contextmanager
    def _errors(self, sql: str) -> Iterator[None]:
        import psycopg

        try:
            yield
        except psycopg.errors.NumericValueOutOfRange as exc:
            raise UnstorableValue(f"a value beyond PostgreSQL's column type: {_first_line(exc)}") from exc
        except psycopg.Error as exc:
            conn = self._conn
            if isinstance(exc, psycopg.OperationalError) and (conn is None or conn.closed or conn.broken):
                self._drop()
                raise self._unavailable(f"{self.target}: the server is unreachable: {_first_line(exc)}",
                                        _first_line(exc)) from exc
            if isinstance(exc, psycopg.errors.AdminShutdown | psycopg.errors.CannotConnectNow):
                self._drop()
                raise self._unavailable(f"{self.target}: {_first_line(exc)}", _first_line(exc)) from exc
            raise StoreError(f"{_first_line(exc)} (in: {' '.join(sql.split())[:120]})") from exc

    # -- sqlite3.Connection's shape ----------------------------------------------------------------
    @property
    def in_transaction(self) -> bool:
        return self._txn

    def execute(self, sql: str, parameters: Sequence[Any] = (), /) -> Cursor:
        conn = self._session()
        with self._errors(sql):
            if parameters:
                return conn.execute(placeholders(sql), tuple(parameters))
            return conn.execute(sql)

    def executemany(self, sql: str, parameters: Any, /) -> Cursor:
        conn = self._session()
        with self._errors(sql):
            cur = conn.cursor()
            cur.executemany(placeholders(sql), [tuple(p) for p in parameters])
            return cur

    def close(self) -> None:
        self._closed = True
        self._drop()

    def column_of_arrays(self, name: str, sql: str, columns: Sequence[Sequence[Any]]) -> list[str]:
        """Run `sql`, whose `?`s take one array each (`CAST(? AS BIGINT[])`, ...), prepared once a
        session under `name`, with `columns` as those arrays; the first column of its rows as
        text. A batch of heartbeats is one such statement over `unnest(...)`.

        Why not `execute`: psycopg parses a statement for its placeholders on every call unless
        its text is short enough for its cache, and adapts Python lists element by element; a
        batch as a few array literals in PostgreSQL's text form, bound to a statement the server
        planned once, costs a fraction of that (measured: scripts/bench_leaders.py)."""
        from psycopg import pq

        conn = self._session()
        key = name.encode()
        with self._errors(sql):
            if key not in self._prepared:
                result = conn.pgconn.prepare(key, _numbered(sql).encode())
                _check(result, (pq.ExecStatus.COMMAND_OK,))
                self._prepared.add(key)
            result = conn.pgconn.exec_prepared(key, [_array_text(c) for c in columns])
            _check(result, (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK))
        return [bytes(result.get_value(row, 0) or b"").decode() for row in range(result.ntuples)]

    def _session(self) -> psycopg.Connection[Any]:
        if self._lost_transaction:
            raise StoreUnavailable(f"{self.target}: the connection was lost inside a transaction")
        if self._txn:
            assert self._conn is not None
            return self._conn
        return self._live()

    # -- transactions (`atomic`) -------------------------------------------------------------------
    def begin(self, *, synced: bool = True) -> None:
        self._lost_transaction = False
        # one round trip either way
        self.execute("BEGIN" if synced else "BEGIN; SET LOCAL synchronous_commit = off")
        self._txn = True

    def commit(self) -> None:
        self.execute("COMMIT")
        self._txn = False

    def rollback(self) -> None:
        """Roll back the open transaction, if the connection still has one; never raises."""
        lost, self._lost_transaction = self._lost_transaction, False
        if self._txn and not lost:
            with contextlib.suppress(StoreError):
                self.execute("ROLLBACK")
        self._txn = False


def _connect_params(target: ServerUrl) -> dict[str, Any]:
    """What every session of this process to `target` connects with, besides its URL."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(target.url)
    except psycopg.Error as exc:
        raise StoreError(f"{target}: not a PostgreSQL URL: {_first_line(exc)}") from exc
    extra: dict[str, Any] = {"application_name": params.get("application_name", "edge-agent leader")}
    if "connect_timeout" not in params:
        extra["connect_timeout"] = CONNECT_TIMEOUT_S
    if target.password is not None:
        extra["password"] = target.password
    return extra


_CHANNEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz_")


class PgListener:
    """A session of its own that `LISTEN`s on `channels` and is read when its socket is
    readable (the event loop's reader): no statement runs while nothing is sent.

    `wait()` returns what was heard, or nothing at its timeout. When the session is lost it
    stops listening (`listening` False: the caller falls back to asking on its own ticks) and
    each later `wait()` tries to listen again, at most once per `RECONNECT_PAUSE_S`; the
    first `wait()` after it listens again hears every channel with an empty payload, because
    what was sent in between is gone.

    A notice is a wake-up, never the work itself: the listener claims what it was told of from
    the tables. Channels are the database's, not a schema's, so two fleets in one database (a
    schema each) wake each other now and then for a claim that finds nothing."""

    def __init__(self, target: ServerUrl, channels: Sequence[str]) -> None:
        for channel in channels:
            if not channel or set(channel) - _CHANNEL_CHARS:
                raise ValueError(f"a channel name is lower-case letters and '_', got {channel!r}")
        self.target = target
        self.channels = tuple(channels)
        self.listening = False
        self._conn: psycopg.Connection[Any] | None = None
        self._fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._heard: set[Notice] = set()
        self._woken: asyncio.Event | None = None
        self._next_connect = 0.0
        self._closed = False
        self.sessions = 0  # sessions it listened on: more than one, it was lost and listened again

    def _listen(self) -> None:
        import psycopg

        if self._closed or self.listening or time.monotonic() < self._next_connect:
            return
        self._next_connect = time.monotonic() + RECONNECT_PAUSE_S
        try:
            conn = psycopg.connect(self.target.url, autocommit=True, **_connect_params(self.target))
        except (psycopg.Error, StoreError):
            return
        try:
            conn.execute("; ".join(f"LISTEN {channel}" for channel in self.channels))
            conn.pgconn.nonblocking = 1
        except psycopg.Error:
            conn.close()
            return
        self._conn, self._fd = conn, conn.pgconn.socket
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._readable)
        self.listening = True
        # listening anew: whatever was sent while it did not listen is lost, so every channel is heard
        self._heard.update((channel, "") for channel in self.channels)
        self.sessions += 1
        self._wake()

    def _readable(self) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            conn.pgconn.consume_input()
            while (notice := conn.pgconn.notifies()) is not None:
                self._heard.add((notice.relname.decode(), notice.extra.decode()))
        except Exception:  # the session is gone (psycopg.OperationalError): listen again later
            self._drop()
            if self._woken is not None:
                self._woken.set()  # a waiter learns it at once: it asks on its own ticks now
            return
        self._wake()

    def _wake(self) -> None:
        if self._heard and self._woken is not None:
            self._woken.set()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if self._loop is not None and self._fd >= 0:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._fd)
        self._fd = -1
        self.listening = False
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    async def wait(self, clock: Clock, timeout_s: float) -> frozenset[Notice]:
        """What was heard since the last call, waiting up to `timeout_s` (on `clock`) for it."""
        if self._woken is None:
            self._woken = asyncio.Event()
        if not self.listening:
            self._listen()
        if not self._heard and timeout_s > 0:
            self._woken.clear()
            with contextlib.suppress(TimeoutError):
                await clock.wait_for(self._woken.wait(), timeout_s)
        heard, self._heard = frozenset(self._heard), set()
        self._woken.clear()
        return heard

    def close(self) -> None:
        self._closed = True
        self._drop()


def listen(target: ServerUrl, channels: Sequence[str]) -> PgListener:
    """A listener on `channels` of `target` (it connects at its first `wait()`)."""
    return PgListener(target, channels)


def notify(conn: PgConnection, channel: str, payload: str = "") -> None:
    """Send `payload` on `channel`, delivered when the open transaction commits (at once outside
    one); the server folds repeats of one notice within a transaction into one."""
    conn.execute("SELECT pg_notify(?, ?)", (channel, payload))


def connect(target: ServerUrl) -> PgConnection:
    """A session on `target`. `StoreUnavailable` naming the URL (never its password) when the
    server cannot be reached or refuses the login."""
    return PgConnection(target)


@contextlib.contextmanager
def atomic(conn: PgConnection, *, synced: bool = True) -> Iterator[PgConnection]:
    """One transaction (READ COMMITTED), or a savepoint when nested; rolled back on any
    exception. A lost server inside it is `StoreUnavailable` and nothing of it was committed.
    `synced=False`: its commit does not wait for the WAL flush (`synchronous_commit = off`: a
    server crash may lose its last moments, never corrupt), as SQLite's NORMAL."""
    if conn.in_transaction:
        name = f"sp{next(_savepoints)}"
        conn.execute(f"SAVEPOINT {name}")
        try:
            yield conn
        except BaseException:
            with contextlib.suppress(StoreError):
                conn.execute(f"ROLLBACK TO SAVEPOINT {name}")
                conn.execute(f"RELEASE SAVEPOINT {name}")
            raise
        conn.execute(f"RELEASE SAVEPOINT {name}")
        return
    conn.begin(synced=synced)
    try:
        yield conn
    except BaseException:
        conn.rollback()
        raise
    try:
        conn.commit()
    except StoreError:
        conn.rollback()
        raise


def migrate(conn: PgConnection, component: str, steps: Sequence[str]) -> int:
    """Bring `component`'s tables to version `len(steps)` (each step one SQL script, run in the
    transaction that records it). Refuses (StoreError) a database written by a newer version."""
    with atomic(conn):
        conn.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS schema_versions (component TEXT PRIMARY KEY, version BIGINT NOT NULL)")
        row = conn.execute("SELECT version FROM schema_versions WHERE component = ?", (component,)).fetchone()
        current = int(row[0]) if row else 0
        if current > len(steps):
            raise StoreError(f"{conn.target}: {component} schema version {current} is newer than this program"
                             f" ({len(steps)})")
        for version in range(current, len(steps)):
            conn.execute(steps[version])
        if current != len(steps):
            conn.execute("INSERT INTO schema_versions (component, version) VALUES (?, ?) ON CONFLICT (component)"
                         " DO UPDATE SET version = excluded.version", (component, len(steps)))
    return len(steps)


def open_migrated(target: ServerUrl, component: str, steps: Sequence[str]) -> PgConnection:
    """`connect` and `migrate` in one step; the connection is closed if the migration fails."""
    conn = connect(target)
    try:
        migrate(conn, component, steps)
    except BaseException:
        conn.close()
        raise
    return conn


def schema_version(conn: PgConnection, component: str) -> int | None:
    """The version of `component`'s tables in the database, or None (no such tables)."""
    row = conn.execute("SELECT to_regclass('schema_versions') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return None
    found = conn.execute("SELECT version FROM schema_versions WHERE component = ?", (component,)).fetchone()
    return int(found[0]) if found else None


__all__ = ["PgConnection", "PgListener", "ServerState", "atomic", "connect", "listen", "migrate", "notify",
           "open_migrated", "placeholders", "schema_version", "server_state"]
