"""The leader's audit record of remote sessions (component "sessions"): who opened what on which
device, when, for how long, the bytes each way, how it ended; and, where `[remote] record_input`
says so, what the operator typed into a shell (at most `INPUT_MAX_BYTES` a session).

    remote_sessions        one row per session asked for (refused ones too)
    remote_session_input   the operator's input of a recorded shell, in the order it was typed

In `leader.db`, or the fleet's PostgreSQL database that every leader shares (each row names the
leader that held the session).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.core.backends import server_migrations
from agent.core.clock import Clock
from agent.core.sql import Connection, ServerUrl, dialect_of, has_table
from agent.core.sqlite import store_errors
from agent.core.store import Store

COMPONENT = "sessions"
INPUT_MAX_BYTES = 1024 * 1024


def _v1(conn: sqlite3.Connection) -> None:
    conn.execute(
        """CREATE TABLE remote_sessions (
            sid TEXT PRIMARY KEY,
            leader TEXT NOT NULL,
            device_id TEXT NOT NULL,
            operator TEXT NOT NULL,
            op TEXT NOT NULL,
            target TEXT NOT NULL,
            opened_ms INTEGER NOT NULL,
            closed_ms INTEGER,
            state TEXT NOT NULL,
            bytes_to_device INTEGER NOT NULL DEFAULT 0,
            bytes_from_device INTEGER NOT NULL DEFAULT 0,
            exit_code INTEGER,
            reason TEXT NOT NULL DEFAULT ''
        ) WITHOUT ROWID"""
    )
    conn.execute("CREATE INDEX remote_sessions_opened ON remote_sessions(opened_ms)")
    conn.execute(
        """CREATE TABLE remote_session_input (
            sid TEXT NOT NULL,
            seq INTEGER NOT NULL,
            at_ms INTEGER NOT NULL,
            data BLOB NOT NULL,
            PRIMARY KEY (sid, seq)
        ) WITHOUT ROWID"""
    )


@dataclass(frozen=True, slots=True)
class SessionRecord:
    sid: str
    leader: str
    device_id: str
    operator: str
    op: str
    target: str
    opened_ms: int
    closed_ms: int | None
    state: str  # "opening", "open", "closed", "refused"
    bytes_to_device: int
    bytes_from_device: int
    exit_code: int | None
    reason: str

    def as_json(self) -> dict[str, Any]:
        return {"sid": self.sid, "leader": self.leader, "device": self.device_id, "operator": self.operator,
                "op": self.op, "target": self.target, "opened_ms": self.opened_ms, "closed_ms": self.closed_ms,
                "state": self.state, "bytes_to_device": self.bytes_to_device,
                "bytes_from_device": self.bytes_from_device, "exit_code": self.exit_code, "reason": self.reason}


_COLUMNS = ("sid, leader, device_id, operator, op, target, opened_ms, closed_ms, state, bytes_to_device,"
            " bytes_from_device, exit_code, reason")


def _record(row: tuple[Any, ...]) -> SessionRecord:
    sid, leader, device, operator, op, target, opened, closed, state, to_dev, from_dev, code, reason = row
    return SessionRecord(str(sid), str(leader), str(device), str(operator), str(op), str(target), int(opened),
                         None if closed is None else int(closed), str(state), int(to_dev), int(from_dev),
                         None if code is None else int(code), str(reason))


class SessionLog(Store):
    COMPONENT = COMPONENT
    MIGRATIONS = (_v1,)
    SERVER_MIGRATIONS = server_migrations("agent.leader", COMPONENT)
    WHAT = "session log"

    def __init__(self, conn: Connection | sqlite3.Connection, *, clock: Clock, path: str) -> None:
        super().__init__(conn, path=path)
        self._clock = clock

    @classmethod
    def open(cls, path: str | Path | ServerUrl, *, clock: Clock) -> SessionLog:
        return cls(cls.connect_target(path, synchronous="FULL"), clock=clock, path=str(path))

    def opened(self, *, sid: str, leader: str, device_id: str, operator: str, op: str, target: str,
               state: str = "opening", reason: str = "") -> None:
        now = self._clock.now_ms()
        with self.atomic():
            self._conn.execute(
                f"INSERT INTO remote_sessions ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0, 0, NULL, ?)",
                (sid, leader, device_id, operator[:128], op, target[:512], now,
                 now if state == "refused" else None, state, reason[:512]))

    def accepted(self, sid: str) -> None:
        with self.atomic():
            self._conn.execute("UPDATE remote_sessions SET state = 'open' WHERE sid = ?", (sid,))

    def ended(self, sid: str, *, state: str, bytes_to_device: int, bytes_from_device: int, exit_code: int | None,
               reason: str) -> None:
        with self.atomic():
            self._conn.execute(
                "UPDATE remote_sessions SET closed_ms = ?, state = ?, bytes_to_device = ?, bytes_from_device = ?,"
                " exit_code = ?, reason = ? WHERE sid = ?",
                (self._clock.now_ms(), state, bytes_to_device, bytes_from_device, exit_code, reason[:512], sid))

    def input(self, sid: str, seq: int, data: bytes) -> None:
        with self.atomic(synced=False):
            self._conn.execute("INSERT INTO remote_session_input (sid, seq, at_ms, data) VALUES (?, ?, ?, ?)",
                               (sid, seq, self._clock.now_ms(), data))

    def close_stale(self, leader: str) -> int:
        """Sessions this leader held when it stopped: closed, their ends not known."""
        with self.atomic():
            return int(self._conn.execute(
                "UPDATE remote_sessions SET closed_ms = ?, state = 'closed', reason = 'the leader stopped while it"
                " was open' WHERE leader = ? AND closed_ms IS NULL", (self._clock.now_ms(), leader)).rowcount)

    def get(self, sid: str) -> SessionRecord | None:
        with store_errors("read a session"):
            row = self._conn.execute(f"SELECT {_COLUMNS} FROM remote_sessions WHERE sid = ?", (sid,)).fetchone()
        return None if row is None else _record(row)


class SessionReads:
    """The session record's reads (`devices sessions`, the audit export, the console), on any
    connection to the leader's database; no table yet: no sessions."""

    def __init__(self, conn: Connection | sqlite3.Connection) -> None:
        self._conn: Any = conn
        self.present = bool(self._conn.execute(has_table(dialect_of(conn), "remote_sessions")).fetchone()[0])

    def sessions(self, *, open_only: bool = False, since_ms: int = 0, limit: int = 100) -> list[SessionRecord]:
        """Newest first."""
        if not self.present:
            return []
        where = "opened_ms >= ?" + (" AND closed_ms IS NULL" if open_only else "")
        return [_record(r) for r in self._conn.execute(
            f"SELECT {_COLUMNS} FROM remote_sessions WHERE {where} ORDER BY opened_ms DESC LIMIT ?",
            (since_ms, limit))]

    def input_of(self, sid: str) -> bytes:
        if not self.present:
            return b""
        return b"".join(bytes(d) for (d,) in self._conn.execute(
            "SELECT data FROM remote_session_input WHERE sid = ? ORDER BY seq", (sid,)))


__all__ = ["INPUT_MAX_BYTES", "SessionLog", "SessionReads", "SessionRecord"]
