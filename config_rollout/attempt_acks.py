"""Operators' acknowledgements of configuration attempts that did not commit, in the leader's
database (component "config_attempt_acks"): its `leader.db`, or the fleet's PostgreSQL when its
leaders share one.

A device that reverted an apply holds what it held before, in sync; how its newest attempt ended
("rolled_back", "failed") is said beside, and counted as `last_attempt_failed`, until an operator
acknowledges that attempt (`edge-agent config acknowledge`, the console's button). The
acknowledgement names the attempt it saw: its number on the device (`ConfigState.attempt`), how
it ended and the version the device held after it. The device's next attempt has another
number, so a new failure is counted again without anyone clearing anything.

    config_attempt_acks   (device, target, attempt) -> how it ended, the version held, who
                          acknowledged it and when (the audit trail reads it too)
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from agent.core.backends import server_migrations
from agent.core.sql import Connection, StoreTarget, dialect_of, has_table
from agent.core.sqlite import Synchronous, store_errors
from agent.core.store import Store
from agent.protocol import ConfigState


def _v1(conn: sqlite3.Connection) -> None:
    conn.execute(
        """CREATE TABLE config_attempt_acks (
            device_id TEXT NOT NULL,
            target TEXT NOT NULL,
            attempt INTEGER NOT NULL,
            outcome TEXT NOT NULL,
            version TEXT NOT NULL,
            acknowledged_by TEXT NOT NULL,
            at_ms INTEGER NOT NULL,
            PRIMARY KEY (device_id, target, attempt)
        )"""
    )
    conn.execute("CREATE INDEX config_attempt_acks_at ON config_attempt_acks(at_ms)")


@dataclass(frozen=True)
class AttemptAck:
    """One operator's acknowledgement of one device's attempt at one target."""

    device_id: str
    target: str
    attempt: int
    outcome: str  # "rolled_back" or "failed", as the device stated it
    version: str  # what the device held after it
    by: str
    at_ms: int

    def covers(self, state: ConfigState) -> bool:
        """Whether this is the acknowledgement of the attempt `state` says ended so."""
        return (self.attempt, self.outcome, self.version) == (state.attempt, state.last_attempt, state.version)


#: (device, target) -> the newest acknowledgement of an attempt there
Acks = Mapping[tuple[str, str], AttemptAck]


def open_attempt(state: ConfigState, ack: AttemptAck | None) -> str:
    """How the device's newest attempt at the target ended when it did not commit and nobody
    acknowledged it ("rolled_back", "failed"); "" otherwise. The one reading every view counts."""
    return "" if ack is not None and ack.covers(state) else state.last_attempt


def acknowledged(state: ConfigState, ack: AttemptAck | None) -> AttemptAck | None:
    """`ack` when it acknowledges the attempt `state` says did not commit (else None)."""
    return ack if ack is not None and state.last_attempt and ack.covers(state) else None


_ATTEMPT_SAID = {"rolled_back": "its last attempt was rolled back", "failed": "its last attempt failed"}


def attempt_said(state: ConfigState, ack: AttemptAck | None) -> str:
    """The attempt beside what the target holds, in words ("" when it committed): `status` and
    `config diff` print it, the console's pages say the same."""
    if not state.last_attempt:
        return ""
    seen = acknowledged(state, ack)
    return _ATTEMPT_SAID[state.last_attempt] + (f"; acknowledged by {seen.by}" if seen is not None else "")


_COLUMNS = "device_id, target, attempt, outcome, version, acknowledged_by, at_ms"


def _ack(row: tuple[object, ...]) -> AttemptAck:
    device, target, attempt, outcome, version, by, at = row
    return AttemptAck(str(device), str(target), int(str(attempt)), str(outcome), str(version), str(by), int(str(at)))


class AttemptAckReads:
    """The acknowledgements' reads, on any connection to the leader's database (a read-only one
    for the views); a database where nobody acknowledged anything yet has none."""

    def __init__(self, conn: Connection | sqlite3.Connection) -> None:
        self._conn = conn
        self.present = bool(int(conn.execute(has_table(dialect_of(conn), "config_attempt_acks")).fetchone()[0]))

    def newest(self, devices: Collection[str] | None = None) -> dict[tuple[str, str], AttemptAck]:
        """(device, target) -> its newest acknowledgement (of the devices named, or all)."""
        if not self.present:
            return {}
        with store_errors("configuration attempts acknowledged"):
            if devices is None:
                rows = self._conn.execute(f"SELECT {_COLUMNS} FROM config_attempt_acks").fetchall()
            else:
                rows = [r for d in sorted(set(devices)) for r in self._conn.execute(
                    f"SELECT {_COLUMNS} FROM config_attempt_acks WHERE device_id = ?", (d,)).fetchall()]
        found: dict[tuple[str, str], AttemptAck] = {}
        for ack in map(_ack, rows):
            held = found.get((ack.device_id, ack.target))
            if held is None or ack.attempt > held.attempt:
                found[(ack.device_id, ack.target)] = ack
        return found

    def since(self, since_ms: int = 0, *, limit: int = 1000) -> list[AttemptAck]:
        """The acknowledgements made since `since_ms`, oldest first (the audit trail)."""
        if not self.present:
            return []
        with store_errors("configuration attempts acknowledged"):
            return [_ack(r) for r in self._conn.execute(
                f"SELECT {_COLUMNS} FROM config_attempt_acks WHERE at_ms >= ? ORDER BY at_ms, device_id, target"
                " LIMIT ?", (since_ms, limit)).fetchall()]


class AttemptAckStore(Store):
    """The acknowledgements' writes, on the leader's database."""

    COMPONENT = "config_attempt_acks"
    MIGRATIONS = (_v1,)
    SERVER_MIGRATIONS = server_migrations("config_rollout", COMPONENT)
    WHAT = "the acknowledged configuration attempts"

    @classmethod
    def open(cls, target: StoreTarget | str, *, synchronous: Synchronous = "FULL") -> AttemptAckStore:
        """The acknowledgements in `target`: a leader's `leader.db`, or the fleet's PostgreSQL."""
        return cls(cls.connect_target(target, synchronous=synchronous), path=target)

    def acknowledge(self, device_id: str, target: str, state: ConfigState, *, by: str, now_ms: int) -> AttemptAck:
        """Acknowledge the attempt `state` (the device's, as the registry holds it) says did not
        commit; the acknowledgement on record (one of the same attempt number before is replaced)."""
        self.check_open()
        ack = AttemptAck(device_id, target, state.attempt, state.last_attempt, state.version, by[:256], now_ms)
        with self.atomic(), store_errors(f"{self.path}: acknowledge a configuration attempt"):
            self._conn.execute(
                f"INSERT INTO config_attempt_acks ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (device_id, target, attempt) DO UPDATE SET outcome = excluded.outcome,"
                " version = excluded.version, acknowledged_by = excluded.acknowledged_by, at_ms = excluded.at_ms",
                (ack.device_id, ack.target, ack.attempt, ack.outcome, ack.version, ack.by, ack.at_ms))
        return ack

    def reads(self) -> AttemptAckReads:
        self.check_open()
        return AttemptAckReads(self._conn)


__all__ = ["Acks", "AttemptAck", "AttemptAckReads", "AttemptAckStore", "acknowledged", "attempt_said", "open_attempt"]
