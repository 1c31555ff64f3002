"""The leader agent on the in-memory broker and virtual time: refusals, work-pulling, crash and
restart, two leaders on a shared subscription."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import leader, pending, stop_all, until, with_time, worker

from agent.core.clock import VirtualClock
from agent.core.codec import Envelope, decode_reply, encode
from agent.leader.agent import LEADER_DB
from agent.protocol import Heartbeat, JobSubmit
from agent.transport import topics
from agent.transport.base import InboundMessage
from agent.transport.memory import MemoryBroker, MemoryTransport


def _hb(device: str, seq: int) -> bytes:
    return msgspec.msgpack.encode(Heartbeat(device_id=device, seq=seq, uptime_s=1.0))


async def test_forged_malformed_and_oversized_messages_are_refused_and_recorded(
    clock: VirtualClock, broker: MemoryBroker, tmp_path: Path
) -> None:
    gw = await leader(clock, tmp_path, broker=broker, mqtt={"max_payload_bytes": 2048})
    rogue = MemoryTransport(broker, "rogue", max_payload_bytes=1 << 20)
    replies: list[InboundMessage] = []

    async def collect(message: InboundMessage) -> None:
        replies.append(message)

    await rogue.subscribe("ea/v1/t/+/reply/rogue", collect)
    await rogue.start()
    try:
        await clock.advance(0.1)

        async def send(device: str, envelope: Envelope | bytes) -> None:
            data = envelope if isinstance(envelope, bytes) else encode(envelope)
            await rogue.publish(topics.up("t", device), data, response_topic=topics.reply("t", device, "rogue"),
                                correlation=str(len(replies)).encode())
            await clock.advance(0.1)

        # 1. sender id does not match the topic's device
        await send("w1", Envelope(id="e1", kind="heartbeat", sender="w2", receiver="leader", payload=_hb("w2", 1)))
        # 2. the envelope matches the topic, the payload names another device
        await send("w1", Envelope(id="e2", kind="heartbeat", sender="w1", receiver="leader", payload=_hb("w9", 1)))
        # 3. not msgpack at all; 4. a payload the heartbeat schema refuses
        await send("w1", b"\xc1\x00 this is not an envelope")
        await send("w1", Envelope(id="e4", kind="heartbeat", sender="w1", receiver="leader", payload=b"\x93\x01"))
        # 5. too big; 6. a kind the leader does not take
        await send("w1", Envelope(id="e5", kind="telemetry", sender="w1", receiver="leader", payload=b"x" * 4096))
        await send("w1", Envelope(id="e6", kind="job.offer", sender="w1", receiver="leader", payload=b""))
        statuses = [decode_reply(r.payload).status for r in replies]
        assert statuses == ["rejected"] * 6
        reasons = [r.reason for r in reversed(gw.rejects.list())]
        assert len(reasons) == 6
        assert "does not match" in reasons[0]
        assert "names device 'w9'" in reasons[1]
        assert "exceeds max_payload_bytes" in reasons[4]
        assert gw.rejects.total() == 6
        # still running: a good heartbeat is accepted and lands in the registry
        await send("w1", Envelope(id="e7", kind="heartbeat", sender="w1", receiver="leader", payload=_hb("w1", 5)))
        assert decode_reply(replies[-1].payload).status == "accepted"
        await clock.advance(1)
        record = gw.registry.device("w1")
        assert record is not None and record.hb_seq == 5
    finally:
        await rogue.stop()
        await stop_all(gw, clock=clock)


async def test_work_pulling_survives_a_lost_worker(clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
    gw = await leader(clock, tmp_path, broker=broker)
    jobs = {"demand_window": 2}
    workers = [await worker(clock, tmp_path, f"w{i}", broker=broker, sections={"jobs": jobs}) for i in range(3)]
    try:
        await until(clock, lambda: len(gw.jobs_queue.workers()) == 3, what="3 workers registered")
        await gw.submit_jobs([JobSubmit(job_id=f"job-{n:02d}", kind="sleep", payload=b"2") for n in range(50)])
        await until(clock, lambda: gw.jobs_queue.stats().confirmed >= 10, what="10 jobs confirmed")
        victim = workers[1]
        held = [o.job_id for o in gw.jobs_queue.held_by(victim.device_id)]
        assert held, "the victim should hold unconfirmed jobs when it dies"
        await victim.transport.abort()  # dies: the broker publishes its last will
        await stop_all(victim, clock=clock)
        await until(clock, lambda: gw.jobs_queue.counts()["confirmed"] == 50, limit_s=900, what="all jobs confirmed")
        stats = gw.jobs_queue.stats()
        assert stats.requeued >= len(held)
        assert gw.leader_stats is not None
        assert gw.leader_stats.stats.results.get("confirmed") == 50  # each exactly once
        for job_id in held:
            record = gw.jobs_queue.job(job_id)
            assert record is not None and record.state == "confirmed"
    finally:
        await stop_all(*workers, gw, clock=clock)


async def test_leader_crash_and_restart_loses_nothing(
    clock: VirtualClock, broker: MemoryBroker, tmp_path: Path
) -> None:
    gw = await leader(clock, tmp_path, broker=broker)
    workers = [await worker(clock, tmp_path, f"w{i}", broker=broker, sections={"jobs": {"demand_window": 2}})
               for i in range(3)]
    try:
        await until(clock, lambda: len(gw.jobs_queue.workers()) == 3, what="workers registered")
        await gw.submit_jobs([JobSubmit(job_id=f"job-{n:02d}", kind="sleep", payload=b"1") for n in range(30)])
        sent = 0
        for _ in range(5):
            for w in workers:
                await w.send_telemetry("t", 1.0)
                sent += 1
            await clock.advance(2)
        # Crash: no goodbye, nothing flushed beyond what was committed.
        await gw.transport.abort()
        await with_time(clock, gw.system.stop(timeout_s=0.01))
        await with_time(clock, gw.relay.stop())
        await gw.outbox.close()
        gw.registry.close()
        gw.jobs_queue.close()
        gw.rejects.close()
        for _ in range(5):
            for w in workers:
                assert await with_time(clock, w.send_telemetry("t", 2.0)) == "outbox"
                sent += 1
            await clock.advance(2)
        gw2 = await leader(clock, tmp_path, broker=broker)
        assert gw2.jobs_queue.epoch == gw.jobs_queue.epoch + 1
        await until(clock, lambda: gw2.jobs_queue.counts()["confirmed"] == 30, limit_s=900, what="jobs confirmed")
        await until(clock, lambda: sum(d.telemetry_count for d in gw2.registry.devices()) == sent, what="telemetry")
        for w in workers:
            await until(clock, lambda w=w: _empty(w), what="drained")  # type: ignore[misc]
        assert sum(d.telemetry_count for d in gw2.registry.devices()) == sent  # nothing applied twice
        rows = gw2.jobs_queue.counts()
        assert rows == {"pending": 0, "confirmed": 30}
        await stop_all(*workers, gw2, clock=clock)
        db = tmp_path / "gw" / LEADER_DB
        assert db.exists()
    finally:
        await stop_all(*workers, clock=clock)


async def _empty(w) -> bool:  # type: ignore[no-untyped-def]
    return await pending(w, "telemetry") == 0


async def test_two_leaders_split_the_fleet_and_one_dies(
    clock: VirtualClock, broker: MemoryBroker, tmp_path: Path
) -> None:
    group = {"shared_group": "leaders"}
    gw1 = await leader(clock, tmp_path, broker=broker, name="gw1", leader=group)
    gw2 = await leader(clock, tmp_path, broker=broker, name="gw2", leader=group)
    assert gw1.inbox.topic_filter == "$share/leaders/ea/v1/t/+/up"
    workers = [await worker(clock, tmp_path, f"w{i}", broker=broker) for i in range(6)]
    try:
        sent = 0
        for round_ in range(10):
            for w in workers:
                await w.send_telemetry("t", float(round_))
                sent += 1
            if round_ == 4:
                await gw1.transport.abort()  # killed: its share goes to gw2
            await clock.advance(3)
        await until(clock, lambda: sum(d.telemetry_count for d in gw2.registry.devices())
                    + sum(d.telemetry_count for d in gw1.registry.devices()) >= sent, what="all telemetry")
        first = sum(d.telemetry_count for d in gw1.registry.devices())
        second = sum(d.telemetry_count for d in gw2.registry.devices())
        assert first > 0 and second > 0  # the shared subscription split the work
        assert first + second >= sent  # nothing lost (a record may be in both after the kill)
        assert second <= sent
    finally:
        await stop_all(*workers, gw2, clock=clock)
        await gw1.transport.stop()
        await stop_all(gw1, clock=clock)


async def test_job_demand_rides_on_the_heartbeat(clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
    """One uplink message per interval: the worker sends no JobDemand of its own, the leader
    registers the demand from the first heartbeat, does nothing for the repeats, and registers it
    again once it lost the worker and heard from it anew."""
    gw = await leader(clock, tmp_path, broker=broker)
    w = await worker(clock, tmp_path, "w1", broker=broker, sections={"jobs": {"demand_window": 3}})
    sent_kinds: list[str] = []
    try:
        await until(clock, lambda: len(gw.jobs_queue.workers()) == 1, what="the worker registered")
        intake = gw.intake_stats
        assert intake is not None and gw.leader_stats is not None
        assert intake.stats.demand_registered == 1
        assert gw.leader_stats.stats.demands == {"registered": 1}
        original = w.link.send

        async def spy(message: msgspec.Struct) -> None:
            sent_kinds.append(type(message).__name__)
            await original(message)

        w.link.send = spy  # type: ignore[method-assign]
        beats = intake.stats.received
        await clock.advance(60)  # twelve more heartbeats
        assert intake.stats.received >= beats + 10
        assert intake.stats.demand_registered == 1  # a repeated demand changes nothing
        assert "JobDemand" not in sent_kinds
        gw.leader_stats.lose_workers([w.device_id], "test")
        assert len(gw.jobs_queue.workers()) == 0
        await until(clock, lambda: len(gw.jobs_queue.workers()) == 1, what="registered again")
        assert intake.stats.demand_registered == 2
        await gw.submit_jobs([JobSubmit(job_id=f"j{n}", kind="sleep", payload=b"0") for n in range(5)])
        await until(clock, lambda: gw.jobs_queue.stats().confirmed == 5, what="jobs confirmed")
    finally:
        await stop_all(w, gw, clock=clock)


async def test_a_late_heartbeat_of_an_earlier_run_or_of_another_worker_registers_nothing(
        clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
    from agent.protocol import JobDemand

    gw = await leader(clock, tmp_path, broker=broker)
    try:
        intake = gw.intake_stats
        assert intake is not None

        def demand(incarnation: str, worker: str = "w9") -> JobDemand:
            return JobDemand(worker=worker, incarnation=incarnation, window=2)

        def beat(seq: int, d: JobDemand) -> None:
            intake._batch["w9"] = Heartbeat(device_id="w9", seq=seq, uptime_s=1.0, wire=2, demand=d)
            intake.flush()

        beat(2_000_000_001, demand("run-2"))
        await clock.advance(1)
        assert gw.jobs_queue.bound(demand("run-2"))
        beat(1_000_000_050, demand("run-1"))  # older: made before the worker restarted
        beat(2_000_000_002, demand("x", worker="w8"))  # names another worker than its device
        await clock.advance(1)
        assert gw.jobs_queue.bound(demand("run-2")) and not gw.jobs_queue.bound(demand("run-1"))
        assert "w8" not in gw.jobs_queue.workers()
        assert intake.stats.demand_refused == 1 and intake.stats.demand_registered == 1
        # a heartbeat of wire 1 (an agent from before) carries no demand: its JobDemand still works
        old = Heartbeat(device_id="w7", seq=5, uptime_s=1.0)
        assert old.wire == 1 and old.demand is None
    finally:
        await stop_all(gw, clock=clock)


async def test_a_worker_from_before_registers_with_a_jobdemand_message(
        clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
    """During a fleet upgrade the new leader still takes the old wire: heartbeats without a
    demand (wire 1) and the JobDemand message of their own."""
    from agent.protocol import KIND_JOB_DEMAND, JobDemand

    gw = await leader(clock, tmp_path, broker=broker)
    old = MemoryTransport(broker, "old-w")
    replies: list[InboundMessage] = []

    async def collect(message: InboundMessage) -> None:
        replies.append(message)

    await old.subscribe("ea/v1/t/+/reply/old-w", collect)
    await old.start()
    try:
        await clock.advance(0.1)
        for n, (kind, payload) in enumerate([
            ("heartbeat", _hb("w5", 1)),
            (KIND_JOB_DEMAND, msgspec.msgpack.encode(JobDemand(worker="w5", incarnation="old-1", window=2))),
        ]):
            env = Envelope(id=f"o{n}", kind=kind, sender="w5", receiver="leader", payload=payload)
            await old.publish(topics.up("t", "w5"), encode(env), response_topic=topics.reply("t", "w5", "old-w"),
                              correlation=str(n).encode())
            await clock.advance(0.5)
        assert [decode_reply(r.payload).status for r in replies] == ["accepted", "accepted"]
        assert gw.jobs_queue.bound(JobDemand(worker="w5", incarnation="old-1", window=2))
    finally:
        await old.stop()
        await stop_all(gw, clock=clock)


async def test_two_leaders_on_postgresql_share_one_job_queue_and_hand_it_over(
    clock: VirtualClock, broker: MemoryBroker, tmp_path: Path, pg_url: str
) -> None:
    """gw1, started first, runs the fleet's job queue; gw2 stands by, posting the job results and
    the demands it hears for gw1. gw1 stops with jobs in
    flight: gw2 opens the queue under the next epoch and every job is confirmed once."""
    group = {"shared_group": "leaders", "database": pg_url}
    gw1 = await leader(clock, tmp_path, broker=broker, name="gw1", leader=group)
    gw2 = await leader(clock, tmp_path, broker=broker, name="gw2", leader=group)
    workers = [await worker(clock, tmp_path, f"w{i}", broker=broker, sections={"jobs": {"demand_window": 2}})
               for i in range(4)]
    try:
        assert (gw1.jobs_queue.held, gw2.jobs_queue.held) == (True, False)
        assert await gw1.checks()["job queue"]() == (True, "running: this leader holds the lease")
        assert await gw2.checks()["job queue"]() == (True, "standing by: leader gw1 holds the lease")
        await until(clock, lambda: len(gw1.jobs_queue.workers()) == 4, what="every worker's demand at gw1")
        await gw1.submit_jobs([JobSubmit(job_id=f"j{n:02d}", kind="sleep", payload=b"2") for n in range(24)])
        await until(clock, lambda: gw1.jobs_queue.stats().confirmed >= 4, what="some jobs confirmed")
        epoch = gw1.jobs_queue.epoch
        await stop_all(gw1, clock=clock)  # it gives the lease up: gw2 takes the queue at its next round
        await until(clock, lambda: gw2.jobs_queue.held, what="gw2 running the job queue")
        assert gw2.jobs_queue.epoch == epoch + 1
        await until(clock, lambda: gw2.jobs_queue.counts()["confirmed"] == 24, what="every job confirmed")
        assert gw2.jobs_queue.counts() == {"pending": 0, "confirmed": 24}
        assert await gw2.checks()["job queue"]() == (True, "running: this leader holds the lease")
        # the results workers gave gw2 while gw1 ran the queue were posted for gw1, not refused
        assert gw2.leader_stats is not None and gw2.leader_stats.stats.results.get("posted", 0) > 0
    finally:
        await stop_all(*workers, gw2, clock=clock)


async def test_a_standby_leader_says_it_stands_by_and_status_names_who_runs_the_rollouts(
    clock: VirtualClock, broker: MemoryBroker, tmp_path: Path, pg_url: str
) -> None:
    """Two leaders on one PostgreSQL database: /healthz of the one without the orchestrator lease
    says it stands by and who holds it (not "running" like the holder); `status` names the
    holder; when the holder stops, the other takes the rollouts and says so."""
    from agent.leader.env import GatewayEnv
    from agent.leader.rollout import rollout_part
    from agent.leader.status import format_status, summarize

    group = {"shared_group": "leaders", "database": pg_url, "rollout_lease_s": 15.0}
    gw1 = await leader(clock, tmp_path, broker=broker, name="gw1", leader=group)
    first = await rollout_part(gw1, GatewayEnv(rollout_poll_s=1.0))
    await first.start()
    await until(clock, lambda: first.orchestrating, what="gw1 running the rollouts")
    gw2 = await leader(clock, tmp_path, broker=broker, name="gw2", leader=group)
    second = await rollout_part(gw2, GatewayEnv(rollout_poll_s=1.0))
    await second.start()
    try:
        await clock.advance(1)
        assert await first.checks()["rollout orchestrator"]() == (True, "running: this leader holds the lease")
        assert await second.checks()["rollout orchestrator"]() == (True, "standing by: leader gw1 holds the lease")
        assert "rollouts: run by leader gw1 since " in format_status(summarize(pg_url, clock=clock))
        await first.stop()  # it gives the lease up: gw2 takes it at its next renewal
        await until(clock, lambda: second.orchestrating, what="gw2 running the rollouts")
        assert await second.checks()["rollout orchestrator"]() == (True, "running: this leader holds the lease")
        assert "rollouts: run by leader gw2 since " in format_status(summarize(pg_url, clock=clock))
    finally:
        await second.stop()
        await stop_all(gw1, gw2, clock=clock)
