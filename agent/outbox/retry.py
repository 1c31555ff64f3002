"""Retry backoff for the relay: capped exponential backoff with full jitter, in one place.

    backoff(attempt) = uniform(0, min(cap_s, base_s * 2**attempt))

`attempt` is the number of tries the row had *before* the one that just failed (`row.attempts`),
so the retry after the first failed try waits up to `base_s`, after the second up to
`2 * base_s`, and so on up to `cap_s`. On top of that:

* `Transient`: the delay is at least `transient_floor_s` (a timeout answered instantly by a
  dead link must not turn into a hot retry loop);
* `Capacity(retry_after_ms)`: the receiver told us when it expects room, so the delay is
  `retry_after_ms` plus the full-jitter backoff (spreading the herd that it refused together).

The random source is injected (`random.Random`) so the simulator and tests are deterministic.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from agent.core.errors import Capacity, DeliveryError

# 2**attempt grows without bound; past this exponent the cap always wins and floats overflow.
_MAX_EXPONENT = 62


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How long a failed delivery waits before its next try."""

    base_s: float = 1.0
    cap_s: float = 300.0
    transient_floor_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("base_s", "cap_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"RetryPolicy.{name} must be a finite number > 0, got {value!r}")
        floor = self.transient_floor_s
        if not (isinstance(floor, int | float) and math.isfinite(floor) and floor >= 0):
            raise ValueError(
                f"RetryPolicy.transient_floor_s must be a finite number >= 0, got {floor!r}"
            )

    def ceiling_s(self, attempt: int) -> float:
        """The upper bound of the jittered backoff after `attempt` earlier tries."""
        if attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {attempt}")
        if attempt >= _MAX_EXPONENT:
            return self.cap_s
        return min(self.cap_s, self.base_s * float(1 << attempt))

    def backoff_s(self, attempt: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2**attempt)]."""
        return rng.uniform(0.0, self.ceiling_s(attempt))

    def delay_s(self, error: DeliveryError, attempt: int, rng: random.Random) -> float:
        """The wait before the next try of a row that failed with `error` after `attempt` tries."""
        jitter = self.backoff_s(attempt, rng)
        if isinstance(error, Capacity):
            return max(0, error.retry_after_ms) / 1000.0 + jitter
        return max(self.transient_floor_s, jitter)

    def delay_ms(self, error: DeliveryError, attempt: int, rng: random.Random) -> int:
        """`delay_s` in whole milliseconds, rounded up so a floor is never undercut."""
        jitter_ms = math.ceil(self.backoff_s(attempt, rng) * 1000.0)
        if isinstance(error, Capacity):
            return max(0, error.retry_after_ms) + jitter_ms
        return max(math.ceil(self.transient_floor_s * 1000.0), jitter_ms)


__all__ = ["RetryPolicy"]
