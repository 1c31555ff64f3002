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

from agent.core.clock import Clock
from agent.core.sqlite import SqliteStore, store_errors

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


class RejectLog(SqliteStore):
    COMPONENT = COMPONENT
    MIGRATIONS = (_v1, _v2)
    WHAT = "reject log"

    def __init__(self, conn: sqlite3.Connection, *, clock: Clock, max_rows: int, max_per_sender: int,
                 path: str) -> None:
        super().__init__(conn, path=path)
        self._clock = clock
        self._max_rows = max_rows
        self._max_per_sender = max_per_sender
        self.count = 0  # recorded by this process

    @classmethod
    def open(cls, path: str | Path, *, clock: Clock, max_rows: int = 10_000, max_per_sender: int = 100) -> RejectLog:
        return cls(cls.connect_migrated(path), clock=clock, max_rows=max_rows, max_per_sender=max_per_sender,
                   path=str(path))

    def record(self, *, topic: str, reason: str, payload: bytes = b"", sender: str | None = None,
               msg_id: str | None = None, kind: str | None = None, size: int | None = None) -> int:
        with self.atomic():
            cur = self._conn.execute(
                "INSERT INTO rejects (at_ms, topic, sender, msg_id, kind, size, reason, head)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (self._clock.now_ms(), topic, sender, msg_id, kind,
                 len(payload) if size is None else size, reason, bytes(payload[:HEAD_BYTES])),
            )
            row_id = int(cur.lastrowid or 0)
            if row_id > self._max_rows:
                self._conn.execute("DELETE FROM rejects WHERE id <= ?", (row_id - self._max_rows,))
            if sender is not None:
                self._conn.execute(
                    "DELETE FROM rejects WHERE sender = ?1 AND id <= (SELECT id FROM rejects"
                    " WHERE sender = ?1 ORDER BY id DESC LIMIT 1 OFFSET ?2)",
                    (sender, self._max_per_sender),
                )
        self.count += 1
        return row_id

    def list(self, limit: int = 100, offset: int = 0) -> list[Reject]:
        with store_errors("list rejects"):
            rows = self._conn.execute(
                "SELECT id, at_ms, topic, sender, msg_id, kind, size, reason, head FROM rejects"
                " ORDER BY id DESC LIMIT ? OFFSET ?",
                (limit, offset),
            ).fetchall()
        return [Reject(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], bytes(r[8])) for r in rows]

    def total(self) -> int:
        with store_errors("count rejects"):
            return int(self._conn.execute("SELECT COUNT(*) FROM rejects").fetchone()[0])



__all__ = ["Reject", "RejectLog"]
