"""A big fleet stops at once: the leader (memory broker, virtual time) releases every held job.

Thousands of devices register demand and heartbeat through the in-memory broker, take jobs, then
all fall silent; the heartbeat deadline loses them in one batch. Every unconfirmed job must be
back at the head of the pending pool, oldest submission first, and go to the next worker.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import leader, stop_all, until, with_time

from agent.core.clock import VirtualClock
from agent.core.codec import Envelope, encode
from agent.leader.jobs import JobQueue
from agent.protocol import Heartbeat, JobDemand, JobResult, JobSubmit, kind_of
from agent.transport import topics
from agent.transport.base import InboundMessage
from agent.transport.memory import MemoryBroker, MemoryTransport

DEVICES = 2500
WINDOW = 2


def _envelope(device: str, n: int, message: msgspec.Struct) -> bytes:
    return encode(Envelope(id=f"{device}-{n}", kind=kind_of(message), sender=device, receiver="leader",
                           payload=msgspec.msgpack.encode(message)))


@pytest.mark.slow
async def test_a_fleet_lost_at_once_puts_every_held_job_back_in_order(tmp_path: Path) -> None:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock, max_queued_per_session=100_000)
    gw = await leader(clock, tmp_path, broker=broker, leader={"job_window_max": 8},
                      mailbox={"capacity": 4096})
    fleet = MemoryTransport(broker, "fleet")
    replies: list[InboundMessage] = []

    async def collect(message: InboundMessage) -> None:
        replies.append(message)

    await fleet.subscribe("ea/v1/t/+/reply/sim", collect)
    await fleet.start()

    async def up(device: str, n: int, message: msgspec.Struct) -> None:
        await fleet.publish(topics.up("t", device), _envelope(device, n, message),
                            response_topic=topics.reply("t", device, "sim"), correlation=f"{device}-{n}".encode())

    devices = [f"d{i:04d}" for i in range(DEVICES)]
    queue: JobQueue = gw.jobs_queue
    try:
        for start in range(0, DEVICES, 250):
            for device in devices[start:start + 250]:
                await up(device, 1, Heartbeat(device_id=device, seq=1, uptime_s=1.0))
                await up(device, 2, JobDemand(worker=device, incarnation="run-1", window=WINDOW))
            await clock.advance(0.05)
        await until(clock, lambda: len(queue.workers()) == DEVICES, step_s=0.1, what="fleet registered")
        total = DEVICES * WINDOW + 300
        await with_time(clock, gw.submit_jobs([JobSubmit(job_id=f"job-{n:05d}", kind="k") for n in range(total)]))
        held = {d: [o.job_id for o in queue.held_by(d)] for d in devices}
        assert all(len(jobs) == WINDOW for jobs in held.values())
        # a few devices finish a job before the fleet goes dark
        for device in devices[::10]:
            job_id = held[device].pop(0)
            await up(device, 3, JobResult(job_id=job_id, epoch=queue.epoch, worker=device, ok=True))
        await until(clock, lambda: queue.stats().confirmed == DEVICES // 10, step_s=0.1, what="results")
        # (their freed demand took the next jobs)
        unconfirmed = sorted(o.job_id for d in devices for o in queue.held_by(d))
        assert len(unconfirmed) == DEVICES * WINDOW
        never_offered = queue.pending_ids()
        # silence: the heartbeat deadline (30 s) loses the whole fleet in one batch
        await until(clock, lambda: not queue.workers(), limit_s=120, step_s=1.0, what="fleet lost")
        assert queue.stats().in_flight == 0
        assert queue.pending_ids() == unconfirmed + never_offered
        assert gw.leader_stats is not None and gw.leader_stats.stats.jobs_requeued == len(unconfirmed)
        # the next worker is offered the oldest released jobs first, with their original ids
        await up("late", 1, JobDemand(worker="late", incarnation="run-1", window=8))
        await until(clock, lambda: len(queue.held_by("late")) == 8, step_s=0.1, what="late worker served")
        assert [o.job_id for o in queue.held_by("late")] == unconfirmed[:8]
    finally:
        await fleet.stop()
        await stop_all(gw, clock=clock)
