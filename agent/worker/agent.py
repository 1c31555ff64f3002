"""The worker agent: what runs on every device.

    WorkerAgent
    ├── ActorSystem: HeartbeatActor, TelemetryActor, JobWorker (bounded mailboxes)
    ├── OutboxStore (SQLite) ──► Relay ──► EnvelopeSender ──► transport: ea/v1/{fleet}/{me}/up
    ├── LeaderLink: direct, acknowledged, non-durable sends (telemetry fast path, job demand)
    ├── MessageIntake: device applications' messages (local API, sources): direct, else outbox
    ├── Housekeeper: prunes the job ledger by age (agent.housekeeping)
    └── EnvelopeInbox on ea/v1/{fleet}/{me}/down: commands from the leader to their actors;
        a full mailbox answers `busy`, an unknown kind `rejected`

Build one with `WorkerAgent.open(config, transport=..., clock=...)` (opens its databases under
the data dir) or hand it already-open stores (the simulator shares files between devices).
`start()` brings it up; `stop()` stops taking work, stops the relay (untried rows go back to
the outbox), disconnects, flushes the outbox and closes the databases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack

import msgspec

from agent.actors import ActorRef, ActorSystem
from agent.core.clock import Clock
from agent.core.codec import Envelope, Reply
from agent.core.config import AgentConfig, resolve
from agent.core.errors import CodecError, EdgeAgentError, MailboxFull, NotConnected
from agent.core.gate import Gate
from agent.core.ids import IdGenerator
from agent.core.reserve import DiskReserve
from agent.core.sqlite import atomic, close_quietly, connect, migrate, recover_damaged
from agent.housekeeping import Housekeeper, limited
from agent.outbox.relay import Relay
from agent.outbox.settings import aimd_settings, outbox_classes, retry_policy
from agent.outbox.store import OutboxStore
from agent.protocol import (
    KIND_HEARTBEAT_PACE,
    KIND_JOB_OFFER,
    AppState,
    ConfigState,
    HeartbeatPace,
    JobOffer,
    SlotState,
    SystemSample,
    agent_registry,
    app_kind,
    kind_of,
)
from agent.service.parts import Checks, Collectors, Liveness, PartBase
from agent.telemetry import SystemSampler
from agent.transport import topics
from agent.transport.base import InboundMessage, Transport
from agent.transport.endpoint import EnvelopeInbox, EnvelopeSender
from agent.transport.linkbytes import TcpCounters
from agent.worker.actors import (
    LEADER,
    BeatNow,
    Cadence,
    HeartbeatActor,
    JobHandler,
    JobWorker,
    Pace,
    RecordTelemetry,
    TelemetryActor,
)
from agent.worker.facts import device_facts
from agent.worker.health import HealthLedger
from agent.worker.jobs import DemandWindow, JobLedger
from agent.worker.messages import MessageIntake, class_audit

if TYPE_CHECKING:
    from config_rollout.device.review import ConfigReviews
    from rollout_engine.device import ExcerptSource

log = logging.getLogger(__name__)

WORKER_DB = "worker.db"

#: The per-class audit the worker's `/metrics` exports (`ea_messages_*`), and what each means.
AUDIT_COUNTERS = ("accepted", "direct", "stored", "duplicates", "refused", "delivered", "delivered_from_outbox",
                  "dead_lettered", "expired", "dropped", "overwritten", "enqueued", "replayed")
AUDIT_HELP = {
    "accepted": "Application messages taken (local API and sources) since the agent started.",
    "direct": "Application messages the leader accepted directly (stored there before the answer).",
    "stored": "Application messages put in the outbox.",
    "duplicates": "Application messages already pending under their key (not stored twice).",
    "refused": "Application messages refused, by reason (invalid, unknown_class, too_large, full, unavailable).",
    "delivered": "Application messages the leader acknowledged: direct plus from the outbox.",
    "delivered_from_outbox": "Application messages of the class the leader acknowledged from the outbox.",
    "pending_at_start": "Application messages of the class that were waiting in the outbox at this start.",
    "dead_lettered": "Application messages of the class moved to the dead letters.",
    "expired": "Application messages of the class past their TTL, deleted undelivered.",
    "dropped": "Application messages of the class dropped to make room (drop_oldest).",
    "overwritten": "Application messages of the class replaced by a newer one of their key.",
    "enqueued": "Application messages of the class stored in the outbox (overwrites included).",
    "replayed": "Dead letters of the class moved back to pending.",
    "pending": "Application messages of the class waiting in the outbox.",
    "pending_bytes": "Payload bytes of the class waiting in the outbox.",
    "dead": "Application messages of the class in the dead letters.",
}


def _meta_v1(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE TABLE worker_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID")


def next_incarnation(path: Path) -> int:
    """Count this start in the worker database: heartbeat seqs of a new run start above the
    old ones (`incarnation * 1e9 + n`) without trusting a wall clock a Pi may not have yet."""
    conn = connect(path)
    try:
        migrate(conn, "worker", (_meta_v1,))
        with atomic(conn):
            row = conn.execute("SELECT value FROM worker_meta WHERE key = 'incarnation'").fetchone()
            value = (int(row[0]) if row else 0) + 1
            conn.execute(
                "INSERT INTO worker_meta(key, value) VALUES ('incarnation', ?)"
                " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (value,),
            )
        return value
    finally:
        close_quietly(conn)


def own_settings_applied(data_dir: Path) -> bool:
    """Whether a release was ever applied to the built-in target `agent` (its journal, where
    `ConfigApplier` keeps it: a stat, no import of the configuration library)."""
    return (data_dir / "config" / "agent" / "journal.json").exists()


def config_states(config: AgentConfig, data_dir: Path) -> dict[str, ConfigState]:
    """Each `[config_targets.NAME]`'s applied version, state and drift, for the heartbeat: read
    from the target's journal and its documents (small files, at the heartbeat's pace)."""
    from config_rollout.device.agent_settings import AGENT_TARGET, agent_target, offers_agent_target
    from config_rollout.device.apply import ConfigApplier

    states = {}
    targets = dict(config.config_targets)
    if offers_agent_target(config) and own_settings_applied(data_dir):
        targets[AGENT_TARGET] = agent_target(data_dir)  # (stated once something was applied to it)
    for name, target in sorted(targets.items())[:32]:
        try:
            st = ConfigApplier(name, target, data_dir).status()
        except EdgeAgentError:  # a damaged journal: said as such, the heartbeat goes on
            states[name] = ConfigState(state="damaged")
            continue
        states[name] = ConfigState(version=st.version[:64], state=st.state[:16],
                                   drifted=tuple(d[:128] for d in st.drifted[:64]), layers=st.layers[:16],
                                   attempt=st.attempt)
    return states


def default_job_handler(clock: Clock) -> JobHandler:
    """Jobs every worker can run: `sleep` (payload: seconds, as text) waits that long on the
    Clock and returns the payload; any other kind is echoed back as its result."""

    async def run(offer: JobOffer) -> bytes:
        if offer.kind == "sleep":
            try:
                seconds = float(offer.payload.decode("ascii") or 0)
            except (UnicodeDecodeError, ValueError):
                raise CodecError(f"sleep job {offer.job_id}: payload is not a number of seconds") from None
            await clock.sleep(max(0.0, min(seconds, 3600.0)))
        return offer.payload

    return run


class LeaderLink:
    """Direct sends to the leader: one envelope, its reply awaited; nothing stored.

    `tell` (for `tell_reliable`) raises `NotConnected` at once while offline, so the caller
    falls back to the outbox without a round trip.
    """

    def __init__(self, sender: EnvelopeSender, topic: str, *, device_id: str, connected_gate: object,
                 ids: IdGenerator, clock: Clock) -> None:
        self._sender = sender
        self._topic = topic
        self._device_id = device_id
        self._gate = connected_gate
        self._ids = ids
        self._clock = clock

    def tell(self, message: object, *, coalesce_key: str | None = None, seq: int = 0) -> Awaitable[str]:
        """Deliver one envelope; the leader's accepted answer's reason (see `EnvelopeSender.deliver`)."""
        if not getattr(self._gate, "is_open", False):
            raise NotConnected("no connection to the broker")
        if not isinstance(message, Envelope):
            raise CodecError(f"LeaderLink.tell takes an Envelope, not {type(message).__name__}")
        return self._sender.deliver(message, self._topic)

    async def send(self, message: msgspec.Struct) -> None:
        await self.tell(self._envelope(kind_of(message), message))

    async def request(self, kind: str, message: msgspec.Struct) -> bytes:
        """Send `message` as `kind` and return the body of the leader's accepted answer (an
        answer with a payload: a renewed certificate); raises as `EnvelopeSender.deliver`."""
        if not getattr(self._gate, "is_open", False):
            raise NotConnected("no connection to the broker")
        return await self._sender.request(self._envelope(kind, message), self._topic)

    def _envelope(self, kind: str, message: msgspec.Struct) -> Envelope:
        return Envelope(id=self._ids.next(), kind=kind, sender=self._device_id, receiver=LEADER,
                        ts_ms=self._clock.now_ms(), payload=msgspec.msgpack.encode(message))


class WorkerOptions(TypedDict, total=False):
    """The optional parts of a `WorkerAgent` that `WorkerAgent.open` passes on."""

    owns_stores: bool
    rng: random.Random | None
    sampler: Callable[[], SystemSample] | None
    job_handler: JobHandler | None
    relay: bool
    housekeeping: bool | None


class WorkerAgent(PartBase):
    """The worker's core part (`agent.service.parts`): its actors, outbox, relay and inboxes."""

    name = "worker"

    def __init__(
        self,
        config: AgentConfig,
        *,
        transport: Transport,
        clock: Clock,
        outbox: OutboxStore,
        ledger: JobLedger,
        incarnation: int,
        owns_stores: bool = True,
        rng: random.Random | None = None,
        sampler: Callable[[], SystemSample] | None = None,
        job_handler: JobHandler | None = None,
        relay: bool = True,
        housekeeping: bool | None = None,
    ) -> None:
        self.config = config
        self.device_id = config.agent.device_id
        self.fleet = config.agent.fleet
        self.transport = transport
        self.clock = clock
        self.outbox = outbox
        self.ledger = ledger
        self.incarnation = incarnation
        self._owns_stores = owns_stores
        self._rng = rng if rng is not None else random.Random()
        self.ids = IdGenerator(clock, self._rng)
        # This start of the agent, whatever survived on disk (see `Heartbeat.boot`).
        self.boot = f"{self._rng.getrandbits(64):016x}"
        # applications' verdicts on staged configs (`agent.worker.configuring.config_reviews`)
        self.config_reviews: ConfigReviews | None = None
        # the log lines a failed update's report carries (`agent.worker.failure_logs`; None: none)
        self.failure_logs: ExcerptSource | None = None
        self.system = ActorSystem(clock=clock, name=self.device_id)
        self.up_topic = topics.up(self.fleet, self.device_id)
        self.sender = EnvelopeSender(
            transport, clock=clock, reply_topic=topics.reply(self.fleet, self.device_id, "relay"),
            timeout_s=config.mqtt.reply_timeout_s,
        )
        self.deliver_row = self.sender.for_rows(lambda _receiver: self.up_topic)
        self.link = LeaderLink(self.sender, self.up_topic, device_id=self.device_id,
                               connected_gate=transport.connected, ids=self.ids, clock=clock)
        self.relay: Relay | None = None
        if relay:
            self.relay = Relay(
                outbox, self.deliver_row, clock=clock, ready=transport.connected,
                partitions=config.relay.partitions, retry=retry_policy(config), limits=aimd_settings(config),
                rng=self._rng, reconnect_jitter_s=config.relay.reconnect_jitter_s, name=f"relay:{self.device_id}",
            )
        # The leader is the sender on our down topic, so the topic names us, not it: no sender check.
        self.inbox = EnvelopeInbox(
            transport, topic_filter=topics.down(self.fleet, self.device_id), handler=self._on_command,
            on_rejected=self._on_rejected, sender_check=False, clock=clock,
        )
        # The psutil reading of this host, shared by the heartbeat and the system source: one
        # sampler, as psutil's non-blocking CPU percent is the share since its previous call.
        self.sampler = sampler
        # What the heartbeat reports as running; an attached updater answers with its active slot.
        self.firmware_version: Callable[[], str] = lambda: config.agent.firmware_version
        # What the heartbeat reports of the slots; an attached updater answers (None: no [firmware]).
        self.slot_state: Callable[[], SlotState | None] = lambda: None
        # What the heartbeat reports of the configuration targets (None: the config declares none,
        # and nothing was ever applied to the agent's own settings: a start follows that apply).
        self.config_states: Callable[[], dict[str, ConfigState] | None] = lambda: (
            config_states(config, self.data_dir) if config.config_targets or own_settings_applied(self.data_dir)
            else None)
        # What the heartbeat reports of the applications; an attached application part answers
        # (None: no [apps]).
        self.app_states: Callable[[], dict[str, AppState] | None] = lambda: None
        # The rollout kinds' parts of this worker by kind ("firmware", "config", "app"): a release
        # drives them together (`agent.worker.releases`); each part's factory adds its own.
        self.kind_parts: dict[str, PartBase] = {}
        # What the heartbeat says the device is (arch, board, os), read once (`agent.worker.facts`);
        # the simulator's devices say their own.
        self.device_facts: Callable[[], dict[str, str] | None] = device_facts
        self._job_handler = job_handler or default_job_handler(clock)
        # What the down topic carries: the kinds this agent decodes, and the actor each goes to.
        self.kinds = agent_registry()
        self._commands: dict[str, ActorRef] = {}
        self.heartbeat_actor: HeartbeatActor | None = None
        self.telemetry_actor: TelemetryActor | None = None
        self.job_worker: JobWorker | None = None
        self.heartbeat: ActorRef | None = None
        self.telemetry: ActorRef | None = None
        self.jobs: ActorRef | None = None
        self.rejected = 0
        self.leader_id: str | None = None  # the sender of the newest command taken: the leader
        self._started_at = clock.monotonic()  # (again at start) what the link's hourly figure divides by
        # Device applications' messages (the local API and the built-in sources hand them here).
        self.messages = MessageIntake(
            device_id=self.device_id, classes=config.classes, outbox=outbox, link=self.link,
            connected=transport.connected, ids=self.ids, clock=clock,
            seq_base=incarnation * 1_000_000_000, direct_timeout_s=config.local_api.direct_timeout_s)
        self.recovered_from: str | None = None  # where a damaged worker.db was moved at open
        self.health: HealthLedger | None = None  # how the agent runs on its firmware (`start` opens it)
        self.reserve: DiskReserve | None = None  # the disk room kept for a full disk (`open` sets it)
        self.data_dir = Path(config.agent.data_dir)  # where its files live (`open`: where it opened them)
        # Whoever owns the stores keeps them from growing for ever (default: this agent if it does).
        self.housekeeping: Housekeeper | None = None
        if owns_stores if housekeeping is None else housekeeping:
            hk = config.housekeeping
            self.housekeeping = Housekeeper(
                clock=clock, interval_s=hk.interval_s, batch_rows=hk.batch_rows,
                name=f"housekeeping:{self.device_id}",
                tasks=[limited("job_ledger", lambda n: ledger.prune(hk.ledger_retention_s, limit=n))])
        self._started = False
        self._closed = False

    # -- construction --------------------------------------------------------------------------
    @classmethod
    async def open(
        cls, config: AgentConfig, *, transport: Transport, clock: Clock, data_dir: str | Path | None = None,
        **kwargs: Unpack[WorkerOptions],
    ) -> WorkerAgent:
        """Open the worker's databases under `data_dir` (default: the config's) and build it."""
        base = Path(data_dir if data_dir is not None else config.agent.data_dir)
        base.mkdir(parents=True, exist_ok=True)
        reserve = DiskReserve(base)
        reserve.release_if_full()  # a full disk: room to open the databases and answer 503
        # A damaged worker.db (the job ledger, the start counter) must not keep the device down:
        # it is moved aside and started afresh, as the outbox is.
        recovered = recover_damaged(base / WORKER_DB, now_ms=clock.now_ms(), what="worker")
        incarnation = next_incarnation(base / WORKER_DB)
        outbox = await OutboxStore.open(
            resolve(base, config.outbox.path), clock=clock, durability=config.outbox.durability,
            max_attempts=config.outbox.max_attempts, classes=outbox_classes(config),
        )
        try:
            ledger = JobLedger.open(base / WORKER_DB, clock=clock,
                                    synchronous="FULL" if config.outbox.durability == "power" else "NORMAL")
        except BaseException:
            await outbox.close()
            raise
        if "sampler" not in kwargs:
            kwargs["sampler"] = SystemSampler(base, clock=clock).sample
        agent = cls(config, transport=transport, clock=clock, outbox=outbox, ledger=ledger,
                    incarnation=incarnation, **kwargs)
        agent.recovered_from = recovered
        agent.data_dir = base
        agent.reserve = reserve
        return agent

    # -- lifecycle -----------------------------------------------------------------------------
    def _outbox_depth(self) -> int:
        return self.outbox.pending

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._started_at = self.clock.monotonic()
        cfg = self.config
        if self._owns_stores:  # (the simulator's devices share stores and a clock: no count of their own)
            self.health = HealthLedger(self.data_dir, self.clock)
            self.health.open()
        await self.system.start()
        if self._owns_stores:  # (a shared outbox's figures are every device's: no audit then)
            self.messages.baseline = dict((await self.outbox.stats()).by_class)
        window = DemandWindow(cfg.jobs.demand_window, worker=self.device_id,
                              incarnation=f"{self.incarnation}-{self.boot}")
        self.job_worker = JobWorker(
            device_id=self.device_id, window=window, ledger=self.ledger, outbox=self.outbox,
            ids=self.ids, handler=self._job_handler)
        self.jobs = self.system.spawn(  # no stall_s: a job runs as long as it takes
            self.job_worker, name="jobs", capacity=cfg.jobs.demand_window + 2, policy="reject",
        )
        self.register_command(KIND_JOB_OFFER, JobOffer, self.jobs)
        self.telemetry_actor = TelemetryActor(
            device_id=self.device_id, outbox=self.outbox, link=self.link, ids=self.ids,
            seq_base=self.incarnation * 1_000_000_000)
        self.telemetry = self.system.spawn(
            self.telemetry_actor, name="telemetry", capacity=cfg.mailbox.capacity, policy=cfg.mailbox.policy,
            stall_s=cfg.mailbox.stall_s,
        )
        hb = cfg.heartbeat
        self.heartbeat_actor = HeartbeatActor(
            device_id=self.device_id, outbox=self.outbox, ids=self.ids,
            cadence=Cadence(interval_s=hb.interval_s, fast_interval_s=hb.fast_interval_s,
                            system_interval_s=hb.system_interval_s, sample_change_pct=hb.sample_change_pct),
            incarnation=self.incarnation, firmware_version=lambda: self.firmware_version(),
            tags=tuple(cfg.agent.tags), sampler=self.sampler, boot=self.boot, link=self.link,
            # a shared outbox (the simulator's) counts other devices' rows too: not reported then
            outbox_pending=self._outbox_depth if self._owns_stores else None,
            demand=self.job_worker.demand,  # a restarted leader learns it from the next heartbeat
            slots=lambda: self.slot_state(), configs=lambda: self.config_states(), apps=lambda: self.app_states(),
            facts=lambda: self.device_facts(), health=self.health.stated if self.health is not None else None)
        self.heartbeat = self.system.spawn(
            self.heartbeat_actor, name="heartbeat", capacity=4, policy="drop_oldest", stall_s=cfg.mailbox.stall_s,
        )
        self.register_command(KIND_HEARTBEAT_PACE, HeartbeatPace, self.heartbeat)
        self.transport.connected.add_listener(self._on_connection)
        await self.sender.start()
        await self.inbox.start()
        await self.transport.start()
        if self.relay is not None:
            await self.relay.start()
        if self.housekeeping is not None:
            await self.housekeeping.start()
        if self.reserve is not None:
            self.reserve.start(self.clock)

    def _on_connection(self, is_open: bool) -> None:
        if not is_open:
            return
        if self.heartbeat is not None:  # back online: the leader hears at once (with the job demand)
            try:
                self.heartbeat.tell(BeatNow(), coalesce_key="beat-now", seq=0)
            except EdgeAgentError:
                pass

    async def stop(self) -> None:
        """Stop taking work, hand untried rows back, disconnect, flush and close the stores (a
        worker never started closes its stores alone)."""
        if self._started:
            self._started = False
            await self._stop_running()
            if self.health is not None:  # a clean stop: not counted as an unexpected restart
                self.health.close()
        if self._owns_stores and not self._closed:
            self._closed = True
            await self.outbox.close()
            self.ledger.close()

    async def _stop_running(self) -> None:
        if self.reserve is not None:
            await self.reserve.stop()
        if self.housekeeping is not None:
            await self.housekeeping.stop()
        self.transport.connected.remove_listener(self._on_connection)
        await self.inbox.stop()
        # Stop the relay and the actors, then fail the deliveries still waiting for a reply:
        # relay rows are released or retried later, an actor's direct send falls back to the
        # outbox (still open), so stopping never waits out a reply timeout and loses nothing.
        stopping = asyncio.ensure_future(self.relay.stop_within()) if self.relay is not None else None
        draining = asyncio.ensure_future(self.system.stop())
        await asyncio.sleep(0)
        await self.sender.stop()
        if stopping is not None:
            await stopping
        await draining
        await self.transport.stop()

    # -- API -----------------------------------------------------------------------------------
    @property
    def leader_answered(self) -> Gate:
        """Open once the leader accepted a message this process sent (the trial boot's health)."""
        return self.sender.answered

    def beat_now(self) -> None:
        """A full heartbeat at once, coalesced with any already asked for (what the device states
        changed: its slots read after the start)."""
        if self.heartbeat is None:
            return
        with contextlib.suppress(EdgeAgentError):  # a full mailbox: a beat is already on its way
            self.heartbeat.tell(BeatNow(), coalesce_key="beat-now", seq=0)

    def beat_fast(self, for_s: float) -> None:
        """Heartbeat at `[heartbeat] fast_interval_s` for the next `for_s` seconds (the updater
        while an update runs: the rollout's gates see the device as fast as they did)."""
        if self.heartbeat is None or for_s <= 0:
            return
        with contextlib.suppress(EdgeAgentError):  # a full mailbox: a pace is already on its way
            self.heartbeat.tell(Pace(self.config.heartbeat.fast_interval_s, for_s), coalesce_key="pace", seq=0)

    def register_command(self, kind: str, type_: type[msgspec.Struct], ref: ActorRef) -> None:
        """Decode envelopes of `kind` arriving on the down topic as `type_` and route them to
        `ref`: the one way to give a worker a new command."""
        self.kinds.register(kind, type_)
        self._commands[kind] = ref

    async def send_telemetry(self, name: str, value: float | None = None,
                             values: dict[str, float] | None = None, *, timeout_s: float = 30.0) -> str:
        """Send one telemetry record; returns "direct" or "outbox" (it is durable either way)."""
        if self.telemetry is None:
            raise NotConnected("the worker agent is not started")
        result = await self.telemetry.ask(RecordTelemetry(name, value, values), timeout_s=timeout_s)
        return str(result)

    async def message_status(self) -> dict[str, object]:
        """What the local API's `GET /v1/status` answers: the connection, and per application
        class its intake and outbox figures (`class_audit`) and what its 202 promises
        (`durability`: "power", it survives a power cut; "crash", it survives the agent's crash)."""
        stats = await self.outbox.stats()
        oldest = stats.oldest_pending_age_ms
        classes = class_audit(self.messages, stats.by_class)
        for name, entry in classes.items():
            entry["durability"] = self.outbox.durability_of(app_kind(name))
        return {
            "device_id": self.device_id, "connected": self.transport.connected.is_open,
            "outbox_pending": stats.pending, "oldest_pending_age_s": None if oldest is None else oldest / 1000.0,
            "classes": classes,
        }

    def statistics(self) -> dict[str, object]:
        out: dict[str, object] = {"mailboxes": [s.__dict__ for s in self.system.statistics()]}
        if self.relay is not None:
            out["relay"] = self.relay.metrics()
        return out

    # -- as a part of the running agent --------------------------------------------------------
    def databases(self) -> list[Path]:
        """The SQLite files this agent owns (none when its stores were handed in)."""
        return [Path(self.outbox.path), Path(self.ledger.path)] if self._owns_stores else []

    def liveness(self) -> Liveness:
        return {"actors": (self.system.problem, "all actors running")}

    def checks(self) -> Checks:
        from agent.service.checks import agent_checks

        relay = self.relay
        running = (lambda: relay.running) if relay is not None else None
        found = agent_checks(connected=self.transport.connected, database=self.outbox.path, clock=self.clock,
                             data_dir=self.data_dir, relay_running=running, reserve=self.reserve)
        connected = found["transport"]

        async def transport() -> tuple[bool, str]:  # `doctor` shows this line: the budget with it
            ok, detail = await connected()
            per_hour = self.link_usage().get("bytes_per_hour")
            if per_hour is not None:
                detail += f"; {per_hour / 1000:.1f} KB an hour on the air (TLS and TCP/IP headers included)"
            return ok, detail

        found["transport"] = transport
        return found

    def collectors(self) -> Collectors:
        from agent.service.collectors import agent_collectors, per_class_collector, snapshot_collector

        found = agent_collectors(
            relay_metrics=self.relay.metrics if self.relay is not None else None,
            mailbox_statistics=self.system.statistics, outbox_stats=self.outbox.stats,
            housekeeping_metrics=self.housekeeping.metrics if self.housekeeping is not None else None)
        # 1 after a damaged worker.db was moved aside at this start (its job ledger was lost)
        # and 1 after the outbox was moved aside at this start: damaged, or it had lost state
        found["worker"] = snapshot_collector(
            "ea_worker", lambda: {"state_recovered": 1 if self.recovered_from else 0,
                                  "outbox_damaged": 1 if self.outbox.recovered_from else 0,
                                  "outbox_state_lost": 1 if self.outbox.lost_from else 0}, label="state")
        found["messages"] = per_class_collector("ea_messages", self._message_audit, counters=AUDIT_COUNTERS,
                                                help_=AUDIT_HELP)
        found["broker_link"] = snapshot_collector(
            "ea_worker_broker", self.link_usage, counters=("bytes_sent", "bytes_received", "segments"),
            help_={"bytes_sent": "bytes the kernel sent on the broker connections (TLS included)",
                   "bytes_received": "bytes the kernel received on the broker connections (TLS included)",
                   "segments": "TCP segments both ways on the broker connections (each carries 52 header bytes)",
                   "bytes_per_hour": "bytes on the air per hour since the agent started (headers included)"})
        return found

    def link_bytes(self) -> TcpCounters | None:
        """What the broker connections moved: the kernel's counters (`agent.transport.linkbytes`),
        the simulator's model of them, or None where neither is kept."""
        reader = getattr(self.transport, "link_bytes", None)
        return reader() if reader is not None else None

    def link_usage(self) -> dict[str, float]:
        """The broker connection's cost (`link_bytes`) as `/metrics` and `/healthz` show it."""
        counters = self.link_bytes()
        if counters is None:
            return {}
        hours = max(1e-9, (self.clock.monotonic() - self._started_at) / 3600.0)
        return {"bytes_sent": counters.bytes_sent, "bytes_received": counters.bytes_received,
                "segments": counters.segs_out + counters.segs_in, "bytes_per_hour": round(counters.on_air / hours)}

    async def _message_audit(self) -> dict[str, dict[str, object]]:
        classes = (await self.message_status())["classes"]
        assert isinstance(classes, dict)
        return classes

    # -- inbound -------------------------------------------------------------------------------
    async def _on_command(self, envelope: Envelope, _message: InboundMessage) -> Reply:
        ref = self._commands.get(envelope.kind)
        if ref is None:
            return Reply(id=envelope.id, status="rejected", reason=f"unknown command kind {envelope.kind!r}")
        try:
            message = self.kinds.decode_payload(envelope)
        except CodecError as exc:
            return Reply(id=envelope.id, status="rejected", reason=str(exc))
        try:
            ref.tell(message)
        except MailboxFull as exc:
            return Reply(id=envelope.id, status="busy", retry_after_ms=exc.retry_after_ms)
        except EdgeAgentError as exc:
            return Reply(id=envelope.id, status="busy", retry_after_ms=1000, reason=str(exc))
        self.leader_id = envelope.sender
        return Reply(id=envelope.id, status="accepted")

    def _on_rejected(self, reason: str, _payload: bytes, topic: str) -> None:
        self.rejected += 1
        log.warning("refused a message on %s: %s", topic, reason)


__all__ = [
    "LeaderLink",
    "WorkerAgent",
    "WorkerOptions",
    "default_job_handler",
    "next_incarnation",
]
