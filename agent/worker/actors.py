"""The worker agent's actors: heartbeats, telemetry, and the job worker.

    HeartbeatActor   every `interval_s` of the Clock (`fast_interval_s` while an update runs or the
                     leader asks): one Heartbeat, straight to the leader when it answers, else
                     into the outbox with the key "heartbeat" and OVERWRITE, so an offline device
                     holds one pending heartbeat. Full when something changed, else short; it
                     carries the job worker's demand window: one uplink message per interval.
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
    FULL_HEARTBEAT_WANTED,
    KIND_HEARTBEAT,
    KIND_JOB_RESULT,
    KIND_TELEMETRY,
    AppState,
    ConfigState,
    DeviceHealth,
    Heartbeat,
    HeartbeatPace,
    JobDemand,
    JobOffer,
    JobResult,
    SlotState,
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
HEARTBEAT_WIRE = 3  # the demand rides on heartbeats; interval_s and short heartbeats (`Heartbeat.wire`)
HEALTH_EVERY_S = 3600.0  # a short heartbeat carries the device's health count once per operating hour


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


@dataclass(frozen=True, slots=True)
class Cadence:
    """When a worker heartbeats (`[heartbeat]`): every `interval_s` while idle, every
    `fast_interval_s` while it matters (an update running, the leader asking); the system sample
    every `system_interval_s`, or sooner when cpu, memory or disk moved `sample_change_pct`
    points since the last one sent."""

    interval_s: float = 300.0
    fast_interval_s: float = 5.0
    system_interval_s: float = 900.0
    sample_change_pct: float = 10.0


@dataclass(frozen=True, slots=True)
class Pace:
    """Heartbeat every `interval_s` (never faster than the cadence's `fast_interval_s`) for the
    next `for_s` seconds, starting with one heartbeat now: an update is running, or the leader
    asked (`HeartbeatPace`)."""

    interval_s: float
    for_s: float


def _moved(sample: SystemSample, last: SystemSample | None, points: float) -> bool:
    """Whether cpu, memory or disk use moved `points` percentage points since `last`."""
    if last is None:
        return True
    for now, then in ((sample.cpu_percent, last.cpu_percent), (sample.mem_percent, last.mem_percent),
                      (sample.disk_percent, last.disk_percent)):
        if (now is None) != (then is None) or (now is not None and then is not None and abs(now - then) >= points):
            return True
    return False


class HeartbeatActor(Actor):
    """One heartbeat per interval of the `Cadence` (ticks on the Clock), sent straight to the
    leader when it answers (`tell_reliable`): an online device writes nothing to flash for its
    heartbeats. When the direct send fails or is not answered in time, the heartbeat is the
    outbox's OVERWRITE row (an offline device holds exactly one, the newest).

    Each heartbeat says when the next one is due (`interval_s`), so the leader's deadline follows
    the pace. It is full (everything) at the start, after a reconnect, after one went to the
    outbox, when its state changed (version, tags, job demand, slots, configuration targets) or when
    the leader asks; otherwise
    short: seq, uptime, the outbox depth if it changed, the system sample if it is due, the health
    count (`DeviceHealth`) each operating hour or when an unexpected restart was counted."""

    def __init__(
        self, *, device_id: str, outbox: KeyedOutbox, ids: IdGenerator, cadence: Cadence, incarnation: int,
        firmware_version: Callable[[], str], tags: tuple[str, ...] = (),
        sampler: Callable[[], SystemSample] | None = None, boot: str = "",
        outbox_pending: Callable[[], int] | None = None, link: DirectLink, direct_backoff_s: float = 0.0,
        demand: Callable[[], JobDemand] | None = None, slots: Callable[[], SlotState | None] | None = None,
        configs: Callable[[], dict[str, ConfigState] | None] | None = None,
        apps: Callable[[], dict[str, AppState] | None] | None = None,
        facts: Callable[[], dict[str, str] | None] | None = None,
        health: Callable[[str], DeviceHealth | None] | None = None,
    ) -> None:
        self.device_id = device_id
        self._health = health
        self._health_said: tuple[int, int] | None = None  # (restarts, operating hours) last sent
        self._demand = demand
        self._slots = slots
        self._configs = configs
        self._apps = apps
        self._facts = facts
        self._link = link
        self._backoff_s = direct_backoff_s
        self._direct: DirectFirst | None = None
        self._held = False  # a heartbeat went to the outbox and may still wait there
        self.direct = 0  # heartbeats the leader answered without the outbox
        self.boot = boot
        self._outbox_pending = outbox_pending
        self._outbox = outbox
        self._ids = ids
        self.cadence = cadence
        self._seq_base = incarnation * SEQ_PER_INCARNATION
        self._firmware_version = firmware_version
        self._tags = tags
        self._sampler = sampler
        self._count = 0
        self._timer: TimerHandle | None = None
        self._tick = 0  # the generation of the one scheduled tick (a rescheduled one is dropped)
        self._started_at = 0.0
        self._fast_until = 0.0  # monotonic: fast until then
        self._fast_s = cadence.fast_interval_s
        self._full_wanted = True
        self._stated: tuple[object, ...] | None = None  # what the last full heartbeat stated
        self._sample: SystemSample | None = None  # the last sample sent, and when
        self._sample_at = 0.0
        self._pending: int | None = None  # the outbox depth last reported
        self.sent = 0
        self.short = 0  # heartbeats sent short
        self.coalesced = 0  # enqueues that replaced (or lost to) a pending heartbeat
        self.failed = 0

    async def on_start(self, ctx: Context) -> None:
        self._direct = DirectFirst(ctx.clock, backoff_s=self._backoff_s)
        self._started_at = ctx.clock.monotonic()
        self._schedule(ctx, 0.0)

    async def on_stop(self, ctx: Context) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self, ctx: Context, delay_s: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._tick += 1
        n = self._tick
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

    def next_interval_s(self, clock: Clock) -> float:
        """Seconds to the next heartbeat: the pace's while one holds, else the idle interval."""
        if self._fast_until > clock.monotonic():
            return min(self._fast_s, self.cadence.interval_s)
        return self.cadence.interval_s

    def heartbeat(self, clock: Clock, *, next_s: float | None = None) -> Heartbeat:
        """The next heartbeat: full or short (see the class), announcing `next_s`."""
        self._count += 1
        now = clock.monotonic()
        firmware = self._firmware_version()
        demand = self._demand() if self._demand is not None else None
        slots = self._slots() if self._slots is not None else None
        configs = self._configs() if self._configs is not None else None
        apps = self._apps() if self._apps is not None else None
        facts = self._facts() if self._facts is not None else None
        stated = (firmware, self._tags, self.boot, demand, slots, configs, apps, facts)
        pending = self._outbox_pending() if self._outbox_pending is not None else None
        sample = self._sampler() if self._sampler is not None else None
        full = self._full_wanted or stated != self._stated
        due = sample is not None and (full or now - self._sample_at >= self.cadence.system_interval_s
                                      or _moved(sample, self._sample, self.cadence.sample_change_pct))
        if due:
            self._sample, self._sample_at = sample, now
        seq = self._seq_base + self._count
        uptime = max(0.0, now - self._started_at)
        interval = next_s if next_s is not None else self.next_interval_s(clock)
        health = self._health(firmware) if self._health is not None else None
        said = (health.unexpected_restarts, int(health.operating_s // HEALTH_EVERY_S)) if health is not None else None
        if full:
            self._stated, self._pending, self._health_said = stated, pending, said
            return Heartbeat(
                device_id=self.device_id, seq=seq, uptime_s=uptime, firmware_version=firmware, tags=self._tags,
                sample=sample, boot=self.boot, outbox_pending=pending, wire=HEARTBEAT_WIRE, demand=demand,
                interval_s=interval, slots=slots, configs=configs, apps=apps, facts=facts, health=health,
            )
        changed = pending if pending != self._pending else None
        self._pending = pending
        if said == self._health_said:  # (a short heartbeat says the count each operating hour)
            health = None
        else:
            self._health_said = said
        return Heartbeat(device_id=self.device_id, seq=seq, uptime_s=uptime, sample=sample if due else None,
                         outbox_pending=changed, wire=HEARTBEAT_WIRE, interval_s=interval, full=False,
                         health=health)

    async def receive(self, message: object, ctx: Context) -> object | None:
        if isinstance(message, _Tick):
            if message.n != self._tick:
                return None  # rescheduled since: a newer tick is on its way
        elif isinstance(message, (Pace, HeartbeatPace)):
            fast = max(message.interval_s, self.cadence.fast_interval_s)
            until = ctx.clock.monotonic() + message.for_s
            if self._fast_until > ctx.clock.monotonic():  # a pace holds: the faster, the longer
                fast = min(fast, self._fast_s)
                until = max(until, self._fast_until)
            was = self.next_interval_s(ctx.clock)
            self._fast_s, self._fast_until = fast, until
            if isinstance(message, Pace) and was <= self.next_interval_s(ctx.clock):
                return None  # the updater's, already this fast: the next beat comes on time
            # the leader's ask is answered with a beat now (a soak hears from the device after it began)
        elif isinstance(message, BeatNow):
            self._full_wanted = True
        else:
            return None
        next_s = self.next_interval_s(ctx.clock)
        self._schedule(ctx, next_s)
        hb = self.heartbeat(ctx.clock, next_s=next_s)
        if not hb.full:
            self.short += 1
        msg = outbox_message(self._ids, self.device_id, hb, key=HEARTBEAT_KEY, overwrite=True, seq=hb.seq)
        assert self._direct is not None  # (made on start)
        if isinstance(message, BeatNow):  # connected again: no need to wait out the back-off
            self._direct.reset()
        try:
            path, result, answer = await self._direct.send(self._link, envelope_of(msg, ctx.clock),
                                                           outbox=self._outbox, msg=msg)
        except StoreError as exc:  # disk full, I/O: the next beat tries again
            self.failed += 1
            self._full_wanted = True
            log.warning("heartbeat %d not stored: %s", hb.seq, exc)
            return None
        self.sent += 1
        if path == "direct":
            self.direct += 1
            self._full_wanted = False
            if answer == FULL_HEARTBEAT_WANTED:  # the leader holds no full one of ours (it restarted)
                self._full_wanted = True
                self._schedule(ctx, 0.0)
            if self._held:  # the one the outbox holds is older than what the leader just took
                self._held = False
                with contextlib.suppress(StoreError):
                    self.coalesced += await self._outbox.supersede(self.device_id, LEADER, HEARTBEAT_KEY, hb.seq)
        else:
            self._held = True
            self._full_wanted = True  # a later short one would replace this one in the outbox
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
    "Cadence",
    "DirectLink",
    "HeartbeatActor",
    "JobHandler",
    "KeyedOutbox",
    "JobWorker",
    "Outbox",
    "Pace",
    "RecordTelemetry",
    "TelemetryActor",
    "envelope_of",
    "outbox_message",
]
