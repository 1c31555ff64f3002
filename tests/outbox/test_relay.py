"""Relay mechanics against a scripted in-memory store on a virtual clock: outcomes, readiness
gate, idle cost, partitions and bulkheads, batching, stop."""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter

import pytest
from relay_support import MemoryOutbox, message

from agent.core.clock import VirtualClock
from agent.core.errors import Capacity, Permanent, StoreError, Transient
from agent.core.gate import Gate
from agent.outbox.limiter import AimdSettings
from agent.outbox.partition import fnv1a_32
from agent.outbox.relay import Relay
from agent.outbox.retry import RetryPolicy
from agent.outbox.types import OutboxRow


def make(
    clock: VirtualClock,
    store: MemoryOutbox,
    deliver,
    *,
    gate: Gate | None = None,
    partitions: int = 4,
    jitter: float = 0.0,
    **kw: object,
) -> tuple[Relay, Gate]:
    gate = gate if gate is not None else Gate(is_open=True)
    relay = Relay(
        store,
        deliver,
        clock=clock,
        ready=gate,
        partitions=partitions,
        rng=random.Random(5),
        reconnect_jitter_s=jitter,
        **kw,  # type: ignore[arg-type]
    )
    return relay, gate


async def fill(store: MemoryOutbox, n: int, *, receivers: int = 7, kind: str = "k") -> None:
    for i in range(n):
        await store.enqueue(message(f"m{i:05d}", receiver=f"r{i % receivers}", kind=kind))


async def test_delivers_everything_and_acks_in_batches() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)
    got: list[str] = []

    async def deliver(row: OutboxRow) -> None:
        got.append(row.msg_id)

    ack_calls = 0
    real_ack = store.ack

    async def counting_ack(ids):  # type: ignore[no-untyped-def]
        nonlocal ack_calls
        ack_calls += 1
        await real_ack(ids)

    store.ack = counting_ack  # type: ignore[method-assign]
    await fill(store, 500)
    relay, _ = make(clock, store, deliver)
    async with relay:
        await clock.advance(1)
        m = relay.metrics()
    assert sorted(got) == [f"m{i:05d}" for i in range(500)]
    assert m.delivered == 500
    assert (await store.stats()).delivered == 500
    assert ack_calls < 500 // 5  # grouped, not one write per message
    assert (await store.stats()).conservation_ok


async def test_no_task_per_message() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)
    peak = 0

    async def deliver(row: OutboxRow) -> None:
        nonlocal peak
        peak = max(peak, len(asyncio.all_tasks()))
        await clock.sleep(0.001)

    await fill(store, 3000, receivers=50)
    relay, _ = make(clock, store, deliver, partitions=2, limits=AimdSettings(initial=5, max=20))
    async with relay:
        await clock.advance(30)
        assert relay.metrics().delivered == 3000
    # 2 partitions x 1 class x at most 20 senders, plus a few relay tasks and the test itself.
    assert peak <= 2 * 20 + 2 + 2 + 4


async def test_capacity_halves_and_backs_off_at_least_retry_after() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)
    calls: list[int] = []

    async def deliver(row: OutboxRow) -> None:
        calls.append(clock.now_ms())
        raise Capacity("mailbox full", retry_after_ms=2000)

    await store.enqueue(message("a", receiver="r"))
    relay, _ = make(clock, store, deliver, partitions=1, retry=RetryPolicy(base_s=0.1, cap_s=1))
    async with relay:
        await clock.advance(0.5)
        m = relay.metrics()
        assert m.capacity_rejections == 1 and m.retried == 1
        assert m.lanes[0].limit == 5  # 10 halved
        row = store.recs[1].row
        assert row.attempts == 0  # the receiver was busy: not the message's fault
        assert store.nack_outcomes == ["capacity"]
        assert 2000 <= row.send_at_ms - calls[0] <= 2000 + 100 + 1
        await clock.advance(10)
    assert len(calls) >= 3
    assert all(b - a >= 2000 for a, b in zip(calls, calls[1:], strict=False))


async def test_transient_keeps_the_limit_and_backs_off_above_the_floor() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)

    async def deliver(row: OutboxRow) -> None:
        raise Transient("timeout")

    await store.enqueue(message("a", receiver="r"))
    relay, _ = make(
        clock, store, deliver, partitions=1, retry=RetryPolicy(base_s=0.01, transient_floor_s=0.5)
    )
    async with relay:
        t0 = clock.now_ms()
        await clock.advance(0.1)
        m = relay.metrics()
        assert m.transient_failures == 1 and m.capacity_rejections == 0
        assert m.lanes[0].limit == 10
        assert store.recs[1].row.send_at_ms - t0 >= 500
        assert store.recs[1].row.last_error == "timeout"


async def test_permanent_goes_to_the_dead_letters_at_once() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)

    async def deliver(row: OutboxRow) -> None:
        raise Permanent("malformed payload")

    await store.enqueue(message("a", receiver="r"))
    relay, _ = make(clock, store, deliver)
    async with relay:
        await clock.advance(1)
        m = relay.metrics()
    rec = store.recs[1]
    assert rec.status == "dead" and rec.row.attempts == 1  # that one try, no retry
    assert rec.row.last_error == "malformed payload"
    assert m.dead_lettered == 1 and m.permanent_failures == 1 and m.retried == 0


async def test_unexpected_exception_is_a_logged_transient(caplog: pytest.LogCaptureFixture) -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)

    async def deliver(row: OutboxRow) -> None:
        raise KeyError("boom")

    await store.enqueue(message("a", receiver="r"))
    relay, _ = make(clock, store, deliver)
    with caplog.at_level(logging.WARNING, logger="agent.outbox.relay"):
        async with relay:
            await clock.advance(0.1)
            m = relay.metrics()
    assert m.transient_failures == 1
    assert store.recs[1].row.attempts == 1
    assert "KeyError" in (store.recs[1].row.last_error or "")
    assert any("KeyError" in r.getMessage() for r in caplog.records)


async def test_poison_message_dies_after_exactly_max_attempts() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock, max_attempts=4)
    tries = 0

    async def deliver(row: OutboxRow) -> None:
        nonlocal tries
        tries += 1
        raise Transient("nope")

    await store.enqueue(message("a", receiver="r"))
    relay, _ = make(clock, store, deliver, retry=RetryPolicy(base_s=0.1, cap_s=1))
    async with relay:
        await clock.advance(600)
        m = relay.metrics()
    assert tries == 4
    assert store.recs[1].status == "dead" and store.recs[1].row.attempts == 4
    assert m.dead_lettered == 1 and m.retried == 3


async def test_closed_gate_sends_nothing_and_spends_no_attempt() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)
    got: list[str] = []

    async def deliver(row: OutboxRow) -> None:
        got.append(row.msg_id)

    await fill(store, 50)
    relay, gate = make(clock, store, deliver, gate=Gate(is_open=False), jitter=30.0)
    async with relay:
        await clock.advance(3 * 3600)
        assert got == []
        assert all(r.row.attempts == 0 for r in store.recs.values())
        assert store.write_txns == 50  # only the enqueues
        gate.open()
        opened = clock.monotonic()
        await clock.advance(30.0)
        assert len(got) == 50
        assert relay.metrics().resumes == 1
    # The first send waited for the jitter drawn in [0, 30] s; rng 5 draws a positive one.
    assert clock.monotonic() - opened <= 30.0


async def test_reconnect_waits_a_jittered_delay() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)
    sent_at: list[float] = []

    async def deliver(row: OutboxRow) -> None:
        sent_at.append(clock.monotonic())

    await store.enqueue(message("a", receiver="r"))
    gate = Gate(is_open=False)
    relay = Relay(
        store, deliver, clock=clock, ready=gate, rng=random.Random(11), reconnect_jitter_s=10.0
    )
    expected = random.Random(11).uniform(0, 10.0)
    async with relay:
        await clock.advance(5)
        gate.open()
        t_open = clock.monotonic()
        await clock.advance(expected - 0.01)
        assert sent_at == []
        await clock.advance(0.02)
        assert len(sent_at) == 1
    assert 0 <= sent_at[0] - t_open <= 10.0


async def test_gate_closing_mid_batch_releases_untried_rows() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)
    started: list[str] = []
    gate = Gate(is_open=True)

    async def deliver(row: OutboxRow) -> None:
        started.append(row.msg_id)
        if len(started) == 3:
            gate.close()  # the link drops while the third is on the wire
            raise Transient("connection lost")
        await clock.sleep(0.01)

    await fill(store, 40, receivers=1)
    relay, _ = make(
        clock, store, deliver, gate=gate, partitions=1, limits=AimdSettings(initial=1, max=1)
    )
    async with relay:
        await clock.advance(5)
        m = relay.metrics()
        assert len(started) == 3
        assert store.in_flight == set()  # everything taken was handed back
        assert all(r.row.attempts == 0 for r in store.recs.values())
        assert m.released >= 1 and m.transient_failures == 0
        gate.open()
        await clock.advance(5)
        assert relay.metrics().delivered == 40 - 1 + 1  # the released one is delivered later too
    assert (await store.stats()).delivered == 40


async def test_idle_relay_does_no_writes_and_no_reads() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)

    async def deliver(row: OutboxRow) -> None:
        return None

    await fill(store, 20)
    relay, _ = make(clock, store, deliver)
    async with relay:
        await clock.advance(1)
        writes, reads = store.write_txns, store.reads
        await clock.advance(24 * 3600)
        assert store.write_txns == writes
        assert store.reads == reads
        # ... and an enqueue wakes it at once, without waiting for any timer.
        await store.enqueue(message("late", receiver="r1"))
        await clock.advance(0)
        assert relay.metrics().delivered == 21


async def test_wakes_exactly_when_a_backed_off_row_comes_due() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)
    tries: list[int] = []

    async def deliver(row: OutboxRow) -> None:
        tries.append(clock.now_ms())
        if len(tries) == 1:
            raise Transient("once")

    await store.enqueue(message("a", receiver="r"))
    relay, _ = make(clock, store, deliver, retry=RetryPolicy(base_s=60, cap_s=60, transient_floor_s=30))
    async with relay:
        await clock.advance(0.1)
        due = store.recs[1].row.send_at_ms
        reads = store.reads
        await clock.advance((due - clock.now_ms()) / 1000 - 0.01)
        assert len(tries) == 1
        assert store.reads - reads <= 4  # no polling while waiting
        await clock.advance(0.02)
        assert len(tries) == 2 and tries[1] >= due


async def test_slow_receiver_does_not_stall_other_partitions() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)
    relay_probe = Relay(store, _noop, clock=clock, ready=Gate(), partitions=4)
    slow = "slow-receiver"
    others = [f"fast-{i}" for i in range(40)]
    others = [r for r in others if relay_probe.partition_of(r) != relay_probe.partition_of(slow)]
    got: Counter[str] = Counter()

    async def deliver(row: OutboxRow) -> None:
        if row.receiver == slow:
            await clock.sleep(3600)  # hangs for an hour
            raise Transient("timeout")
        got[row.receiver] += 1

    for i in range(200):
        await store.enqueue(message(f"s{i}", receiver=slow))
    for i, r in enumerate(others * 5):
        await store.enqueue(message(f"f{i}", receiver=r))
    relay, _ = make(clock, store, deliver)
    async with relay:
        await clock.advance(1)
        assert sum(got.values()) == len(others) * 5


async def test_a_slow_class_does_not_stall_another_class_in_the_same_partition() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)
    got: list[str] = []

    async def deliver(row: OutboxRow) -> None:
        if row.kind == "bulk":
            await clock.sleep(600)
        got.append(row.msg_id)

    for i in range(500):  # older, and far more than the lane will hold
        await store.enqueue(message(f"b{i}", receiver=f"r{i % 3}", kind="bulk"))
    for i in range(30):
        await store.enqueue(message(f"h{i}", receiver=f"r{i % 3}", kind="heartbeat"))
    relay, _ = make(clock, store, deliver, partitions=1, discovery_interval_s=5.0)
    async with relay:
        await clock.advance(1)
        # The bulk lane filled up at once; the store's classes were looked up then.
        assert sorted(got) == sorted(f"h{i}" for i in range(30))
        for i in range(10):
            await store.enqueue(message(f"t{i}", receiver="r0", kind="telemetry"))
        await clock.advance(1)
        assert len(got) == 30  # a class never seen while the bulk lane is full ...
        await clock.advance(4.5)  # ... is found by the next periodic look
        assert len(got) == 40
        m = relay.metrics()
        bulk = m.lane(0, "bulk")
        assert bulk is not None and bulk.in_flight == bulk.limit == 10


async def test_declared_classes_are_isolated_from_the_start() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)
    got: list[str] = []

    async def deliver(row: OutboxRow) -> None:
        if row.kind == "bulk":
            await clock.sleep(600)
        got.append(row.msg_id)

    for i in range(500):
        await store.enqueue(message(f"b{i}", receiver=f"r{i % 3}", kind="bulk"))
    for i in range(30):
        await store.enqueue(message(f"h{i}", receiver=f"r{i % 3}", kind="heartbeat"))
    relay, _ = make(clock, store, deliver, partitions=1, classes=["bulk", "heartbeat"])
    async with relay:
        await clock.advance(0.5)
        assert sorted(got) == sorted(f"h{i}" for i in range(30))


async def test_fifo_receiver_gets_its_rows_in_order_one_at_a_time() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock, fifo=["cmd"])
    in_flight: Counter[str] = Counter()
    seen: dict[str, list[str]] = {}

    async def deliver(row: OutboxRow) -> None:
        in_flight[row.receiver] += 1
        assert in_flight[row.receiver] == 1
        await clock.sleep(0.01)
        seen.setdefault(row.receiver, []).append(row.msg_id)
        in_flight[row.receiver] -= 1

    for i in range(60):
        await store.enqueue(message(f"c{i:03d}", receiver=f"r{i % 3}", kind="cmd"))
    relay, _ = make(clock, store, deliver)
    async with relay:
        await clock.advance(10)
    assert sum(len(v) for v in seen.values()) == 60
    for ids in seen.values():
        assert ids == sorted(ids)


async def test_stop_hands_back_untried_rows_and_cannot_restart() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)

    async def deliver(row: OutboxRow) -> None:
        await clock.sleep(100)

    await fill(store, 100)
    relay, _ = make(clock, store, deliver)
    await relay.start()
    await clock.advance(1)
    assert store.in_flight
    await relay.stop()
    assert store.in_flight == set()
    assert all(r.row.attempts == 0 and r.status == "pending" for r in store.recs.values())
    with pytest.raises(RuntimeError):
        await relay.start()
    await relay.stop()  # idempotent


async def test_bad_arguments_are_refused() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)
    with pytest.raises(ValueError, match="partitions"):
        Relay(store, _noop, clock=clock, ready=Gate(), partitions=0)
    with pytest.raises(ValueError, match="reconnect_jitter_s"):
        Relay(store, _noop, clock=clock, ready=Gate(), reconnect_jitter_s=-1)


async def _noop(row: OutboxRow) -> None:
    return None


async def test_a_backed_off_row_is_retried_on_time_while_another_partition_is_stuck() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)
    probe = Relay(store, _noop, clock=clock, ready=Gate(), partitions=2)
    stuck = "stuck-receiver"
    mine = next(f"dev{i}" for i in range(100) if probe.partition_of(f"dev{i}") != probe.partition_of(stuck))
    tries: list[int] = []

    async def deliver(row: OutboxRow) -> None:
        if row.receiver == stuck:
            await clock.sleep(3600)
            return
        tries.append(clock.now_ms())
        if len(tries) == 1:
            raise Transient("once")

    for i in range(100):  # far more than the stuck lane takes: due rows left in the store
        await store.enqueue(message(f"s{i}", receiver=stuck))
    await store.enqueue(message("mine", receiver=mine))
    relay, _ = make(
        clock, store, deliver, partitions=2,
        retry=RetryPolicy(base_s=20, cap_s=20, transient_floor_s=10),
    )
    async with relay:
        await clock.advance(0.1)
        assert len(tries) == 1
        due = next(r.row.send_at_ms for r in store.recs.values() if r.row.msg_id == "mine")
        await clock.advance((due - clock.now_ms()) / 1000 + 5.1)
        assert len(tries) == 2, "the retry waited for the stuck partition"
        assert tries[1] - due <= 5100


async def test_store_errors_are_retried_and_never_hang_stop() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)
    got: list[str] = []
    failures = {"ack": 2, "take_ready": 2}
    real_ack, real_take = store.ack, store.take_ready

    async def flaky_ack(ids):  # type: ignore[no-untyped-def]
        if failures["ack"] > 0:
            failures["ack"] -= 1
            raise StoreError("disk I/O error")
        await real_ack(ids)

    async def flaky_take(**kw):  # type: ignore[no-untyped-def]
        if failures["take_ready"] > 0:
            failures["take_ready"] -= 1
            raise StoreError("database is locked")
        return await real_take(**kw)

    store.ack = flaky_ack  # type: ignore[method-assign]
    store.take_ready = flaky_take  # type: ignore[method-assign]

    async def deliver(row: OutboxRow) -> None:
        got.append(row.msg_id)

    await fill(store, 30)
    relay, _ = make(clock, store, deliver, partitions=1)
    async with relay:
        await clock.advance(10)
        assert sorted(got) == sorted(f"m{i:05d}" for i in range(30))
        assert (await store.stats()).delivered == 30
        assert relay.metrics().store_errors == 4
        failures["ack"] = 10**6  # the disk is gone for good: stop must still return
        await store.enqueue(message("late", receiver="r0"))
        await clock.advance(0.1)
        assert "late" in got
    assert relay.metrics().store_errors > 4


async def test_each_receiver_is_served_by_its_fnv1a_partition() -> None:
    clock = VirtualClock()
    store = MemoryOutbox(clock)

    async def deliver(row: OutboxRow) -> None:
        return None

    await fill(store, 300, receivers=23)
    relay, _ = make(clock, store, deliver, partitions=4)
    expected: Counter[int] = Counter(relay.partition_of(f"r{i % 23}") for i in range(300))
    async with relay:
        await clock.advance(1)
        m = relay.metrics()
    assert {p: m.lane(p, "k").successes for p in expected} == dict(expected)  # type: ignore[union-attr]
    assert len(expected) == 4  # the 23 receivers spread over every partition
    assert relay.partition_of("r1") == fnv1a_32("r1") % 4
