"""Where a store keeps its tables, and the connection shape every database offers the stores.

A leader's stores live in one SQLite file (`leader.db`, the default) or on one database server
(`[leader] database = "postgresql://..."`; the servers are a table: `agent.core.backends`). A
store is written once, in the SQL they all speak (`INSERT ... ON CONFLICT ... DO UPDATE ...
WHERE`, `RETURNING`, `?` placeholders), against `Connection`; where they differ (a type name, a
JSON array) the store asks its `Dialect`.

`StoreTarget` is what a store is opened on: a `Path` (SQLite) or a `ServerUrl`. Callers tell the
two apart (a file of one leader, a server the fleet's leaders share), never one server from
another.
"""

from __future__ import annotations

import enum
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agent.core.backends import Backend, backend_named, schemes
from agent.core.errors import ConfigError

NO_LIMIT = 1 << 62  # a LIMIT of "all" on both (PostgreSQL takes no negative LIMIT, SQLite's -1)
# The database server's clock in epoch milliseconds (PostgreSQL): what leases expire by, one
# clock for every leader of a fleet.
SERVER_NOW_MS = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)"


class Dialect(enum.StrEnum):
    SQLITE = "sqlite"
    POSTGRESQL = "postgresql"


class Cursor(Protocol):
    """What a store reads of a statement it ran (sqlite3's and psycopg's cursors both)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Connection(Protocol):
    """The part of `sqlite3.Connection` the stores use; `agent.core.postgres.PgConnection` offers
    the same over PostgreSQL (`?` placeholders on both)."""

    @property
    def in_transaction(self) -> bool: ...

    def execute(self, sql: str, parameters: Sequence[Any] = ..., /) -> Cursor: ...

    def executemany(self, sql: str, parameters: Any, /) -> Cursor: ...

    def close(self) -> None: ...


def dialect_of(conn: object) -> Dialect:
    """The dialect of a store's connection (a `PgConnection` says so; anything else is SQLite)."""
    return getattr(conn, "dialect", Dialect.SQLITE)


def greatest(dialect: Dialect, a: str, b: str) -> str:
    """The larger of two SQL expressions (SQLite's scalar `MAX`, PostgreSQL's `GREATEST`)."""
    return f"MAX({a}, {b})" if dialect is Dialect.SQLITE else f"GREATEST({a}, {b})"


def json_array_holds(dialect: Dialect, column: str) -> str:
    """A condition: the JSON array (text) in `column` holds the string bound to the next `?`."""
    if dialect is Dialect.SQLITE:
        return f"EXISTS (SELECT 1 FROM json_each({column}) WHERE json_each.value = ?)"
    return f"EXISTS (SELECT 1 FROM jsonb_array_elements_text(CAST({column} AS jsonb)) AS t(v) WHERE t.v = ?)"


def in_json_array(dialect: Dialect, column: str) -> str:
    """A condition: `column` is one of the strings of the JSON array (text) bound to the next `?`."""
    if dialect is Dialect.SQLITE:
        return f"{column} IN (SELECT value FROM json_each(?))"
    return f"{column} IN (SELECT jsonb_array_elements_text(CAST(? AS jsonb)))"


def has_table(dialect: Dialect, table: str) -> str:
    """A query of one row, one column: 1 when `table` exists (in the session's schema)."""
    if dialect is Dialect.SQLITE:
        return f"SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = '{table}'"
    return f"SELECT CAST(to_regclass('{table}') IS NOT NULL AS integer)"


@dataclass(frozen=True)
class ServerUrl:
    """A database on a server, by its URL, whose scheme names the backend
    (`postgresql://user@host:port/db?sslmode=...`: `agent.core.backends`).

    The password is read from a file (`[leader] database_password_file`) or left to the driver
    (PostgreSQL: libpq's `PG*` environment, `PGPASSWORD`, `PGPASSFILE`, ..., and `~/.pgpass`).
    `str()` never shows a password."""

    url: str
    password: str | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return redacted(self.url)

    @property
    def backend(self) -> Backend:
        found = backend_named(self.url)
        if found is None:  # (`store_target` refuses such a URL first)
            raise ConfigError(redacted(self.url), None, "not the URL of a database server this program knows")
        return found


StoreTarget = Path | ServerUrl


@dataclass(frozen=True)
class Outage:
    """A database server this process cannot reach: since when (epoch ms), why (its first failure),
    and how many outages it has had in this process, this one included."""

    since_ms: int
    why: str
    count: int


#: One notice a listener heard on a database server: (channel, payload).
Notice = tuple[str, str]


def is_server_url(value: str) -> bool:
    """Whether `value` names a database server (a scheme of `agent.core.backends`), not a file."""
    return backend_named(value) is not None


def redacted(url: str) -> str:
    """`url` with any password in it replaced by `***` (for logs and error lines)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def store_target(value: str | Path, *, password: str | None = None, source: str = "", key: str = "") -> StoreTarget:
    """A `Path` for an SQLite file, a `ServerUrl` for a database server's URL (`postgresql://...`);
    `ConfigError` naming `source` and `key` for any other URL scheme."""
    text = str(value)
    backend = backend_named(text)
    if backend is not None:
        form = f"{backend.schemes[0]}USER@HOST[:PORT]/DB"
        parts = urllib.parse.urlsplit(text)
        if not parts.hostname and "host=" not in parts.query:
            raise ConfigError(source, key, f"{redacted(text)}: names no host ({form})")
        if not parts.path.strip("/"):
            raise ConfigError(source, key, f"{redacted(text)}: names no database ({form})")
        return ServerUrl(text, password)
    if "://" in text:
        raise ConfigError(source, key, f"{redacted(text)}: not a file path nor the URL of a database server"
                                       f" ({', '.join(schemes())})")
    return Path(text)


__all__ = [
    "NO_LIMIT",
    "Outage",
    "SERVER_NOW_MS",
    "Connection",
    "Cursor",
    "Dialect",
    "ServerUrl",
    "StoreTarget",
    "dialect_of",
    "greatest",
    "has_table",
    "in_json_array",
    "json_array_holds",
    "is_server_url",
    "redacted",
    "store_target",
]
