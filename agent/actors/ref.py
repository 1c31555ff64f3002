"""`ActorRef`: the only handle other code holds on an actor."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any

from agent.actors.mailbox import MailboxStatistics
from agent.core.errors import AskTimeout

if TYPE_CHECKING:
    from agent.actors._cell import ActorCell


class Ask:
    """A queued request: the message plus the future its reply goes to (internal)."""

    __slots__ = ("message", "future")

    def __init__(self, message: object, future: asyncio.Future[Any]) -> None:
        self.message = message
        self.future = future


class ActorRef:
    """Send messages to one actor. Cheap to copy around; compares by actor identity."""

    __slots__ = ("_cell",)

    def __init__(self, cell: ActorCell) -> None:
        self._cell = cell

    @property
    def name(self) -> str:
        return self._cell.name

    @property
    def alive(self) -> bool:
        """True while the actor accepts messages."""
        return not self._cell.mailbox.closed

    @property
    def depth(self) -> int:
        """Messages queued right now (cheaper than `statistics().depth`)."""
        return len(self._cell.mailbox)

    @property
    def restarts(self) -> int:
        """How many times the supervisor restarted this actor."""
        return self._cell.restarts

    def tell(self, message: object, *, coalesce_key: str | None = None, seq: int = 0) -> None:
        """Enqueue `message` and return at once.

        Raises MailboxFull (policy `reject`, with a retry_after_ms hint) or ActorStopped.
        With `coalesce_key`, a queued message with the same key is replaced if `seq` is higher.
        """
        self._cell.mailbox.put_nowait(message, coalesce_key=coalesce_key, seq=seq)

    async def ask(self, message: object, *, timeout_s: float) -> Any:
        """Send `message` and wait for what `receive` returns.

        Raises AskTimeout after `timeout_s` of the system clock, MailboxFull or ActorStopped when
        the message is not taken (or is dropped by a drop policy, or handed back on stop), and
        re-raises whatever exception `receive` raised for this message.
        """
        if not (isinstance(timeout_s, int | float) and timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"ask timeout_s must be a finite number > 0, got {timeout_s!r}")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._cell.mailbox.put_nowait(Ask(message, future))
        name = self.name

        def expire() -> None:
            if not future.done():
                future.set_exception(AskTimeout(f"no reply from {name!r} within {timeout_s}s"))

        timer = self._cell.clock.call_later(timeout_s, expire)
        try:
            return await future
        finally:
            timer.cancel()

    def statistics(self) -> MailboxStatistics:
        return self._cell.mailbox.statistics()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and other._cell is self._cell

    def __hash__(self) -> int:
        return id(self._cell)

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r})"


__all__ = ["ActorRef", "Ask"]
