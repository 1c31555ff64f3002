"""One hostile device with valid credentials must not stop the leader: integers beyond SQLite's
64 bits and timestamps from the far future are refused with a reason, and a value the database
cannot store fails alone, never the batch of other devices' messages around it."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import leader, stop_all, until, worker

from agent.core.clock import VirtualClock
from agent.core.codec import Envelope, decode_reply, encode
from agent.core.errors import UnstorableValue
from agent.leader.actors import Durable, HeartbeatIntake
from agent.leader.registry import DeviceRegistry
from agent.protocol import Heartbeat, Telemetry
from agent.transport import topics
from agent.transport.base import InboundMessage
from agent.transport.memory import MemoryBroker, MemoryTransport

BEYOND = [2**63, 2**64 - 1]


class Rogue:
    """A credentialed device that writes raw envelopes (any bytes) on its own up topic."""

    def __init__(self, broker: MemoryBroker, clock: VirtualClock, device: str = "rogue") -> None:
        self.device = device
        self.clock = clock
        self.transport = MemoryTransport(broker, device, max_payload_bytes=1 << 20)
        self.replies: list[InboundMessage] = []

    async def start(self) -> None:
        async def collect(message: InboundMessage) -> None:
            self.replies.append(message)

        await self.transport.subscribe(topics.reply("t", self.device, "r"), collect)
        await self.transport.start()

    async def send(self, kind: str, payload: dict[str, object]) -> tuple[str, str]:
        n = len(self.replies)
        env = Envelope(id=f"e{n}", kind=kind, sender=self.device, receiver="leader",
                       payload=msgspec.msgpack.encode(payload))
        await self.transport.publish(topics.up("t", self.device), encode(env),
                                     response_topic=topics.reply("t", self.device, "r"), correlation=env.id.encode())
        await until(self.clock, lambda: len(self.replies) > n, step_s=0.1, what="a reply")
        reply = decode_reply(self.replies[-1].payload)
        return reply.status, reply.reason


@pytest.mark.parametrize("value", BEYOND)
async def test_a_heartbeat_seq_beyond_int64_is_refused_and_the_fleet_stays_online(
        clock: VirtualClock, broker: MemoryBroker, tmp_path: Path, value: int) -> None:
    gw = await leader(clock, tmp_path, broker=broker, leader={"process_interval_s": 1.0})
    honest = await worker(clock, tmp_path, "w1", broker=broker, sections={"heartbeat": {"interval_s": 1.0}})
    rogue = Rogue(broker, clock)
    await rogue.start()
    try:
        await until(clock, lambda: gw.registry.device("w1") is not None, what="w1 registered")
        for _ in range(10):
            status, reason = await rogue.send("heartbeat", {"device_id": "rogue", "seq": value, "uptime_s": 1.0})
            assert status == "rejected" and "seq" in reason
            status, reason = await rogue.send("telemetry", {"device_id": "rogue", "seq": 1, "name": "t",
                                                            "ts_ms": value, "value": 1.0})
            assert status == "rejected" and "ts_ms" in reason
        seen = gw.registry.device("w1")
        assert seen is not None
        before = seen.hb_seq
        await until(clock, lambda: (d := gw.registry.device("w1")) is not None and d.hb_seq > before,
                    what="w1's heartbeats still applied")
        assert gw.system.failures == []  # every leader actor still running
        assert gw.registry.counts()[0] >= 1
        assert gw.rejects.total() >= 20
    finally:
        await rogue.transport.stop()
        await stop_all(honest, gw, clock=clock)


async def test_telemetry_from_the_far_future_is_refused(clock: VirtualClock, broker: MemoryBroker,
                                                        tmp_path: Path) -> None:
    gw = await leader(clock, tmp_path, broker=broker)
    rogue = Rogue(broker, clock)
    await rogue.start()
    try:
        far = clock.now_ms() + 146_000_000 * 365 * 86_400_000  # 146 million years ahead, within int64
        status, reason = await rogue.send("telemetry", {"device_id": "rogue", "seq": 1, "name": "t", "ts_ms": far,
                                                        "value": 1.0})
        assert status == "rejected" and "ahead of the leader's clock" in reason
        now = clock.now_ms()
        status, _ = await rogue.send("telemetry", {"device_id": "rogue", "seq": 2, "name": "t", "ts_ms": now,
                                                   "value": 1.0})
        assert status == "accepted"
    finally:
        await rogue.transport.stop()
        await stop_all(gw, clock=clock)


async def test_a_device_keeps_at_most_its_share_of_telemetry_names(clock: VirtualClock, broker: MemoryBroker,
                                                                  tmp_path: Path) -> None:
    gw = await leader(clock, tmp_path, broker=broker, leader={"telemetry_names_max": 5})
    rogue = Rogue(broker, clock)
    await rogue.start()
    honest = await worker(clock, tmp_path, "w1", broker=broker)
    try:
        now = clock.now_ms()

        def record(seq: int, name: str) -> dict[str, object]:
            return {"device_id": "rogue", "seq": seq, "name": name, "ts_ms": now, "value": float(seq)}

        answers = [await rogue.send("telemetry", record(n, f"name-{n}")) for n in range(8)]
        assert [status for status, _ in answers] == ["accepted"] * 5 + ["rejected"] * 3
        assert "already has 5 telemetry names" in answers[-1][1]
        assert await rogue.send("telemetry", record(9, "name-0")) == ("accepted", "")  # a known name goes on
        kept = gw.registry.last_telemetry("rogue")
        assert {name: r.seq for name, r in kept.items()} == {"name-0": 9, "name-1": 1, "name-2": 2, "name-3": 3,
                                                             "name-4": 4}
        assert [r.reason for r in gw.rejects.list()][0].startswith("rogue already has 5 telemetry names")
        await honest.send_telemetry("temp", 1.0)  # another device has a share of its own
        await until(clock, lambda: getattr(gw.registry.device("w1"), "telemetry_count", 0) == 1, what="w1's record")
    finally:
        await rogue.transport.stop()
        await stop_all(honest, gw, clock=clock)


def test_a_heartbeat_the_registry_cannot_store_fails_alone(tmp_path: Path) -> None:
    """Defence behind the codec: a value that still reaches the store fails by itself."""
    clock = VirtualClock()
    refused: list[tuple[str, str]] = []
    with DeviceRegistry.open(tmp_path / "leader.db", clock=clock) as registry:
        intake = HeartbeatIntake(registry, on_refused=lambda hb, why: refused.append((hb.device_id, why)))
        # Structs are not validated when built in-process: this one carries what the wire refuses.
        intake._batch = {
            "a": Heartbeat(device_id="a", seq=3, uptime_s=1.0),
            "poison": Heartbeat(device_id="poison", seq=2**63, uptime_s=1.0),
            "b": Heartbeat(device_id="b", seq=4, uptime_s=1.0),
        }
        intake.flush()
        assert [d.device_id for d in registry.devices()] == ["a", "b"]
        assert intake.stats.applied == 2 and intake.stats.refused == 1
        assert refused and refused[0][0] == "poison" and "64-bit" in refused[0][1]


async def test_a_telemetry_record_the_registry_cannot_store_fails_alone(clock: VirtualClock, broker: MemoryBroker,
                                                                        tmp_path: Path) -> None:
    gw = await leader(clock, tmp_path, broker=broker)
    try:
        assert gw.leader is not None
        loop = asyncio.get_running_loop()
        good: asyncio.Future[bool] = loop.create_future()
        bad: asyncio.Future[bool] = loop.create_future()
        now = clock.now_ms()
        gw.leader.tell(Durable("m1", "a", Telemetry(device_id="a", seq=1, name="t", ts_ms=now, value=1.0), good,
                                 gw.leader_stats.telemetry))
        gw.leader.tell(Durable("m2", "z", Telemetry(device_id="z", seq=2**63, name="t", ts_ms=now, value=1.0), bad,
                                 gw.leader_stats.telemetry))
        await until(clock, lambda: good.done() and bad.done(), step_s=0.1, what="both answered")
        assert good.result() is True
        with pytest.raises(UnstorableValue):
            bad.result()
        assert gw.system.failures == []
        record = gw.registry.device("a")
        assert record is not None and record.telemetry_count == 1
    finally:
        await stop_all(gw, clock=clock)


async def test_the_leader_answers_only_on_the_senders_own_reply_topic(clock: VirtualClock, broker: MemoryBroker,
                                                                       tmp_path: Path) -> None:
    """A device naming another device's `down` topic as its response topic gets no answer there
    (it could not publish there itself): the leader records the refusal instead."""
    gw = await leader(clock, tmp_path, broker=broker)
    victim = MemoryTransport(broker, "victim-listener")
    seen: list[InboundMessage] = []

    async def collect(message: InboundMessage) -> None:
        seen.append(message)

    await victim.subscribe(topics.down("t", "w2"), collect)
    await victim.start()
    rogue = MemoryTransport(broker, "rogue")
    await rogue.start()
    try:
        env = Envelope(id="e1", kind="heartbeat", sender="rogue", receiver="leader",
                       payload=msgspec.msgpack.encode({"device_id": "rogue", "seq": 1, "uptime_s": 1.0}))
        await rogue.publish(topics.up("t", "rogue"), encode(env), response_topic=topics.down("t", "w2"),
                            correlation=b"e1")
        await until(clock, lambda: gw.rejects.total() == 1, step_s=0.1, what="the refusal recorded")
        assert "not a reply topic of device 'rogue'" in gw.rejects.list()[0].reason
        await clock.advance(1.0)
        assert seen == []  # nothing was published on w2's down topic
    finally:
        await rogue.stop()
        await victim.stop()
        await stop_all(gw, clock=clock)


async def test_a_device_cannot_submit_jobs_an_operator_can(clock: VirtualClock, broker: MemoryBroker,
                                                           tmp_path: Path) -> None:
    gw = await leader(clock, tmp_path, broker=broker, leader={"operators": ["ops"]})
    device, operator = Rogue(broker, clock, "pi-0004"), Rogue(broker, clock, "ops")
    await device.start()
    await operator.start()
    try:
        status, reason = await device.send("job.submit", {"job_id": "j1", "kind": "sleep", "payload": b"1"})
        assert status == "rejected" and "operator" in reason
        assert gw.jobs_queue.stats().submitted == 0
        status, _ = await operator.send("job.submit", {"job_id": "j2", "kind": "sleep", "payload": b"1"})
        assert status == "accepted"
        assert gw.jobs_queue.stats().submitted == 1
    finally:
        await device.transport.stop()
        await operator.transport.stop()
        await stop_all(gw, clock=clock)


async def test_a_wiped_device_is_online_again_at_its_first_heartbeat(clock: VirtualClock, broker: MemoryBroker,
                                                                      tmp_path: Path) -> None:
    """A new SD card (or a deleted worker.db) starts the seqs from the start again; the boot id
    of the new start tells the leader to take them, instead of ignoring the device for as long
    as the old seqs were ahead."""
    import shutil

    gw = await leader(clock, tmp_path, broker=broker, leader={"process_interval_s": 1.0})
    sections = {"heartbeat": {"interval_s": 1.0}}
    old = await worker(clock, tmp_path, "w1", broker=broker, sections=sections)
    try:
        await until(clock, lambda: (d := gw.registry.device("w1")) is not None and d.hb_seq is not None
                    and d.hb_seq >= 1_000_000_020, what="twenty heartbeats of the first life")
    finally:
        await stop_all(old, clock=clock)
    shutil.rmtree(tmp_path / "w1")  # wiped: no worker.db, no outbox
    new = await worker(clock, tmp_path, "w1", broker=broker, sections=sections,
                       rng=random.Random("another start"))  # an agent's start draws its boot id at random
    try:
        assert new.boot != old.boot and new.incarnation == old.incarnation == 1
        await until(clock, lambda: (d := gw.registry.device("w1")) is not None and d.hb_seq is not None
                    and d.hb_seq < 1_000_000_010, limit_s=10, what="the new life's heartbeats taken")
        record = gw.registry.device("w1")
        assert record is not None and record.online
    finally:
        await stop_all(new, gw, clock=clock)


async def test_a_flooding_device_is_slowed_to_its_share_and_others_are_served(
        clock: VirtualClock, broker: MemoryBroker, tmp_path: Path) -> None:
    gw = await leader(clock, tmp_path, broker=broker, leader={"device_rate_per_s": 5.0, "device_burst": 10})
    flood, honest = Rogue(broker, clock, "pi-0004"), Rogue(broker, clock, "pi-0001")
    await flood.start()
    await honest.start()
    try:
        answers = [await flood.send("heartbeat", {"device_id": "pi-0004", "seq": n + 1, "uptime_s": 1.0})
                   for n in range(30)]
        statuses = [status for status, _ in answers]
        assert statuses[:10] == ["accepted"] * 10  # the burst
        assert "busy" in statuses[10:]  # then its share: busy, which its relay backs off from
        assert all(reason == "over this device's share" for status, reason in answers if status == "busy")
        status, _ = await honest.send("heartbeat", {"device_id": "pi-0001", "seq": 1, "uptime_s": 1.0})
        assert status == "accepted"
        assert gw.rates is not None and gw.rates.limited >= 1
    finally:
        await flood.transport.stop()
        await honest.transport.stop()
        await stop_all(gw, clock=clock)


async def test_one_device_cannot_fill_the_rejects_table_or_the_log(clock: VirtualClock, broker: MemoryBroker,
                                                                  tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    import logging

    gw = await leader(clock, tmp_path, broker=broker, leader={"device_rate_per_s": 0.0})
    junk, other = Rogue(broker, clock, "pi-0004"), Rogue(broker, clock, "pi-0001")
    await junk.start()
    await other.start()
    try:
        status, _ = await other.send("nonsense", {})
        assert status == "rejected"
        with caplog.at_level(logging.WARNING, logger="agent.leader.agent"):
            for _ in range(150):
                assert (await junk.send("nonsense", {}))[0] == "rejected"
        rows = gw.rejects.list(limit=1000)
        assert sum(1 for r in rows if r.sender == "pi-0004") == 100  # capped per sender
        assert sum(1 for r in rows if r.sender == "pi-0001") == 1  # the other device's refusal stays
        lines = [r for r in caplog.records if "pi-0004" in r.getMessage()]
        assert len(lines) == 1  # one line per device and kind per minute, not 150
    finally:
        await junk.transport.stop()
        await other.transport.stop()
        await stop_all(gw, clock=clock)
