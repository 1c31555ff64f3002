"""Health checks run after booting a new slot; passing one within the deadline commits the slot.

`ConnectivityCheck` waits until the agent is connected to the broker and has heard from the
leader (two `Gate`s the worker owns); `CommandCheck` runs a user command and passes on exit 0;
`AllChecks` runs several in order within one deadline.

A leader that announced itself down (its last will, retained on its presence topic) is no fault
of the new image: `ConnectivityCheck` then answers `wait` instead of failing, and the updater
keeps the trial (up to `leader_wait_s`) instead of reverting a good image. Its own failures (no
broker, a failed health command) still fail at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from agent.core.clock import Clock
from agent.core.gate import Gate


@dataclass(frozen=True)
class HealthResult:
    ok: bool
    detail: str = ""
    wait: bool = False  # not ok, but nothing this device did: the leader announced itself down


@runtime_checkable
class HealthCheck(Protocol):
    async def check(self, clock: Clock, timeout_s: float) -> HealthResult:
        """Decide within `timeout_s` of `clock`; return a failed result rather than raise."""


class ConnectivityCheck:
    """Passes once `broker` and then `leader` are open, each within the remaining time."""

    def __init__(self, broker: Gate, leader: Gate, *,
                 leader_down: Callable[[float], bool] = lambda since: False) -> None:
        self._broker = broker
        self._leader = leader
        # the leader's own presence said offline at some time since the clock's monotonic `since`
        self._leader_down = leader_down

    async def check(self, clock: Clock, timeout_s: float) -> HealthResult:
        start = clock.monotonic()
        for name, gate in (("broker", self._broker), ("leader", self._leader)):
            remaining = timeout_s - (clock.monotonic() - start)
            if gate.is_open:
                continue
            if remaining <= 0:
                return HealthResult(False, f"{name} not reached within {timeout_s:g}s")
            try:
                await clock.wait_for(gate.wait_open(), remaining)
            except TimeoutError:
                if gate is self._leader and self._leader_down(start):
                    return HealthResult(False, "the leader announced itself offline: waiting for it", wait=True)
                return HealthResult(False, f"{name} not reached within {timeout_s:g}s")
        return HealthResult(True, "connected to broker and leader")


class CommandCheck:
    """Runs `argv` (no shell); passes on exit status 0 within `timeout_s` (and the deadline)."""

    def __init__(self, argv: Sequence[str], *, timeout_s: float = 60.0) -> None:
        if not argv:
            raise ValueError("health check command is empty")
        self._argv = list(argv)
        self._timeout_s = timeout_s

    async def check(self, clock: Clock, timeout_s: float) -> HealthResult:
        limit = min(self._timeout_s, timeout_s)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
        except OSError as exc:
            return HealthResult(False, f"health command {self._argv[0]!r} did not start: {exc.strerror or exc}")
        try:
            output, _ = await clock.wait_for(proc.communicate(), limit)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return HealthResult(False, f"health command timed out after {limit:g}s")
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise
        lines = output.decode(errors="replace").strip().splitlines()
        last = lines[-1][:200] if lines else ""
        if proc.returncode == 0:
            return HealthResult(True, last or "health command passed")
        return HealthResult(False, f"health command exited {proc.returncode}" + (f": {last}" if last else ""))


class AllChecks:
    """Runs each check in order with the time left; the first failure is the result."""

    def __init__(self, *checks: HealthCheck) -> None:
        self._checks = checks

    async def check(self, clock: Clock, timeout_s: float) -> HealthResult:
        """The first failure; a `wait` result only when every other check passed (a failure of
        this device's own decides at once)."""
        start = clock.monotonic()
        details = []
        waiting: HealthResult | None = None
        for check in self._checks:
            remaining = timeout_s - (clock.monotonic() - start)
            if remaining <= 0 and waiting is None:
                return HealthResult(False, f"health checks did not finish within {timeout_s:g}s")
            result = await check.check(clock, max(remaining, 1.0) if waiting is not None else remaining)
            if result.wait:
                waiting = waiting or result
                continue
            if not result.ok:
                return result
            details.append(result.detail)
        return waiting or HealthResult(True, "; ".join(d for d in details if d))


__all__ = ["AllChecks", "CommandCheck", "ConnectivityCheck", "HealthCheck", "HealthResult"]
