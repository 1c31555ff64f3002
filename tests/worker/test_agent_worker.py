"""The worker agent on the in-memory broker and virtual time."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import leader, pending, stop_all, until, worker

from agent.core.clock import VirtualClock
from agent.core.codec import Envelope
from agent.leader.agent import LeaderAgent
from agent.protocol import KIND_JOB_OFFER, JobOffer, encode_message
from agent.transport.base import InboundMessage
from agent.transport.memory import MemoryBroker
from agent.worker.actors import SEQ_PER_INCARNATION


async def test_broker_outage_keeps_one_heartbeat_row_and_all_telemetry(
    clock: VirtualClock, broker: MemoryBroker, tmp_path: Path
) -> None:
    gw = await leader(clock, tmp_path, broker=broker)
    devices = [await worker(clock, tmp_path, f"w{i}", broker=broker) for i in range(3)]
    try:
        await until(clock, lambda: gw.registry.counts()[0] == 3, what="3 devices online")
        broker.partition()  # the broker goes away for 10 minutes of fleet time
        sent = 0
        for minute in range(10):
            for w in devices:
                assert await w.send_telemetry("temp", float(minute)) == "outbox"
                sent += 1
            await clock.advance(60)
        for w in devices:
            assert await pending(w, "heartbeat") == 1  # 120 beats made, one row kept
            assert await pending(w, "telemetry") == 10
            assert w.heartbeat_actor is not None and w.heartbeat_actor.coalesced >= 100
        broker.heal()
        await until(clock, lambda: sum(gw.registry.last_telemetry(w.device_id).__len__() for w in devices) == 3
                    and sum(d.telemetry_count for d in gw.registry.devices()) == sent, what="telemetry arrived")
        await until(clock, _all_empty(devices), what="outboxes empty")
        await clock.advance(10)
        for w in devices:
            record = gw.registry.device(w.device_id)
            assert record is not None and record.telemetry_count == 10  # each exactly once
            assert w.heartbeat_actor is not None
            assert record.hb_seq == w.heartbeat_actor.last_seq
            stats = await w.outbox.stats()
            assert stats.conservation_ok and stats.dead_lettered == 0
    finally:
        await stop_all(*devices, gw, clock=clock)


def _all_empty(devices):  # type: ignore[no-untyped-def]
    async def check() -> bool:
        return all([await pending(w) == 0 for w in devices])

    return check


async def test_a_full_job_mailbox_answers_busy(clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
    release = asyncio.Event()
    started: list[str] = []

    async def slow(offer: JobOffer) -> bytes:
        started.append(offer.job_id)
        await release.wait()
        return b"done"

    w = await worker(clock, tmp_path, "w1", broker=broker, job_handler=slow, sections={"jobs": {"demand_window": 1}})
    try:
        replies = []
        for n in range(5):
            offer = JobOffer(job_id=f"j{n}", epoch=1, kind="k")
            env = Envelope(id=f"id{n}", kind=KIND_JOB_OFFER, sender="gw", receiver="w1",
                           payload=encode_message(offer))
            replies.append(await w._on_command(env, InboundMessage("x", b"")))
            await asyncio.sleep(0)
        statuses = [r.status for r in replies]
        assert statuses.count("busy") >= 1 and statuses[0] == "accepted"
        busy = next(r for r in replies if r.status == "busy")
        assert busy.retry_after_ms >= 1
        unknown = Envelope(id="u", kind="firmware.nope", sender="gw", receiver="w1")
        assert (await w._on_command(unknown, InboundMessage("x", b""))).status == "rejected"
    finally:
        release.set()
        await stop_all(w, clock=clock)


async def test_a_job_offered_twice_runs_once(clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
    runs: list[str] = []

    async def count(offer: JobOffer) -> bytes:
        runs.append(offer.job_id)
        return b"ok"

    w = await worker(clock, tmp_path, "w1", broker=broker, job_handler=count)
    try:
        assert w.jobs is not None
        for epoch in (1, 1, 2):
            w.jobs.tell(JobOffer(job_id="job-1", epoch=epoch, kind="k"))
            await clock.advance(0.1)
        assert runs == ["job-1"]
        assert w.ledger.count() == 1
        assert w.job_worker is not None and w.job_worker.duplicates == 2
        # Every offer is confirmed (the redeliveries from the ledger), nothing run twice: one row
        # per epoch (the repeated epoch-1 offer's confirmation is that row again, by its key).
        assert (await w.outbox.stats()).by_class["job.result"].enqueued == 2
    finally:
        await stop_all(w, clock=clock)


async def test_heartbeat_seq_grows_across_restarts(clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
    first = await worker(clock, tmp_path, "w1", broker=broker)
    await clock.advance(30)
    assert first.heartbeat_actor is not None
    last = first.heartbeat_actor.last_seq
    await stop_all(first, clock=clock)
    second = await worker(clock, tmp_path, "w1", broker=broker)
    try:
        await clock.advance(1)
        assert second.incarnation == first.incarnation + 1
        assert second.heartbeat_actor is not None
        assert second.heartbeat_actor.last_seq > last
        assert second.heartbeat_actor.last_seq // SEQ_PER_INCARNATION == second.incarnation
    finally:
        await stop_all(second, clock=clock)


async def test_heartbeats_report_the_outbox_backlog_the_leader_shows(
    clock: VirtualClock, broker: MemoryBroker, tmp_path: Path
) -> None:
    """A device that was cut off says in its first heartbeat back how much it still holds."""
    from agent.leader.fleet_view import device_detail
    from agent.leader.readonly import open_leader_db

    gw = await leader(clock, tmp_path, broker=broker)
    device = await worker(clock, tmp_path, "w0", broker=broker)
    try:
        await until(clock, lambda: gw.registry.counts()[0] == 1, what="online")
        broker.partition()
        for n in range(20):
            await device.send_telemetry("t", float(n))  # into the outbox: no leader to take them
        assert device.outbox.pending >= 20
        beat = device.heartbeat_actor.heartbeat(clock)
        assert beat.outbox_pending is not None and beat.outbox_pending >= 20
        broker.heal()
        await until(clock, lambda: _reported(gw) is not None, what="a heartbeat with the backlog applied")
        await until(clock, lambda: _empty(device), what="the backlog delivered")
        with open_leader_db(tmp_path / "gw" / "leader.db") as db:
            detail = device_detail(db, "w0")
        assert detail is not None and detail.outbox_pending is not None
    finally:
        await stop_all(device, gw, clock=clock)


def _reported(gw: LeaderAgent) -> int | None:
    """The backlog w0's newest applied heartbeat reported, if any."""
    from agent.leader.readonly import open_leader_db

    with open_leader_db(gw.registry.path) as db:
        found = db.registry.device("w0")
    return found[1].outbox_pending if found is not None and found[1].outbox_pending else None


async def _empty(w) -> bool:  # type: ignore[no-untyped-def]
    return await pending(w, "telemetry") == 0


async def test_the_leader_answered_gate_opens_only_when_a_leader_accepts_a_message(
    clock: VirtualClock, broker: MemoryBroker, tmp_path: Path
) -> None:
    """What a trial boot's health check waits for: the broker alone is not the leader."""
    w = await worker(clock, tmp_path, "w1", broker=broker)
    try:
        await until(clock, lambda: w.transport.connected.is_open, what="connected to the broker")
        await clock.advance(30)  # heartbeats go out; nobody answers them
        assert not w.leader_answered.is_open
        gw = await leader(clock, tmp_path, broker=broker)
        try:
            await until(clock, lambda: w.leader_answered.is_open, what="the leader accepted a heartbeat")
        finally:
            await stop_all(gw)
    finally:
        await stop_all(w)


async def test_an_online_device_writes_no_heartbeat_to_its_outbox_and_an_offline_one_holds_one(
    clock: VirtualClock, broker: MemoryBroker, tmp_path: Path
) -> None:
    gw = await leader(clock, tmp_path, broker=broker)
    w = await worker(clock, tmp_path, "w1", broker=broker)
    try:
        await until(clock, lambda: gw.registry.counts()[0] == 1, what="online")
        before = (await w.outbox.stats()).by_class.get("heartbeat")
        stored_before = before.enqueued if before is not None else 0
        direct_before = w.heartbeat_actor.direct if w.heartbeat_actor else 0
        await clock.advance(60)  # 12 beats, all answered by the leader
        after = (await w.outbox.stats()).by_class.get("heartbeat")
        assert (after.enqueued if after is not None else 0) == stored_before  # nothing written for them
        assert w.heartbeat_actor is not None and w.heartbeat_actor.direct >= direct_before + 11
        broker.partition()
        await clock.advance(60)
        assert await pending(w, "heartbeat") == 1  # offline: the newest one, held
        broker.heal()
        await until(clock, lambda: _no_heartbeat_held(w), what="the held heartbeat settled")
        stats = await w.outbox.stats()
        assert stats.conservation_ok, stats
    finally:
        await stop_all(w, gw, clock=clock)


async def _no_heartbeat_held(w) -> bool:  # type: ignore[no-untyped-def]
    return await pending(w, "heartbeat") == 0


async def test_what_the_applications_run_reaches_the_leader_in_a_full_heartbeat(
    clock: VirtualClock, broker: MemoryBroker, tmp_path: Path
) -> None:
    from agent.protocol import AppState

    gw = await leader(clock, tmp_path, broker=broker)
    w = await worker(clock, tmp_path, "w0", broker=broker)
    running: dict[str, AppState] = {"hello": AppState(version="1.0.0")}
    w.app_states = lambda: dict(running)
    try:
        await until(clock, lambda: gw.registry.app_states().get("w0") == running, what="hello 1.0.0 at the leader")
        running["hello"] = AppState(version="2.0.0", previous="1.0.0", health="healthy")  # a trial committed
        await until(clock, lambda: gw.registry.app_states().get("w0") == running, what="hello 2.0.0 at the leader")
    finally:
        await stop_all(w, gw, clock=clock)
