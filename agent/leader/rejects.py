"""Messages the leader refused (forged sender, undecodable, oversized, unknown kind), kept with
the reason so an operator can see them: `RejectLog.list()`.

A table of its own in the leader's database, written only when something is refused (rare), so
it costs nothing on the hot path. The oldest rows beyond `max_rows` are trimmed, and the oldest
of one sender's beyond `max_per_sender`: one device sending junk cannot push every other
device's refusals out of the table.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from agent.core.backends import server_migrations
from agent.core.clock import Clock
from agent.core.sql import Connection, ServerUrl, dialect_of, has_table
from agent.core.sqlite import store_errors
from agent.core.store import Store

COMPONENT = "rejects"
HEAD_BYTES = 256  # how much of a refused payload is kept as evidence


def _v1(conn: sqlite3.Connection) -> None:
    conn.execute(
        """CREATE TABLE rejects (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            at_ms INTEGER NOT NULL,
            topic TEXT NOT NULL,
            sender TEXT,
            msg_id TEXT,
            kind TEXT,
            size INTEGER NOT NULL,
            reason TEXT NOT NULL,
            head BLOB NOT NULL
        )"""
    )


def _v2(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE INDEX rejects_sender ON rejects(sender, id)")


@dataclass(frozen=True, slots=True)
class Reject:
    id: int
    at_ms: int
    topic: str
    sender: str | None
    msg_id: str | None
    kind: str | None
    size: int
    reason: str
    head: bytes




class RejectLog(Store):
    COMPONENT = COMPONENT
    MIGRATIONS = (_v1, _v2)
    SERVER_MIGRATIONS = server_migrations("agent.leader", COMPONENT)
    WHAT = "reject log"

    def __init__(self, conn: Connection | sqlite3.Connection, *, clock: Clock, max_rows: int, max_per_sender: int,
                 path: str) -> None:
        super().__init__(conn, path=path)
        self._clock = clock
        self._max_rows = max_rows
        self._max_per_sender = max_per_sender
        self.count = 0  # recorded by this process

    @classmethod
    def open(cls, path: str | Path | ServerUrl, *, clock: Clock, max_rows: int = 10_000,
             max_per_sender: int = 100) -> RejectLog:
        # Unsynced: a reject row is evidence for an operator, never what an acknowledgement rests on,
        # and a hostile device must not buy an fsync per junk message.
        return cls(cls.connect_target(path, synchronous="NORMAL"), clock=clock, max_rows=max_rows,
                   max_per_sender=max_per_sender, path=str(path))

    def record(self, *, topic: str, reason: str, payload: bytes = b"", sender: str | None = None,
               msg_id: str | None = None, kind: str | None = None, size: int | None = None) -> int:
        with self.atomic():
            cur = self._conn.execute(
                "INSERT INTO rejects (at_ms, topic, sender, msg_id, kind, size, reason, head)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
                (self._clock.now_ms(), topic, sender, msg_id, kind,
                 len(payload) if size is None else size, reason, bytes(payload[:HEAD_BYTES])),
            )
            row_id = int(cur.fetchone()[0])
            if row_id > self._max_rows:
                self._conn.execute("DELETE FROM rejects WHERE id <= ?", (row_id - self._max_rows,))
            if sender is not None:
                self._conn.execute(
                    "DELETE FROM rejects WHERE sender = ? AND id <= (SELECT id FROM rejects"
                    " WHERE sender = ? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                    (sender, sender, self._max_per_sender),
                )
        self.count += 1
        return row_id

    def list(self, limit: int = 100, offset: int = 0) -> list[Reject]:
        with store_errors("list rejects"):
            rows = self._conn.execute(f"SELECT {_COLUMNS} FROM rejects ORDER BY id DESC LIMIT ? OFFSET ?",
                                      (limit, offset)).fetchall()
        return [_reject(r) for r in rows]

    def total(self) -> int:
        with store_errors("count rejects"):
            return int(self._conn.execute("SELECT COUNT(*) FROM rejects").fetchone()[0])


class RejectCount(msgspec.Struct, kw_only=True, frozen=True):
    sender: str | None
    reason: str
    count: int
    last_ms: int


_COLUMNS = "id, at_ms, topic, sender, msg_id, kind, size, reason, head"


def _reject(values: tuple[object, ...]) -> Reject:
    id_, at, topic, sender, msg_id, kind, size, reason, head = values
    return Reject(int(str(id_)), int(str(at)), str(topic), None if sender is None else str(sender),
                  None if msg_id is None else str(msg_id), None if kind is None else str(kind), int(str(size)),
                  str(reason), head if isinstance(head, bytes) else b"")


class RejectReads:
    """The refusals' reads for the views (`rejects`, `status --device`, the console), on any
    connection to the leader's database (a read-only one while the leader runs); a database that
    never refused anything has no table yet, and no refusals."""

    def __init__(self, conn: Connection | sqlite3.Connection) -> None:
        self._conn: Any = conn
        self._present = bool(self._conn.execute(has_table(dialect_of(conn), "rejects")).fetchone()[0])

    @staticmethod
    def _sender(device: str | None) -> tuple[str, tuple[str, ...]]:
        return (" WHERE sender = ?", (device,)) if device is not None else ("", ())

    def counts(self, *, device: str | None = None) -> list[RejectCount]:
        """Refusals kept, grouped by sender and reason, the most frequent first."""
        if not self._present:
            return []
        where, params = self._sender(device)
        return [RejectCount(sender=sender, reason=str(reason), count=int(n), last_ms=int(last))
                for sender, reason, n, last in self._conn.execute(
                    f"SELECT sender, reason, COUNT(*), MAX(at_ms) FROM rejects{where}"
                    " GROUP BY sender, reason ORDER BY COUNT(*) DESC, MAX(at_ms) DESC", params)]

    def newest(self, *, device: str | None = None, limit: int = 50) -> list[Reject]:
        """The newest refusals first; `limit` 0 for all."""
        if not self._present:
            return []
        where, params = self._sender(device)
        return [_reject(v) for v in self._conn.execute(
            f"SELECT {_COLUMNS} FROM rejects{where} ORDER BY id DESC" + (f" LIMIT {int(limit)}" if limit else ""),
            params)]

    def get(self, reject_id: int) -> Reject | None:
        if not self._present:
            return None
        found = self._conn.execute(f"SELECT {_COLUMNS} FROM rejects WHERE id = ?", (reject_id,)).fetchone()
        return None if found is None else _reject(found)


__all__ = ["Reject", "RejectCount", "RejectLog", "RejectReads"]
