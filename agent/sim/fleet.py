"""One leader and N workers (or one part of them, `agent.sim.part`): real actors, real outboxes,
real relays.

Only the transport (a `MemoryBroker`, or a real broker with `--broker`) and the clock (virtual
by default) are swapped; with `firmware` the leader runs the rollout service and every device
the real updater, with its installer, health check and reboot simulated (`agent.sim.devices`).

Simulated devices keep their outboxes in a few shared SQLite files: each file holds the rows of
many devices (the row's `owner`), and one relay per file drains it, handing each row to its
owner's `EnvelopeSender`, so it travels over that device's own connection. A device whose uplink
is down answers `Transient` and its row backs off; the file's relay holds everything while the
whole broker is down. Job ledgers are shared per file too.
"""

from __future__ import annotations

import asyncio
import functools
import random
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import msgspec

from agent.app import App, AppEnv, Starting, assemble, make_transport, prepare
from agent.core.clock import Clock
from agent.core.config import AgentConfig, ConfigTargetSection, convert
from agent.core.errors import Transient
from agent.core.gate import Gate
from agent.core.tasks import cancel_and_wait
from agent.leader.agent import LeaderAgent
from agent.leader.env import GatewayEnv
from agent.outbox.reads import FileReads
from agent.outbox.relay import Relay
from agent.outbox.retry import RetryPolicy
from agent.outbox.settings import outbox_classes
from agent.outbox.store import OutboxStore
from agent.outbox.types import OutboxRow
from agent.protocol import KIND_HEARTBEAT, JobOffer
from agent.sim.database import RunSchema
from agent.sim.devices import SimFirmware, sim_hardware
from agent.sim.enrolment import (
    EnrolmentTimes,
    claim_connection,
    issue_token,
    leader_identity,
    share_authority,
    worker_identity,
)
from agent.sim.options import SimOptions
from agent.sim.part import FleetPart, split
from agent.transport.base import Transport
from agent.transport.memory import MemoryBroker
from agent.transport.rounds import RoundBroker
from agent.worker.agent import WorkerAgent
from agent.worker.env import DeviceEnv, SharedStores
from agent.worker.hardware import UpdaterHardware
from agent.worker.jobs import JobLedger
from agent.worker.local_api import LocalApi
from firmware_rollout.orchestration.chunk_server import ConfigServerPool
from rollout_engine.orchestrator import Orchestrator
from rollout_engine.store import RolloutStore


@runtime_checkable
class Rollouts(Protocol):
    """What the simulator drives of the leader's rollout part (`rollouts`): the orchestrator it
    starts rollouts with, the store it reads their state from, the ConfigServers' figures."""

    orchestrator: Orchestrator
    store: RolloutStore
    pools: dict[str, ConfigServerPool]
    artifacts_dir: Path  # the verified copies its rollouts serve (the simulated devices' mirror)

    @property
    def orchestrating(self) -> bool: ...


FLEET = "sim"
SIM_ARCHES = ("aarch64", "armv7l")


def sim_facts(device: str) -> Callable[[], dict[str, str]]:
    """What a simulated device says it is: half the fleet aarch64, half armv7l (by its name)."""
    facts = {"arch": SIM_ARCHES[zlib.crc32(device.encode()) % 2], "board": "simulated board", "os": "edge-agent sim"}
    return lambda: facts
LEADER_ID = "leader-1"
# Attempts spent while a simulated device is offline are real nacks in a shared file's relay;
# a generous cap keeps a long offline period from dead-lettering what the device will resend.
SIM_MAX_ATTEMPTS = 10_000
REMEMBERED_DELIVERIES = 100_000


def rng_for(seed: int, name: str) -> random.Random:
    """A generator owned by one part of the simulation, the same in every run with `seed`."""
    return random.Random(f"{seed}:{name}")


class _LazyRandom:
    """`rng_for(seed, name)`, made on first use: a device's transport draws from its generator
    only to reconnect, and 10,000 idle Mersenne Twister states would hold 2.9 KB each."""

    __slots__ = ("_args", "_rng")

    def __init__(self, seed: int, name: str) -> None:
        self._args = (seed, name)
        self._rng: random.Random | None = None

    def __getattr__(self, attr: str) -> Any:
        rng = self._rng
        if rng is None:
            rng = self._rng = rng_for(*self._args)
        return getattr(rng, attr)


def device_name(index: int) -> str:
    return f"dev-{index:05d}"


def worker_config(opts: SimOptions, device_id: str, *, firmware_key: str = "") -> AgentConfig:
    """A simulated device's config: the fleet's one template, with its own device id; with
    `firmware_key` (the pinned key's file) its updater is on."""
    template = _worker_template(opts, firmware_key)
    return msgspec.structs.replace(template, agent=msgspec.structs.replace(template.agent, device_id=device_id))


@functools.lru_cache(maxsize=4)
def _worker_template(opts: SimOptions, firmware_key: str) -> AgentConfig:
    # Validated once per run: converting the whole config for each of 10,000 devices costs
    # as much as a minute of their fleet time.
    return convert(
        {
            "agent": {"role": "worker", "device_id": device_name(0), "fleet": FLEET, "data_dir": ".",
                      "firmware_version": opts.base_version},
            "firmware": {"public_key": firmware_key},
            # on when the devices' applications send (`app_every_s`), and then served in process
            "local_api": {"enabled": opts.app_every_s > 0},
            "mailbox": {"capacity": 64},
            "heartbeat": {"interval_s": opts.heartbeat_s},
            "jobs": {"demand_window": opts.job_window},
            # "crash": a simulated device's power is never cut; an fsync per commit would only
            # make the laptop running the fleet slower
            "outbox": {"max_attempts": SIM_MAX_ATTEMPTS, "backoff_cap_s": 60.0, "durability": "crash",
                       "classes": {"heartbeat": {"max_messages": 16 * opts.devices},
                                   "telemetry": {"max_messages": 100_000}}},
            "relay": {"partitions": 1, "reconnect_jitter_s": 5.0},
            "mqtt": {"reply_timeout_s": 10.0},
        },
        AgentConfig,
        source="simulate",
    )


def leader_config(opts: SimOptions, *, firmware_key: str = "", name: str = LEADER_ID,
                  database: str = "") -> AgentConfig:
    """The simulated leader's config; with `firmware_key` (the pinned key's file) it takes rollouts;
    with `database`, its registry, messages and rejects are there, shared with the other leaders
    on the shared subscription."""
    shared = {"database": database, "shared_group": "leaders" if opts.leaders > 1 else ""} if database else {}
    return convert(
        {
            "agent": {"role": "leader", "device_id": name, "fleet": FLEET, "data_dir": "."},
            "firmware": {"public_key": firmware_key},
            "artifacts": {"listen": ""},  # devices fetch over MQTT from the leader's ConfigServers
            "mailbox": {"capacity": opts.leader_mailbox_capacity},
            "leader": {"process_interval_s": opts.leader_interval_s,
                       # a beat waits up to one processing interval in the mailbox before it counts
                       # (each device's own deadline follows the interval it announces)
                       "heartbeat_deadline_s": max(30.0, 2 * (opts.leader_interval_s + min(opts.heartbeat_s, 5.0))),
                       "job_window_max": 64, **shared},
            "outbox": {"max_attempts": SIM_MAX_ATTEMPTS, "backoff_cap_s": 60.0, "durability": "crash"},
            "relay": {"partitions": 4, "reconnect_jitter_s": 2.0},
            "mqtt": {"reply_timeout_s": 10.0},
            **({"identity": leader_identity(opts.devices)} if opts.enrol else {}),
        },
        AgentConfig,
        source="simulate",
    )


class SimFleet:
    """Builds, starts and stops the simulated fleet; `workers` by device id."""

    def __init__(self, opts: SimOptions, *, clock: Clock, workdir: Path, firmware: SimFirmware | None = None,
                 rollout_poll_s: float = 2.0, incarnation: int = 1, part: FleetPart | None = None) -> None:
        self.opts = opts
        # Which devices this process runs, and whether the leader is here (every device and the
        # leader, unless the fleet is spread over processes: `agent.sim.processes`).
        self.part = part if part is not None else split(opts.devices, 1)[0]
        self.clock = clock
        self.workdir = workdir
        self.firmware = firmware
        self.rollouts: list[Rollouts] = []  # each leader's rollout part, when the leaders run here
        self._rollout_poll_s = rollout_poll_s
        self._first_incarnation = incarnation  # a fleet started again on its files: above the last
        self.broker: MemoryBroker | None = None
        if opts.broker_url is None and self.part.processes > 1:
            self.broker = RoundBroker(rank=self.part.rank, clock=clock, rng=rng_for(opts.seed, "broker"),
                                      max_queued_per_session=100_000)
        elif opts.broker_url is None:
            self.broker = MemoryBroker(clock=clock, rng=rng_for(opts.seed, "broker"),
                                       max_queued_per_session=100_000)
        self.uplink = Gate(is_open=True)  # closed while the whole (memory) broker is down
        self.leader_apps: list[App[LeaderAgent]] = []  # the first is `leader_app`
        self.crashed_leaders: set[str] = set()
        self._schema: RunSchema | None = None  # `--database`: the run's own schema there
        self.workers: dict[str, WorkerAgent] = {}
        self.apps: dict[str, App[WorkerAgent]] = {}  # each device's parts, as `edge-agent run` assembles them
        self.stores: list[OutboxStore] = []
        self.ledgers: list[JobLedger] = []
        self.relays: list[Relay] = []
        self._cut: set[str] = set()
        self._file_of: dict[str, int] = {}
        self.retired: list[WorkerAgent] = []  # the earlier incarnations of crashed devices
        self.down: set[str] = set()  # crashed, not restarted yet
        self._delivered: OrderedDict[str, None] = OrderedDict()
        self.redeliveries_suppressed = 0
        self._readers: list[FileReads] = []  # `pending_rows`
        self.config_steps: dict[str, list[tuple[str, float]]] = {}  # device -> (apply step, clock's monotonic)
        # --enrol: each device enrols at its first boot, then is assembled (`agent.sim.enrolment`)
        self.enrolment = EnrolmentTimes() if opts.enrol else None
        self._identity = worker_identity(workdir) if opts.enrol else None  # every device's, converted once
        self._booting: dict[str, asyncio.Task[None]] = {}
        self._stopping = asyncio.Event()  # the fleet stops: a device still waiting to enrol gives up

    def _transport(self, config: AgentConfig, name: str) -> Transport:
        rng = cast(random.Random, _LazyRandom(self.opts.seed, f"transport:{name}"))
        return make_transport(config, clock=self.clock, broker_url=self.opts.broker_url,
                              memory_broker=self.broker, rng=rng)

    @property
    def _firmware_key(self) -> str:
        return str(self.firmware.public_key) if self.firmware is not None else ""

    async def open(self) -> None:
        opts = self.opts
        part = self.part
        if part.leader:
            database = ""
            if opts.database is not None:
                self._schema = RunSchema(opts.database, opts.seed)
                database = self._schema.create()
            for n in range(opts.leaders):
                name = leader_name(n)
                lcfg = leader_config(opts, firmware_key=self._firmware_key, name=name, database=database)
                env = GatewayEnv(rng=rng_for(opts.seed, "leader" if n == 0 else name),
                                 intake_batch_max=max(512, opts.devices), rollout_poll_s=self._rollout_poll_s)
                self.leader_apps.append(await assemble(
                    lcfg, transport=self._transport(lcfg, name), clock=self.clock,
                    base=self.workdir / ("leader" if n == 0 else name), env=AppEnv(gateway=env)))
                if n == 0 and opts.enrol and lcfg.identity is not None:  # one fleet, one CA
                    share_authority(self.workdir / "leader", [self.workdir / leader_name(k)
                                                              for k in range(1, opts.leaders)], lcfg.identity)
            if opts.enrol:
                issue_token(self.leader_apps[0].agent, self.workdir, len(part.indices), self.clock)
            for app in self.leader_apps:
                rollout = app.part("rollouts")
                assert isinstance(rollout, Rollouts)
                self.rollouts.append(rollout)
        files = min(opts.files, len(part.indices))
        wcfg0 = worker_config(opts, device_name(0))
        for k in range(files):
            self.stores.append(await OutboxStore.open(
                self.workdir / f"outbox-{k}.db", clock=self.clock, max_attempts=SIM_MAX_ATTEMPTS,
                classes=outbox_classes(wcfg0), durability=wcfg0.outbox.durability))
            self.ledgers.append(JobLedger.open(self.workdir / f"ledger-{k}.db", clock=self.clock,
                                               synchronous="NORMAL"))
        for n, i in enumerate(part.indices):
            device = device_name(i)
            self._file_of[device] = n % files
            if self.enrolment is not None:
                self.enrolment.devices += 1
            else:  # (enrolling: assembled at its boot, once the leaders run)
                await self._assemble(device, incarnation=self._first_incarnation)
        for k, store in enumerate(self.stores):
            self.relays.append(Relay(
                store, self._route, clock=self.clock, ready=self.uplink, partitions=1,
                retry=RetryPolicy(base_s=1.0, cap_s=60.0, transient_floor_s=0.5),
                rng=rng_for(opts.seed, part.scoped(f"relay:{k}")), reconnect_jitter_s=5.0,
                name=f"relay:file{k}"))

    async def _assemble(self, device: str, *, incarnation: int) -> WorkerAgent | None:
        """Build a device's agent and its parts as `edge-agent run` does (its stages first: with
        `--enrol`, its enrolment), on the fleet's shared files and the simulated hardware; None
        when the fleet stopped while it waited for its certificate."""
        firmware = self.firmware
        silent = firmware is None or firmware.fate(device).silent  # a silent device pins no key: no updater
        cfg = worker_config(self.opts, device, firmware_key="" if silent else self._firmware_key)
        targets = firmware.config_targets if firmware is not None else None
        if targets is not None:  # its own folder: each device's documents apart
            etc = self.device_dir(device) / "etc" / "app"
            if not etc.is_dir():
                etc.mkdir(parents=True)
                (etc / "app.toml").write_bytes(targets.factory)
            cfg = msgspec.structs.replace(cfg, config_targets={"app": ConfigTargetSection(
                directory=str(etc), confirm_s=targets.confirm_s, settle_s=targets.settle_s)})
        k = self._file_of[device]
        suffix = "" if incarnation == self._first_incarnation else f":{incarnation}"
        env = DeviceEnv(rng=rng_for(self.opts.seed, device + suffix), sample_system=False, job_handler=self._job,
                        failure_logs=False,
                        stores=SharedStores(outbox=self.stores[k], ledger=self.ledgers[k], incarnation=incarnation),
                        updater_hardware=self._hardware, api_sockets=False,
                        config_steps=self._config_step if targets is not None else None,
                        apps_hardware=self._apps_hardware(firmware), facts=sim_facts(device),
                        claim_transport=claim_connection(self.broker) if self.broker is not None else None)
        if self._identity is not None:
            cfg = msgspec.structs.replace(cfg, identity=self._identity)
        prepared = await prepare(cfg, clock=self.clock, base=self.device_dir(device), env=AppEnv(device=env),
                                 starting=Starting(stopping=self._stopping))
        if prepared is None:
            return None
        app = await assemble(prepared, transport=self._transport(prepared, device + suffix), clock=self.clock,
                             base=self.device_dir(device), env=AppEnv(device=env))
        self.apps[device] = app
        self.workers[device] = app.agent
        return app.agent

    def _apps_hardware(self, firmware: SimFirmware | None) -> Callable[[WorkerAgent], Any] | None:
        """The simulated application helper and mirror, when the fleet runs applications."""
        if firmware is None or firmware.apps is None:
            return None
        from agent.sim.apps import sim_app_hardware

        def artifacts() -> Path:
            service = self.rollout
            assert service is not None, "an application rollout runs on a leader with rollouts"
            return service.artifacts_dir

        return sim_app_hardware(firmware.apps, firmware.verify_key, artifacts)

    def _config_step(self, worker: WorkerAgent, target: str, step: str) -> None:
        """A config that cuts its device off: the uplink goes when it is applied, and comes back
        when the device reverts it. Each step's fleet time is kept (`config_steps`)."""
        device = worker.device_id
        self.config_steps.setdefault(device, []).append((step, self.clock.monotonic()))
        targets = self.firmware.config_targets if self.firmware is not None else None
        if targets is None or device not in targets.cuts:
            return
        if step == "applied":
            self.cut(device)
        elif step == "reverted":
            self.heal(device)

    def _hardware(self, worker: WorkerAgent) -> UpdaterHardware:
        assert self.firmware is not None
        return sim_hardware(self.firmware, worker, state_dir=self.device_dir(worker.device_id))

    async def _route(self, row: OutboxRow) -> None:
        worker = self.workers.get(row.owner)
        if worker is None:
            raise Transient(f"no simulated device {row.owner!r}")
        if not worker.transport.connected.is_open:
            raise Transient(f"{row.owner} is offline")
        if row.msg_id in self._delivered:
            # The relay handed out a row it had already delivered (its ack still being written).
            # Sending it again would be harmless (the leader deduplicates) but would make the
            # run depend on thread timing; count it instead (in the report's `wall` section).
            self.redeliveries_suppressed += 1
            return
        await worker.deliver_row(row)
        self._delivered[row.msg_id] = None
        if len(self._delivered) > REMEMBERED_DELIVERIES:
            self._delivered.popitem(last=False)

    async def _job(self, offer: JobOffer) -> bytes:
        # The duration depends on the job alone, not on which device happens to run it first.
        spread = zlib.crc32(f"{self.opts.seed}:{offer.job_id}".encode()) % 1000 / 1000.0
        await self.clock.sleep(self.opts.job_work_s * (0.5 + spread))
        return offer.payload

    @property
    def leader_app(self) -> App[LeaderAgent] | None:
        """The first leader that has not crashed (None: no leader in this process)."""
        return next((a for a in self.leader_apps if a.agent.device_id not in self.crashed_leaders), None)

    @property
    def leader(self) -> LeaderAgent | None:
        app = self.leader_app
        return app.agent if app is not None else None

    @property
    def leaders(self) -> list[LeaderAgent]:
        """Every leader of the run, crashed ones included (their counters count)."""
        return [a.agent for a in self.leader_apps]

    def living_leaders(self) -> list[LeaderAgent]:
        return [a.agent for a in self.leader_apps if a.agent.device_id not in self.crashed_leaders]

    @property
    def rollout(self) -> Rollouts | None:
        """The rollout part of the living leader running the rollouts (several leaders: the holder
        of the orchestrator lease), else of the first living one (None: no leader here)."""
        living = [part for app, part in zip(self.leader_apps, self.rollouts, strict=True)
                  if app.agent.device_id not in self.crashed_leaders]
        return next((part for part in living if part.orchestrating), living[0] if living else None)

    @property
    def job_leader(self) -> LeaderAgent | None:
        """The living leader running the fleet's job queue (several leaders: the holder of its
        lease), else the first living one (None: no leader in this process)."""
        living = self.living_leaders()
        return next((each for each in living if each.jobs_queue.held), living[0] if living else None)

    async def crash_leader(self) -> None:
        """The first leader dies: its connection breaks at once (the broker publishes its will and
        hands its share of the uplinks to the others), unanswered messages stay with their
        devices, and its memory is gone. It is not started again."""
        app = self.leader_apps[0]
        name = app.agent.device_id
        if self.broker is not None:
            self.broker.partition(app.agent.transport.client_id)
        self.crashed_leaders.add(name)
        await app.stop()

    async def start_leader(self) -> None:
        """Start the leaders (when they run in this process) with their parts, and the relays."""
        for app in self.leader_apps:
            await app.start()
        for relay in self.relays:
            await relay.start()

    async def start_worker(self, device: str) -> None:
        """Start a device's agent and its parts (with firmware, a boot: the updater resumes what
        its database says was in progress). Enrolling (`--enrol`), its first boot enrols it and
        assembles it first, in a task of its own: the fleet's time goes on while it waits."""
        if device in self.apps:
            await self.apps[device].start()
        elif device not in self._booting:
            self._booting[device] = asyncio.create_task(self._first_boot(device), name=f"boot:{device}")

    async def _first_boot(self, device: str) -> None:
        booted = self.clock.monotonic()
        if await self._assemble(device, incarnation=self._first_incarnation) is None:
            return  # the fleet stopped while it waited for its certificate
        if self.enrolment is not None:
            self.enrolment.seconds[device] = self.clock.monotonic() - booted
        await self.apps[device].start()

    def local_api(self, device: str) -> LocalApi | None:
        """The local API of the device's current incarnation (None: off, or the device is down)."""
        if device in self.down:
            return None
        api = self.apps[device].part(LocalApi.name)
        return api if isinstance(api, LocalApi) else None

    def device_dir(self, device: str) -> Path:
        """A simulated device's own files (its updater database and slots)."""
        return self.workdir / "devices" / device

    def active_version(self, device: str) -> str:
        """The firmware the device runs now, as its heartbeat reports it."""
        return self.workers[device].firmware_version()

    async def stop(self) -> None:
        self._stopping.set()
        for task in self._booting.values():
            await cancel_and_wait(task)
        for app in self.apps.values():
            await app.stop()
        for relay in self.relays:
            await relay.stop()
        for gateway in self.leader_apps:
            if gateway.agent.device_id not in self.crashed_leaders:
                await gateway.stop()
        if self._schema is not None:
            self._schema.drop()
            self._schema = None
        for reads in self._readers:
            reads.close()
        self._readers = []
        for store in self.stores:
            await store.close()
        for ledger in self.ledgers:
            ledger.close()

    # -- crashes: the process dies, its SQLite state survives ---------------------------------
    async def crash(self, device: str) -> None:
        """Stop the device's agent (its actors' memory is gone; its outbox rows stay in the
        shared file, where the file's relay keeps them until the device is back). A device still
        enrolling at its first boot has nothing running to crash."""
        if device not in self.apps:
            return
        self.down.add(device)
        await self.apps[device].stop()

    async def restart(self, device: str) -> None:
        """Start the device again as its next incarnation, on the same outbox and ledger."""
        old = self.workers[device]
        self.retired.append(old)
        worker = await self._assemble(device, incarnation=old.incarnation + 1)
        if worker is None:
            return
        self.down.discard(device)
        await self.apps[device].start()
        if device in self._cut and self.broker is not None:
            self.broker.partition(worker.transport.client_id)

    def all_workers(self) -> list[WorkerAgent]:
        """Every incarnation of every device (the counters of crashed ones count too)."""
        return [*self.retired, *self.workers.values()]

    def online(self) -> int:
        return sum(1 for w in self.workers.values() if w.transport.connected.is_open)

    # -- failure injection (memory broker only) ----------------------------------------------
    def cut(self, device: str) -> None:
        if self.broker is not None:
            self._cut.add(device)
            self.broker.partition(self.workers[device].transport.client_id)

    def is_cut(self, device: str) -> bool:
        return device in self._cut

    def heal(self, device: str) -> None:
        if self.broker is not None:
            self._cut.discard(device)
            self.broker.heal(self.workers[device].transport.client_id)

    def broker_down(self) -> None:
        if self.broker is not None:
            self.uplink.close()
            self.broker.partition()

    def broker_up(self) -> None:
        if self.broker is not None:
            self.broker.heal()
            for device in sorted(self._cut):  # still in their own offline period
                self.broker.partition(self.workers[device].transport.client_id)
            self.uplink.open()

    def heal_all(self) -> None:
        """End every fault of the network: the broker is back, every device's uplink too."""
        self.broker_up()
        for device in sorted(self._cut):
            self.heal(device)

    async def outbox_pending(self) -> int:
        total = 0
        for store in self.stores:
            total += (await store.stats()).pending
        for leader in self.living_leaders():
            total += (await leader.outbox.stats()).pending
        return total

    def pending_rows(self) -> int:
        """Rows pending in the devices' outbox files now, read on read-only connections of the
        fleet's own: no await, so a progress display calling it never reorders the run."""
        return sum(reads.pending() for reads in self._file_readers())

    def held_heartbeats(self) -> set[str]:
        """The devices whose newest heartbeat is still held in their outbox file (OVERWRITE keeps
        one row per device, always the newest made): a device stopped before it was delivered."""
        return {owner for reads in self._file_readers() for owner in reads.owners_pending(KIND_HEARTBEAT)}

    def _file_readers(self) -> list[FileReads]:
        if len(self._readers) != len(self.stores):
            self._readers = [FileReads(store.path) for store in self.stores]
        return self._readers

    async def pending_of(self, message_class: str) -> int:
        """Rows of one message class pending in the devices' outbox files."""
        total = 0
        for store in self.stores:
            by_class = (await store.stats()).by_class.get(message_class)
            total += by_class.pending if by_class is not None else 0
        return total

    def relay_metrics(self) -> list[Any]:
        out = [relay.metrics() for relay in self.relays]
        out.extend(leader.relay.metrics() for leader in self.living_leaders())
        return out


def leader_name(n: int) -> str:
    """The n-th simulated leader's device id (from 0): leader-1, leader-2, ..."""
    return LEADER_ID if n == 0 else f"leader-{n + 1}"


__all__ = ["FLEET", "LEADER_ID", "SimFleet", "device_name", "leader_config", "leader_name", "rng_for",
           "worker_config"]
