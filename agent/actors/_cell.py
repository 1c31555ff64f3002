"""One actor's runtime: its mailbox, its long-lived task and its supervisor (internal).

The task takes one message at a time from the mailbox and awaits `receive`; no task is created
per message. A failure (an exception from `on_start` or `receive`) is logged with the message,
counted as `failed`, re-raised to an asker, and followed by a restart: `on_stop`, a backoff
sleep on the clock, a fresh instance when spawned from a factory, `on_start`. The failing
message is not retried. When more than `max_restarts` failures fall within `window_s`, the actor
stops, its queued messages are handed back in an `ActorFailure` and the system is told.
"""

from __future__ import annotations

import asyncio
import logging
import reprlib
from collections import deque
from typing import TYPE_CHECKING

from agent.actors.actor import Actor, ActorFactory, ActorFailure, Context, RestartPolicy
from agent.actors.mailbox import DiscardReason, Mailbox, MailboxPolicy
from agent.actors.ref import ActorRef, Ask
from agent.core.clock import Clock
from agent.core.errors import ActorStopped, MailboxFull

if TYPE_CHECKING:
    from agent.actors.system import ActorSystem

logger = logging.getLogger("agent.actors")

# Messages processed back to back before the actor yields to the event loop, so a busy actor
# whose receive() never suspends cannot starve the other tasks.
_BURST = 64

_repr = reprlib.Repr()
_repr.maxstring = 120
_repr.maxother = 120


class ActorCell:
    def __init__(
        self,
        *,
        name: str,
        actor: Actor | ActorFactory,
        system: ActorSystem,
        clock: Clock,
        capacity: int,
        policy: MailboxPolicy,
        restart: RestartPolicy | None,
        stall_s: float | None = None,
    ) -> None:
        if isinstance(actor, Actor):
            self._factory: ActorFactory | None = None
            self._actor: Actor | None = actor
        elif callable(actor):
            self._factory = actor
            self._actor = None
        else:
            raise TypeError(f"spawn {name!r}: expected an Actor or a zero-argument factory")
        if restart is not None and not isinstance(restart, RestartPolicy):
            raise TypeError(f"spawn {name!r}: restart must be a RestartPolicy or None")
        self.name = name
        self.clock = clock
        self.system = system
        self.mailbox = Mailbox(
            capacity, policy, name=name, clock=clock, on_discard=self._on_discard
        )
        self.ref = ActorRef(self)
        self.ctx = Context(self.ref, system, clock)
        self._restart = restart
        self._failure_times: deque[float] = deque()
        self.restarts = 0
        self._stopping = False
        self._in_flight: object | None = None
        self.stall_s = stall_s
        self._busy_since = 0.0  # clock.monotonic() when the message in flight began
        self._interrupted: list[object] = []
        self._wakeup: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    # -- the sending side (ActorRef puts into the mailbox directly; closed means stopped) --
    def _on_discard(self, item: object, reason: DiscardReason) -> None:
        if isinstance(item, Ask) and not item.future.done():
            item.future.set_exception(MailboxFull(self.name, self.mailbox.retry_after_ms()))

    def stalled_for(self) -> float | None:
        """Seconds the message in flight has been in `receive()`, if beyond `stall_s`."""
        if self.stall_s is None or self._in_flight is None or self._stopping:
            return None
        busy = self.clock.monotonic() - self._busy_since
        return busy if busy > self.stall_s else None

    # -- lifecycle driven by the system ------------------------------------------------------
    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(
            self._run(), name=f"{self.system.name}/{self.name}"
        )

    def begin_stop(self) -> None:
        """Refuse new messages; the task drains the queue, runs on_stop and ends."""
        self._stopping = True
        self.mailbox.close()
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)  # no backoff wait during shutdown

    def hand_back(self) -> list[object]:
        """Everything not processed: an interrupted message first, then the queue.

        Pending asks are answered with ActorStopped instead of being listed.
        """
        items = self._interrupted + self.mailbox.drain()
        self._interrupted = []
        out: list[object] = []
        for item in items:
            if type(item) is Ask:
                if not item.future.done():
                    item.future.set_exception(ActorStopped(f"actor {self.name!r} stopped"))
            else:
                out.append(item)
        return out

    # -- the actor's task --------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            if await self._begin() and await self._loop():
                await self._end()
        except asyncio.CancelledError:
            if self._in_flight is not None:
                self._interrupted.append(self._in_flight)
                self._in_flight = None
            raise
        finally:
            # However the task ends, senders must see ActorStopped, not a mailbox nobody reads.
            self.mailbox.close()

    async def _loop(self) -> bool:
        """Process messages until the mailbox is closed and empty (True) or we gave up (False)."""
        mailbox = self.mailbox
        burst = 0
        while True:
            if mailbox.empty():
                burst = 0
                try:
                    item = await mailbox.get()
                except ActorStopped:
                    return True
            elif burst >= _BURST:
                burst = 0
                await asyncio.sleep(0)  # a cooperative yield, not a timer
                continue
            else:
                item = mailbox.get_nowait()
            burst += 1
            self._in_flight = item
            if self.stall_s is not None:
                self._busy_since = self.clock.monotonic()
            if type(item) is Ask:
                message, future = item.message, item.future
            else:
                message, future = item, None
            assert self._actor is not None
            try:
                result = await self._actor.receive(message, self.ctx)
            except (Exception, asyncio.CancelledError) as raised:
                if isinstance(raised, asyncio.CancelledError) and _being_cancelled():
                    raise  # our task is being cancelled (stop timeout): not a failure
                exc = _as_failure(raised, self.name)
                self._in_flight = None
                mailbox.task_done(failed=True)
                logger.warning(
                    "actor %r failed on message %s: %r",
                    self.name, _repr.repr(message), exc, exc_info=exc,
                )
                if future is not None and not future.done():
                    future.set_exception(exc)
                if self._stopping:
                    continue  # draining for shutdown: no restart, keep handing out the queue
                await self._end()
                if not await self._backoff(exc) or not await self._begin():
                    return False
                continue
            self._in_flight = None
            mailbox.task_done()
            if future is not None and not future.done():
                future.set_result(result)

    async def _pause(self, delay_s: float) -> None:
        """Sleep `delay_s` on the clock; cut short when the system begins to stop."""
        wakeup: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._wakeup = wakeup

        def wake() -> None:
            if not wakeup.done():
                wakeup.set_result(None)

        timer = self.clock.call_later(delay_s, wake)
        try:
            await wakeup
        finally:
            timer.cancel()
            self._wakeup = None

    async def _begin(self) -> bool:
        """Create (factory) and start the actor, retrying under the policy. False: gave up."""
        while True:
            try:
                if self._actor is None:
                    assert self._factory is not None
                    actor = self._factory()
                    if not isinstance(actor, Actor):
                        raise TypeError(f"factory of {self.name!r} returned {actor!r}")
                    self._actor = actor
                await self._actor.on_start(self.ctx)
                return True
            except Exception as exc:
                logger.warning("actor %r failed to start: %r", self.name, exc, exc_info=exc)
                if not await self._backoff(exc):
                    return False

    async def _end(self) -> None:
        if self._actor is None:
            return
        try:
            await self._actor.on_stop(self.ctx)
        except Exception as exc:
            logger.warning("actor %r: on_stop raised %r", self.name, exc, exc_info=exc)
        if self._factory is not None:
            self._actor = None

    async def _backoff(self, exc: BaseException) -> bool:
        """Count a failure; wait the backoff before a restart, or give up (False)."""
        now = self.clock.monotonic()
        policy = self._restart
        times = self._failure_times
        times.append(now)
        if policy is not None:
            while times and times[0] <= now - policy.window_s:
                times.popleft()
        if policy is None or len(times) > policy.max_restarts:
            self._give_up(exc)
            return False
        delay = policy.backoff_s(len(times))
        self.restarts += 1
        logger.info("actor %r restarts in %.3fs (failure %d)", self.name, delay, len(times))
        if delay > 0 and not self._stopping:
            await self._pause(delay)
        return True

    def _give_up(self, exc: BaseException) -> None:
        self.mailbox.close()
        failure = ActorFailure(
            name=self.name,
            error=exc,
            restarts=self.restarts,
            at_ms=self.clock.now_ms(),
            undelivered=self.hand_back(),
        )
        logger.error(
            "actor %r stopped after %d restarts; last error %r; %d messages handed back",
            self.name, self.restarts, exc, len(failure.undelivered),
        )
        self.system._report_failure(failure)


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _as_failure(raised: BaseException, name: str) -> Exception:
    """A stray CancelledError from inside receive() becomes an ordinary failure."""
    if isinstance(raised, Exception):
        return raised
    failure = RuntimeError(f"receive() of {name!r} raised {raised!r}")
    failure.__cause__ = raised
    return failure


__all__ = ["ActorCell"]
