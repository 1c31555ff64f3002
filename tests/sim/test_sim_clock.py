"""SimClock: timers fire in ticks, in order; the outbox works on the loop under it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agent.outbox.store import OutboxStore
from agent.outbox.types import OutboxMessage
from agent.sim.clock import SimClock


async def test_timers_within_a_tick_fire_together_in_deadline_order() -> None:
    clock = SimClock(tick_s=0.5)
    seen: list[tuple[str, float]] = []
    for name, delay in (("c", 1.3), ("a", 1.0), ("b", 1.2), ("d", 1.6), ("e", 3.0)):
        clock.call_later(delay, lambda n=name: seen.append((n, clock.monotonic())))
    await clock.advance(2.0)
    # a, b, c fall within one tick of a: fired in order, each reading its own deadline
    assert [n for n, _ in seen] == ["a", "b", "c", "d"]
    assert [t for _, t in seen] == pytest.approx([1.0, 1.2, 1.3, 1.6])
    assert clock.monotonic() == 2.0
    assert clock.settles < 8  # two batches and the settles around them, not one per timer


async def test_a_cancelled_timer_never_fires_even_inside_a_batch() -> None:
    clock = SimClock(tick_s=1.0)
    fired: list[str] = []
    later = clock.call_later(0.5, lambda: fired.append("later"))
    clock.call_later(0.2, later.cancel)
    await clock.advance(1.0)
    assert fired == []
    with pytest.raises(ValueError):
        SimClock(tick_s=-1)


async def test_settle_waits_for_busy_work_without_polling() -> None:
    clock = SimClock()
    done: list[int] = []

    async def work() -> None:
        with clock.busy():
            await asyncio.sleep(0.01)  # stands for a thread's work
            done.append(1)

    task = asyncio.ensure_future(work())
    await asyncio.sleep(0)
    await clock.settle()
    assert done == [1]
    await task


async def test_outbox_under_the_sim_clock_runs_on_the_loop(tmp_path: Path) -> None:
    clock = SimClock()
    store = await OutboxStore.open(tmp_path / "o.db", clock=clock)
    try:
        assert store._writer.inline is True
        msg = OutboxMessage(msg_id="m1", owner="dev-1", receiver="leader", kind="telemetry", payload=b"x")
        result = await store.enqueue(msg)
        assert result.outcome == "stored"
        assert (await store.stats()).pending == 1
    finally:
        await store.close()
    reopened = await OutboxStore.open(tmp_path / "o.db", clock=clock)
    try:
        assert (await reopened.stats()).pending == 1  # durable across a close
    finally:
        await reopened.close()


@settings(deadline=None, max_examples=40)
@given(
    tick=st.sampled_from([0.0, 0.05, 0.1, 0.5]),
    timers=st.lists(st.tuples(st.floats(0, 30, allow_nan=False), st.booleans()), min_size=1, max_size=40),
    steps=st.lists(st.floats(0.01, 7, allow_nan=False), min_size=1, max_size=6),
)
@example(tick=0.5, timers=[(1.0, False), (1.6, False), (1.4, True)], steps=[3.0])
async def test_buckets_fire_every_live_timer_once_in_order_batching_only_within_a_tick(
    tick: float, timers: list[tuple[float, bool]], steps: list[float]
) -> None:
    clock = SimClock(tick_s=tick)
    loop = asyncio.get_running_loop()
    events: list[tuple[str, int]] = []

    def fire(n: int) -> None:
        events.append(("fired", n))
        loop.call_soon(events.append, ("settled", n))  # work the timer triggers

    handles = [clock.call_later(delay, lambda n=n: fire(n)) for n, (delay, _) in enumerate(timers)]
    for handle, (_, cancel) in zip(handles, timers, strict=True):
        if cancel:
            handle.cancel()
    live = sorted((d, n) for n, (d, cancel) in enumerate(timers) if not cancel)
    assert clock.pending_timers == len(live)
    assert clock.next_deadline() == (live[0][0] if live else None)
    for step in steps:  # targets that cut buckets anywhere
        await clock.advance(step)
    await clock.advance(31.0)
    order = [n for what, n in events if what == "fired"]
    assert order == [n for _, n in live]
    # A timer more than one tick after another never fires before the other's work has run.
    position = {event: i for i, event in enumerate(events)}
    deadline = {n: d for d, n in live}
    for i in order:
        for j in order:
            if deadline[j] > deadline[i] + tick + 1e-9:
                assert position[("settled", i)] < position[("fired", j)]
    assert clock.pending_timers == 0
    assert clock.next_deadline() is None


async def test_without_a_tick_work_of_one_deadline_runs_before_the_next() -> None:
    loop = asyncio.get_running_loop()
    for tick, expected in ((0.0, ["a", "x", "b"]), (0.1, ["a", "b", "x"])):
        clock = SimClock(tick_s=tick)
        seen: list[str] = []

        def first(seen: list[str] = seen) -> None:
            seen.append("a")
            loop.call_soon(seen.append, "x")

        clock.call_later(1.0, first)
        clock.call_later(1.05, lambda seen=seen: seen.append("b"))
        await clock.advance(2.0)
        assert seen == expected, tick


async def test_wait_for_a_coroutine_times_out_without_leaving_a_cancellation_behind() -> None:
    clock = SimClock()
    event = asyncio.Event()
    outcome: list[object] = []
    tasks_before = len(asyncio.all_tasks())

    async def waiter() -> None:
        try:
            await clock.wait_for(event.wait(), 2.0)
        except TimeoutError:
            outcome.append("timeout")
        task = asyncio.current_task()
        assert task is not None
        outcome.append(task.cancelling())
        await clock.sleep(1.0)  # the task goes on normally
        outcome.append(await clock.wait_for(asyncio.sleep(0, result="done"), 5.0))

    task = asyncio.ensure_future(waiter())
    await clock.settle()
    assert len(asyncio.all_tasks()) == tasks_before + 1  # no task of its own for the wait
    await clock.advance(10.0)
    await task
    assert outcome == ["timeout", 0, "done"]


async def test_wait_for_keeps_an_outside_cancellation_a_cancellation() -> None:
    clock = SimClock()
    started = asyncio.Event()

    async def waiter() -> None:
        started.set()
        await clock.wait_for(asyncio.Event().wait(), 5.0)

    task = asyncio.ensure_future(waiter())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # A timeout and an outside cancel in the same batch: the outside one stands, still counted.
    seen: list[int] = []

    async def doubly_cancelled() -> None:
        try:
            await clock.wait_for(asyncio.Event().wait(), 1.0)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            assert current is not None
            seen.append(current.cancelling())
            raise

    victim = asyncio.ensure_future(doubly_cancelled())
    await clock.settle()
    clock.call_later(1.0, victim.cancel)  # same deadline, after the wait's own timer
    await clock.advance(2.0)
    with pytest.raises(asyncio.CancelledError):
        await victim
    assert seen == [1]
    # and a future that times out is cancelled, raising TimeoutError to the waiter
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(clock.wait_for(fut, 1.0))
    await clock.advance(1.5)
    with pytest.raises(TimeoutError):
        await waiting
    assert fut.cancelled()
