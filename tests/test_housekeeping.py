"""Housekeeping on virtual time: dedup windows hold, tables stay bounded, batches stay bounded,
active rollouts and unconfirmed jobs are never pruned, the agents start and stop it."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e.agent_support import leader, stop_all, with_time, worker

from agent.core.clock import VirtualClock
from agent.core.codec import Envelope, decode_reply, encode
from agent.core.config import HousekeepingSection
from agent.core.errors import StoreError
from agent.housekeeping import Housekeeper, PruneTask, limited
from agent.leader.housekeeping import leader_housekeeper
from agent.leader.jobs import JobQueue
from agent.leader.registry import DeviceRegistry
from agent.protocol import JobDemand, JobResult, JobSubmit, Telemetry
from agent.transport import topics
from agent.transport.base import InboundMessage
from agent.transport.memory import MemoryBroker, MemoryTransport
from agent.worker.jobs import JobLedger

HOUR = 3600.0
DAY = 86_400.0


def _telemetry(device: str, seq: int) -> Telemetry:
    return Telemetry(device_id=device, name="temp", seq=seq, ts_ms=seq, value=float(seq))


def _settings(**overrides: float) -> HousekeepingSection:
    values = {"interval_s": 600.0, "batch_rows": 50, "processed_retention_s": DAY,
              "jobs_retention_s": DAY, "ledger_retention_s": DAY}
    values.update(overrides)
    return msgspec.convert(values, HousekeepingSection)


# -- the generic scheduler -------------------------------------------------------------------
async def test_rounds_follow_the_clock_in_bounded_batches(clock: VirtualClock) -> None:
    rows = list(range(230))
    calls: list[int] = []

    def prune(limit: int) -> int:
        calls.append(limit)
        n = min(limit, len(rows))
        del rows[:n]
        return n

    keeper = Housekeeper(clock=clock, tasks=[limited("t", prune)], interval_s=600, batch_rows=100,
                         first_delay_s=60)
    await keeper.start()
    try:
        await clock.advance(59)
        assert calls == []  # nothing before the first delay
        await clock.advance(2)
        assert rows == [] and calls == [100, 100, 100]  # 100 + 100 + 30: three bounded batches
        assert keeper.metrics().pruned == {"t": 230} and keeper.metrics().rounds == 1
        await clock.advance(600)
        assert keeper.metrics().rounds == 2 and keeper.metrics().last_round == {"t": 0}
    finally:
        await keeper.stop()
    await clock.advance(3600)
    assert keeper.metrics().rounds == 2  # stopped: no more rounds


async def test_a_failing_task_is_counted_and_the_others_go_on(clock: VirtualClock) -> None:
    def broken(_limit: int) -> tuple[int, bool]:
        raise StoreError("disk I/O error")

    keeper = Housekeeper(clock=clock, tasks=[PruneTask("bad", broken), limited("good", lambda n: 3)],
                         interval_s=60, batch_rows=10)
    assert await keeper.run_once() == {"bad": 0, "good": 3}
    assert keeper.metrics().errors == 1


async def test_info_summary_at_most_once_an_hour(clock: VirtualClock, caplog: pytest.LogCaptureFixture) -> None:
    keeper = Housekeeper(clock=clock, tasks=[limited("t", lambda n: 1)], interval_s=60, batch_rows=10)
    with caplog.at_level(logging.INFO, logger="agent.housekeeping"):
        for _ in range(130):  # two hours and ten minutes of rounds, one a minute
            await keeper.run_once()
            await clock.advance(60)
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 3  # at 0, 60 and 120 minutes
    assert "60 t" in infos[1].getMessage()


async def test_processed_ids_are_pruned_oldest_first_in_bounded_batches(clock: VirtualClock, tmp_path: Path) -> None:
    registry = DeviceRegistry.open(tmp_path / "r.db", clock=clock)
    try:
        for hour in range(48):  # 100 ids an hour for two days, never pruned
            registry.apply_telemetry_batch([(f"m{hour}-{i}", _telemetry("d1", hour * 100 + i))
                                            for i in range(100)])
            await clock.advance(HOUR)
        step = limited("processed_messages", lambda n: registry.prune_processed(DAY, limit=n)).step
        steps = []
        while True:
            removed, more = step(150)
            steps.append(removed)
            if not more:
                break
        assert sum(steps) == 2400  # the first day's ids, all of them
        assert max(steps) <= 150  # never more than the limit in one step
        assert registry.processed_count() == 2400
        assert not registry.is_processed("m0-0") and registry.is_processed("m24-0")  # the oldest went first
        assert step(150) == (0, False)
    finally:
        registry.close()


# -- the leader's tables ---------------------------------------------------------------------
async def test_redelivery_inside_the_window_is_ignored_and_ids_stay_bounded(
    clock: VirtualClock, tmp_path: Path
) -> None:
    db = tmp_path / "leader.db"
    registry = DeviceRegistry.open(db, clock=clock)
    jobs = JobQueue.open(db, clock=clock)
    keeper, reports = leader_housekeeper(_settings(), clock=clock, registry=registry, jobs=jobs,
                                         rollout_db=db)
    await keeper.start()
    try:
        assert registry.apply_telemetry("first", _telemetry("d1", 0))
        sizes = []
        for hour in range(1, 24 * 5 + 1):  # five days, 20 new ids an hour
            registry.apply_telemetry_batch([(f"m{hour}-{i}", _telemetry("d1", hour * 100 + i))
                                            for i in range(20)])
            await clock.advance(HOUR)
            sizes.append(registry.processed_count())
            if hour == 23:  # 23 h after it was applied, all the while pruning: still a duplicate
                assert not registry.apply_telemetry("first", _telemetry("d1", 0))
        device = registry.device("d1")
        assert device is not None
        assert device.telemetry_count == 1 + 20 * 24 * 5
        # one day plus one interval of ids at most: 25 hours x 20
        assert max(sizes[30:]) <= 20 * 25 and min(sizes[30:]) >= 20 * 24
        assert not registry.is_processed("first")
        assert keeper.metrics().pruned["processed_messages"] == 1 + 20 * 24 * 5 - sizes[-1]
    finally:
        await keeper.stop()
        if reports is not None:
            reports.close()
        jobs.close()
        registry.close()


async def test_confirmed_jobs_go_pending_and_held_jobs_stay(clock: VirtualClock, tmp_path: Path) -> None:
    db = tmp_path / "leader.db"
    registry = DeviceRegistry.open(db, clock=clock)
    jobs = JobQueue.open(db, clock=clock)
    keeper, reports = leader_housekeeper(_settings(batch_rows=7), clock=clock, registry=registry,
                                         jobs=jobs, rollout_db=None)
    try:
        jobs.submit_many([JobSubmit(job_id=f"j{i}", kind="k") for i in range(40)])
        jobs.demand(JobDemand(worker="w1", incarnation="a", window=30))
        offers = jobs.dispatch()
        for d in offers[:25]:
            assert jobs.result(JobResult(job_id=d.offer.job_id, epoch=jobs.epoch, worker="w1",
                                         ok=True)).outcome == "confirmed"
        await clock.advance(2 * DAY)
        assert (await with_time(clock, keeper.run_once()))["confirmed_jobs"] == 25
        assert jobs.counts() == {"pending": 15, "confirmed": 0}
        assert len(jobs.held_by("w1")) == 5 and len(jobs.pending_ids()) == 10  # untouched
        # a resubmitted id inside the window is a duplicate; the held jobs still confirm
        jobs.submit(JobSubmit(job_id="j39", kind="k"))
        for d in offers[25:]:
            assert jobs.result(JobResult(job_id=d.offer.job_id, epoch=jobs.epoch, worker="w1",
                                         ok=True)).outcome == "confirmed"
        await clock.advance(HOUR)
        assert (await with_time(clock, keeper.run_once()))["confirmed_jobs"] == 0  # confirmed an hour ago: kept
        assert jobs.counts() == {"pending": 10, "confirmed": 5}
    finally:
        if reports is not None:
            reports.close()
        jobs.close()
        registry.close()


async def test_finished_rollouts_lose_their_device_rows_and_keep_their_summary(
    clock: VirtualClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollout_engine.spec import spec_from_dict
    from rollout_engine.store import RolloutStore

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent / "rollout"))
    from rollout_support import spec_data

    db = tmp_path / "leader.db"
    artifact = tmp_path / "fw.bin"
    artifact.write_bytes(b"x" * 64)
    registry = DeviceRegistry.open(db, clock=clock)
    jobs = JobQueue.open(db, clock=clock)
    store = RolloutStore.open(db, clock=clock)
    keeper, reports = leader_housekeeper(_settings(batch_rows=8, rollouts_retention_s=7 * DAY), clock=clock,
                                         registry=registry, jobs=jobs, rollout_db=db)
    try:
        spec = spec_from_dict(spec_data(artifact))
        for rid in ("old", "running"):
            devices = [f"{rid}-{i}" for i in range(20)]
            store.create_rollout(rid, spec=spec, artifact=str(artifact), version="2.0.0", signed_manifest=b"m",
                                 waves=[devices], from_versions={})
        store.set_rollout("old", state="succeeded", finished_ms=clock.now_ms())
        await clock.advance(6 * DAY)
        assert (await with_time(clock, keeper.run_once()))["finished_rollouts"] == 0  # inside the window
        await clock.advance(2 * DAY)
        assert (await with_time(clock, keeper.run_once()))["finished_rollouts"] == 20  # in batches of 8
        assert store.devices("old") == [] and len(store.devices("running")) == 20
        old = store.get("old")
        assert old is not None and old.state == "succeeded" and "20 devices" in old.detail
        assert keeper.metrics().pruned["finished_rollouts"] == 20
    finally:
        if reports is not None:
            reports.close()
        store.close()
        jobs.close()
        registry.close()


# -- the worker's ledger ---------------------------------------------------------------------
async def test_ledger_entries_inside_the_window_keep_a_job_from_running_twice(
    clock: VirtualClock, tmp_path: Path
) -> None:
    ledger = JobLedger.open(tmp_path / "worker.db", clock=clock)
    keeper = Housekeeper(clock=clock, interval_s=600, batch_rows=10,
                         tasks=[limited("job_ledger", lambda n: ledger.prune(DAY, limit=n))])
    await keeper.start()
    try:
        sizes = []
        for hour in range(24 * 4):
            for i in range(5):
                assert ledger.complete(f"j{hour}-{i}", ok=True)
            if hour == 23:  # re-offered 23 h later: answered from the ledger, not run again
                assert not ledger.complete("j0-0", ok=True)
            await clock.advance(HOUR)
            sizes.append(ledger.count())
        assert max(sizes) <= 5 * 25
        assert ledger.lookup("j0-0") is None
    finally:
        await keeper.stop()
        ledger.close()


# -- the agents ------------------------------------------------------------------------------
async def test_agents_start_and_stop_housekeeping_and_the_leader_ignores_a_late_redelivery(
    clock: VirtualClock, tmp_path: Path
) -> None:
    broker = MemoryBroker(clock=clock)
    hk = {"interval_s": 600.0, "processed_retention_s": 2 * HOUR}  # >= 1000 attempts x 5 s cap
    gw = await leader(clock, tmp_path, broker=broker, housekeeping=hk)
    w1 = await worker(clock, tmp_path, "w1", broker=broker, sections={"housekeeping": hk})
    rogue = MemoryTransport(broker, "rogue")
    replies: list[InboundMessage] = []

    async def collect(message: InboundMessage) -> None:
        replies.append(message)

    await rogue.subscribe(topics.reply("t", "d9", "rogue"), collect)
    await rogue.start()
    envelope = Envelope(id="tel-1", kind="telemetry", sender="d9", receiver="leader",
                        payload=msgspec.msgpack.encode(_telemetry("d9", 1)))

    async def send() -> str:
        await rogue.publish(topics.up("t", "d9"), encode(envelope), response_topic=topics.reply("t", "d9", "rogue"),
                            correlation=b"c")
        await clock.advance(1)
        return decode_reply(replies[-1].payload).status

    try:
        assert gw.housekeeping is not None and w1.housekeeping is not None
        assert set(gw.housekeeping.tasks) == {"processed_messages", "confirmed_jobs", "app_messages",
                                             "rollout_processed", "finished_rollouts"}
        assert w1.housekeeping.tasks == ("job_ledger",)
        assert await send() == "accepted"
        await clock.advance(1.75 * HOUR)  # close to the window's end, after ten pruning rounds
        assert gw.housekeeping.metrics().rounds >= 10 and w1.housekeeping.metrics().rounds >= 10
        assert await send() == "accepted"  # the sender hears it is done ...
        record = gw.registry.device("d9")
        assert record is not None and record.telemetry_count == 1  # ... and it counts once
        await clock.advance(HOUR)
        assert not gw.registry.is_processed("tel-1")  # forgotten once the window passed
    finally:
        await rogue.stop()
        await stop_all(gw, w1, clock=clock)
    rounds = gw.housekeeping.metrics().rounds
    await clock.advance(HOUR)
    assert gw.housekeeping.metrics().rounds == rounds
