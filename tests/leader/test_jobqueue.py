from pathlib import Path

import pytest

from agent.core.clock import VirtualClock
from agent.core.errors import StoreError
from agent.leader.jobs import Dispatch, JobQueue, QueueFenced
from agent.protocol import JobDemand, JobResult, JobSubmit


def job(n: int, payload: bytes | None = None) -> JobSubmit:
    return JobSubmit(job_id=f"j{n}", kind="work", payload=payload if payload is not None
                     else f"p{n}".encode())


def demand(worker: str, window: int = 4, incarnation: str = "i1") -> JobDemand:
    return JobDemand(worker=worker, incarnation=incarnation, window=window)


def result(q: JobQueue, job_id: str, worker: str, ok: bool = True, epoch: int | None = None,
           payload: bytes = b"") -> JobResult:
    return JobResult(job_id=job_id, epoch=q.epoch if epoch is None else epoch, worker=worker,
                     ok=ok, result=payload)


def assigned(dispatches: list[Dispatch]) -> list[tuple[str, str]]:
    return [(d.worker, d.offer.job_id) for d in dispatches]


@pytest.fixture
def path(leader_store: Path | str) -> Path | str:
    """Each test runs on leader.db and on a fleet's PostgreSQL database."""
    return leader_store


@pytest.fixture
def queue(path: Path | str):
    q = JobQueue.open(path, clock=VirtualClock(), window_max=8)
    yield q
    q.close()


def test_submit_is_idempotent_first_write_wins(queue: JobQueue, path: Path | str) -> None:
    first = queue.submit(job(1, b"original"))
    again = queue.submit(job(1, b"changed"))
    assert (first.outcome, again.outcome) == ("stored", "duplicate")
    assert again.store_seq == first.store_seq
    assert queue.pending_ids() == ["j1"]
    record = queue.job("j1")
    assert record is not None and record.payload == b"original" and record.state == "pending"
    queue.close()
    with JobQueue.open(path, clock=VirtualClock()) as reopened:
        assert reopened.submit(job(1, b"third")).outcome == "duplicate"
        assert reopened.pending_ids() == ["j1"]


def test_a_confirmed_job_submitted_again_is_not_run_again(queue: JobQueue) -> None:
    queue.submit(job(1))
    queue.demand(demand("w1"))
    queue.dispatch()
    assert queue.result(result(queue, "j1", "w1")).outcome == "confirmed"
    assert queue.submit(job(1)).outcome == "duplicate"
    assert queue.pending_ids() == [] and queue.dispatch() == []


def test_round_robin_within_demand_windows(queue: JobQueue) -> None:
    queue.submit_many([job(n) for n in range(1, 11)])
    queue.demand(demand("w1", 2))
    queue.demand(demand("w2", 1))
    queue.demand(demand("w3", 3))
    assert assigned(queue.dispatch()) == [
        ("w1", "j1"), ("w2", "j2"), ("w3", "j3"), ("w1", "j4"), ("w3", "j5"), ("w3", "j6")]
    assert queue.dispatch() == []  # every window is full
    assert queue.stats().in_flight == 6 and queue.stats().pending == 4
    assert queue.result(result(queue, "j2", "w2")).outcome == "confirmed"
    assert assigned(queue.dispatch()) == [("w2", "j7")]
    queue.demand(demand("w2", 3))  # a bigger window: two more slots
    assert assigned(queue.dispatch()) == [("w2", "j8"), ("w2", "j9")]


def test_offers_carry_the_epoch_and_the_job(queue: JobQueue) -> None:
    queue.submit(job(1, b"data"))
    queue.demand(demand("w1"))
    (d,) = queue.dispatch()
    assert d.offer.epoch == queue.epoch >= 1
    assert (d.offer.job_id, d.offer.kind, d.offer.payload) == ("j1", "work", b"data")


def test_default_window_and_bound(queue: JobQueue) -> None:
    queue.submit_many([job(n) for n in range(10)])
    assert queue.demand(JobDemand(worker="w1", incarnation="i")) == "registered"
    assert len(queue.dispatch()) == 4
    assert queue.demand(demand("w2", 9)) == "violation"  # window_max is 8
    assert "w2" not in queue.workers()


def test_lost_worker_jobs_go_to_the_head_with_original_ids(queue: JobQueue) -> None:
    queue.submit_many([job(n) for n in range(1, 7)])
    queue.demand(demand("w1", 2))
    queue.demand(demand("w2", 2))
    assert assigned(queue.dispatch()) == [("w1", "j1"), ("w2", "j2"), ("w1", "j3"), ("w2", "j4")]
    assert queue.lose_worker("w1") == ["j1", "j3"]
    assert queue.pending_ids() == ["j1", "j3", "j5", "j6"]
    assert queue.holder_of("j1") is None
    assert queue.result(result(queue, "j2", "w2")).outcome == "confirmed"
    (d,) = queue.dispatch()
    assert (d.worker, d.offer.job_id, d.offer.payload) == ("w2", "j1", b"p1")
    assert queue.lose_worker("nobody") == []


def test_protocol_violation_ends_only_that_workers_binding(queue: JobQueue) -> None:
    queue.submit_many([job(n) for n in range(1, 5)])
    queue.demand(demand("w1", 2))
    queue.demand(demand("w2", 2))
    queue.dispatch()  # w1: j1, j3; w2: j2, j4
    ack = queue.result(result(queue, "j1", "w2"))  # w2 was never offered j1
    assert ack.outcome == "violation" and ack.requeued == ("j2", "j4")
    assert queue.workers() == {"w1": 2}
    assert queue.holder_of("j1") == "w1" and queue.holder_of("j3") == "w1"
    assert queue.job("j1").state == "pending"  # type: ignore[union-attr]
    assert queue.result(result(queue, "j1", "w1")).outcome == "confirmed"
    assert queue.result(result(queue, "nope", "w1")).outcome == "violation"  # unknown job
    assert queue.workers() == {}
    assert sorted(queue.pending_ids()) == ["j2", "j3", "j4"]
    assert queue.stats().violations == 2


def test_new_incarnation_replaces_the_binding(queue: JobQueue) -> None:
    queue.submit_many([job(n) for n in range(1, 4)])
    queue.demand(demand("w1", 2, "run-1"))
    queue.dispatch()
    assert queue.demand(demand("w1", 2, "run-1")) == "updated"  # periodic re-registration
    assert [o.job_id for o in queue.held_by("w1")] == ["j1", "j2"]
    assert queue.demand(demand("w1", 2, "run-2")) == "replaced"
    assert queue.held_by("w1") == []
    assert assigned(queue.dispatch()) == [("w1", "j1"), ("w1", "j2")]


def test_late_result_from_a_lost_worker_confirms_once(queue: JobQueue) -> None:
    queue.submit(job(1))
    queue.demand(demand("w1", 1))
    queue.demand(demand("w2", 1))
    assert assigned(queue.dispatch()) == [("w1", "j1")]
    queue.lose_worker("w1")
    assert assigned(queue.dispatch()) == [("w2", "j1")]
    assert queue.result(result(queue, "j1", "w1", payload=b"from w1")).outcome == "confirmed"
    assert queue.holder_of("j1") is None and queue.stats().free_demand == 1
    assert queue.result(result(queue, "j1", "w2", payload=b"from w2")).outcome == "duplicate"
    record = queue.job("j1")
    assert record is not None and record.confirmed_by == "w1" and record.result == b"from w1"


def test_confirmation_exactly_once(queue: JobQueue) -> None:
    queue.submit(job(1))
    queue.demand(demand("w1"))
    queue.dispatch()
    assert queue.result(result(queue, "j1", "w1", ok=False)).outcome == "confirmed"
    for _ in range(3):
        assert queue.result(result(queue, "j1", "w1", ok=True)).outcome == "duplicate"
    record = queue.job("j1")
    assert record is not None and record.ok is False and record.state == "confirmed"
    assert queue.counts() == {"pending": 0, "confirmed": 1}
    assert queue.stats().confirmed == 1
    assert queue.workers() == {"w1": 4}  # a duplicate is not a violation


def test_epoch_fencing_after_restart(path: Path | str) -> None:
    clock = VirtualClock()
    old = JobQueue.open(path, clock=clock)
    old.submit_many([job(n) for n in range(1, 6)])
    old.demand(demand("w1", 3))
    old.dispatch()  # w1 holds j1, j2, j3
    assert old.result(result(old, "j2", "w1")).outcome == "confirmed"
    old_epoch = old.epoch

    new = JobQueue.open(path, clock=clock)  # the leader restarted on the same file
    assert new.epoch == old_epoch + 1
    assert new.pending_ids() == ["j1", "j3", "j4", "j5"]  # unconfirmed, in submission order
    # the previous incarnation is fenced: its writes are refused
    with pytest.raises(QueueFenced):
        old.result(result(old, "j1", "w1"))
    with pytest.raises(QueueFenced):
        old.submit(job(99))
    with pytest.raises(QueueFenced):
        old.dispatch()
    # results carrying the old epoch are refused by the new incarnation
    ack = new.result(result(new, "j1", "w1", epoch=old_epoch))
    assert ack.outcome == "stale_epoch"
    assert new.job("j1").state == "pending"  # type: ignore[union-attr]
    new.demand(demand("w2", 8))
    offers = new.dispatch()
    assert [d.offer.job_id for d in offers] == ["j1", "j3", "j4", "j5"]
    assert {d.offer.epoch for d in offers} == {new.epoch}
    for d in offers:  # (on PostgreSQL w1's posted demand is bound again too: any leader heard it)
        assert new.result(result(new, d.offer.job_id, d.worker)).outcome == "confirmed"
    assert new.counts() == {"pending": 0, "confirmed": 5}
    assert new.job("j99") is None
    old.close()
    new.close()
    with JobQueue.open(path, clock=clock) as third:
        assert third.epoch == old_epoch + 2 and third.pending_ids() == []


def test_closed_queue_refuses(queue: JobQueue) -> None:
    queue.close()
    with pytest.raises(StoreError):
        queue.submit(job(1))


async def test_prune_confirmed_by_age(path: Path | str) -> None:
    clock = VirtualClock()
    with JobQueue.open(path, clock=clock) as q:
        q.submit_many([job(1), job(2)])
        q.demand(demand("w1"))
        q.dispatch()
        q.result(result(q, "j1", "w1"))
        await clock.advance(3600)
        assert q.prune_confirmed(older_than_s=60) == 1
        assert q.job("j1") is None and q.job("j2") is not None


async def test_prune_confirmed_in_batches_never_touches_unconfirmed_jobs(path: Path | str) -> None:
    clock = VirtualClock()
    with JobQueue.open(path, clock=clock) as q:
        q.submit_many([job(n) for n in range(30)])
        q.demand(demand("w1", 8))
        offers = q.dispatch()
        for d in offers[:5]:
            assert q.result(result(q, d.offer.job_id, "w1")).outcome == "confirmed"
        q.demand(demand("w2", 8))
        second = q.dispatch()
        for d in second[:4]:
            assert q.result(result(q, d.offer.job_id, d.worker)).outcome == "confirmed"
        await clock.advance(7200)
        assert q.prune_confirmed(older_than_s=3600, limit=4) == 4
        assert q.prune_confirmed(older_than_s=3600, limit=4) == 4
        assert q.prune_confirmed(older_than_s=3600, limit=4) == 1
        assert q.prune_confirmed(older_than_s=3600, limit=4) == 0
        assert q.counts() == {"pending": 21, "confirmed": 0}
        stats = q.stats()
        assert stats.in_flight == 16 - 5 - 4 + 5 and stats.pending == 21 - stats.in_flight
        for d in offers[5:] + second[4:]:  # the held jobs still confirm after the prune
            assert q.result(result(q, d.offer.job_id, d.worker)).outcome == "confirmed"


def test_losing_a_big_fleet_puts_every_held_job_back_at_the_head_in_order(path: Path | str) -> None:
    workers = 3000
    q = JobQueue.open(path, clock=VirtualClock(), window_max=8)
    try:
        q.submit_many([job(n) for n in range(workers * 2 + 500)])
        for w in range(workers):
            q.demand(demand(f"w{w}", 2))
        offers = q.dispatch()
        assert len(offers) == workers * 2
        confirmed = {d.offer.job_id for d in offers[::7]}
        for d in offers[::7]:
            assert q.result(result(q, d.offer.job_id, d.worker)).outcome == "confirmed"
        held = [d.offer.job_id for d in offers if d.offer.job_id not in confirmed]
        waiting = q.pending_ids()
        # half the fleet goes at once (a deadline batch), the other half one by one (last wills)
        lost = q.lose_workers([f"w{w}" for w in range(0, workers, 2)] + ["never-bound"])
        assert len(lost) == workers // 2 and "never-bound" not in lost
        for w in range(1, workers, 2):
            assert "w" + str(w) not in lost
            q.lose_worker(f"w{w}")
        assert q.workers() == {} and q.stats().in_flight == 0
        number = {f"j{n}": n for n in range(workers * 2 + 500)}
        pending = q.pending_ids()
        assert pending[len(held):] == waiting  # the jobs that were waiting come after
        assert set(pending[:len(held)]) == set(held)
        assert q.counts()["pending"] == len(pending)
        # one by one or all at once: the released jobs wait oldest submission first
        assert pending[:len(held)] == sorted(held, key=number.__getitem__)
        q.demand(demand("fresh", 8))
        assert [d.offer.job_id for d in q.dispatch()] == pending[:8]
    finally:
        q.close()


def test_lose_workers_in_one_call_is_submission_order_across_workers(queue: JobQueue) -> None:
    queue.submit_many([job(n) for n in range(1, 9)])
    for w in ("w1", "w2", "w3"):
        queue.demand(demand(w, 2))
    assert len(queue.dispatch()) == 6  # w1: j1 j4, w2: j2 j5, w3: j3 j6
    assert queue.lose_workers(["w3", "w1"]) == {"w3": ["j3", "j6"], "w1": ["j1", "j4"]}
    assert queue.pending_ids() == ["j1", "j3", "j4", "j6", "j7", "j8"]
    assert "w2" in queue.workers() and len(queue.workers()) == 1
    assert queue.lose_worker("w2") == ["j2", "j5"]  # merged into the released jobs by age
    assert queue.pending_ids() == ["j1", "j2", "j3", "j4", "j5", "j6", "j7", "j8"]
