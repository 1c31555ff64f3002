"""Where a store keeps its tables, and the connection shape both databases offer the stores.

A leader's stores live in one SQLite file (`leader.db`, the default) or in one PostgreSQL
database (`[leader] database = "postgresql://..."`). A store is written once, in the SQL both
speak (`INSERT ... ON CONFLICT ... DO UPDATE ... WHERE`, `RETURNING`, `?` placeholders), against
`Connection`; where the two differ (a type name, a JSON array) the store asks its `Dialect`.

`StoreTarget` is what a store is opened on: a `Path` (SQLite) or a `PostgresUrl`.
"""

from __future__ import annotations

import enum
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

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
class PostgresUrl:
    """A PostgreSQL database by its libpq URL (`postgresql://user@host:port/db?sslmode=...`).

    The password is read from a file (`[leader] database_password_file`) or left to libpq: the
    standard `PG*` environment (`PGPASSWORD`, `PGPASSFILE`, `PGSSLMODE`, ...) and `~/.pgpass`.
    `str()` never shows a password."""

    url: str
    password: str | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return redacted(self.url)


StoreTarget = Path | PostgresUrl


@dataclass(frozen=True)
class Outage:
    """A database server this process cannot reach: since when (epoch ms), why (its first failure),
    and how many outages it has had in this process, this one included."""

    since_ms: int
    why: str
    count: int

_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_url(value: str) -> bool:
    return value.startswith(_SCHEMES)


def redacted(url: str) -> str:
    """`url` with any password in it replaced by `***` (for logs and error lines)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def store_target(value: str | Path, *, password: str | None = None, source: str = "", key: str = "") -> StoreTarget:
    """A `Path` for an SQLite file, a `PostgresUrl` for `postgresql://...`; `ConfigError` naming
    `source` and `key` for any other URL scheme."""
    text = str(value)
    if is_postgres_url(text):
        parts = urllib.parse.urlsplit(text)
        if not parts.hostname and "host=" not in parts.query:
            raise ConfigError(source, key, f"{redacted(text)}: names no host (postgresql://USER@HOST[:PORT]/DB)")
        if not parts.path.strip("/"):
            raise ConfigError(source, key, f"{redacted(text)}: names no database (postgresql://USER@HOST[:PORT]/DB)")
        return PostgresUrl(text, password)
    if "://" in text:
        raise ConfigError(source, key, f"{redacted(text)}: not a file path nor a postgresql:// URL")
    return Path(text)


__all__ = [
    "NO_LIMIT",
    "Outage",
    "SERVER_NOW_MS",
    "Connection",
    "Cursor",
    "Dialect",
    "PostgresUrl",
    "StoreTarget",
    "dialect_of",
    "greatest",
    "has_table",
    "in_json_array",
    "json_array_holds",
    "is_postgres_url",
    "redacted",
    "store_target",
]
