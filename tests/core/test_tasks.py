"""`cancel_and_wait`: the task's cancellation is its end; the caller's own is never swallowed."""

from __future__ import annotations

import asyncio

import pytest

from agent.core.tasks import cancel_and_wait


async def test_the_task_ends_and_the_caller_goes_on() -> None:
    task = asyncio.ensure_future(asyncio.Event().wait())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.cancelled()
    await cancel_and_wait(task)  # ended already: nothing to do
    await cancel_and_wait(None)


async def test_a_cancellation_aimed_at_the_caller_while_it_waits_is_raised() -> None:
    """The task takes a while to end (its cleanup waits for `release`); the caller is cancelled
    meanwhile: the caller ends cancelled, it does not carry on as if it had only ended the task."""
    cleaning, release = asyncio.Event(), asyncio.Event()
    carried_on: list[str] = []

    async def slow_to_end() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaning.set()
            await release.wait()

    async def caller(task: asyncio.Task[None]) -> None:
        await cancel_and_wait(task)
        carried_on.append("after")

    task = asyncio.ensure_future(slow_to_end())
    await asyncio.sleep(0)
    stopping = asyncio.ensure_future(caller(task))
    await cleaning.wait()
    stopping.cancel()
    await asyncio.sleep(0)
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert stopping.cancelled() and task.done() and carried_on == []


async def test_a_caller_already_being_cancelled_still_ends_its_tasks() -> None:
    """Cleanup on the way out of a cancellation: each task is ended, the cleanup runs to its end."""
    ended: list[str] = []

    async def worker() -> None:
        tasks = [asyncio.ensure_future(asyncio.Event().wait()) for _ in range(2)]
        try:
            await asyncio.Event().wait()
        finally:
            for t in tasks:
                await cancel_and_wait(t)
                ended.append("one")

    outer = asyncio.ensure_future(worker())
    await asyncio.sleep(0)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert ended == ["one", "one"]


async def test_a_task_failing_as_it_ends_raises_its_error() -> None:
    async def fails_on_cancel() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    task = asyncio.ensure_future(fails_on_cancel())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await cancel_and_wait(task)
