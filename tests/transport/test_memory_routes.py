"""MemoryBroker's remembered routes follow every subscription change; dispatch stays ordered."""

from __future__ import annotations

import asyncio

import pytest

from agent.core.clock import VirtualClock
from agent.transport import topics
from agent.transport.base import InboundMessage
from agent.transport.memory import MemoryBroker, MemoryTransport


class Inbox:
    def __init__(self, name: str, log: list[tuple[str, bytes]]) -> None:
        self.name = name
        self.log = log

    async def __call__(self, message: InboundMessage) -> None:
        self.log.append((self.name, message.payload))


async def started(broker: MemoryBroker, client_id: str) -> MemoryTransport:
    transport = MemoryTransport(broker, client_id)
    await transport.start()
    return transport


async def test_routes_follow_subscribes_and_unsubscribes_after_a_topic_was_used() -> None:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    pub = await started(broker, "pub")
    sub = await started(broker, "sub")
    other = await started(broker, "other")
    log: list[tuple[str, bytes]] = []
    topic = "ea/v1/f/dev-1/up"

    async def send(payload: bytes) -> None:
        await pub.publish(topic, payload)
        await clock.settle()

    await send(b"1")  # nobody listens: the route is remembered as empty
    await sub.subscribe("ea/v1/f/+/up", Inbox("wild", log))
    await send(b"2")
    await other.subscribe(topic, Inbox("exact", log))
    await send(b"3")
    await sub.subscribe("$share/leaders/ea/v1/f/+/up", Inbox("shared", log))
    await send(b"4")
    await sub.unsubscribe("ea/v1/f/+/up")
    await send(b"5")
    await other.stop()  # a clean session would keep its subscription: this one is persistent
    await send(b"6")
    await sub.unsubscribe("$share/leaders/ea/v1/f/+/up")
    await send(b"7")
    assert log == [
        ("wild", b"2"),
        ("exact", b"3"), ("wild", b"3"),
        ("exact", b"4"), ("wild", b"4"), ("shared", b"4"),
        ("exact", b"5"), ("shared", b"5"),
        ("shared", b"6"),
    ]
    assert broker.queued("other") == 2  # 6 and 7 wait for the persistent session's return
    await other.start()
    await clock.settle()
    await other.unsubscribe(topic)
    await send(b"8")  # nobody subscribed any more
    assert log[-2:] == [("exact", b"6"), ("exact", b"7")]
    assert broker.stats().delivered == len(log) == 11


async def test_an_invalid_topic_is_refused_every_time() -> None:
    broker = MemoryBroker(clock=VirtualClock())
    pub = await started(broker, "pub")
    await pub.publish("a/b", b"ok")
    for _ in range(2):
        with pytest.raises(topics.TopicError):
            await pub.publish("a/+", b"no")


async def test_idle_clients_hold_no_task_and_a_slow_handler_keeps_the_order() -> None:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    before = len(asyncio.all_tasks())
    clients = [await started(broker, f"c{i}") for i in range(20)]
    log: list[tuple[str, bytes]] = []

    async def slow(message: InboundMessage) -> None:
        if message.payload == b"1":
            await clock.sleep(5.0)  # the next message waits for this one
        log.append(("slow", message.payload))

    for c in clients:
        await c.subscribe("t", slow if c is clients[0] else Inbox(c.client_id, log))
    await clock.settle()
    assert len(asyncio.all_tasks()) == before
    for payload in (b"1", b"2", b"3"):
        await clients[1].publish("t", payload)
    await clock.settle()
    assert ("slow", b"1") not in log and ("slow", b"2") not in log
    assert len(asyncio.all_tasks()) == before + 1  # the slow client's delivery in progress
    await clock.advance(5.0)
    assert [p for name, p in log if name == "slow"] == [b"1", b"2", b"3"]
    assert len(asyncio.all_tasks()) == before
    for c in clients:
        await c.stop()


async def test_a_plain_function_handler_runs_without_a_task_in_arrival_order_with_awaiting_ones() -> None:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    pub = await started(broker, "pub")
    sub = await started(broker, "sub")
    log: list[tuple[str, bytes, bool]] = []

    def plain(message: InboundMessage) -> None:
        log.append(("plain", message.payload, asyncio.current_task() is None))

    async def slow(message: InboundMessage) -> None:
        if message.payload == b"1":
            await clock.sleep(5.0)
        log.append(("slow", message.payload, asyncio.current_task() is None))

    await sub.subscribe("plain", plain)
    await sub.subscribe("slow", slow)
    before = len(asyncio.all_tasks())
    for n in (b"a", b"b"):
        await pub.publish("plain", n)
    await clock.settle()
    assert log == [("plain", b"a", True), ("plain", b"b", True)]  # handed over by one callback, no task
    assert len(asyncio.all_tasks()) == before
    log.clear()
    await pub.publish("slow", b"1")
    await pub.publish("plain", b"c")  # waits behind the slow handler's first message
    await pub.publish("slow", b"2")
    await clock.settle()
    assert log == []
    await clock.advance(5.0)
    assert [(name, payload) for name, payload, _ in log] == [("slow", b"1"), ("plain", b"c"), ("slow", b"2")]
    assert len(asyncio.all_tasks()) == before  # the dispatch task ended with the queue
    await pub.stop()
    await sub.stop()


async def test_publish_nowait_arrives_after_the_latency_or_is_lost_with_the_connection() -> None:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock)
    pub = await started(broker, "pub")
    sub = await started(broker, "sub")
    got: list[tuple[bytes, bytes | None, int]] = []

    def take(message: InboundMessage) -> None:
        got.append((message.payload, message.correlation, message.qos))

    await sub.subscribe("r", take)
    pub.publish_nowait("r", b"now", correlation=b"c")
    await clock.settle()
    assert got == [(b"now", b"c", 0)]
    broker.set_delay("pub", 1.0)
    pub.publish_nowait("r", b"late")
    await clock.settle()
    assert got == [(b"now", b"c", 0)]
    await clock.advance(1.0)
    assert got[-1] == (b"late", None, 0)
    pub.publish_nowait("r", b"in flight")
    broker.partition("pub")
    await clock.advance(0.5)
    broker.heal("pub")
    await clock.advance(2.0)
    assert [payload for payload, _, _ in got] == [b"now", b"late"]  # QoS 0 in flight: lost with the link
    await pub.stop()
    await sub.stop()
