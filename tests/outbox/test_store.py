"""OutboxStore semantics: enqueue, take, ack, nack, dead letters, TTL, caps, idle cost."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest
from store_support import OpenStore, assert_conserved, make_msg

from agent.core.clock import VirtualClock
from agent.core.errors import OutboxFull, StoreClosed
from agent.outbox.engine import ClassPolicy
from agent.outbox.partition import fnv1a_32
from agent.outbox.store import OutboxStore


async def test_enqueue_take_ack_fifo_per_receiver(store: OutboxStore) -> None:
    ids = [(await store.enqueue(make_msg("r1", payload=bytes([i])))).row_id for i in range(5)]
    assert ids == sorted(ids) and len(set(ids)) == 5
    rows = await store.take_ready(limit=10)
    assert [r.row_id for r in rows] == ids
    assert [r.payload for r in rows] == [bytes([i]) for i in range(5)]
    assert all(r.attempts == 0 and r.receiver == "r1" for r in rows)
    # in flight: a second take does not hand them out again
    assert await store.take_ready(limit=10) == []
    stats = await store.stats()
    assert (stats.pending, stats.in_flight) == (5, 5)
    await store.ack(ids[:3])
    stats = await assert_conserved(store)
    assert (stats.pending, stats.delivered, stats.in_flight) == (2, 3, 2)
    await store.release(ids[3:])
    rows = await store.take_ready(limit=10)
    assert [r.row_id for r in rows] == ids[3:]
    assert rows[0].attempts == 0  # release spends no attempt


async def test_ids_are_never_reused(open_store: OpenStore, db_path) -> None:
    store = await open_store()
    a = (await store.enqueue(make_msg())).row_id
    await store.take_ready(limit=1)
    await store.ack([a])
    await store.close()
    store = await open_store()
    b = (await store.enqueue(make_msg())).row_id
    assert b is not None and a is not None and b > a


async def test_take_ready_limit_and_send_at(store: OutboxStore, clock: VirtualClock) -> None:
    await store.enqueue(make_msg("a"), delay_ms=5_000)
    now = await store.enqueue(make_msg("b"))
    assert [r.row_id for r in await store.take_ready(limit=10)] == [now.row_id]
    assert await store.next_due_ms() == clock.now_ms() + 5_000
    await clock.advance(5)
    assert [r.receiver for r in await store.take_ready(limit=10)] == ["a"]
    assert await store.next_due_ms() is None


async def test_partitions_and_kinds_filter(store: OutboxStore) -> None:
    receivers = [f"dev-{i}" for i in range(40)]
    for r in receivers:
        await store.enqueue(make_msg(r, kind="a" if len(r) % 2 else "b"))
    seen: list[str] = []
    for p in range(4):
        rows = await store.take_ready(limit=100, partition=p, partitions=4)
        assert all(fnv1a_32(r.receiver) % 4 == p for r in rows)
        seen += [r.receiver for r in rows]
    assert sorted(seen) == sorted(receivers)
    await store.release([r for r in range(1, 41)])
    only_b = await store.take_ready(limit=100, kinds=["b"])
    assert only_b and {r.kind for r in only_b} == {"b"}
    assert await store.take_ready(limit=100, kinds=[]) == []


async def test_fifo_class_one_per_receiver_in_order(open_store: OpenStore) -> None:
    store = await open_store(classes={"cmd": ClassPolicy(fifo=True)}, max_attempts=5)
    a = [(await store.enqueue(make_msg("r1", kind="cmd"))).row_id for _ in range(3)]
    b = (await store.enqueue(make_msg("r2", kind="cmd"))).row_id
    other = (await store.enqueue(make_msg("r1", kind="telemetry"))).row_id
    rows = await store.take_ready(limit=10)
    assert sorted(r.row_id for r in rows) == sorted([a[0], b, other])
    assert await store.take_ready(limit=10) == []  # r1's next waits for its head
    # the head fails and backs off: later rows of r1 must not overtake it
    await store.nack(a[0], delay_ms=1_000, error="busy")
    assert await store.take_ready(limit=10) == []
    assert await store.next_due_ms() == store._clock.now_ms() + 1_000  # type: ignore[attr-defined]
    clock: VirtualClock = store._clock  # type: ignore[assignment]
    await clock.advance(1)
    assert [r.row_id for r in await store.take_ready(limit=10)] == [a[0]]
    await store.ack([a[0]])
    assert [r.row_id for r in await store.take_ready(limit=10)] == [a[1]]
    await assert_conserved(store)


async def test_append_duplicate_key_is_rejected_and_counted(store: OutboxStore) -> None:
    first = await store.enqueue(make_msg(key="job-1"))
    dup = await store.enqueue(make_msg(key="job-1"))
    assert (first.outcome, dup.outcome, dup.row_id) == ("stored", "duplicate", first.row_id)
    # same key for another receiver or owner is a different message
    assert (await store.enqueue(make_msg("other", key="job-1"))).outcome == "stored"
    assert (await store.enqueue(make_msg(owner="dev-2", key="job-1"))).outcome == "stored"
    # in flight still counts as pending
    await store.take_ready(limit=10)
    assert (await store.enqueue(make_msg(key="job-1"))).outcome == "duplicate"
    # once delivered the key is free again
    assert first.row_id is not None
    await store.ack([first.row_id])
    assert (await store.enqueue(make_msg(key="job-1"))).outcome == "stored"
    stats = await assert_conserved(store)
    assert stats.duplicates == 2


async def test_overwrite_newer_replaces_older_is_stale(store: OutboxStore) -> None:
    def hb(seq: int) -> object:
        return make_msg(key="heartbeat", conflict="overwrite", seq=seq, payload=b"s%d" % seq)

    r1 = await store.enqueue(hb(1))  # type: ignore[arg-type]
    r2 = await store.enqueue(hb(3))  # type: ignore[arg-type]
    r3 = await store.enqueue(hb(2))  # type: ignore[arg-type]
    r4 = await store.enqueue(hb(3))  # type: ignore[arg-type]
    assert [r.outcome for r in (r1, r2, r3, r4)] == ["stored", "overwritten", "stale", "stale"]
    # a committed row is replaced by a new one (same place in the ready order); the stale
    # newcomer names the row that won
    assert r2.row_id != r1.row_id and r3.row_id == r4.row_id == r2.row_id
    assert await store.get(r1.row_id) is None  # type: ignore[arg-type]
    rows = await store.take_ready(limit=10)
    assert [(r.seq, r.payload) for r in rows] == [(3, b"s3")]
    stats = await assert_conserved(store)
    assert (stats.overwritten, stats.dropped, stats.pending) == (1, 2, 1)


async def test_overwrite_never_touches_a_row_in_flight(store: OutboxStore) -> None:
    def hb(seq: int):
        return make_msg(key="hb", conflict="overwrite", seq=seq, payload=b"%d" % seq)

    first = await store.enqueue(hb(1))
    [flying] = await store.take_ready(limit=10)
    waiting = await store.enqueue(hb(2))
    assert waiting.outcome == "stored" and waiting.row_id != first.row_id
    # further overwrites replace the waiting row, not the one in flight
    again = await store.enqueue(hb(3))
    assert again.outcome == "overwritten" and again.row_id not in (first.row_id, waiting.row_id)
    assert await store.get(waiting.row_id) is None  # type: ignore[arg-type]
    row = await store.get(flying.row_id)
    assert row is not None and row.payload == b"1"
    await store.ack([flying.row_id])
    stats = await assert_conserved(store)
    assert stats.pending == 1


async def test_waiting_overwrite_row_waits_for_the_one_in_flight(store: OutboxStore) -> None:
    await store.enqueue(make_msg(key="hb", conflict="overwrite", seq=1))
    [flying] = await store.take_ready(limit=10)
    await store.enqueue(make_msg(key="hb", conflict="overwrite", seq=2))
    assert await store.take_ready(limit=10) == []  # one row of a key in flight at a time
    await store.ack([flying.row_id])
    [waiting] = await store.take_ready(limit=10)
    assert waiting.seq == 2 and waiting.row_id != flying.row_id


async def test_nacked_overwrite_row_superseded_by_newer_is_dropped(store: OutboxStore) -> None:
    await store.enqueue(make_msg(key="hb", conflict="overwrite", seq=1))
    [flying] = await store.take_ready(limit=10)
    await store.enqueue(make_msg(key="hb", conflict="overwrite", seq=2))
    assert await store.nack(flying.row_id, delay_ms=0, error="timeout") is False
    assert await store.get(flying.row_id) is None
    rows = await store.take_ready(limit=10)
    assert [r.seq for r in rows] == [2]
    stats = await assert_conserved(store)
    assert stats.overwritten == 1


async def test_poison_message_dead_after_exactly_max_attempts_and_replay(
    open_store: OpenStore, clock: VirtualClock
) -> None:
    store = await open_store(max_attempts=2)
    rid = (await store.enqueue(make_msg(payload=b"poison"))).row_id
    tries = 0
    while True:
        rows = await store.take_ready(limit=10)
        if not rows:
            if await store.next_due_ms() is None:
                break
            await clock.advance(1)
            continue
        tries += 1
        assert rows[0].attempts == tries - 1
        died = await store.nack(rows[0].row_id, delay_ms=500, error=f"refused #{tries}")
        assert died == (tries == 2)
    assert tries == 2
    [dead] = await store.list_dead()
    assert (dead.row_id, dead.attempts, dead.last_error) == (rid, 2, "refused #2")
    stats = await assert_conserved(store)
    assert (stats.dead, stats.dead_lettered, stats.pending) == (1, 1, 0)
    assert stats.by_class["telemetry"].dead == 1

    assert await store.replay([rid]) == 1  # type: ignore[list-item]
    [row] = await store.take_ready(limit=10)
    assert (row.row_id, row.attempts, row.payload) == (rid, 0, b"poison")
    await store.ack([row.row_id])
    stats = await assert_conserved(store)
    assert (stats.delivered, stats.replayed, stats.dead, stats.pending) == (1, 1, 0, 0)


async def test_permanent_failure_dead_at_once_and_purge(store: OutboxStore) -> None:
    ids = [(await store.enqueue(make_msg())).row_id for _ in range(3)]
    await store.take_ready(limit=10)
    for rid in ids:
        await store.dead_letter(rid, error="malformed")  # type: ignore[arg-type]
    dead = await store.list_dead(limit=2)
    assert [d.row_id for d in dead] == ids[:2]
    assert [d.row_id for d in await store.list_dead(limit=10, offset=2)] == ids[2:]
    assert all(d.attempts == 1 and d.last_error == "malformed" for d in dead)
    assert await store.purge([ids[0]]) == 1  # type: ignore[list-item]
    assert await store.purge() == 2
    assert await store.list_dead() == []
    stats = await assert_conserved(store)
    assert (stats.dead, stats.dead_lettered) == (0, 3)


async def test_ttl_expired_message_is_never_delivered(
    open_store: OpenStore, clock: VirtualClock
) -> None:
    store = await open_store(classes={"status": ClassPolicy(ttl_ms=10_000)})
    await store.enqueue(make_msg(kind="status"))  # class default: 10 s
    never = await store.enqueue(make_msg(kind="status", ttl_ms=0))
    short = await store.enqueue(make_msg(kind="telemetry", ttl_ms=1_000), delay_ms=500)
    backed = await store.enqueue(make_msg(kind="telemetry", ttl_ms=3_000))
    [row] = [r for r in await store.take_ready(limit=10) if r.row_id == backed.row_id]
    assert row.expires_at_ms == clock.now_ms() + 3_000
    await store.release([r for r in range(1, 5)])
    await store.take_ready(limit=10)
    await store.nack(backed.row_id, delay_ms=5_000, error="busy")  # type: ignore[arg-type]
    await store.release([r for r in range(1, 5)])
    await clock.advance(11)
    rows = await store.take_ready(limit=10)
    assert [(r.row_id, r.expires_at_ms) for r in rows] == [(never.row_id, None)]
    stats = await assert_conserved(store)
    assert stats.expired == 3 and stats.pending == 1
    assert await store.get(short.row_id) is None  # type: ignore[arg-type]


async def test_expire_due_sweeps_rows_not_yet_due(
    store: OutboxStore, clock: VirtualClock
) -> None:
    await store.enqueue(make_msg(ttl_ms=1_000), delay_ms=60_000)
    await clock.advance(2)
    assert await store.expire_due() == 1
    stats = await assert_conserved(store)
    assert (stats.expired, stats.pending) == (1, 0)


async def test_cap_reject_raises_and_stores_nothing(open_store: OpenStore) -> None:
    store = await open_store(
        classes={"bulk": ClassPolicy(max_messages=3, full_policy="reject")}
    )
    for _ in range(3):
        await store.enqueue(make_msg(kind="bulk"))
    with pytest.raises(OutboxFull):
        await store.enqueue(make_msg(kind="bulk"))
    # other classes are not affected
    assert (await store.enqueue(make_msg(kind="other"))).outcome == "stored"
    # enqueue_many is all or nothing
    [first] = await store.take_ready(limit=1, kinds=["bulk"])
    await store.ack([first.row_id])
    with pytest.raises(OutboxFull):
        await store.enqueue_many([make_msg(kind="bulk"), make_msg(kind="bulk")])
    stats = await assert_conserved(store)
    assert stats.by_class["bulk"].pending == 2
    assert stats.rejected_full == 2
    # a duplicate needs no room and is not a rejection
    await store.enqueue(make_msg(kind="bulk", key="k1"))
    assert (await store.enqueue(make_msg(kind="bulk", key="k1"))).outcome == "duplicate"
    stats = await assert_conserved(store)
    assert stats.rejected_full == 2


async def test_cap_drop_oldest_by_count_and_bytes(open_store: OpenStore) -> None:
    store = await open_store(
        classes={"t": ClassPolicy(max_messages=3, max_bytes=100, full_policy="drop_oldest")}
    )
    ids = [(await store.enqueue(make_msg(kind="t", payload=b"x" * 10))).row_id for _ in range(3)]
    [flying] = await store.take_ready(limit=1)
    assert flying.row_id == ids[0]
    await store.enqueue(make_msg(kind="t", payload=b"y" * 10))
    # the oldest not in flight went
    assert await store.get(ids[1]) is None  # type: ignore[arg-type]
    assert await store.get(ids[0]) is not None  # type: ignore[arg-type]
    await store.enqueue(make_msg(kind="t", payload=b"z" * 75))  # bytes: 10+10+10+75 > 100
    stats = await assert_conserved(store)
    assert stats.dropped == 2
    assert stats.by_class["t"].pending_bytes <= 100
    with pytest.raises(OutboxFull):  # larger than the whole class
        await store.enqueue(make_msg(kind="t", payload=b"w" * 101))
    await assert_conserved(store)


async def test_empty_take_ready_performs_no_write(store: OutboxStore) -> None:
    await store.enqueue(make_msg(), delay_ms=10_000)
    before = store.write_transactions
    # an outside connection sees data_version move only when someone commits
    conn = sqlite3.connect(store.path)
    try:
        version = conn.execute("PRAGMA data_version").fetchone()
        for _ in range(20):
            assert await store.take_ready(limit=10) == []
            assert await store.next_due_ms() is not None
            await store.stats()
        assert store.write_transactions == before
        assert conn.execute("PRAGMA data_version").fetchone() == version
        # the check itself can fail: a real write moves it
        await store.enqueue(make_msg())
        assert conn.execute("PRAGMA data_version").fetchone() != version
        assert store.write_transactions == before + 1
    finally:
        conn.close()


async def test_concurrent_enqueues_share_commits(store: OutboxStore) -> None:
    before = store.write_transactions
    results = await asyncio.gather(*(store.enqueue(make_msg(f"r{i}")) for i in range(200)))
    assert len({r.row_id for r in results}) == 200
    assert store.write_transactions - before < 20
    await assert_conserved(store)


async def test_reopen_keeps_rows_attempts_and_counters(
    open_store: OpenStore, clock: VirtualClock
) -> None:
    store = await open_store(max_attempts=5)
    a = (await store.enqueue(make_msg("r", payload=b"a"))).row_id
    b = (await store.enqueue(make_msg("r", payload=b"b"))).row_id
    await store.take_ready(limit=10)
    await store.nack(a, delay_ms=0, error="busy")  # type: ignore[arg-type]
    await store.close()
    with pytest.raises(StoreClosed):
        await store.enqueue(make_msg())
    store = await open_store(max_attempts=5)
    rows = await store.take_ready(limit=10)
    assert {(r.row_id, r.attempts) for r in rows} == {(a, 1), (b, 0)}
    assert [r.last_error for r in rows if r.row_id == a] == ["busy"]
    stats = await assert_conserved(store)
    assert stats.enqueued == 2


async def test_wait_for_change_wakes_on_enqueue_and_not_before(store: OutboxStore) -> None:
    await store.take_ready(limit=10)
    waiter = asyncio.ensure_future(store.wait_for_change())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    await store.enqueue(make_msg())
    await asyncio.wait_for(waiter, 5)


async def test_wait_for_change_does_not_miss_a_change_after_the_last_look(
    store: OutboxStore,
) -> None:
    assert await store.take_ready(limit=10) == []
    other = asyncio.ensure_future(store.enqueue(make_msg()))
    await other
    # the change happened between our take and our wait (same task): we return at once
    async with asyncio.timeout(1):
        await store.wait_for_change()


async def test_closed_store_refuses_everything(store: OutboxStore) -> None:
    waiter = asyncio.ensure_future(store.wait_for_change())
    await asyncio.sleep(0)
    await store.close()
    with pytest.raises(StoreClosed):
        await waiter
    with pytest.raises(StoreClosed):
        await store.enqueue(make_msg())
    with pytest.raises(StoreClosed):
        await store.take_ready(limit=1)
    await store.close()  # idempotent


async def test_bad_messages_are_refused_with_value_error(store: OutboxStore) -> None:
    with pytest.raises(ValueError):
        await store.enqueue(make_msg(conflict="overwrite"))  # no key
    with pytest.raises(ValueError):
        await store.enqueue(make_msg(conflict="sideways"))
    with pytest.raises(ValueError):
        await store.enqueue(make_msg(payload="text"))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await store.take_ready(limit=1, partition=4, partitions=4)
    with pytest.raises(ValueError):
        ClassPolicy(max_messages=0)
    await assert_conserved(store)


async def test_stats_by_class_and_oldest_age(store: OutboxStore, clock: VirtualClock) -> None:
    assert (await store.stats()).oldest_pending_age_ms is None
    await store.enqueue(make_msg(kind="a", payload=b"12345"))
    await clock.advance(2)
    await store.enqueue(make_msg(kind="b"))
    await store.take_ready(limit=1)
    stats = await store.stats()
    assert stats.oldest_pending_age_ms == 2_000
    assert stats.by_class["a"].pending == 1 and stats.by_class["a"].in_flight == 1
    assert stats.by_class["a"].pending_bytes == 5
    assert stats.by_class["b"].in_flight == 0


async def test_concurrent_polls_and_acks_never_hand_a_row_out_twice(
    open_store: OpenStore,
) -> None:
    """Polls read on the loop's thread while the writer thread commits acks: a row acked (or
    nacked) during a poll must not come back from that poll's older snapshot."""
    from agent.core.clock import SystemClock

    store = await open_store(clock=SystemClock())
    n = 6_000
    producer = asyncio.ensure_future(
        asyncio.gather(*(store.enqueue(make_msg(f"r{i % 37}", msg_id=f"c{i}")) for i in range(n)))
    )
    seen: list[str] = []

    async def consumer(part: int) -> None:
        while len(seen) < n:
            rows = await store.take_ready(limit=50, partition=part, partitions=4)
            seen.extend(r.msg_id for r in rows)
            if rows:
                asyncio.ensure_future(store.ack([r.row_id for r in rows]))
            await asyncio.sleep(0)

    await asyncio.wait_for(asyncio.gather(producer, *(consumer(p) for p in range(4))), 60)
    assert len(seen) == len(set(seen)) == n
    await asyncio.sleep(0.05)
    stats = await assert_conserved(store)
    assert stats.delivered + stats.pending == n


async def test_enqueue_many_matches_one_by_one(open_store: OpenStore, tmp_path) -> None:
    """A big batch (keys looked up in bulk, rows written together) decides exactly as the
    same messages enqueued one at a time."""
    import random

    rng = random.Random(7)
    msgs = [
        make_msg(
            f"r{rng.randrange(3)}",
            owner=f"d{rng.randrange(20)}",
            key=f"k{rng.randrange(3)}",
            conflict=rng.choice(["append", "overwrite"]),
            seq=rng.randrange(10),
            payload=b"%d" % i,
        )
        for i in range(400)
    ]
    one = await open_store(tmp_path / "one.db")
    await one.enqueue(msgs[0])  # something committed before, so both paths meet old rows
    many = await open_store(tmp_path / "many.db")
    await many.enqueue(msgs[0])
    singles = [await one.enqueue(m) for m in msgs[1:]]
    batch = await many.enqueue_many(msgs[1:])
    assert [r.outcome for r in batch] == [r.outcome for r in singles]
    s1, s2 = await assert_conserved(one), await assert_conserved(many)
    assert (s1.pending, s1.overwritten, s1.dropped, s1.duplicates) == (
        s2.pending, s2.overwritten, s2.dropped, s2.duplicates,
    )
    rows1 = sorted((r.owner, r.receiver, r.key, r.seq, r.payload)
                   for r in await one.take_ready(limit=1_000))
    rows2 = sorted((r.owner, r.receiver, r.key, r.seq, r.payload)
                   for r in await many.take_ready(limit=1_000))
    assert rows1 == rows2
