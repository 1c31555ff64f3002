"""The simulator's virtual clock: `VirtualClock`, moved in ticks instead of one deadline at a time.

`VirtualClock.advance` fires one deadline, then lets the loop settle, then the next deadline. With
thousands of devices whose timers fall a few milliseconds apart, that is one settle (several loop
turns, plus a wait for the outbox writer threads) per timer. `SimClock` instead:

* fires every timer due within one `tick_s` of the earliest in one batch (in deadline order, the
  clock reading each timer's own deadline as it fires), then settles once, so the heartbeats of
  many devices become one loop turn and one group commit per shared outbox file;
* asks the outbox stores to do their SQLite work on the loop (`inline_io`), so nothing in a run
  waits on a writer thread (`VirtualClock.settle` still waits for any other thread work).

Timers never fire early by more than `tick_s`, never out of order, and the same timeline gives
the same interleaving every run, so the same seed still gives the same report.

Timers are kept in buckets one tick wide (a calendar queue) rather than one heap: a fleet sets
tens of thousands of timers a minute, most of them reply timeouts cancelled a moment later, and
a heap of that size costs a cache miss per level on every push and pop. A bucket is an append;
it is sorted once, when its tick comes, and cancelled timers are dropped without being ordered.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from bisect import bisect_right
from collections.abc import Awaitable, Callable
from typing import TypeVar

from agent.core.clock import TimerHandle, VirtualClock, _VirtualTimer

DEFAULT_TICK_S = 0.1
_INF = float("inf")
_BUCKET_S_WHEN_NO_TICK = 0.1  # bucket width when every deadline fires on its own (tick_s 0)

T = TypeVar("T")
_Entry = tuple[float, int, _VirtualTimer]


class _Expiry:
    """The timeout of one `wait_for`: cancels the awaited future, or the waiting task."""

    __slots__ = ("target", "expired")

    def __init__(self, target: asyncio.Future[object] | asyncio.Task[object]) -> None:
        self.target = target
        self.expired = False

    def __call__(self) -> None:
        if not self.target.done():
            self.expired = True
            self.target.cancel()


class SimClock(VirtualClock):
    """A `VirtualClock` that fires timers in ticks of `tick_s` (0 = one deadline at a time).

    `inline_io` asks outbox stores opened with this clock to run their SQLite work on the loop
    (no writer thread), so nothing in a run depends on thread timing."""

    inline_io = True  # `Clock.inline_io`

    def __init__(self, *, tick_s: float = DEFAULT_TICK_S) -> None:
        super().__init__()
        if tick_s < 0:
            raise ValueError(f"tick_s must be >= 0, got {tick_s}")
        self.tick_s = tick_s
        self.fired = 0  # timers fired: the simulator's count of events
        self._width = tick_s if tick_s > 0 else _BUCKET_S_WHEN_NO_TICK
        self._buckets: dict[int, list[_Entry]] = {}  # bucket index -> entries, in creation order
        self._slots: list[int] = []  # heap of the bucket indices in `_buckets`
        self._seq = itertools.count()

    # -- timers ----------------------------------------------------------------------------
    def call_later(self, delay_s: float, callback: Callable[[], object]) -> TimerHandle:
        deadline = self._now + delay_s if delay_s > 0 else self._now
        timer = _VirtualTimer(deadline, callback)
        slot = int(deadline / self._width)
        bucket = self._buckets.get(slot)
        if bucket is None:
            bucket = self._buckets[slot] = []
            heapq.heappush(self._slots, slot)
        bucket.append((deadline, next(self._seq), timer))
        return timer

    @property
    def pending_timers(self) -> int:
        return sum(1 for bucket in self._buckets.values() for entry in bucket if not entry[2].cancelled)

    def next_deadline(self) -> float | None:
        """Monotonic time of the earliest live timer, or None."""
        slots, buckets = self._slots, self._buckets
        while slots:
            slot = slots[0]
            bucket = buckets[slot]
            live = [entry for entry in bucket if not entry[2].cancelled]
            if live:
                live.sort()
                buckets[slot] = live
                return live[0][0]
            heapq.heappop(slots)
            del buckets[slot]
        return None

    def _take(self, horizon: float) -> list[_Entry]:
        """Remove and return, in (deadline, creation) order, every entry due by `horizon`."""
        slots, buckets, width = self._slots, self._buckets, self._width
        batch: list[_Entry] = []
        kept: list[int] = []
        # One bucket past the horizon's own: a deadline's bucket index is a float division away.
        while slots and slots[0] * width <= horizon + width:
            slot = heapq.heappop(slots)
            bucket = buckets[slot]
            bucket.sort()
            cut = bisect_right(bucket, (horizon, _INF))
            if cut:
                batch.extend(bucket[:cut])
                del bucket[:cut]
            if bucket:
                kept.append(slot)
            else:
                del buckets[slot]
        for slot in kept:
            heapq.heappush(slots, slot)
        return batch  # in order: buckets are disjoint, ascending ranges of deadlines

    async def wait_for(self, aw: Awaitable[T], timeout_s: float | None) -> T:
        """`VirtualClock.wait_for` without a task per call: a future is awaited as it is, a
        coroutine in the calling task, which the timeout cancels (as `asyncio.timeout` does)."""
        if timeout_s is None:
            return await aw
        if isinstance(aw, asyncio.Future):
            expiry = _Expiry(aw)
            timer = self.call_later(timeout_s, expiry)
            try:
                return await aw
            except asyncio.CancelledError:
                if expiry.expired:
                    raise TimeoutError(f"timed out after {timeout_s}s of virtual time") from None
                raise
            finally:
                timer.cancel()
        task = asyncio.current_task()
        if task is None:
            return await super().wait_for(aw, timeout_s)
        expiry = _Expiry(task)
        timer = self.call_later(timeout_s, expiry)
        try:
            return await aw
        except asyncio.CancelledError:
            if expiry.expired:
                expiry.expired = False
                # Ours only if no one else cancelled the task too (then their cancel stands).
                if task.uncancel() == 0:
                    raise TimeoutError(f"timed out after {timeout_s}s of virtual time") from None
            raise
        finally:
            timer.cancel()
            if expiry.expired:  # fired, yet `aw` ended before the cancellation reached it
                task.uncancel()

    # -- driving ---------------------------------------------------------------------------
    async def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`, firing due timers in batches of one tick."""
        target = self._now + max(0.0, seconds)
        await self.settle()
        while True:
            first = self.next_deadline()
            if first is None or first > target:
                break
            for deadline, _, timer in self._take(min(target, first + self.tick_s)):
                if timer.cancelled:  # cancelled before its batch, or by a timer fired before it
                    continue
                if deadline > self._now:
                    self._now = deadline
                self.fired += 1
                timer.callback()
            await self.settle()
        self._now = target
        await self.settle()


__all__ = ["DEFAULT_TICK_S", "SimClock"]
