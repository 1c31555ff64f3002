"""Remote actor messaging over any `Transport`: an envelope out, a `Reply` for its id back.

`EnvelopeSender.deliver` publishes an `Envelope` with an MQTT v5 response topic and correlation
data (the envelope id) and waits for the receiver's `Reply`, mapping it to the relay's typed
outcomes: `accepted` returns, `busy` raises `Capacity(retry_after_ms)`, `rejected` raises
`Permanent(reason)`; no answer in time, not connected, or a disconnect while waiting raise
`Transient`. One subscription serves every delivery in flight: replies are matched to waiting
futures by correlation id, with no task per message.

`EnvelopeInbox` is the receiving side: it decodes each envelope (undecodable or oversized
payloads, and on a device's `up` topic a sender other than that device, are answered `rejected`
and reported to `on_rejected` for dead-lettering), hands it to the handler and publishes the
handler's `Reply` to the response topic, at QoS 0 by default: a reply is only useful to a sender
still waiting on the same connection (the sender fails its pending deliveries when its link
drops, so a reply the broker kept for its session would arrive as a late reply), and a lost one
is what the sender's timeout already covers, the envelope being redelivered and deduplicated.
A failing handler never crashes the inbox: the sender is told `busy` with a short retry_after
and the failure is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agent.core.clock import Clock, SystemClock
from agent.core.codec import Envelope, Reply, decode_envelope, decode_reply, encode
from agent.core.errors import (
    Capacity,
    CodecError,
    Permanent,
    Transient,
    TransportError,
)
from agent.core.gate import Gate
from agent.core.ratelog import RateLimitedLog
from agent.core.tasks import cancel_and_wait
from agent.outbox.types import OutboxRow
from agent.transport import topics
from agent.transport._deadlines import Deadlines
from agent.transport.base import InboundMessage, PayloadTooLarge, Transport

log = logging.getLogger(__name__)

# A handler answers at once (a Reply) or later (an awaitable of one: an `async def` handler).
InboxHandler = Callable[[Envelope, InboundMessage], Reply | Awaitable[Reply]]
RejectSink = Callable[[str, bytes, str], object]  # (reason, raw payload, topic); may be async

_LOST = object()
_EXPIRED = object()
# A message whose handler has not answered yet, for an inbox worker: (message, envelope, answer).
_Unfinished = tuple[InboundMessage, Envelope, Awaitable[Reply]]
_DEVICE_CACHE = 65536  # topics whose device id the inbox remembers
# How long an answer waits for the connection to be up before it is given up (the sender
# times out and retries, the receiver deduplicates).
REPLY_WAIT_S = 10.0
LOG_INTERVAL_S = 60.0  # per-message problems: one line per kind per interval, the rest at DEBUG


def envelope_from_row(row: OutboxRow) -> Envelope:
    """The wire envelope for an outbox row (its id, owner as sender, remaining ttl)."""
    ttl_ms = None
    if row.expires_at_ms is not None:
        ttl_ms = max(0, row.expires_at_ms - row.created_at_ms)
    return Envelope(
        id=row.msg_id,
        kind=row.kind,
        sender=row.owner,
        receiver=row.receiver,
        key=row.key,
        conflict=row.conflict,
        seq=row.seq,
        ts_ms=row.created_at_ms,
        ttl_ms=ttl_ms,
        payload=row.payload,
    )


@dataclass(slots=True)
class SenderStats:
    sent: int = 0
    accepted: int = 0
    busy: int = 0
    rejected: int = 0
    timeouts: int = 0
    lost: int = 0  # in flight when the connection went away, or not connected at all
    late_replies: int = 0  # a reply for nothing in flight (after a timeout, or a duplicate)
    foreign_replies: int = 0  # a reply from another device than the one the envelope went to


class EnvelopeSender:
    """Publishes envelopes and awaits their replies on one reply topic.

    With `per_receiver=True` (the leader, sending to many devices) each envelope asks for its
    reply on `{reply_topic}/{receiver}`, the one sub-topic of the reply topic the broker's ACL
    lets that receiver write, and a reply arriving on another receiver's sub-topic is ignored
    (counted in `foreign_replies`): one device cannot answer for another. Every exit of
    `deliver` after `_receiver_of` is set goes through the `finally` that drops it."""

    def __init__(self, transport: Transport, *, clock: Clock, reply_topic: str, timeout_s: float = 10.0,
                 per_receiver: bool = False) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        topics.validate_topic(reply_topic)
        self._transport = transport
        self._clock = clock
        self._reply_topic = reply_topic
        self._per_receiver = per_receiver
        self._subscription = f"{reply_topic}/+" if per_receiver else reply_topic
        self._timeout_s = timeout_s
        self._pending: dict[bytes, asyncio.Future[object]] = {}
        self._receiver_of: dict[bytes, str] = {}  # per_receiver: who may answer each envelope
        # Reply deadlines, swept by one timer (not a timeout per delivery).
        self._deadlines: Deadlines[object] = Deadlines(clock, timeout_s, lambda f: f.set_result(_EXPIRED))
        self._started = False
        self.stats = SenderStats()
        # open once a receiver accepted an envelope of this sender: the far end is up and answers
        self.answered = Gate()

    @property
    def reply_topic(self) -> str:
        return self._reply_topic

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def start(self) -> None:
        """Subscribe to the reply topic. Call before (or after) the transport starts."""
        if self._started:
            return
        self._started = True
        self._transport.connected.add_listener(self._on_gate)
        await self._transport.subscribe(self._subscription, self._on_reply)

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        self._transport.connected.remove_listener(self._on_gate)
        self._fail_pending()
        self._deadlines.clear()
        try:
            await self._transport.unsubscribe(self._subscription)
        except TransportError as exc:
            log.debug("reply topic %r not unsubscribed: %s", self._subscription, exc)

    async def __aenter__(self) -> EnvelopeSender:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def for_rows(self, topic_for: Callable[[str], str]) -> Callable[[OutboxRow], Awaitable[None]]:
        """A relay `Deliver`: each row goes as an envelope to `topic_for(row.receiver)`."""

        async def deliver(row: OutboxRow) -> None:
            await self.deliver(envelope_from_row(row), topic_for(row.receiver))

        return deliver

    async def deliver(self, envelope: Envelope, topic: str) -> str:
        """Send one envelope and wait for its reply: the accepted reply's reason ("" mostly; the
        leader says `ALREADY_STORED` of a message it held before); raises Capacity, Permanent
        or Transient."""
        return (await self._accepted(envelope, topic)).reason

    async def request(self, envelope: Envelope, topic: str) -> bytes:
        """As `deliver`, for an answer with a payload: the accepted reply's body."""
        return (await self._accepted(envelope, topic)).body

    async def _accepted(self, envelope: Envelope, topic: str) -> Reply:
        if not self._started:
            raise Transient("sender is not started")
        data = encode(envelope)
        limit = self._transport.max_payload_bytes
        if len(data) > limit:
            self.stats.rejected += 1
            raise Permanent(f"envelope {envelope.id} is {len(data)} bytes, over the {limit} limit")
        correlation = envelope.id.encode("utf-8")
        if correlation in self._pending:
            raise Transient(f"envelope {envelope.id} is already in flight")
        expiry_s: int | None = None
        if envelope.ttl_ms:  # what the broker may hold for an offline receiver: no stale command
            left_ms = envelope.ts_ms + envelope.ttl_ms - self._clock.now_ms()
            if left_ms <= 0:
                self.stats.rejected += 1
                raise Permanent(f"envelope {envelope.id} expired before it was sent")
            expiry_s = min(2**32 - 1, -(-left_ms // 1000))
        reply_topic = self._reply_topic
        if self._per_receiver:
            try:
                reply_topic = topics.reply_from(reply_topic, envelope.receiver)
            except topics.TopicError as exc:
                self.stats.rejected += 1
                raise Permanent(f"envelope {envelope.id}: no reply topic for receiver {envelope.receiver!r}: {exc}"
                                ) from None
            self._receiver_of[correlation] = envelope.receiver
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._pending[correlation] = future
        try:
            try:
                if expiry_s is None:
                    await self._transport.publish(topic, data, qos=1, response_topic=reply_topic,
                                                  correlation=correlation)
                else:
                    await self._transport.publish(topic, data, qos=1, response_topic=reply_topic,
                                                  correlation=correlation, expiry_s=expiry_s)
            except (PayloadTooLarge, topics.TopicError) as exc:
                self.stats.rejected += 1
                raise Permanent(str(exc)) from None
            except TransportError as exc:
                self.stats.lost += 1
                raise Transient(f"envelope {envelope.id} not sent: {exc}") from None
            self.stats.sent += 1
            self._deadlines.add(future)
            outcome = await future
        finally:
            if not future.done():
                future.cancel()
            if self._pending.get(correlation) is future:
                del self._pending[correlation]
                self._receiver_of.pop(correlation, None)
        if outcome is _EXPIRED:
            self.stats.timeouts += 1
            raise Transient(f"no reply for envelope {envelope.id} within {self._timeout_s}s")
        if outcome is _LOST:
            self.stats.lost += 1
            raise Transient(f"connection lost waiting for the reply to {envelope.id}")
        assert isinstance(outcome, Reply)
        if outcome.status == "accepted":
            self.stats.accepted += 1
            if not self.answered.is_open:
                self.answered.open()
            return outcome
        if outcome.status == "busy":
            self.stats.busy += 1
            raise Capacity(outcome.reason or f"{envelope.receiver} is busy", outcome.retry_after_ms)
        self.stats.rejected += 1
        raise Permanent(outcome.reason or f"{envelope.receiver} rejected {envelope.id}")

    def _on_reply(self, message: InboundMessage) -> None:
        correlation = message.correlation
        future = self._pending.get(correlation) if correlation is not None else None
        if future is None or future.done():
            self.stats.late_replies += 1
            return
        if self._per_receiver and message.topic.rpartition("/")[2] != self._receiver_of.get(correlation or b""):
            self.stats.foreign_replies += 1
            log.debug("ignored a reply on %s: not from the device the envelope went to", message.topic)
            return
        try:
            reply = decode_reply(message.payload)
        except CodecError as exc:
            log.warning("undecodable reply on %s: %s", message.topic, exc)
            future.set_result(_LOST)
            return
        future.set_result(reply)
        self._deadlines.drop_done()

    def _on_gate(self, is_open: bool) -> None:
        if not is_open:
            self._fail_pending()

    def _fail_pending(self) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_result(_LOST)


@dataclass(slots=True)
class InboxStats:
    received: int = 0
    accepted: int = 0
    busy: int = 0
    rejected: int = 0
    handler_errors: int = 0
    reply_failures: int = 0
    retained_ignored: int = 0  # requests the broker kept retained from before the subscription


class EnvelopeInbox:
    """Receives envelopes on `topic_filter`, answers each with the handler's `Reply`.

    A handler that answers at once (returns a `Reply`, as the leader does for heartbeats) is
    answered in the same step, at QoS 0 with `publish_nowait`: no task, no queue. An answer the
    handler must wait for (it returns an awaitable) is awaited in arrival order with
    `concurrency` 1; a higher value hands it to that many long-lived workers (not a task per
    message), so answers that wait for a commit overlap.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        topic_filter: str,
        handler: InboxHandler,
        max_payload_bytes: int | None = None,
        on_rejected: RejectSink | None = None,
        sender_check: bool = True,
        busy_retry_after_ms: int = 200,
        concurrency: int = 1,
        reply_qos: int = 0,
        clock: Clock | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if reply_qos not in (0, 1):
            raise ValueError("reply_qos must be 0 or 1")
        topics.validate_filter(topic_filter)
        self._transport = transport
        self.topic_filter = topic_filter
        self._handler = handler
        self._max_payload = max_payload_bytes or transport.max_payload_bytes
        self._on_rejected = on_rejected
        self._sender_check = sender_check
        self._busy_retry_after_ms = busy_retry_after_ms
        self._concurrency = concurrency
        self._reply_qos = reply_qos
        self._devices: dict[str, str | None] = {}
        self._clock = clock if clock is not None else SystemClock()
        self._log_limit = RateLimitedLog(log, self._clock, LOG_INTERVAL_S)
        self._queue: asyncio.Queue[_Unfinished] | None = None
        self._workers: list[asyncio.Task[None]] = []
        self._started = False
        self.stats = InboxStats()

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        if self._concurrency > 1:
            self._queue = asyncio.Queue(maxsize=self._concurrency * 4)
            loop = asyncio.get_running_loop()
            name = f"inbox:{self.topic_filter}"
            self._workers = [loop.create_task(self._worker(), name=f"{name}:{i}") for i in range(self._concurrency)]
        await self._transport.subscribe(self.topic_filter, self._receive)

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        try:
            await self._transport.unsubscribe(self.topic_filter)
        except TransportError as exc:
            log.debug("inbox %r not unsubscribed: %s", self.topic_filter, exc)
        workers, self._workers = self._workers, []
        for task in workers:
            task.cancel()
        for task in workers:
            await cancel_and_wait(task)
        queue, self._queue = self._queue, None
        while queue is not None and not queue.empty():
            unanswered = queue.get_nowait()[2]
            if inspect.iscoroutine(unanswered):
                unanswered.close()  # never started: the sender times out and sends it again

    async def __aenter__(self) -> EnvelopeInbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _receive(self, message: InboundMessage, *, to_workers: bool = True) -> Awaitable[None] | None:
        """The subscription's handler: check, decode and hand over one message, and answer it at
        once when the handler did. What waits (a handler's unfinished work, a rejection for the
        dead letters, an answer while disconnected) is returned for the transport to await in
        order, or, with `concurrency` > 1, queued for the workers (backpressure when full)."""
        self.stats.received += 1
        if message.retain:
            # Delivered with the retain flag: the broker kept it from before this subscription
            # (a live publish arrives without it). No request is meant to be retained, and one
            # kept (a device's junk on its own uplink) would be taken again at every start.
            self.stats.retained_ignored += 1
            return None
        checked = self._check(message)
        if not isinstance(checked, Envelope):
            return checked
        envelope = checked
        try:
            outcome = self._handler(envelope, message)
        except Exception:
            outcome = self._handler_failed(envelope)
        if isinstance(outcome, Reply):
            return self._answer_soon(message, outcome)
        queue = self._queue if to_workers else None
        if queue is None:
            return self._finish(message, envelope, outcome)
        item = (message, envelope, outcome)
        if not queue.full():
            queue.put_nowait(item)
            return None
        return queue.put(item)  # backpressure onto the transport's dispatch

    async def _worker(self) -> None:
        queue = self._queue
        assert queue is not None
        while True:
            message, envelope, outcome = await queue.get()
            await self._finish(message, envelope, outcome)

    async def _finish(self, message: InboundMessage, envelope: Envelope, outcome: Awaitable[Reply]) -> None:
        try:
            reply = await outcome
        except Exception:
            reply = self._handler_failed(envelope)
        pending = self._answer_soon(message, reply)
        if pending is not None:
            await pending

    async def handle(self, message: InboundMessage) -> None:
        """Check, decode, hand over and answer one inbound message, all of it before returning.
        Never raises."""
        pending = self._receive(message, to_workers=False)
        if pending is not None:
            await pending

    def _check(self, message: InboundMessage) -> Envelope | Awaitable[None] | None:
        """The message's envelope, or (refused) the rejection still to finish."""
        payload = message.payload
        if self._sender_check and message.response_topic is not None:
            device = self._up_device(message.topic)
            if device is not None and not topics.is_own_reply_topic(message.response_topic, message.topic):
                # Answering would publish where the sender may not (another device's topics).
                reason = f"response topic {message.response_topic!r} is not a reply topic of device {device!r}"
                self._log_limited(logging.WARNING, "reply-topic", f"refused a message on {message.topic}: {reason}")
                return self._reject(message, "", reason, answer=False)
        if len(payload) > self._max_payload:
            reason = f"payload of {len(payload)} bytes exceeds max_payload_bytes={self._max_payload}"
            return self._reject(message, "", reason)
        try:
            envelope = decode_envelope(payload)
        except CodecError as exc:
            return self._reject(message, "", str(exc))
        if self._sender_check:
            device = self._up_device(message.topic)
            if device is not None and envelope.sender != device:
                reason = f"sender {envelope.sender!r} does not match device {device!r} of the topic"
                self._log_limited(logging.WARNING, "forged", f"rejected {envelope.id} on {message.topic}: {reason}")
                return self._reject(message, envelope.id, reason)
        return envelope

    def _handler_failed(self, envelope: Envelope) -> Reply:
        self.stats.handler_errors += 1
        log.exception("handler failed on %s from %s", envelope.id, envelope.sender)
        return Reply(id=envelope.id, status="busy", retry_after_ms=self._busy_retry_after_ms, reason="receiver error")

    def _up_device(self, topic: str) -> str | None:
        """The device of a device's `up` topic, else None (remembered per topic)."""
        try:
            return self._devices[topic]
        except KeyError:
            pass
        parsed = topics.parse(topic)
        device = parsed.device if parsed is not None and parsed.channel == "up" else None
        if len(self._devices) >= _DEVICE_CACHE:
            self._devices.clear()
        self._devices[topic] = device
        return device

    def _reject(self, message: InboundMessage, envelope_id: str, reason: str, *,
                answer: bool = True) -> Awaitable[None] | None:
        """Count, dead-letter and (unless `answer` is False) answer a refused message; what is
        left to await when the dead-letter sink is async or the answer must wait."""
        self.stats.rejected += 1
        result: object = None
        if self._on_rejected is not None:
            try:
                result = self._on_rejected(reason, message.payload, message.topic)
            except Exception:
                log.exception("dead-letter sink failed for a message on %s", message.topic)
        reply = Reply(id=envelope_id, status="rejected", reason=reason)
        if inspect.isawaitable(result):
            return self._reject_later(message, result, reply if answer else None)
        return self._send(message, reply) if answer else None

    async def _reject_later(self, message: InboundMessage, sinking: Awaitable[object], reply: Reply | None) -> None:
        try:
            await sinking
        except Exception:
            log.exception("dead-letter sink failed for a message on %s", message.topic)
        if reply is not None:
            pending = self._send(message, reply)
            if pending is not None:
                await pending

    def _answer_soon(self, message: InboundMessage, reply: Reply) -> Awaitable[None] | None:
        """Count the handler's `reply` and send it (see `_send`)."""
        if reply.status == "accepted":
            self.stats.accepted += 1
        elif reply.status == "busy":
            self.stats.busy += 1
        else:
            self.stats.rejected += 1
        return self._send(message, reply)

    def _send(self, message: InboundMessage, reply: Reply) -> Awaitable[None] | None:
        """Publish `reply` to the response topic: at once at QoS 0 while connected; else the
        publish (or the wait for the connection) is returned, to await."""
        if message.response_topic is None:
            return None
        if self._reply_qos == 0 and self._transport.connected.is_open:
            try:
                self._transport.publish_nowait(message.response_topic, encode(reply), correlation=message.correlation)
            except TransportError as exc:
                self._reply_failed(message, reply, exc)
            return None
        return self._answer(message, reply)

    async def _answer(self, message: InboundMessage, reply: Reply) -> None:
        assert message.response_topic is not None
        if not self._transport.connected.is_open:
            # A persistent session's queued messages arrive right after CONNACK, before the
            # connection is up for us (subscriptions, birth): answer them once it is.
            with contextlib.suppress(TimeoutError):
                await self._clock.wait_for(self._transport.connected.wait_open(), REPLY_WAIT_S)
        try:
            await self._transport.publish(
                message.response_topic, encode(reply), qos=self._reply_qos, correlation=message.correlation
            )
        except TransportError as exc:
            self._reply_failed(message, reply, exc)

    def _reply_failed(self, message: InboundMessage, reply: Reply, exc: TransportError) -> None:
        # The sender times out and retries; the receiver deduplicates by envelope id.
        self.stats.reply_failures += 1
        self._log_limited(logging.INFO, "reply", f"reply {reply.status} to {message.response_topic} not sent: {exc}")

    def _log_limited(self, level: int, key: str, text: str) -> None:
        """A per-message problem: one line per kind per LOG_INTERVAL_S at `level`, the rest at DEBUG."""
        if not self._log_limit.log(level, key, text):
            log.debug(text)


__all__ = [
    "EnvelopeInbox",
    "EnvelopeSender",
    "InboxHandler",
    "InboxStats",
    "RejectSink",
    "SenderStats",
    "envelope_from_row",
]
