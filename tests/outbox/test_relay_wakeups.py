"""When the relay wakes for work: an ack of rows it holds makes nothing new takeable, so it
wakes nobody, unless a row waited behind an acked one (a FIFO receiver's next row, a newer row
of an OVERWRITE key). Counted in store polls, never in time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

from store_support import OpenStore, make_msg

from agent.core.clock import VirtualClock
from agent.core.gate import Gate
from agent.outbox.limiter import AimdSettings
from agent.outbox.policy import ClassPolicy
from agent.outbox.reads import Flight
from agent.outbox.relay import Relay
from agent.outbox.store import OutboxStore
from agent.outbox.types import OutboxRow


def count_takes(store: OutboxStore) -> list[int]:
    """Wrap the store's take_ready; returns a one-element list holding the call count."""
    calls = [0]
    take = store.take_ready

    async def counted(**kwargs: object) -> list[OutboxRow]:
        calls[0] += 1
        return await take(**kwargs)  # type: ignore[arg-type]

    store.take_ready = counted  # type: ignore[method-assign]
    return calls


async def advance_until(clock: VirtualClock, done: Callable[[], bool], limit_s: float = 60) -> None:
    waited = 0.0
    while not done():
        assert waited < limit_s, "condition not reached in virtual time"
        await clock.advance(0.1)
        waited += 0.1


async def settled(store: OutboxStore, clock: VirtualClock) -> None:
    """Let every queued write and the wake-ups it causes run (a few loop rounds)."""
    await store.stats()
    for _ in range(5):
        await clock.advance(0.5)


async def test_acks_of_delivered_rows_cause_no_extra_takes(
    tmp_path: Path, clock: VirtualClock
) -> None:
    n = 12
    store = await OutboxStore.open(tmp_path / "outbox.db", clock=clock)
    takes = count_takes(store)
    held: list[OutboxRow] = []
    go = asyncio.Event()

    async def deliver(row: OutboxRow) -> None:
        held.append(row)
        await go.wait()

    await store.enqueue_many([make_msg(f"r{i}", kind="k") for i in range(n)])
    relay = Relay(store, deliver, clock=clock, ready=Gate(is_open=True), partitions=1,
                  classes=("k",), limits=AimdSettings(initial=n, max=2 * n))
    async with relay:
        await advance_until(clock, lambda: len(held) == n)
        await settled(store, clock)
        before = takes[0]
        go.set()  # every delivery returns: n acks, in one or more groups
        await advance_until(clock, lambda: relay.metrics().delivered == n)
        await settled(store, clock)
        assert (await store.stats()).delivered == n
        assert takes[0] == before, f"{takes[0] - before} polls after acks alone"
        # A new row still wakes the relay at once.
        await store.enqueue(make_msg("late", kind="k"))
        await advance_until(clock, lambda: len(held) == n + 1)
    await store.close()


async def test_ack_wakes_only_when_a_row_waited_behind_it(open_store: OpenStore) -> None:
    store = await open_store(classes={"fifo": ClassPolicy(fifo=True)}, ack_delay_ms=0)

    async def woken_by_ack(ids: Sequence[int]) -> bool:
        waiter = asyncio.ensure_future(store.wait_for_change())
        await asyncio.sleep(0)
        await store.ack(ids)
        await store.stats()  # (one more writer round: any wake has been delivered)
        woken = waiter.done()
        waiter.cancel()
        return woken

    # Plain rows: nothing waits behind them.
    await store.enqueue(make_msg(kind="plain"))
    rows = await store.take_ready(limit=10)
    assert not await woken_by_ack([r.row_id for r in rows])

    # A FIFO receiver's next row waits for the head in flight.
    await store.enqueue(make_msg("rx", kind="fifo"))
    await store.enqueue(make_msg("rx", kind="fifo"))
    (head,) = await store.take_ready(limit=10)
    assert await store.take_ready(limit=10) == []
    assert await woken_by_ack([head.row_id])
    assert len(await store.take_ready(limit=10)) == 1

    # A newer row of an OVERWRITE key waits for the older one in flight.
    await store.enqueue(make_msg("rx", kind="hb", key="hb", conflict="overwrite", seq=1))
    (old,) = await store.take_ready(limit=10, kinds=["hb"])
    await store.enqueue(make_msg("rx", kind="hb", key="hb", conflict="overwrite", seq=2))
    assert await store.take_ready(limit=10, kinds=["hb"]) == []
    assert await woken_by_ack([old.row_id])
    (new,) = await store.take_ready(limit=10, kinds=["hb"])
    assert new.seq == 2


def test_a_key_settled_during_a_scan_asks_for_another_look() -> None:
    flight = Flight()
    ident = ("dev", "rx", "hb")
    # (id, msg_id, owner, receiver, kind, payload, key, conflict, ..., fifo, size)
    flight.add([(1, "m", "dev", "rx", "hb", b"", "hb", "overwrite", 1, 0, 0, None, 0, None, 0, 1)])
    assert flight.blocked_by_acked([ident]) == (False, False)  # still in flight: noted waiting
    assert not flight.pop_freed()
    flight.settle([1], moved=False)
    assert flight.pop_freed()  # its waiting row is free: the store wakes the relay
    assert not flight.pop_freed()
    # Settled before the scan could note it waiting: the reader must ask for a look itself.
    assert flight.blocked_by_acked([ident]) == (False, True)
