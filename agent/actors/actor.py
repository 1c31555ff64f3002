"""What a user of the runtime writes: an `Actor` subclass, and what it is given: a `Context`.

An actor processes one message at a time, in mailbox order. `receive` may return a value: that is
the reply to an `ask` (and ignored for a `tell`). An exception raised by `receive` is re-raised to
the asker, counted as `failed`, logged with the message, and makes the supervisor restart the
actor under its `RestartPolicy`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agent.core.clock import Clock

if TYPE_CHECKING:
    from agent.actors.ref import ActorRef
    from agent.actors.system import ActorSystem


class Actor:
    """Subclass and override `receive` (and `on_start` / `on_stop` when state needs them).

    On a restart the supervisor calls `on_stop` then `on_start` again: on the same instance when
    the actor was spawned as an instance, on a fresh one when it was spawned from a factory.
    """

    async def on_start(self, ctx: Context) -> None:
        """Called before the first message and after every restart."""

    async def receive(self, message: object, ctx: Context) -> object | None:
        """Handle one message. The return value is the reply to an `ask`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement receive()")

    async def on_stop(self, ctx: Context) -> None:
        """Called when the actor stops, and before each restart."""


ActorFactory = Callable[[], Actor]


class Context:
    """Handed to every callback: the actor's own ref, its system and its clock."""

    __slots__ = ("self", "system", "clock")

    def __init__(self, ref: ActorRef, system: ActorSystem, clock: Clock) -> None:
        self.self = ref
        self.system = system
        self.clock = clock

    @property
    def name(self) -> str:
        return self.self.name


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    """How a failing actor is restarted.

    The n-th failure within the last `window_s` seconds waits
    ``min(backoff_cap_s, backoff_base_s * 2 ** (n - 1))`` before the restart; a failure that
    makes more than `max_restarts` within the window stops the actor and reports it.
    """

    max_restarts: int = 5
    window_s: float = 60.0
    backoff_base_s: float = 0.1
    backoff_cap_s: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int):
            raise TypeError(f"RestartPolicy.max_restarts must be an int: {self.max_restarts!r}")
        if self.max_restarts < 0:
            raise ValueError(f"RestartPolicy.max_restarts must be >= 0: {self.max_restarts}")
        for name in ("window_s", "backoff_base_s", "backoff_cap_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"RestartPolicy.{name} must be a finite number >= 0: {value!r}")
        if self.window_s <= 0:
            raise ValueError(f"RestartPolicy.window_s must be > 0: {self.window_s}")
        if self.backoff_cap_s < self.backoff_base_s:
            raise ValueError("RestartPolicy.backoff_cap_s must be >= backoff_base_s")

    def backoff_s(self, failures_in_window: int) -> float:
        """Delay before the restart that follows the n-th failure in the window (n >= 1)."""
        exponent = max(0, failures_in_window - 1)
        if exponent >= 64:
            return self.backoff_cap_s
        return min(self.backoff_cap_s, self.backoff_base_s * (2**exponent))


@dataclass(frozen=True)
class ActorFailure:
    """An actor the supervisor gave up on. `undelivered` holds the messages still queued."""

    name: str
    error: BaseException
    restarts: int
    at_ms: int
    undelivered: list[object] = field(default_factory=list)


__all__ = ["Actor", "ActorFactory", "ActorFailure", "Context", "RestartPolicy"]
