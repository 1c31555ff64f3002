"""The systemd notify protocol, spoken directly over `$NOTIFY_SOCKET` (no libsystemd).

A service of `Type=notify` tells systemd about itself with newline-separated `KEY=value`
datagrams sent to the AF_UNIX socket named in `$NOTIFY_SOCKET` (a path, or `@name` for the
abstract namespace). Outside systemd the variable is unset and every call is a no-op.

`Watchdog` pings `WATCHDOG=1` from the event loop at half of `WatchdogSec=`, through the Clock:
if the loop wedges, the pings stop and systemd restarts the service. That is the point of pinging
from the loop rather than from a thread.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

from agent.core.clock import Clock

log = logging.getLogger(__name__)


def _address(value: str) -> str | bytes | None:
    """The socket address for `sendto`, or None for an address family we do not speak."""
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    return None


class Notifier:
    """Sends notify messages to systemd. A socket failure is logged and returned as False, never
    raised: a lost notification must not stop the agent (systemd reacts to a missing READY or
    WATCHDOG itself). Only a malformed assignment (a programming error) raises ValueError."""

    def __init__(self, socket_address: str | None = None, *, env: Mapping[str, str] | None = None):
        environ = os.environ if env is None else env
        raw = socket_address if socket_address is not None else environ.get("NOTIFY_SOCKET", "")
        self._raw = raw
        self._address = _address(raw) if raw else None
        if raw and self._address is None:
            log.warning("NOTIFY_SOCKET=%r is not a unix socket address; notifications are off", raw)
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *assignments: str) -> bool:
        """Send `KEY=value` lines in one datagram. True if systemd's socket accepted it."""
        if self._address is None or not assignments:
            return False
        for line in assignments:
            if "=" not in line or "\n" in line:
                raise ValueError(f"not a single KEY=value line: {line!r}")
        payload = "\n".join(assignments).encode("utf-8")
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, socket.MSG_DONTWAIT, self._address)
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self._raw, exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """The service is up: sent once the database is open and the actors have started."""
        return self.notify("READY=1", *self._status(status))

    def status(self, text: str) -> bool:
        return self.notify(*self._status(text))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *self._status(status))

    def reloading(self, status: str | None = None) -> bool:
        """Reload started; send `ready()` when done. MONOTONIC_USEC is what `Type=notify-reload`
        (systemd 253+) needs to match the reload to its request; older versions ignore it."""
        usec = time.monotonic_ns() // 1000  # CLOCK_MONOTONIC, as the protocol defines it
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}", *self._status(status))

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for more start-up/shutdown time (a long database migration, a big flush)."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(1, int(seconds * 1_000_000))}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @staticmethod
    def _status(text: str | None) -> tuple[str, ...]:
        if text is None:
            return ()
        return ("STATUS=" + " ".join(text.split()),)


def notify_ready(status: str | None = None, *, env: Mapping[str, str] | None = None) -> bool:
    notifier = Notifier(env=env)
    try:
        return notifier.ready(status)
    finally:
        notifier.close()


def notify_status(text: str, *, env: Mapping[str, str] | None = None) -> bool:
    notifier = Notifier(env=env)
    try:
        return notifier.status(text)
    finally:
        notifier.close()


def notify_stopping(status: str | None = None, *, env: Mapping[str, str] | None = None) -> bool:
    notifier = Notifier(env=env)
    try:
        return notifier.stopping(status)
    finally:
        notifier.close()


def watchdog_timeout_s(env: Mapping[str, str] | None = None) -> float | None:
    """`WatchdogSec=` of this process in seconds, or None when the watchdog is off or is meant
    for another process (`WATCHDOG_PID` names a different pid)."""
    environ = os.environ if env is None else env
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if pid:
        if not pid.isdigit() or int(pid) != os.getpid():
            return None
    if not usec.isdigit() or int(usec) == 0:
        return None
    return int(usec) / 1_000_000


class Watchdog:
    """Pings `WATCHDOG=1` every `timeout / 2` from the event loop.

    `alive`, when given, is asked before each ping; while it returns False the ping is withheld,
    so a dead subsystem (say, the relay task) gets the service restarted too.
    """

    def __init__(
        self,
        clock: Clock,
        notifier: Notifier | None = None,
        *,
        env: Mapping[str, str] | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        self._clock = clock
        self._owns_notifier = notifier is None
        self._notifier = notifier if notifier is not None else Notifier(env=env)
        self._timeout_s = watchdog_timeout_s(env) if self._notifier.enabled else None
        self._alive = alive
        self.pings = 0
        self.withheld = 0

    @property
    def enabled(self) -> bool:
        return self._timeout_s is not None

    @property
    def interval_s(self) -> float | None:
        return None if self._timeout_s is None else self._timeout_s / 2

    def ping(self) -> bool:
        if self._alive is not None and not self._alive():
            self.withheld += 1
            log.warning("watchdog ping withheld: a subsystem reports it is not alive")
            return False
        sent = self._notifier.watchdog()
        if sent:
            self.pings += 1
        return sent

    async def run(self) -> None:
        """Ping until cancelled. Returns at once when the watchdog is off."""
        interval = self.interval_s
        try:
            if interval is None:
                return
            while True:
                self.ping()
                await self._clock.sleep(interval)
        finally:
            if self._owns_notifier:
                self._notifier.close()


__all__ = [
    "Notifier",
    "Watchdog",
    "notify_ready",
    "notify_status",
    "notify_stopping",
    "watchdog_timeout_s",
]
