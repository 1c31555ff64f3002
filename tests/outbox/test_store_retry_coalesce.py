"""Two store rules the relay relies on:

* a `Capacity` (busy) answer spends no delivery attempt: a receiver that stays busy for a long
  time never sends telemetry to the dead letters, while `Transient` failures still count;
* an OVERWRITE key has at most one row in flight and one pending: a newer row waits (is not
  handed out) while an older row of its key is in flight, and when that older row comes back
  (nacked or released) with a newer one waiting, the older one is coalesced (counted as
  overwritten) instead of being retried.
"""

from __future__ import annotations

import sqlite3

from store_support import OpenStore, assert_conserved, make_msg

from agent.core.clock import VirtualClock
from agent.core.errors import Transient
from agent.core.gate import Gate
from agent.outbox.relay import Relay
from agent.outbox.retry import RetryPolicy
from agent.outbox.store import OutboxStore
from agent.outbox.types import OutboxMessage, OutboxRow


def hb(seq: int, *, owner: str = "dev-1") -> OutboxMessage:
    return make_msg(
        owner=owner, kind="heartbeat", key="heartbeat", conflict="overwrite", seq=seq,
        payload=b"hb%d" % seq,
    )


# -- Capacity spends no attempt -------------------------------------------------------------
async def test_capacity_nack_spends_no_attempt(open_store: OpenStore, clock: VirtualClock) -> None:
    store = await open_store(max_attempts=2)
    rid = (await store.enqueue(make_msg(payload=b"t"))).row_id
    for i in range(10):  # busy for far longer than max_attempts tries
        [row] = await store.take_ready(limit=10)
        assert row.attempts == 0
        died = await store.nack(row.row_id, delay_ms=1_000, error=f"busy #{i}", outcome="capacity")
        assert died is False
        assert await store.take_ready(limit=10) == []  # backed off: not due yet
        await clock.advance(1)
    row2 = await store.get(rid)  # type: ignore[arg-type]
    assert row2 is not None and (row2.attempts, row2.last_error) == (0, "busy #9")
    # Transient failures still count: dead after exactly max_attempts of them.
    [row] = await store.take_ready(limit=10)
    assert await store.nack(row.row_id, delay_ms=0, error="timeout", outcome="transient") is False
    [row] = await store.take_ready(limit=10)
    assert row.attempts == 1
    assert await store.nack(row.row_id, delay_ms=0, error="timeout") is True  # default: counts
    stats = await assert_conserved(store)
    assert (stats.dead, stats.pending) == (1, 0)


async def test_capacity_nack_of_a_superseded_overwrite_row_still_coalesces(
    store: OutboxStore,
) -> None:
    await store.enqueue(hb(1))
    [flying] = await store.take_ready(limit=10)
    await store.enqueue(hb(2))
    assert await store.nack(flying.row_id, delay_ms=0, error="busy", outcome="capacity") is False
    assert await store.get(flying.row_id) is None
    assert [r.seq for r in await store.take_ready(limit=10)] == [2]
    assert (await assert_conserved(store)).overwritten == 1


async def test_nack_outcome_is_checked(store: OutboxStore) -> None:
    await store.enqueue(make_msg())
    [row] = await store.take_ready(limit=1)
    try:
        await store.nack(row.row_id, delay_ms=0, error="x", outcome="later")  # type: ignore[arg-type]
    except ValueError as exc:
        assert "outcome" in str(exc)
    else:
        raise AssertionError("an unknown outcome was accepted")


# -- one in flight + one pending per OVERWRITE key ----------------------------------------
async def test_newer_overwrite_rows_wait_while_their_key_is_in_flight(store: OutboxStore) -> None:
    await store.enqueue(hb(1))
    [flying] = await store.take_ready(limit=10)
    for seq in range(2, 12):
        await store.enqueue(hb(seq))
        assert await store.take_ready(limit=10) == []  # the key is in flight: the newer waits
    stats = await assert_conserved(store)
    assert (stats.pending, stats.in_flight) == (2, 1)  # one in flight + one pending
    assert await store.next_due_ms() is None  # nothing the relay could take now
    # another key (another device) is not held back
    await store.enqueue(hb(1, owner="dev-2"))
    assert [r.owner for r in await store.take_ready(limit=10)] == ["dev-2"]
    # the try fails: the waiting newer row supersedes the one in flight
    assert await store.nack(flying.row_id, delay_ms=0, error="timeout") is False
    [row] = await store.take_ready(limit=10)
    assert (row.owner, row.seq) == ("dev-1", 11)
    stats = await assert_conserved(store)
    assert stats.overwritten == 10  # hb1 (nacked) and hb2..hb10 (overwritten while waiting)


async def test_released_overwrite_row_superseded_by_newer_is_coalesced(
    store: OutboxStore,
) -> None:
    await store.enqueue(hb(1))
    [flying] = await store.take_ready(limit=10)
    await store.enqueue(hb(2))
    await store.release([flying.row_id])
    assert await store.get(flying.row_id) is None
    assert [r.seq for r in await store.take_ready(limit=10)] == [2]
    stats = await assert_conserved(store)
    assert (stats.overwritten, stats.pending) == (1, 1)


async def test_released_overwrite_row_without_newer_stays(store: OutboxStore) -> None:
    await store.enqueue(hb(1))
    [flying] = await store.take_ready(limit=10)
    await store.release([flying.row_id])
    [again] = await store.take_ready(limit=10)
    assert (again.row_id, again.attempts) == (flying.row_id, 0)


async def test_acked_overwrite_row_lets_the_waiting_one_go(store: OutboxStore) -> None:
    await store.enqueue(hb(1))
    [flying] = await store.take_ready(limit=10)
    await store.enqueue(hb(2))
    assert await store.take_ready(limit=10) == []
    await store.ack([flying.row_id])
    [row] = await store.take_ready(limit=10)
    assert row.seq == 2
    stats = await assert_conserved(store)
    assert (stats.delivered, stats.overwritten) == (1, 0)


async def test_leader_down_broker_up_keeps_one_flying_one_pending_heartbeat(
    open_store: OpenStore, clock: VirtualClock, db_path
) -> None:
    """The relay's deliveries get no answer (the leader is down, the broker up): each times
    out after 30 s as Transient. Heartbeats every 5 s for 10 minutes never leave more than one
    row in flight and one pending for the device; when the leader answers again, the latest
    heartbeat arrives."""
    store = await open_store(max_attempts=1_000)
    leader_up = False
    delivered: list[int] = []

    async def deliver(row: OutboxRow) -> None:
        if not leader_up:
            await clock.sleep(30)
            raise Transient("no answer in 30 s")
        delivered.append(row.seq)

    relay = Relay(
        store, deliver, clock=clock, ready=Gate(is_open=True), partitions=2,
        retry=RetryPolicy(base_s=1.0, cap_s=10.0, transient_floor_s=0.5),
        reconnect_jitter_s=0.0,
    )
    most = 0
    async with relay:
        for seq in range(1, 121):
            await store.enqueue(hb(seq))
            await clock.advance(5)
            most = max(most, _rows_of(db_path))
        leader_up = True
        await clock.advance(60)
        stats = await assert_conserved(store)
    assert most <= 2, most
    assert delivered and delivered[-1] == 120
    assert (stats.pending, stats.in_flight) == (0, 0)


def _rows_of(path) -> int:
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT count(*) FROM outbox WHERE status = 'pending'").fetchone()[0])
    finally:
        conn.close()


# -- supersede: a newer message of the key went another way --------------------------------
async def test_supersede_drops_older_pending_rows_of_the_key_and_keeps_the_books(store: OutboxStore) -> None:
    await store.enqueue(hb(5))
    await store.enqueue(hb(3, owner="dev-2"))  # another device's key: not touched
    assert await store.supersede("dev-1", "leader", "heartbeat", 5) == 0  # not older than 5
    assert await store.supersede("dev-1", "leader", "heartbeat", 9) == 1
    assert await store.supersede("dev-1", "leader", "heartbeat", 9) == 0  # idempotent
    stats = await store.stats()
    assert stats.pending == 1 and stats.overwritten == 1
    await assert_conserved(store)
    [row] = await store.take_ready(limit=10)
    assert row.owner == "dev-2"


async def test_supersede_leaves_a_row_in_flight_to_its_ack(store: OutboxStore) -> None:
    await store.enqueue(hb(5))
    [row] = await store.take_ready(limit=10)
    assert await store.supersede("dev-1", "leader", "heartbeat", 9) == 0
    await store.ack([row.row_id])
    stats = await store.stats()
    assert stats.pending == 0 and stats.delivered == 1 and stats.overwritten == 0
    await assert_conserved(store)
