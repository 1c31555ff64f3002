"""An in-process MQTT-like broker and its client, for the simulator and the fast tests.

One `MemoryBroker` is one simulated world. It keeps MQTT v5's semantics where edge-agent relies on
them: `+`/`#` wildcards, QoS 1 messages queued for an offline persistent session (bounded, drops
counted) and delivered on reconnect, retained messages, the last will on an abrupt disconnect
only, shared subscriptions (round-robin among the group's connected members), response topic and
correlation data. Failures are injected: `partition(client_id)` cuts a client off (abruptly, so
its will fires) until `heal`, `partition()` takes the whole broker down, and `set_delay` adds
per-client latency through the `Clock`.

Delivery is deterministic for the same inputs (everything is kept in insertion-ordered dicts) and
cheap: a delivery is an append to the client's queue. One callback per loop turn hands the
broker's fresh deliveries to their handlers, client by client in the order they became ready; a
handler that returns nothing costs no task. A client whose handler returns something to await gets
a dispatch task for the rest of its queue, which ends when the queue is empty.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
from collections import deque
from collections.abc import Awaitable

from agent.core.errors import ConnectionLost, NotConnected
from agent.core.gate import Gate
from agent.core.tasks import cancel_and_wait
from agent.transport import topics
from agent.transport._memory_broker import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_MAX_QUEUED_PER_SESSION,
    BrokerStats,
    MemoryBroker,
    _as_message,
)
from agent.transport.base import Handler, InboundMessage, PayloadTooLarge, Will
from agent.transport.linkbytes import AirModel, TcpCounters, publish_bytes

log = logging.getLogger(__name__)


def _packet_bytes(message: InboundMessage, expiry: bool = False) -> int:
    """The MQTT v5 PUBLISH that would carry `message` (for the `AirModel`)."""
    return publish_bytes(message.topic, len(message.payload), qos=message.qos, response_topic=message.response_topic,
                         correlation=message.correlation, expiry=expiry)


class MemoryTransport:
    """A client of a `MemoryBroker`, implementing the `Transport` protocol."""

    def __init__(
        self,
        broker: MemoryBroker,
        client_id: str,
        *,
        clean_start: bool = False,
        will: Will | None = None,
        birth: Will | None = None,
        max_payload_bytes: int | None = None,
        reconnect_jitter_s: float = 0.0,
        rng: random.Random | None = None,
        air: AirModel | None = None,
    ) -> None:
        if not client_id:
            raise ValueError("client_id must not be empty")
        self._broker = broker
        self._clock = broker.clock
        self._client_id = client_id
        self.clean_start = clean_start
        self.will = will
        self.birth = birth
        self._max_payload = max_payload_bytes or broker.max_payload_bytes
        self._jitter_s = max(0.0, reconnect_jitter_s)
        self._rng = rng if rng is not None else broker.rng
        self._gate = Gate()
        self._subs: dict[str, tuple[Handler, int]] = {}
        self._queue: deque[tuple[str, InboundMessage]] = deque()
        # Runs only while there is something to hand over: an idle client holds no task.
        self._dispatcher: asyncio.Task[None] | None = None
        self._ready = False  # waiting for the broker's next hand-over of deliveries
        self._unstarted: Awaitable[None] | None = None  # what a new dispatch task awaits first
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self.connects = 0
        # what this client's connection would cost over TLS (`AirModel`), when the simulator asks
        self.air = air

    # -- Transport protocol ----------------------------------------------------------------
    @property
    def client_id(self) -> str:
        return self._client_id

    @property
    def connected(self) -> Gate:
        return self._gate

    @property
    def max_payload_bytes(self) -> int:
        return self._max_payload

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._try_connect()
        if self._queue:
            self._wake()

    async def stop(self) -> None:
        """Clean disconnect: announce the will's message ourselves, the broker's will stays unused."""
        if not self._started:
            return
        self._started = False
        if self._gate.is_open:
            if self.will is not None:
                self._broker._publish(self, _as_message(self.will))
            self._broker._disconnect(self, fire_will=False)
            if self.air is not None:
                self.air.ended(self._clock.monotonic())
        self._broker._waiting.pop(self._client_id, None)
        self._gate.close()
        await self._stop_dispatcher()

    async def abort(self) -> None:
        """Die without a DISCONNECT (a crash or power cut): the broker publishes the will."""
        if not self._started:
            return
        self._started = False
        if self._gate.is_open:
            self._broker._disconnect(self, fire_will=True)
            if self.air is not None:
                self.air.ended(self._clock.monotonic())
        self._broker._waiting.pop(self._client_id, None)
        self._gate.close()
        await self._stop_dispatcher()

    def _outbound(self, topic: str, payload: bytes, retain: bool, response_topic: str | None,
                  correlation: bytes | None, qos: int) -> InboundMessage:
        """The message to publish, once its size, its topic and the connection are checked."""
        if len(payload) > self._max_payload:
            raise PayloadTooLarge(len(payload), self._max_payload)
        broker = self._broker
        if topic not in broker._valid:
            broker.check_topic(topic)
        if not self._gate.is_open:
            raise NotConnected(f"{self._client_id!r} is not connected")
        return InboundMessage(topic, bytes(payload), retain, response_topic, correlation, qos)

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        response_topic: str | None = None,
        correlation: bytes | None = None,
        expiry_s: int | None = None,  # not modelled: the in-memory broker keeps queued messages
    ) -> None:
        message = self._outbound(topic, payload, retain, response_topic, correlation, qos)
        if self.air is not None:
            self._count_out(message, expiry_s is not None)
        broker = self._broker
        if broker._delays:
            delay = broker.delay_of(self._client_id)
            if delay:
                await self._clock.sleep(delay)
                if not self._gate.is_open:
                    raise ConnectionLost(f"{self._client_id!r} lost its connection while publishing")
        broker._publish(self, message)

    def publish_nowait(self, topic: str, payload: bytes, *, correlation: bytes | None = None) -> None:
        """QoS 0, not retained, routed now; with a latency set, routed when it has passed (and
        lost, as QoS 0 is, if the connection broke meanwhile)."""
        message = self._outbound(topic, payload, False, None, correlation, 0)
        if self.air is not None:
            self._count_out(message, False)
        broker = self._broker
        delay = broker.delay_of(self._client_id) if broker._delays else 0.0
        if not delay:
            broker._publish(self, message)
            return
        connects = self.connects

        def arrive() -> None:
            if self._gate.is_open and self.connects == connects:
                broker._publish(self, message)

        self._clock.call_later(delay, arrive)

    def _count_out(self, message: InboundMessage, expiry: bool) -> None:
        assert self.air is not None
        self.air.publish_out(self._clock.monotonic(), _packet_bytes(message, expiry), message.qos)

    def link_bytes(self) -> TcpCounters | None:
        """The modelled bytes of this client's connections (None without a model)."""
        return None if self.air is None else self.air.total(self._clock.monotonic())

    async def subscribe(self, topic_filter: str, handler: Handler, *, qos: int = 1) -> None:
        topics.validate_filter(topic_filter)
        self._subs[topic_filter] = (handler, qos)
        if self._gate.is_open:
            self._broker._subscribe(self, topic_filter, qos)

    async def unsubscribe(self, topic_filter: str) -> None:
        self._subs.pop(topic_filter, None)
        session = self._broker._sessions.get(self._client_id)
        if session is not None and session.client is self:
            self._broker._unsubscribe(session, topic_filter)

    # -- connection ------------------------------------------------------------------------
    def _try_connect(self) -> None:
        if not self._started or self._gate.is_open:
            return
        if not self._broker.reachable(self._client_id):
            self._broker._waiting[self._client_id] = self
            return
        self._broker._connect(self)
        self.connects += 1
        if self.air is not None:
            self.air.connected(self._clock.monotonic())
        for topic_filter, (_, qos) in self._subs.items():
            self._broker._subscribe(self, topic_filter, qos)
        if self.birth is not None:
            self._broker._publish(self, _as_message(self.birth))
        self._gate.open()

    def _schedule_reconnect(self) -> None:
        if not self._started:
            return
        delay = self._rng.uniform(0.0, self._jitter_s) if self._jitter_s else 0.0
        self._clock.call_later(delay, self._try_connect)

    def _lost(self, reason: str, *, reconnect: bool = True) -> None:
        """Called by the broker when the connection breaks under us."""
        log.debug("%s: connection lost: %s", self._client_id, reason)
        self._gate.close()
        if self.air is not None:
            self.air.ended(self._clock.monotonic())
        if not reconnect:
            self._started = False
            task, self._dispatcher = self._dispatcher, None
            if task is not None:
                task.cancel()
            self._close_unstarted()
            self._queue.clear()
            return
        if self._broker.reachable(self._client_id):
            self._schedule_reconnect()
        else:
            self._broker._waiting[self._client_id] = self

    # -- dispatch --------------------------------------------------------------------------
    def _enqueue(self, sub_filter: str, message: InboundMessage) -> None:
        if self.air is not None:
            self.air.publish_in(self._clock.monotonic(), _packet_bytes(message), message.qos)
        self._queue.append((sub_filter, message))
        self._wake()

    def _wake(self) -> None:
        """Ask the broker for a hand-over, unless one is coming or the dispatch task runs."""
        if self._dispatcher is None and not self._ready and self._started:
            self._ready = True
            self._broker._ready(self)

    def _hand_over(self) -> None:
        """Called by the broker once per loop turn while deliveries wait: run the handlers on
        the queue in order, until one returns something to await (the dispatch task then
        awaits it and goes on with the rest)."""
        self._ready = False
        if self._dispatcher is not None:
            return
        waiting = self._handle_until_pending()
        if waiting is not None:
            self._unstarted = waiting[0]
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch(waiting))

    def _handle_until_pending(self) -> tuple[Awaitable[None], str] | None:
        """Hand queued messages to their handlers in arrival order; stop at the first handler
        that returns something to await: that and its filter (None: the queue is empty)."""
        queue = self._queue
        subs = self._subs
        while queue and self._started:
            sub_filter, message = queue.popleft()
            entry = subs.get(sub_filter)
            if entry is None:
                continue
            try:
                pending = entry[0](message)
            except Exception:
                log.exception("%s: handler for %r failed", self._client_id, sub_filter)
                continue
            if pending is not None:
                return pending, sub_filter
        return None

    async def _dispatch(self, waiting: tuple[Awaitable[None], str]) -> None:
        """Await a handler's unfinished work, then hand over the rest of the queue the same
        way; ends when the queue is empty."""
        me = self._dispatcher
        self._unstarted = None
        try:
            next_waiting: tuple[Awaitable[None], str] | None = waiting
            while next_waiting is not None:
                pending, sub_filter = next_waiting
                try:
                    await pending
                except Exception:
                    log.exception("%s: handler for %r failed", self._client_id, sub_filter)
                next_waiting = self._handle_until_pending()
        finally:
            if self._dispatcher is me:
                self._dispatcher = None

    def _close_unstarted(self) -> None:
        """A dispatch task cancelled before its first step never awaits its first handler's
        coroutine: close it (it was never started either)."""
        unstarted, self._unstarted = self._unstarted, None
        if inspect.iscoroutine(unstarted):
            unstarted.close()

    async def _stop_dispatcher(self) -> None:
        task, self._dispatcher = self._dispatcher, None
        self._queue.clear()
        if task is not None and task is not asyncio.current_task():
            try:
                await cancel_and_wait(task)
            finally:
                self._close_unstarted()


__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "DEFAULT_MAX_QUEUED_PER_SESSION",
    "BrokerStats",
    "MemoryBroker",
    "MemoryTransport",
]
