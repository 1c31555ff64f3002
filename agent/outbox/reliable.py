"""`tell_reliable`: deliver directly when the receiver can take it, else keep it in the outbox.

The direct `tell` costs nothing durable; when it fails for any reason we know about (a full
mailbox, a stopped actor, the transport offline: every `EdgeAgentError`) the message goes to the
outbox, which the relay drains later. Only when both fail does the caller see an error: the
store's, with the `tell` failure chained as its cause.
"""

from __future__ import annotations

import inspect
import logging
from typing import Literal, NamedTuple, Protocol

from agent.core.errors import EdgeAgentError
from agent.outbox.types import EnqueueResult, OutboxMessage

log = logging.getLogger(__name__)

TellPath = Literal["direct", "outbox"]


class Told(NamedTuple):
    """Which path took a message; what the outbox made of it (that path), or what the direct
    `tell` returned (the receiver's answer, when it gives one)."""

    path: TellPath
    stored: EnqueueResult | None
    answer: object = None


class TellTarget(Protocol):
    """Anything with an ActorRef-like `tell` (local refs return None; a remote one may return
    an awaitable, which is awaited)."""

    def tell(self, message: object, *, coalesce_key: str | None = None, seq: int = 0) -> object:
        ...


class Monotonic(Protocol):
    def monotonic(self) -> float: ...


class OutboxWriter(Protocol):
    async def enqueue(self, msg: OutboxMessage, *, delay_ms: int = 0) -> EnqueueResult: ...


async def tell_reliable(
    ref: TellTarget, message: object, *, outbox: OutboxWriter, msg: OutboxMessage
) -> TellPath:
    return (await tell_reliable_result(ref, message, outbox=outbox, msg=msg))[0]


async def tell_reliable_result(
    ref: TellTarget, message: object, *, outbox: OutboxWriter, msg: OutboxMessage
) -> Told:
    """`tell_reliable`, with what the outbox made of the message when it took it.

    Try `ref.tell(message)`; on an `EdgeAgentError` store `msg` in `outbox` instead.

    `msg` is the durable form of the same message (its receiver, class, encoded payload, key).
    An OVERWRITE message passes its key as the mailbox's coalescing key, so the direct path
    coalesces the same way the outbox does. Returns which path took the message.
    """
    coalesce_key = msg.key if msg.conflict == "overwrite" else None
    try:
        result = ref.tell(message, coalesce_key=coalesce_key, seq=msg.seq)
        if inspect.isawaitable(result):
            result = await result
    except EdgeAgentError as tell_error:
        log.debug("tell to %s failed (%s); storing %s in the outbox", msg.receiver, tell_error, msg.msg_id)
        try:
            stored = await outbox.enqueue(msg)
        except EdgeAgentError as store_error:
            raise store_error from tell_error
        return Told("outbox", stored)
    return Told("direct", None, result)


class DirectFirst:
    """`tell_reliable` that stops trying the direct path for `backoff_s` after it failed: while
    the receiver is away, each message goes straight to the outbox (no round trip per message)."""

    def __init__(self, clock: Monotonic, *, backoff_s: float = 30.0) -> None:
        self._clock = clock
        self._backoff_s = backoff_s
        self._direct_after = 0.0

    def reset(self) -> None:
        """Try the direct path again from now on (the connection came back)."""
        self._direct_after = 0.0

    async def send(self, ref: TellTarget, message: object, *, outbox: OutboxWriter,
                   msg: OutboxMessage) -> Told:
        if self._clock.monotonic() < self._direct_after:
            return Told("outbox", await outbox.enqueue(msg))
        told = await tell_reliable_result(ref, message, outbox=outbox, msg=msg)
        if told.path == "outbox":
            self._direct_after = self._clock.monotonic() + self._backoff_s
        return told


__all__ = ["DirectFirst", "TellPath", "TellTarget", "Told", "tell_reliable", "tell_reliable_result"]
