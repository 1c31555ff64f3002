"""The worker's UpdaterActor: firmware offers in, the A/B updater driven, reports out via the outbox.

    leader ──UpdateOffer──► (down topic) ──► UpdaterActor (bounded mailbox: busy when it is full)
    leader ──RolloutCancel─► (down topic) ──► UpdateCancels ──► UpdaterActor.cancel (not queued
                                               behind the update it stops: the running work is
                                               canceled, then the updater ends it `canceled`)
                                               │ waits for a maintenance window (device-local time)
                                               │ Updater.offer(offer, source)
                                               │    chunks: the offer's HTTP(S) mirrors, in order,
                                               │    then ChunkClient ──► leader's ConfigServers
                                               ▼
                     RolloutReport ──► OutboxStore (OVERWRITE per device, seq) ──► relay ──► leader

On start it opens the updater (that is "a boot": a trial boot is counted, a fallback settled)
and resumes whatever was in progress. With an in-process `Rebooter` (`InProcessRebooter`, the
simulator and tests) the actor "reboots" by opening the updater again, which runs the health
check and commits or reverts; on a device `ExecRebooter` restarts the process instead and the
next start resumes.

`agent.worker.updating.updater_part(worker, env)` builds it (a part of the worker, `agent.app`),
on the environment's hardware or on what `[firmware]` names (`device_hardware`); it asks of the
worker only what `UpdaterHost` names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec

from agent.actors import Actor, ActorRef, ActorSystem, Context
from agent.core.clock import Clock
from agent.core.config import AgentConfig
from agent.core.errors import ArtifactError, EdgeAgentError
from agent.core.gate import Gate
from agent.core.ids import IdGenerator
from agent.protocol import SlotState
from agent.service.parts import PartBase
from agent.transport.base import Transport
from agent.worker.actors import LEADER, Outbox
from agent.worker.fleet_keys import fleet_keys
from agent.worker.hardware import InProcessRebooter, OpenUpdater, UpdaterHardware, system_utc_offset_s
from agent.worker.installers import firmware_state_dir, installer_from_config, rebooter_for
from agent.worker.leader_watch import LeaderWatch
from firmware_rollout.device.chunk_client import ChunkClient, RemoteChunkSource
from firmware_rollout.device.download import DownloadSource, MirrorSettings, download_source
from firmware_rollout.device.health import AllChecks, CommandCheck, ConnectivityCheck, HealthCheck
from firmware_rollout.device.reboot import Rebooter
from firmware_rollout.device.slots import Installer
from firmware_rollout.device.updater import CANCELABLE_STATES, ReportSink, Updater, UpdaterSettings
from firmware_rollout.errors import UpdaterError
from firmware_rollout.messages import KIND_UPDATE_CANCEL, KIND_UPDATE_OFFER, UpdateOffer
from rollout_engine.device import EXCERPT_SPAN_MS, FAILURE_STATES, ExcerptSource, excerpted
from rollout_engine.messages import RolloutCancel, RolloutReport, report_message
from rollout_engine.windows import parse_window, window_wait

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class Resume:
    """Carry on with whatever update is in progress (sent on start and after a reconnect)."""


class UpdaterActor(Actor):
    def __init__(
        self,
        *,
        device_id: str,
        open_updater: OpenUpdater,
        chunks: ChunkClient,
        outbox: Outbox,
        ids: IdGenerator,
        rebooter: InProcessRebooter | None = None,
        utc_offset_s: Callable[[], float] = system_utc_offset_s,
        window_initial: int = 2,
        window_max: int = 4,
        mirrors: MirrorSettings | None = None,
        beat_fast: Callable[[], None] | None = None,
        offered: Callable[[], Awaitable[None]] | None = None,
        excerpt: ExcerptSource | None = None,
        opened: Callable[[], None] | None = None,
    ) -> None:
        self.device_id = device_id
        self._opened_hook = opened  # told once the slots are read: the heartbeat states them at once
        self._excerpt = excerpt  # the log lines a failure's report carries
        self._beat_fast = beat_fast
        self._offered = offered  # told of each offer taken (the leader's id is kept then)
        self._mirrors = mirrors or MirrorSettings()
        self._open = open_updater
        self._chunks = chunks
        self._outbox = outbox
        self._ids = ids
        self._rebooter = rebooter
        self._utc_offset_s = utc_offset_s
        self._window = (window_initial, window_max)
        self.updater: Updater | None = None
        self.offers = 0
        self.duplicate_offers = 0
        self.reports_sent = 0
        self.cancels = 0
        # The update work in progress (a window wait, a download...) and its rollout: a cancel
        # stops it from outside the mailbox.
        self._work: asyncio.Task[None] | None = None
        self._work_rollout = ""
        self._canceled: dict[str, str] = {}  # rollout -> reason, the newest CANCELS_KEPT
        self.not_open = ""  # why the updater is not open yet ("" once it is)
        # a release that drives the firmware as one of its parts (`agent.worker.releases`): what
        # else a trial boot waits for before its commit, and the reports it takes for its own
        self.hold: HealthCheck | None = None
        self.claims: Callable[[RolloutReport], Awaitable[bool]] | None = None

    async def on_start(self, ctx: Context) -> None:
        await self._chunks.start()
        self.updater = await self._open_when_it_can(ctx.clock)
        if self._opened_hook is not None:
            self._opened_hook()
        await self._boot_and_resume(ctx)

    async def _open_when_it_can(self, clock: Clock) -> Updater:
        """The updater, opened. While it cannot be (the root helper not answering yet, a state
        directory it cannot use), the reason is logged once and the open tried again, backing
        off: the rest of the agent runs meanwhile, and offers wait in the mailbox (or are
        refused as busy, and offered again)."""
        wait_s, said = OPEN_RETRY_FIRST_S, ""
        while True:
            try:
                updater = await self._opened()
            except EdgeAgentError as exc:
                if str(exc) != said:
                    said = str(exc)
                    log.warning("updater not open, trying again: %s", said)
                self.not_open = said
                await clock.sleep(wait_s)
                wait_s = min(wait_s * 2, OPEN_RETRY_MAX_S)
                continue
            if said:
                log.info("updater open")
            self.not_open = ""
            return updater

    async def _opened(self) -> Updater:
        updater = await self._open(self._report)
        updater.hold = self.hold
        return updater

    async def on_stop(self, ctx: Context) -> None:
        if self.updater is not None:
            await self.updater.close()
            self.updater = None
        await self._chunks.stop()

    async def receive(self, message: object, ctx: Context) -> None:
        if isinstance(message, Resume):
            status = self.updater.status() if self.updater is not None else None
            await self._run_work(self._boot_and_resume(ctx), status.rollout_id if status is not None else "")
            return
        if not isinstance(message, UpdateOffer):
            log.warning("updater: ignoring %s", type(message).__name__)
            return
        self.offers += 1
        if message.rollout_id in self._canceled:
            log.info("update %s: offer ignored, the rollout was canceled", message.rollout_id)
            return
        await self._run_work(self._take(message, ctx), message.rollout_id)

    async def _run_work(self, work: Awaitable[None], rollout_id: str) -> None:
        """Run `work` as a task a cancel of `rollout_id` can stop."""
        task = asyncio.ensure_future(work)
        self._work, self._work_rollout = task, rollout_id
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:  # the actor itself is stopping
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise
        finally:
            self._work, self._work_rollout = None, ""
        if not task.cancelled():
            task.result()

    async def cancel(self, cancel: RolloutCancel) -> None:
        """The leader canceled a rollout: stop its work in progress, then let the updater end it."""
        self.cancels += 1
        self._canceled[cancel.rollout_id] = cancel.reason
        while len(self._canceled) > CANCELS_KEPT:
            self._canceled.pop(next(iter(self._canceled)))
        work = self._work
        if work is not None and self._work_rollout == cancel.rollout_id:
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait({work})
        updater = self.updater
        if updater is None:
            return
        try:
            status = await updater.cancel(cancel.rollout_id, cancel.reason)
        except UpdaterError as exc:  # closed for a reboot: the next start resumes (or finishes) it
            log.info("cancel of %s waits for the reboot: %s", cancel.rollout_id, exc)
            return
        log.info("update %s canceled by the leader (%s): %s", cancel.rollout_id, cancel.reason or "no reason",
                 status.state)

    async def _take(self, message: UpdateOffer, ctx: Context) -> None:
        updater = self.updater
        assert updater is not None
        status = updater.status()
        if status.rollout_id == message.rollout_id and status.state == "committed":
            self.duplicate_offers += 1  # a redelivered offer of an update already done: report again
            with contextlib.suppress(UpdaterError):
                await updater.flush_reports()
            return
        if self._offered is not None:
            await self._offered()
        await self._wait_for_window(message, ctx.clock)
        log.info("update %s offered", message.rollout_id)
        source = self._source(message.rollout_id, message.signed_manifest, message.chunk_size, message.mirrors)
        try:
            await updater.offer(message, source)
        except UpdaterError as exc:  # closed: a reboot was asked for and has not happened yet
            log.info("offer %s not taken: %s", message.rollout_id, exc)
            return
        finally:
            await source.aclose()
        await self._boot_and_resume(ctx)

    async def _wait_for_window(self, offer: UpdateOffer, clock: Clock) -> None:
        if not offer.maintenance_windows:
            return
        try:
            windows = [parse_window(w) for w in offer.maintenance_windows]
        except ValueError as exc:
            log.warning("offer %s: ignoring bad maintenance windows: %s", offer.rollout_id, exc)
            return
        told = False
        while True:
            wait, detail = window_wait(windows, clock.now_ms(), self._utc_offset_s())
            if wait <= 0:
                return
            log.info("update %s waits %.0fs for its maintenance window (%s)", offer.rollout_id, wait, detail)
            if not told and self.updater is not None:
                with contextlib.suppress(UpdaterError):
                    await self.updater.waiting(offer, until_ms=clock.now_ms() + int(wait * 1000), detail=detail)
                told = True
            await clock.sleep(wait)

    def _source(self, rollout_id: str, signed_manifest: bytes | None, chunk_size: int,
                mirrors: Sequence[str]) -> DownloadSource:
        """The download's source (`download_source`), planned from the manifest the updater
        checked (and keeps for the update: it is not decoded again)."""
        manifest = None
        if signed_manifest is not None and self.updater is not None:
            try:
                manifest = self.updater.checked(signed_manifest)
            except ArtifactError:
                manifest = None  # the updater refuses it with the reason
        mqtt = RemoteChunkSource(self._chunks, rollout_id=rollout_id, manifest=manifest, piece_size=chunk_size,
                                 window_initial=self._window[0], window_max=self._window[1])
        return download_source(manifest, mirrors=mirrors, mqtt=mqtt, settings=self._mirrors)

    async def _boot_and_resume(self, ctx: Context) -> None:
        """Resume an update in progress; after an in-process reboot, boot again and resume."""
        for _ in range(10):  # a trial boot, then maybe a boot back to the old slot
            if self._rebooter is not None and self._rebooter.requested:
                self._rebooter.requested = False
                self.updater = await self._opened()
            updater = self.updater
            assert updater is not None
            status = updater.status()
            if status.rollout_id in self._canceled and status.state in CANCELABLE_STATES:
                # canceled while the updater was closed for a reboot: end it now instead of resuming
                await updater.cancel(status.rollout_id, self._canceled[status.rollout_id])
                status = updater.status()
            source = (self._source(status.rollout_id, status.signed_manifest, 0, status.mirrors)
                      if status.state == "downloading" else None)
            try:
                await updater.resume(source)
            except UpdaterError as exc:
                # The updater closed itself for a reboot (a reboot command that returned before the
                # system went down): wait for the reboot; the next start resumes the update.
                log.info("update waits for the device to reboot: %s", exc)
                return
            finally:
                if source is not None:
                    await source.aclose()
            if self._rebooter is None or not self._rebooter.requested:
                return

    async def _report(self, report: RolloutReport) -> None:
        """The updater's report sink: into the outbox, newest report per device wins. Each
        report keeps the heartbeat fast a while longer (downloading, on trial, soaking)."""
        if self._beat_fast is not None:
            self._beat_fast()
        if self.claims is not None and await self.claims(report):
            return
        if self._excerpt is not None and report.state in FAILURE_STATES and not report.excerpt:
            report = await excerpted(report, self._excerpt, (), report.ts_ms - EXCERPT_SPAN_MS)
        await self._outbox.enqueue(report_message(report, msg_id=self._ids.next(), receiver=LEADER))
        self.reports_sent += 1


CANCELS_KEPT = 64
OPEN_RETRY_FIRST_S = 2.0  # an updater that cannot open yet is tried again after this, doubling...
OPEN_RETRY_MAX_S = 60.0  # ...up to this


def slot_state(updater: Updater) -> SlotState | None:
    """What the heartbeat states of the slots: read from the installer's view in memory (no
    I/O of its own); None when the installer cannot say (the heartbeat goes without it)."""
    installer = updater.installer
    try:
        view = installer.describe()
        left = view.get("attempts_left") if isinstance(view, dict) else None
        attempts = {str(s)[:16]: n for s, n in left.items()
                    if isinstance(n, int) and 0 <= n <= 1000} if isinstance(left, dict) else {}
        return SlotState(backend=installer.name[:32], booted=installer.booted_slot()[:16],
                         default=installer.default_slot()[:16], trial=(installer.trial_slot() or "")[:16],
                         attempts=dict(list(attempts.items())[:4]),
                         versions={s[:16]: v[:64] for s, v in list(updater.slot_versions().items())[:4]})
    except (EdgeAgentError, OSError) as exc:
        log.debug("slot state for the heartbeat: %s", exc)
        return None


class UpdateCancels(Actor):
    """Takes the leader's cancels off the down topic and hands each to the UpdaterActor directly:
    its own mailbox may hold the very update the cancel must stop."""

    def __init__(self, updater: UpdaterActor) -> None:
        self._updater = updater

    async def receive(self, message: object, ctx: Context) -> None:
        if isinstance(message, RolloutCancel):
            await self._updater.cancel(message)


class UpdaterHost(Protocol):
    """What the updater needs of the worker (`WorkerAgent` is one)."""

    @property
    def config(self) -> AgentConfig: ...
    @property
    def device_id(self) -> str: ...
    @property
    def fleet(self) -> str: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def ids(self) -> IdGenerator: ...
    @property
    def transport(self) -> Transport: ...
    @property
    def system(self) -> ActorSystem: ...
    @property
    def outbox(self) -> Outbox: ...
    @property
    def data_dir(self) -> Path: ...

    #: The log lines a failed update's report carries (None: none).
    failure_logs: ExcerptSource | None

    #: What the heartbeat reports as running; the updater answers with its active slot's version.
    firmware_version: Callable[[], str]
    #: What the heartbeat states of the slots; the updater answers from its installer.
    slot_state: Callable[[], SlotState | None]

    @property
    def leader_answered(self) -> Gate: ...

    #: The sender of the newest command taken (the leader), None before any.
    leader_id: str | None

    def register_command(self, kind: str, type_: type[msgspec.Struct], ref: ActorRef) -> None: ...

    def beat_fast(self, for_s: float) -> None: ...

    def beat_now(self) -> None: ...


class UpdaterPart(PartBase):
    """The worker's updater feature: an UpdaterActor spawned into the started worker, firmware
    offers and cancels routed to it, and the heartbeat reporting the active slot's version."""

    name = "updater"

    def __init__(self, worker: UpdaterHost, hardware: UpdaterHardware, *, capacity: int = 2) -> None:
        self._worker = worker
        self._hardware = hardware
        self._capacity = capacity
        self.actor: UpdaterActor | None = None
        self.ref: ActorRef | None = None
        # a release driving the firmware as one of its parts sets these before the start
        # (`UpdaterActor.hold`, `UpdaterActor.claims`)
        self.hold: HealthCheck | None = None
        self.claims: Callable[[RolloutReport], Awaitable[bool]] | None = None

    async def start(self) -> None:
        worker = self._worker
        hw = self._hardware
        chunks = ChunkClient(worker.transport, clock=worker.clock, fleet=worker.fleet, device_id=worker.device_id,
                             ids=worker.ids, timeout_s=worker.config.mqtt.reply_timeout_s)
        watch = hw.leader_watch
        if watch is not None:
            await watch.start(worker.transport)

        async def offered() -> None:
            if watch is not None:
                await watch.learn(worker.leader_id)

        actor = self.actor = UpdaterActor(
            device_id=worker.device_id, open_updater=hw.open_updater, chunks=chunks, outbox=worker.outbox,
            ids=worker.ids, rebooter=hw.rebooter, utc_offset_s=hw.utc_offset_s, mirrors=hw.mirrors,
            beat_fast=lambda: worker.beat_fast(worker.config.heartbeat.fast_hold_s), offered=offered,
            excerpt=worker.failure_logs, opened=worker.beat_now)
        actor.hold, actor.claims = self.hold, self.claims
        self.ref = worker.system.spawn(actor, name="updater", capacity=self._capacity, policy="reject")
        worker.register_command(KIND_UPDATE_OFFER, UpdateOffer, self.ref)
        cancels = worker.system.spawn(UpdateCancels(actor), name="update-cancels", capacity=8, policy="reject",
                                      stall_s=worker.config.mailbox.stall_s)
        worker.register_command(KIND_UPDATE_CANCEL, RolloutCancel, cancels)

        def running_version() -> str:
            # until the updater has read the slots, the device does not know what it runs: a
            # heartbeat says "" (unknown), never the config file's version, and the full heartbeat
            # that states the slots goes out as soon as they are read (`opened`)
            return actor.updater.active_version if actor.updater is not None else ""

        worker.firmware_version = running_version
        worker.slot_state = lambda: slot_state(actor.updater) if actor.updater is not None else None

    async def stop(self) -> None:
        """Nothing of its own: its actors stop with the worker's. (The root helper's connection is
        not closed here: the parts stop before the worker's actors, and a reboot asked of the
        helper is still waiting on that connection while systemd stops the agent on the way
        down; the helper closes a connection idle for a minute, the process's end closes the rest.)"""


def device_hardware(worker: UpdaterHost) -> UpdaterHardware:
    """A device's own hardware as `[firmware]` names it: health = connected to the broker, the
    leader accepted a message sent since this start (a heartbeat is enough; the broker alone is
    not the leader), and the optional health command; reboot = the reboot command, or restarting
    the agent in place."""
    config = worker.config
    fw = config.firmware
    key = fleet_keys(worker)
    state_dir = firmware_state_dir(fw, worker.data_dir)
    clock = worker.clock
    watch = LeaderWatch(state_dir, fleet=worker.fleet, clock=clock)
    health: HealthCheck = ConnectivityCheck(worker.transport.connected, worker.leader_answered,
                                            leader_down=watch.down_since)
    if fw.health_command:
        health = AllChecks(health, CommandCheck(fw.health_command, timeout_s=fw.health_timeout_s))
    made: list[tuple[Installer, Rebooter]] = []

    async def open_updater(sink: ReportSink) -> Updater:
        if not made:
            # at the first open, in a thread: with `helper_socket` the installer asks the root
            # helper for its slots, and the helper's first start (socket activation, RAUC's
            # service on D-Bus) takes seconds on a small device, tens of them on an emulated one;
            # the agent is up (READY, the watchdog pinged) without waiting for it
            installer = await asyncio.to_thread(installer_from_config, fw, state_dir, clock=clock, verify_key=key)
            made.append((installer, rebooter_for(installer, fw, clock=clock)))
        installer, rebooter = made[0]
        return await Updater.open(state_dir, device_id=config.agent.device_id, verify_key=key, clock=clock,
                                  health=health, rebooter=rebooter, installer=installer,
                                  hardware=fw.hardware or None,
                                  image=fw.image or None,
                                  initial_version=config.agent.firmware_version,
                                  settings=UpdaterSettings(health_timeout_s=fw.health_timeout_s,
                                                           leader_wait_s=fw.leader_wait_s,
                                                           update_lock=fw.update_lock,
                                                           max_download_kbps=fw.max_download_kbps),
                                  on_report=sink)

    mirrors = MirrorSettings(timeout_s=fw.mirror_timeout_s, ca=fw.mirror_ca, retry_budget=fw.retry_budget,
                             client_cert=config.mqtt.tls_cert, client_key=config.mqtt.tls_key)
    return UpdaterHardware(open_updater=open_updater, mirrors=mirrors, leader_watch=watch)


__all__ = [
    "Resume",
    "UpdateCancels",
    "UpdaterActor",
    "UpdaterHost",
    "UpdaterPart",
    "device_hardware",
]
