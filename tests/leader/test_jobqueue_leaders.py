"""Several leaders on one PostgreSQL database: one runs the job queue (its lease), the others
stand by, and a takeover reopens the queue under a new epoch with nothing lost."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from agent.core.clock import VirtualClock
from agent.core.errors import StoreUnavailable
from agent.core.sql import ServerUrl
from agent.leader.jobs import JobQueue, QueueFenced, QueueStandby
from agent.protocol import JobDemand, JobResult, JobSubmit


def job(n: int) -> JobSubmit:
    return JobSubmit(job_id=f"j{n}", kind="work", payload=b"p")


def demand(worker: str, window: int = 2, incarnation: str = "i1") -> JobDemand:
    return JobDemand(worker=worker, incarnation=incarnation, window=window)


@pytest.fixture
def two(pg_url: str) -> Iterator[tuple[JobQueue, JobQueue]]:
    """The job queue as two leaders open it, gw1 first (it takes the queue), then gw2."""
    a = JobQueue.open(pg_url, clock=VirtualClock(), holder="gw1")
    b = JobQueue.open(pg_url, clock=VirtualClock(), holder="gw2")
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def run_out(url: str) -> None:
    """The holder stopped renewing and its lease time passed (as the server's clock sees it)."""
    from agent.core import postgres

    conn = postgres.connect(ServerUrl(url))
    try:
        conn.execute("UPDATE leases SET expires_ms = 0 WHERE name = 'job queue'")
    finally:
        conn.close()


def test_one_leader_runs_the_queue_the_other_stands_by_and_passes_on_what_it_hears(
        two: tuple[JobQueue, JobQueue]) -> None:
    a, b = two
    assert (a.held, b.held) == (True, False)
    assert b.lease_holder == "gw1" and b.hold() is False
    with pytest.raises(QueueStandby, match="leader 'gw1' does"):
        b.submit(job(1))
    assert b.dispatch() == [] and b.lose_workers(["w1"]) == {} and b.prune_confirmed(0) == 0
    # a demand heard by the standby reaches the holder through the database
    assert b.demand(demand("w1"), seq=5) == "posted"
    assert a.submit_many([job(1), job(2), job(3)])[0].outcome == "stored"
    assert a.dispatch() == []  # no worker known yet
    assert a.read_demands() == 1
    assert [(d.worker, d.offer.job_id) for d in a.dispatch()] == [("w1", "j1"), ("w1", "j2")]
    # a result given to the standby is posted, and the holder applies it at its next read, once
    result = JobResult(job_id="j1", epoch=a.epoch, worker="w1", ok=True, result=b"done")
    assert b.result(result).outcome == "posted"
    assert [ack.outcome for ack in a.read_results()] == ["confirmed"] and a.read_results() == []
    assert a.job("j1").result == b"done"  # type: ignore[union-attr]
    assert b.result(result).outcome == "posted"  # sent again: a duplicate, nothing changes
    assert [ack.outcome for ack in a.read_results()] == ["duplicate"]
    assert [(d.worker, d.offer.job_id) for d in a.dispatch()] == [("w1", "j3")]
    # an older heartbeat's demand (a late one, from another leader) does not replace it; a
    # batch of demands is posted at once, the newest of each worker's kept
    b.demand(demand("w1", window=1, incarnation="i0"), seq=4)
    assert a.read_demands() == 0 and a.workers() == {"w1": 2}
    assert b.demand_many([(demand("w2", 1), 9), (demand("w3"), 3), (demand("w2", 2), 10)]) == ["posted"] * 3
    assert a.read_demands() == 2 and a.workers() == {"w1": 2, "w2": 2, "w3": 2}


def test_a_takeover_reopens_the_queue_and_fences_the_old_holder(two: tuple[JobQueue, JobQueue], pg_url: str) -> None:
    a, b = two
    a.submit_many([job(n) for n in range(1, 5)])
    a.demand(demand("w1"), seq=1)
    offers = a.dispatch()  # w1 holds j1, j2
    assert a.result(JobResult(job_id="j1", epoch=a.epoch, worker="w1", ok=True)).outcome == "confirmed"
    old_epoch = a.epoch

    run_out(pg_url)  # gw1 froze (SIGSTOP) past its lease
    assert b.hold() is True and b.epoch == old_epoch + 1
    # every unconfirmed job, and w1's demand as gw1 heard it, are b's now: j2 goes out again
    assert b.pending_ids() == ["j2", "j3", "j4"] and b.workers() == {"w1": 2}
    assert [(d.worker, d.offer.job_id, d.offer.epoch) for d in b.dispatch()] == [
        ("w1", "j2", b.epoch), ("w1", "j3", b.epoch)]

    # gw1 wakes: it offers nothing more (w1 has room for j3 in its memory), none of its writes
    # lands, and it stands by at its next renewal
    with pytest.raises(QueueFenced):
        a.dispatch()
    with pytest.raises(QueueFenced):
        a.result(JobResult(job_id=offers[1].offer.job_id, epoch=old_epoch, worker="w1", ok=True))
    assert a.hold() is False and a.lease_holder == "gw2"
    with pytest.raises(QueueStandby):
        a.submit(job(9))
    assert b.job("j2").state == "pending"  # type: ignore[union-attr]
    assert b.result(JobResult(job_id="j2", epoch=b.epoch, worker="w1", ok=True)).outcome == "confirmed"
    assert b.counts() == {"pending": 2, "confirmed": 2}


def test_a_clean_stop_hands_the_queue_over_at_once_and_a_restarted_leader_takes_its_own(
        two: tuple[JobQueue, JobQueue], pg_url: str) -> None:
    a, b = two
    first = a.epoch
    assert a.hold() is True and a.epoch == first  # a renewal keeps the epoch
    a.release()
    assert not a.held and b.hold() is True and b.epoch == first + 1
    b.close()  # gw2 killed: its lease runs on, but gw2 started again takes its own lease at once
    again = JobQueue.open(pg_url, clock=VirtualClock(), holder="gw2")
    assert again.held and again.epoch == first + 2
    again.close()


def _session(url: str):  # type: ignore[no-untyped-def]
    """Another session on the fleet's database (a posting or a frozen leader's)."""
    from agent.core import postgres

    return postgres.connect(ServerUrl(url))


async def test_the_holder_hears_what_a_standby_posts_and_a_standby_hears_a_lease_given_up(
        two: tuple[JobQueue, JobQueue]) -> None:
    from agent.core.lease import CHANNEL as LEASES
    from agent.leader.jobs import CHANNEL as POSTED

    a, b = two
    clock = VirtualClock()  # (never advanced: every wait below ends on a notice, or not at all)
    heard_by_a, heard_by_b = a.listener(POSTED), b.listener(LEASES)
    assert heard_by_a is not None and heard_by_b is not None
    try:
        # listening starts by hearing every channel once: what was said before is not known
        assert (POSTED, "") in await heard_by_a.wait(clock, 0) and heard_by_a.listening
        assert (LEASES, "") in await heard_by_b.wait(clock, 0)
        b.demand(demand("w1"), seq=1)
        assert (POSTED, "gw2") in await heard_by_a.wait(clock, 3600)
        assert a.read_demands() == 1
        a.submit(job(1))
        (offer,) = a.dispatch()
        assert b.result(JobResult(job_id="j1", epoch=a.epoch, worker="w1", ok=True)).outcome == "posted"
        assert (POSTED, "gw2") in await heard_by_a.wait(clock, 3600)
        assert [ack.outcome for ack in a.read_results()] == ["confirmed"]
        # the holder's own demands are kept for a next holder, not said: nothing to claim
        a.demand(demand("w2"), seq=1)
        assert a.read_demands() == 0 and a.workers() == {"w1": 2, "w2": 2}
        a.release()
        assert (LEASES, "job queue") in await heard_by_b.wait(clock, 3600)
        assert b.hold() is True and b.workers() == {"w1": 2, "w2": 2}
    finally:
        heard_by_a.close()
        heard_by_b.close()


def test_a_claim_skips_what_another_session_locks_and_takes_it_once_that_commits(
        two: tuple[JobQueue, JobQueue], pg_url: str) -> None:
    a, b = two
    a.submit_many([job(1), job(2)])
    a.demand(demand("w1"), seq=1)
    a.dispatch()
    for n in (1, 2):
        b.result(JobResult(job_id=f"j{n}", epoch=a.epoch, worker="w1", ok=True))
    frozen = _session(pg_url)  # a leader frozen in a transaction that locked the first posted result
    try:
        frozen.execute("BEGIN")
        frozen.execute("SELECT id FROM job_results_posted ORDER BY id LIMIT 1 FOR UPDATE")
        assert [ack.job_id for ack in a.read_results()] == ["j2"]  # not waited for: skipped
        frozen.execute("ROLLBACK")
        assert [ack.job_id for ack in a.read_results()] == ["j1"]
        # a demand whose posting commits after a later one was claimed is still claimed
        posting = _session(pg_url)
        try:
            posting.execute("BEGIN")
            posting.execute("INSERT INTO job_demands (worker, incarnation, demand_window, hb_seq, unread)"
                            " VALUES ('w-late', 'i1', 1, 1, true)")
            b.demand(demand("w-early"), seq=1)
            assert a.read_demands() == 1 and "w-late" not in a.workers()
            posting.execute("COMMIT")
        finally:
            posting.close()
        assert a.read_demands() == 1 and a.workers()["w-late"] == 1
    finally:
        frozen.close()


def test_a_fenced_holder_claims_nothing_the_next_holder_needs(two: tuple[JobQueue, JobQueue], pg_url: str) -> None:
    a, b = two
    a.submit(job(1))
    a.demand(demand("w1"), seq=1)
    (offer,) = a.dispatch()
    run_out(pg_url)
    assert b.hold() is True
    c = JobQueue.open(pg_url, clock=VirtualClock(), holder="gw3")  # a third leader, standing by
    try:
        c.demand(demand("w2"), seq=1)
        c.result(JobResult(job_id="j1", epoch=b.epoch, worker="w1", ok=True))
        with pytest.raises(QueueFenced):  # gw1 wakes from its freeze: its claims are refused
            a.read_demands()
        with pytest.raises(QueueFenced):
            a.read_results()
        assert b.read_demands() == 1 and set(b.workers()) == {"w1", "w2"}
        b.dispatch()
        assert [ack.outcome for ack in b.read_results()] == ["confirmed"]
    finally:
        c.close()


async def test_a_listener_listens_again_after_the_server_restarts(postgres) -> None:  # type: ignore[no-untyped-def]
    from agent.core.clock import SystemClock
    from agent.leader.jobs import CHANNEL as POSTED

    url = postgres.new_schema()
    clock = SystemClock()
    a = JobQueue.open(url, clock=clock, holder="gw1")
    b = JobQueue.open(url, clock=clock, holder="gw2")
    heard = a.listener(POSTED)
    assert heard is not None
    try:
        await heard.wait(clock, 0)
        assert heard.listening and heard.sessions == 1  # type: ignore[attr-defined]
        postgres.stop("immediate")
        while heard.listening:  # the event loop reads the lost session and wakes the waiter
            await heard.wait(clock, 3600)
        postgres.start()
        while not (got := await heard.wait(clock, 0)):  # tries again at most once a second
            await asyncio.sleep(0.05)
        assert (POSTED, "") in got and heard.listening and heard.sessions == 2  # type: ignore[attr-defined]
        while True:  # b finds its session lost at its first call, and connects again after
            try:
                b.demand(demand("w1"), seq=1)
                break
            except StoreUnavailable:
                await asyncio.sleep(0.1)
        assert (POSTED, "gw2") in await heard.wait(clock, 3600)
    finally:
        heard.close()
        a.close()
        b.close()
