"""Mailbox policies at capacity, keyed coalescing, the retry hint, waiting, closing."""

from __future__ import annotations

import asyncio

import pytest

from agent.actors import MAX_RETRY_AFTER_MS, Mailbox, MailboxStatistics
from agent.core.clock import VirtualClock
from agent.core.errors import ActorStopped, MailboxFull


def make(capacity: int = 2, policy: str = "reject", **kw: object) -> tuple[Mailbox, list]:
    discarded: list[tuple[object, str]] = []
    box = Mailbox(
        capacity,
        policy,  # type: ignore[arg-type]
        name="box",
        clock=VirtualClock(),
        on_discard=lambda item, reason: discarded.append((item, reason)),
        **kw,  # type: ignore[arg-type]
    )
    return box, discarded


def take_all(box: Mailbox) -> list[object]:
    out = []
    while not box.empty():
        out.append(box.get_nowait())
        box.task_done()
    return out


def check_accounting(s: MailboxStatistics, offered: int) -> None:
    assert offered == s.enqueued + s.rejected
    assert s.enqueued == s.processed + s.depth + s.dropped + s.coalesced + s.drained
    assert s.depth <= s.capacity


# -- construction --------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [0, -1, -100])
def test_capacity_below_one_is_an_error_naming_it(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        Mailbox(capacity, name="box", clock=VirtualClock())


@pytest.mark.parametrize("capacity", [1.5, "2", None, True])
def test_capacity_must_be_an_int(capacity: object) -> None:
    with pytest.raises(TypeError, match="capacity"):
        Mailbox(capacity, name="box", clock=VirtualClock())  # type: ignore[arg-type]


def test_unknown_policy_is_an_error() -> None:
    with pytest.raises(ValueError, match="policy"):
        Mailbox(2, "drop_random", name="box", clock=VirtualClock())  # type: ignore[arg-type]


# -- policies at capacity: capacity 2, third message -------------------------------------------
def test_reject_third_message_then_retry_is_accepted() -> None:
    box, discarded = make(2, "reject")
    box.put_nowait("m1")
    box.put_nowait("m2")
    with pytest.raises(MailboxFull) as info:
        box.put_nowait("m3")
    assert info.value.actor == "box"
    assert 1 <= info.value.retry_after_ms <= MAX_RETRY_AFTER_MS
    s = box.statistics()
    assert (s.depth, s.rejected, s.dropped, s.enqueued) == (2, 1, 0, 2)
    assert discarded == []

    assert box.get_nowait() == "m1"
    box.task_done()
    box.put_nowait("m3")  # the retry is accepted once there is room
    assert take_all(box) == ["m2", "m3"]
    s = box.statistics()
    assert (s.processed, s.rejected, s.high_water) == (3, 1, 2)
    check_accounting(s, offered=4)


def test_drop_oldest_third_message_evicts_the_first() -> None:
    box, discarded = make(2, "drop_oldest")
    for m in ("m1", "m2", "m3"):
        box.put_nowait(m)
    assert discarded == [("m1", "dropped")]
    s = box.statistics()
    assert (s.depth, s.dropped, s.rejected) == (2, 1, 0)
    assert take_all(box) == ["m2", "m3"]
    check_accounting(box.statistics(), offered=3)


def test_drop_newest_third_message_is_discarded() -> None:
    box, discarded = make(2, "drop_newest")
    for m in ("m1", "m2", "m3"):
        box.put_nowait(m)
    assert discarded == [("m3", "dropped")]
    s = box.statistics()
    assert (s.depth, s.dropped, s.rejected) == (2, 1, 0)
    assert take_all(box) == ["m1", "m2"]
    box.put_nowait("m4")  # room again: accepted
    assert take_all(box) == ["m4"]
    check_accounting(box.statistics(), offered=4)


# -- coalescing ----------------------------------------------------------------------------------
def test_coalescing_newer_seq_replaces_in_place_without_a_slot() -> None:
    box, discarded = make(2, "reject")
    box.put_nowait("hb1", coalesce_key="dev-1", seq=1)
    box.put_nowait("other")
    box.put_nowait("hb2", coalesce_key="dev-1", seq=2)  # full, but takes no slot
    assert discarded == [("hb1", "coalesced")]
    s = box.statistics()
    assert (s.depth, s.coalesced, s.rejected) == (2, 1, 0)
    assert take_all(box) == ["hb2", "other"]  # keeps the first one's queue position
    check_accounting(box.statistics(), offered=3)


@pytest.mark.parametrize("seq", [1, 5])
def test_coalescing_older_or_equal_seq_is_dropped_and_counted(seq: int) -> None:
    box, discarded = make(2, "reject")
    box.put_nowait("hb5", coalesce_key="dev-1", seq=5)
    box.put_nowait(f"hb{seq}-late", coalesce_key="dev-1", seq=seq)
    assert discarded == [(f"hb{seq}-late", "coalesced")]
    assert box.statistics().coalesced == 1
    assert take_all(box) == ["hb5"]
    check_accounting(box.statistics(), offered=2)


def test_coalescing_keys_are_independent() -> None:
    box, _ = make(4)
    box.put_nowait("a1", coalesce_key="a", seq=1)
    box.put_nowait("b1", coalesce_key="b", seq=1)
    box.put_nowait("a2", coalesce_key="a", seq=2)
    box.put_nowait("plain")
    box.put_nowait("b3", coalesce_key="b", seq=3)
    assert take_all(box) == ["a2", "b3", "plain"]
    assert box.statistics().coalesced == 2


def test_rejected_coalescing_put_leaves_no_trace() -> None:
    box, discarded = make(2, "reject")
    box.put_nowait("m1")
    box.put_nowait("m2")
    with pytest.raises(MailboxFull):
        box.put_nowait("hb9", coalesce_key="dev-1", seq=9)
    assert box.get_nowait() == "m1"
    box.task_done()
    # Had the key been recorded at seq 9, this older seq would be dropped as stale.
    box.put_nowait("hb1", coalesce_key="dev-1", seq=1)
    assert discarded == []
    assert take_all(box) == ["m2", "hb1"]
    assert box.statistics().coalesced == 0


def test_drop_newest_coalescing_put_for_a_new_key_needs_a_slot() -> None:
    box, discarded = make(1, "drop_newest")
    box.put_nowait("m1")
    box.put_nowait("hb2", coalesce_key="k", seq=2)
    assert discarded == [("hb2", "dropped")]
    take_all(box)
    box.put_nowait("hb1", coalesce_key="k", seq=1)  # no trace of the dropped key
    assert take_all(box) == ["hb1"]


def test_drop_oldest_eviction_forgets_the_evicted_key() -> None:
    box, discarded = make(2, "drop_oldest")
    box.put_nowait("hb5", coalesce_key="k", seq=5)
    box.put_nowait("m2")
    box.put_nowait("m3")  # evicts hb5
    box.put_nowait("hb1", coalesce_key="k", seq=1)  # a new slot (evicts m2), not stale
    assert discarded == [("hb5", "dropped"), ("m2", "dropped")]
    assert take_all(box) == ["m3", "hb1"]


def test_key_is_forgotten_once_its_message_is_taken() -> None:
    box, _ = make(2)
    box.put_nowait("hb5", coalesce_key="k", seq=5)
    assert box.get_nowait() == "hb5"
    box.task_done()
    box.put_nowait("hb4", coalesce_key="k", seq=4)
    assert take_all(box) == ["hb4"]


# -- the retry_after_ms hint ---------------------------------------------------------------------
def rejected_hint(box: Mailbox) -> int:
    with pytest.raises(MailboxFull) as info:
        box.put_nowait("overflow")
    return info.value.retry_after_ms


def test_retry_hint_grows_with_queue_depth() -> None:
    hints = []
    for capacity in (2, 8, 32):
        box, _ = make(capacity, initial_service_s=0.01)
        for i in range(capacity):
            box.put_nowait(i)
        hints.append(rejected_hint(box))
    assert hints[0] < hints[1] < hints[2]
    box, _ = make(32, initial_service_s=0.01)
    depth_hints = []
    for i in range(4):
        box.put_nowait(i)
        depth_hints.append(box.retry_after_ms())
    assert depth_hints == sorted(depth_hints) and depth_hints[0] < depth_hints[-1]


async def test_retry_hint_grows_when_processing_slows() -> None:
    clock = VirtualClock()
    box = Mailbox(4, name="box", clock=clock, initial_service_s=0.001)

    async def process(n: int, each_s: float) -> None:
        for _ in range(n):
            box.put_nowait("work")
            box.get_nowait()
            await clock.advance(each_s)
            box.task_done()

    await process(20, 0.002)
    for i in range(4):
        box.put_nowait(i)
    fast = rejected_hint(box)
    take_all(box)
    await process(20, 0.5)  # the actor became slow: the EWMA follows it
    for i in range(4):
        box.put_nowait(i)
    slow = rejected_hint(box)
    assert box.service_time_s > 0.2
    assert slow > fast * 10


async def test_retry_hint_is_clamped() -> None:
    clock = VirtualClock()
    box = Mailbox(2, name="box", clock=clock, initial_service_s=0.0)
    box.put_nowait(1)
    box.put_nowait(2)
    assert rejected_hint(box) == 1  # never 0, even with instant processing
    box.get_nowait()
    await clock.advance(3600)
    box.task_done()
    box.put_nowait(3)
    assert rejected_hint(box) == MAX_RETRY_AFTER_MS


def test_task_done_without_a_message_is_an_error() -> None:
    box, _ = make()
    with pytest.raises(ValueError, match="task_done"):
        box.task_done()


def test_failed_messages_are_counted() -> None:
    box, _ = make()
    box.put_nowait(1)
    box.get_nowait()
    box.task_done(failed=True)
    assert box.statistics().failed == 1


# -- waiting without polling ---------------------------------------------------------------------
async def test_get_waits_for_a_put_without_timers() -> None:
    clock = VirtualClock()
    box = Mailbox(2, name="box", clock=clock)
    getter = asyncio.ensure_future(box.get())
    await clock.settle()
    assert not getter.done()
    assert clock.pending_timers == 0  # waiting is a future, not a polling timer
    box.put_nowait("m1")
    assert await getter == "m1"


async def test_put_waits_for_room_under_every_policy() -> None:
    for policy in ("reject", "drop_oldest", "drop_newest"):
        clock = VirtualClock()
        box = Mailbox(1, policy, name="box", clock=clock)  # type: ignore[arg-type]
        box.put_nowait("m1")
        putter = asyncio.ensure_future(box.put("m2"))
        await clock.settle()
        assert not putter.done()
        assert box.get_nowait() == "m1"
        await putter
        assert box.get_nowait() == "m2"
        assert box.statistics().dropped == 0


async def test_coalescing_put_with_a_queued_key_does_not_wait() -> None:
    box = Mailbox(1, name="box", clock=VirtualClock())
    box.put_nowait("hb1", coalesce_key="k", seq=1)
    await asyncio.wait_for(box.put("hb2", coalesce_key="k", seq=2), 1.0)
    assert box.get_nowait() == "hb2"


async def test_cancelled_getter_passes_the_wake_up_on() -> None:
    clock = VirtualClock()
    box = Mailbox(2, name="box", clock=clock)
    first = asyncio.ensure_future(box.get())
    second = asyncio.ensure_future(box.get())
    await clock.settle()
    box.put_nowait("m1")
    first.cancel()  # woken and cancelled before it ran
    await clock.settle()
    assert first.cancelled()
    assert await asyncio.wait_for(second, 1.0) == "m1"


# -- close and drain -----------------------------------------------------------------------------
async def test_close_hands_out_what_is_queued_then_raises() -> None:
    clock = VirtualClock()
    box = Mailbox(3, name="box", clock=clock)
    box.put_nowait("m1")
    box.close()
    with pytest.raises(ActorStopped):
        box.put_nowait("m2")
    assert await box.get() == "m1"
    with pytest.raises(ActorStopped):
        await box.get()


async def test_close_wakes_waiting_getters_and_putters() -> None:
    clock = VirtualClock()
    box = Mailbox(1, name="box", clock=clock)
    getter = asyncio.ensure_future(box.get())
    await clock.settle()
    box.close()
    with pytest.raises(ActorStopped):
        await getter
    box2 = Mailbox(1, name="box2", clock=clock)
    box2.put_nowait("m1")
    putter = asyncio.ensure_future(box2.put("m2"))
    await clock.settle()
    box2.close()
    with pytest.raises(ActorStopped):
        await putter


def test_drain_returns_queued_in_order_and_counts_them() -> None:
    box, _ = make(3)
    box.put_nowait("a", coalesce_key="k", seq=1)
    box.put_nowait("b")
    assert box.drain() == ["a", "b"]
    s = box.statistics()
    assert (s.depth, s.drained) == (0, 2)
    box.put_nowait("a0", coalesce_key="k", seq=0)  # keys went with the drained messages
    assert take_all(box) == ["a0"]
    check_accounting(box.statistics(), offered=3)


def test_get_nowait_on_empty_raises_queue_empty() -> None:
    box, _ = make()
    with pytest.raises(asyncio.QueueEmpty):
        box.get_nowait()


def test_a_raising_discard_hook_does_not_break_accounting() -> None:
    def broken(item: object, reason: str) -> None:
        raise RuntimeError("hook bug")

    box = Mailbox(1, "drop_oldest", name="box", clock=VirtualClock(), on_discard=broken)
    box.put_nowait("m1")
    box.put_nowait("m2")
    assert take_all(box) == ["m2"]
    check_accounting(box.statistics(), offered=2)
