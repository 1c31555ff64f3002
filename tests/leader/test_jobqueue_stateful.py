"""Model-based test of the job queue: submit / demand / dispatch / result / lose / restart.

Invariants after every step: each unconfirmed job is either pending or held by exactly one live
worker, never both and never by two; no job is confirmed twice. At the end every submitted job
is driven to confirmation, so each is confirmed exactly once.
"""

import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from agent.core.clock import VirtualClock
from agent.leader.jobs import JobQueue, QueueFenced
from agent.protocol import JobDemand, JobResult, JobSubmit

WORKERS = ("w1", "w2", "w3")


class JobQueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="jobq-")
        self.path = Path(self.dir) / "leader.db"
        self.clock = VirtualClock()
        self.queue = JobQueue.open(self.path, clock=self.clock, window_max=3)
        self.submitted: set[str] = set()
        self.confirmed: Counter[str] = Counter()
        self.offers: set[tuple[str, str, int]] = set()  # (worker, job_id, epoch) ever offered
        self.incarnation = 0
        self.order: dict[str, int] = {}  # job id -> submission order

    @rule(n=st.integers(min_value=0, max_value=12))
    def submit(self, n: int) -> None:
        job_id = f"j{n}"
        outcome = self.queue.submit(JobSubmit(job_id=job_id, kind="k", payload=job_id.encode()))
        assert outcome.outcome == ("duplicate" if job_id in self.submitted else "stored")
        self.submitted.add(job_id)
        self.order.setdefault(job_id, len(self.order))

    @rule(worker=st.sampled_from(WORKERS), window=st.integers(min_value=1, max_value=4),
          new_run=st.booleans())
    def demand(self, worker: str, window: int, new_run: bool) -> None:
        if new_run:
            self.incarnation += 1
        outcome = self.queue.demand(
            JobDemand(worker=worker, incarnation=f"run-{self.incarnation}", window=window))
        if window > 3:
            assert outcome == "violation" and worker not in self.queue.workers()

    @rule()
    def dispatch(self) -> None:
        for d in self.queue.dispatch():
            assert d.offer.epoch == self.queue.epoch
            assert d.offer.payload == d.offer.job_id.encode()
            assert self.confirmed[d.offer.job_id] == 0
            self.offers.add((d.worker, d.offer.job_id, d.offer.epoch))

    @rule(data=st.data(), ok=st.booleans())
    def answer(self, data: st.DataObject, ok: bool) -> None:
        if not self.offers:
            return
        worker, job_id, epoch = data.draw(st.sampled_from(sorted(self.offers)))
        ack = self.queue.result(JobResult(job_id=job_id, epoch=epoch, worker=worker, ok=ok))
        if epoch != self.queue.epoch:
            assert ack.outcome == "stale_epoch"
        elif self.confirmed[job_id]:
            assert ack.outcome == "duplicate"
        else:
            assert ack.outcome == "confirmed"
            self.confirmed[job_id] += 1

    @rule(worker=st.sampled_from(WORKERS), n=st.integers(min_value=0, max_value=12))
    def violate(self, worker: str, n: int) -> None:
        job_id = f"j{n}"
        if (worker, job_id, self.queue.epoch) in self.offers:
            return
        others = {w: [o.job_id for o in self.queue.held_by(w)]
                  for w in self.queue.workers() if w != worker}
        ack = self.queue.result(JobResult(job_id=job_id, epoch=self.queue.epoch, worker=worker,
                                          ok=True))
        if self.confirmed[job_id]:
            assert ack.outcome == "duplicate"
        else:
            assert ack.outcome == "violation"
            assert worker not in self.queue.workers()
            for w, held in others.items():  # nobody else lost a thing
                assert [o.job_id for o in self.queue.held_by(w)] == held

    @rule(worker=st.sampled_from(WORKERS))
    def lose_worker(self, worker: str) -> None:
        held = [o.job_id for o in self.queue.held_by(worker)]
        assert self.queue.lose_worker(worker) == held
        # released jobs wait at the head, oldest submission first, before any job never offered
        pending = self.queue.pending_ids()
        offered = {job_id for _, job_id, epoch in self.offers if epoch == self.queue.epoch}
        released = [j for j in pending if j in offered]
        assert pending[: len(released)] == released
        assert released == sorted(released, key=self.order.__getitem__)
        assert set(held) <= set(released)

    @rule()
    def restart(self) -> None:
        old = self.queue
        self.queue = JobQueue.open(self.path, clock=self.clock, window_max=3)
        assert self.queue.epoch == old.epoch + 1
        with pytest.raises(QueueFenced):
            old.submit(JobSubmit(job_id="zombie", kind="k"))
        old.close()
        unconfirmed = self.submitted - set(self.confirmed)
        assert set(self.queue.pending_ids()) == unconfirmed
        assert self.queue.workers() == {}

    @invariant()
    def each_unconfirmed_job_is_in_exactly_one_place(self) -> None:
        held: dict[str, str] = {}
        for worker in self.queue.workers():
            for offer in self.queue.held_by(worker):
                assert offer.job_id not in held, f"{offer.job_id} held by two workers"
                held[offer.job_id] = worker
                assert self.queue.holder_of(offer.job_id) == worker
        pending = self.queue.pending_ids()
        assert len(pending) == len(set(pending))
        assert not set(pending) & set(held)
        assert set(pending) | set(held) == self.submitted - set(self.confirmed)
        assert all(count == 1 for count in self.confirmed.values())

    def teardown(self) -> None:
        try:
            for worker in list(self.queue.workers()):
                self.queue.lose_worker(worker)
            self.queue.demand(JobDemand(worker="drain", incarnation="final", window=3))
            for _ in range(len(self.submitted) + 1):
                for d in self.queue.dispatch():
                    ack = self.queue.result(JobResult(job_id=d.offer.job_id, epoch=d.offer.epoch,
                                                      worker="drain", ok=True))
                    assert ack.outcome == "confirmed"
                    self.confirmed[d.offer.job_id] += 1
            assert set(self.confirmed) == self.submitted
            assert all(count == 1 for count in self.confirmed.values())
            assert self.queue.counts() == {"pending": 0, "confirmed": len(self.submitted)}
        finally:
            self.queue.close()
            shutil.rmtree(self.dir, ignore_errors=True)


JobQueueMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
test_job_queue_state_machine = JobQueueMachine.TestCase
