"""The leader agent's actors.

    HeartbeatIntake  a bounded mailbox with one slot per device (coalesce key = device id, seq =
                     heartbeat seq), drained into a batch (a newer heartbeat of a device replaces
                     the held one) applied to the registry in one transaction: at once when the
                     mailbox is empty, or after lingering `process_interval_s` for more. A newer
                     heartbeat whose job demand (wire 2) the job queue does not hold yet goes on
                     to the LeaderActor as a registration; a repeated one costs a dict lookup.
    LeaderActor      telemetry, job demand/results/submissions and presence: applied in batches
                     (one transaction), each message answered only once its change is committed,
                     so an `accepted` reply means the leader's state holds it. After each batch it
                     dispatches pending jobs to workers with free demand, through the leader's
                     outbox (`dispatch` callback).

Both are real actors of the leader's ActorSystem; their mailboxes are bounded and the transport
answers `busy(retry_after_ms)` when they are full.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from agent.actors import Actor, ActorRef, Context
from agent.core.clock import TimerHandle
from agent.core.errors import EdgeAgentError, StoreError, UnstorableValue, store_log_level
from agent.core.ratelog import RateLimitedLog
from agent.leader.jobs import DemandOutcome, Dispatch, JobQueue, ResultAck
from agent.leader.registry import DeviceRegistry
from agent.leader.sinks import MessageSinks
from agent.protocol import AppMessage, Heartbeat, JobDemand, JobResult, JobSubmit, Presence, Telemetry

log = logging.getLogger(__name__)

DEFAULT_BATCH_MAX = 512


@dataclass(slots=True)
class IntakeStats:
    received: int = 0  # heartbeats handed to the actor (after mailbox coalescing)
    applied: int = 0  # newer than the stored one: changed the registry
    stale: int = 0  # not newer than the stored one (late or duplicate)
    batches: int = 0
    largest_batch: int = 0
    refused: int = 0  # could not be stored (each alone; the rest of its batch was)
    demand_registered: int = 0  # heartbeats whose job demand the job queue did not hold yet
    demand_refused: int = 0  # a demand naming another worker than the heartbeat's device
    unstored: int = 0  # dropped because the registry's database failed (the devices beat again)


#: Told of a heartbeat the registry could not store, with the reason (the leader records it).
Refused = Callable[[Heartbeat, str], None]


class DemandSink(Protocol):
    """Where a heartbeat's job demand goes: whether the job queue holds it already, and the
    registration when it does not (to the LeaderActor, which owns the job queue)."""

    def bound(self, demand: JobDemand) -> bool: ...

    def register(self, demands: Sequence[tuple[JobDemand, int]]) -> None: ...


@dataclass(frozen=True, slots=True)
class RegisterDemand:
    """Workers' demand windows, each with the sequence of the heartbeat that carried it (memory
    only on leader.db; posted for the queue's holder on PostgreSQL)."""

    demands: tuple[tuple[JobDemand, int], ...]


@dataclass(frozen=True, slots=True)
class _RestOver:
    """The intake has rested `process_interval_s` since its last write: apply what came meanwhile."""


class HeartbeatIntake(Actor):
    """Applies coalesced heartbeats to the registry in batches: what the mailbox holds when the
    intake gets to it. With `process_interval_s` above 0 it rests that long after each write,
    gathering what comes meanwhile (at most `batch_max`) into the next batch, so that a store
    whose statement costs more than its rows (PostgreSQL) writes fewer, larger batches; the
    mailbox keeps draining into the batch while it rests, so resting never fills it. A heartbeat
    the registry cannot store fails alone: its batch is applied again without it."""

    def __init__(self, registry: DeviceRegistry, *, process_interval_s: float = 0.0,
                 batch_max: int = DEFAULT_BATCH_MAX, on_refused: Refused | None = None,
                 demand: DemandSink | None = None) -> None:
        self._registry = registry
        self._demand = demand
        self._interval_s = process_interval_s
        self._batch_max = batch_max
        self._on_refused = on_refused
        self._batch: dict[str, Heartbeat] = {}
        self._rest: TimerHandle | None = None  # while armed, the intake rests: heartbeats wait in the batch
        self._due = False  # the rest is over and a batch waits
        self.stats = IntakeStats()
        self._failures: RateLimitedLog | None = None  # made with the first message (it needs the clock)

    async def receive(self, message: object, ctx: Context) -> object | None:
        if isinstance(message, Heartbeat):
            self.stats.received += 1
            if self._failures is None:
                self._failures = RateLimitedLog(log, ctx.clock, 30.0)
            held = self._batch.get(message.device_id)
            if held is None or message.seq > held.seq:
                self._batch[message.device_id] = message
        elif not isinstance(message, _RestOver):
            return None
        if self._due or len(self._batch) >= self._batch_max or (self._rest is None and ctx.self.depth == 0):
            self.flush()
            if self._interval_s > 0:
                ref = ctx.self
                self._rest = ctx.clock.call_later(self._interval_s, lambda: self._rested(ref))
        return None

    def _rested(self, ref: ActorRef) -> None:
        self._rest = None
        if self._batch:
            self._due = True
            with contextlib.suppress(EdgeAgentError):  # a full mailbox: its next message finds `_due`
                ref.tell(_RestOver())

    def stop_resting(self) -> None:
        """The leader is stopping: what waits in the batch is applied now (`on_stop` does)."""
        self._due = True

    def flush(self) -> None:
        self._due = False
        if self._rest is not None:
            self._rest.cancel()
            self._rest = None
        if not self._batch:
            return
        batch = list(self._batch.values())
        self._batch.clear()
        try:
            applied = self._registry.apply_heartbeats(batch)
        except UnstorableValue:
            applied = [self._apply_alone(hb) for hb in batch]
        except StoreError as exc:
            # the database failed (PostgreSQL lost, a disk error): each device beats again within
            # its interval, and the actor keeps running for when the database is back
            self.stats.unstored += len(batch)
            if self._failures is not None:
                self._failures.log(store_log_level(exc, logging.WARNING), "store",
                                   f"{len(batch)} heartbeats not applied: {exc}")
            return
        if self._demand is not None:
            self._register_demand(batch, applied)
        n = sum(applied)
        self.stats.applied += n
        self.stats.stale += len(batch) - n
        self.stats.batches += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(batch))

    def _register_demand(self, batch: Sequence[Heartbeat], applied: Sequence[bool]) -> None:
        """Only a heartbeat newer than the stored one registers: a late one from an earlier run
        of the worker must not replace its current binding."""
        assert self._demand is not None
        wanted: list[tuple[JobDemand, int]] = []
        for hb, newer in zip(batch, applied, strict=True):
            demand = hb.demand
            if not newer or demand is None or hb.wire < 2:
                continue
            if demand.worker != hb.device_id:
                self.stats.demand_refused += 1
                continue
            if not self._demand.bound(demand):
                self.stats.demand_registered += 1
                wanted.append((demand, hb.seq))
        if wanted:
            self._demand.register(wanted)

    def _apply_alone(self, hb: Heartbeat) -> bool:
        try:
            return self._registry.apply_heartbeats([hb])[0]
        except UnstorableValue as exc:
            self.stats.refused += 1
            if self._on_refused is not None:
                self._on_refused(hb, str(exc))
            return False

    async def on_stop(self, ctx: Context) -> None:
        try:
            self.flush()
        except StoreError as exc:
            log.warning("heartbeats not applied at stop: %s", exc)


M = TypeVar("M", bound=msgspec.Struct)
#: What applying one durable message gave: True (new), False (a duplicate, or refused but
#: answered), or the error to answer it with.
Applied = bool | BaseException


@dataclass(frozen=True, eq=False)
class DurableKind(Generic[M]):
    """How the LeaderActor applies one kind of durable message, declared where the kind is
    registered (`LeaderAgent.register_durable`): the messages of a batch of this kind together
    (`batch`: one call, one outcome each, in arrival order), or each alone (`one`: in arrival
    order among every kind applied one at a time, after the batched kinds)."""

    name: str
    batch: Callable[[list[tuple[str, M]]], Awaitable[Sequence[Applied]]] | None = None
    one: Callable[[M], bool] | None = None

    def __post_init__(self) -> None:
        if (self.batch is None) == (self.one is None):
            raise ValueError(f"durable kind {self.name!r}: give exactly one of batch and one")


@dataclass(slots=True)
class Durable:
    """A message whose reply waits for its commit: `done` gets True (new), False (duplicate or
    refused but answered) or an exception."""

    msg_id: str
    sender: str
    message: msgspec.Struct
    done: asyncio.Future[bool]
    kind: DurableKind[Any]


@dataclass(frozen=True, slots=True)
class WorkersLost:
    """Devices that went offline (last will, heartbeat deadline): end their job bindings."""

    devices: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class SubmitJobs:
    jobs: tuple[JobSubmit, ...]


@dataclass(frozen=True, slots=True)
class TendJobs:
    """Several leaders on PostgreSQL: keep or take the fleet's job queue (`renew`: its lease is
    due, or was given up), claim what the other leaders posted for it (`posted`: they said so,
    or nobody listens for it), and, on the second's tick (`tick`), end the bindings of the
    workers the registry says went offline."""

    renew: bool
    posted: bool = True
    tick: bool = True


# Leaders' clocks differ: a worker lost by another leader is looked for this far back.
LOST_WORKERS_SKEW_MS = 60_000


@dataclass(slots=True)
class LeaderStats:
    telemetry_new: int = 0
    telemetry_duplicate: int = 0
    results: dict[str, int] = field(default_factory=dict)
    demands: dict[str, int] = field(default_factory=dict)
    presence: int = 0
    workers_lost: int = 0
    jobs_requeued: int = 0
    offers_sent: int = 0
    batches: int = 0


Dispatcher = Callable[[Sequence[Dispatch]], Awaitable[None]]


class LeaderActor(Actor):
    """Applies durable messages in batches and dispatches jobs after each batch. The kinds it
    applies are its attributes (`telemetry`, `app_messages`, `job_results`, `job_demands`,
    `job_submissions`, `presence`), each registered with its route by the leader."""

    def __init__(self, registry: DeviceRegistry, jobs: JobQueue, *, dispatch: Dispatcher,
                 batch_max: int = DEFAULT_BATCH_MAX, sinks: MessageSinks | None = None,
                 on_lost: Callable[[Sequence[str]], None] | None = None) -> None:
        self._registry = registry
        self._on_lost = on_lost
        self._sinks = sinks
        self._jobs = jobs
        self._dispatch = dispatch
        self._batch_max = batch_max
        self._pending: list[Durable] = []
        self._lost_since_ms = 0  # several leaders: the registry's losses looked at from here on
        self.stats = LeaderStats()
        self._failures: RateLimitedLog | None = None  # made at start (it needs the clock)
        self.telemetry = DurableKind[Telemetry]("telemetry", batch=self._apply_telemetry)
        self.app_messages = DurableKind[AppMessage]("app", batch=self._apply_messages)
        self.job_results = DurableKind[JobResult]("job.result", one=self._apply_result)
        # a worker of wire 1 (its demand is not on its heartbeats)
        self.job_demands = DurableKind[JobDemand]("job.demand", one=lambda d: self._register(d) != "violation")
        self.job_submissions = DurableKind[JobSubmit]("job.submit",
                                                      one=lambda j: self._jobs.submit(j).outcome == "stored")
        self.presence = DurableKind[Presence]("presence", one=self._apply_presence)

    async def on_start(self, ctx: Context) -> None:
        self._failures = RateLimitedLog(log, ctx.clock, 30.0)
        await self._send_offers()  # jobs reloaded after a restart wait for registrations

    async def receive(self, message: object, ctx: Context) -> object | None:
        """Durable messages wait for the next ones in the mailbox, up to a batch; the batch is
        applied when the mailbox is empty after any message (a durable one followed by a
        demand or a tend must not wait for the next durable one)."""
        results: object | None = None
        if isinstance(message, Durable):
            self._pending.append(message)
        elif isinstance(message, WorkersLost):
            self.lose_workers(message.devices, message.reason)
        elif isinstance(message, RegisterDemand):
            self._register_many(message.demands)
        elif isinstance(message, TendJobs):
            self._tend_jobs(message, ctx.clock.now_ms())
        elif isinstance(message, SubmitJobs):
            results = self._jobs.submit_many(list(message.jobs))
        else:
            return None
        if self._pending and (len(self._pending) >= self._batch_max or ctx.self.depth == 0):
            batch, self._pending = self._pending, []
            await self._apply(batch)
        await self._send_offers()
        return results

    def _register(self, demand: JobDemand) -> DemandOutcome:
        outcome = self._jobs.demand(demand)
        self.stats.demands[outcome] = self.stats.demands.get(outcome, 0) + 1
        return outcome

    def _register_many(self, demands: Sequence[tuple[JobDemand, int]]) -> None:
        try:
            outcomes = self._jobs.demand_many(demands)
        except StoreError as exc:  # the workers' next full heartbeats carry them again
            if self._failures is not None:
                self._failures.log(store_log_level(exc, logging.WARNING), "jobs",
                                   f"{len(demands)} job demands not registered: {exc}")
            return
        for outcome in outcomes:
            self.stats.demands[outcome] = self.stats.demands.get(outcome, 0) + 1

    def _tend_jobs(self, tend: TendJobs, now_ms: int) -> None:
        jobs = self._jobs
        was = (jobs.held, jobs.epoch)
        try:
            if tend.renew:
                jobs.hold()
            if not jobs.held:
                if was[0]:
                    log.warning("jobs: leader %r runs the fleet's job queue now; this one stands by",
                                jobs.lease_holder)
                return
            taken = was != (jobs.held, jobs.epoch)
            if taken:
                log.info("jobs: this leader runs the fleet's job queue now (epoch %d, %d jobs unconfirmed,"
                         " %d workers)", jobs.epoch, len(jobs.pending_ids()), len(jobs.workers()))
                self._lost_since_ms = 0  # every worker offline now, whenever it went
            if tend.posted or taken:
                jobs.read_demands()
                for ack in jobs.read_results():  # the results the workers gave the other leaders
                    self._counted(ack)
            if not (tend.tick or taken):
                return
            offline = self._registry.offline_since(self._lost_since_ms)
            self._lost_since_ms = now_ms - LOST_WORKERS_SKEW_MS
            bound = jobs.workers()
            lost = [w for w in offline if w in bound]
            if lost:
                self.lose_workers(lost, "offline in the registry")
        except StoreError as exc:
            if self._failures is not None:
                self._failures.log(store_log_level(exc, logging.WARNING), "jobs", f"the job queue not tended: {exc}")

    def lose_workers(self, devices: Sequence[str], reason: str) -> None:
        released = self._jobs.lose_workers(devices)  # one pass, however many workers a fleet loses
        if self._on_lost is not None:
            self._on_lost(devices)
        for device, jobs in released.items():
            log.info("worker %s lost (%s): %d jobs back to the pool", device, reason, len(jobs))
            self.stats.jobs_requeued += len(jobs)
        self.stats.workers_lost += len(devices)

    async def _apply(self, batch: list[Durable]) -> None:
        """The batched kinds first, each in one call; then the others one at a time, in order."""
        self.stats.batches += 1
        outcome: dict[int, Applied] = {}
        together: dict[DurableKind[Any], list[Durable]] = {}
        for d in batch:
            if d.kind.batch is not None:
                together.setdefault(d.kind, []).append(d)
        for kind, items in together.items():
            assert kind.batch is not None
            result: Sequence[Applied]
            try:
                result = await kind.batch([(d.msg_id, d.message) for d in items])
            except StoreError as exc:
                if self._failures is not None:
                    self._failures.log(store_log_level(exc, logging.WARNING), kind.name, f"{len(items)} {kind.name}"
                                       f" messages not applied (answered busy): {exc}")
                result = [exc] * len(items)
            for d, value in zip(items, result, strict=True):
                outcome[id(d)] = value
        for d in batch:
            if id(d) in outcome:
                continue
            assert d.kind.one is not None
            try:
                outcome[id(d)] = d.kind.one(d.message)
            except StoreError as exc:
                outcome[id(d)] = exc
        for d in batch:
            value = outcome[id(d)]
            if d.done.done():
                continue
            if isinstance(value, BaseException):
                d.done.set_exception(value)
            else:
                d.done.set_result(value)

    async def _apply_telemetry(self, items: list[tuple[str, Telemetry]]) -> Sequence[Applied]:
        """One transaction for the batch; a record that cannot be stored fails alone."""
        new: Sequence[bool | StoreError]
        try:
            new = self._registry.apply_telemetry_batch(items)  # a refused record: its error
        except UnstorableValue:  # one record cannot be stored: each alone, it fails alone
            new = [self._telemetry_alone(item) for item in items]
        for value in new:
            if value is True:
                self.stats.telemetry_new += 1
            elif value is False:
                self.stats.telemetry_duplicate += 1
        return new

    async def _apply_messages(self, items: list[tuple[str, AppMessage]]) -> Sequence[Applied]:
        """Application messages go to the sinks in one batch."""
        if self._sinks is None:
            return [StoreError("this leader takes no application messages")] * len(items)
        return await self._sinks.apply(items)

    def _telemetry_alone(self, item: tuple[str, Telemetry]) -> bool | StoreError:
        try:
            return self._registry.apply_telemetry(*item)
        except StoreError as exc:
            return exc

    def _apply_result(self, result: JobResult) -> bool:
        return self._counted(self._jobs.result(result)) == "confirmed"

    def _counted(self, ack: ResultAck) -> str:
        self.stats.results[ack.outcome] = self.stats.results.get(ack.outcome, 0) + 1
        if ack.outcome == "violation":
            log.warning("job result for %s refused: %s", ack.job_id, ack.reason)
        return ack.outcome

    def _apply_presence(self, presence: Presence) -> bool:
        self.stats.presence += 1
        changed = self._registry.apply_presence(presence.device_id, presence.status == "online",
                                                session=presence.session)
        if presence.status == "offline" and changed:
            self.lose_workers([presence.device_id], "presence")
        return changed

    async def _send_offers(self) -> None:
        try:
            offers = self._jobs.dispatch()
        except StoreError as exc:  # taken over by another leader, or the database lost: it stands by
            if self._failures is not None:
                self._failures.log(logging.WARNING, "jobs", f"no job offered: {exc}")
            return
        if offers:
            self.stats.offers_sent += len(offers)
            await self._dispatch(offers)

    async def on_stop(self, ctx: Context) -> None:
        batch, self._pending = self._pending, []
        if batch:
            await self._apply(batch)


__all__ = [
    "DEFAULT_BATCH_MAX",
    "Applied",
    "DemandSink",
    "Dispatcher",
    "Durable",
    "DurableKind",
    "HeartbeatIntake",
    "IntakeStats",
    "Refused",
    "RegisterDemand",
    "LeaderActor",
    "LeaderStats",
    "SubmitJobs",
    "WorkersLost",
]
