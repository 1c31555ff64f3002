"""Per-device message rates on the leader's intake: a token bucket per sender.

One device, hostile or broken, must not take the whole leader: beyond `rate_per_s` messages a
second (bursts of `burst`) its messages are answered `busy(retry_after_ms)`. That is the answer
a full mailbox gives, so the device's relay halves its AIMD window and backs off without
spending an attempt: nothing is lost, the device is only slowed to its share.
"""

from __future__ import annotations

from agent.core.clock import Clock

MAX_TRACKED = 100_000  # senders are authenticated device ids; beyond this, start over


class DeviceRates:
    def __init__(self, clock: Clock, *, rate_per_s: float, burst: float) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self._clock = clock
        self._rate = rate_per_s
        self._burst = burst
        self._buckets: dict[str, tuple[float, float]] = {}  # device -> (tokens, at)
        self.limited = 0  # messages answered busy

    def take(self, device: str) -> int:
        """One message of `device`: 0 when it may go on, else the milliseconds until it may."""
        now = self._clock.monotonic()
        tokens, at = self._buckets.get(device, (self._burst, now))
        tokens = min(self._burst, tokens + (now - at) * self._rate)
        if tokens >= 1.0:
            if len(self._buckets) >= MAX_TRACKED and device not in self._buckets:
                self._buckets.clear()
            self._buckets[device] = (tokens - 1.0, now)
            return 0
        self._buckets[device] = (tokens, now)
        self.limited += 1
        return max(1, int((1.0 - tokens) / self._rate * 1000))


__all__ = ["DeviceRates"]
