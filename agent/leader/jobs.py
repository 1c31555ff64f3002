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
  pool with their original ids and are offered to another worker. The head of the pool is
  every released job not yet offered again, oldest submission first, ahead of the jobs never
  offered: losing workers one by one or all at once (`lose_workers`, O(workers + their jobs
  log jobs)) gives the same order. A violation ends only the
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

Several leaders (`[leader] database = "postgresql://..."`): the queue's tables are in the fleet's
PostgreSQL database and one leader runs the queue at a time, the holder of its lease (a row
whose expiry is in the server's time, renewed by `hold()`). Taking the lease is opening the
queue: a new epoch, every unconfirmed job reloaded, every worker's posted demand bound again; so
the offers a dead holder left in its outbox are made again by the next one. The others stand by:
a job submission sent to them is answered busy (`QueueStandby`: the operator's agent sends it
again and the broker hands it to a leader of the group); a worker's result is posted to
`job_results_posted` (answered at once: a worker is never left to the broker's choice of leader,
which may hand its retries to standbys again and again), and a demand heard on any leader's
heartbeats to `job_demands`. Each posting transaction says so on the channel `CHANNEL` (a
`NOTIFY`, delivered at its commit); the holder listens there and claims what was posted at once
(`read_results`, `read_demands`: rows taken `FOR UPDATE SKIP LOCKED`, so a row a posting or a
frozen leader still locks is left for the next notice, never waited for), and asks on its own
ticks only while its listening session is lost. A worker's loss
is the registry's (shared), which the holder asks (`agent.leader.actors.LeaderActor`). A frozen
holder that wakes after a takeover is fenced by the epoch, read `FOR SHARE` in each of its
write transactions (a taker's epoch update waits for them, and they see its commit), its claims
included.

Threading choice: synchronous, called on the event loop. Dispatch and requeue touch memory
only; `submit` and `result` are each one short transaction (WAL, `synchronous=NORMAL`: no fsync
per commit). sqlite3 errors never leave this module (`StoreError`).
"""

from __future__ import annotations

import heapq
import json
import sqlite3
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from agent.core.backends import server_migrations
from agent.core.clock import Clock
from agent.core.errors import StoreError
from agent.core.lease import FencedLease, lease_row
from agent.core.sql import (
    NO_LIMIT,
    Connection,
    Dialect,
    ServerUrl,
    StoreTarget,
    dialect_of,
    has_table,
    in_json_array,
)
from agent.core.sqlite import Synchronous, read_int, store_errors
from agent.core.store import Store
from agent.leader.job_types import (
    DemandOutcome,
    Dispatch,
    JobRecord,
    QueueFenced,
    QueueStandby,
    QueueStats,
    ResultAck,
    ResultOutcome,
    SubmitOutcome,
    SubmitResult,
)
from agent.protocol import JobDemand, JobOffer, JobResult, JobSubmit

COMPONENT = "jobqueue"
LEASE_NAME = "job queue"  # its row of the fleet's leases (several leaders on a database server)
CHANNEL = "ea_job_queue"  # work posted for the holder is said here, with the posting leader's name
CLAIM_MAX = 512  # posted results claimed in one transaction

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

#: The same tables on PostgreSQL, with the lease of the one leader that runs the queue and the
#: demand windows every leader posts from the heartbeats it hears.


@dataclass(slots=True)
class _Job:
    kind: str
    payload: bytes
    seq: int  # store_seq: submission order
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


class _WorkerWindows(Mapping[str, int]):
    """Read-only view of the bound workers' windows (see `JobQueue.workers`)."""

    __slots__ = ("_workers",)

    def __init__(self, workers: dict[str, _Binding]) -> None:
        self._workers = workers

    def __getitem__(self, worker: str) -> int:
        return self._workers[worker].window

    def __contains__(self, worker: object) -> bool:
        return worker in self._workers

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._workers))

    def __len__(self) -> int:
        return len(self._workers)

    def __repr__(self) -> str:
        return repr({w: b.window for w, b in self._workers.items()})


class JobQueue(Store):
    """Open with `JobQueue.open(target, clock=...)`; one open queue per database is the writer
    (on PostgreSQL: the holder of the queue's lease, see the module docstring)."""

    COMPONENT = COMPONENT
    MIGRATIONS = _MIGRATIONS
    SERVER_MIGRATIONS = server_migrations("agent.leader", COMPONENT)
    WHAT = "job queue"

    def __init__(self, conn: Any, *, clock: Clock, window_max: int, path: str | Path | ServerUrl,
                 holder: str = "", lease_s: float = 10.0) -> None:
        super().__init__(conn, path=path)
        self._clock = clock
        self.window_max = window_max
        self.holder = holder
        self.held = False
        self.lease_holder = ""  # on a server, standing by: the leader that holds the lease
        # on a database server: the fleet's lease of the queue (`agent.core.lease`)
        self.lease = FencedLease(self, LEASE_NAME, holder, ttl_s=lease_s) if self.on_server else None
        self._taken_token: int | None = None  # the lease's token when this leader took the queue
        self.taken = 0  # times this queue was taken (opened under a new epoch)
        self._reset(0)

    def _reset(self, epoch: int) -> None:
        """Forget every job and binding of memory: the queue (re)opens under `epoch`."""
        self.epoch = epoch
        self._fenced = False
        self._jobs: dict[str, _Job] = {}  # every accepted, unconfirmed job
        self._head: list[tuple[int, str]] = []  # released jobs: a heap by store_seq
        self._pending: deque[str] = deque()  # never offered, FIFO; both may hold stale ids
        self._queued: set[str] = set()  # ids really waiting in `_head` or `_pending`
        self._holder: dict[str, _Binding] = {}
        self._workers: dict[str, _Binding] = {}
        self._ring: deque[_Binding] = deque()  # bindings with free demand, round-robin order
        self._submitted = self._confirmed = self._requeued = self._violations = 0

    @staticmethod
    def epoch_in(path: Path) -> int | None:
        """The epoch the queue's file holds (read-only), None if the file or its tables are gone."""
        return read_int(path, "SELECT value FROM jobqueue_meta WHERE key = 'epoch'")

    @classmethod
    def open(
        cls,
        target: StoreTarget | str,
        *,
        clock: Clock,
        window_max: int = 64,
        synchronous: Synchronous = "FULL",
        holder: str = "",
        lease_s: float = 10.0,
    ) -> JobQueue:
        """Open the queue, take a new epoch (a synced commit: the leader's mark records it) and
        reload every accepted, unconfirmed job. `synchronous` is for the commits after that.

        On PostgreSQL the queue is taken only if its lease is free, expired or `holder`'s own
        (a leader restarted); else it stands by (`held` False) until `hold()` takes it."""
        if window_max < 1:
            raise ValueError("window_max must be >= 1")
        if lease_s <= 0:
            raise ValueError("lease_s must be > 0")
        conn = cls.connect_target(target, synchronous="FULL")
        queue = cls(conn, clock=clock, window_max=window_max, path=target, holder=holder, lease_s=lease_s)
        try:
            queue.hold()
            if queue.dialect is Dialect.SQLITE:
                conn.execute(f"PRAGMA synchronous = {synchronous}")
        except BaseException:
            queue.close()
            raise
        return queue

    # -- who runs the queue ----------------------------------------------------------------
    def hold(self) -> bool:
        """Keep the queue, or take it (a new epoch, reloaded) when it can be taken; whether this
        queue runs now. On leader.db it is taken at `open` and kept. On PostgreSQL this renews
        the lease (every third of `lease_s`, by the leader); a database error raises and changes
        nothing (the fence decides each write meanwhile)."""
        self.check_open()
        if self.dialect is Dialect.SQLITE:
            if not self.held:
                self._take()
            return True
        assert self.lease is not None
        kept = self.lease.hold()  # renewed under the same token, or taken under a new one
        if kept and self.held and not self._fenced and self.lease.token == self._taken_token:
            return True
        self._stand_by()
        if not kept:
            found = lease_row(self._conn, LEASE_NAME)
            self.lease_holder = found.holder if found is not None else ""
            return False
        return self._take()

    def _take(self) -> bool:
        with self.atomic():
            if self.lease is not None:  # the lease still ours (FOR SHARE: a taker waits for this)
                self.lease.fence()
            row = self._conn.execute("SELECT value FROM jobqueue_meta WHERE key = 'epoch'"
                                     + self._locking(" FOR UPDATE")).fetchone()
            epoch = (int(row[0]) if row else 0) + 1
            self._conn.execute(
                "INSERT INTO jobqueue_meta(key, value) VALUES ('epoch', ?)"
                " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (epoch,),
            )
            rows = self._conn.execute(
                "SELECT job_id, kind, payload, store_seq FROM jobs WHERE state = 'pending'"
                " ORDER BY store_seq"
            ).fetchall()
            demands = self._claim_demands(everyone=True) if self.on_server else []
        self._reset(epoch)
        self.held, self.lease_holder = True, self.holder
        self._taken_token = self.lease.token if self.lease is not None else None
        self.taken += 1
        for job_id, kind, payload, seq in rows:
            self._jobs[job_id] = _Job(kind, bytes(payload), int(seq))
            self._pending.append(job_id)
            self._queued.add(job_id)
        for demand in demands:  # every worker's window, as the leaders last heard it
            self._bind(demand)
        return True

    def _stand_by(self) -> None:
        if self.held:
            self._reset(self.epoch)
            self.held = False

    def release(self) -> None:
        """Give the lease up (a leader that stops): a standby takes the queue at its next
        `hold()`, not a lease time later. Nothing on leader.db, or if it is not ours any more."""
        if self.lease is None or not self.held or self.closed:
            return
        self._stand_by()
        self.lease.release()

    def _locking(self, clause: str) -> str:
        return clause if self.on_server else ""  # (row locks: one writer holds a whole SQLite file)

    def _standing_by(self) -> QueueStandby:
        return QueueStandby(f"this leader ({self.holder}) does not run the fleet's job queue:"
                            f" {('leader ' + repr(self.lease_holder)) if self.lease_holder else 'no leader'} does")

    def post_demands(self, demands: Sequence[tuple[JobDemand, int]]) -> None:
        """On PostgreSQL, any leader: keep each demand (heard on a heartbeat of that sequence) in
        `job_demands` for the queue's holder, unless a newer heartbeat's demand is there; one
        transaction (a heartbeat batch's, or a fleet reconnecting at once). The holder keeps
        them for whoever takes the queue next (it binds them itself), a standby posts them
        unread and says so on `CHANNEL`."""
        self.check_open()
        unread = not self.held
        newest: dict[str, tuple[JobDemand, int]] = {}
        for demand, seq in demands:
            if demand.worker not in newest or seq >= newest[demand.worker][1]:
                newest[demand.worker] = (demand, seq)
        with self.atomic(synced=False):
            self._conn.executemany(
                "INSERT INTO job_demands (worker, incarnation, demand_window, hb_seq, unread)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (worker) DO UPDATE SET"
                " incarnation = excluded.incarnation, demand_window = excluded.demand_window,"
                " hb_seq = excluded.hb_seq, unread = excluded.unread WHERE excluded.hb_seq >= job_demands.hb_seq",
                # in worker order: two leaders posting batches lock the rows alike, never a deadlock
                [(d.worker, d.incarnation, d.window, seq, unread)
                 for d, seq in sorted(newest.values(), key=lambda item: item[0].worker)])
            if unread:
                self.notify(CHANNEL, self.holder)

    def read_results(self) -> list[ResultAck]:
        """The holder on PostgreSQL: claim the results the other leaders posted (`FOR UPDATE SKIP
        LOCKED`, at most `CLAIM_MAX`), apply them and remove them, in one transaction fenced by
        the epoch. If that transaction fails, what it applied in memory may not be what the
        database kept: the queue stands by, and its next `hold()` takes it again from the
        database (a new epoch)."""
        if not self.on_server or not self.held:
            return []
        self._check()
        acks: list[ResultAck] = []
        try:
            with self.atomic():
                self._fence()
                rows = self._conn.execute(
                    "SELECT id, job_id, epoch, worker, ok, result, error FROM job_results_posted ORDER BY id"
                    " LIMIT ? FOR UPDATE SKIP LOCKED", (CLAIM_MAX,)).fetchall()
                if not rows:
                    return []
                acks = [self.result(JobResult(job_id=job_id, epoch=int(epoch), worker=worker, ok=bool(ok),
                                              result=bytes(result) if result is not None else b"", error=error))
                        for _, job_id, epoch, worker, ok, result, error in rows]
                self._conn.execute("DELETE FROM job_results_posted WHERE "
                                   + in_json_array(self.dialect, "CAST(id AS TEXT)"),
                                   (json.dumps([str(r[0]) for r in rows]),))
        except StoreError:
            if acks:
                self._stand_by()
            raise
        return acks

    def read_demands(self) -> int:
        """The holder on PostgreSQL: claim the demands posted since it last claimed (by any
        leader) and bind them; how many were claimed."""
        if not self.on_server or not self.held:
            return 0
        self._check()
        with self.atomic(synced=False):
            self._fence()
            demands = self._claim_demands(everyone=False)
        for demand in demands:
            self._bind(demand)
        return len(demands)

    def _claim_demands(self, *, everyone: bool) -> list[JobDemand]:
        """Inside a fenced transaction: the posted demands not claimed yet (`everyone`: every
        worker's, at a take) in worker order, marked claimed. A row a posting transaction still
        locks is skipped: its commit says so again on `CHANNEL`."""
        rows = self._conn.execute(
            "UPDATE job_demands SET unread = false WHERE worker IN (SELECT worker FROM job_demands"
            + ("" if everyone else " WHERE unread") + " FOR UPDATE SKIP LOCKED)"
            " RETURNING worker, incarnation, demand_window").fetchall()
        return [JobDemand(worker=worker, incarnation=incarnation, window=int(window))
                for worker, incarnation, window in sorted(rows)]

    # -- durable writes --------------------------------------------------------------------
    def _check(self) -> None:
        self.check_open()
        if not self.held:
            raise self._standing_by()
        if self._fenced:
            raise QueueFenced(f"job queue epoch {self.epoch} was fenced by a newer incarnation")

    def _fence(self) -> None:
        """First in each write transaction, and before any offer: refuse if a newer incarnation
        took the database."""
        row = self._conn.execute("SELECT value FROM jobqueue_meta WHERE key = 'epoch'"
                                 + self._locking(" FOR SHARE")).fetchone()
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
        stored: list[tuple[JobSubmit, int]] = []
        with self.atomic():
            self._fence()
            for job in jobs:
                row = self._conn.execute(
                    "INSERT INTO jobs (job_id, kind, payload, state, submitted_ms, submit_epoch)"
                    " VALUES (?, ?, ?, 'pending', ?, ?) ON CONFLICT (job_id) DO NOTHING RETURNING store_seq",
                    (job.job_id, job.kind, job.payload, now, self.epoch),
                ).fetchone()
                if row is not None:
                    seq = int(row[0])
                    results.append(SubmitResult("stored", job.job_id, seq))
                    stored.append((job, seq))
                else:
                    row = self._conn.execute(
                        "SELECT store_seq FROM jobs WHERE job_id = ?", (job.job_id,)
                    ).fetchone()
                    results.append(SubmitResult("duplicate", job.job_id, int(row[0])))
        for job, seq in stored:
            self._jobs[job.job_id] = _Job(job.kind, job.payload, seq)
            self._pending.append(job.job_id)
            self._queued.add(job.job_id)
        self._submitted += len(stored)
        return results

    def result(self, result: JobResult) -> ResultAck:
        """Apply a worker's result; see the module docstring for the outcomes. On PostgreSQL a
        leader standing by posts it for the holder ("posted")."""
        if self.on_server and not self.held:
            self.check_open()
            with self.atomic():
                self._conn.execute(
                    "INSERT INTO job_results_posted (job_id, epoch, worker, ok, result, error)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (result.job_id, result.epoch, result.worker, int(result.ok), result.result, result.error))
                self.notify(CHANNEL, self.holder)
            return ResultAck("posted", result.job_id)
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
        with self.atomic():
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
    def demand(self, demand: JobDemand, seq: int = 0) -> DemandOutcome:
        """Register or re-register a worker's demand window (heard on a heartbeat of sequence
        `seq`). On PostgreSQL it is posted for whichever leader runs the queue ("posted" when
        that is another one)."""
        return self.demand_many([(demand, seq)])[0]

    def demand_many(self, demands: Sequence[tuple[JobDemand, int]]) -> list[DemandOutcome]:
        """`demand` for many, posted in one transaction on PostgreSQL."""
        if self.on_server:
            self.post_demands(demands)
            if not self.held:
                return ["posted"] * len(demands)
        return [self._bind(demand) for demand, _ in demands]

    def _bind(self, demand: JobDemand) -> DemandOutcome:
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

    def bound(self, demand: JobDemand) -> bool:
        """The worker holds this very binding already (a heartbeat repeating its demand changes
        nothing: nothing to do). On PostgreSQL never: the demand is posted for the holder."""
        if self.on_server:
            return False
        binding = self._workers.get(demand.worker)
        return binding is not None and binding.incarnation == demand.incarnation and binding.window == demand.window

    def lose_worker(self, worker: str) -> list[str]:
        """End `worker`'s binding (lost); its unconfirmed jobs (returned in dispatch order) go
        back to the head of the pool."""
        return self.lose_workers((worker,)).get(worker, [])

    def lose_workers(self, workers: Iterable[str]) -> dict[str, list[str]]:
        """End the bindings of many lost workers at once, in O(workers + k log k) for k held jobs.

        Every job they held goes back to the head of the pending pool: ahead of every job never
        offered, with the other released jobs, oldest submission first. Returns, per worker
        that was bound, the jobs it held in dispatch order; unknown workers are skipped. Nothing
        on a leader standing by: the holder reads the losses from the registry.
        """
        if not self.held:
            return {}
        self._check()
        out: dict[str, list[str]] = {}
        released: list[str] = []
        for worker in workers:
            binding = self._workers.get(worker)
            if binding is None:
                continue
            held = self._release(binding)
            out[worker] = held
            released.extend(held)
        self._requeue_head(released)
        return out

    def dispatch(self) -> list[Dispatch]:
        """Offer pending jobs round-robin to workers with free demand; the offers to send (none
        from a leader standing by)."""
        if not self.held:
            return []
        self._check()
        if self._queued and self._ring and self.on_server:
            self._fence()  # a holder frozen past its lease wakes to offer nothing
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

    def workers(self) -> Mapping[str, int]:
        """Bound workers and their windows: a live, read-only view (O(1) to get, `in`, `len`);
        iterating it walks a snapshot of the worker ids."""
        return _WorkerWindows(self._workers)

    def pending_ids(self) -> list[str]:
        """Job ids waiting for a worker, head first."""
        head = [j for _, j in sorted(self._head)]
        return [j for j in dict.fromkeys(head + list(self._pending)) if j in self._queued]

    def _next_pending(self) -> str:
        while True:
            job_id = heapq.heappop(self._head)[1] if self._head else self._pending.popleft()
            if job_id in self._queued:
                self._queued.discard(job_id)
                return job_id

    def _offer_demand(self, binding: _Binding) -> None:
        if not binding.ended and not binding.in_ring and binding.free > 0:
            binding.in_ring = True
            self._ring.append(binding)

    def _end(self, binding: _Binding) -> list[str]:
        released = self._release(binding)
        self._requeue_head(released)
        return released

    def _release(self, binding: _Binding) -> list[str]:
        """End a binding; the jobs it held, in dispatch order (not yet requeued)."""
        binding.ended = True
        if self._workers.get(binding.worker) is binding:
            del self._workers[binding.worker]
        released = list(binding.held)
        binding.held.clear()
        for job_id in released:
            self._holder.pop(job_id, None)
        return released

    def _requeue_head(self, job_ids: Iterable[str]) -> None:
        """Put jobs back at the head of the pool, where released jobs wait oldest first."""
        jobs, queued, head = self._jobs, self._queued, self._head
        count = 0
        for job_id in job_ids:
            if job_id in jobs and job_id not in queued:
                heapq.heappush(head, (jobs[job_id].seq, job_id))
                queued.add(job_id)
                count += 1
        self._requeued += count

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
            held=int(self.held),
            taken=self.taken,
        )

    def prune_confirmed(self, older_than_s: float, *, limit: int | None = None) -> int:
        """Delete confirmed jobs confirmed more than `older_than_s` ago, oldest first, at most
        `limit` of them in this one transaction; how many were deleted. Pending and in-flight
        jobs are never touched. A pruned id could be submitted (and run) again, and a late
        result for it counts as a violation, so keep confirmed jobs longer than any submitter
        or worker may still resend (see `agent.housekeeping`). Nothing on a leader standing by."""
        if not self.held:
            return 0
        self._check()
        cutoff = self._clock.now_ms() - int(older_than_s * 1000)
        with store_errors("prune jobs"):
            if self._conn.execute(
                "SELECT 1 FROM jobs WHERE state = 'confirmed' AND confirmed_ms < ? LIMIT 1", (cutoff,)
            ).fetchone() is None:
                return 0  # nothing due: no write transaction (an idle leader writes nothing)
        with self.atomic():
            self._fence()
            cur = self._conn.execute(
                "DELETE FROM jobs WHERE store_seq IN (SELECT store_seq FROM jobs"
                " WHERE state = 'confirmed' AND confirmed_ms < ? ORDER BY confirmed_ms LIMIT ?)",
                (cutoff, NO_LIMIT if limit is None else max(0, limit)),
            )
        return cur.rowcount


class JobCounts(msgspec.Struct, kw_only=True, frozen=True):
    pending: int = 0
    confirmed: int = 0
    failed: int = 0  # confirmed with ok=False
    epoch: int = 0
    run_by: str = ""  # several leaders: the leader that took the queue's lease last
    run_since_ms: int | None = None  # when it took it
    run_until_ms: int | None = None  # until when it holds it (past: none runs the queue now)


class JobReads:
    """The job queue's reads for the views (`status`), on any connection to the leader's
    database (leader.db, or the fleet's PostgreSQL database); None from `counts` when the queue
    was never opened there."""

    def __init__(self, conn: sqlite3.Connection | Connection) -> None:
        self._conn: Any = conn
        self._dialect = dialect_of(conn)

    def counts(self) -> JobCounts | None:
        for table in ("jobs", "jobqueue_meta"):
            if not self._conn.execute(has_table(self._dialect, table)).fetchone()[0]:
                return None
        counts = dict(self._conn.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())
        (failed,) = self._conn.execute("SELECT COUNT(*) FROM jobs WHERE state = 'confirmed' AND ok = 0").fetchone()
        row = self._conn.execute("SELECT value FROM jobqueue_meta WHERE key = 'epoch'").fetchone()
        run_by, since, until = "", None, None
        lease = lease_row(self._conn, LEASE_NAME) if self._dialect is not Dialect.SQLITE else None
        if lease is not None:
            run_by, since, until = lease.holder, lease.acquired_ms, lease.expires_ms
        return JobCounts(pending=int(counts.get("pending", 0)), confirmed=int(counts.get("confirmed", 0)),
                         failed=int(failed), epoch=int(row[0]) if row else 0, run_by=run_by,
                         run_since_ms=since, run_until_ms=until)


__all__ = [
    "COMPONENT",
    "DemandOutcome",
    "Dispatch",
    "JobCounts",
    "JobQueue",
    "JobReads",
    "JobRecord",
    "QueueFenced",
    "QueueStandby",
    "QueueStats",
    "ResultAck",
    "ResultOutcome",
    "SubmitOutcome",
    "SubmitResult",
]
