"""The leader agent: what runs on the gateway.

    LeaderAgent
    ├── EnvelopeInbox on ea/v1/{fleet}/+/up, or $share/{group}/... with other leaders (sender checked)
    │   ├── heartbeat ──► HeartbeatIntake   (bounded, one slot per device, own pace)
    │   ├── telemetry, job demand/result/submit ──► LeaderActor (bounded, answered after commit)
    │   └── app.CLASS (device applications) ──► LeaderActor ──► MessageSinks: forwarders, leader.db
    │   full mailbox: `busy(retry_after_ms)`; undecodable, forged, oversized: `rejected` + RejectLog
    ├── presence subscription ea/v1/{fleet}/+/presence (retained; last wills) ──► LeaderActor
    ├── heartbeat deadline watcher ──► devices offline, their jobs back to the pool
    ├── Housekeeper: prunes processed ids, confirmed jobs, rollout report ids (agent.housekeeping)
    ├── leader.db, or the fleet's PostgreSQL: DeviceRegistry, JobQueue (epoch-fenced), RejectLog
    ├── several leaders on PostgreSQL: the job queue tended every second (its lease, demands, losses)
    └── OutboxStore ──► Relay ──► EnvelopeSender ──► ea/v1/{fleet}/{worker}/down (job offers)

`LeaderAgent.open(config, transport=..., clock=...)` opens the databases under the data dir;
`start()` / `stop()` as for the worker.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, Unpack

import msgspec

from agent.actors import ActorRef, ActorSystem, MailboxStatistics
from agent.core.clock import Clock
from agent.core.codec import Envelope, Reply
from agent.core.config import AgentConfig, resolve
from agent.core.errors import (
    ActorStopped,
    CodecError,
    EdgeAgentError,
    MailboxFull,
    StoreError,
    StoreUnavailable,
    UnstorableValue,
    store_log_level,
)
from agent.core.ids import IdGenerator
from agent.core.marks import StoreMark
from agent.core.ratelog import RateLimitedLog
from agent.core.reserve import DiskReserve
from agent.core.sql import StoreTarget
from agent.core.sqlite import damage_report, recover_damaged
from agent.core.tasks import cancel_and_wait
from agent.housekeeping import Housekeeper
from agent.leader.actors import (
    Durable,
    DurableKind,
    HeartbeatIntake,
    LeaderActor,
    RegisterDemand,
    SubmitJobs,
    TendJobs,
    WorkersLost,
)
from agent.leader.database import LEADER_DB, shared_database
from agent.leader.housekeeping import RolloutReports, leader_housekeeper
from agent.leader.jobs import Dispatch, JobQueue, QueueStandby, SubmitResult
from agent.leader.messages import MessageLog
from agent.leader.presence import PresenceApplier
from agent.leader.rates import DeviceRates
from agent.leader.registry import DeviceRegistry
from agent.leader.rejects import RejectLog
from agent.leader.sinks import MessageSinks
from agent.outbox.relay import Relay
from agent.outbox.settings import aimd_settings, crash_classes, durability, outbox_classes, retry_policy
from agent.outbox.store import OutboxStore
from agent.outbox.types import OutboxMessage
from agent.protocol import (
    ALREADY_STORED,
    APP_KIND_PREFIX,
    FULL_HEARTBEAT_WANTED,
    KIND_HEARTBEAT,
    KIND_JOB_DEMAND,
    KIND_JOB_RESULT,
    KIND_JOB_SUBMIT,
    KIND_PING,
    KIND_TELEMETRY,
    Heartbeat,
    JobDemand,
    JobResult,
    JobSubmit,
    Ping,
    Presence,
    Telemetry,
    agent_registry,
    decode_app_message,
    encode_message,
    kind_of,
)
from agent.service.parts import Checks, Collectors, Liveness, PartBase
from agent.service.prom import MetricFamily
from agent.transport import topics
from agent.transport.base import InboundMessage, Transport
from agent.transport.endpoint import EnvelopeInbox, EnvelopeSender
from agent.transport.presence import PresenceFormatError, decode_presence

if TYPE_CHECKING:
    from agent.leader.readonly import FleetReader

log = logging.getLogger(__name__)

BUSY_STORE_MS = 1_000  # retry hint when the leader's database failed under a message
# A record stamped further ahead of the leader's clock than this is refused: a device's clock
# may lag (no RTC on a Pi), but a timestamp from the far future would outrank every later one.
MAX_AHEAD_MS = 24 * 3600 * 1000
REJECT_LOG_INTERVAL_S = 60.0
# On PostgreSQL the heartbeat intake rests this long after each write, where a statement costs
# more than its rows (scripts/bench_leaders.py measures what it buys); on leader.db it does not.
POSTGRES_REST_S = 0.1

M = TypeVar("M", bound=msgspec.Struct)

#: Answers one decoded message from a device on the up topic: at once (a Reply) or when what it
#: waits for is done (an awaitable of one).
Route = Callable[[Envelope, msgspec.Struct], Reply | Awaitable[Reply]]


class LeaderOptions(TypedDict, total=False):
    """The optional parts of a `LeaderAgent` that `LeaderAgent.open` passes on."""

    owns_stores: bool
    rng: random.Random | None
    intake_batch_max: int
    inbox_concurrency: int
    housekeeping: bool | None


class LeaderAgent(PartBase):
    """The leader's core part (`agent.service.parts`): its inbox, intake actors, stores and relay."""

    name = "leader"

    def __init__(
        self,
        config: AgentConfig,
        *,
        transport: Transport,
        clock: Clock,
        outbox: OutboxStore,
        registry: DeviceRegistry,
        jobs: JobQueue,
        rejects: RejectLog,
        messages: MessageLog | None = None,
        owns_stores: bool = True,
        rng: random.Random | None = None,
        intake_batch_max: int = 512,
        inbox_concurrency: int = 128,
        housekeeping: bool | None = None,
    ) -> None:
        self.config = config
        self.device_id = config.agent.device_id
        self.fleet = config.agent.fleet
        self.transport = transport
        self.clock = clock
        self.outbox = outbox
        self.registry = registry
        registry.leader = self.device_id  # each device's row says which leader served it last
        self.jobs_queue = jobs
        # this leader's own SQLite file (`open` sets it): its outbox, and without `[leader] database`
        # the fleet's stores too
        self.leader_db = Path(config.agent.data_dir) / LEADER_DB if jobs.on_server else Path(jobs.path)
        self.rejects = rejects
        # Device applications' messages: stored in leader.db, and forwarded where attached.
        self.messages = messages
        self.sinks = MessageSinks(messages) if messages is not None else None
        self._owns_stores = owns_stores
        self._rng = rng if rng is not None else random.Random()
        self.ids = IdGenerator(clock, self._rng)
        self.system = ActorSystem(clock=clock, name=self.device_id)
        # Each device answers on its own sub-topic of the leader's reply topic (the ACL's
        # `.../reply/+/%u`): no device can answer for another.
        self.sender = EnvelopeSender(
            transport, clock=clock, reply_topic=topics.reply(self.fleet, self.device_id, "relay"),
            timeout_s=config.mqtt.reply_timeout_s, per_receiver=True,
        )
        fleet = self.fleet
        self.relay = Relay(
            outbox, self.sender.for_rows(lambda worker: topics.down(fleet, worker)),
            clock=clock, ready=transport.connected,
            partitions=config.relay.partitions, retry=retry_policy(config), limits=aimd_settings(config),
            rng=self._rng, reconnect_jitter_s=config.relay.reconnect_jitter_s, name=f"relay:{self.device_id}",
        )
        up_filter = topics.leader_up_filter(self.fleet, config.leader.shared_group)
        self.inbox = EnvelopeInbox(
            transport, topic_filter=up_filter, handler=self._on_up, on_rejected=self._on_rejected,
            sender_check=True, concurrency=inbox_concurrency, clock=clock,
        )
        self._batch_max = intake_batch_max
        # devices whose certificate was revoked (`agent.leader.enrolment`): every message refused
        self.revoked: set[str] = set()
        self.intake: ActorRef | None = None
        self.leader: ActorRef | None = None
        self._intake_actor: HeartbeatIntake | None = None
        # devices whose full heartbeat this leader took since it started (`Heartbeat.full`): a
        # short one from any other is answered FULL_HEARTBEAT_WANTED (a restarted leader, another
        # leader of the group had it, it lost the worker)
        self._full_heard: set[str] = set()
        # The durable kinds are the LeaderActor's: made here so that each is registered with its route.
        self._leader_actor = LeaderActor(registry, jobs, dispatch=self._send_offers, batch_max=intake_batch_max,
                                         sinks=self.sinks, on_lost=self._full_heard.difference_update)
        self._watcher: asyncio.Task[None] | None = None
        # Whoever owns the stores keeps them from growing for ever (default: this agent if it does).
        self.housekeeping: Housekeeper | None = None
        self._reports: RolloutReports | None = None
        if owns_stores if housekeeping is None else housekeeping:
            self.housekeeping, self._reports = leader_housekeeper(
                config.housekeeping, clock=clock, registry=registry, jobs=jobs, rollout_db=self.rollout_tables,
                name=f"housekeeping:{self.device_id}", messages=messages,
                messages_retention_s=config.messages.retention_s)
        self._started = False
        self._closed = False
        self.refused_forged = 0
        self.busy_answers = 0
        # What the up topic carries: the kinds this agent decodes, and the route of each. The
        # rollout service adds firmware reports and chunk requests the same way.
        self.kinds = agent_registry()
        self._routes: dict[str, Route] = {}
        actor = self._leader_actor
        self.register_route(KIND_HEARTBEAT, Heartbeat, self._heartbeat)
        self.register_route(KIND_PING, Ping, self._ping)
        self.register_durable(KIND_TELEMETRY, Telemetry, actor.telemetry, check=self._not_far_ahead)
        self.register_durable(KIND_JOB_SUBMIT, JobSubmit, actor.job_submissions, check=self._from_operator)
        self.register_durable(KIND_JOB_RESULT, JobResult, actor.job_results)
        self.register_durable(KIND_JOB_DEMAND, JobDemand, actor.job_demands)
        lc = config.leader
        self._operators = frozenset(lc.operators)
        # One line per device and kind (or topic) per minute, with the count of the rest: a
        # device sending junk must not flood the journal.
        self._reject_log = RateLimitedLog(log, clock, REJECT_LOG_INTERVAL_S)
        self._store_log = RateLimitedLog(log, clock, REJECT_LOG_INTERVAL_S)  # the database failing
        self.rates = DeviceRates(clock, rate_per_s=lc.device_rate_per_s, burst=lc.device_burst) \
            if lc.device_rate_per_s > 0 else None
        self.data_dir = Path(config.agent.data_dir)  # where its files live (`open`: where it opened them)
        self.reserve: DiskReserve | None = None  # the disk room kept for a full disk (`open` sets it)
        # where the registry, messages and rejects are (`open` sets it: leader.db or PostgreSQL)
        self.shared: StoreTarget = Path(registry.path)
        self._jobs_task: asyncio.Task[None] | None = None
        self._fleet_reader: FleetReader | None = None  # /metrics' reads of the fleet (the first scrape opens it)
        # the devices' presence changes: each applied, or kept (newest per device) until it can be
        self.presence = PresenceApplier(self._tell_presence, clock)
        self._presence_task: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls, config: AgentConfig, *, transport: Transport, clock: Clock, data_dir: str | Path | None = None,
        recover: bool = False,
        **kwargs: Unpack[LeaderOptions],
    ) -> LeaderAgent:
        base = Path(data_dir if data_dir is not None else config.agent.data_dir)
        base.mkdir(parents=True, exist_ok=True)
        reserve = DiskReserve(base)
        reserve.release_if_full()  # a full disk: room to open the stores and answer busy
        db = base / LEADER_DB
        mark = StoreMark(db)  # the job queue's epoch at the last start (`agent.core.marks`)
        # The fleet's registry, job queue and rollout history: never dropped without being asked.
        if recover:
            if (damaged := recover_damaged(db, now_ms=clock.now_ms(), what="leader")) is not None:
                mark.set_aside(Path(damaged))
        elif (problem := damage_report(db)) is not None:
            raise StoreError(f"{db} is damaged ({problem}): start once with `edge-agent run --recover` to move it"
                             " aside and start with an empty registry, job queue and rollout history")
        if (lost := mark.lost_state("epoch", JobQueue.epoch_in(db))) is not None:
            if not recover:
                raise StoreError(f"{db} lost state: {lost}: start once with `edge-agent run --recover` to move it"
                                 " aside and start with an empty registry, job queue and rollout history")
            dest = mark.move_lost(clock.now_ms())
            log.error("leader: %s lost state (%s); moved aside to %s and started afresh", db, lost, dest)
        shared = shared_database(config, base)  # leader.db, or the fleet's PostgreSQL database
        registry = DeviceRegistry.open(shared, clock=clock, heartbeat_deadline_s=config.leader.heartbeat_deadline_s,
                                       telemetry_names_max=config.leader.telemetry_names_max,
                                       telemetry_durable=durability(config, KIND_TELEMETRY) == "power")
        jobs = rejects = messages = None
        try:
            registry.claim_fleet(config.agent.fleet)
            jobs = JobQueue.open(db if isinstance(shared, Path) else shared, clock=clock,
                                 window_max=config.leader.job_window_max,
                                 synchronous="FULL" if config.outbox.durability == "power" else "NORMAL",
                                 holder=config.agent.device_id, lease_s=config.leader.job_lease_s)
            if not jobs.on_server:
                mark.write("epoch", jobs.epoch)  # its commit was synced
            rejects = RejectLog.open(shared, clock=clock)
            messages = MessageLog.open(shared, clock=clock, max_bytes_per_device=config.messages.max_bytes_per_device,
                                       crash_classes=crash_classes(config))
            outbox = await OutboxStore.open(
                resolve(base, config.outbox.path), clock=clock, durability=config.outbox.durability,
                max_attempts=config.outbox.max_attempts, classes=outbox_classes(config),
            )
        except BaseException:
            registry.close()
            if jobs is not None:
                jobs.close()
            if rejects is not None:
                rejects.close()
            if messages is not None:
                messages.close()
            raise
        leader = cls(config, transport=transport, clock=clock, outbox=outbox, registry=registry, jobs=jobs,
                     rejects=rejects, messages=messages, **kwargs)
        leader.data_dir = base
        leader.leader_db = db
        leader.reserve = reserve
        leader.shared = shared
        return leader

    @property
    def rollout_tables(self) -> StoreTarget:
        """Where the rollout tables live: with the fleet's registry, in its PostgreSQL database
        (several leaders, one orchestrator by a lease), else in this leader's leader.db."""
        return self.registry.target if self.registry.on_server else self.leader_db

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        cfg = self.config
        await self.system.start()
        self._intake_actor = HeartbeatIntake(
            self.registry, process_interval_s=self.process_interval_s, batch_max=self._batch_max,
            on_refused=self._heartbeat_refused, demand=_HeartbeatDemand(self))
        self.intake = self.system.spawn(
            self._intake_actor, name="heartbeats", capacity=cfg.mailbox.capacity, policy="reject",
            stall_s=cfg.mailbox.stall_s)
        self.leader = self.system.spawn(
            self._leader_actor, name="leader", capacity=cfg.mailbox.capacity, policy="reject",
            stall_s=cfg.mailbox.stall_s)
        await self.sender.start()
        await self.inbox.start()
        await self.transport.subscribe(topics.fleet_filter(self.fleet, "presence"), self._on_presence)
        try:
            self.registry.mark_alive()  # a leader of the registry before its presence is out
        except StoreError as exc:
            log.warning("the leader not marked alive yet (its deadline watcher does it): %s", exc)
        await self.transport.start()
        await self.relay.start()
        self._watcher = asyncio.create_task(
            self.registry.watch_deadlines(self._on_deadline), name=f"deadlines:{self.device_id}")
        self._presence_task = asyncio.create_task(self.presence.run(), name=f"presence:{self.device_id}")
        if self.jobs_queue.on_server:
            queue = self.jobs_queue
            log.info("jobs: %s", f"this leader runs the fleet's job queue (epoch {queue.epoch})" if queue.held
                     else f"leader {queue.lease_holder!r} runs the fleet's job queue; this one stands by")
            self._jobs_task = asyncio.create_task(self._tend_jobs(), name=f"job-queue:{self.device_id}")
        if self.housekeeping is not None:
            await self.housekeeping.start()
        if self.reserve is not None:
            self.reserve.start(self.clock)

    async def stop(self) -> None:
        """Stop taking work, hand untried rows back, disconnect, flush and close the stores (a
        leader never started closes its stores alone)."""
        if self._started:
            self._started = False
            await self._stop_running()
        if self._fleet_reader is not None:
            self._fleet_reader.close()
            self._fleet_reader = None
        if self._owns_stores and not self._closed:
            self._closed = True
            await self.outbox.close()
            self.registry.close()
            self.jobs_queue.close()
            self.rejects.close()
            if self.messages is not None:
                self.messages.close()

    async def _stop_running(self) -> None:
        if self.reserve is not None:
            await self.reserve.stop()
        if self.housekeeping is not None:
            await self.housekeeping.stop()
        if self._reports is not None:
            self._reports.close()
        await cancel_and_wait(self._watcher)
        await cancel_and_wait(self._presence_task)
        await cancel_and_wait(self._jobs_task)
        self._jobs_task = None
        await self.inbox.stop()
        if self._intake_actor is not None:
            self._intake_actor.stop_resting()
        await self.system.stop()
        try:
            self.jobs_queue.release()  # several leaders: a standby takes the job queue at once
        except StoreError as exc:
            log.warning("jobs: the job queue's lease not released (a standby takes it when it expires): %s", exc)
        stopping = asyncio.ensure_future(self.relay.stop_within())  # see WorkerAgent.stop
        await asyncio.sleep(0)
        await self.sender.stop()
        await stopping
        await self.transport.stop()

    async def _tend_jobs(self) -> None:
        """Several leaders on PostgreSQL: the LeaderActor tends the fleet's job queue
        (`agent.leader.actors.TendJobs`). On each second's tick: the job queue's lease renewed
        every third of `[leader] job_lease_s` (a standby tries to take it every tick, so it takes
        over within a second of the lease running out) and the lost workers ended. Between ticks,
        on a notice of the database: what the other leaders posted for the holder, claimed at
        once, and a lease given up, taken at once. While the listening session is lost, the
        posted work is claimed on the ticks instead. A full mailbox skips a round."""
        from agent.core.lease import CHANNEL as LEASES
        from agent.leader.jobs import CHANNEL as POSTED

        queue = self.jobs_queue
        lease_s = self.config.leader.job_lease_s
        every_s, renew_s = min(1.0, lease_s / 3), lease_s / 3
        listener = queue.listener(POSTED, LEASES)
        assert listener is not None  # (on a database server only)
        renewed = self.clock.monotonic()  # (taken or refused at open)
        next_tick = renewed + every_s
        try:
            while True:
                heard = await listener.wait(self.clock, next_tick - self.clock.monotonic())
                now = self.clock.monotonic()
                tick = now >= next_tick
                if tick:
                    next_tick = now + every_s
                given_up = any(channel == LEASES for channel, _ in heard)
                renew = (not queue.held and (tick or given_up)) or (tick and now - renewed >= renew_s - every_s / 2)
                posted = (tick and not listener.listening) or any(
                    channel == POSTED and by != self.device_id for channel, by in heard)
                if self.leader is None or not (tick or renew or posted):
                    continue
                try:
                    self.leader.tell(TendJobs(renew, posted=posted, tick=tick))
                except EdgeAgentError:
                    continue
                if renew:
                    renewed = now
        finally:
            listener.close()

    # -- API -----------------------------------------------------------------------------------
    async def submit_jobs(self, jobs: Sequence[JobSubmit], *, timeout_s: float = 30.0) -> list[SubmitResult]:
        """Store jobs (idempotent by job id) and dispatch them to workers with free demand."""
        if self.leader is None:
            raise StoreError("the leader agent is not started")
        results: list[SubmitResult] = await self.leader.ask(SubmitJobs(tuple(jobs)), timeout_s=timeout_s)
        return results

    def mailbox_statistics(self) -> list[MailboxStatistics]:
        return self.system.statistics()

    @property
    def intake_stats(self) -> HeartbeatIntake | None:
        return self._intake_actor

    @property
    def leader_stats(self) -> LeaderActor:
        return self._leader_actor

    # -- as a part of the running agent --------------------------------------------------------
    def databases(self) -> list[Path]:
        """The SQLite files this agent owns (none when its stores were handed in)."""
        if not self._owns_stores:
            return []
        return [Path(self.outbox.path)] + ([self.leader_db] if self.leader_db.exists() else [])

    def liveness(self) -> Liveness:
        return {"actors": (self.system.problem, "all actors running")}

    def checks(self) -> Checks:
        from agent.service.checks import agent_checks

        relay = self.relay
        checks = agent_checks(connected=self.transport.connected, database=self.outbox.path, clock=self.clock,
                              data_dir=self.data_dir, relay_running=lambda: relay.running, reserve=self.reserve)
        from agent.service.checks import task_check

        checks["presence"] = task_check(lambda: self._presence_task)  # the devices' presence changes applied
        if self.registry.on_server:  # the fleet's database, as one state
            from agent.service.checks import problem_check

            checks["fleet database"] = problem_check(self._database_problem, up="reachable")
        if self.jobs_queue.on_server:  # the loop that keeps, takes and tends the fleet's job queue
            from agent.service.checks import lease_check

            queue = self.jobs_queue
            checks["job queue"] = lease_check(lambda: self._jobs_task,
                                              held_by=lambda: None if queue.held else queue.lease_holder)
        return checks

    @property
    def process_interval_s(self) -> float:
        """How long the heartbeat intake rests after each write (`[leader] process_interval_s`, else by
        the store)."""
        stated = self.config.leader.process_interval_s
        if stated is not None:
            return stated
        return POSTGRES_REST_S if self.registry.on_server else 0.0

    def _leaders_metrics(self) -> list[MetricFamily]:
        """Several leaders on PostgreSQL: the fleet's leaders running or not (by their own marks)
        and whether this one runs the job queue."""
        from agent.service.prom import family

        running = self.registry.leaders_running()
        return [
            family("ea_fleet_leaders", "gauge", "The fleet's leaders, running (marked alive within three of their"
                   " beats) or not.", [({"state": "running"}, float(sum(running.values()))),
                                       ({"state": "not_running"}, float(len(running) - sum(running.values())))]),
            family("ea_job_queue_held", "gauge", "1 while this leader runs the fleet's job queue (holds its lease).",
                   1.0 if self.jobs_queue.held else 0.0),
        ]

    def _database_problem(self) -> str | None:
        outage = self.registry.outage()
        if outage is None:
            return None
        from agent.core.durations import utc_iso

        return (f"unreachable since {utc_iso(outage.since_ms)} ({outage.why}): durable messages are answered busy,"
                " presence changes wait")

    def collectors(self) -> Collectors:
        from agent.service.collectors import agent_collectors, per_class_collector, snapshot_collector

        found = agent_collectors(
            relay_metrics=self.relay.metrics, mailbox_statistics=self.system.statistics,
            outbox_stats=self.outbox.stats,
            housekeeping_metrics=self.housekeeping.metrics if self.housekeeping is not None else None)
        found["jobs"] = snapshot_collector("ea_jobs", self.jobs_queue.stats)
        presence = self.presence
        found["presence"] = snapshot_collector("ea_leader_presence", lambda: {
            "applied": presence.applied, "pending": presence.pending, "retries": presence.retries,
            "superseded": presence.superseded}, counters=("applied", "retries", "superseded"),
            help_={"applied": "Device presence changes applied to the registry.",
                   "pending": "Device presence changes waiting for the store (the newest per device).",
                   "retries": "Rounds that left presence changes pending (the store failed, the mailbox was full).",
                   "superseded": "Presence changes replaced by the same device's newer one before applied."})
        if self.registry.on_server:
            found["leaders"] = self._leaders_metrics
            registry = self.registry
            found["database"] = snapshot_collector("ea_leader_database", lambda: {
                "reachable": registry.outage() is None, "outages": registry.outages()}, counters=("outages",),
                help_={"reachable": "1 while the fleet's database answers, 0 while it is lost.",
                       "outages": "Times this leader lost the fleet's database."})
        found["config"] = self._config_compliance
        found["fleet"] = self._fleet_devices
        found["leader"] = snapshot_collector("ea_leader", lambda: {
            "busy_answers": self.busy_answers, "refused_forged": self.refused_forged,
            "rejects": self.rejects.count, "accepted": self.inbox.stats.accepted if self.inbox is not None else 0,
            "heartbeats_applied": self._intake_actor.stats.applied if self._intake_actor is not None else 0,
            "heartbeats_unstored": self._intake_actor.stats.unstored if self._intake_actor is not None else 0,
            "heartbeat_batches": self._intake_actor.stats.batches if self._intake_actor is not None else 0},
            label="counter")
        if self.sinks is not None:
            found["messages"] = per_class_collector(
                "ea_leader_messages", self.sinks.stats.snapshot,
                counters=("applied", "duplicates", "rejected", "forwarded"),
                help_={"applied": "Application messages stored (each once).",
                       "duplicates": "Redeliveries of application messages already stored (suppressed).",
                       "rejected": "Application messages the leader refused (see edge-agent rejects).",
                       "forwarded": "Application messages queued for the northbound broker."})
        return found

    def _fleet_devices(self) -> list[MetricFamily]:
        """`ea_fleet_devices{state}`: the fleet's devices online (connected, by their presence) and
        offline, as `edge-agent status` counts them; `ea_fleet_release_*{firmware}`: the healthy
        hours of each firmware release, as its devices count them (`DeviceRegistry.release_health`)."""
        from agent.service.prom import family

        online, offline = self.registry.counts()
        releases = self.registry.release_health()
        return [family("ea_fleet_devices", "gauge", "The fleet's devices by presence (online: connected).",
                       [({"state": "online"}, float(online)), ({"state": "offline"}, float(offline))]),
                family("ea_fleet_release_devices", "gauge", "Devices that run the firmware release and count how"
                       " their agent runs on it.", [({"firmware": r.firmware}, float(r.devices)) for r in releases]),
                family("ea_fleet_release_hours", "gauge", "Hours the agents of those devices ran on the release.",
                       [({"firmware": r.firmware}, r.hours) for r in releases]),
                family("ea_fleet_release_unexpected_restarts", "gauge", "Their starts on the release that found the"
                       " run before not stopped (a crash, a kill, a power cut, a watchdog).",
                       [({"firmware": r.firmware}, float(r.unexpected_restarts)) for r in releases]),
                family("ea_fleet_release_healthy_hours_ratio", "gauge", "The share of those hours without an"
                       " unexpected restart (crash-free hours; each restart spoils one).",
                       [({"firmware": r.firmware}, r.healthy_ratio) for r in releases])]

    def _config_compliance(self) -> list[MetricFamily]:
        """`ea_config_devices{target, compliance}` and `ea_config_last_attempt_failed{target}`: the
        fleet's configuration targets as their
        devices' heartbeats state them, pending where a config rollout or a layer has more for
        them (the family without samples when no device states any)."""
        from agent.leader.config_pending import fleet_compliance
        from agent.leader.readonly import FleetReader
        from agent.service.prom import family

        if self._fleet_reader is None:
            self._fleet_reader = FleetReader(self.shared)
        with self._fleet_reader.reading() as db:  # (the fleet's stores, the layers among them)
            compliance = fleet_compliance(db, self.clock.now_ms())
        from agent.leader.registry import LAST_ATTEMPT_FAILED

        samples = [({"target": target, "compliance": kind}, float(n)) for target, counts in compliance.items()
                   for kind, n in counts.items() if kind != LAST_ATTEMPT_FAILED]
        failed = [({"target": target}, float(counts.get(LAST_ATTEMPT_FAILED, 0)))
                  for target, counts in compliance.items()]
        return [family("ea_config_devices", "gauge", "Devices by configuration target and what they hold of it"
                       " (each device in one: in_sync, pending, drifted, damaged, not_applied).", samples),
                family("ea_config_last_attempt_failed", "gauge", "Devices whose newest apply of the target did not"
                       " commit (reverted or refused; they hold what `ea_config_devices` says).", failed)]

    # -- inbound -------------------------------------------------------------------------------
    def register_route(self, kind: str, type_: type[msgspec.Struct], route: Route) -> None:
        """Decode envelopes of `kind` from devices as `type_` and answer them with `route`: the
        one way to give the leader a new message kind."""
        self.kinds.register(kind, type_)
        self._routes[kind] = route

    def register_durable(self, kind: str, type_: type[M], durable: DurableKind[M], *,
                         check: Callable[[Envelope, M], Reply | None] | None = None) -> None:
        """Take `kind` as a durable message: `check` may refuse it (its Reply), else it is told to
        the LeaderActor, applied with `durable` and answered `accepted` once committed. The one way
        to give the leader a new durable kind: how it is applied is declared with its route."""

        def route(env: Envelope, message: msgspec.Struct) -> Reply | Awaitable[Reply]:
            assert isinstance(message, type_)
            refusal = check(env, message) if check is not None else None
            return refusal or self._durable(env, message, durable)

        self.register_route(kind, type_, route)

    def _on_up(self, env: Envelope, _message: InboundMessage) -> Reply | Awaitable[Reply]:
        if self.revoked and env.sender in self.revoked:
            return self._refuse(env, f"device {env.sender} is revoked")
        if self.rates is not None:
            wait_ms = self.rates.take(env.sender)
            if wait_ms:
                self.busy_answers += 1
                return Reply(id=env.id, status="busy", retry_after_ms=wait_ms, reason="over this device's share")
        # A device application's message (kind "app.CLASS") is one kind per class: decoded and
        # routed by its prefix, then checked like any other.
        app = env.kind.startswith(APP_KIND_PREFIX)
        if app and self.sinks is None:
            return self._refuse(env, "this leader takes no application messages")
        try:
            message = decode_app_message(env) if app else self.kinds.decode_payload(env)
        except CodecError as exc:
            return self._refuse(env, f"undecodable payload: {exc}")
        owner = getattr(message, "device_id", None) or getattr(message, "worker", None)
        if owner is not None and owner != env.sender:
            self.refused_forged += 1
            return self._refuse(env, f"payload names device {owner!r} but the sender is {env.sender!r}")
        route = self._app_message if app else self._routes.get(env.kind)
        if route is None:
            return self._refuse(env, f"the leader does not take {env.kind!r} messages")
        return route(env, message)

    def _refuse_far_ahead(self, env: Envelope, ts_ms: int) -> Reply | None:
        """A record stamped too far ahead of the leader's clock is refused (see MAX_AHEAD_MS)."""
        ahead_ms = ts_ms - self.clock.now_ms()
        if ahead_ms > MAX_AHEAD_MS:
            return self._refuse(env, f"ts_ms {ts_ms} is {ahead_ms / 86_400_000:.0f} days ahead of the leader's clock")
        return None

    def _app_message(self, env: Envelope, message: msgspec.Struct) -> Reply | Awaitable[Reply]:
        """Stored once it is in the sinks."""
        return self._not_far_ahead(env, message) or self._durable(env, message, self._leader_actor.app_messages,
                                                                  held=ALREADY_STORED)

    def _not_far_ahead(self, env: Envelope, message: msgspec.Struct) -> Reply | None:
        """A record's own timestamp (`ts_ms`) must not be too far ahead (see MAX_AHEAD_MS)."""
        ts_ms = getattr(message, "ts_ms", None)
        return self._refuse_far_ahead(env, ts_ms) if isinstance(ts_ms, int) else None

    def _ping(self, env: Envelope, _message: msgspec.Struct) -> Reply:
        return Reply(id=env.id, status="accepted")  # nothing stored: a round trip for `doctor`

    def _heartbeat(self, env: Envelope, message: msgspec.Struct) -> Reply:
        assert isinstance(message, Heartbeat) and self.intake is not None
        try:
            self.intake.tell(message, coalesce_key=message.device_id, seq=message.seq)
        except MailboxFull as exc:
            self.busy_answers += 1
            return Reply(id=env.id, status="busy", retry_after_ms=exc.retry_after_ms)
        except EdgeAgentError as exc:
            return Reply(id=env.id, status="busy", retry_after_ms=BUSY_STORE_MS, reason=str(exc))
        if message.full:
            self._full_heard.add(message.device_id)
        elif message.device_id not in self._full_heard:  # a short one: this leader lacks the rest
            return Reply(id=env.id, status="accepted", reason=FULL_HEARTBEAT_WANTED)
        return Reply(id=env.id, status="accepted")

    def _heartbeat_refused(self, hb: Heartbeat, reason: str) -> None:
        """A heartbeat already answered `accepted` that the registry could not store."""
        self.record_reject(topic=self._up_topic(hb.device_id), reason=f"heartbeat {hb.seq} not stored: {reason}",
                            payload=b"", sender=hb.device_id, kind="heartbeat")

    def _from_operator(self, env: Envelope, _message: msgspec.Struct) -> Reply | None:
        """Jobs come from operators only (`leader.operators`, or `submit_jobs` on the leader's
        host): a device's job would run on every other worker."""
        if env.sender not in self._operators:
            return self._refuse(env, f"job.submit is taken from an operator (leader.operators) only, not from"
                                     f" device {env.sender!r}")
        return None

    def _durable(self, env: Envelope, message: msgspec.Struct, kind: DurableKind[Any], *,
                 held: str = "") -> Reply | Awaitable[Reply]:
        """Told to the LeaderActor now; answered `accepted` once its batch is committed (with the
        reason `held` when it changed nothing: a message held before)."""
        assert self.leader is not None
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        try:
            self.leader.tell(Durable(env.id, env.sender, message, done, kind))
        except MailboxFull as exc:
            self.busy_answers += 1
            return Reply(id=env.id, status="busy", retry_after_ms=exc.retry_after_ms)
        except EdgeAgentError as exc:
            return Reply(id=env.id, status="busy", retry_after_ms=BUSY_STORE_MS, reason=str(exc))
        return self._committed(env, done, held)

    async def _committed(self, env: Envelope, done: asyncio.Future[bool], held: str) -> Reply:
        try:
            await self.clock.wait_for(asyncio.shield(done), self.config.mqtt.reply_timeout_s)
        except TimeoutError:
            return Reply(id=env.id, status="busy", retry_after_ms=BUSY_STORE_MS, reason="not committed in time")
        except UnstorableValue as exc:  # this message alone: refused, its batch was applied
            return self._refuse(env, str(exc))
        except StoreError as exc:
            self.busy_answers += 1
            # (the leader running the job queue takes it when sent again; a lost database is one line)
            if not isinstance(exc, QueueStandby | StoreUnavailable):
                self._store_log.warning("store", f"message {env.id} from {env.sender} not applied (answered busy):"
                                        f" {exc}")
            return Reply(id=env.id, status="busy", retry_after_ms=BUSY_STORE_MS, reason=str(exc))
        return Reply(id=env.id, status="accepted", reason="" if done.result() else held)

    def _refuse(self, env: Envelope, reason: str) -> Reply:
        if self.sinks is not None and env.kind.startswith(APP_KIND_PREFIX):
            cls = env.kind.removeprefix(APP_KIND_PREFIX)
            self.sinks.rejected(cls if _topic_safe(cls) and len(cls) <= 48 else "other")
        self._reject_log.warning(f"{env.sender}:{env.kind}", f"refused {env.kind} {env.id} from {env.sender}: {reason}")
        self.record_reject(topic=self._up_topic(env.sender), reason=reason, payload=env.payload, sender=env.sender,
                            msg_id=env.id, kind=env.kind)
        return Reply(id=env.id, status="rejected", reason=reason)

    def _on_rejected(self, reason: str, payload: bytes, topic: str) -> None:
        """The inbox refused a message before it became an envelope (oversized, undecodable,
        sender not matching the topic)."""
        self._reject_log.warning(topic, f"refused message on {topic}: {reason}")
        self.record_reject(topic=topic, reason=reason, payload=payload, sender=topics.device_of(topic))

    def _up_topic(self, device: str) -> str:
        """The up topic a refused message of `device` came on, for the rejects table."""
        return topics.up(self.fleet, device) if _topic_safe(device) else "?"

    def record_reject(self, *, topic: str, reason: str, payload: bytes, sender: str | None,
                       msg_id: str | None = None, kind: str | None = None) -> None:
        try:
            self.rejects.record(topic=topic, reason=reason, payload=payload, sender=sender, msg_id=msg_id, kind=kind)
        except StoreError as exc:
            log.log(store_log_level(exc, logging.ERROR), "could not record a refused message: %s", exc)

    async def _on_presence(self, message: InboundMessage) -> None:
        device = topics.device_of(message.topic)
        if device is None or device == self.device_id:
            return
        payload = bytes(message.payload)
        try:
            state = decode_presence(payload)
        except PresenceFormatError as exc:
            self.record_reject(topic=message.topic, reason=str(exc), payload=payload, sender=device)
            return
        self.presence.put(Presence(device_id=device, status="online" if state.online else "offline",
                                   ts_ms=self.clock.now_ms(), session=state.session))

    def _tell_presence(self, presence: Presence, done: asyncio.Future[bool]) -> None:
        if self.leader is None:
            raise ActorStopped("the leader actor is not running")
        self.leader.tell(Durable(f"presence:{presence.device_id}", presence.device_id, presence, done,
                                 self._leader_actor.presence))

    def _on_deadline(self, devices: list[str]) -> None:
        if self.leader is None:
            return
        try:
            self.leader.tell(WorkersLost(tuple(devices), "heartbeat deadline"))
        except EdgeAgentError as exc:
            log.warning("could not release the jobs of %d lost workers: %s", len(devices), exc)

    async def _send_offers(self, offers: Sequence[Dispatch]) -> None:
        msgs = [
            OutboxMessage(
                msg_id=self.ids.next(), owner=self.device_id, receiver=d.worker, kind=kind_of(d.offer),
                payload=encode_message(d.offer), key=f"job.offer:{d.offer.job_id}:{d.offer.epoch}",
            )
            for d in offers
        ]
        await self.outbox.enqueue_many(msgs)


class _HeartbeatDemand:
    """The heartbeat intake's view of the leader's job queue: a lookup, and a registration told
    to the LeaderActor (a full mailbox drops it: the worker's next heartbeat carries it again)."""

    def __init__(self, leader: LeaderAgent) -> None:
        self._leader = leader

    def bound(self, demand: JobDemand) -> bool:
        return self._leader.jobs_queue.bound(demand)

    def register(self, demands: Sequence[tuple[JobDemand, int]]) -> None:
        ref = self._leader.leader
        if ref is None:
            return
        try:
            ref.tell(RegisterDemand(tuple(demands)))
        except EdgeAgentError:
            pass


def _topic_safe(device: str) -> bool:
    return bool(device) and not any(ch in device for ch in "/+#\x00") and not device.startswith("$")


__all__ = ["LEADER_DB", "LeaderAgent", "LeaderOptions"]
