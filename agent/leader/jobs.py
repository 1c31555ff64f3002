"""The leader's durable work-pulling job queue.

Model (after the work-pulling pattern: one producer, a dynamic pool of uniform workers):

* `submit(job)` stores a job durably, idempotent by `job_id`: the first write wins, a repeat
  returns the stored job and appends nothing. A stored job is *accepted*: it will be confirmed.
* Workers register with a demand window (`JobDemand`): the most unconfirmed jobs they hold at
  once, at most `window_max`. `dispatch()` hands pending jobs round-robin to workers with free
  demand and returns the offers to send; holding a job is kept in memory only (a restart
  re-dispatches everything unconfirmed anyway).
* A job is confirmed only by a worker's `JobResult`, exactly once: the confirming UPDATE is
  guarded by `state = 'pending'`; a duplicate result is acknowledged and changes nothing.
* A lost worker (presence offline / last will, heartbeat deadline, a new incarnation, or a
  protocol violation) ends its binding: its unconfirmed jobs go back to the HEAD of the pending
  pool with their original ids and are offered to another worker. A violation ends only the
  offending worker's binding. A violation is: a result for a job the worker was never offered
  in this epoch (or an unknown job), or a demand window above `window_max`. A late result from
  a worker that *was* offered the job (it was presumed lost, or the job moved on) confirms it:
  the work was done, and the current holder's later result is then a duplicate.
* Epoch fencing: opening the queue takes a new epoch (persisted, incremented) in one
  transaction. Every offer carries it; a result carrying another epoch is refused
  (`stale_epoch`); every write re-reads the stored epoch inside its transaction and raises
  `QueueFenced` if a newer incarnation has opened the same database since. After a restart all
  accepted, unconfirmed jobs are reloaded in submission order and dispatched again. Workers
  deduplicate by job id (their ledger), so a job redone after a restart has its effect once.

Threading choice: synchronous, called on the event loop. Dispatch and requeue touch memory
only; `submit` and `result` are each one short transaction (WAL, `synchronous=NORMAL`: no fsync
per commit). sqlite3 errors never leave this module (`StoreError`).
"""

from __future__ import annotations

import sqlite3
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agent.core.clock import Clock
from agent.core.errors import StoreError
from agent.core.sqlite import Synchronous, atomic, close_quietly, connect, migrate, store_errors
from agent.protocol import JobDemand, JobOffer, JobResult, JobSubmit

COMPONENT = "jobqueue"

SubmitOutcome = Literal["stored", "duplicate"]
DemandOutcome = Literal["registered", "updated", "replaced", "violation"]
ResultOutcome = Literal["confirmed", "duplicate", "stale_epoch", "violation"]


class QueueFenced(StoreError):
    """A newer incarnation of the queue owns the database; this one must stop."""


def _v1(conn: sqlite3.Connection) -> None:
    conn.execute(
        """CREATE TABLE jobs (
            store_seq INTEGER PRIMARY KEY AUTOINCREMENT,
            job_id TEXT NOT NULL UNIQUE,
            kind TEXT NOT NULL,
            payload BLOB NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('pending', 'confirmed')),
            submitted_ms INTEGER NOT NULL,
            submit_epoch INTEGER NOT NULL,
            confirmed_ms INTEGER,
            confirm_epoch INTEGER,
            confirmed_by TEXT,
            ok INTEGER,
            result BLOB,
            error TEXT
        )"""
    )
    conn.execute("CREATE INDEX jobs_pending ON jobs(store_seq) WHERE state = 'pending'")
    conn.execute("CREATE INDEX jobs_confirmed ON jobs(confirmed_ms) WHERE state = 'confirmed'")
    conn.execute(
        "CREATE TABLE jobqueue_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID"
    )


_MIGRATIONS = (_v1,)


@dataclass(frozen=True, slots=True)
class SubmitResult:
    outcome: SubmitOutcome
    job_id: str
    store_seq: int


@dataclass(frozen=True, slots=True)
class ResultAck:
    """What `result()` did. `requeued`: jobs released by a violation (already at the head)."""

    outcome: ResultOutcome
    job_id: str
    requeued: tuple[str, ...] = ()
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Send `offer` to `worker`."""

    worker: str
    offer: JobOffer


@dataclass(frozen=True, slots=True)
class JobRecord:
    job_id: str
    store_seq: int
    kind: str
    payload: bytes
    state: Literal["pending", "confirmed"]
    submitted_ms: int
    confirmed_ms: int | None
    confirmed_by: str | None
    ok: bool | None
    result: bytes | None
    error: str | None


@dataclass(frozen=True, slots=True)
class QueueStats:
    epoch: int
    pending: int  # waiting for a worker
    in_flight: int  # held by a worker, unconfirmed
    workers: int
    free_demand: int
    submitted: int  # this incarnation
    confirmed: int  # this incarnation
    requeued: int  # this incarnation
    violations: int  # this incarnation


@dataclass(slots=True)
class _Job:
    kind: str
    payload: bytes
    offered: set[str] = field(default_factory=set)  # workers offered this job in this epoch


@dataclass(eq=False, slots=True)
class _Binding:
    worker: str
    incarnation: str
    window: int
    held: dict[str, None] = field(default_factory=dict)  # insertion = dispatch order
    ended: bool = False
    in_ring: bool = False

    @property
    def free(self) -> int:
        return self.window - len(self.held)


class JobQueue:
    """Open with `JobQueue.open(path, clock=...)`; one open queue per database is the writer."""

    def __init__(self, conn: sqlite3.Connection, *, clock: Clock, epoch: int, window_max: int,
                 path: str) -> None:
        self._conn = conn
        self._clock = clock
        self.epoch = epoch
        self.window_max = window_max
        self.path = path
        self._closed = False
        self._fenced = False
        self._jobs: dict[str, _Job] = {}  # every accepted, unconfirmed job
        self._pending: deque[str] = deque()  # head = left; may hold ids no longer queued
        self._queued: set[str] = set()  # ids really waiting in `_pending`
        self._holder: dict[str, _Binding] = {}
        self._workers: dict[str, _Binding] = {}
        self._ring: deque[_Binding] = deque()  # bindings with free demand, round-robin order
        self._submitted = self._confirmed = self._requeued = self._violations = 0

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        clock: Clock,
        window_max: int = 64,
        synchronous: Synchronous = "NORMAL",
    ) -> JobQueue:
        """Open the queue, take a new epoch and reload every accepted, unconfirmed job."""
        if window_max < 1:
            raise ValueError("window_max must be >= 1")
        conn = connect(path, synchronous=synchronous)
        try:
            migrate(conn, COMPONENT, _MIGRATIONS)
            with atomic(conn):
                row = conn.execute("SELECT value FROM jobqueue_meta WHERE key = 'epoch'").fetchone()
                epoch = (int(row[0]) if row else 0) + 1
                conn.execute(
                    "INSERT INTO jobqueue_meta(key, value) VALUES ('epoch', ?)"
                    " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (epoch,),
                )
                rows = conn.execute(
                    "SELECT job_id, kind, payload FROM jobs WHERE state = 'pending'"
                    " ORDER BY store_seq"
                ).fetchall()
        except BaseException:
            close_quietly(conn)
            raise
        queue = cls(conn, clock=clock, epoch=epoch, window_max=window_max, path=str(path))
        for job_id, kind, payload in rows:
            queue._jobs[job_id] = _Job(kind, bytes(payload))
            queue._pending.append(job_id)
            queue._queued.add(job_id)
        return queue

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            close_quietly(self._conn)

    def __enter__(self) -> JobQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- durable writes --------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise StoreError("job queue is closed")
        if self._fenced:
            raise QueueFenced(f"job queue epoch {self.epoch} was fenced by a newer incarnation")

    def _fence(self) -> None:
        """Inside a write transaction: refuse if a newer incarnation took the database."""
        row = self._conn.execute("SELECT value FROM jobqueue_meta WHERE key = 'epoch'").fetchone()
        stored = int(row[0]) if row else 0
        if stored != self.epoch:
            self._fenced = True
            raise QueueFenced(f"job queue epoch {self.epoch} was fenced by epoch {stored}")

    def submit(self, job: JobSubmit) -> SubmitResult:
        """Store `job` unless its id is known (first write wins)."""
        return self.submit_many([job])[0]

    def submit_many(self, jobs: Sequence[JobSubmit]) -> list[SubmitResult]:
        """Store several jobs in one transaction, in order."""
        self._check()
        now = self._clock.now_ms()
        results: list[SubmitResult] = []
        stored: list[JobSubmit] = []
        with atomic(self._conn):
            self._fence()
            for job in jobs:
                cur = self._conn.execute(
                    "INSERT INTO jobs (job_id, kind, payload, state, submitted_ms, submit_epoch)"
                    " VALUES (?, ?, ?, 'pending', ?, ?) ON CONFLICT (job_id) DO NOTHING",
                    (job.job_id, job.kind, job.payload, now, self.epoch),
                )
                if cur.rowcount > 0:
                    results.append(SubmitResult("stored", job.job_id, int(cur.lastrowid or 0)))
                    stored.append(job)
                else:
                    row = self._conn.execute(
                        "SELECT store_seq FROM jobs WHERE job_id = ?", (job.job_id,)
                    ).fetchone()
                    results.append(SubmitResult("duplicate", job.job_id, int(row[0])))
        for job in stored:
            self._jobs[job.job_id] = _Job(job.kind, job.payload)
            self._pending.append(job.job_id)
            self._queued.add(job.job_id)
        self._submitted += len(stored)
        return results

    def result(self, result: JobResult) -> ResultAck:
        """Apply a worker's result; see the module docstring for the outcomes."""
        self._check()
        job_id, worker = result.job_id, result.worker
        if result.epoch != self.epoch:
            return ResultAck("stale_epoch", job_id, reason=f"epoch {result.epoch} != {self.epoch}")
        job = self._jobs.get(job_id)
        if job is None:
            if self._state_of(job_id) == "confirmed":
                return ResultAck("duplicate", job_id)
            return self._violation(worker, job_id, "result for an unknown job")
        if worker not in job.offered:
            return self._violation(worker, job_id, "result for a job it was not offered")
        now = self._clock.now_ms()
        with atomic(self._conn):
            self._fence()
            cur = self._conn.execute(
                "UPDATE jobs SET state = 'confirmed', confirmed_ms = ?, confirm_epoch = ?,"
                " confirmed_by = ?, ok = ?, result = ?, error = ?"
                " WHERE job_id = ? AND state = 'pending'",
                (now, self.epoch, worker, int(result.ok), result.result, result.error, job_id),
            )
            if cur.rowcount != 1:
                raise StoreError(f"job {job_id!r} is unconfirmed in memory but not in the database")
        del self._jobs[job_id]
        self._queued.discard(job_id)
        holder = self._holder.pop(job_id, None)
        if holder is not None:
            holder.held.pop(job_id, None)
            self._offer_demand(holder)
        self._confirmed += 1
        return ResultAck("confirmed", job_id)

    def _state_of(self, job_id: str) -> str | None:
        with store_errors("read job"):
            row = self._conn.execute("SELECT state FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return None if row is None else str(row[0])

    # -- workers (memory only) -------------------------------------------------------------
    def demand(self, demand: JobDemand) -> DemandOutcome:
        """Register or re-register a worker's demand window."""
        self._check()
        if demand.window > self.window_max:
            self._violation(demand.worker, "", f"window {demand.window} > {self.window_max}")
            return "violation"
        binding = self._workers.get(demand.worker)
        if binding is not None and binding.incarnation == demand.incarnation:
            binding.window = demand.window
            self._offer_demand(binding)
            return "updated"
        outcome: DemandOutcome = "registered"
        if binding is not None:
            self._end(binding)
            outcome = "replaced"
        binding = _Binding(demand.worker, demand.incarnation, demand.window)
        self._workers[demand.worker] = binding
        self._offer_demand(binding)
        return outcome

    def lose_worker(self, worker: str) -> list[str]:
        """End `worker`'s binding (lost); its unconfirmed jobs go to the head of the pool."""
        self._check()
        binding = self._workers.get(worker)
        return [] if binding is None else self._end(binding)

    def dispatch(self) -> list[Dispatch]:
        """Offer pending jobs round-robin to workers with free demand; the offers to send."""
        self._check()
        out: list[Dispatch] = []
        while self._queued and self._ring:
            binding = self._ring.popleft()
            if binding.ended or binding.free <= 0:
                binding.in_ring = False
                continue
            job_id = self._next_pending()
            job = self._jobs[job_id]
            binding.held[job_id] = None
            self._holder[job_id] = binding
            job.offered.add(binding.worker)
            out.append(Dispatch(binding.worker, JobOffer(
                job_id=job_id, epoch=self.epoch, kind=job.kind, payload=job.payload)))
            if binding.free > 0:
                self._ring.append(binding)
            else:
                binding.in_ring = False
        return out

    def held_by(self, worker: str) -> list[JobOffer]:
        """The offers `worker` holds unconfirmed, in dispatch order (to resend them)."""
        binding = self._workers.get(worker)
        if binding is None:
            return []
        return [JobOffer(job_id=j, epoch=self.epoch, kind=self._jobs[j].kind,
                         payload=self._jobs[j].payload) for j in binding.held]

    def holder_of(self, job_id: str) -> str | None:
        binding = self._holder.get(job_id)
        return None if binding is None else binding.worker

    def workers(self) -> dict[str, int]:
        """Bound workers and their windows."""
        return {w: b.window for w, b in self._workers.items()}

    def pending_ids(self) -> list[str]:
        """Job ids waiting for a worker, head first."""
        return [j for j in dict.fromkeys(self._pending) if j in self._queued]

    def _next_pending(self) -> str:
        while True:
            job_id = self._pending.popleft()
            if job_id in self._queued:
                self._queued.discard(job_id)
                return job_id

    def _offer_demand(self, binding: _Binding) -> None:
        if not binding.ended and not binding.in_ring and binding.free > 0:
            binding.in_ring = True
            self._ring.append(binding)

    def _end(self, binding: _Binding) -> list[str]:
        binding.ended = True
        if self._workers.get(binding.worker) is binding:
            del self._workers[binding.worker]
        released = list(binding.held)
        binding.held.clear()
        for job_id in released:
            self._holder.pop(job_id, None)
        self._requeue_head(released)
        return released

    def _requeue_head(self, job_ids: Iterable[str]) -> None:
        fresh = [j for j in job_ids if j in self._jobs and j not in self._queued]
        self._pending.extendleft(reversed(fresh))
        self._queued.update(fresh)
        self._requeued += len(fresh)

    def _violation(self, worker: str, job_id: str, reason: str) -> ResultAck:
        self._violations += 1
        binding = self._workers.get(worker)
        released = tuple(self._end(binding)) if binding is not None else ()
        return ResultAck("violation", job_id, released, reason)

    # -- reads -----------------------------------------------------------------------------
    def job(self, job_id: str) -> JobRecord | None:
        self._check()
        with store_errors("read job"):
            row = self._conn.execute(
                "SELECT job_id, store_seq, kind, payload, state, submitted_ms, confirmed_ms,"
                " confirmed_by, ok, result, error FROM jobs WHERE job_id = ?",
                (job_id,),
            ).fetchone()
        if row is None:
            return None
        return JobRecord(
            job_id=row[0], store_seq=row[1], kind=row[2], payload=bytes(row[3]), state=row[4],
            submitted_ms=row[5], confirmed_ms=row[6], confirmed_by=row[7],
            ok=None if row[8] is None else bool(row[8]),
            result=None if row[9] is None else bytes(row[9]), error=row[10],
        )

    def counts(self) -> dict[str, int]:
        """Jobs in the database by state: {'pending': n, 'confirmed': m}."""
        self._check()
        with store_errors("count jobs"):
            rows = self._conn.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        out = {"pending": 0, "confirmed": 0}
        out.update({str(state): int(n) for state, n in rows})
        return out

    def stats(self) -> QueueStats:
        return QueueStats(
            epoch=self.epoch,
            pending=len(self._queued),
            in_flight=len(self._holder),
            workers=len(self._workers),
            free_demand=sum(max(0, b.free) for b in self._workers.values()),
            submitted=self._submitted,
            confirmed=self._confirmed,
            requeued=self._requeued,
            violations=self._violations,
        )

    def prune_confirmed(self, older_than_s: float) -> int:
        """Delete confirmed jobs older than `older_than_s`. A pruned id could be submitted (and
        run) again, so keep confirmed jobs longer than any submitter may retry."""
        self._check()
        cutoff = self._clock.now_ms() - int(older_than_s * 1000)
        with atomic(self._conn):
            self._fence()
            cur = self._conn.execute(
                "DELETE FROM jobs WHERE state = 'confirmed' AND confirmed_ms < ?", (cutoff,)
            )
        return cur.rowcount


__all__ = [
    "COMPONENT",
    "DemandOutcome",
    "Dispatch",
    "JobQueue",
    "JobRecord",
    "QueueFenced",
    "QueueStats",
    "ResultAck",
    "ResultOutcome",
    "SubmitOutcome",
    "SubmitResult",
]
