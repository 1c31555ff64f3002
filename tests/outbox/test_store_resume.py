"""take_ready resumes a partition's scan past rows it already handed out: rows made takeable
again before that point (released, nacked, replayed) must still come back, oldest first."""

from __future__ import annotations

import asyncio
import random

from store_support import OpenStore, assert_conserved, make_msg

from agent.core.clock import SystemClock
from agent.outbox.store import OutboxStore


async def _ids(store: OutboxStore, limit: int) -> list[int]:
    return [r.row_id for r in await store.take_ready(limit=limit)]


async def test_released_row_before_the_resume_point_comes_back_first(store: OutboxStore) -> None:
    ids = [(await store.enqueue(make_msg(f"r{i}"))).row_id for i in range(10)]
    assert await _ids(store, 3) == ids[:3]
    assert await _ids(store, 3) == ids[3:6]  # resumed after ids[2]
    await store.release([ids[1]])
    assert await _ids(store, 3) == [ids[1], ids[6], ids[7]]


async def test_nacked_row_due_now_before_the_resume_point_comes_back(
    store: OutboxStore,
) -> None:
    ids = [(await store.enqueue(make_msg(f"r{i}"))).row_id for i in range(8)]
    assert await _ids(store, 4) == ids[:4]
    assert await _ids(store, 2) == ids[4:6]
    assert await store.nack(ids[0], delay_ms=0, error="boom") is False
    rows = await store.take_ready(limit=3)
    assert [r.row_id for r in rows] == [ids[0], ids[6], ids[7]]
    assert rows[0].attempts == 1


async def test_acks_keep_the_resume_point_and_nothing_is_skipped(store: OutboxStore) -> None:
    ids = [(await store.enqueue(make_msg(f"r{i % 3}"))).row_id for i in range(30)]
    got: list[int] = []
    while len(got) < len(ids):
        batch = await _ids(store, 4)
        assert batch, got
        got += batch
        await store.ack(batch[:2])  # the rest stays in flight, behind the resume point
    assert got == ids
    assert await _ids(store, 10) == []
    await store.ack(ids)
    stats = await assert_conserved(store)
    assert stats.delivered == 30 and stats.pending == 0


async def test_replayed_dead_row_before_the_resume_point_comes_back(
    open_store: OpenStore,
) -> None:
    store = await open_store(max_attempts=1)
    ids = [(await store.enqueue(make_msg(f"r{i}"))).row_id for i in range(6)]
    assert await _ids(store, 2) == ids[:2]
    assert await store.nack(ids[0], delay_ms=0, error="poison") is True
    assert await _ids(store, 2) == ids[2:4]
    assert await store.replay([ids[0]]) == 1
    assert await _ids(store, 3) == [ids[0], ids[4], ids[5]]


async def test_polls_with_releases_and_nacks_hand_each_row_out_once_at_a_time(
    open_store: OpenStore,
) -> None:
    """Polls race the writer's acks, nacks and releases: a row is never handed out while it is
    already out, and every row is finally delivered."""
    store = await open_store(clock=SystemClock())
    rng = random.Random(7)
    n = 3_000
    producer = asyncio.ensure_future(
        asyncio.gather(*(store.enqueue(make_msg(f"r{i % 23}", msg_id=f"c{i}")) for i in range(n)))
    )
    out: set[int] = set()
    delivered: set[int] = set()

    async def settle(rows: list[int]) -> None:
        acked = [r for r in rows if rng.random() < 0.8]
        back = [r for r in rows if r not in acked]
        # A row may be handed out again once its settling commit is done, so it leaves `out`
        # before that commit is asked for.
        out.difference_update(rows)
        if acked:
            await store.ack(acked)
            delivered.update(acked)
        for rid in back:
            if rng.random() < 0.5:
                await store.release([rid])
            else:
                await store.nack(rid, delay_ms=0, error="again")

    async def consumer(part: int) -> None:
        pending: list[asyncio.Future[None]] = []
        while len(delivered) < n:
            rows = [r.row_id for r in await store.take_ready(limit=40, partition=part, partitions=3)]
            assert not out.intersection(rows), "a row was handed out twice"
            out.update(rows)
            if rows:
                pending.append(asyncio.ensure_future(settle(rows)))
            await asyncio.sleep(0)
        await asyncio.gather(*pending)

    await asyncio.wait_for(asyncio.gather(producer, *(consumer(p) for p in range(3))), 90)
    assert len(delivered) == n
    stats = await assert_conserved(store)
    assert stats.delivered == n and stats.pending == 0


async def test_ack_of_a_row_dead_lettered_in_the_same_commit_counts_only_the_others(
    open_store: OpenStore,
) -> None:
    store = await open_store(max_attempts=1)
    a, b, c = [(await store.enqueue(make_msg(f"r{i}", payload=b"x" * (i + 1)))).row_id for i in range(3)]
    assert await _ids(store, 3) == [a, b, c]
    # one writer round: the nack sends `a` to the dead letters, then the ack meets it
    dead, _ = await asyncio.gather(store.nack(a, delay_ms=0, error="poison"), store.ack([a, b, b]))
    assert dead is True
    stats = await assert_conserved(store)
    assert (stats.delivered, stats.dead, stats.pending, stats.in_flight) == (1, 1, 1, 1)
    assert stats.by_class["telemetry"].pending_bytes == 3
    await store.ack([c, 999_999])  # an id never taken: nothing to delete, nothing counted
    stats = await assert_conserved(store)
    assert (stats.delivered, stats.pending, stats.in_flight) == (2, 0, 0)
