"""Time, behind one interface so the simulator can run hours of fleet time in seconds.

Every timer, timeout and timestamp in edge-agent goes through a `Clock`:

* `SystemClock` reads the wall and monotonic clocks and sleeps on the event loop.
* `VirtualClock` only moves when told to (`advance`). Sleepers wake in deadline order and the
  loop is allowed to settle between two wake-ups, so a test or the simulator sees exactly the
  interleaving it would see in real time, only faster, and the same every run.

Timestamps written to SQLite (`send_at`, deadlines) come from `now_ms()` of the same clock, so
the database and the timers agree under virtual time too.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol, TypeVar, runtime_checkable

T = TypeVar("T")


@runtime_checkable
class TimerHandle(Protocol):
    def cancel(self) -> None: ...


@runtime_checkable
class Clock(Protocol):
    """What every component asks for the time."""

    def now_ms(self) -> int:
        """Wall-clock time in milliseconds since the Unix epoch (timestamps, send_at)."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (durations, rates)."""

    async def sleep(self, seconds: float) -> None:
        """Suspend the calling task for `seconds` of this clock's time."""

    async def wait_for(self, aw: Awaitable[T], timeout_s: float | None) -> T:
        """Await `aw`; raise the built-in `TimeoutError` after `timeout_s` of this clock."""

    def call_later(self, delay_s: float, callback: Callable[[], object]) -> TimerHandle:
        """Run `callback` on the event loop after `delay_s` of this clock's time."""

    def busy(self) -> contextlib.AbstractContextManager[None]:
        """Mark work outside the event loop (a thread) that virtual time must wait for."""

    @property
    def inline_io(self) -> bool:
        """True when blocking file and SQLite work should run on the loop's thread instead of a
        worker thread (the simulator's clock: a run must not depend on thread timing)."""


class SystemClock:
    """The real clocks of the machine."""

    inline_io = False

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    async def wait_for(self, aw: Awaitable[T], timeout_s: float | None) -> T:
        # asyncio.timeout, not asyncio.wait_for: on 3.11 wait_for swallows a cancellation that
        # arrives as the awaited future completes, and the cancelled task runs on.
        if timeout_s is None:
            return await aw
        async with asyncio.timeout(max(0.0, timeout_s)):
            return await aw

    def call_later(self, delay_s: float, callback: Callable[[], object]) -> TimerHandle:
        return asyncio.get_running_loop().call_later(max(0.0, delay_s), callback)

    def busy(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class _VirtualTimer:
    __slots__ = ("deadline", "callback", "cancelled")

    def __init__(self, deadline: float, callback: Callable[[], object]) -> None:
        self.deadline = deadline
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


# 2023-11-14T22:13:20Z: a fixed, recognisable start so simulated timestamps are reproducible.
DEFAULT_VIRTUAL_EPOCH_MS = 1_700_000_000_000
# Longest real-time wait for thread work in one settle round (it always ends; never hang on it).
_BUSY_WAIT_S = 1.0


class VirtualClock:
    """A clock that moves only when `advance` is awaited.

    Time stands still while tasks run; `advance(s)` fires the due timers one deadline at a time,
    letting the event loop settle (no ready callbacks, no thread work in flight) after each, so
    work triggered by one timer can schedule the next before time moves on.
    """

    inline_io = False  # thread work runs on threads; `settle` waits for it (`busy`)

    def __init__(self, start_ms: int = DEFAULT_VIRTUAL_EPOCH_MS) -> None:
        self._start_ms = start_ms
        self._now = 0.0
        self._timers: list[tuple[float, int, _VirtualTimer]] = []
        self._order = itertools.count()
        self._busy = 0
        self._idle: asyncio.Future[None] | None = None  # resolved when the last busy section ends
        self.settles = 0

    # -- reading ---------------------------------------------------------------------------
    def now_ms(self) -> int:
        return self._start_ms + int(round(self._now * 1000))

    def monotonic(self) -> float:
        return self._now

    @property
    def pending_timers(self) -> int:
        return sum(1 for _, _, t in self._timers if not t.cancelled)

    def next_deadline(self) -> float | None:
        """Monotonic time of the earliest live timer, or None."""
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    # -- scheduling ------------------------------------------------------------------------
    def call_later(self, delay_s: float, callback: Callable[[], object]) -> TimerHandle:
        timer = _VirtualTimer(self._now + max(0.0, delay_s), callback)
        heapq.heappush(self._timers, (timer.deadline, next(self._order), timer))
        return timer

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        timer = self.call_later(seconds, wake)
        try:
            await fut
        finally:
            timer.cancel()

    async def wait_for(self, aw: Awaitable[T], timeout_s: float | None) -> T:
        task = asyncio.ensure_future(aw)
        if timeout_s is None:
            return await task
        expired = False

        def expire() -> None:
            nonlocal expired
            if not task.done():
                expired = True
                task.cancel()

        timer = self.call_later(timeout_s, expire)
        try:
            return await task
        except asyncio.CancelledError:
            if expired:
                raise TimeoutError(f"timed out after {timeout_s}s of virtual time") from None
            raise
        finally:
            timer.cancel()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            idle = self._idle
            if self._busy == 0 and idle is not None and not idle.done():
                idle.set_result(None)

    # -- driving ---------------------------------------------------------------------------
    async def settle(self, max_rounds: int = 100_000) -> None:
        """Let the event loop run until nothing is ready and no thread work is in flight."""
        self.settles += 1
        loop = asyncio.get_running_loop()
        quiet = 0
        for _ in range(max_rounds):
            if self._busy:
                quiet = 0
                idle = self._idle
                if idle is None or idle.done():
                    idle = self._idle = loop.create_future()
                # Real time: the loop sleeps in its selector until the last busy section ends
                # (a writer thread posts its result); bounded so a lost wake-up cannot hang it.
                await asyncio.wait((idle,), timeout=_BUSY_WAIT_S)
                continue
            ready = getattr(loop, "_ready", None)
            if ready is not None and len(ready) > 0:
                quiet = 0
                await asyncio.sleep(0)
                continue
            quiet += 1
            if quiet >= 3:
                return
            await asyncio.sleep(0)

    async def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`, firing every timer due on the way, in order."""
        target = self._now + max(0.0, seconds)
        await self.settle()
        while True:
            deadline = self.next_deadline()
            if deadline is None or deadline > target:
                break
            _, _, timer = heapq.heappop(self._timers)
            self._now = max(self._now, timer.deadline)
            timer.callback()
            await self.settle()
        self._now = target
        await self.settle()

    async def advance_to_next(self) -> bool:
        """Jump to the next timer and fire it (and any others due then). False if none."""
        deadline = self.next_deadline()
        if deadline is None:
            return False
        await self.advance(deadline - self._now)
        return True
