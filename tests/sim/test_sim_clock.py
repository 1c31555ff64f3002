"""SimClock: timers fire in ticks, in order; the outbox works on the loop under it."""

from __future__ import annotations

from pathlib import Path

import pytest

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
    import asyncio

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
