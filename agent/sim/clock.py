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
"""

from __future__ import annotations

import heapq

from agent.core.clock import VirtualClock

DEFAULT_TICK_S = 0.1


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
        self.fired = 0  # timers fired: the simulator's count of events

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
