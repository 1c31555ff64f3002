"""A bounded actor mailbox with a stated overflow policy and keyed coalescing.

Policies, applied by `put_nowait` when the mailbox is full:

* ``reject``: raise `MailboxFull(actor, retry_after_ms)`. The hint is the time the actor needs to
  work through what is queued: queue depth times an EWMA of its recent per-message service time
  (measured through the `Clock` between `get` and `task_done`), clamped to [1 ms, 60 s].
* ``drop_oldest``: evict the oldest queued message, then enqueue the new one.
* ``drop_newest``: discard the incoming message.

Both drops are counted (`dropped`) and reported to the optional `on_discard` hook, never silent.

Keyed coalescing (OVERWRITE): a put with ``coalesce_key`` whose key is already queued replaces
that message in place (same queue position, no extra slot) when its ``seq`` is higher; an
older-or-equal ``seq`` is discarded instead. Either way one message is counted as `coalesced`.
A coalescing put whose key is not queued needs a slot like any message, and a message refused
for lack of room leaves no trace: its key is only recorded once it is actually queued. Keys are
forgotten when their message leaves the queue (seq ordering applies to queued messages only).

Accounting (exact at every moment)::

    offered  == enqueued + rejected
    enqueued == processed + depth + dropped + coalesced + drained

`enqueued` counts every put that returned normally (the mailbox then owns the message's fate),
`processed` counts messages handed out by `get`, `drained` those handed back by `drain()`.

`put_nowait` and `get_nowait` are O(1): a deque of slots plus a dict from key to its slot.
`get` and `put` wait on futures woken by the other side, never by polling.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from agent.core.clock import Clock
from agent.core.errors import ActorStopped, MailboxFull

logger = logging.getLogger("agent.actors")

MailboxPolicy = Literal["reject", "drop_oldest", "drop_newest"]
DiscardReason = Literal["dropped", "coalesced"]

MIN_RETRY_AFTER_MS = 1
MAX_RETRY_AFTER_MS = 60_000
_EWMA_ALPHA = 0.25
_POLICIES: frozenset[str] = frozenset(get_args(MailboxPolicy))


@dataclass(frozen=True)
class MailboxStatistics:
    """A snapshot of one mailbox's counters (see the module docstring for the identities)."""

    name: str
    depth: int
    capacity: int
    enqueued: int
    processed: int
    rejected: int
    dropped: int
    coalesced: int
    high_water: int
    drained: int = 0
    failed: int = 0  # handed-out messages whose processing raised (a subset of processed)


class _Slot:
    __slots__ = ("item", "key", "seq")

    def __init__(self, item: object, key: str | None, seq: int) -> None:
        self.item = item
        self.key = key
        self.seq = seq


class Mailbox:
    """A bounded FIFO of messages for one actor. Not thread-safe: use it from its event loop."""

    def __init__(
        self,
        capacity: int,
        policy: MailboxPolicy = "reject",
        *,
        name: str,
        clock: Clock,
        on_discard: Callable[[object, DiscardReason], object] | None = None,
        initial_service_s: float = 0.001,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise TypeError(f"mailbox {name!r}: capacity must be an int, got {capacity!r}")
        if capacity < 1:
            raise ValueError(
                f"mailbox {name!r}: capacity must be >= 1, got {capacity} "
                "(0 is not 'unbounded'; every mailbox is bounded)"
            )
        if policy not in _POLICIES:
            raise ValueError(
                f"mailbox {name!r}: policy must be one of {sorted(_POLICIES)}, got {policy!r}"
            )
        if not (initial_service_s >= 0 and math.isfinite(initial_service_s)):
            raise ValueError(f"mailbox {name!r}: initial_service_s must be >= 0")
        self.name = name
        self.capacity = capacity
        self.policy: MailboxPolicy = policy
        self._clock = clock
        self._monotonic = clock.monotonic
        self._on_discard = on_discard
        # Plain messages are queued as they are; keyed ones in a _Slot that the key maps to.
        self._queue: deque[object] = deque()
        self._keys: dict[str, _Slot] = {}
        self._getters: deque[asyncio.Future[None]] = deque()
        self._putters: deque[asyncio.Future[None]] = deque()
        self._closed = False
        self._service_s = initial_service_s
        self._started_at: float | None = None
        self._enqueued = 0
        self._processed = 0
        self._rejected = 0
        self._dropped = 0
        self._coalesced = 0
        self._drained = 0
        self._failed = 0
        self._high_water = 0

    # -- reading -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._queue)

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def closed(self) -> bool:
        return self._closed

    def full(self) -> bool:
        return len(self._queue) >= self.capacity

    def empty(self) -> bool:
        return not self._queue

    @property
    def service_time_s(self) -> float:
        """The EWMA of recent per-message service time, in seconds."""
        return self._service_s

    def retry_after_ms(self) -> int:
        """How long a refused sender should wait: queued work at the recent service rate."""
        estimate = math.ceil(max(1, len(self._queue)) * self._service_s * 1000.0)
        return max(MIN_RETRY_AFTER_MS, min(MAX_RETRY_AFTER_MS, estimate))

    def statistics(self) -> MailboxStatistics:
        return MailboxStatistics(
            name=self.name,
            depth=len(self._queue),
            capacity=self.capacity,
            enqueued=self._enqueued,
            processed=self._processed,
            rejected=self._rejected,
            dropped=self._dropped,
            coalesced=self._coalesced,
            high_water=self._high_water,
            drained=self._drained,
            failed=self._failed,
        )

    # -- putting -----------------------------------------------------------------------------
    def put_nowait(self, item: object, *, coalesce_key: str | None = None, seq: int = 0) -> None:
        """Offer `item`; apply the policy if full. Raises MailboxFull (reject) or ActorStopped."""
        if self._closed:
            raise ActorStopped(f"actor {self.name!r} is stopped (mailbox closed)")
        if coalesce_key is not None and self._coalesce(item, coalesce_key, seq):
            return
        queue = self._queue
        if len(queue) >= self.capacity:
            if self.policy == "reject":
                self._rejected += 1
                raise MailboxFull(self.name, self.retry_after_ms())
            if self.policy == "drop_newest":
                self._enqueued += 1
                self._dropped += 1
                self._discard(item, "dropped")
                return
            evicted = queue.popleft()
            if type(evicted) is _Slot:
                self._forget(evicted)
                evicted = evicted.item
            self._dropped += 1
            self._discard(evicted, "dropped")
        if coalesce_key is None:
            queue.append(item)
        else:
            slot = _Slot(item, coalesce_key, seq)
            queue.append(slot)
            self._keys[coalesce_key] = slot
        self._enqueued += 1
        if len(queue) > self._high_water:
            self._high_water = len(queue)
        if self._getters:
            self._wake(self._getters)

    async def put(self, item: object, *, coalesce_key: str | None = None, seq: int = 0) -> None:
        """Wait for room, then enqueue. The overflow policy governs `put_nowait` only.

        A coalescing put whose key is queued never waits (it takes no slot).
        """
        while len(self._queue) >= self.capacity and not (
            coalesce_key is not None and coalesce_key in self._keys
        ):
            if self._closed:
                raise ActorStopped(f"mailbox of {self.name!r} is closed")
            await self._wait(self._putters)
        self.put_nowait(item, coalesce_key=coalesce_key, seq=seq)

    def _coalesce(self, item: object, key: str, seq: int) -> bool:
        """Resolve a keyed put against a queued message; False if the key is not queued."""
        slot = self._keys.get(key)
        if slot is None:
            return False
        self._enqueued += 1
        self._coalesced += 1
        if seq > slot.seq:
            superseded = slot.item
            slot.item = item
            slot.seq = seq
            self._discard(superseded, "coalesced")
        else:
            self._discard(item, "coalesced")
        return True

    def _forget(self, slot: _Slot) -> None:
        if slot.key is not None and self._keys.get(slot.key) is slot:
            del self._keys[slot.key]

    def _discard(self, item: object, reason: DiscardReason) -> None:
        if self._on_discard is not None:
            try:
                self._on_discard(item, reason)
            except Exception as exc:  # a broken hook must not corrupt the queue's accounting
                logger.error("mailbox %r: on_discard hook raised %r", self.name, exc)

    # -- getting -----------------------------------------------------------------------------
    def get_nowait(self) -> object:
        """Take the oldest message. Raises asyncio.QueueEmpty, or ActorStopped once closed."""
        if not self._queue:
            if self._closed:
                raise ActorStopped(f"mailbox of {self.name!r} is closed and empty")
            raise asyncio.QueueEmpty
        item = self._queue.popleft()
        if type(item) is _Slot:
            self._forget(item)
            item = item.item
        self._processed += 1
        self._started_at = self._monotonic()
        if self._putters:
            self._wake(self._putters)
        return item

    async def get(self) -> object:
        """Wait for a message. Once closed, queued messages are still handed out, then
        ActorStopped is raised."""
        while not self._queue:
            if self._closed:
                raise ActorStopped(f"mailbox of {self.name!r} is closed and empty")
            await self._wait(self._getters)
        return self.get_nowait()

    def task_done(self, *, failed: bool = False) -> None:
        """Mark the message last handed out as finished; feeds the service-time EWMA."""
        if self._started_at is None:
            raise ValueError(f"mailbox {self.name!r}: task_done() without a message in service")
        elapsed = max(0.0, self._monotonic() - self._started_at)
        self._started_at = None
        self._service_s += _EWMA_ALPHA * (elapsed - self._service_s)
        if failed:
            self._failed += 1

    def drain(self) -> list[object]:
        """Remove and return every queued message, oldest first (counted as `drained`)."""
        items = [x.item if type(x) is _Slot else x for x in self._queue]
        self._queue.clear()
        self._keys.clear()
        self._drained += len(items)
        self._wake_all(self._putters)
        return items

    def close(self) -> None:
        """Refuse new messages; queued ones can still be taken. Wakes every waiter."""
        self._closed = True
        self._wake_all(self._getters)
        self._wake_all(self._putters)

    # -- waiting -----------------------------------------------------------------------------
    async def _wait(self, waiters: deque[asyncio.Future[None]]) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        try:
            await fut
        except BaseException:
            fut.cancel()
            try:
                waiters.remove(fut)
            except ValueError:
                # We were woken and cancelled at once: pass the wake-up on.
                self._wake(waiters)
            raise

    @staticmethod
    def _wake(waiters: deque[asyncio.Future[None]]) -> None:
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    @staticmethod
    def _wake_all(waiters: deque[asyncio.Future[None]]) -> None:
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)


__all__ = [
    "MAX_RETRY_AFTER_MS",
    "MIN_RETRY_AFTER_MS",
    "DiscardReason",
    "Mailbox",
    "MailboxPolicy",
    "MailboxStatistics",
]
