"""The rollout on the leader: orchestrator, report intake and ConfigServers wired into `LeaderAgent`.

    device ──firmware.report──► LeaderAgent inbox ──► ReportIntake actor (bounded; busy when full)
                                                          └─► Orchestrator.on_report (one transaction,
                                                              deduplicated by message id)
    device ──firmware.chunk───► LeaderAgent inbox ──► ConfigServerPool of that rollout
                                                      (servers x bounded mailboxes from the spec)
    device ──HTTP Range GET───► ArtifactServer ([artifacts] listen; at most max_downloads at once,
                                                 then 503 Retry-After) ──► the store's verified copies
    Orchestrator.run() ──offers──► leader OutboxStore (key per rollout, device) ──► relay ──► devices
                         ◄── controls written by `edge-agent rollout ...` into leader.db

`rollout_part(leader, env)` builds it (a part of the leader, `agent.app`): started after the
leader, stopped before it. Its tables live where the fleet's registry does: `leader.db`, whose
one leader runs the orchestrator, or the fleet's PostgreSQL database, where every leader serves
chunks and the one holding the orchestrator lease (`rollout_engine.lease`)
runs the orchestrator and applies reports; the others answer reports busy (the device sends
its report again, and the broker hands it to a leader of the group) and take the lease over
when its holder stops renewing it. The service asks of the leader only what `RolloutHost` names. Controls
written by the CLI are picked up on the orchestrator's tick (every `poll_s`, one indexed read);
in-process callers use `service.orchestrator.control(...)`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec

from agent.actors import Actor, ActorRef, ActorSystem, Context
from agent.core.clock import Clock
from agent.core.codec import Envelope, Reply, encode
from agent.core.config import AgentConfig
from agent.core.errors import ConfigError, EdgeAgentError, MailboxFull, StoreError, store_log_level
from agent.core.ids import IdGenerator
from agent.core.lease import CHANNEL as LEASES
from agent.core.tasks import cancel_and_wait
from agent.leader.agent import LeaderAgent, Route
from agent.leader.env import GatewayEnv
from agent.leader.registry import DeviceRecord
from agent.leader.rollout_kinds import ROLLOUT_KINDS, KindEntry
from agent.outbox.types import OutboxMessage
from agent.protocol import KIND_HEARTBEAT_PACE, AppState, ConfigState, HeartbeatPace
from agent.service.checks import Check, lease_check, problem_check, task_check
from agent.service.files import artifact_tls
from agent.service.parts import Checks, Collectors, PartBase
from agent.service.prom import Collector, MetricFamily, family
from firmware_rollout.artifact.manifest import SignedManifest, parse_signed_manifest
from firmware_rollout.messages import KIND_CHUNK_REQUEST, ChunkRequest
from firmware_rollout.orchestration.artifact_server import ArtifactServer
from firmware_rollout.orchestration.chunk_server import ConfigServerPool
from rollout_engine.errors import ReportRefused
from rollout_engine.keys import Verifier
from rollout_engine.kinds import Outgoing
from rollout_engine.lease import OrchestratorLease, lease_of
from rollout_engine.messages import KIND_ROLLOUT_REPORT, RolloutReport
from rollout_engine.orchestrator import Orchestrator
from rollout_engine.plan import DeviceInfo
from rollout_engine.status import describe
from rollout_engine.store import RolloutRow, RolloutStore
from rollout_engine.trust import TrustedKeys, load_fleet_keys

if TYPE_CHECKING:
    from config_rollout.layer_store import LayerStore
    from config_rollout.layers import LayerValue

log = logging.getLogger(__name__)
STANDBY_TRY_S = 1.0  # a standby tries to take the orchestrator lease this often

REPORT_BUSY_MS = 500
HTTP_RETRY_S = 5.0  # how often a leader whose artifact port is taken tries it again


@dataclass(slots=True)
class _Report:
    msg_id: str
    report: RolloutReport
    done: asyncio.Future[bool]


class ReportIntake(Actor):
    """Applies device reports one at a time; the inbox answers after the commit."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self._orchestrator = orchestrator
        self.applied = 0
        self.duplicates = 0

    async def receive(self, message: object, ctx: Context) -> None:
        assert isinstance(message, _Report)
        try:
            changed = await self._orchestrator.on_report(message.msg_id, message.report)
        except EdgeAgentError as exc:
            if not message.done.done():
                message.done.set_exception(exc)
            return
        if changed:
            self.applied += 1
        else:
            self.duplicates += 1
        if not message.done.done():
            message.done.set_result(changed)


class _Devices(Protocol):
    def devices(self) -> list[DeviceRecord]: ...
    def config_states(self) -> dict[str, tuple[tuple[str, ...], dict[str, ConfigState]]]: ...
    def app_states(self) -> dict[str, dict[str, AppState]]: ...


class _Offers(Protocol):
    async def enqueue_many(self, msgs: Sequence[OutboxMessage], /) -> object: ...


class RolloutHost(Protocol):
    """What the rollout service needs of the leader (`LeaderAgent` is one)."""

    @property
    def config(self) -> AgentConfig: ...
    @property
    def device_id(self) -> str: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def ids(self) -> IdGenerator: ...
    @property
    def system(self) -> ActorSystem: ...
    @property
    def registry(self) -> _Devices: ...
    @property
    def outbox(self) -> _Offers: ...

    def register_route(self, kind: str, type_: type[msgspec.Struct], route: Route) -> None: ...


class LeaderPort:
    """The orchestrator's view of the leader: the registry's devices, the outbox for what it sends."""

    def __init__(self, leader: RolloutHost) -> None:
        self._leader = leader

    def devices(self) -> Sequence[DeviceInfo]:
        return [
            DeviceInfo(device_id=d.device_id, firmware_version=d.firmware_version, tags=d.tags, online=d.online,
                       last_seen_ms=d.last_seen_ms, first_seen_ms=d.first_seen_ms, facts=d.facts)
            for d in self._leader.registry.devices()
        ]

    async def send(self, messages: Sequence[Outgoing], *, ttl_ms: int) -> None:
        leader = self._leader
        await leader.outbox.enqueue_many([
            OutboxMessage(msg_id=leader.ids.next(), owner=leader.device_id, receiver=m.device, kind=m.kind,
                          payload=m.payload, key=m.key, ttl_ms=ttl_ms)  # (also the MQTT message expiry)
            for m in messages])

    async def ask_fast_heartbeats(self, devices: Sequence[str], *, for_s: float) -> None:
        leader = self._leader
        pace = encode(HeartbeatPace(interval_s=SOAK_HEARTBEAT_S, for_s=min(for_s, 86_400.0)))
        msgs = [
            OutboxMessage(msg_id=leader.ids.next(), owner=leader.device_id, receiver=device, kind=KIND_HEARTBEAT_PACE,
                          payload=pace, ttl_ms=max(1, int(for_s * 1000)))  # useless once the soak is over
            for device in devices
        ]
        await leader.outbox.enqueue_many(msgs)


SOAK_HEARTBEAT_S = 5.0  # what a soak asks for (a device keeps to its own fast_interval_s at most)
ARTIFACTS_DIR = "artifacts"  # beside leader.db: the verified copies the rollouts serve


TRUST_DIR = "trust"  # beside leader.db: the newest trust document this leader accepted


def fleet_keys(config: AgentConfig, data_dir: Path, clock: Clock) -> Verifier | None:
    """What the leader checks artifacts and config releases with: the trust document under its
    `[firmware] trust_root` (never an older one than it handed out before), or the pinned
    `public_key`; None when neither is set (every start is refused, saying so)."""
    fw = config.firmware
    return load_fleet_keys(public_key=fw.public_key, trust_root=fw.trust_root, trust_document=fw.trust_document,
                           state_dir=data_dir / TRUST_DIR, now_ms=clock.now_ms)


class RolloutService(PartBase):
    """The leader's rollout feature, one part of it (`agent.service.parts`); it owns `store`
    (closed at stop) and checks artifacts against `[firmware] public_key`."""

    name = "rollouts"

    def __init__(self, leader: RolloutHost, store: RolloutStore, *, poll_s: float = 2.0,
                 report_capacity: int = 256, serve_http: bool = False, data_dir: Path | None = None,
                 lease: OrchestratorLease | None = None, kinds: Mapping[str, KindEntry] = ROLLOUT_KINDS) -> None:
        self.leader = leader
        self.store = store
        self.clock = leader.clock
        # the leader's own files (artifacts, trust): beside leader.db
        self.data_dir = data_dir if data_dir is not None else Path(store.path).parent
        self.keys = fleet_keys(leader.config, self.data_dir, self.clock)
        self.artifacts_dir = self.data_dir / ARTIFACTS_DIR
        self.kinds = kinds
        # several leaders on one PostgreSQL database: the orchestrator runs while this holds it
        self.lease = lease
        if lease is not None:
            store.fence = lease.fence
        self._lead_task: asyncio.Task[None] | None = None
        self.orchestrator = Orchestrator(store, clock=self.clock, port=LeaderPort(leader), poll_s=poll_s,
                                         kinds={name: entry.make(self) for name, entry in kinds.items()})
        if isinstance(self.keys, TrustedKeys):
            self.orchestrator.trust_document = self.keys.document_bytes
        if lease is not None:
            self.orchestrator.after_tick = lease.ticked
        self._layers: LayerStore | None = None  # opened at the first config offer
        self._report_capacity = report_capacity
        self.pools: dict[str, ConfigServerPool] = {}
        self._artifacts: dict[str, tuple[Path, SignedManifest] | None] = {}
        self.intake: ReportIntake | None = None
        self._intake_ref: ActorRef | None = None
        self._task: asyncio.Task[None] | None = None
        self._serving_task: asyncio.Task[None] | None = None
        self._bind_task: asyncio.Task[None] | None = None
        self.http_problem: str | None = None  # why the artifact server does not listen (it retries)
        self._serving_poll_s = poll_s
        self._serving_seen: dict[str, dict[str, int]] = {}  # per pool: the counts already stored
        self._serve_http = serve_http
        self.http: ArtifactServer | None = None
        self._by_image: dict[str, Path] = {}  # image sha256 (hex) -> the store's copy
        self._by_image_scanned_ms = -1_000_000  # a hash not known yet looks the rollouts up again after 1 s
        self._stopped = False

    # -- what the kinds take of the leader (`agent.leader.rollout_kinds.KindHost`) ---------------
    def config_states(self) -> dict[str, tuple[tuple[str, ...], dict[str, ConfigState]]]:
        return self.leader.registry.config_states()

    def device_tags(self) -> dict[str, tuple[str, ...]]:
        return {d.device_id: tuple(d.tags) for d in self.leader.registry.devices()}

    def app_versions(self, name: str) -> dict[str, str]:
        return {device: apps[name].version for device, apps in self.leader.registry.app_states().items()
                if name in apps and apps[name].version}

    def layer_values(self, target: str, devices: dict[str, tuple[str, ...]]) -> dict[str, tuple[LayerValue, ...]]:
        if self._layers is None:
            from config_rollout.layer_store import LayerStore

            self._layers = LayerStore.open(self.store.target)  # where the rollouts are: the fleet's
        return self._layers.values_for_devices(target, devices, now_ms=self.clock.now_ms())

    def register(self) -> None:
        """Take rollout reports (under their name and each kind's older one) and chunk requests
        from devices: the report intake actor and the routes, in place before the leader's inbox
        starts (a report is never refused as a kind the leader does not take)."""
        leader = self.leader
        self.intake = ReportIntake(self.orchestrator)
        self._intake_ref = leader.system.spawn(
            self.intake, name="rollout-reports", capacity=self._report_capacity, policy="reject",
            stall_s=leader.config.mailbox.stall_s)
        older = (name for entry in self.kinds.values() for name in entry.traits.report_kinds)
        for kind in dict.fromkeys([KIND_ROLLOUT_REPORT, *older]):
            leader.register_route(kind, RolloutReport, self._on_report)
        leader.register_route(KIND_CHUNK_REQUEST, ChunkRequest, self._on_chunk)

    async def start(self) -> None:
        """Serve artifacts over HTTP (when `[artifacts] listen` is set) and run the orchestrator."""
        if self._intake_ref is None:
            self.register()
        loop = asyncio.get_running_loop()
        if self._serve_http:
            tls = artifact_tls(self.leader.config)  # files that do not load: a mistake, refused at once
            if not await self._bind_http(tls, first=True):
                self._bind_task = loop.create_task(self._bind_http_until_bound(tls), name="artifact-server-bind")
        if self.lease is None:
            self._task = loop.create_task(self.orchestrator.run(), name="rollout-orchestrator")
        else:
            self._lead_task = loop.create_task(self._lead(self.lease), name="rollout-lease")
        self._serving_task = loop.create_task(self._store_serving_every_tick(), name="rollout-serving")

    async def stop(self) -> None:
        """Stop the orchestrator and the artifact server. Reports and chunk requests that still
        arrive are answered busy: the device keeps them and sends them to the next leader."""
        self._stopped = True
        self.orchestrator.stop()
        for task in (self._lead_task, self._task, self._serving_task, self._bind_task):
            await cancel_and_wait(task)
        self._lead_task = self._task = self._serving_task = self._bind_task = None
        if self.lease is not None:
            try:
                self.lease.release()  # a standby takes over at its next renewal, not a lease time later
            except StoreError as exc:
                log.warning("rollouts: the orchestrator lease not released (a standby takes it when it"
                            " expires): %s", exc)
        self.store_serving()
        if self.http is not None:
            await self.http.stop()
            self.http = None
        self.store.close()
        if self._layers is not None:
            self._layers.close()

    async def _lead(self, lease: OrchestratorLease) -> None:
        """Several leaders: renew the orchestrator lease every third of its time, or, standing by,
        try to take it every second (at most: a takeover follows the lease's running out within a
        second) and at once when its holder says it gave it up; run the orchestrator while it is
        held (first sending again the offers the previous holder stored, which may sit in its
        outbox), stop it when it is lost."""
        renew_s = lease.ttl_ms / 3000
        loop = asyncio.get_running_loop()
        listener = self.store.listener(LEASES)
        assert listener is not None  # (a lease is on a database server only)
        try:
            while True:
                await self._lead_once(lease, loop)
                until = self.clock.monotonic() + (renew_s if lease.held else min(renew_s, STANDBY_TRY_S))
                while (left := until - self.clock.monotonic()) > 0:
                    heard = await listener.wait(self.clock, left)
                    if not lease.held and (LEASES, lease.name) in heard:
                        break  # given up: take it now
        finally:
            listener.close()

    async def _lead_once(self, lease: OrchestratorLease, loop: asyncio.AbstractEventLoop) -> None:
        """One round: renew or take the lease, and start or stop the orchestrator to match."""
        was = lease.token
        try:
            held = lease.hold()
        except StoreError as exc:
            log.log(store_log_level(exc, logging.WARNING), "rollouts: the orchestrator lease not renewed: %s", exc)
            held = lease.held  # unknown: the fence decides each write
        if held and (self._task is None or self._task.done()):
            if lease.token != was:
                log.info("rollouts: this leader (%s) runs the fleet's rollouts now (lease token %s)",
                         lease.holder, lease.token)
                try:
                    resent = await self.orchestrator.resend_offers()
                except EdgeAgentError as exc:
                    log.warning("rollouts: pending offers not sent again: %s (their devices time out"
                                " and are offered again)", exc)
                else:
                    if resent:
                        log.info("rollouts: %d pending offers sent again", resent)
            self._task = loop.create_task(self.orchestrator.run(), name="rollout-orchestrator")
        elif not held and self._task is not None:  # (running, or ended by a fenced write)
            log.warning("rollouts: another leader runs the fleet's rollouts now; this one stands by")
            self.orchestrator.stop()
            await cancel_and_wait(self._task)
            self._task = None

    def _lease_held_by(self) -> str | None:
        """None while this leader runs the orchestrator; else the leader holding its lease ("":
        none, or the database cannot say now)."""
        if self.orchestrating:
            return None
        try:
            row = lease_of(self.store)
        except StoreError:
            return ""
        if row is None or row.expires_ms <= self.clock.now_ms():
            return ""
        return row.holder

    @property
    def orchestrating(self) -> bool:
        """This leader runs the orchestrator (always, on leader.db)."""
        return self.lease is None or (self.lease.held and self._task is not None and not self._task.done())

    def checks(self) -> Checks:
        """The orchestrator's loop (on PostgreSQL: the lease loop that runs it) is running; the
        artifact server listens when `[artifacts] listen` is set."""
        if self.lease is None:
            found: dict[str, Check] = {"rollout orchestrator": task_check(lambda: self._task)}
        else:
            found = {"rollout orchestrator": lease_check(lambda: self._lead_task, held_by=self._lease_held_by)}
        if self._serve_http:
            found["artifact server"] = problem_check(lambda: self.http_problem, up="listening")
        return found

    async def _bind_http(self, tls: ssl.SSLContext | None, *, first: bool) -> bool:
        """Listen for artifact downloads; a port taken (or an address not this host's) is no
        reason to stop leading: it is reported in /healthz and tried again every HTTP_RETRY_S,
        and devices download over their mirrors and MQTT chunks meanwhile."""
        try:
            await self._start_http(tls)
        except ConfigError as exc:
            if first:
                log.error("%s; trying again every %gs (devices download over their mirrors and MQTT meanwhile)",
                          exc, HTTP_RETRY_S)
            self.http_problem = f"{exc.reason} (trying again every {HTTP_RETRY_S:g}s)"
            return False
        self.http_problem = None
        return True

    async def _bind_http_until_bound(self, tls: ssl.SSLContext | None) -> None:
        while True:
            await self.clock.sleep(HTTP_RETRY_S)
            if await self._bind_http(tls, first=False):
                return

    def collectors(self) -> Collectors:
        found = {"rollouts": rollout_collector(self.store),
                 "orchestrator": lambda: [family(
                     "ea_rollout_orchestrator", "gauge", "1 while this leader runs the fleet's rollouts (on"
                     " PostgreSQL: holds the orchestrator lease).", [({}, int(self.orchestrating))])]}
        http = self.http
        if http is not None:
            found["artifact server"] = artifact_server_collector(http)
        return found

    def store_serving(self) -> None:
        """Add what each rollout's ConfigServers served since the last call to the rollout store
        (`rollout status`, the console): the pools count in memory, the store adds up across
        leader restarts."""
        for rollout_id, pool in self.pools.items():
            now = pool.statistics()
            seen = self._serving_seen.get(rollout_id, {})
            delta = {k: now[k] - seen.get(k, 0) for k in ("served", "bytes_served", "busy", "rejected")}
            if not any(delta.values()) and now["max_concurrent"] <= seen.get("max_concurrent", 0):
                continue
            try:
                self.store.add_serving(rollout_id, chunks=delta["served"], bytes_=delta["bytes_served"],
                                       busy=delta["busy"], rejected=delta["rejected"],
                                       max_concurrent=now["max_concurrent"])
            except StoreError as exc:  # counted again at the next tick
                log.log(store_log_level(exc, logging.WARNING), "serving figures of rollout %s not stored: %s",
                        rollout_id, exc)
                continue
            self._serving_seen[rollout_id] = now

    async def _store_serving_every_tick(self) -> None:
        while True:
            await self.clock.sleep(self._serving_poll_s)
            self.store_serving()

    def max_concurrent_downloads(self) -> int:
        return max((p.max_concurrent for p in self.pools.values()), default=0)

    # -- inbound -------------------------------------------------------------------------------
    async def _on_report(self, env: Envelope, message: msgspec.Struct) -> Reply:
        if not isinstance(message, RolloutReport):
            return Reply(id=env.id, status="rejected", reason="not a rollout report")
        if message.device != env.sender:
            return Reply(id=env.id, status="rejected",
                         reason=f"report names device {message.device!r} but the sender is {env.sender!r}")
        if self._stopped:
            return Reply(id=env.id, status="busy", retry_after_ms=REPORT_BUSY_MS, reason="rollouts are stopping")
        assert self._intake_ref is not None
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        try:
            self._intake_ref.tell(_Report(env.id, message, done))
        except MailboxFull as exc:
            return Reply(id=env.id, status="busy", retry_after_ms=exc.retry_after_ms)
        except EdgeAgentError as exc:
            return Reply(id=env.id, status="busy", retry_after_ms=REPORT_BUSY_MS, reason=str(exc))
        try:
            await self.clock.wait_for(asyncio.shield(done), 30.0)
        except ReportRefused as exc:  # a rollout it is not in, or that offered it nothing yet
            return Reply(id=env.id, status="rejected", reason=str(exc))
        except TimeoutError:
            return Reply(id=env.id, status="busy", retry_after_ms=REPORT_BUSY_MS, reason="not committed in time")
        except StoreError as exc:
            return Reply(id=env.id, status="busy", retry_after_ms=REPORT_BUSY_MS, reason=str(exc))
        return Reply(id=env.id, status="accepted")

    async def _on_chunk(self, env: Envelope, message: msgspec.Struct) -> Reply:
        if not isinstance(message, ChunkRequest):
            return Reply(id=env.id, status="rejected", reason="not a chunk request")
        if self._stopped:
            return Reply(id=env.id, status="busy", retry_after_ms=REPORT_BUSY_MS, reason="rollouts are stopping")
        try:
            pool = self._pool(message.rollout_id)
        except StoreError as exc:
            return Reply(id=env.id, status="busy", retry_after_ms=REPORT_BUSY_MS, reason=str(exc))
        if pool is None:
            return Reply(id=env.id, status="rejected", reason=f"unknown rollout {message.rollout_id!r}")
        return await pool.handle(env, message)

    def _pool(self, rollout_id: str) -> ConfigServerPool | None:
        pool = self.pools.get(rollout_id)
        if pool is not None:
            return pool
        r = self.store.get(rollout_id)  # (a StoreError: the database away, answered busy)
        if r is None:
            return None
        served = self._served(r)
        if served is None:
            return None
        self._artifacts.setdefault(rollout_id, served)
        d = r.spec.download
        pool = ConfigServerPool(self.leader.system, lookup=self._lookup, clock=self.clock,
                                servers=d.servers, capacity=d.mailbox_capacity, rate_bytes_per_s=d.rate_bytes_per_s,
                                name=f"config-server:{rollout_id}")
        self.pools[rollout_id] = pool
        return pool

    async def _start_http(self, tls: ssl.SSLContext | None) -> None:
        a = self.leader.config.artifacts
        host, _, port = a.listen.rpartition(":")
        host = host.strip("[]")
        server = ArtifactServer(self._artifact_by_image, host=host, port=int(port), max_downloads=a.max_downloads,
                                max_downloads_per_peer=a.max_downloads_per_address, retry_after_s=a.retry_after_s,
                                tls=tls, min_rate_bps=a.min_rate_kbps * 1000 // 8)
        try:
            await server.start()
        except OSError as exc:
            raise ConfigError("config", "artifacts.listen",
                              f"cannot listen on {a.listen}: {exc.strerror or exc}") from None
        self.http = server
        url = a.url or f"{server.scheme}://{_advertised_host(host)}:{server.port}"
        self.orchestrator.own_mirror = url.rstrip("/") + "/artifacts"
        log.info("artifact server on %s:%d, offered to devices as %s", host, server.port, self.orchestrator.own_mirror)

    def _artifact_by_image(self, file_name: str) -> Path | None:
        """The store's copy of a firmware artifact by its image hash (`{sha256}.eafw`: the
        rollouts' own, looked up again at most once a second for a hash not seen yet), or of an
        application bundle the application kind kept by its own hash (`{sha256}.eaapp`)."""
        sha256_hex, _, suffix = file_name.partition(".")
        if suffix != "eafw":
            kept = self.artifacts_dir / file_name
            return kept if kept.is_file() else None
        found = self._by_image.get(sha256_hex)
        if found is not None:
            return found
        now = int(self.clock.monotonic() * 1000)
        if now - self._by_image_scanned_ms < 1000:
            return None
        self._by_image_scanned_ms = now
        try:
            rows = self.store.rollouts()
        except EdgeAgentError:
            return None
        for r in rows:
            try:
                served = self._served(r)
            except EdgeAgentError:
                continue
            if served is not None:
                self._by_image.setdefault(served[1].manifest.sha256.hex(), served[0])
        return self._by_image.get(sha256_hex)

    def _lookup(self, rollout_id: str) -> tuple[Path, SignedManifest] | None:
        if rollout_id not in self._artifacts:
            try:
                r = self.store.get(rollout_id)
            except EdgeAgentError:
                return None
            self._artifacts[rollout_id] = None if r is None else self._served(r)
        return self._artifacts[rollout_id]

    def _served(self, r: RolloutRow) -> tuple[Path, SignedManifest] | None:
        """What a rollout's ConfigServers serve: its firmware image's copy and signed manifest
        (its kind's `image`; None: it serves none)."""
        entry = self.kinds.get(r.spec.rollout.kind)
        image = entry.traits.image_of(r) if entry is not None else None
        if image is None:
            return None
        return Path(image[0]), parse_signed_manifest(image[1])


def artifact_server_collector(server: ArtifactServer) -> Collector:
    """`/metrics` for the leader's artifact HTTP server."""

    def collect() -> list[MetricFamily]:
        s = server.stats
        return [
            family("ea_artifact_http_requests_total", "counter", "Requests to the artifact server.",
                   [({}, s.requests)]),
            family("ea_artifact_http_served_bytes_total", "counter", "Artifact bytes the artifact server sent.",
                   [({}, s.bytes_served)]),
            family("ea_artifact_http_busy_total", "counter", "Requests answered 503 with Retry-After (its bound).",
                   [({}, s.busy)]),
            family("ea_artifact_http_refused_total", "counter", "Requests answered 4xx (not an artifact, a bad"
                   " range or request).", [({}, s.refused)]),
            family("ea_artifact_http_downloads", "gauge", "Downloads being answered now.", [({}, s.in_flight)]),
            family("ea_artifact_http_downloads_max", "gauge", "The most downloads answered at once.",
                   [({}, s.max_concurrent)]),
            family("ea_artifact_http_downloads_bound", "gauge", "The bound on downloads at once ([artifacts]"
                   " max_downloads).", [({}, server.max_downloads)]),
        ]

    return collect


METRIC_ROLLOUTS_FINISHED = 5  # finished rollouts exported besides the running ones (bounded series)


def rollout_collector(store: RolloutStore) -> Collector:
    """`/metrics` for rollouts, from `describe` (what `rollout status` shows): the running and
    paused ones and the few newest finished ones, each by id."""

    def collect() -> list[MetricFamily]:
        rows = store.rollouts()
        shown = [r for r in rows if r.active]
        shown += [r for r in reversed(rows) if not r.active][:METRIC_ROLLOUTS_FINISHED]
        views = [describe(store, r.id) for r in shown]
        return [
            family("ea_rollout_info", "gauge", "1 per rollout, labelled with its state and version.",
                   (({"rollout": v["id"], "state": v["state"], "version": v["version"]}, 1) for v in views)),
            family("ea_rollout_devices", "gauge", "Devices of a rollout by their state in it.",
                   (({"rollout": v["id"], "state": st}, n) for v in views for st, n in v["counts"].items())),
            family("ea_rollout_downloaded_bytes", "gauge", "Bytes the rollout's devices report downloaded.",
                   (({"rollout": v["id"]}, sum(w["download"]["bytes_done"] for w in v["waves"])) for v in views)),
            family("ea_rollout_download_size_bytes", "gauge", "Bytes the rollout's offered devices download in all.",
                   (({"rollout": v["id"]}, sum(w["download"]["bytes_total"] for w in v["waves"])) for v in views)),
            family("ea_rollout_served_bytes_total", "counter", "Image bytes the leader's ConfigServers served.",
                   (({"rollout": v["id"]}, v["serving"].get("bytes", 0)) for v in views)),
            family("ea_rollout_busy_answers_total", "counter", "Chunk requests answered busy (bounded servers).",
                   (({"rollout": v["id"]}, v["serving"].get("busy", 0)) for v in views)),
            family("ea_rollout_cancel_pending", "gauge", "Devices of a canceled or aborted rollout yet to stop.",
                   (({"rollout": v["id"]}, v["cancel_pending"]) for v in views)),
        ]

    return collect


def _advertised_host(bound: str) -> str:
    """The name devices reach a server bound to `bound` by (a wildcard: this host's name)."""
    if bound in ("", "0.0.0.0", "::"):
        return socket.gethostname()
    return f"[{bound}]" if ":" in bound else bound


async def rollout_part(leader: LeaderAgent, env: GatewayEnv) -> RolloutService:
    """The leader's rollout feature, always on: it opens the rollout tables where the fleet's
    registry is (leader.db, or the fleet's PostgreSQL database: then under the orchestrator
    lease), checks artifacts against `[firmware] public_key` (none set: every start is refused,
    saying so) and serves them over HTTP when `[artifacts] listen` is set. Reports and chunk
    requests are routed from here on; `start` runs the orchestrator (or waits for the lease)."""
    config = leader.config
    store = RolloutStore.open(leader.rollout_tables, clock=leader.clock)
    lease = None
    if store.on_server:
        lease = OrchestratorLease(store, leader.device_id, ttl_s=config.leader.rollout_lease_s)
    service = RolloutService(leader, store, poll_s=env.rollout_poll_s, serve_http=bool(config.artifacts.listen),
                             report_capacity=config.mailbox.capacity,  # as the leader's other intake mailboxes
                             data_dir=leader.data_dir, lease=lease, kinds=env.rollout_kinds or ROLLOUT_KINDS)
    service.register()
    return service


__all__ = [
    "ARTIFACTS_DIR",
    "METRIC_ROLLOUTS_FINISHED",
    "LeaderPort",
    "ReportIntake",
    "RolloutHost",
    "RolloutService",
    "artifact_server_collector",
    "fleet_keys",
    "rollout_collector",
    "rollout_part",
]
