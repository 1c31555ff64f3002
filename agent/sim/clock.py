"""The simulator's virtual clock: `VirtualClock`, moved in ticks instead of one deadline at a time.

`VirtualClock.advance` fires one deadline, then lets the loop settle, then the next deadline. With
thousands of devices whose timers fall a few milliseconds apart, that is one settle (several loop
turns, plus a wait for the outbox writer threads) per timer. `SimClock` instead:

* fires every timer due within one `tick_s` of the earliest in one batch (in deadline order, the
  clock reading each timer's own deadline as it fires), then settles once, so the heartbeats of
  many devices become one loop turn and one group commit per shared outbox file;
* asks the outbox stores to do their SQLite work on the loop (`inline_io`), and, while other
  thread work is in flight (`busy()`), waits for the moment the last piece ends instead of
  polling in 0.5 ms real-time sleeps.

Timers never fire early by more than `tick_s`, never out of order, and the same timeline gives
the same interleaving every run, so the same seed still gives the same report.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
from collections.abc import Iterator

from agent.core.clock import VirtualClock

DEFAULT_TICK_S = 0.1
# A busy section always ends (a writer thread posts its result), but never wait blindly forever.
_BUSY_WAIT_S = 1.0


class SimClock(VirtualClock):
    """A `VirtualClock` that fires timers in ticks of `tick_s` (0 = one deadline at a time).

    `inline_io` asks outbox stores opened with this clock to run their SQLite work on the loop
    (no writer thread), so nothing in a run depends on thread timing."""

    inline_io = True

    def __init__(self, *, tick_s: float = DEFAULT_TICK_S) -> None:
        super().__init__()
        if tick_s < 0:
            raise ValueError(f"tick_s must be >= 0, got {tick_s}")
        self.tick_s = tick_s
        self._idle: asyncio.Future[None] | None = None
        self.fired = 0  # timers fired: the simulator's count of events
        self.settles = 0

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

    async def settle(self, max_rounds: int = 100_000) -> None:
        """Run the loop until nothing is ready and no thread work is in flight."""
        self.settles += 1
        loop = asyncio.get_running_loop()
        quiet = 0
        for _ in range(max_rounds):
            if self._busy:
                quiet = 0
                idle = self._idle
                if idle is None or idle.done():
                    idle = self._idle = loop.create_future()
                # Wakes as soon as the last busy section ends (the loop sleeps in its selector
                # until a writer thread posts its result).
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
        """Move time forward by `seconds`, firing due timers in batches of one tick."""
        target = self._now + max(0.0, seconds)
        await self.settle()
        timers = self._timers
        while True:
            first = self.next_deadline()
            if first is None or first > target:
                break
            horizon = min(target, first + self.tick_s)
            batch = []
            while timers and timers[0][0] <= horizon:
                entry = heapq.heappop(timers)
                if not entry[2].cancelled:
                    batch.append(entry[2])
            for timer in batch:
                if timer.cancelled:  # cancelled by a timer fired before it in this batch
                    continue
                self._now = max(self._now, timer.deadline)
                self.fired += 1
                timer.callback()
            await self.settle()
        self._now = target
        await self.settle()


__all__ = ["DEFAULT_TICK_S", "SimClock"]
