"""AIMD concurrency limiter: how many deliveries one lane of the relay keeps in flight.

Additive increase, multiplicative decrease, as in TCP congestion control:

* a delivery accepted by the receiver: `limit += 1` (up to `max`);
* the receiver answered `Capacity` (its mailbox is full): `limit //= 2` (down to `min`);
* a `Transient` failure (timeout, network) says nothing about the receiver's capacity: unchanged.

When the limit drops below the number already in flight, those deliveries finish normally and
no new permit is handed out until in-flight falls below the new limit.

The limiter lives on one event loop and is not thread-safe (it needs no locks: every method runs
to completion without awaiting, except `acquire`, which only waits for a wake-up).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Literal

Outcome = Literal["success", "capacity", "transient", "none"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AimdSettings:
    """Bounds of every limiter the relay creates (one per partition and message class)."""

    initial: int = 10
    min: int = 1
    max: int = 50

    def __post_init__(self) -> None:
        for name in ("initial", "min", "max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AimdSettings.{name} must be an int >= 1, got {value!r}")
        if not self.min <= self.initial <= self.max:
            raise ValueError(
                "AimdSettings needs min <= initial <= max, got "
                f"min={self.min} initial={self.initial} max={self.max}"
            )


class AimdLimiter:
    """A concurrency limit that grows by one on success and halves on a capacity rejection."""

    __slots__ = (
        "_limit",
        "_min",
        "_max",
        "_in_flight",
        "_waiters",
        "successes",
        "capacity_rejections",
        "transients",
    )

    def __init__(self, initial: int = 10, min: int = 1, max: int = 50) -> None:
        AimdSettings(initial=initial, min=min, max=max)  # validates
        self._limit = initial
        self._min = min
        self._max = max
        self._in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.successes = 0
        self.capacity_rejections = 0
        self.transients = 0

    @classmethod
    def from_settings(cls, settings: AimdSettings) -> AimdLimiter:
        return cls(initial=settings.initial, min=settings.min, max=settings.max)

    # -- reading ---------------------------------------------------------------------------
    @property
    def limit(self) -> int:
        return self._limit

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def min(self) -> int:
        return self._min

    @property
    def max(self) -> int:
        return self._max

    @property
    def available(self) -> int:
        """Permits that could be handed out right now (0 when at or above the limit)."""
        return self._limit - self._in_flight if self._in_flight < self._limit else 0

    # -- permits ---------------------------------------------------------------------------
    def try_acquire(self) -> bool:
        """Take a permit if in-flight is below the limit; never waits."""
        if self._in_flight < self._limit and not self._waiters:
            self._in_flight += 1
            return True
        return False

    async def acquire(self) -> None:
        """Wait for a permit (first come, first served)."""
        if self.try_acquire():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                # Granted just as we were cancelled: hand the permit on.
                self._in_flight -= 1
                self._wake()
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def release(self, outcome: Outcome = "none") -> None:
        """Return a permit, adjusting the limit by the delivery's outcome."""
        if self._in_flight <= 0:
            raise RuntimeError("AimdLimiter.release() without a matching acquire")
        self._in_flight -= 1
        if outcome == "success":  # the hot path, inlined
            self.successes += 1
            if self._limit < self._max:
                self._limit += 1
        elif outcome != "none":
            self.record(outcome)
        if self._waiters:
            self._wake()

    # -- the AIMD rule ---------------------------------------------------------------------
    def record(self, outcome: Outcome) -> None:
        """Apply one outcome to the limit without touching in-flight."""
        if outcome == "success":
            self.successes += 1
            if self._limit < self._max:
                self._limit += 1
                self._wake()
        elif outcome == "capacity":
            self.capacity_rejections += 1
            self._limit = max(self._min, self._limit // 2)
        elif outcome == "transient":
            self.transients += 1
        elif outcome != "none":
            raise ValueError(f"unknown limiter outcome {outcome!r}")

    def _wake(self) -> None:
        while self._waiters and self._in_flight < self._limit:
            fut = self._waiters.popleft()
            if fut.done():
                continue
            self._in_flight += 1
            fut.set_result(None)

    def __repr__(self) -> str:
        return (
            f"AimdLimiter(limit={self._limit}, in_flight={self._in_flight}, "
            f"min={self._min}, max={self._max})"
        )


__all__ = ["AimdLimiter", "AimdSettings", "Outcome"]
