import asyncio
import random

import pytest

from agent.core.clock import SystemClock, VirtualClock
from agent.core.ids import IdGenerator, id_timestamp_ms


async def test_virtual_sleepers_wake_in_deadline_order() -> None:
    clock = VirtualClock()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, delay: float) -> None:
        await clock.sleep(delay)
        woke.append((name, clock.monotonic()))

    tasks = [asyncio.create_task(sleeper(n, d)) for n, d in (("c", 3.0), ("a", 1.0), ("b", 2.0))]
    await clock.advance(1.5)
    assert woke == [("a", 1.0)]
    await clock.advance(10)
    assert woke == [("a", 1.0), ("b", 2.0), ("c", 3.0)]
    assert clock.monotonic() == 11.5
    await asyncio.gather(*tasks)


async def test_virtual_timers_scheduled_by_a_timer_fire_within_the_same_advance() -> None:
    clock = VirtualClock()
    ticks: list[float] = []

    async def ticker() -> None:
        for _ in range(5):
            await clock.sleep(10)
            ticks.append(clock.monotonic())

    task = asyncio.create_task(ticker())
    await clock.advance(45)
    assert ticks == [10, 20, 30, 40]
    await clock.advance(5)
    assert ticks[-1] == 50
    await task


async def test_virtual_wait_for_times_out_only_on_virtual_time() -> None:
    clock = VirtualClock()
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiter = asyncio.create_task(clock.wait_for(never, 5))
    await clock.advance(4.9)
    assert not waiter.done()
    await clock.advance(0.2)
    with pytest.raises(TimeoutError):
        await waiter
    assert never.cancelled()


async def test_virtual_wait_for_returns_result_and_cancels_timer() -> None:
    clock = VirtualClock()

    async def quick() -> int:
        await clock.sleep(1)
        return 42

    waiter = asyncio.create_task(clock.wait_for(quick(), 5))
    await clock.advance(1)
    assert await waiter == 42
    assert clock.pending_timers == 0


async def test_virtual_now_ms_follows_advance() -> None:
    clock = VirtualClock(start_ms=1_000)
    await clock.advance(2.5)
    assert clock.now_ms() == 3_500


async def test_system_clock_wait_for_raises_builtin_timeout() -> None:
    clock = SystemClock()
    with pytest.raises(TimeoutError):
        await clock.wait_for(asyncio.Event().wait(), 0.01)


def test_ids_are_unique_and_time_ordered_within_one_millisecond() -> None:
    clock = VirtualClock(start_ms=1_700_000_000_000)
    gen = IdGenerator(clock, random.Random(1))
    ids = [gen.next() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)
    assert all(len(i) == 26 for i in ids)
    assert id_timestamp_ms(ids[0]) == 1_700_000_000_000


async def test_ids_sort_by_creation_time_across_milliseconds() -> None:
    clock = VirtualClock()
    gen = IdGenerator(clock, random.Random(2))
    first = gen.next()
    await clock.advance(0.001)
    second = gen.next()
    assert first < second
    assert id_timestamp_ms(second) - id_timestamp_ms(first) == 1


def test_seeded_generators_repeat() -> None:
    a = IdGenerator(VirtualClock(), random.Random(5))
    b = IdGenerator(VirtualClock(), random.Random(5))
    assert [a.next() for _ in range(5)] == [b.next() for _ in range(5)]


@pytest.mark.parametrize("clock", [SystemClock(), VirtualClock()], ids=["system", "virtual"])
async def test_wait_for_never_swallows_a_cancellation_that_races_the_result(clock: SystemClock) -> None:
    """A stop that cancels a task at the moment its awaited future completes must still stop it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()

    async def waiter() -> str:
        await clock.wait_for(future, 60)
        return "ran on after being cancelled"

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)  # the task now waits on the future
    future.set_result(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
