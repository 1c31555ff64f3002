"""The worker agent's actors: heartbeats, telemetry, and the job worker.

    HeartbeatActor   every `interval_s` of the Clock: one Heartbeat, straight to the leader when
                     it answers, else into the outbox with the key "heartbeat" and OVERWRITE, so
                     an offline device holds one pending heartbeat. It carries the job worker's
                     demand window (wire 2): one uplink message per interval, not two.
    TelemetryActor   one record at a time through `tell_reliable`: straight to the leader when it
                     is reachable and has room, into the outbox otherwise.
    JobWorker        takes JobOffers up to its demand window (bounded mailbox; more is `busy`),
                     runs each once (ledger), confirms only after processing; its demand rides
                     on every heartbeat (and so on the one sent at every reconnect).

Everything durable goes through the outbox as an `OutboxMessage` whose payload is the message's
msgpack encoding; the relay turns a row into an `Envelope` with the row's id, kind, key and seq.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec

from agent.actors import Actor, Context
from agent.core.clock import Clock, TimerHandle
from agent.core.codec import Envelope
from agent.core.errors import EdgeAgentError, StoreError
from agent.core.ids import IdGenerator
from agent.outbox.reliable import DirectFirst
from agent.outbox.types import EnqueueResult, OutboxMessage
from agent.protocol import (
    KIND_HEARTBEAT,
    KIND_JOB_RESULT,
    KIND_TELEMETRY,
    Heartbeat,
    JobDemand,
    JobOffer,
    JobResult,
    SystemSample,
    Telemetry,
    encode_message,
    kind_of,
)
from agent.worker.jobs import DemandWindow, JobLedger

log = logging.getLogger(__name__)

HEARTBEAT_KEY = "heartbeat"
LEADER = "leader"  # the receiver name of everything a worker sends up: whichever leader takes it
SEQ_PER_INCARNATION = 1_000_000_000  # a heartbeat seq is incarnation * this + count
HEARTBEAT_WIRE = 2  # heartbeats carry the job demand (`Heartbeat.wire`)


class Outbox(Protocol):
    async def enqueue(self, msg: OutboxMessage, *, delay_ms: int = 0) -> EnqueueResult: ...


class KeyedOutbox(Outbox, Protocol):
    async def supersede(self, owner: str, receiver: str, key: str, seq: int) -> int: ...


class DirectLink(Protocol):
    """Non-durable, acknowledged sending to the leader (see `agent.worker.agent.LeaderLink`)."""

    def tell(self, message: object, *, coalesce_key: str | None = None, seq: int = 0) -> Awaitable[object]: ...

    async def send(self, message: msgspec.Struct) -> None: ...


@dataclass(frozen=True, slots=True)
class _Tick:
    n: int


@dataclass(frozen=True, slots=True)
class BeatNow:
    """Send a heartbeat now, outside the interval (the connection came back)."""


@dataclass(frozen=True, slots=True)
class RecordTelemetry:
    """Local request: send one telemetry record (`value` and/or `values`)."""

    name: str
    value: float | None = None
    values: dict[str, float] | None = None


def outbox_message(
    ids: IdGenerator, owner: str, message: msgspec.Struct, *, key: str | None = None,
    overwrite: bool = False, seq: int = 0, receiver: str = LEADER,
) -> OutboxMessage:
    """The durable form of `message` (its wire kind is its message class in the outbox)."""
    return OutboxMessage(
        msg_id=ids.next(), owner=owner, receiver=receiver, kind=kind_of(message),
        payload=encode_message(message), key=key, conflict="overwrite" if overwrite else "append",
        seq=seq,
    )


def envelope_of(msg: OutboxMessage, clock: Clock) -> Envelope:
    return Envelope(
        id=msg.msg_id, kind=msg.kind, sender=msg.owner, receiver=msg.receiver, key=msg.key,
        conflict=msg.conflict, seq=msg.seq, ts_ms=clock.now_ms(), payload=msg.payload,
    )


class HeartbeatActor(Actor):
    """One heartbeat per interval (ticks scheduled on the Clock without drift), sent straight to
    the leader when it answers (`tell_reliable`): an online device writes nothing to flash for
    its heartbeats. When the direct send fails or is not answered in time, the heartbeat is the
    outbox's OVERWRITE row (an offline device holds exactly one, the newest). Every beat tries
    the leader first (one message per interval needs no back-off; `direct_backoff_s` can set one;
    a failure while disconnected costs nothing)."""

    def __init__(
        self, *, device_id: str, outbox: KeyedOutbox, ids: IdGenerator, interval_s: float, incarnation: int,
        firmware_version: Callable[[], str], tags: tuple[str, ...] = (),
        sampler: Callable[[], SystemSample] | None = None, boot: str = "",
        outbox_pending: Callable[[], int] | None = None, link: DirectLink, direct_backoff_s: float = 0.0,
        demand: Callable[[], JobDemand] | None = None,
    ) -> None:
        self.device_id = device_id
        self._demand = demand
        self._link = link
        self._backoff_s = direct_backoff_s
        self._direct: DirectFirst | None = None
        self._held = False  # a heartbeat went to the outbox and may still wait there
        self.direct = 0  # heartbeats the leader answered without the outbox
        self.boot = boot
        self._outbox_pending = outbox_pending
        self._outbox = outbox
        self._ids = ids
        self._interval_s = interval_s
        self._seq_base = incarnation * SEQ_PER_INCARNATION
        self._firmware_version = firmware_version
        self._tags = tags
        self._sampler = sampler
        self._count = 0
        self._timer: TimerHandle | None = None
        self._started_at = 0.0
        self._epoch = 0.0
        self.sent = 0
        self.coalesced = 0  # enqueues that replaced (or lost to) a pending heartbeat
        self.failed = 0

    async def on_start(self, ctx: Context) -> None:
        self._direct = DirectFirst(ctx.clock, backoff_s=self._backoff_s)
        self._started_at = self._epoch = ctx.clock.monotonic()
        self._schedule(ctx, 0, 0.0)

    async def on_stop(self, ctx: Context) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self, ctx: Context, n: int, delay_s: float) -> None:
        ref = ctx.self

        def fire() -> None:
            try:
                ref.tell(_Tick(n), coalesce_key="tick", seq=n)
            except EdgeAgentError:  # stopped, or a tick already queued: the next one comes
                pass

        self._timer = ctx.clock.call_later(delay_s, fire)

    @property
    def last_seq(self) -> int:
        """Seq of the newest heartbeat made (the base of this incarnation before the first)."""
        return self._seq_base + self._count

    def heartbeat(self, clock: Clock) -> Heartbeat:
        self._count += 1
        return Heartbeat(
            device_id=self.device_id, seq=self._seq_base + self._count,
            uptime_s=max(0.0, clock.monotonic() - self._started_at),
            firmware_version=self._firmware_version(), tags=self._tags,
            sample=self._sampler() if self._sampler is not None else None, boot=self.boot,
            outbox_pending=self._outbox_pending() if self._outbox_pending is not None else None,
            wire=HEARTBEAT_WIRE, demand=self._demand() if self._demand is not None else None,
        )

    async def receive(self, message: object, ctx: Context) -> object | None:
        if isinstance(message, _Tick):
            n = message.n + 1
            self._schedule(ctx, n, max(0.0, self._epoch + n * self._interval_s - ctx.clock.monotonic()))
        elif not isinstance(message, BeatNow):
            return None
        hb = self.heartbeat(ctx.clock)
        msg = outbox_message(self._ids, self.device_id, hb, key=HEARTBEAT_KEY, overwrite=True, seq=hb.seq)
        assert self._direct is not None  # (made on start)
        if isinstance(message, BeatNow):  # connected again: no need to wait out the back-off
            self._direct.reset()
        try:
            path, result, _ = await self._direct.send(self._link, envelope_of(msg, ctx.clock), outbox=self._outbox,
                                                   msg=msg)
        except StoreError as exc:  # disk full, I/O: the next beat tries again
            self.failed += 1
            log.warning("heartbeat %d not stored: %s", hb.seq, exc)
            return None
        self.sent += 1
        if path == "direct":
            self.direct += 1
            if self._held:  # the one the outbox holds is older than what the leader just took
                self._held = False
                with contextlib.suppress(StoreError):
                    self.coalesced += await self._outbox.supersede(self.device_id, LEADER, HEARTBEAT_KEY, hb.seq)
        else:
            self._held = True
            if result is not None and result.outcome in ("overwritten", "stale"):
                self.coalesced += 1
        return None


class TelemetryActor(Actor):
    """Sends telemetry with `tell_reliable`; after a failed direct try it goes straight to the
    outbox for `direct_backoff_s` (no round trip per record while the leader is away)."""

    def __init__(
        self, *, device_id: str, outbox: Outbox, link: DirectLink, ids: IdGenerator,
        seq_base: int = 0, direct_backoff_s: float = 30.0,
    ) -> None:
        self.device_id = device_id
        self._outbox = outbox
        self._link = link
        self._ids = ids
        self._seq = seq_base
        self._backoff_s = direct_backoff_s
        self._direct: DirectFirst | None = None
        self.direct = 0
        self.stored = 0
        self.failed = 0
        self.sending = 0  # records sent directly, not answered yet (neither counted nor in the outbox)

    async def receive(self, message: object, ctx: Context) -> object | None:
        if isinstance(message, RecordTelemetry):
            self._seq += 1
            record = Telemetry(
                device_id=self.device_id, seq=self._seq, name=message.name, ts_ms=ctx.clock.now_ms(),
                value=message.value, values=message.values,
            )
        elif isinstance(message, Telemetry):
            record = message
        else:
            return None
        msg = outbox_message(self._ids, self.device_id, record, seq=record.seq)
        if self._direct is None:
            self._direct = DirectFirst(ctx.clock, backoff_s=self._backoff_s)
        self.sending += 1
        try:
            path, _, _ = await self._direct.send(self._link, envelope_of(msg, ctx.clock), outbox=self._outbox, msg=msg)
        except EdgeAgentError as exc:
            self.failed += 1
            log.warning("telemetry %s lost: direct and outbox both failed: %s", msg.msg_id, exc)
            raise
        finally:
            self.sending -= 1
        if path == "direct":
            self.direct += 1
        else:
            self.stored += 1
        return path


JobHandler = Callable[[JobOffer], Awaitable[bytes]]


class JobWorker(Actor):
    """Runs offered jobs one at a time, each at most once (the ledger), confirming afterwards.
    Its demand window (`demand()`) is what the heartbeats carry to the leader."""

    def __init__(
        self, *, device_id: str, window: DemandWindow, ledger: JobLedger, outbox: Outbox,
        ids: IdGenerator, handler: JobHandler,
    ) -> None:
        self.device_id = device_id
        self._window = window
        self._ledger = ledger
        self._outbox = outbox
        self._ids = ids
        self._handler = handler
        self.done = 0
        self.duplicates = 0
        self.failures = 0
        self.busy = 0

    def demand(self) -> JobDemand:
        return self._window.demand()

    async def receive(self, message: object, ctx: Context) -> object | None:
        if not isinstance(message, JobOffer):
            return None
        result = self._ledger.result_message(message.job_id, epoch=message.epoch, worker=self.device_id)
        if result is not None:
            self.duplicates += 1
            await self._confirm(result)
            return None
        if self._window.admit(message) != "run":
            return None  # already running (a redelivery while queued): its result follows
        try:
            output = await self._handler(message)
            ok, error = True, ""
        except EdgeAgentError as exc:
            output, ok, error = b"", False, str(exc)
        except Exception as exc:
            output, ok, error = b"", False, f"{type(exc).__name__}: {exc}"
            log.warning("job %s failed: %s", message.job_id, error)
        epoch = self._window.finish(message.job_id)
        self._ledger.complete(message.job_id, ok=ok, result=output, error=error)
        self.done += 1
        if not ok:
            self.failures += 1
        await self._confirm(JobResult(
            job_id=message.job_id, epoch=epoch, worker=self.device_id, ok=ok, result=output, error=error))
        return None

    async def _confirm(self, result: JobResult) -> None:
        key = f"{KIND_JOB_RESULT}:{result.job_id}:{result.epoch}"
        await self._outbox.enqueue(outbox_message(self._ids, self.device_id, result, key=key))


__all__ = [
    "HEARTBEAT_KEY",
    "KIND_HEARTBEAT",
    "KIND_TELEMETRY",
    "LEADER",
    "SEQ_PER_INCARNATION",
    "BeatNow",
    "DirectLink",
    "HeartbeatActor",
    "JobHandler",
    "KeyedOutbox",
    "JobWorker",
    "Outbox",
    "RecordTelemetry",
    "TelemetryActor",
    "envelope_of",
    "outbox_message",
]
