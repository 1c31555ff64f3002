"""QoS 1 publishes of one `MqttTransport` waiting for their PUBACK.

At most `max_inflight` at once (the broker's receive maximum is not ours to exceed: mosquitto
answers a publish beyond it with a failure reason code), each failed after `timeout_s` by one
sweep timer rather than a timeout per publish, all failed at once when the connection ends.

A PUBACK with a failure reason code (an ACL refusing the topic, say) completes the publish as
aiomqtt does, since the broker has dealt with it; it is counted in `refused` and logged (the
first of each connection at WARNING). An envelope refused this way gets no reply, which its
sender's reply timeout already handles.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from agent.core.clock import Clock
from agent.core.errors import ConnectionLost, TransportError
from agent.transport._deadlines import Deadlines

FAILURE = 0x80  # MQTT v5 reason codes at or above this are failures

log = logging.getLogger("agent.transport.mqtt")


class PubackTracker:
    def __init__(self, *, clock: Clock, timeout_s: float, max_inflight: int, name: str) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        self._clock = clock
        self._timeout_s = timeout_s
        self._max = max_inflight
        self._name = name
        self._acks: dict[int, asyncio.Future[None]] = {}  # packet id -> its publish's future
        self._deadlines: Deadlines[None] = Deadlines(clock, timeout_s, self._overdue)
        self._waiters: deque[asyncio.Future[None]] = deque()  # publishes waiting for a slot
        self._generation = 0  # bumped by fail_all: a slot waiter learns its connection ended
        self._refusal_logged = False  # this connection's first refusal went out at WARNING
        self.refused = 0

    def __len__(self) -> int:
        return len(self._acks)

    async def reserve(self) -> None:
        """Wait until fewer than `max_inflight` are in flight; `ConnectionLost` if the
        connection ends meanwhile. No await between this and `wait` keeps the count exact."""
        generation = self._generation
        while len(self._acks) >= self._max:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if not waiter.done():
                    waiter.cancel()
            if self._generation != generation:
                raise ConnectionLost(f"{self._name}: connection lost while publishing")

    async def wait(self, mid: int) -> None:
        """Wait for the PUBACK of packet `mid`: returns, or raises `TransportError` (overdue)
        or `ConnectionLost`."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._acks[mid] = future
        self._deadlines.add(future)
        try:
            await future
        finally:
            if not future.done():
                future.cancel()
            if self._acks.get(mid) is future:
                del self._acks[mid]
                self._wake_one()

    def acked(self, mid: int, reason: int) -> None:
        """A PUBACK arrived (reason code as an int)."""
        future = self._acks.pop(mid, None)
        if future is None:
            return
        if reason >= FAILURE:
            self.refused += 1
            level = logging.DEBUG if self._refusal_logged else logging.WARNING
            self._refusal_logged = True
            log.log(level, "%s: the broker refused a publish (reason code %#x; %d so far)", self._name, reason,
                    self.refused)
        if not future.done():
            future.set_result(None)
        self._wake_one()
        self._deadlines.drop_done()

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        """The connection ended: every waiting publish fails with `error()`."""
        self._generation += 1
        self._refusal_logged = False
        acks, self._acks = self._acks, {}
        for future in acks.values():
            if not future.done():
                future.set_exception(error())
        self._deadlines.clear()
        waiters, self._waiters = self._waiters, deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _wake_one(self) -> None:
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _overdue(self, future: asyncio.Future[None]) -> None:
        future.set_exception(TransportError(f"{self._name}: no PUBACK within {self._timeout_s}s"))


__all__ = ["FAILURE", "PubackTracker"]
