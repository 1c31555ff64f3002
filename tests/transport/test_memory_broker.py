"""MemoryBroker / MemoryTransport semantics, on a VirtualClock."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.clock import VirtualClock
from agent.core.errors import NotConnected
from agent.transport import topics
from agent.transport.base import InboundMessage, PayloadTooLarge, Transport, Will
from agent.transport.memory import MemoryBroker, MemoryTransport


class Inbox:
    def __init__(self) -> None:
        self.messages: list[InboundMessage] = []

    async def __call__(self, message: InboundMessage) -> None:
        self.messages.append(message)

    @property
    def payloads(self) -> list[bytes]:
        return [m.payload for m in self.messages]


async def client(broker: MemoryBroker, client_id: str, **kwargs: object) -> MemoryTransport:
    transport = MemoryTransport(broker, client_id, **kwargs)  # type: ignore[arg-type]
    await transport.start()
    return transport


async def test_memory_transport_satisfies_the_protocol(broker: MemoryBroker) -> None:
    transport = MemoryTransport(broker, "a")
    assert isinstance(transport, Transport)
    assert not transport.connected.is_open
    await transport.start()
    assert transport.connected.is_open
    await transport.stop()
    assert not transport.connected.is_open


async def test_wildcards_route_to_matching_subscriptions(broker: MemoryBroker, clock: VirtualClock) -> None:
    sub = await client(broker, "sub")
    pub = await client(broker, "pub")
    plus, hash_, exact = Inbox(), Inbox(), Inbox()
    await sub.subscribe("ea/v1/f/+/up", plus)
    await sub.subscribe("ea/v1/f/#", hash_)
    await sub.subscribe("ea/v1/f/d1/down", exact)
    await pub.publish("ea/v1/f/d1/up", b"1")
    await pub.publish("ea/v1/f/d1/down", b"2")
    await pub.publish("ea/v1/g/d1/up", b"3")
    await clock.settle()
    assert plus.payloads == [b"1"]
    assert hash_.payloads == [b"1", b"2"]
    assert exact.payloads == [b"2"]


async def test_retained_message_reaches_later_subscribers_and_empty_clears(
    broker: MemoryBroker, clock: VirtualClock
) -> None:
    pub = await client(broker, "pub")
    await pub.publish("status/a", b"on", retain=True)
    first = Inbox()
    sub = await client(broker, "sub")
    await sub.subscribe("status/+", first)
    await clock.settle()
    assert [(m.payload, m.retain) for m in first.messages] == [(b"on", True)]
    await pub.publish("status/a", b"off", retain=True)
    await clock.settle()
    assert [(m.payload, m.retain) for m in first.messages][-1] == (b"off", False)
    await pub.publish("status/a", b"", retain=True)
    assert broker.retained("status/a") is None
    late = Inbox()
    other = await client(broker, "other")
    await other.subscribe("status/#", late)
    await clock.settle()
    assert late.messages == []


async def test_will_fires_on_abrupt_disconnect_only(broker: MemoryBroker, clock: VirtualClock) -> None:
    watcher = Inbox()
    sub = await client(broker, "watch")
    await sub.subscribe(topics.fleet_filter("f", "presence"), watcher)
    will = Will(topics.presence("f", "d1"), topics.OFFLINE)
    birth = Will(topics.presence("f", "d1"), topics.ONLINE)

    clean = await client(broker, "d1", will=will, birth=birth)
    await clean.stop()
    await clock.settle()
    assert broker.stats().wills_published == 0
    assert watcher.payloads == [b"online", b"offline"]  # birth, then the clean goodbye

    crashed = await client(broker, "d1", will=will, birth=birth)
    await crashed.abort()
    await clock.settle()
    assert broker.stats().wills_published == 1
    assert watcher.payloads[-2:] == [b"online", b"offline"]
    assert broker.retained(will.topic) == b"offline"


async def test_partition_fires_will_and_heal_reconnects_with_birth(broker: MemoryBroker, clock: VirtualClock) -> None:
    will = Will(topics.presence("f", "d1"), topics.OFFLINE)
    birth = Will(topics.presence("f", "d1"), topics.ONLINE)
    device = await client(broker, "d1", will=will, birth=birth, reconnect_jitter_s=3.0, rng=random.Random(7))
    assert broker.retained(will.topic) == b"online"
    broker.partition("d1")
    assert not device.connected.is_open
    assert broker.retained(will.topic) == b"offline"
    with pytest.raises(NotConnected):
        await device.publish("x", b"1")
    await clock.advance(60)
    assert not device.connected.is_open  # stays cut off until healed
    broker.heal("d1")
    await clock.advance(3.0)  # full jitter within reconnect_jitter_s
    assert device.connected.is_open
    assert device.connects == 2
    assert broker.retained(will.topic) == b"online"


async def test_qos1_queued_for_offline_persistent_session_and_redelivered(
    clock: VirtualClock,
) -> None:
    broker = MemoryBroker(clock=clock, max_queued_per_session=3)
    inbox = Inbox()
    device = MemoryTransport(broker, "d1", clean_start=False)
    await device.subscribe("cmd/d1", inbox)
    await device.start()
    pub = await client(broker, "leader")
    broker.partition("d1")
    for i in range(4):
        await pub.publish("cmd/d1", b"%d" % i)
    await pub.publish("cmd/d1", b"qos0", qos=0)
    assert broker.queued("d1") == 3
    assert broker.dropped("d1") == 1
    assert broker.stats().dropped_queue_full == 1
    broker.heal("d1")
    await clock.advance(0)
    assert device.connected.is_open
    assert inbox.payloads == [b"0", b"1", b"2"]
    assert broker.queued("d1") == 0


async def test_clean_session_gets_nothing_sent_while_offline(broker: MemoryBroker, clock: VirtualClock) -> None:
    inbox = Inbox()
    device = MemoryTransport(broker, "d1", clean_start=True)
    await device.subscribe("cmd/d1", inbox)
    await device.start()
    pub = await client(broker, "leader")
    broker.partition("d1")
    await pub.publish("cmd/d1", b"lost")
    broker.heal("d1")
    await clock.advance(0)
    await pub.publish("cmd/d1", b"after")
    await clock.settle()
    assert inbox.payloads == [b"after"]


async def test_restarted_process_resumes_its_persistent_session(broker: MemoryBroker, clock: VirtualClock) -> None:
    first = Inbox()
    device = MemoryTransport(broker, "d1")
    await device.subscribe("cmd/d1", first)
    await device.start()
    await device.abort()
    pub = await client(broker, "leader")
    await pub.publish("cmd/d1", b"while-dead")
    second = Inbox()
    again = MemoryTransport(broker, "d1")
    await again.subscribe("cmd/d1", second)
    await again.start()
    await clock.settle()
    assert first.payloads == []
    assert second.payloads == [b"while-dead"]


async def test_shared_subscription_round_robins_among_connected_members(
    broker: MemoryBroker, clock: VirtualClock
) -> None:
    a_in, b_in = Inbox(), Inbox()
    flt = topics.leaders_up("f")
    leader_a = MemoryTransport(broker, "leader-a")
    leader_b = MemoryTransport(broker, "leader-b")
    await leader_a.subscribe(flt, a_in)
    await leader_b.subscribe(flt, b_in)
    await leader_a.start()
    await leader_b.start()
    dev = await client(broker, "d1")
    for i in range(10):
        await dev.publish(topics.up("f", f"d{i}"), b"%d" % i)
    await clock.settle()
    assert len(a_in.messages) == 5 and len(b_in.messages) == 5
    assert sorted(a_in.payloads + b_in.payloads) == sorted(b"%d" % i for i in range(10))
    broker.partition("leader-b")
    for i in range(10, 14):
        await dev.publish(topics.up("f", "d1"), b"%d" % i)
    await clock.settle()
    assert a_in.payloads[-4:] == [b"10", b"11", b"12", b"13"]
    assert len(b_in.messages) == 5


async def test_shared_subscription_queues_for_offline_members_when_none_connected(
    broker: MemoryBroker, clock: VirtualClock
) -> None:
    inbox = Inbox()
    leader = MemoryTransport(broker, "leader-a")
    await leader.subscribe(topics.leaders_up("f"), inbox)
    await leader.start()
    dev = await client(broker, "d1")
    broker.partition("leader-a")
    await dev.publish(topics.up("f", "d1"), b"held")
    broker.heal("leader-a")
    await clock.advance(0)
    assert inbox.payloads == [b"held"]


async def test_broker_outage_disconnects_everyone_until_heal(broker: MemoryBroker, clock: VirtualClock) -> None:
    a = await client(broker, "a", will=Will("p/a", b"offline"))
    b = await client(broker, "b")
    broker.partition()
    assert not a.connected.is_open and not b.connected.is_open
    assert broker.stats().wills_published == 0  # a dead broker publishes nothing
    late = await client(broker, "late")
    assert not late.connected.is_open
    broker.heal()
    await clock.advance(0)
    assert a.connected.is_open and b.connected.is_open and late.connected.is_open


async def test_delays_apply_through_the_clock(broker: MemoryBroker, clock: VirtualClock) -> None:
    inbox = Inbox()
    sub = await client(broker, "slow")
    await sub.subscribe("t", inbox)
    pub = await client(broker, "pub")
    broker.set_delay("slow", 2.0)
    await pub.publish("t", b"1")
    await pub.publish("t", b"2")
    await clock.advance(1.9)
    assert inbox.payloads == []
    await clock.advance(0.2)
    assert inbox.payloads == [b"1", b"2"]
    # outbound latency: a publish from the slow client takes its delay to reach the broker
    echo = Inbox()
    await pub.subscribe("back", echo)
    task = asyncio.create_task(sub.publish("back", b"x"))
    await clock.advance(1.0)
    assert echo.payloads == [] and not task.done()
    await clock.advance(1.0)
    await task
    assert echo.payloads == [b"x"]


async def test_response_topic_and_correlation_pass_through(broker: MemoryBroker, clock: VirtualClock) -> None:
    inbox = Inbox()
    sub = await client(broker, "sub")
    await sub.subscribe("req", inbox)
    pub = await client(broker, "pub")
    await pub.publish("req", b"q", response_topic="rep/pub", correlation=b"\x01\x02")
    await clock.settle()
    assert inbox.messages[0].response_topic == "rep/pub"
    assert inbox.messages[0].correlation == b"\x01\x02"


async def test_max_payload_is_enforced(clock: VirtualClock) -> None:
    broker = MemoryBroker(clock=clock, max_payload_bytes=10)
    small = await client(broker, "small")
    with pytest.raises(PayloadTooLarge) as info:
        await small.publish("t", b"x" * 11)
    assert info.value.size == 11 and info.value.limit == 10
    big = await client(broker, "big", max_payload_bytes=100)
    with pytest.raises(PayloadTooLarge):
        await big.publish("t", b"x" * 50)  # the broker's own limit still applies
    await small.publish("t", b"x" * 10)


async def test_handler_failure_does_not_stop_dispatch(
    broker: MemoryBroker, clock: VirtualClock, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[bytes] = []

    async def flaky(message: InboundMessage) -> None:
        if message.payload == b"boom":
            raise RuntimeError("handler bug")
        seen.append(message.payload)

    sub = await client(broker, "sub")
    await sub.subscribe("t", flaky)
    pub = await client(broker, "pub")
    for payload in (b"1", b"boom", b"2"):
        await pub.publish("t", payload)
    await clock.settle()
    assert seen == [b"1", b"2"]
    assert "handler bug" in caplog.text


async def test_unsubscribe_stops_delivery(broker: MemoryBroker, clock: VirtualClock) -> None:
    inbox = Inbox()
    sub = await client(broker, "sub")
    await sub.subscribe("t/+", inbox)
    pub = await client(broker, "pub")
    await pub.publish("t/1", b"1")
    await clock.settle()
    await sub.unsubscribe("t/+")
    await pub.publish("t/2", b"2")
    await clock.settle()
    assert inbox.payloads == [b"1"]


async def _scenario(seed: int) -> list[tuple[str, bytes]]:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock, rng=random.Random(seed))
    log: list[tuple[str, bytes]] = []

    def recorder(name: str):
        async def handler(message: InboundMessage) -> None:
            log.append((name, message.payload))

        return handler

    leaders = []
    for name in ("l1", "l2", "l3"):
        leader = MemoryTransport(broker, name, reconnect_jitter_s=2.0)
        await leader.subscribe(topics.leaders_up("f"), recorder(name))
        await leader.start()
        leaders.append(leader)
    devices = [await client(broker, f"d{i}") for i in range(5)]
    for i, leader in enumerate(leaders):
        broker.set_delay(leader.client_id, 0.1 * (i + 1))
    for round_ in range(4):
        if round_ == 2:
            broker.partition("l2")
        for dev in devices:
            await dev.publish(topics.up("f", dev.client_id), f"{dev.client_id}:{round_}".encode())
        await clock.advance(1.0)
    broker.heal("l2")
    await clock.advance(5.0)
    return log


async def test_delivery_order_is_deterministic() -> None:
    first = await _scenario(3)
    second = await _scenario(3)
    assert first == second
    assert len(first) == 20


@settings(deadline=None, max_examples=60)
@given(
    st.lists(
        st.one_of(
            st.just(("partition",)),
            st.just(("heal",)),
            st.tuples(st.just("publish"), st.integers(min_value=1, max_value=5)),
            st.tuples(st.just("wait"), st.sampled_from([0.1, 0.5, 2.0])),
        ),
        max_size=30,
    ),
    st.sampled_from([0.0, 0.3]),
)
async def test_qos1_to_a_persistent_session_arrives_once_in_order_through_partitions(
    steps: list[tuple], delay: float
) -> None:
    clock = VirtualClock()
    broker = MemoryBroker(clock=clock, rng=random.Random(1))
    inbox = Inbox()
    device = MemoryTransport(broker, "dev", reconnect_jitter_s=1.0)
    await device.subscribe("cmd/dev", inbox)
    await device.start()
    leader = MemoryTransport(broker, "leader")
    await leader.start()
    broker.set_delay("dev", delay)
    sent: list[bytes] = []
    for step in steps:
        if step[0] == "partition":
            broker.partition("dev")
        elif step[0] == "heal":
            broker.heal("dev")
        elif step[0] == "publish":
            for _ in range(step[1]):
                payload = b"%d" % len(sent)
                await leader.publish("cmd/dev", payload)
                sent.append(payload)
        else:
            await clock.advance(step[1])
    broker.heal("dev")
    await clock.advance(5.0)
    assert device.connected.is_open
    assert inbox.payloads == sent
    await device.stop()
    await leader.stop()


async def test_session_takeover_disconnects_the_old_client(broker: MemoryBroker, clock: VirtualClock) -> None:
    old_in, new_in = Inbox(), Inbox()
    old = MemoryTransport(broker, "dup")
    await old.subscribe("t", old_in)
    await old.start()
    new = MemoryTransport(broker, "dup")
    await new.subscribe("t", new_in)
    await new.start()
    assert not old.connected.is_open and new.connected.is_open
    pub = await client(broker, "pub")
    await pub.publish("t", b"x")
    await clock.advance(1)
    assert old_in.payloads == [] and new_in.payloads == [b"x"]
