"""A leader and N simulated devices in one process, for rollout scenarios and tests.

Real parts: the `LeaderAgent` (registry, inbox, outbox and relay for offers) with the rollout
service (orchestrator, report intake, ConfigServers), and per device the `UpdaterActor` driving
a real `Updater` (SQLite state, A/B slot directories, signature and chunk checks, health check,
commit or revert) whose reports go through a durable outbox (one SQLite file shared by the
simulated devices, rows owned by device) and a relay. Swapped: the transport
(`MemoryBroker`), the clock (usually a `VirtualClock`), and the device's heartbeat, which the
fleet sends for every online device on one timer instead of one actor per device.

A device's fate is set per device: `health_fails` (rolled back after the trial boot),
`install_fails` (the slot write fails), `silent` (never answers an offer: the leader's
delivery times out and the device times out).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sqlite3
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.actors import ActorRef, ActorSystem
from agent.core.clock import Clock
from agent.core.codec import Envelope, Reply, encode
from agent.core.config import AgentConfig, AgentSection, LeaderSection, MqttSection
from agent.core.errors import CodecError, EdgeAgentError, MailboxFull
from agent.core.gate import Gate
from agent.core.ids import IdGenerator
from agent.leader.agent import LEADER_DB, LeaderAgent
from agent.leader.rollout import RolloutService, attach_rollout
from agent.outbox.relay import Relay
from agent.outbox.retry import RetryPolicy
from agent.outbox.store import OutboxStore
from agent.outbox.types import OutboxRow
from agent.protocol import REGISTRY, Heartbeat
from agent.transport import topics
from agent.transport.base import InboundMessage, Will
from agent.transport.endpoint import EnvelopeInbox, EnvelopeSender, envelope_from_row
from agent.transport.memory import MemoryBroker, MemoryTransport
from agent.worker.updater_actor import InProcessRebooter, UpdaterActor
from firmware_rollout.config_server import ChunkClient
from firmware_rollout.errors import InstallError
from firmware_rollout.health import HealthResult
from firmware_rollout.keys import VerifyKey
from firmware_rollout.manifest import Manifest
from firmware_rollout.messages import UpdateOffer
from firmware_rollout.slots import DirectoryInstaller
from firmware_rollout.updater import ReportSink, Updater, UpdaterSettings

FLEET = "sim"
HEARTBEAT_S = 30.0  # the simulated devices' heartbeat interval (one fleet-wide timer)


@dataclass
class DeviceFate:
    health_fails: bool = False
    install_fails: bool = False
    silent: bool = False


class SimHealth:
    """Passes when the device is connected, unless its fate says the new image is broken."""

    def __init__(self, device: SimDevice) -> None:
        self._device = device

    async def check(self, clock: Clock, timeout_s: float) -> HealthResult:
        if self._device.fate.health_fails:
            return HealthResult(False, "service did not come up on the new image (simulated)")
        if not self._device.transport.connected.is_open:
            return HealthResult(False, "broker not reached")
        return HealthResult(True, "connected")


class FailingInstaller(DirectoryInstaller):
    async def write(self, slot: str, image: Path, manifest: Manifest) -> None:
        raise InstallError(f"cannot write slot {slot}: simulated flash failure")


@dataclass
class SimDevice:
    device_id: str
    fleet: SimFleet
    state_dir: Path
    tags: tuple[str, ...]
    fate: DeviceFate
    transport: MemoryTransport = field(init=False)
    sender: EnvelopeSender = field(init=False)
    inbox: EnvelopeInbox = field(init=False)
    actor: UpdaterActor = field(init=False)
    ref: ActorRef | None = None
    rebooter: InProcessRebooter = field(default_factory=InProcessRebooter)
    hb_seq: int = 0
    offers_seen: int = 0

    def __post_init__(self) -> None:
        fleet = self.fleet
        presence = topics.presence(FLEET, self.device_id)
        self.transport = MemoryTransport(
            fleet.broker,
            f"dev-{self.device_id}",
            will=Will(presence, topics.OFFLINE),
            birth=Will(presence, topics.ONLINE),
        )
        self.ids = IdGenerator(fleet.clock, random.Random(f"{fleet.seed}:{self.device_id}"))
        self.sender = EnvelopeSender(
            self.transport, clock=fleet.clock, reply_topic=topics.reply(FLEET, self.device_id, "relay"), timeout_s=30.0
        )
        self.inbox = EnvelopeInbox(
            self.transport,
            topic_filter=topics.down(FLEET, self.device_id),
            handler=self._on_command,
            sender_check=False,
        )
        chunks = ChunkClient(
            self.transport, clock=fleet.clock, fleet=FLEET, device_id=self.device_id, ids=self.ids, timeout_s=30.0
        )
        self.actor = UpdaterActor(
            device_id=self.device_id,
            open_updater=self._open_updater,
            chunks=chunks,
            outbox=fleet.device_outbox,
            ids=self.ids,
            rebooter=self.rebooter,
            utc_offset_s=lambda: 0.0,
        )

    async def _open_updater(self, sink: ReportSink) -> Updater:
        fleet = self.fleet
        installer = None
        if self.fate.install_fails:
            installer = FailingInstaller(self.state_dir / "slots", clock=fleet.clock)
        return await Updater.open(
            self.state_dir,
            device_id=self.device_id,
            verify_key=fleet.verify_key,
            clock=fleet.clock,
            health=SimHealth(self),
            rebooter=self.rebooter,
            installer=installer,
            initial_version=fleet.base_version,
            settings=fleet.updater_settings,
            on_report=sink,
        )

    async def start(self) -> None:
        await self.sender.start()
        await self.inbox.start()
        await self.transport.start()
        self.ref = self.fleet.devices_system.spawn(self.actor, name=f"updater:{self.device_id}", capacity=2)

    async def _on_command(self, env: Envelope, _message: InboundMessage) -> Reply:
        try:
            message = REGISTRY.decode_payload(env)
        except CodecError as exc:
            return Reply(id=env.id, status="rejected", reason=str(exc))
        if not isinstance(message, UpdateOffer):
            return Reply(id=env.id, status="rejected", reason=f"unknown command kind {env.kind!r}")
        if self.fate.silent:
            await asyncio.Event().wait()  # never answers: the sender times out
        self.offers_seen += 1
        assert self.ref is not None
        try:
            self.ref.tell(message)
        except MailboxFull as exc:
            return Reply(id=env.id, status="busy", retry_after_ms=exc.retry_after_ms)
        except EdgeAgentError as exc:
            return Reply(id=env.id, status="busy", retry_after_ms=1000, reason=str(exc))
        return Reply(id=env.id, status="accepted")

    @property
    def active_version(self) -> str:
        updater = self.actor.updater
        return updater.active_version if updater is not None else self.fleet.base_version

    async def heartbeat(self) -> None:
        if not self.transport.connected.is_open:
            return
        # The seq must keep growing across restarts of the simulated device: the clock's ms do.
        self.hb_seq = max(self.hb_seq + 1, self.fleet.clock.now_ms())
        beat = Heartbeat(
            device_id=self.device_id,
            seq=self.hb_seq,
            uptime_s=float(self.hb_seq),
            firmware_version=self.active_version,
            tags=self.tags,
        )
        env = Envelope(
            id=self.ids.next(),
            kind="heartbeat",
            sender=self.device_id,
            receiver="leader",
            key="heartbeat",
            conflict="overwrite",
            seq=self.hb_seq,
            ts_ms=self.fleet.clock.now_ms(),
            payload=encode(beat),
        )
        with contextlib.suppress(EdgeAgentError):
            await self.sender.deliver(env, topics.up(FLEET, self.device_id))

    def go_offline(self) -> None:
        self.fleet.broker.partition(self.transport.client_id)

    def go_online(self) -> None:
        self.fleet.broker.heal(self.transport.client_id)

    async def stop(self) -> None:
        await self.inbox.stop()
        await self.sender.stop()
        await self.transport.stop()


class SimFleet:
    """Build with `await SimFleet.open(...)`, then `await fleet.start()`."""

    leader_config: AgentConfig  # set by `open`

    def __init__(
        self,
        *,
        clock: Clock,
        work_dir: Path,
        verify_key: VerifyKey,
        seed: int = 0,
        base_version: str = "1.0.0",
        heartbeat_s: float = HEARTBEAT_S,
        poll_s: float = 2.0,
        updater_settings: UpdaterSettings | None = None,
    ) -> None:
        self.clock = clock
        self.work_dir = work_dir
        self.verify_key = verify_key
        self.seed = seed
        self.base_version = base_version
        self.heartbeat_s = heartbeat_s
        self.poll_s = poll_s
        self.updater_settings = updater_settings or UpdaterSettings(
            health_timeout_s=30.0, fetch_timeout_s=30.0, fetch_backoff_base_s=1.0, fetch_backoff_cap_s=30.0
        )
        self.broker = MemoryBroker(clock=clock, rng=random.Random(seed))
        self.devices: dict[str, SimDevice] = {}
        self.devices_system = ActorSystem(clock=clock, name="devices")
        self.device_outbox: OutboxStore
        self.device_relay: Relay
        self.leader: LeaderAgent
        self.rollout: RolloutService
        self._hb_task: asyncio.Task[None] | None = None
        self._relay_gate = Gate(is_open=True)
        self._depth_conn: sqlite3.Connection | None = None

    @classmethod
    async def open(cls, **kwargs: object) -> SimFleet:
        fleet = cls(**kwargs)  # type: ignore[arg-type]
        (fleet.work_dir / "devices").mkdir(parents=True, exist_ok=True)
        fleet.device_outbox = await OutboxStore.open(
            fleet.work_dir / "devices" / "outbox.db", clock=fleet.clock, max_attempts=1000
        )
        fleet.device_relay = Relay(
            fleet.device_outbox,
            fleet._deliver_report,
            clock=fleet.clock,
            ready=fleet._relay_gate,
            partitions=4,
            retry=RetryPolicy(base_s=1.0, cap_s=30.0, transient_floor_s=0.5),
            rng=random.Random(fleet.seed),
            reconnect_jitter_s=0.0,
            name="relay:devices",
        )
        config = AgentConfig(
            agent=AgentSection(device_id="leader", role="leader", fleet=FLEET, data_dir=str(fleet.work_dir / "leader")),
            leader=LeaderSection(heartbeat_deadline_s=fleet.heartbeat_s * 3),
            mqtt=MqttSection(reply_timeout_s=10.0),
        )
        fleet.leader_config = config
        return fleet

    @property
    def leader_db(self) -> Path:
        return self.work_dir / "leader" / LEADER_DB

    async def start_leader(self) -> None:
        presence = topics.presence(FLEET, "leader")
        transport = MemoryTransport(
            self.broker, "leader", will=Will(presence, topics.OFFLINE), birth=Will(presence, topics.ONLINE)
        )
        self.leader = await LeaderAgent.open(
            self.leader_config,
            transport=transport,
            clock=self.clock,
            data_dir=self.work_dir / "leader",
            rng=random.Random(self.seed + 1),
        )
        await self.leader.start()
        self.rollout = await attach_rollout(self.leader, db_path=self.leader_db, poll_s=self.poll_s)

    async def stop_leader(self) -> None:
        await self.rollout.stop()
        self.rollout.store.close()
        await self.leader.stop()

    def add_device(self, device_id: str, *, tags: tuple[str, ...] = (), fate: DeviceFate | None = None) -> SimDevice:
        device = SimDevice(
            device_id=device_id,
            fleet=self,
            state_dir=self.work_dir / "devices" / device_id,
            tags=tags,
            fate=fate or DeviceFate(),
        )
        self.devices[device_id] = device
        return device

    async def start(self) -> None:
        await self.start_leader()
        await self.devices_system.start()
        for device in self.devices.values():
            await device.start()
        await self.device_relay.start()
        self._hb_task = asyncio.get_running_loop().create_task(self._heartbeats(), name="fleet-heartbeats")

    async def start_device(self, device: SimDevice) -> None:
        await device.start()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.gather(*(d.heartbeat() for d in list(self.devices.values())))
            await self.clock.sleep(self.heartbeat_s)

    async def _deliver_report(self, row: OutboxRow) -> None:
        device = self.devices.get(row.owner)
        if device is None:
            from agent.core.errors import Permanent

            raise Permanent(f"no simulated device {row.owner!r}")
        await device.sender.deliver(envelope_from_row(row), topics.up(FLEET, row.owner))

    async def run_until(
        self,
        done: Callable[[], bool],
        *,
        max_s: float,
        step_s: float = 5.0,
        on_step: Callable[[], None] | None = None,
    ) -> bool:
        """Advance the (virtual) clock in steps until `done()` or `max_s` passed. `on_step` is
        called after every step; it must only read (a progress display), never await."""
        advance = getattr(self.clock, "advance", None)
        waited = 0.0
        while not done():
            if waited >= max_s:
                return False
            if advance is not None:
                await advance(step_s)
            else:
                await self.clock.sleep(step_s)
            waited += step_s
            if on_step is not None:
                on_step()
        return True

    def connected(self) -> int:
        """Simulated devices whose transport is connected now."""
        return sum(1 for d in self.devices.values() if d.transport.connected.is_open)

    def outbox_depth(self) -> int:
        """Rows pending in the devices' shared outbox file (update reports not yet delivered),
        read on a read-only connection of its own: no await, so it never reorders the run."""
        if self._depth_conn is None:
            uri = (self.work_dir / "devices" / "outbox.db").resolve().as_uri() + "?mode=ro"
            self._depth_conn = sqlite3.connect(uri, uri=True)
        row = self._depth_conn.execute("SELECT COALESCE(SUM(pending), 0) FROM outbox_classes").fetchone()
        return int(row[0])

    async def stop(self) -> None:
        if self._hb_task is not None:
            self._hb_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._hb_task
        await self._while_time_runs(self.device_relay.stop())
        await self._while_time_runs(self.devices_system.stop())
        for device in self.devices.values():
            await device.stop()
        await self._while_time_runs(self.stop_leader())
        if self._depth_conn is not None:
            self._depth_conn.close()
            self._depth_conn = None
        await self.device_outbox.close()

    async def _while_time_runs(self, coro: Coroutine[Any, Any, object]) -> None:
        """Await `coro`, moving a virtual clock on meanwhile: a shutdown waits (on the clock) for
        actors still busy, e.g. a device downloading after the leader timed it out."""
        task = asyncio.ensure_future(coro)
        advance = getattr(self.clock, "advance", None)
        while advance is not None and not task.done():
            await advance(0.5)
        await task


__all__ = ["FLEET", "HEARTBEAT_S", "DeviceFate", "FailingInstaller", "SimDevice", "SimFleet", "SimHealth"]
