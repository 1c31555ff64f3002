"""Futures that must finish within one fixed timeout, expired by a single timer.

With one timeout for all of them, deadlines are reached in the order the futures were added, so
a deque swept from its head replaces a timer per future: the sweep expires what is overdue,
skips what finished meanwhile, and re-arms itself for the next deadline. Used by the transport
(PUBACKs) and the request/reply endpoint (replies).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from agent.core.clock import Clock, TimerHandle

T = TypeVar("T")


class Deadlines(Generic[T]):
    """`add` a future when its wait starts; `expire(future)` is called for each one still
    pending `timeout_s` later."""

    def __init__(self, clock: Clock, timeout_s: float, expire: Callable[[asyncio.Future[T]], None]) -> None:
        self._clock = clock
        self._timeout_s = timeout_s
        self._expire = expire
        self._queue: deque[tuple[float, asyncio.Future[T]]] = deque()
        self._timer: TimerHandle | None = None

    def add(self, future: asyncio.Future[T]) -> None:
        self._queue.append((self._clock.monotonic() + self._timeout_s, future))
        if self._timer is None:
            self._timer = self._clock.call_later(self._timeout_s, self._sweep)

    def drop_done(self) -> None:
        """Forget finished futures at the head (answers mostly come in order: this stays short)."""
        queue = self._queue
        while queue and queue[0][1].done():
            queue.popleft()

    def clear(self) -> None:
        self._queue.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _sweep(self) -> None:
        self._timer = None
        now = self._clock.monotonic()
        queue = self._queue
        while queue and (queue[0][1].done() or queue[0][0] <= now):
            _, future = queue.popleft()
            if not future.done():
                self._expire(future)
        if queue:
            self._timer = self._clock.call_later(max(0.0, queue[0][0] - now), self._sweep)


__all__ = ["Deadlines"]
