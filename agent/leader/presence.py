"""The devices' presence changes, each applied to the registry or kept until it can be.

A presence (a device's retained online/offline, its last will) comes from the broker, not from
the device's outbox: nobody sends it again if the leader drops it. So each change is told to the
LeaderActor and its commit awaited; one the store could not take (the fleet's database lost, a
full mailbox) stays pending and is tried again after `retry_s`. Pending changes are kept per
device, the newest replacing an older one (a device that went offline and came back during an
outage is applied once, as online), and told in batches so that a burst of reconnections is
still a few commits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from agent.core.clock import Clock
from agent.core.errors import (
    EdgeAgentError,
    MailboxFull,
    StoreClosed,
    StoreError,
    StoreUnavailable,
    UnstorableValue,
)
from agent.protocol import Presence

log = logging.getLogger(__name__)

RETRY_S = 1.0  # after a store failure, the pending changes are tried again this much later
BATCH = 256  # pending changes told at once
MAX_PENDING = 100_000  # devices with a change pending; beyond it the oldest change goes (logged)

#: tell the LeaderActor one presence with the future its commit settles (raises MailboxFull, ...)
Tell = Callable[[Presence, "asyncio.Future[bool]"], None]


class PresenceApplier:
    """`put(presence)` from the transport's callback (never blocks); `run()` applies them."""

    def __init__(self, tell: Tell, clock: Clock, *, retry_s: float = RETRY_S, batch: int = BATCH,
                 max_pending: int = MAX_PENDING) -> None:
        self._tell = tell
        self._clock = clock
        self._retry_s = retry_s
        self._batch = batch
        self._max_pending = max_pending
        self._pending: dict[str, Presence] = {}  # device -> its newest change not applied yet
        self._wake = asyncio.Event()
        self.applied = 0
        self.retries = 0  # rounds that left changes pending (the store failed, the mailbox was full)
        self.superseded = 0  # changes replaced by the same device's newer one, or past max_pending
        self.refused = 0  # changes the store refused for good (a value it cannot store)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def put(self, presence: Presence) -> None:
        device = presence.device_id
        if self._pending.pop(device, None) is not None:
            self.superseded += 1
        elif len(self._pending) >= self._max_pending:
            oldest = next(iter(self._pending))
            del self._pending[oldest]
            self.superseded += 1
            log.warning("presence of %s not applied: %d devices' changes wait already", oldest, self._max_pending)
        self._pending[device] = presence
        self._wake.set()

    async def run(self) -> None:
        """Apply what is pending until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                if not await self._round():
                    self.retries += 1
                    await self._clock.sleep(self._retry_s)

    async def _round(self) -> bool:
        """Tell a batch and await its commits; whether every change told was applied."""
        loop = asyncio.get_running_loop()
        told: list[tuple[Presence, asyncio.Future[bool]]] = []
        for presence in list(self._pending.values())[:self._batch]:
            done: asyncio.Future[bool] = loop.create_future()
            try:
                self._tell(presence, done)
            except MailboxFull:
                break
            except EdgeAgentError as exc:  # the LeaderActor is stopping: nothing more is applied
                log.debug("presence not told: %s", exc)
                break
            told.append((presence, done))
        if not told:
            return False
        await asyncio.gather(*(done for _, done in told), return_exceptions=True)
        complete = True
        for presence, done in told:
            failed = done.exception()
            if isinstance(failed, StoreError) and not isinstance(failed, UnstorableValue | StoreClosed):
                complete = False
                if not isinstance(failed, StoreUnavailable):  # (a lost database is one line of its own)
                    log.warning("presence of %s not applied yet: %s", presence.device_id, failed)
                continue
            if failed is not None:
                self.refused += 1
                log.warning("presence of %s not applied: %s", presence.device_id, failed)
            elif self._pending.get(presence.device_id) is presence:
                self.applied += 1
            if self._pending.get(presence.device_id) is presence:
                del self._pending[presence.device_id]
        return complete and len(told) > 0


__all__ = ["PresenceApplier"]
