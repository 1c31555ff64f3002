"""Background work: ending a task the agent started itself (`cancel_and_wait`), blocking file
or SQLite work run in a thread (`in_thread`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from agent.core.clock import Clock

T = TypeVar("T")


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (None: nothing to end) and wait until it has ended. The task's own
    cancellation is its expected end; a cancellation aimed at the caller while it waits is
    raised, so a stopping caller stops (the task is cancelled either way)."""
    if task is None:
        return
    current = asyncio.current_task()
    # (a caller already being cancelled, ending its tasks on the way out, is not cancelled anew)
    before = current.cancelling() if current is not None else 0
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if current is not None and current.cancelling() > before:
            raise


async def in_thread(clock: Clock, fn: Callable[..., T], *args: object) -> T:
    """Run blocking file or SQLite work in a thread, keeping the event loop free of fsyncs.

    Under a clock with `inline_io` (the simulators' virtual clocks) the work runs at once on the
    loop's thread instead, and the caller resumes on the next loop turn, where a thread's result
    would be delivered: the interleaving is the one a fast thread gives, but it is the same on
    every run, since no job finishes at a moment the OS scheduler picks."""
    if clock.inline_io:
        return await _inline(fn, *args)
    with clock.busy():
        return await asyncio.to_thread(fn, *args)


async def _inline(fn: Callable[..., T], *args: object) -> T:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    try:
        result = fn(*args)
    except Exception as exc:  # as from a thread: the awaiting coroutine gets it
        loop.call_soon(_deliver_error, done, exc)
    else:
        loop.call_soon(_deliver, done, result)
    return await done


def _deliver(done: asyncio.Future[T], result: T) -> None:
    if not done.done():  # the awaiting task may have been cancelled meanwhile
        done.set_result(result)


def _deliver_error(done: asyncio.Future[T], exc: BaseException) -> None:
    if not done.done():
        done.set_exception(exc)


__all__ = ["cancel_and_wait", "in_thread"]
