"""One message class inside one relay partition: a bulkhead with its own AIMD limiter, an
in-memory queue of rows taken from the store, and long-lived sender coroutines pulling from it.

No task per message: senders are created on demand up to the current limit and live until the
relay stops. One wake-up at a time per lane: a sender whose delivery returns at once works
through the queue by itself, and one whose delivery waits wakes the next sender before it does,
so concurrency follows the receiver's pace up to the limit without a wake-up per row.

What happens to a row after its delivery is the relay's business (`LaneHost`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

from agent.core.errors import Capacity, Permanent
from agent.outbox.limiter import AimdLimiter, AimdSettings
from agent.outbox.types import OutboxRow


class LaneHost(Protocol):
    """What a lane's senders need from the relay."""

    @property
    def sending(self) -> bool: ...

    async def failed(self, row: OutboxRow, exc: Exception) -> None:
        """Settle a failed delivery in the store (nack, dead letter or release)."""

    async def release_untried(self, row: OutboxRow) -> None:
        """Hand a row back to the store without spending an attempt."""

    def abandoned(self, row: OutboxRow) -> None:
        """A sender was cancelled holding this row: release it when the relay stops."""


class Lane:
    __slots__ = (
        "kind", "limiter", "queue", "workers", "busy", "_idle", "_waking", "_host", "_deliver",
        "_acks", "_ack_wake", "_room", "_name",
    )

    def __init__(
        self,
        kind: str,
        limits: AimdSettings,
        *,
        host: LaneHost,
        deliver: Callable[[OutboxRow], Awaitable[None]],
        acks: list[int],
        ack_wake: asyncio.Event,
        room: Callable[[], None],
        name: str,
    ) -> None:
        self.kind = kind
        self.limiter = AimdLimiter.from_settings(limits)
        self.queue: deque[OutboxRow] = deque()
        self.workers: list[asyncio.Task[None]] = []
        self.busy = 0  # rows held by senders (waiting for a permit, delivering, settling)
        self._idle: deque[asyncio.Future[None]] = deque()  # senders waiting for a row
        self._waking = 0  # senders told to run that have not started yet
        self._host = host
        self._deliver = deliver
        self._acks = acks  # the relay's list of delivered row ids (acked in groups)
        self._ack_wake = ack_wake
        self._room = room  # called when the lane could take a batch of `limit` rows
        self._name = name

    @property
    def load(self) -> int:
        return len(self.queue) + self.busy

    @property
    def room(self) -> int:
        """How many more rows this lane wants in memory: read-ahead of twice its limit."""
        return max(0, 2 * self.limiter.limit - self.load)

    def push(self, row: OutboxRow) -> None:
        self.queue.append(row)
        if not self._waking:
            self._wake_sender()

    def take_queued(self) -> list[OutboxRow]:
        """Empty the queue (rows not yet picked up by a sender)."""
        rows = list(self.queue)
        self.queue.clear()
        return rows

    def reset(self) -> None:
        """After the relay cancelled and awaited every sender."""
        self.queue.clear()
        self.workers.clear()
        self._idle.clear()
        self.busy = self._waking = 0

    def _wake_sender(self) -> None:
        """Get one more sender going: an idle one, or a new one while under the limit."""
        if self._idle:
            fut = self._idle.popleft()
            self._waking += 1
            fut.set_result(None)
        elif len(self.workers) < self.limiter.limit:
            self._waking += 1
            self.workers.append(
                asyncio.create_task(self._send_loop(), name=f"{self._name}-{len(self.workers)}")
            )

    async def _send_loop(self) -> None:
        loop = asyncio.get_running_loop()
        host = self._host
        deliver = self._deliver
        acks = self._acks
        limiter = self.limiter
        queue = self.queue
        self._waking -= 1  # started
        while True:
            if not queue:
                fut: asyncio.Future[None] = loop.create_future()
                self._idle.append(fut)
                try:
                    await fut
                finally:
                    if fut.done():
                        self._waking -= 1  # woken by _wake_sender
                    else:  # cancelled while idle
                        fut.cancel()
                        with contextlib.suppress(ValueError):
                            self._idle.remove(fut)
                continue
            row = queue.popleft()
            self.busy += 1
            held: OutboxRow | None = row  # handed back untried if we are cancelled holding it
            try:
                if not limiter.try_acquire():
                    await limiter.acquire()
                if not host.sending:
                    limiter.release()
                    held = None
                    await host.release_untried(row)
                    continue
                if queue and not self._waking:
                    self._wake_sender()
                try:
                    await deliver(row)
                except asyncio.CancelledError:
                    limiter.release()
                    raise
                except Exception as exc:  # every failure is an outcome, typed or not
                    held = None
                    limiter.release(
                        "capacity"
                        if isinstance(exc, Capacity)
                        else "none"
                        if isinstance(exc, Permanent)
                        else "transient"
                    )
                    await host.failed(row, exc)
                else:
                    held = None
                    limiter.release("success")  # counts it: the relay sums lane successes
                    if not acks:
                        self._ack_wake.set()  # a non-empty list is already on its way
                    acks.append(row.row_id)
            finally:
                self.busy -= 1
                if held is not None:
                    host.abandoned(held)
                if len(queue) + self.busy <= limiter.limit:
                    self._room()


__all__ = ["Lane", "LaneHost"]
