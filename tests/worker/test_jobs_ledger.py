from pathlib import Path

import pytest

from agent.core.clock import VirtualClock
from agent.core.errors import StoreError
from agent.leader.jobs import JobQueue
from agent.protocol import JobOffer, JobSubmit
from agent.worker.jobs import DemandWindow, JobLedger, LedgerTransaction


def counter_effect(tx: LedgerTransaction) -> None:
    tx.execute("CREATE TABLE IF NOT EXISTS counter (n INTEGER NOT NULL)")
    tx.execute("INSERT INTO counter (n) VALUES (1)")


def effects(ledger: JobLedger) -> int:
    return int(ledger.query("SELECT COUNT(*) FROM counter")[0][0])


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "worker.db"


def test_a_job_id_is_committed_once_with_its_effect(path: Path) -> None:
    clock = VirtualClock()
    with JobLedger.open(path, clock=clock) as ledger:
        assert ledger.lookup("j1") is None
        assert ledger.complete("j1", ok=True, result=b"42", effect=counter_effect) is True
        assert ledger.complete("j1", ok=False, error="again", effect=counter_effect) is False
    with JobLedger.open(path, clock=clock) as ledger:  # after a restart
        assert ledger.complete("j1", ok=True, effect=counter_effect) is False
        entry = ledger.lookup("j1")
        assert entry is not None and (entry.ok, entry.result, entry.error) == (True, b"42", "")
        assert effects(ledger) == 1


def test_a_failing_effect_records_nothing(path: Path) -> None:
    with JobLedger.open(path, clock=VirtualClock()) as ledger:
        ledger.complete("setup", ok=True, effect=lambda tx: tx.execute(
            "CREATE TABLE counter (n INTEGER NOT NULL)"))

        def half_then_crash(tx: LedgerTransaction) -> None:
            counter_effect(tx)
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            ledger.complete("j1", ok=True, effect=half_then_crash)
        assert ledger.lookup("j1") is None
        with pytest.raises(StoreError):
            ledger.complete("j1", ok=True, effect=lambda tx: tx.execute("INSERT INTO nowhere"))
        assert ledger.lookup("j1") is None
        assert ledger.complete("j1", ok=True, effect=counter_effect)
        assert effects(ledger) == 1


def test_result_message_is_stamped_with_the_newest_epoch(path: Path) -> None:
    with JobLedger.open(path, clock=VirtualClock()) as ledger:
        assert ledger.result_message("j1", epoch=1, worker="w") is None
        ledger.complete("j1", ok=False, error="disk full")
        message = ledger.result_message("j1", epoch=7, worker="w")
        assert message is not None
        assert (message.epoch, message.ok, message.error, message.worker) == (7, False,
                                                                              "disk full", "w")


async def test_prune_by_age(path: Path) -> None:
    clock = VirtualClock()
    with JobLedger.open(path, clock=clock) as ledger:
        ledger.complete("old", ok=True)
        await clock.advance(7200)
        ledger.complete("new", ok=True)
        assert ledger.prune(older_than_s=3600) == 1
        assert ledger.lookup("old") is None and ledger.count() == 1


def test_closed_ledger_and_bad_file(tmp_path: Path) -> None:
    ledger = JobLedger.open(tmp_path / "w.db", clock=VirtualClock())
    ledger.close()
    with pytest.raises(StoreError):
        ledger.complete("j", ok=True)
    with pytest.raises(StoreError):
        JobLedger.open(tmp_path, clock=VirtualClock())


def offer(job_id: str, epoch: int = 1) -> JobOffer:
    return JobOffer(job_id=job_id, epoch=epoch, kind="k")


def test_demand_window_accounting() -> None:
    window = DemandWindow(2, worker="w1", incarnation="run-1")
    assert window.demand().window == 2 and window.demand().worker == "w1"
    assert window.admit(offer("a")) == "run"
    assert window.admit(offer("a", epoch=3)) == "running"
    assert window.admit(offer("b")) == "run"
    assert window.free == 0 and window.running == ("a", "b")
    assert window.admit(offer("c")) == "over_window"
    assert window.finish("a") == 3  # the newest epoch it was offered under
    assert window.admit(offer("c")) == "run"
    window.resize(4)
    assert window.free == 2
    with pytest.raises(KeyError):
        window.finish("zzz")
    with pytest.raises(ValueError):
        DemandWindow(0, worker="w", incarnation="i")


def test_job_done_before_a_leader_restart_has_its_effect_once(tmp_path: Path) -> None:
    """The leader restarts after the worker committed a job but before the result landed: the
    job is re-offered under the new epoch and answered from the ledger, not run again."""
    clock = VirtualClock()
    leader_db, worker_db = tmp_path / "leader.db", tmp_path / "worker.db"
    queue = JobQueue.open(leader_db, clock=clock)
    queue.submit(JobSubmit(job_id="j1", kind="k"))
    window = DemandWindow(2, worker="w1", incarnation="run-1")
    queue.demand(window.demand())
    ledger = JobLedger.open(worker_db, clock=clock)

    def handle(o: JobOffer) -> object:
        done = ledger.result_message(o.job_id, epoch=o.epoch, worker="w1")
        if done is not None:
            return done
        assert window.admit(o) == "run"
        ledger.complete(o.job_id, ok=True, result=b"r", effect=counter_effect)
        return ledger.result_message(o.job_id, epoch=window.finish(o.job_id), worker="w1")

    (d,) = queue.dispatch()
    lost_result = handle(d.offer)  # the leader dies before this result arrives
    queue.close()
    queue = JobQueue.open(leader_db, clock=clock)
    assert queue.result(lost_result).outcome == "stale_epoch"  # type: ignore[arg-type]
    queue.demand(window.demand())
    (d,) = queue.dispatch()
    assert d.offer.epoch == queue.epoch == 2
    assert queue.result(handle(d.offer)).outcome == "confirmed"  # type: ignore[arg-type]
    assert effects(ledger) == 1
    queue.close()
    ledger.close()


async def test_prune_in_batches_oldest_first(path: Path) -> None:
    clock = VirtualClock()
    with JobLedger.open(path, clock=clock) as ledger:
        for n in range(7):
            ledger.complete(f"j{n}", ok=True)
            await clock.advance(60)
        await clock.advance(3600)
        ledger.complete("recent", ok=True)
        assert ledger.prune(older_than_s=3600, limit=3) == 3
        assert [ledger.lookup(f"j{n}") is None for n in range(4)] == [True, True, True, False]
        assert ledger.prune(older_than_s=3600, limit=3) == 3
        assert ledger.prune(older_than_s=3600, limit=3) == 1
        assert ledger.prune(older_than_s=3600, limit=3) == 0
        assert ledger.count() == 1 and not ledger.complete("recent", ok=True)
