"""The leader agent's actors.

    HeartbeatIntake  a bounded mailbox with one slot per device (coalesce key = device id, seq =
                     heartbeat seq): while the actor rests for `process_interval_s`, a newer
                     heartbeat of a device replaces the queued one in place. Each round it drains
                     what is queued and applies it to the registry in one transaction. A newer
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
from typing import Protocol

import msgspec

from agent.actors import Actor, Context
from agent.core.errors import StoreError, UnstorableValue
from agent.leader.jobs import DemandOutcome, Dispatch, JobQueue
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


#: Told of a heartbeat the registry could not store, with the reason (the leader records it).
Refused = Callable[[Heartbeat, str], None]


class DemandSink(Protocol):
    """Where a heartbeat's job demand goes: whether the job queue holds it already, and the
    registration when it does not (to the LeaderActor, which owns the job queue)."""

    def bound(self, demand: JobDemand) -> bool: ...

    def register(self, demand: JobDemand) -> None: ...


@dataclass(frozen=True, slots=True)
class RegisterDemand:
    """A worker's demand window, as its heartbeat carried it (memory only: nothing durable)."""

    demand: JobDemand


class HeartbeatIntake(Actor):
    """Applies coalesced heartbeats to the registry in batches, at its own pace. A heartbeat
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
        self._wake = asyncio.Event()  # ends a rest early: the leader is stopping
        self.stats = IntakeStats()

    async def receive(self, message: object, ctx: Context) -> object | None:
        if not isinstance(message, Heartbeat):
            return None
        self.stats.received += 1
        held = self._batch.get(message.device_id)
        if held is None or message.seq > held.seq:
            self._batch[message.device_id] = message
        if len(self._batch) >= self._batch_max or ctx.self.depth == 0:
            self.flush()
            if self._interval_s > 0 and not self._wake.is_set():
                with contextlib.suppress(TimeoutError):
                    await ctx.clock.wait_for(self._wake.wait(), self._interval_s)
        return None

    def stop_resting(self) -> None:
        """The leader is stopping: take what is queued now instead of resting out the interval."""
        self._wake.set()

    def flush(self) -> None:
        if not self._batch:
            return
        batch = list(self._batch.values())
        self._batch.clear()
        try:
            applied = self._registry.apply_heartbeats(batch)
        except UnstorableValue:
            applied = [self._apply_alone(hb) for hb in batch]
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
        for hb, newer in zip(batch, applied, strict=True):
            demand = hb.demand
            if not newer or demand is None or hb.wire < 2:
                continue
            if demand.worker != hb.device_id:
                self.stats.demand_refused += 1
                continue
            if not self._demand.bound(demand):
                self.stats.demand_registered += 1
                self._demand.register(demand)

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


@dataclass(slots=True)
class Durable:
    """A message whose reply waits for its commit: `done` gets True (new), False (duplicate or
    refused but answered) or an exception."""

    msg_id: str
    sender: str
    message: msgspec.Struct
    done: asyncio.Future[bool]


@dataclass(frozen=True, slots=True)
class WorkersLost:
    """Devices that went offline (last will, heartbeat deadline): end their job bindings."""

    devices: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class SubmitJobs:
    jobs: tuple[JobSubmit, ...]


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
    """Applies durable messages in batches and dispatches jobs after each batch."""

    def __init__(self, registry: DeviceRegistry, jobs: JobQueue, *, dispatch: Dispatcher,
                 batch_max: int = DEFAULT_BATCH_MAX, sinks: MessageSinks | None = None) -> None:
        self._registry = registry
        self._sinks = sinks
        self._jobs = jobs
        self._dispatch = dispatch
        self._batch_max = batch_max
        self._pending: list[Durable] = []
        self.stats = LeaderStats()

    async def on_start(self, ctx: Context) -> None:
        await self._send_offers()  # jobs reloaded after a restart wait for registrations

    async def receive(self, message: object, ctx: Context) -> object | None:
        if isinstance(message, Durable):
            self._pending.append(message)
            if len(self._pending) < self._batch_max and ctx.self.depth > 0:
                return None
            batch, self._pending = self._pending, []
            await self._apply(batch)
        elif isinstance(message, WorkersLost):
            self.lose_workers(message.devices, message.reason)
        elif isinstance(message, RegisterDemand):
            self._register(message.demand)
        elif isinstance(message, SubmitJobs):
            results = self._jobs.submit_many(list(message.jobs))
            await self._send_offers()
            return results
        else:
            return None
        await self._send_offers()
        return None

    def _register(self, demand: JobDemand) -> DemandOutcome:
        outcome = self._jobs.demand(demand)
        self.stats.demands[outcome] = self.stats.demands.get(outcome, 0) + 1
        return outcome

    def lose_workers(self, devices: Sequence[str], reason: str) -> None:
        released = self._jobs.lose_workers(devices)  # one pass, however many workers a fleet loses
        for device, jobs in released.items():
            log.info("worker %s lost (%s): %d jobs back to the pool", device, reason, len(jobs))
            self.stats.jobs_requeued += len(jobs)
        self.stats.workers_lost += len(devices)

    async def _apply(self, batch: list[Durable]) -> None:
        self.stats.batches += 1
        telemetry = [(d.msg_id, d.message) for d in batch if isinstance(d.message, Telemetry)]
        outcome: dict[int, bool | BaseException] = {}
        if telemetry:
            new: Sequence[bool | StoreError]
            try:
                new = self._registry.apply_telemetry_batch(telemetry)  # a refused record: its error
            except UnstorableValue:  # one record cannot be stored: each alone, it fails alone
                new = [self._telemetry_alone(item) for item in telemetry]
            except StoreError as exc:
                new = [exc] * len(telemetry)
            it = iter(new)
            for d in batch:
                if isinstance(d.message, Telemetry):
                    value = next(it)
                    outcome[id(d)] = value
                    if value is True:
                        self.stats.telemetry_new += 1
                    elif value is False:
                        self.stats.telemetry_duplicate += 1
        apps = [d for d in batch if isinstance(d.message, AppMessage)]
        if apps:
            await self._apply_messages(apps, outcome)
        for d in batch:
            if id(d) in outcome:
                continue
            try:
                outcome[id(d)] = self._apply_one(d)
            except StoreError as exc:
                outcome[id(d)] = exc
        for d in batch:
            result = outcome[id(d)]
            if d.done.done():
                continue
            if isinstance(result, BaseException):
                d.done.set_exception(result)
            else:
                d.done.set_result(result)

    async def _apply_messages(self, apps: list[Durable], outcome: dict[int, bool | BaseException]) -> None:
        """Application messages go to the sinks in one batch; a failure answers each busy."""
        result: Sequence[bool | BaseException]
        if self._sinks is None:
            result = [StoreError("this leader takes no application messages")] * len(apps)
        else:
            items = [(d.msg_id, d.message) for d in apps if isinstance(d.message, AppMessage)]
            try:
                result = await self._sinks.apply(items)
            except StoreError as exc:
                log.warning("%d application messages not stored: %s", len(apps), exc)
                result = [exc] * len(apps)
        for d, value in zip(apps, result, strict=True):
            outcome[id(d)] = value

    def _telemetry_alone(self, item: tuple[str, Telemetry]) -> bool | StoreError:
        try:
            return self._registry.apply_telemetry(*item)
        except StoreError as exc:
            return exc

    def _apply_one(self, d: Durable) -> bool:
        msg = d.message
        if isinstance(msg, JobResult):
            ack = self._jobs.result(msg)
            self.stats.results[ack.outcome] = self.stats.results.get(ack.outcome, 0) + 1
            if ack.outcome == "violation":
                log.warning("job result from %s refused: %s", msg.worker, ack.reason)
            return ack.outcome == "confirmed"
        if isinstance(msg, JobDemand):  # a worker of wire 1 (its demand is not on its heartbeats)
            return self._register(msg) != "violation"
        if isinstance(msg, JobSubmit):
            return self._jobs.submit(msg).outcome == "stored"
        if isinstance(msg, Presence):
            self.stats.presence += 1
            changed = self._registry.apply_presence(msg.device_id, msg.status == "online", session=msg.session)
            if msg.status == "offline" and changed:
                self.lose_workers([msg.device_id], "presence")
            return changed
        raise StoreError(f"the leader does not apply {type(msg).__name__} messages")

    async def _send_offers(self) -> None:
        offers = self._jobs.dispatch()
        if offers:
            self.stats.offers_sent += len(offers)
            await self._dispatch(offers)

    async def on_stop(self, ctx: Context) -> None:
        batch, self._pending = self._pending, []
        if batch:
            await self._apply(batch)


__all__ = [
    "DEFAULT_BATCH_MAX",
    "DemandSink",
    "Dispatcher",
    "Durable",
    "HeartbeatIntake",
    "IntakeStats",
    "Refused",
    "RegisterDemand",
    "LeaderActor",
    "LeaderStats",
    "SubmitJobs",
    "WorkersLost",
]
