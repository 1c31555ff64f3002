"""Model-based test of the fleet's one job queue on PostgreSQL: three leaders renew, take, lose
(a lease run out: the holder froze), release and restart, while jobs are submitted and worked.

Invariants after every step: only the leader that took the queue last (the stored epoch) runs
it, and only its writes land (a standby's are `QueueStandby`, a superseded holder's
`QueueFenced`); every job accepted is in the database once, and a confirmed job stays confirmed.
At the end the running leader drives every job to confirmation: each is confirmed exactly once.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from postgres import PostgresCluster

from agent.core import postgres
from agent.core.clock import VirtualClock
from agent.core.errors import StoreError
from agent.core.sql import ServerUrl
from agent.leader.jobs import JobQueue, QueueFenced, QueueStandby
from agent.protocol import JobDemand, JobResult, JobSubmit

LEADERS = ("gw1", "gw2", "gw3")
leaders = st.sampled_from(LEADERS)


class LeaseMachine(RuleBasedStateMachine):
    cluster: ClassVar[PostgresCluster]

    def __init__(self) -> None:
        super().__init__()
        self.url = self.cluster.new_schema()
        self.queues = {name: JobQueue.open(self.url, clock=VirtualClock(), holder=name, window_max=4)
                       for name in LEADERS}
        self.epoch = self.queues["gw1"].epoch  # the first opened took it
        self.accepted: set[str] = set()
        self.confirmed: set[str] = set()
        self.db = postgres.connect(ServerUrl(self.url))

    def _stored_epoch(self) -> int:
        return int(self.db.execute("SELECT value FROM jobqueue_meta WHERE key = 'epoch'").fetchone()[0])

    def _runs(self, name: str) -> bool:
        queue = self.queues[name]
        return queue.held and queue.epoch == self._stored_epoch()

    def _note_take(self, queue: JobQueue) -> None:
        if queue.held and queue.epoch > self.epoch:
            self.epoch = queue.epoch

    @rule(name=leaders)
    def hold(self, name: str) -> None:
        queue = self.queues[name]
        before = (queue.held, queue.epoch)
        held = queue.hold()
        self._note_take(queue)
        if held and before[0] and queue.epoch == before[1]:
            assert self._runs(name)  # a renewal: still the one running it

    @rule()
    def run_out(self) -> None:
        """Whoever holds the lease froze past it (or was SIGKILLed): it may be taken."""
        self.db.execute("UPDATE leases SET expires_ms = 0 WHERE name = 'job queue'")

    @rule(name=leaders)
    def release(self, name: str) -> None:
        self.queues[name].release()
        assert not self.queues[name].held

    @rule(name=leaders)
    def restart(self, name: str) -> None:
        self.queues[name].close()
        self.queues[name] = JobQueue.open(self.url, clock=VirtualClock(), holder=name, window_max=4)
        self._note_take(self.queues[name])

    @rule(name=leaders, n=st.integers(min_value=0, max_value=9))
    def submit(self, name: str, n: int) -> None:
        runs = self._runs(name)
        queue = self.queues[name]
        try:
            outcome = queue.submit(JobSubmit(job_id=f"j{n}", kind="k")).outcome
        except QueueStandby:
            assert not queue.held and not runs
            return
        except QueueFenced:
            assert not runs
            return
        assert runs, f"{name} stored a job without running the queue"
        assert (outcome == "stored") == (f"j{n}" not in self.accepted)
        self.accepted.add(f"j{n}")

    @rule(name=leaders, worker=st.sampled_from(("w1", "w2")))
    def work(self, name: str, worker: str) -> None:
        """`worker` asks for jobs from `name` and confirms what it is offered at once."""
        queue = self.queues[name]
        runs = self._runs(name)
        try:
            queue.demand(JobDemand(worker=worker, incarnation="i", window=2))
            offers = queue.dispatch()
        except QueueStandby:
            assert not runs
            return
        except QueueFenced:
            assert not runs
            return
        if offers:
            assert runs, f"{name} offered jobs without running the queue"
        for d in offers:
            ack = queue.result(JobResult(job_id=d.offer.job_id, epoch=d.offer.epoch, worker=d.worker, ok=True))
            assert ack.outcome == "confirmed" and d.offer.job_id not in self.confirmed
            self.confirmed.add(d.offer.job_id)

    @invariant()
    def one_leader_runs_the_queue(self) -> None:
        running = [name for name in LEADERS if self._runs(name)]
        assert len(running) <= 1, running
        assert self._stored_epoch() == self.epoch

    @invariant()
    def every_job_once_and_confirmed_ones_stay(self) -> None:
        rows = dict(self.db.execute("SELECT job_id, state FROM jobs").fetchall())
        assert set(rows) == self.accepted
        assert {job for job, state in rows.items() if state == "confirmed"} == self.confirmed

    def teardown(self) -> None:
        try:
            self.run_out()
            last = self.queues["gw3"]
            assert last.hold() and self._runs("gw3")
            last.demand(JobDemand(worker="drain", incarnation="final", window=4))
            for _ in range(len(self.accepted) + 1):
                for d in last.dispatch():
                    assert last.result(JobResult(job_id=d.offer.job_id, epoch=d.offer.epoch, worker=d.worker,
                                                 ok=True)).outcome == "confirmed"
            assert last.counts() == {"pending": 0, "confirmed": len(self.accepted)}
        finally:
            for queue in self.queues.values():
                queue.close()
            self.db.close()


def test_three_leaders_share_one_job_queue(postgres_shared: PostgresCluster) -> None:
    LeaseMachine.cluster = postgres_shared
    try:
        run_state_machine_as_test(LeaseMachine, settings=settings(max_examples=40, stateful_step_count=30,
                                                                  deadline=None))
    except StoreError as exc:  # pragma: no cover - a database fault is not the model's finding
        pytest.fail(f"the database failed: {exc}")
