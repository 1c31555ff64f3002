"""Signals as asyncio events, and an ordered, time-bounded shutdown.

SIGTERM (systemd's stop) and SIGINT (Ctrl-C) set `ServiceSignals.stop`; SIGHUP sets
`ServiceSignals.reload`. Nothing happens inside the signal handler beyond setting the event:
the agent's main task wakes up and runs its `ShutdownSequence` (stop taking work, stop the
relay, flush and close the outbox, disconnect) in order, each step with its own deadline.

A second SIGINT/SIGTERM while shutting down exits at once (128 + signal): the operator asked
twice. Nothing acknowledged is lost that way either; the outbox is durable on every enqueue.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agent.core.clock import Clock
from agent.service.sdnotify import Notifier

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ServiceSignals:
    """Events set by signals. Use `install_signal_handlers()` to create one bound to a loop."""

    def __init__(self, *, force_exit_on_second: bool = True) -> None:
        self.stop = asyncio.Event()
        self.reload = asyncio.Event()
        self.stop_signal: int | None = None
        self.reloads = 0
        self._force = force_exit_on_second
        self._loop: asyncio.AbstractEventLoop | None = None
        self._installed: list[int] = []

    def request_stop(self, signum: int | None = None) -> None:
        """Ask for a clean shutdown (what SIGTERM does); callable from code as well."""
        if self.stop.is_set():
            if signum is not None and self._force:
                log.warning("second %s during shutdown: exiting now", signal.Signals(signum).name)
                os._exit(128 + signum)
            return
        self.stop_signal = signum
        name = signal.Signals(signum).name if signum is not None else "request"
        log.info("shutdown requested", extra={"kv": {"by": name}})
        self.stop.set()

    def request_reload(self) -> None:
        self.reloads += 1
        self.reload.set()

    async def wait_stop(self) -> int | None:
        """Wait for a stop request; returns the signal number (None if requested by code)."""
        await self.stop.wait()
        return self.stop_signal

    def take_reload(self) -> bool:
        """True once per pending reload request (clears it)."""
        if self.reload.is_set():
            self.reload.clear()
            return True
        return False

    def install(self, loop: asyncio.AbstractEventLoop | None = None) -> ServiceSignals:
        loop = loop or asyncio.get_running_loop()
        self._loop = loop
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, self.request_stop, signum)
            self._installed.append(signum)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        self._installed.append(signal.SIGHUP)
        return self

    def uninstall(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for signum in self._installed:
                self._loop.remove_signal_handler(signum)
        self._installed.clear()
        self._loop = None


def install_signal_handlers(
    loop: asyncio.AbstractEventLoop | None = None, *, force_exit_on_second: bool = True
) -> ServiceSignals:
    """SIGTERM/SIGINT -> `.stop`, SIGHUP -> `.reload`, on `loop` (default: the running loop)."""
    return ServiceSignals(force_exit_on_second=force_exit_on_second).install(loop)


Step = Callable[[], Awaitable[object]]


@dataclass(frozen=True, slots=True)
class StepFailure:
    name: str
    reason: str


class ShutdownSequence:
    """Steps run in the order added, each bounded by its timeout; a failing or hung step is
    logged and the next one still runs (closing the database matters even if the transport
    would not disconnect). `run` sends STOPPING=1 first and never raises for a step's failure."""

    def __init__(
        self,
        *,
        clock: Clock,
        notifier: Notifier | None = None,
        step_timeout_s: float = 10.0,
    ) -> None:
        self._clock = clock
        self._notifier = notifier
        self._default_timeout_s = step_timeout_s
        self._steps: list[tuple[str, Step, float]] = []
        self._ran = False

    def add(self, name: str, step: Step, *, timeout_s: float | None = None) -> None:
        self._steps.append((name, step, self._default_timeout_s if timeout_s is None else timeout_s))

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self._steps]

    async def run(self, status: str = "shutting down") -> list[StepFailure]:
        if self._ran:
            return []
        self._ran = True
        if self._notifier is not None:
            self._notifier.stopping(status)
        return await self._run_steps()

    async def run_for_restart(self) -> list[StepFailure]:
        """The steps as at a shutdown, without STOPPING=1 (the service goes on: its parts start
        again), then forgotten: the parts started next add their own."""
        try:
            return await self._run_steps()
        finally:
            self._steps.clear()

    async def _run_steps(self) -> list[StepFailure]:
        failures: list[StepFailure] = []
        for name, step, timeout_s in self._steps:
            try:
                await self._clock.wait_for(step(), timeout_s)
            except TimeoutError:
                failures.append(StepFailure(name, f"timed out after {timeout_s}s"))
            except Exception as exc:
                failures.append(StepFailure(name, f"{type(exc).__name__}: {exc}"))
            else:
                log.debug("shutdown step done", extra={"kv": {"step": name}})
                continue
            log.error(
                "shutdown step failed",
                extra={"kv": {"step": name, "reason": failures[-1].reason}},
            )
        return failures


__all__ = [
    "STOP_SIGNALS",
    "ServiceSignals",
    "ShutdownSequence",
    "StepFailure",
    "install_signal_handlers",
]
