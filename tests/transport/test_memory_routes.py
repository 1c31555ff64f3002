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
