"""The relay over the real SQLite store on a virtual clock: a receiver at capacity, a receiver
offline for hours, a poison message, a slow receiver among fast ones, a long idle. The
conservation law is checked after every scenario."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from relay_support import message

from agent.actors import Actor, ActorRef, ActorSystem, Context
from agent.core.clock import VirtualClock
from agent.core.errors import Capacity, MailboxFull, Permanent, Transient
from agent.core.gate import Gate
from agent.outbox.metrics import collect_metrics
from agent.outbox.partition import partition_of
from agent.outbox.relay import Relay
from agent.outbox.retry import RetryPolicy
from agent.outbox.store import OutboxStore
from agent.outbox.types import OutboxRow

FAST_RETRY = RetryPolicy(base_s=0.05, cap_s=2.0, transient_floor_s=0.05)


@pytest.fixture
async def store(tmp_path: Path, clock: VirtualClock) -> AsyncIterator[OutboxStore]:
    s = await OutboxStore.open(tmp_path / "outbox.db", clock=clock, max_attempts=20)
    yield s
    await s.close()


async def assert_conserved(store: OutboxStore, relay: Relay | None = None) -> None:
    m = await collect_metrics(store, relay)
    assert m.conservation_ok, (m.conservation_gap(), m.store)
    broken = {kind: c for kind, c in m.store.by_class.items() if not c.conservation_ok}
    assert not broken, broken  # and class by class


async def advance_until(
    clock: VirtualClock, done: Callable[[], bool], *, step_s: float = 0.5, limit_s: float = 3600
) -> None:
    waited = 0.0
    while not done():
        assert waited < limit_s, "condition not reached in virtual time"
        await clock.advance(step_s)
        waited += step_s


class BoundedReceiver(Actor):
    """Takes one message per `service_s` of virtual time from a small bounded mailbox."""

    def __init__(self, service_s: float) -> None:
        self.service_s = service_s
        self.got: list[str] = []

    async def receive(self, message: object, ctx: Context) -> None:
        await ctx.clock.sleep(self.service_s)
        assert isinstance(message, OutboxRow)
        self.got.append(message.msg_id)


def deliver_to(ref: ActorRef) -> Callable[[OutboxRow], object]:
    async def deliver(row: OutboxRow) -> None:
        try:
            ref.tell(row)
        except MailboxFull as exc:
            raise Capacity(str(exc), retry_after_ms=exc.retry_after_ms) from exc

    return deliver


async def test_receiver_at_capacity_limit_halves_and_recovers_nothing_lost(
    clock: VirtualClock, store: OutboxStore
) -> None:
    receiver = BoundedReceiver(service_s=0.01)
    n = 200
    for i in range(n):
        await store.enqueue(message(f"m{i:04d}", receiver="leader", kind="status"))
    limits: list[int] = []
    async with ActorSystem(clock=clock) as system:
        ref = system.spawn(receiver, name="leader", capacity=8, policy="reject")
        inner = deliver_to(ref)
        relay: Relay

        async def deliver(row: OutboxRow) -> None:
            await inner(row)  # type: ignore[misc]
            lane = relay.metrics().lane(relay.partition_of("leader"), "status")
            assert lane is not None
            limits.append(lane.limit)

        relay = Relay(
            store, deliver, clock=clock, ready=Gate(is_open=True), retry=FAST_RETRY,
            rng=random.Random(1),
        )
        async with relay:
            await advance_until(clock, lambda: len(receiver.got) == n)
            await clock.advance(1)
            m = relay.metrics()
            await assert_conserved(store, relay)
    assert sorted(receiver.got) == [f"m{i:04d}" for i in range(n)]  # nothing lost
    assert len(set(receiver.got)) == n
    assert m.capacity_rejections > 0 and m.retried >= m.capacity_rejections
    lane = m.lane(relay.partition_of("leader"), "status")
    assert lane is not None and lane.capacity_rejections == m.capacity_rejections
    assert min(limits) < 10  # halved below the initial limit ...
    assert limits[-1] > min(limits)  # ... and grew again as the receiver kept up
    stats = await store.stats()
    assert stats.delivered == n and stats.dead_lettered == 0 and stats.pending == 0


async def test_receiver_offline_for_hours_then_everything_arrives(
    clock: VirtualClock, store: OutboxStore
) -> None:
    got: list[str] = []
    gate = Gate(is_open=False)

    async def deliver(row: OutboxRow) -> None:
        if not gate.is_open:  # would be NotConnected on a real transport
            raise Transient("offline")
        got.append(row.msg_id)

    ids = []
    for i in range(120):
        r = await store.enqueue(message(f"m{i:03d}", receiver=f"dev{i % 9}"))
        ids.append(r.row_id)
    relay = Relay(store, deliver, clock=clock, ready=gate, rng=random.Random(2),
                  reconnect_jitter_s=20.0)
    async with relay:
        writes = store.write_transactions
        for _ in range(12):
            await clock.advance(1800)  # six hours offline
        assert got == []
        assert store.write_transactions == writes  # no attempt spent, nothing written
        rows = [await store.get(i) for i in ids]
        assert all(r is not None and r.attempts == 0 for r in rows)
        gate.open()
        await clock.advance(20.0)  # the reconnect jitter is at most 20 s
        await advance_until(clock, lambda: len(got) == 120, limit_s=60)
        m = relay.metrics()
    assert sorted(got) == [f"m{i:03d}" for i in range(120)]
    assert m.transient_failures == 0 and m.delivered == 120
    await assert_conserved(store)


async def test_link_drops_mid_stream_no_attempts_spent(
    clock: VirtualClock, store: OutboxStore
) -> None:
    gate = Gate(is_open=True)
    got: list[str] = []

    async def deliver(row: OutboxRow) -> None:
        await clock.sleep(0.05)
        if not gate.is_open:
            raise Transient("connection lost")
        got.append(row.msg_id)

    ids = [(await store.enqueue(message(f"m{i:03d}", receiver="leader"))).row_id for i in range(200)]
    relay = Relay(store, deliver, clock=clock, ready=gate, rng=random.Random(3),
                  reconnect_jitter_s=1.0)
    async with relay:
        await clock.advance(0.12)
        gate.close()
        await clock.advance(0.2)
        delivered_before = len(got)
        assert 0 < delivered_before < 200
        await clock.advance(3600)
        assert len(got) == delivered_before
        pending = [await store.get(i) for i in ids]
        assert all(r is None or r.attempts == 0 for r in pending)
        assert store.in_flight == 0
        gate.open()
        await advance_until(clock, lambda: len(set(got)) == 200, limit_s=120)
    assert relay.metrics().released > 0
    await assert_conserved(store)


async def test_a_busy_receiver_never_dead_letters_a_message(tmp_path: Path, clock: VirtualClock) -> None:
    """Busy answers are the receiver's state, not the message's fault: a message answered busy
    many more times than max_attempts is delivered once the receiver has room."""
    store = await OutboxStore.open(tmp_path / "busy.db", clock=clock, max_attempts=3)
    tries: Counter[str] = Counter()

    async def deliver(row: OutboxRow) -> None:
        tries[row.msg_id] += 1
        if tries[row.msg_id] <= 10:
            raise Capacity("mailbox full", retry_after_ms=100)

    await store.enqueue(message("t1", receiver="leader"))
    relay = Relay(store, deliver, clock=clock, ready=Gate(is_open=True), retry=FAST_RETRY,
                  rng=random.Random(4))
    try:
        async with relay:
            await advance_until(clock, lambda: relay.metrics().delivered == 1, limit_s=600)
            assert tries["t1"] == 11
            assert await store.list_dead() == []
            m = relay.metrics()
            assert m.capacity_rejections == 10 and m.dead_lettered == 0
            await assert_conserved(store, relay)
    finally:
        await store.close()


async def test_poison_message_dead_after_exactly_max_attempts_then_replayed(
    tmp_path: Path, clock: VirtualClock
) -> None:
    store = await OutboxStore.open(tmp_path / "p.db", clock=clock, max_attempts=5)
    tries: Counter[str] = Counter()
    cured = False

    async def deliver(row: OutboxRow) -> None:
        tries[row.msg_id] += 1
        if row.payload == b"poison" and not cured:
            raise Transient("receiver chokes on it")

    poison = await store.enqueue(message("bad", receiver="leader", payload=b"poison"))
    for i in range(20):
        await store.enqueue(message(f"ok{i}", receiver="leader"))
    relay = Relay(store, deliver, clock=clock, ready=Gate(is_open=True), retry=FAST_RETRY,
                  rng=random.Random(4))
    try:
        async with relay:
            await advance_until(clock, lambda: tries["bad"] >= 5, limit_s=600)
            await clock.advance(600)
            assert tries["bad"] == 5  # exactly max_attempts tries, no sixth
            dead = await store.list_dead()
            assert [r.msg_id for r in dead] == ["bad"]
            assert dead[0].attempts == 5 and dead[0].last_error == "receiver chokes on it"
            m = relay.metrics()
            assert m.dead_lettered == 1 and m.retried == 4 and m.delivered == 20
            await assert_conserved(store, relay)
            cured = True
            assert await store.replay([poison.row_id]) == 1
            await advance_until(clock, lambda: tries["bad"] == 6, limit_s=10)
            await clock.advance(1)
            assert await store.list_dead() == []
            assert relay.metrics().delivered == 21
            stats = await store.stats()
            assert stats.delivered == 21 and stats.replayed == 1 and stats.pending == 0
            await assert_conserved(store, relay)
    finally:
        await store.close()


async def test_permanent_failure_is_dead_at_once(clock: VirtualClock, store: OutboxStore) -> None:
    async def deliver(row: OutboxRow) -> None:
        raise Permanent("refused: unknown kind")

    await store.enqueue(message("x", receiver="leader"))
    async with Relay(store, deliver, clock=clock, ready=Gate(is_open=True)) as relay:
        await clock.advance(1)
        dead = await store.list_dead()
        assert [(r.msg_id, r.attempts) for r in dead] == [("x", 1)]  # one try, no retry
        assert dead[0].last_error == "refused: unknown kind"
        assert relay.metrics().dead_lettered == 1
    await assert_conserved(store)


async def test_one_always_failing_receiver_does_not_stall_the_others(
    clock: VirtualClock, store: OutboxStore
) -> None:
    bad = "bad-receiver"
    fast = [f"dev{i}" for i in range(60) if partition_of(f"dev{i}", 4) != partition_of(bad, 4)]
    got: Counter[str] = Counter()

    async def deliver(row: OutboxRow) -> None:
        if row.receiver == bad:
            await clock.sleep(30)  # a slow timeout, every time
            raise Transient("timeout")
        got[row.receiver] += 1

    for i in range(300):
        await store.enqueue(message(f"b{i}", receiver=bad))
    for i, r in enumerate(fast * 3):
        await store.enqueue(message(f"f{i}", receiver=r))
    async with Relay(store, deliver, clock=clock, ready=Gate(is_open=True), retry=FAST_RETRY,
                     rng=random.Random(5)) as relay:
        await clock.advance(2)
        assert sum(got.values()) == len(fast) * 3
        lane = relay.metrics().lane(relay.partition_of(bad), "k")
        assert lane is not None and lane.in_flight > 0  # still stuck on the bad one
    await assert_conserved(store)


async def test_idle_relay_does_zero_write_transactions(
    clock: VirtualClock, store: OutboxStore
) -> None:
    got: list[str] = []

    async def deliver(row: OutboxRow) -> None:
        got.append(row.msg_id)

    polls = 0
    for name in ("take_ready", "next_due_ms", "stats"):
        method = getattr(store, name)

        def counted(*a: object, _m=method, **kw: object):  # type: ignore[no-untyped-def]
            nonlocal polls
            polls += 1
            return _m(*a, **kw)

        setattr(store, name, counted)
    for i in range(50):
        await store.enqueue(message(f"m{i}", receiver=f"d{i % 5}"))
    async with Relay(store, deliver, clock=clock, ready=Gate(is_open=True)) as relay:
        await advance_until(clock, lambda: len(got) == 50)
        await clock.advance(1)
        writes, reads = store.write_transactions, polls
        for _ in range(48):
            await clock.advance(1800)  # a day of virtual idle
        assert store.write_transactions == writes
        assert polls == reads  # not even a read: no polling
        await store.enqueue(message("late", receiver="d1"))
        await clock.advance(0)
        await advance_until(clock, lambda: len(got) == 51, step_s=0.01, limit_s=0.1)
        assert relay.metrics().delivered == 51
    await assert_conserved(store)


async def test_stop_releases_everything_and_a_new_relay_finishes(
    clock: VirtualClock, store: OutboxStore
) -> None:
    got: list[str] = []
    slow = True

    async def deliver(row: OutboxRow) -> None:
        if slow:
            await clock.sleep(10)
        got.append(row.msg_id)

    for i in range(100):
        await store.enqueue(message(f"m{i}", receiver=f"d{i % 5}"))
    relay = Relay(store, deliver, clock=clock, ready=Gate(is_open=True))
    await relay.start()
    await clock.advance(1)
    assert store.in_flight > 0
    await relay.stop()
    assert store.in_flight == 0
    assert (await store.stats()).pending == 100
    slow = False
    got.clear()
    async with Relay(store, deliver, clock=clock, ready=Gate(is_open=True)):
        await advance_until(clock, lambda: len(got) == 100)
        await asyncio.sleep(0)
    await assert_conserved(store)
