import sqlite3
from pathlib import Path

import pytest

from agent.core.errors import StoreError
from agent.core.sqlite import atomic, connect, migrate


def rows(conn: sqlite3.Connection) -> list[int]:
    return [r[0] for r in conn.execute("SELECT x FROM t ORDER BY x")]


@pytest.fixture
def conn(tmp_path: Path):
    c = connect(tmp_path / "db.sqlite")
    c.execute("CREATE TABLE t (x INTEGER PRIMARY KEY)")
    yield c
    c.close()


def test_connect_uses_wal_and_the_requested_synchronous(tmp_path: Path) -> None:
    c = connect(tmp_path / "a.db", synchronous="FULL")
    assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert c.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    c.close()


def test_atomic_commits_or_rolls_back_on_any_base_exception(conn: sqlite3.Connection) -> None:
    with atomic(conn):
        conn.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(KeyboardInterrupt), atomic(conn):
        conn.execute("INSERT INTO t VALUES (2)")
        raise KeyboardInterrupt
    assert rows(conn) == [1] and not conn.in_transaction


def test_nested_atomic_is_a_savepoint(conn: sqlite3.Connection) -> None:
    with atomic(conn):
        conn.execute("INSERT INTO t VALUES (1)")
        with pytest.raises(ValueError), atomic(conn):
            conn.execute("INSERT INTO t VALUES (2)")
            raise ValueError
        conn.execute("INSERT INTO t VALUES (3)")
    assert rows(conn) == [1, 3]


def test_sqlite_errors_become_store_errors(conn: sqlite3.Connection, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="UNIQUE"), atomic(conn):
        conn.execute("INSERT INTO t VALUES (1)")
        conn.execute("INSERT INTO t VALUES (1)")
    assert rows(conn) == []
    with pytest.raises(StoreError):
        connect(tmp_path)  # a directory


def test_migrations_run_once_each_and_refuse_a_newer_schema(conn: sqlite3.Connection) -> None:
    ran: list[int] = []
    steps = [lambda c: ran.append(1), lambda c: ran.append(2)]
    assert migrate(conn, "comp", steps[:1]) == 1
    assert migrate(conn, "comp", steps) == 2
    assert migrate(conn, "comp", steps) == 2
    assert ran == [1, 2]
    assert migrate(conn, "other", steps[:1]) == 1  # versions are per component
    with pytest.raises(StoreError, match="newer"):
        migrate(conn, "comp", steps[:1])


def test_a_failing_migration_leaves_no_trace(conn: sqlite3.Connection) -> None:
    def bad(c: sqlite3.Connection) -> None:
        c.execute("CREATE TABLE half (x)")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        migrate(conn, "comp", [bad])
    assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'half'").fetchone() is None
    assert migrate(conn, "comp", [lambda c: c.execute("CREATE TABLE half (x)")]) == 1
