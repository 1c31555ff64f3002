"""`ActorSystem`: spawns actors, runs one named task per actor, supervises and stops them.

Stopping is graceful: `stop()` makes every actor refuse new messages (`tell` raises
ActorStopped), lets each one work through what is already queued, and waits up to `timeout_s`
of the system clock. Actors still busy then are cancelled. `stop()` returns, per actor name, the
messages that were not processed, oldest first (a message interrupted by the cancellation comes
first); pending asks among them are answered with ActorStopped instead of being listed. An actor
the supervisor gave up on handed its queue back earlier, in its `ActorFailure.undelivered`.
While the system stops, a failing message is counted and logged but causes no restart, and a
pending restart backoff is cut short, so the queue can drain.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from types import TracebackType

from agent.actors._cell import ActorCell
from agent.actors.actor import Actor, ActorFactory, ActorFailure, RestartPolicy
from agent.actors.mailbox import MailboxPolicy, MailboxStatistics
from agent.actors.ref import ActorRef
from agent.core.clock import Clock, SystemClock
from agent.core.errors import ActorStopped

logger = logging.getLogger("agent.actors")

_DEFAULT_RESTART = RestartPolicy()


class ActorSystem:
    """A set of named actors sharing one clock and one supervisor report.

    Actors spawned before `start()` queue messages and begin processing at `start()`.
    `failures` lists the actors the supervisor gave up on; `on_failure` is also called for each.
    `problem()` also names an actor stuck on one message beyond the `stall_s` it was spawned with.
    """

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        name: str = "system",
        on_failure: Callable[[ActorFailure], object] | None = None,
    ) -> None:
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.name = name
        self.failures: list[ActorFailure] = []
        self._on_failure = on_failure
        self._cells: dict[str, ActorCell] = {}
        self._started = False
        self._stopped = False

    @property
    def running(self) -> bool:
        return self._started and not self._stopped

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self._stopped:
            raise ActorStopped(f"actor system {self.name!r} was stopped; make a new one")
        if self._started:
            raise RuntimeError(f"actor system {self.name!r} is already started")
        self._started = True
        for cell in self._cells.values():
            cell.start()

    async def stop(self, timeout_s: float = 5.0) -> dict[str, list[object]]:
        """Drain and stop every actor; return the messages not processed, by actor name."""
        if not (isinstance(timeout_s, int | float) and timeout_s >= 0 and math.isfinite(timeout_s)):
            raise ValueError(f"stop timeout_s must be a finite number >= 0, got {timeout_s!r}")
        self._stopped = True
        cells = list(self._cells.values())
        for cell in cells:
            cell.begin_stop()
        tasks = [c.task for c in cells if c.task is not None and not c.task.done()]
        if tasks:
            try:
                await self.clock.wait_for(asyncio.wait(tasks), timeout_s)
            except TimeoutError:
                late = [t for t in tasks if not t.done()]
                logger.warning(
                    "actor system %r: %d actors did not drain within %ss; cancelling them",
                    self.name, len(late), timeout_s,
                )
                for task in late:
                    task.cancel()
                await asyncio.wait(tasks)
        return {cell.name: cell.hand_back() for cell in cells}

    async def __aenter__(self) -> ActorSystem:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        undelivered = await self.stop()
        lost = {name: len(items) for name, items in undelivered.items() if items}
        if lost:
            logger.warning("actor system %r stopped with unprocessed messages: %s", self.name, lost)

    # -- actors ------------------------------------------------------------------------------
    def spawn(
        self,
        actor: Actor | ActorFactory,
        *,
        name: str,
        capacity: int = 256,
        policy: MailboxPolicy = "reject",
        restart: RestartPolicy | None = _DEFAULT_RESTART,
        stall_s: float | None = None,
    ) -> ActorRef:
        """Create an actor from an instance or a zero-argument factory.

        An instance is restarted in place (`on_stop`, then `on_start` again); a factory is
        called again on every restart. `restart=None` stops the actor at its first failure.
        `stall_s`: an actor still in `receive()` of one message after this long is stuck
        (`problem()` says so); None for an actor whose messages may legitimately take hours.
        """
        if stall_s is not None and not (stall_s > 0 and math.isfinite(stall_s)):
            raise ValueError(f"spawn {name!r}: stall_s must be a finite number > 0, got {stall_s!r}")
        if self._stopped:
            raise ActorStopped(f"actor system {self.name!r} is stopped")
        if not isinstance(name, str) or not name:
            raise ValueError(f"actor name must be a non-empty string, got {name!r}")
        if name in self._cells:
            raise ValueError(f"actor name {name!r} is already taken in {self.name!r}")
        cell = ActorCell(
            name=name,
            actor=actor,
            system=self,
            clock=self.clock,
            capacity=capacity,
            policy=policy,
            restart=restart,
            stall_s=stall_s,
        )
        self._cells[name] = cell
        if self._started:
            cell.start()
        return cell.ref

    def lookup(self, name: str) -> ActorRef | None:
        cell = self._cells.get(name)
        return cell.ref if cell is not None else None

    def problem(self) -> str | None:
        """Why this system cannot do its work, or None: an actor the supervisor gave up on, or
        one stuck on a message beyond its `stall_s`. The service's liveness check."""
        if self.failures:
            failure = self.failures[0]
            return f"actor {failure.name!r} stopped after {failure.restarts} restarts: {failure.error!r}"
        for cell in self._cells.values():
            stuck = cell.stalled_for()
            if stuck is not None:
                return f"actor {cell.name!r} stuck on one message for {stuck:.0f}s (stall_s {cell.stall_s:g})"
        return None

    def statistics(self) -> list[MailboxStatistics]:
        return [cell.mailbox.statistics() for cell in self._cells.values()]

    def _report_failure(self, failure: ActorFailure) -> None:
        self.failures.append(failure)
        if self._on_failure is not None:
            try:
                self._on_failure(failure)
            except Exception as exc:
                logger.error("actor system %r: on_failure callback raised %r", self.name, exc)


__all__ = ["ActorSystem"]
