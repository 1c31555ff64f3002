"""The heartbeat intake's pace: with `process_interval_s` 0 a batch is what the mailbox holds;
above 0 it writes at once, then rests that long gathering the next batch, draining its mailbox
meanwhile (resting never fills it). PostgreSQL leaders rest 0.1 s by default."""

from __future__ import annotations

from pathlib import Path

from agent.actors import ActorSystem
from agent.core.clock import VirtualClock
from agent.leader.actors import HeartbeatIntake
from agent.leader.registry import DeviceRegistry
from agent.protocol import Heartbeat


async def test_a_resting_intake_writes_at_once_then_gathers_the_next_batch(tmp_path: Path) -> None:
    clock = VirtualClock()
    system = ActorSystem(clock=clock)
    with DeviceRegistry.open(tmp_path / "leader.db", clock=clock) as registry:
        intake = HeartbeatIntake(registry, process_interval_s=1.0)
        ref = system.spawn(intake, name="heartbeats", capacity=8, policy="reject")
        await system.start()
        try:
            ref.tell(Heartbeat(device_id="first", seq=1, uptime_s=1.0))
            await clock.settle()
            assert intake.stats.batches == 1 and registry.device("first") is not None  # written at once
            for n in range(40):  # five times the mailbox, while the intake rests
                ref.tell(Heartbeat(device_id=f"pi-{n}", seq=1, uptime_s=1.0))
                if n % 4 == 3:
                    await clock.settle()
            ref.tell(Heartbeat(device_id="pi-0", seq=2, uptime_s=2.0))  # the newer one of a device wins
            await clock.settle()
            assert intake.stats.batches == 1 and registry.device("pi-0") is None  # gathered, not written yet
            await clock.advance(1.0)
            assert intake.stats.batches == 2 and intake.stats.largest_batch == 40
            assert registry.device("pi-0").hb_seq == 2 and len(registry.devices()) == 41  # type: ignore[union-attr]
            await clock.advance(5.0)  # idle: nothing more is written, and the next one goes at once
            ref.tell(Heartbeat(device_id="late", seq=1, uptime_s=1.0))
            await clock.settle()
            assert intake.stats.batches == 3 and registry.device("late") is not None
        finally:
            await system.stop()


async def test_an_intake_without_rest_writes_what_its_mailbox_holds(tmp_path: Path) -> None:
    clock = VirtualClock()
    system = ActorSystem(clock=clock)
    with DeviceRegistry.open(tmp_path / "leader.db", clock=clock) as registry:
        intake = HeartbeatIntake(registry)
        ref = system.spawn(intake, name="heartbeats", capacity=64, policy="reject")
        await system.start()
        try:
            for n in range(10):
                ref.tell(Heartbeat(device_id=f"pi-{n}", seq=1, uptime_s=1.0))
            await clock.settle()
            assert len(registry.devices()) == 10 and intake.stats.batches == 1
        finally:
            await system.stop()
