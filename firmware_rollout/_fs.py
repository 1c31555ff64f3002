"""Durable file helpers: a copy through a temporary file, blocking work in a thread; the atomic
write is the agent's one (`agent.core.files`)."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from agent.core.clock import Clock
from agent.core.files import fsync_dir

T = TypeVar("T")
_COPY_BLOCK = 1024 * 1024


def durable_copy(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` through a temporary file; `dst` is complete or absent, never partial."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    with src.open("rb") as source, tmp.open("wb") as target:
        shutil.copyfileobj(source, target, _COPY_BLOCK)
        target.flush()
        os.fsync(target.fileno())
    os.replace(tmp, dst)
    fsync_dir(dst.parent)


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
