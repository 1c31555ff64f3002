"""Worker side of work-pulling jobs: a durable ledger of done jobs, and demand-window accounting.

A job can reach a worker more than once: the leader re-offers unconfirmed jobs after a restart
(new epoch), after presuming the worker lost, or because an offer was redelivered. The
`JobLedger` makes the job's *effect* happen once: `complete()` commits the job id, its outcome
and the job's own writes (through `LedgerTransaction`) in one SQLite transaction. A job found in
the ledger is answered from it (`result_message()`, stamped with the newest offer's epoch) and
never run again.

`DemandWindow` is the in-memory accounting of the worker's window: which jobs are running, the
newest epoch each was offered under, and how much demand is free.

Threading choice: synchronous (one short transaction per completed job, WAL with
`synchronous=NORMAL` unless the caller asks for FULL). sqlite3 errors never leave this module.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from agent.core.clock import Clock
from agent.core.sqlite import Synchronous, atomic, store_errors
from agent.core.store import Store
from agent.protocol import JobDemand, JobOffer, JobResult

COMPONENT = "jobledger"

Admission = Literal["run", "running", "over_window"]


def _v1(conn: sqlite3.Connection) -> None:
    conn.execute(
        """CREATE TABLE job_ledger (
            job_id TEXT PRIMARY KEY,
            ok INTEGER NOT NULL,
            result BLOB NOT NULL,
            error TEXT NOT NULL,
            done_ms INTEGER NOT NULL
        ) WITHOUT ROWID"""
    )
    conn.execute("CREATE INDEX job_ledger_done ON job_ledger(done_ms)")


_MIGRATIONS = (_v1,)


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    job_id: str
    ok: bool
    result: bytes
    error: str
    done_ms: int


class LedgerTransaction:
    """The job's own writes, committed with its ledger entry. SQL errors become `StoreError`
    (and roll the whole completion back)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with store_errors("job effect"):
            return self._conn.execute(sql, tuple(params)).fetchall()


Effect = Callable[[LedgerTransaction], None]


class JobLedger(Store):
    """Open with `JobLedger.open(path, clock=...)` (the worker's database may be shared)."""

    COMPONENT = COMPONENT
    MIGRATIONS = _MIGRATIONS
    WHAT = "job ledger"

    def __init__(self, conn: sqlite3.Connection, *, clock: Clock, path: str) -> None:
        super().__init__(conn, path=path)
        self._clock = clock

    @classmethod
    def open(cls, path: str | Path, *, clock: Clock,
             synchronous: Synchronous = "FULL") -> JobLedger:
        return cls(cls.connect_migrated(path, synchronous=synchronous), clock=clock, path=str(path))

    def lookup(self, job_id: str) -> LedgerEntry | None:
        """The recorded outcome of a job done before, or None."""
        self.check_open()
        with store_errors("read job ledger"):
            row = self._conn.execute(
                "SELECT job_id, ok, result, error, done_ms FROM job_ledger WHERE job_id = ?",
                (job_id,),
            ).fetchone()
        if row is None:
            return None
        return LedgerEntry(row[0], bool(row[1]), bytes(row[2]), row[3], row[4])

    def complete(
        self,
        job_id: str,
        *,
        ok: bool,
        result: bytes = b"",
        error: str = "",
        effect: Effect | None = None,
    ) -> bool:
        """Record a finished job and run `effect` in the same transaction.

        Returns False (and runs nothing) when the job id is already recorded. If `effect`
        raises, nothing is recorded and the exception propagates.
        """
        self.check_open()
        with atomic(self._conn):
            cur = self._conn.execute(
                "INSERT INTO job_ledger (job_id, ok, result, error, done_ms) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (job_id) DO NOTHING",
                (job_id, int(ok), result, error, self._clock.now_ms()),
            )
            if cur.rowcount == 0:
                return False
            if effect is not None:
                effect(LedgerTransaction(self._conn))
        return True

    def result_message(self, job_id: str, *, epoch: int, worker: str) -> JobResult | None:
        """The `JobResult` to send for a recorded job, stamped with `epoch`; None if not done."""
        entry = self.lookup(job_id)
        if entry is None:
            return None
        return JobResult(job_id=job_id, epoch=epoch, worker=worker, ok=entry.ok,
                         result=entry.result, error=entry.error)

    def prune(self, older_than_s: float, *, limit: int | None = None) -> int:
        """Forget jobs finished more than `older_than_s` ago, oldest first, at most `limit` in
        this one transaction; how many were forgotten. A forgotten job offered again runs
        again, so keep entries longer than the leader may re-offer them: its downtime plus how
        long our result can wait in the outbox (see `agent.housekeeping`)."""
        self.check_open()
        cutoff = self._clock.now_ms() - int(older_than_s * 1000)
        with store_errors("prune job ledger"):
            if self._conn.execute(
                "SELECT 1 FROM job_ledger WHERE done_ms < ? LIMIT 1", (cutoff,)
            ).fetchone() is None:
                return 0  # nothing due: no write transaction (an idle worker writes nothing)
        with atomic(self._conn):
            cur = self._conn.execute(
                "DELETE FROM job_ledger WHERE job_id IN (SELECT job_id FROM job_ledger"
                " WHERE done_ms < ? ORDER BY done_ms LIMIT ?)",
                (cutoff, -1 if limit is None else max(0, limit)),
            )
        return cur.rowcount

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Read the worker's own tables (the ones job effects write) outside a completion."""
        self.check_open()
        with store_errors("query"):
            return self._conn.execute(sql, tuple(params)).fetchall()

    def count(self) -> int:
        self.check_open()
        with store_errors("count job ledger"):
            return int(self._conn.execute("SELECT COUNT(*) FROM job_ledger").fetchone()[0])


class DemandWindow:
    """How many jobs this worker runs at once, and which.

    `admit(offer)` says what to do with an offer the ledger does not know yet: `run` it (a
    slot was taken), it is already `running` (the newest epoch is remembered so the result is
    stamped with it), or `over_window` (answer busy: the leader sent more than asked for).
    """

    def __init__(self, window: int, *, worker: str, incarnation: str) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._window = window
        self.worker = worker
        self.incarnation = incarnation
        self._running: dict[str, int] = {}

    @property
    def window(self) -> int:
        return self._window

    @property
    def free(self) -> int:
        return max(0, self._window - len(self._running))

    @property
    def running(self) -> tuple[str, ...]:
        return tuple(self._running)

    def resize(self, window: int) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._window = window

    def admit(self, offer: JobOffer) -> Admission:
        if offer.job_id in self._running:
            self._running[offer.job_id] = max(self._running[offer.job_id], offer.epoch)
            return "running"
        if len(self._running) >= self._window:
            return "over_window"
        self._running[offer.job_id] = offer.epoch
        return "run"

    def finish(self, job_id: str) -> int:
        """Release a job's slot; the newest epoch it was offered under (stamp the result).

        Raises `KeyError` for a job that is not running (a bug in the caller).
        """
        return self._running.pop(job_id)

    def demand(self) -> JobDemand:
        """The registration to send to the leader (at start, and periodically)."""
        return JobDemand(worker=self.worker, incarnation=self.incarnation, window=self._window)


__all__ = [
    "COMPONENT",
    "Admission",
    "DemandWindow",
    "Effect",
    "JobLedger",
    "LedgerEntry",
    "LedgerTransaction",
]
