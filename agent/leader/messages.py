"""The leader's store of device applications' messages (`AppMessage`), in leader.db.

* APPEND messages are kept once each: the envelope id is unique, so a redelivery (a lost reply,
  a device restarted before its ack) is a duplicate and changes nothing.
* OVERWRITE messages keep one row per (device, class, key): a newer `seq` replaces it, an older
  or equal one is a duplicate.
* Each device has a byte budget (`[messages] max_bytes_per_device`): beyond it, that device's
  oldest rows go first. One device flooding the leader fills only its own budget.
* Rows older than `[messages] retention_s` are pruned by housekeeping (with the processed ids:
  the retention must outlive every redelivery, checked at config load).

`edge-agent messages --db leader.db --device ID --class NAME` reads it (`read_messages`).
"""

from __future__ import annotations

import base64
import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.core.backends import server_migrations
from agent.core.clock import Clock
from agent.core.errors import StoreError
from agent.core.sql import Connection, ServerUrl
from agent.core.sqlite import Synchronous
from agent.core.store import Store
from agent.protocol import AppMessage

COMPONENT = "messages"
MAX_BYTES_PER_DEVICE = 64 * 1024 * 1024


def _v1(conn: sqlite3.Connection) -> None:
    conn.execute(
        """CREATE TABLE app_messages (
            id INTEGER PRIMARY KEY,
            msg_id TEXT NOT NULL UNIQUE,
            device_id TEXT NOT NULL,
            class TEXT NOT NULL,
            key TEXT,
            overwrite INTEGER NOT NULL,
            seq INTEGER NOT NULL,
            ts_ms INTEGER NOT NULL,
            received_ms INTEGER NOT NULL,
            content_type TEXT NOT NULL,
            size INTEGER NOT NULL,
            payload BLOB NOT NULL
        )"""
    )
    conn.execute("CREATE INDEX app_messages_device ON app_messages (device_id, class, id)")
    conn.execute("CREATE UNIQUE INDEX app_messages_key ON app_messages (device_id, class, key)"
                 " WHERE overwrite = 1")
    conn.execute("CREATE INDEX app_messages_received ON app_messages (received_ms)")
    conn.execute(
        "CREATE TABLE app_message_usage (device_id TEXT PRIMARY KEY, bytes INTEGER NOT NULL) WITHOUT ROWID"
    )


_DEVICE_LOCKS = 1  # pg_advisory_xact_lock(1, hash of a device id): one writer of a device's messages at a time


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """One row of the message store, as the CLI shows it."""

    id: int
    msg_id: str
    device_id: str
    cls: str
    key: str | None
    overwrite: bool
    seq: int
    ts_ms: int
    received_ms: int
    content_type: str
    payload: bytes


class MessageLog(Store):
    """Open with `MessageLog.open(path, clock=...)` (the leader's database)."""

    COMPONENT = COMPONENT
    MIGRATIONS = (_v1,)
    SERVER_MIGRATIONS = server_migrations("agent.leader", COMPONENT)
    WHAT = "message store"

    def __init__(self, conn: Connection | sqlite3.Connection, *, clock: Clock, path: str,
                 max_bytes_per_device: int = MAX_BYTES_PER_DEVICE, crash_classes: frozenset[str] = frozenset()) -> None:
        super().__init__(conn, path=path)
        self.crash_classes = crash_classes  # classes of durability "crash": their commits are not synced
        self._clock = clock
        self._budget = max_bytes_per_device
        self.trimmed = 0  # rows deleted to keep a device within its budget

    @classmethod
    def open(cls, path: str | Path | ServerUrl, *, clock: Clock, synchronous: Synchronous = "FULL",
             max_bytes_per_device: int = MAX_BYTES_PER_DEVICE,
             crash_classes: frozenset[str] = frozenset()) -> MessageLog:
        conn = cls.connect_target(path, synchronous=synchronous)
        return cls(conn, clock=clock, path=str(path), max_bytes_per_device=max_bytes_per_device,
                   crash_classes=crash_classes)

    def known(self, msg_ids: Sequence[str]) -> set[str]:
        """Which of `msg_ids` are stored already (a redelivery)."""
        self.check_open()
        found: set[str] = set()
        for start in range(0, len(msg_ids), 500):
            chunk = list(msg_ids[start:start + 500])
            marks = ", ".join("?" * len(chunk))
            found.update(r[0] for r in self._conn.execute(
                f"SELECT msg_id FROM app_messages WHERE msg_id IN ({marks})", chunk))
        return found

    def apply_batch(self, batch: Sequence[tuple[str, AppMessage]]) -> list[bool]:
        """Store (envelope id, message) pairs in one transaction; per pair, True if it was new
        (stored, or replaced an older value of its key), False for a duplicate or stale one. The
        commit is synced (it survives a power cut) unless every message is of a "crash" class."""
        self.check_open()
        now = self._clock.now_ms()
        out = [False] * len(batch)
        grown: dict[str, int] = {}
        execute = self._conn.execute
        crash = self.crash_classes
        # By device (a device's own in batch order). On PostgreSQL several leaders may store one
        # device's messages at once (a redelivery, or an OVERWRITE key's next value through another
        # leader): a lock per device, taken in this order, makes each see the other's commit first.
        order = sorted(range(len(batch)), key=lambda i: batch[i][1].device_id)
        locked: set[str] = set()
        with self.atomic(synced=not (crash and all(m.cls in crash for _, m in batch))):
            for i in order:
                msg_id, m = batch[i]
                if self.on_server and m.device_id not in locked:
                    execute("SELECT pg_advisory_xact_lock(?, hashtext(?))", (_DEVICE_LOCKS, m.device_id))
                    locked.add(m.device_id)
                if execute("SELECT 1 FROM app_messages WHERE msg_id = ?", (msg_id,)).fetchone() is not None:
                    continue
                size = len(m.payload)
                freed = 0
                if m.overwrite and m.key is not None:
                    old = execute("SELECT id, seq, size FROM app_messages WHERE device_id = ? AND class = ?"
                                  " AND key = ? AND overwrite = 1", (m.device_id, m.cls, m.key)).fetchone()
                    if old is not None:
                        if m.seq <= old[1]:
                            continue
                        execute("DELETE FROM app_messages WHERE id = ?", (old[0],))
                        freed = int(old[2])
                execute(
                    "INSERT INTO app_messages (msg_id, device_id, class, key, overwrite, seq, ts_ms, received_ms,"
                    " content_type, size, payload) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (msg_id, m.device_id, m.cls, m.key, 1 if m.overwrite else 0, m.seq, m.ts_ms, now,
                     m.content_type, size, m.payload),
                )
                grown[m.device_id] = grown.get(m.device_id, 0) + size - freed
                out[i] = True
            for device, delta in sorted(grown.items()):
                (used,) = execute(
                    "INSERT INTO app_message_usage (device_id, bytes) VALUES (?, ?) ON CONFLICT (device_id)"
                    " DO UPDATE SET bytes = app_message_usage.bytes + excluded.bytes RETURNING bytes",
                    (device, delta)).fetchone()
                if used > self._budget:
                    self._trim(device, int(used) - self._budget)
        return out

    def _trim(self, device: str, over: int) -> None:
        """Delete `device`'s oldest rows until it is back within its budget."""
        freed = 0
        victims: list[int] = []
        for rid, size in self._conn.execute(
                "SELECT id, size FROM app_messages WHERE device_id = ? ORDER BY id", (device,)):
            victims.append(int(rid))
            freed += int(size)
            if freed >= over:
                break
        self._conn.executemany("DELETE FROM app_messages WHERE id = ?", [(v,) for v in victims])
        self._conn.execute("UPDATE app_message_usage SET bytes = bytes - ? WHERE device_id = ?", (freed, device))
        self.trimmed += len(victims)

    def prune(self, retention_s: float, *, limit: int) -> int:
        """Delete up to `limit` rows received more than `retention_s` ago; returns how many."""
        self.check_open()
        cutoff = self._clock.now_ms() - int(retention_s * 1000)
        with self.atomic():
            gone = self._conn.execute(
                "DELETE FROM app_messages WHERE id IN (SELECT id FROM app_messages WHERE received_ms < ?"
                " ORDER BY received_ms LIMIT ?) RETURNING device_id, size", (cutoff, limit)).fetchall()
            freed: dict[str, int] = {}
            for device, size in gone:
                freed[device] = freed.get(device, 0) + int(size)
            self._conn.executemany("UPDATE app_message_usage SET bytes = bytes - ? WHERE device_id = ?",
                                   [(n, d) for d, n in freed.items()])
        return len(gone)

    def count(self, device_id: str | None = None, cls: str | None = None) -> int:
        self.check_open()
        where, args = _filters(device_id, cls)
        return int(self._conn.execute(f"SELECT count(*) FROM app_messages{where}", args).fetchone()[0])


def payload_fields(content_type: str, payload: bytes) -> dict[str, object]:
    """A message's payload for a JSON document: `payload` (the value itself) when it is JSON,
    else `payload_base64`."""
    if content_type.split(";")[0].strip() == "application/json":
        try:
            return {"payload": json.loads(payload)}
        except ValueError:
            pass
    return {"payload_base64": base64.b64encode(payload).decode()}


def _filters(device_id: str | None, cls: str | None) -> tuple[str, list[object]]:
    clauses: list[str] = []
    args: list[object] = []
    if device_id is not None:
        clauses.append("device_id = ?")
        args.append(device_id)
    if cls is not None:
        clauses.append("class = ?")
        args.append(cls)
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), args


def read_messages(db_path: str | Path, *, device_id: str | None = None, cls: str | None = None,
                  limit: int = 100, after_id: int = 0, newest: bool = False) -> tuple[int, list[StoredMessage]]:
    """(how many match, up to `limit` of them) from the leader database opened read-only:
    oldest first after `after_id`, or the newest `limit` (still shown oldest first)."""
    conn = MessageLog.connect_reader(db_path)
    try:
        where, args = _filters(device_id, cls)
        total = int(conn.execute(f"SELECT count(*) FROM app_messages{where}", args).fetchone()[0])
        columns = ("id, msg_id, device_id, class, key, overwrite, seq, ts_ms, received_ms, content_type,"
                   " payload FROM app_messages")
        if newest:
            rows = conn.execute(f"SELECT {columns}{where} ORDER BY id DESC LIMIT ?", (*args, limit)).fetchall()
            rows.reverse()
        else:
            clause = f"{where} AND id > ?" if where else " WHERE id > ?"
            rows = conn.execute(f"SELECT {columns}{clause} ORDER BY id LIMIT ?", (*args, after_id, limit)).fetchall()
    except sqlite3.Error as exc:
        raise StoreError(f"{db_path}: cannot read the message store: {exc}") from exc
    finally:
        conn.close()
    return total, [StoredMessage(int(r[0]), str(r[1]), str(r[2]), str(r[3]), r[4], bool(r[5]), int(r[6]),
                                 int(r[7]), int(r[8]), str(r[9]), bytes(r[10])) for r in rows]


__all__ = ["MAX_BYTES_PER_DEVICE", "MessageLog", "StoredMessage", "payload_fields", "read_messages"]
