"""Rate-limited log lines: periodic events (retries, reconnect attempts, a misbehaving peer) log
once per key per interval of the clock instead of once per event.

Lives in the core layer so that every layer can use it (`agent.service.logs` re-exports it).
"""

from __future__ import annotations

import logging
from typing import Any

from agent.core.clock import Clock
from agent.core.errors import ConfigError


class RateLimitedLog:
    """At most one line per key per `interval_s` of the clock; the next line that gets through
    carries `suppressed=N`. For periodic events (heartbeats sent, retries, reconnect attempts).
    """

    def __init__(self, logger: logging.Logger, clock: Clock, interval_s: float = 60.0,
                 max_keys: int = 10_000) -> None:
        if interval_s <= 0:
            raise ConfigError("logging", "interval_s", "must be > 0")
        self._max_keys = max_keys  # keys may come from peers: beyond this, start over
        self._logger = logger
        self._clock = clock
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, key: str, msg: str, **kv: Any) -> bool:
        """Log `msg` unless `key` logged within the interval. True if it was emitted."""
        if not self._logger.isEnabledFor(level):
            return False
        now = self._clock.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        if last is None and len(self._last) >= self._max_keys:
            self._last.clear()
            self._suppressed.clear()
        self._last[key] = now
        held = self._suppressed.pop(key, 0)
        if held:
            kv["suppressed"] = held
        self._logger.log(level, msg, extra={"kv": kv})
        return True

    def info(self, key: str, msg: str, **kv: Any) -> bool:
        return self.log(logging.INFO, key, msg, **kv)

    def warning(self, key: str, msg: str, **kv: Any) -> bool:
        return self.log(logging.WARNING, key, msg, **kv)

    def suppressed(self, key: str) -> int:
        return self._suppressed.get(key, 0)


__all__ = ["RateLimitedLog"]
