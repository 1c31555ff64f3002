"""Request/reply between EnvelopeSender and EnvelopeInbox, the same scenarios on both transports."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from agent.core.clock import Clock, SystemClock, VirtualClock
from agent.core.codec import Envelope, Reply, decode_reply, encode
from agent.core.errors import Capacity, Permanent, Transient
from agent.outbox.types import OutboxRow
from agent.transport import topics
from agent.transport.base import InboundMessage, Transport
from agent.transport.endpoint import EnvelopeInbox, EnvelopeSender, envelope_from_row
from agent.transport.memory import MemoryBroker, MemoryTransport
from agent.transport.mqtt import MqttTransport

FLEET = "f1"
LEADER_IN = topics.leaders_up(FLEET)
REPLY_TIMEOUT_S = 1.0


class World:
    """Transports on one broker: an in-memory world on a VirtualClock, or a real mosquitto."""

    def __init__(self, kind: str, url: str | None = None) -> None:
        self.kind = kind
        self.url = url
        self.clock: Clock = VirtualClock() if kind == "memory" else SystemClock()
        self.broker = MemoryBroker(clock=self.clock) if kind == "memory" else None  # type: ignore[arg-type]
        self.transports: list[Transport] = []

    async def client(self, client_id: str, **kwargs: Any) -> Transport:
        transport: Transport
        if self.broker is not None:
            transport = MemoryTransport(self.broker, client_id, **kwargs)
        else:
            assert self.url is not None
            transport = MqttTransport.from_url(
                self.url, client_id=client_id, reconnect_min_s=0.05, reconnect_max_s=0.5, **kwargs
            )
        await transport.start()
        await asyncio.wait_for(transport.connected.wait_open(), 10)
        self.transports.append(transport)
        return transport

    async def finish(self, task: asyncio.Task[Any], *, within_s: float) -> Any:
        """Let `within_s` of the world's time pass and return the task's outcome."""
        if isinstance(self.clock, VirtualClock):
            await self.clock.advance(within_s)
        return await asyncio.wait_for(task, within_s + 10)

    async def close(self) -> None:
        for transport in reversed(self.transports):
            await transport.stop()


@pytest.fixture(params=["memory", pytest.param("mqtt", marks=pytest.mark.mqtt)])
async def world(request: pytest.FixtureRequest) -> AsyncIterator[World]:
    if request.param == "mqtt":
        broker = request.getfixturevalue("mosquitto")
        world = World("mqtt", broker.url)
    else:
        world = World("memory")
    try:
        yield world
    finally:
        await world.close()


def envelope(id_: str, sender: str = "dev-1", payload: bytes = b"p") -> Envelope:
    return Envelope(id=id_, kind="telemetry", sender=sender, receiver="leader", payload=payload)


Answer = Callable[[Envelope, InboundMessage], Reply | Awaitable[Reply]]


async def pair(
    world: World,
    answer: Answer,
    *,
    device: str = "dev-1",
    **inbox_kwargs: Any,
) -> tuple[EnvelopeSender, EnvelopeInbox, Transport]:
    leader = await world.client("leader")
    dev = await world.client(device)
    inbox = EnvelopeInbox(leader, topic_filter=LEADER_IN, handler=answer, **inbox_kwargs)
    await inbox.start()
    sender = EnvelopeSender(dev, clock=world.clock, reply_topic=topics.reply(FLEET, device), timeout_s=REPLY_TIMEOUT_S)
    await sender.start()
    if world.kind == "mqtt":
        await asyncio.sleep(0.05)  # let the broker settle the shared subscription
    return sender, inbox, dev


async def accept(envelope: Envelope, message: InboundMessage) -> Reply:
    return Reply(id=envelope.id, status="accepted")


async def test_accepted_returns_and_handler_sees_the_envelope(world: World) -> None:
    seen: list[Envelope] = []

    async def answer(env: Envelope, message: InboundMessage) -> Reply:
        seen.append(env)
        return Reply(id=env.id, status="accepted")

    sender, inbox, _ = await pair(world, answer)
    await sender.deliver(envelope("m1"), topics.up(FLEET, "dev-1"))
    assert [e.id for e in seen] == ["m1"]
    assert sender.stats.accepted == 1 and inbox.stats.accepted == 1
    assert sender.in_flight == 0


async def test_busy_raises_capacity_with_retry_after(world: World) -> None:
    async def answer(env: Envelope, message: InboundMessage) -> Reply:
        return Reply(id=env.id, status="busy", retry_after_ms=250, reason="mailbox full")

    sender, _, _ = await pair(world, answer)
    with pytest.raises(Capacity) as info:
        await sender.deliver(envelope("m1"), topics.up(FLEET, "dev-1"))
    assert info.value.retry_after_ms == 250
    assert "mailbox full" in str(info.value)


async def test_rejected_raises_permanent_with_reason(world: World) -> None:
    async def answer(env: Envelope, message: InboundMessage) -> Reply:
        return Reply(id=env.id, status="rejected", reason="unknown kind")

    sender, _, _ = await pair(world, answer)
    with pytest.raises(Permanent, match="unknown kind"):
        await sender.deliver(envelope("m1"), topics.up(FLEET, "dev-1"))


async def test_no_reply_in_time_is_transient(world: World) -> None:
    dev = await world.client("dev-1")
    sender = EnvelopeSender(dev, clock=world.clock, reply_topic=topics.reply(FLEET, "dev-1"), timeout_s=REPLY_TIMEOUT_S)
    await sender.start()
    task = asyncio.create_task(sender.deliver(envelope("m1"), topics.up(FLEET, "dev-1")))
    with pytest.raises(Transient, match="no reply"):
        await world.finish(task, within_s=REPLY_TIMEOUT_S + 0.5)
    assert sender.stats.timeouts == 1 and sender.in_flight == 0


async def test_not_connected_is_transient(world: World) -> None:
    dev = await world.client("dev-1")
    sender = EnvelopeSender(dev, clock=world.clock, reply_topic=topics.reply(FLEET, "dev-1"), timeout_s=REPLY_TIMEOUT_S)
    await sender.start()
    await dev.stop()
    with pytest.raises(Transient, match="not sent"):
        await sender.deliver(envelope("m1"), topics.up(FLEET, "dev-1"))


async def test_handler_exception_answers_busy_and_inbox_keeps_going(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    async def answer(env: Envelope, message: InboundMessage) -> Reply:
        if env.id == "boom":
            raise RuntimeError("handler bug")
        return Reply(id=env.id, status="accepted")

    sender, inbox, _ = await pair(world, answer, busy_retry_after_ms=50)
    with caplog.at_level(logging.ERROR):
        with pytest.raises(Capacity) as info:
            await sender.deliver(envelope("boom"), topics.up(FLEET, "dev-1"))
    assert info.value.retry_after_ms == 50
    assert "handler bug" in caplog.text
    await sender.deliver(envelope("next"), topics.up(FLEET, "dev-1"))
    assert inbox.stats.handler_errors == 1 and inbox.stats.accepted == 1


async def test_sender_mismatch_is_rejected_and_logged(world: World, caplog: pytest.LogCaptureFixture) -> None:
    handled: list[str] = []
    dead: list[tuple[str, bytes, str]] = []

    async def answer(env: Envelope, message: InboundMessage) -> Reply:
        handled.append(env.id)
        return Reply(id=env.id, status="accepted")

    sender, _, _ = await pair(world, answer, on_rejected=lambda *a: dead.append(a))
    with caplog.at_level(logging.WARNING):
        with pytest.raises(Permanent, match="does not match"):
            await sender.deliver(envelope("m1", sender="dev-2"), topics.up(FLEET, "dev-1"))
    assert handled == []
    assert "does not match" in caplog.text
    assert dead and dead[0][2] == topics.up(FLEET, "dev-1")


async def test_oversized_payload_is_rejected_with_reason(world: World) -> None:
    dead: list[tuple[str, bytes, str]] = []

    async def sink(reason: str, raw: bytes, topic: str) -> None:  # an async sink is awaited
        dead.append((reason, raw, topic))

    sender, _, _ = await pair(world, accept, max_payload_bytes=128, on_rejected=sink)
    big = envelope("m1", payload=b"x" * 500)
    with pytest.raises(Permanent, match="exceeds max_payload_bytes=128"):
        await sender.deliver(big, topics.up(FLEET, "dev-1"))
    assert dead[0][1] == encode(big)


async def test_sender_refuses_an_envelope_over_the_transport_limit(world: World) -> None:
    sender, _, dev = await pair(world, accept)
    huge = envelope("m1", payload=b"x" * (dev.max_payload_bytes + 1))
    with pytest.raises(Permanent, match="limit"):
        await sender.deliver(huge, topics.up(FLEET, "dev-1"))


async def test_malformed_payload_is_rejected_and_dead_lettered(world: World) -> None:
    dead: list[tuple[str, bytes, str]] = []
    _, inbox, dev = await pair(world, accept, on_rejected=lambda *a: dead.append(a))
    replies: asyncio.Queue[InboundMessage] = asyncio.Queue()

    async def collect(message: InboundMessage) -> None:
        replies.put_nowait(message)

    own_reply = topics.reply(FLEET, "dev-1", "raw")
    await dev.subscribe(own_reply, collect)
    for correlation, garbage in ((b"c1", b"\xc1\xff not msgpack"), (b"c2", encode(Reply(id="x", status="accepted")))):
        await dev.publish(topics.up(FLEET, "dev-1"), garbage, response_topic=own_reply, correlation=correlation)
    got = [await asyncio.wait_for(replies.get(), 5) for _ in range(2)]
    by_corr = {m.correlation: decode_reply(m.payload) for m in got}
    for correlation in (b"c1", b"c2"):
        assert by_corr[correlation].status == "rejected"
        assert by_corr[correlation].reason
    assert "undecodable" in by_corr[b"c1"].reason
    assert [d[1] for d in dead] == [b"\xc1\xff not msgpack", encode(Reply(id="x", status="accepted"))]
    assert inbox.stats.rejected == 2


async def test_many_in_flight_with_concurrent_inbox_workers(world: World) -> None:
    seen: list[str] = []

    async def answer(env: Envelope, message: InboundMessage) -> Reply:
        seen.append(env.id)
        return Reply(id=env.id, status="accepted")

    sender, inbox, _ = await pair(world, answer, concurrency=4)
    ids = [f"m{i:03d}" for i in range(50)]
    await asyncio.gather(*(sender.deliver(envelope(i), topics.up(FLEET, "dev-1")) for i in ids))
    assert sorted(seen) == ids
    assert sender.stats.accepted == 50 and sender.in_flight == 0
    await inbox.stop()


async def test_disconnect_while_waiting_is_transient() -> None:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    release = asyncio.Event()

    async def stall(env: Envelope, message: InboundMessage) -> Reply:
        await release.wait()
        return Reply(id=env.id, status="accepted")

    leader = MemoryTransport(broker, "leader")
    dev = MemoryTransport(broker, "dev-1")
    inbox = EnvelopeInbox(leader, topic_filter=LEADER_IN, handler=stall)
    sender = EnvelopeSender(dev, clock=clock, reply_topic=topics.reply(FLEET, "dev-1"), timeout_s=30)
    await inbox.start()
    await sender.start()
    await leader.start()
    await dev.start()
    task = asyncio.create_task(sender.deliver(envelope("m1"), topics.up(FLEET, "dev-1")))
    await clock.settle()
    broker.partition("dev-1")
    with pytest.raises(Transient, match="connection lost"):
        await task
    release.set()
    await clock.settle()
    assert sender.stats.lost == 1
    for transport in (dev, leader):
        await transport.stop()


def test_envelope_from_row_carries_the_row() -> None:
    row = OutboxRow(
        row_id=1,
        msg_id="01ID",
        owner="dev-1",
        receiver="leader",
        kind="hb",
        payload=b"x",
        key="hb",
        conflict="overwrite",
        seq=7,
        created_at_ms=1000,
        send_at_ms=1000,
        expires_at_ms=61_000,
        attempts=0,
    )
    env = envelope_from_row(row)
    assert (env.id, env.sender, env.receiver, env.kind, env.key, env.conflict, env.seq) == (
        "01ID",
        "dev-1",
        "leader",
        "hb",
        "hb",
        "overwrite",
        7,
    )
    assert env.ts_ms == 1000 and env.ttl_ms == 60_000 and env.payload == b"x"


async def test_for_rows_delivers_to_the_receivers_topic() -> None:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    seen: list[tuple[str, str]] = []

    async def answer(env: Envelope, message: InboundMessage) -> Reply:
        seen.append((env.id, message.topic))
        return Reply(id=env.id, status="accepted")

    leader = MemoryTransport(broker, "leader")
    dev = MemoryTransport(broker, "dev-1")
    await leader.start()
    await dev.start()
    inbox = EnvelopeInbox(dev, topic_filter=topics.down(FLEET, "dev-1"), handler=answer)
    await inbox.start()
    sender = EnvelopeSender(leader, clock=clock, reply_topic=topics.reply(FLEET, "leader"))
    await sender.start()
    deliver = sender.for_rows(lambda receiver: topics.down(FLEET, receiver))
    row = OutboxRow(
        row_id=1,
        msg_id="01J",
        owner="leader",
        receiver="dev-1",
        kind="job",
        payload=b"",
        key=None,
        conflict="append",
        seq=0,
        created_at_ms=0,
        send_at_ms=0,
        expires_at_ms=None,
        attempts=0,
    )
    await deliver(row)
    assert seen == [("01J", topics.down(FLEET, "dev-1"))]


async def test_an_invalid_topic_is_permanent() -> None:
    broker = MemoryBroker(clock=VirtualClock())
    dev = MemoryTransport(broker, "dev-1")
    await dev.start()
    sender = EnvelopeSender(dev, clock=broker.clock, reply_topic=topics.reply(FLEET, "dev-1"))
    await sender.start()
    with pytest.raises(Permanent, match="invalid topic"):
        await sender.deliver(envelope("m1"), "ea/v1/+/up")
    await dev.stop()


@pytest.mark.mqtt
async def test_commands_queued_while_offline_are_answered_after_the_reconnect(mosquitto) -> None:
    """A persistent session's queued commands arrive right after CONNACK, before the connection
    is up for the device: their answers wait for it instead of being dropped."""
    clock = SystemClock()
    device_topic = topics.down(FLEET, "dev-q")

    def device_transport() -> MqttTransport:
        return MqttTransport.from_url(mosquitto.url, client_id="dev-q", clean_start=False,
                                      reconnect_min_s=0.05, reconnect_max_s=0.3)

    async def accept(envelope: Envelope, message: InboundMessage) -> Reply:
        return Reply(id=envelope.id, status="accepted")

    first = device_transport()
    inbox = EnvelopeInbox(first, topic_filter=device_topic, handler=accept, sender_check=False, clock=clock)
    await inbox.start()
    await first.start()
    await asyncio.wait_for(first.connected.wait_open(), 30)
    await first.stop()  # offline: the broker keeps the session (and its subscription) and queues what comes
    await inbox.stop()
    leader = MqttTransport.from_url(mosquitto.url, client_id="leader-q", reconnect_min_s=0.05, reconnect_max_s=0.3)
    sender = EnvelopeSender(leader, clock=clock, reply_topic=topics.reply(FLEET, "leader-q", "relay"), timeout_s=60.0)
    await sender.start()
    await leader.start()
    await asyncio.wait_for(leader.connected.wait_open(), 30)
    again = device_transport()
    inbox = EnvelopeInbox(again, topic_filter=device_topic, handler=accept, sender_check=False, clock=clock)
    try:
        sends = [asyncio.ensure_future(sender.deliver(Envelope(id=f"cmd-{n}", kind="job.offer", sender="leader-q",
                                                                receiver="dev-q"), device_topic)) for n in range(5)]
        await asyncio.sleep(0)  # the commands go out while the device is away
        while sender.stats.sent < 5:
            await asyncio.sleep(0.01)
        await inbox.start()
        await again.start()  # queued commands are delivered before the connection is up for it
        await asyncio.wait_for(asyncio.gather(*sends), 60)  # every one answered: accepted
        assert sender.stats.accepted == 5 and inbox.stats.reply_failures == 0
    finally:
        await inbox.stop()
        await again.stop()
        await sender.stop()
        await leader.stop()


async def test_an_envelope_with_a_ttl_asks_the_broker_to_expire_it() -> None:
    """A command for an offline device must not run days later: the envelope's remaining TTL
    goes out as the MQTT message expiry; an envelope already past it is not sent at all."""
    from agent.core.gate import Gate

    clock = VirtualClock()

    class Recording:
        max_payload_bytes = 1 << 20
        connected = Gate(is_open=True)

        def __init__(self) -> None:
            self.expiries: list[int | None] = []

        async def subscribe(self, topic_filter: str, handler: Any, *, qos: int = 1) -> None: ...

        async def unsubscribe(self, topic_filter: str) -> None: ...

        async def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                          response_topic: str | None = None, correlation: bytes | None = None,
                          expiry_s: int | None = None) -> None:
            self.expiries.append(expiry_s)

    wire = Recording()
    sender = EnvelopeSender(wire, clock=clock, reply_topic=topics.reply(FLEET, "leader", "relay"),  # type: ignore[arg-type]
                            timeout_s=1.0)
    await sender.start()
    now = clock.now_ms()
    fresh = Envelope(id="e1", kind="job.offer", sender="leader", receiver="d", ts_ms=now - 500, ttl_ms=90_000)
    task = asyncio.ensure_future(sender.deliver(fresh, topics.down(FLEET, "d")))
    await asyncio.sleep(0)
    await clock.advance(2.0)  # no reply: transient, but the expiry was asked for
    with pytest.raises(Transient):
        await task
    assert wire.expiries == [90]  # 89.5 s left, rounded up
    stale = Envelope(id="e2", kind="job.offer", sender="leader", receiver="d", ts_ms=now - 100_000, ttl_ms=90_000)
    with pytest.raises(Permanent, match="expired"):
        await sender.deliver(stale, topics.down(FLEET, "d"))
    assert wire.expiries == [90]  # not sent
    await sender.stop()


async def test_a_plain_function_handler_is_answered_at_once_and_its_failure_is_busy(world: World) -> None:
    def answer(env: Envelope, message: InboundMessage) -> Reply:  # no coroutine: answered in the same turn
        if env.id == "boom":
            raise RuntimeError("receiver bug")
        return Reply(id=env.id, status="accepted")

    sender, inbox, _ = await pair(world, answer)
    await sender.deliver(envelope("m1"), topics.up(FLEET, "dev-1"))
    with pytest.raises(Capacity):
        await sender.deliver(envelope("boom"), topics.up(FLEET, "dev-1"))
    assert (inbox.stats.accepted, inbox.stats.busy, inbox.stats.handler_errors) == (1, 1, 1)
