"""The device-side A/B updater: download, verify, install into the inactive slot, reboot into it,
check health, then commit, or revert to the old slot.

    idle ─offer─► downloading ─► verifying ─► installing ─► rebooting ═reboot═► verifying_health
      │               │              │             │                              │        │
      └► rejected     └► rejected    └► failed     └► failed           committed ◄┘        └► rolled_back
         (signature, hardware,          (storage)     (slot write)     (health ok)     (health failed, crash
          downgrade, tampered chunk)                                                   loop, bootloader fallback)

Every transition is one SQLite transaction together with the report it makes, and every side
effect (slot write, boot flags) is idempotent and happens on the side of the transition that
lets a restart repeat it. So the process may die at any point (power loss, SIGKILL) and a new
`Updater` on the same state directory carries on: a download resumes from the last chunk that
was fsynced, an install is redone, a trial boot is counted, a commit or a revert is completed.

Chunks are hashed as they arrive and streamed into the inactive slot by the installer at their
offset, each fsynced before the progress row moves (no second copy of the image: an SD card has
no room for one); the slot is read back and verified whole before it is armed. Reports
are stored first and handed to `on_report` (the agent's outbox) in order, at least once.

The work of each state is a step of its own (`firmware_rollout.device.steps`: one class per
state, the table `STEPS`); this class keeps the record and the reports, accounts for boots, and
answers offers, cancels and the operator. The offer's signed manifest is verified once
(`checked`) and the checked manifest carried from there on: the download plan, the status and
every step use it; the installer checks it once more for itself.

Driving it (an actor does this): `await Updater.open(...)` at process start (that is "a boot"),
then `await updater.resume(source)` to carry on whatever was in progress, and
`await updater.offer(UpdateOffer, source)` for each offer from the leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from agent.core.clock import Clock
from agent.core.errors import (
    ArtifactError,
    EdgeAgentError,
)
from agent.core.files import atomic_write
from agent.core.tasks import in_thread
from firmware_rollout.artifact.manifest import (
    Manifest,
    check_policy,
    verify_signed_manifest,
)
from firmware_rollout.device.delta import Delta, find_delta
from firmware_rollout.device.health import AllChecks, HealthCheck, HealthResult
from firmware_rollout.device.reboot import Rebooter
from firmware_rollout.device.slots import SLOTS_DIR, DirectoryInstaller, Installer, other_slot
from firmware_rollout.device.sources import ChunkSource
from firmware_rollout.device.steps import STEPS, StopUpdate
from firmware_rollout.device.store import UpdateRecord, UpdaterStore, report_fields
from firmware_rollout.errors import InstallError, UpdaterError
from firmware_rollout.messages import TERMINAL_STATES, UpdateOffer
from rollout_engine.keys import Verifier
from rollout_engine.messages import DownloadProgress, RolloutReport
from rollout_engine.trust import take_trust_document
from rollout_engine.version import Version

ReportSink = Callable[[RolloutReport], Awaitable[None]]
DB_FILE = "updater.db"
LEGACY_STAGING_FILE = "staging.img"  # where downloads went before they streamed into the slot
REBOOT_MARK_FILE = "reboot-requested"  # the kernel boot id when a reboot into a trial was asked for
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
CHECKED_KEPT = 4  # checked manifests kept: the update's, the active slot's, a repeated offer's
log = logging.getLogger(__name__)


#: What `slot_versions` says of a slot whose new image is being written (or was left half written
#: by a cancel or a failure): not the version it held before, not the new one yet.
PARTIAL_SLOT = "partial"

#: What a cancel can still stop: the new slot has not booted (on its trial boot the health check decides).
CANCELABLE_STATES: frozenset[str] = frozenset({"downloading", "verifying", "staged", "installing", "rebooting"})


@dataclass(frozen=True, kw_only=True)
class UpdaterSettings:
    max_boots: int = 3  # boots of a new slot without a commit before it counts as a crash loop
    health_timeout_s: float = 120.0  # per boot of the new slot
    # a leader announced offline is waited for this long on a trial boot (not a failure of the image)
    leader_wait_s: float = 3600.0
    fetch_timeout_s: float = 30.0
    fetch_attempts: int = 8  # per chunk; `Capacity` (busy) answers do not count
    fetch_backoff_base_s: float = 1.0
    fetch_backoff_cap_s: float = 60.0
    max_download_kbps: int = 0  # kilobits per second the download may use on average (0: no cap)
    # a file an application flock(2)s while it must not be interrupted: no reboot while held
    update_lock: str = ""
    # changes at every boot of the kernel: tells a reboot that came back to the old slot from a
    # restart of the agent alone (empty: no such file here)
    boot_id_path: str = BOOT_ID_PATH

    def __post_init__(self) -> None:
        if self.max_download_kbps < 0:
            raise UpdaterError("max_download_kbps must be 0 (no cap) or positive")
        if self.max_boots < 1 or self.fetch_attempts < 1:
            raise UpdaterError("max_boots and fetch_attempts must be at least 1")
        if min(self.health_timeout_s, self.fetch_timeout_s, self.fetch_backoff_base_s, self.fetch_backoff_cap_s) <= 0:
            raise UpdaterError("updater timeouts and backoffs must be positive")


@dataclass(frozen=True)
class UpdaterStatus:
    state: str
    rollout_id: str
    version: str
    detail: str
    booted_slot: str
    default_slot: str
    active_version: str
    chunks_done: int
    chunks_total: int
    boot_count: int
    signed_manifest: bytes | None = None  # of the update in progress: a resumed download needs it
    mirrors: tuple[str, ...] = ()  # the ones its offer named


class Updater:
    """One device's updater. Make it with `await Updater.open(...)`; not safe to share between
    processes (one state directory, one updater)."""

    def __init__(
        self,
        *,
        state_dir: Path,
        store: UpdaterStore,
        record: UpdateRecord,
        slot_versions: dict[str, str],
        device_id: str,
        verify_key: Verifier,
        clock: Clock,
        installer: Installer,
        health: HealthCheck,
        rebooter: Rebooter,
        hardware: str | None,
        initial_version: str,
        settings: UpdaterSettings,
        on_report: ReportSink | None,
        image: str | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.device_id = device_id
        self.installer = installer
        self.settings = settings
        self._store = store
        self._record = record
        self._slot_versions = slot_versions
        self._key = verify_key
        self._clock = clock
        self._health = health
        # what else must be healthy before a trial boot is committed: a release's other parts
        # (`agent.worker.releases`), set by whoever drives the updater
        self.hold: HealthCheck | None = None
        self._rebooter = rebooter
        self._hardware = hardware
        self._image = image  # the image name this device runs (None: any)
        self._initial_version = initial_version
        self._on_report = on_report
        self._lock = asyncio.Lock()
        self._closed = False
        self._last_report: RolloutReport | None = None
        self._checked: dict[bytes, Manifest] = {}  # signed manifest -> its checked manifest (`checked`)

    # -- lifecycle -------------------------------------------------------------------------
    @classmethod
    async def open(
        cls,
        state_dir: str | Path,
        *,
        device_id: str,
        verify_key: Verifier,
        clock: Clock,
        health: HealthCheck,
        rebooter: Rebooter,
        installer: Installer | None = None,
        hardware: str | None = None,
        initial_version: str = "0.0.0",
        settings: UpdaterSettings | None = None,
        on_report: ReportSink | None = None,
        image: str | None = None,
    ) -> Updater:
        """Open (or create) the state in `state_dir` and account for this boot: a trial boot is
        counted, a bootloader fallback or a stale trial flag is settled. Nothing is downloaded or
        checked until `resume` or `offer`."""
        Version.parse(initial_version)
        state_dir = _made(state_dir)
        if installer is None:
            installer = DirectoryInstaller(state_dir / SLOTS_DIR, clock=clock, verify_key=verify_key)
        store = await UpdaterStore.open(state_dir / DB_FILE, clock=clock)
        try:
            record, slot_versions = await store.load()
            updater = cls(
                state_dir=state_dir,
                store=store,
                record=record,
                slot_versions=slot_versions,
                device_id=device_id,
                verify_key=verify_key,
                clock=clock,
                installer=installer,
                health=health,
                rebooter=rebooter,
                hardware=hardware,
                initial_version=initial_version,
                settings=settings or UpdaterSettings(),
                on_report=on_report,
                image=image,
            )
            recent = await store.reports(limit=1)
            updater._last_report = recent[-1] if recent else None
            await updater._on_boot()
        except BaseException:
            await store.aclose()
            raise
        return updater

    @classmethod
    async def inspect(cls, state_dir: str | Path, *, installer: Installer, device_id: str, verify_key: Verifier,
                      clock: Clock, initial_version: str = "0.0.0") -> Updater:
        """Open the records only to read them (`status`, `slot_versions`): no boot is accounted,
        no flag settled; safe beside a running agent. Close it after."""
        state_dir = _made(state_dir)
        store = await UpdaterStore.open(state_dir / DB_FILE, clock=clock)
        record, slot_versions = await store.load()
        return cls(state_dir=state_dir, store=store, record=record, slot_versions=slot_versions,
                   device_id=device_id, verify_key=verify_key, clock=clock, installer=installer,
                   health=_NoHealthCheck(), rebooter=_NoReboot(), hardware=None, initial_version=initial_version,
                   settings=UpdaterSettings(), on_report=None)

    def slot_versions(self) -> dict[str, str]:
        """The version recorded in each slot (the booted one as the initial version when unknown)."""
        return {slot: self._slot_versions[slot] for slot in self.installer.slots if slot in self._slot_versions}

    async def close(self) -> None:
        """Close the database. Safe at any point: every transition is already durable."""
        self._closed = True
        await self._store.aclose()

    # -- public API ------------------------------------------------------------------------
    @property
    def active_version(self) -> str:
        """The version the running system booted."""
        return self._slot_versions.get(self.installer.booted_slot(), self._initial_version)

    def status(self) -> UpdaterStatus:
        r = self._record
        total = 0
        if r.signed_manifest is not None and r.state not in ("idle", "rejected"):
            with contextlib.suppress(ArtifactError):
                total = self.checked(r.signed_manifest).chunk_count
        return UpdaterStatus(
            state=r.state,
            rollout_id=r.rollout_id,
            version=r.version,
            detail=r.detail,
            booted_slot=self.installer.booted_slot(),
            default_slot=self.installer.default_slot(),
            active_version=self.active_version,
            chunks_done=r.chunks_done,
            chunks_total=total,
            boot_count=r.boot_count,
            signed_manifest=r.signed_manifest if total else None,
            mirrors=tuple(m for m in r.mirrors.split("\n") if m),
        )

    async def offer(self, offer: UpdateOffer, source: ChunkSource) -> RolloutReport:
        """Take an offer: refuse it (reported `rejected` with the reason), or run the update until
        it ends or the device reboots into the new slot. Re-offering the update in progress
        resumes it; an offer of the version already running is reported `succeeded` at once; a
        repeated offer of an update that was rolled back is reported `rolled_back` again (retry
        a failed image under a new rollout id); after `failed` or `rejected` it is tried afresh.
        Returns the last report made."""
        async with self._lock:
            self._check_open()
            r = self._record
            if r.state not in TERMINAL_STATES and r.state != "idle":
                if r.rollout_id == offer.rollout_id and r.signed_manifest == offer.signed_manifest:
                    if r.stage_only and not offer.download_only:  # the go-ahead for a staged download
                        go = r.but(stage_only=False)
                        if r.state == "staged":
                            go = go.but(state="installing", detail=f"writing slot {r.to_slot}")
                        await self._set(go)
                    await self._drive(source)
                    return self._latest()
                self._last_report = await self._store.add_report(self._report_about(
                    offer.rollout_id, self._offered_version(offer), "rejected",
                    f"busy with rollout {r.rollout_id} ({r.state})", phase="rejected"))
                await self._flush()
                return self._last_report
            if r.state == "rolled_back" and (r.rollout_id, r.signed_manifest) == (
                offer.rollout_id,
                offer.signed_manifest,
            ):  # a repeated offer never reinstalls an image that already failed here
                fields = report_fields(
                    r, device=self.device_id, ts_ms=self._clock.now_ms(), active_version=self.active_version
                )
                fields["detail"] = f"already rolled back: {r.detail}"
                self._last_report = await self._store.add_report(fields)
                await self._flush()
                return self._last_report
            await self._start(offer)
            await self._drive(source)
            return self._latest()

    async def resume(self, source: ChunkSource | None = None) -> UpdaterStatus:
        """Carry on after a restart: download (needs `source`), verify, install, reboot, check
        health and commit or revert, as far as the recorded state calls for."""
        async with self._lock:
            self._check_open()
            await self._drive(source)
            return self.status()

    async def abort(self, reason: str) -> UpdaterStatus:
        """End a download that has not reached the install (a canceled rollout) as `failed`.
        Cancel the task running `offer`/`resume` first. Later states cannot be aborted."""
        async with self._lock:
            self._check_open()
            if self._record.state in ("downloading", "verifying"):
                await self._set(self._record.but(state="failed", detail=reason))
                await self._flush()
            return self.status()

    async def cancel(self, rollout_id: str, reason: str) -> UpdaterStatus:
        """The leader canceled `rollout_id` (cancel first the task running `offer`/`resume`):
        an update of it that has not booted its new slot ends `canceled` (an armed trial
        disarmed; the inactive slot keeps what was written); one on its trial boot goes on to
        its health check; one that never started here is reported `canceled` all the same, so the leader hears back."""
        async with self._lock:
            self._check_open()
            r = self._record
            if r.rollout_id == rollout_id and r.state in CANCELABLE_STATES:
                if r.state in ("installing", "rebooting") and r.from_slot:
                    with contextlib.suppress(InstallError, OSError):
                        await self.installer.revert(r.from_slot)
                await self._set(r.but(state="canceled", detail=f"canceled: {reason}" if reason else "canceled"))
            elif r.rollout_id != rollout_id or r.state == "idle":
                self._last_report = await self._store.add_report(self._report_about(
                    rollout_id, "", "canceled", f"canceled before it started here: {reason}" if reason else "canceled",
                    phase="canceled"))
            await self._flush()
            return self.status()

    async def waiting(self, offer: UpdateOffer, *, until_ms: int, detail: str) -> None:
        """Tell the leader the offer waits for the device's maintenance window (until `until_ms`),
        so its timeout runs from the window, not from the offer."""
        async with self._lock:
            self._check_open()
            fields = self._report_about(offer.rollout_id, self._offered_version(offer), "waiting_window", detail)
            fields["until_ms"] = max(0, until_ms)
            self._last_report = await self._store.add_report(fields)
            await self._flush()

    async def operator_commit(self) -> UpdaterStatus:
        """An operator at the console keeps the new slot the device booted on its trial: the
        update ends `committed` without the health check. Refused when no trial boot is running."""
        async with self._lock:
            self._check_open()
            r = self._record
            booted = self.installer.booted_slot()
            if r.state != "verifying_health" or booted != r.to_slot:
                raise UpdaterError(f"nothing to commit: the update is {r.state or 'idle'} and slot {booted} is "
                                   "not on a trial boot")
            await self.installer.commit(r.to_slot)
            await self._set(r.but(state="committed", detail="committed by the operator"), slots={r.to_slot: r.version})
            await self._flush()
            return self.status()

    async def operator_revert(self) -> UpdaterStatus:
        """An operator at the console gives up the update in progress: the old slot is the
        default again (reboot to return to it when the new one is running)."""
        async with self._lock:
            self._check_open()
            r = self._record
            if r.state in TERMINAL_STATES or r.state == "idle" or not r.from_slot:
                raise UpdaterError(f"nothing to revert: no update in progress (the last one is {r.state or 'idle'})")
            await self._set(r.but(state="rolled_back", detail="reverted by the operator"))
            await self.installer.revert(r.from_slot)
            await self._flush()
            return self.status()

    def _offered_version(self, offer: UpdateOffer) -> str:
        """The version an offer names, for a report about an offer that was not taken up ("" for
        one whose manifest the key does not vouch for)."""
        try:
            return self.checked(offer.signed_manifest).version
        except ArtifactError:
            return ""

    def _report_about(self, rollout_id: str, version: str, state: str, detail: str, *,
                      phase: str | None = None) -> dict[str, object]:
        """A report about a rollout other than (or before) the recorded update: its own state,
        the recorded phase (unless given)."""
        return {"device": self.device_id, "rollout_id": rollout_id, "version": version, "state": state,
                "phase": phase or self._record.state, "detail": detail, "ts_ms": self._clock.now_ms(),
                "active_version": self.active_version}

    async def flush_reports(self) -> int:
        """Hand unsent reports to `on_report` in order; returns how many went. A sink raising an
        `EdgeAgentError` stops the flush; the rest go next time."""
        async with self._lock:
            self._check_open()
            return await self._flush()

    async def reports(self, *, unsent_only: bool = False, limit: int = 100) -> list[RolloutReport]:
        """Reports made, oldest first (the last `limit`)."""
        return await self._store.reports(unsent_only=unsent_only, limit=limit)

    # -- boot accounting -------------------------------------------------------------------
    async def _on_boot(self) -> None:
        await self._forget_legacy_staging()
        booted = self.installer.booted_slot()
        if booted not in self._slot_versions:
            await self._store.save(self._record, slots={booted: self._initial_version})
            self._slot_versions[booted] = self._initial_version
        r = self._record
        if r.state == "installing" and r.to_slot and booted == r.to_slot:
            await self._count_trial_boot()  # died between marking the trial and recording it
        elif r.state == "rebooting":
            if booted == r.to_slot:
                await self._count_trial_boot()
            elif self.installer.fell_back() or self._rebooted_since_request():
                await self._set(r.but(state="rolled_back", detail=f"reverted by the bootloader: the trial boot of "
                                                                  f"slot {r.to_slot} did not come up; slot {booted} "
                                                                  "booted"))
                await self.installer.revert(r.from_slot)
            elif self.installer.trial_slot() != r.to_slot:
                await self._set(
                    r.but(
                        state="rolled_back", detail=f"trial boot of slot {r.to_slot} failed: booted slot {booted} again"
                    )
                )
        elif r.state == "verifying_health":
            if booted == r.to_slot:
                await self._count_trial_boot()
            else:
                await self._set(
                    r.but(
                        state="rolled_back", detail=f"reverted by the bootloader: slot {booted} booted after "
                                                    f"{r.boot_count} boots of slot {r.to_slot} without a commit"
                    )
                )
                await self.installer.revert(r.from_slot)
        await self._settle_boot_flags()
        await self._flush()

    async def _count_trial_boot(self) -> None:
        r = self._record
        deadline = self._clock.now_ms() + int(self.settings.health_timeout_s * 1000)
        changes = {"boot_count": r.boot_count + 1, "health_deadline_ms": deadline}
        if r.state != "verifying_health":
            await self._set(
                r.but(state="verifying_health", detail=f"booted slot {r.to_slot}", **changes),
                slots={r.to_slot: r.version},
            )
        else:
            await self._set(r.but(**changes), report=False)

    async def _settle_boot_flags(self) -> None:
        """After an ended update the boot flags must say what the record says (a power loss can
        fall between the record and the flags)."""
        r = self._record
        if r.state not in TERMINAL_STATES and r.state != "idle":
            return
        await self._clear_reboot_mark()
        installer = self.installer
        if r.state in ("rolled_back", "canceled") and r.from_slot:
            if installer.default_slot() != r.from_slot or installer.trial_slot() is not None:
                await installer.revert(r.from_slot)
        elif r.state == "committed" and r.to_slot:
            if installer.default_slot() != r.to_slot or installer.trial_slot() is not None:
                await installer.commit(r.to_slot)
        elif installer.trial_slot() is not None:
            await installer.revert(installer.default_slot())
        if installer.trial_slot() is None and installer.booted_slot() == installer.default_slot():
            # the default slot came up: its boot attempts are counted afresh (what RAUC's
            # mark-good does at boot); a backend writes nothing when nothing changes
            await installer.commit(installer.booted_slot())

    # -- the state machine -----------------------------------------------------------------
    async def _start(self, offer: UpdateOffer) -> None:
        booted = self.installer.booted_slot()
        active = self.active_version
        base = UpdateRecord(
            rollout_id=offer.rollout_id, signed_manifest=offer.signed_manifest, from_slot=booted, from_version=active,
            stage_only=offer.download_only, mirrors="\n".join(offer.mirrors),
        )
        try:
            take_trust_document(self._key, offer.trust, came_with=f"offer {offer.rollout_id}")
            manifest = self.checked(offer.signed_manifest)
        except ArtifactError as exc:  # a trust document or a signature refused, a manifest that is not one
            await self._refuse(base, exc)
            return
        base = base.but(version=manifest.version)
        try:
            check_policy(manifest, hardware=self._hardware, installed_version=active, image=self._image)
        except ArtifactError as exc:
            await self._refuse(base, exc)
            return
        if manifest.parsed_version() == Version.parse(active):
            await self._set(base.but(state="committed", to_slot=booted, detail=f"already running version {active}"))
            return
        to_slot = other_slot(self.installer, booted)
        chunking = "content-defined chunks of at most" if manifest.content_defined else "chunks of"
        await self._set(
            base.but(state="downloading", to_slot=to_slot,
                     detail=f"{manifest.chunk_count} {chunking} {manifest.chunk_size} bytes"),
            manifests={to_slot: None},  # it is about to be overwritten: no delta copies from it
            slots={to_slot: PARTIAL_SLOT},  # until its image is checked whole: not the version it held
        )

    async def _drive(self, source: ChunkSource | None) -> None:
        """Run the step of each state the update reaches (`STEPS`) until it ends or waits. Each
        step's reports go out when it ends: the leader hears `verifying` and `installing` as they
        begin (a long check or install is not silence to its timeout)."""
        try:
            while not self._closed:
                step = STEPS.get(self._record.state)
                if step is None or not step.due(self, source):
                    break
                await step.run(self, source)
                if not self._closed:
                    await self._flush()
        except StopUpdate:
            pass
        if not self._closed:
            await self._flush()

    # -- the steps' view (`UpdateContext`) ---------------------------------------------------
    @property
    def record(self) -> UpdateRecord:
        return self._record

    @property
    def health(self) -> HealthCheck:
        return AllChecks(self._health, self.hold) if self.hold is not None else self._health

    @property
    def clock(self) -> Clock:
        return self._clock

    def manifest(self) -> Manifest:
        """The checked manifest of the recorded update's image (checked once, kept after)."""
        assert self._record.signed_manifest is not None
        return self.checked(self._record.signed_manifest)

    def checked(self, signed_manifest: bytes) -> Manifest:
        """`signed_manifest` verified against the pinned key and decoded, once per updater: the
        offer's manifest is checked before anything of it is used, and the checked one carried
        on (the source's plan, the status, the steps). Raises `ArtifactError`."""
        found = self._checked.get(signed_manifest)
        if found is None:
            found = verify_signed_manifest(signed_manifest, self._key).manifest
            if len(self._checked) >= CHECKED_KEPT:
                self._checked.pop(next(iter(self._checked)))
            self._checked[signed_manifest] = found
        return found

    async def save(self, record: UpdateRecord, *, report: bool = True, slots: dict[str, str] | None = None,
                   manifests: dict[str, bytes | None] | None = None, progress: DownloadProgress | None = None) -> None:
        await self._set(record, report=report, slots=slots, manifests=manifests, progress=progress)

    async def report_about(self, state: str, detail: str) -> None:
        r = self._record
        self._last_report = await self._store.add_report(self._report_about(r.rollout_id, r.version, state, detail))

    async def flush(self) -> int:
        return await self._flush()

    async def delta(self, manifest: Manifest) -> Delta:
        return await find_delta(self.installer, manifest, active_version=self.active_version,
                                active_manifest=self._slot_manifest)

    async def _slot_manifest(self, slot: str) -> Manifest | None:
        """The checked manifest of the image the updater installed in `slot` (None: unknown or unusable)."""
        try:
            raw = await self._store.slot_manifest(slot)
            return None if raw is None else self.checked(raw)
        except (ArtifactError, EdgeAgentError) as exc:
            log.warning("no delta: the active slot's manifest is unusable: %s", exc)
            return None

    async def reboot(self, reason: str, *, trial: bool = False) -> None:
        await self._reboot(reason, trial=trial)

    async def _reboot(self, reason: str, *, trial: bool = False) -> None:
        """Reboot into the armed slot. A reboot command that fails, or returns and the device
        does not go down, ends the update `failed` with the trial disarmed (an ordinary restart
        later must not boot the aborted image) and the updater takes the next offer."""
        await self._flush()
        await self._mark_reboot()
        await self.close()
        try:
            await self._rebooter.reboot(reason, trial=trial)
        except UpdaterError as exc:
            self._store = await UpdaterStore.open(self.state_dir / DB_FILE, clock=self._clock)
            self._closed = False
            await self._clear_reboot_mark()
            r = self._record
            if r.state != "rebooting":  # a reboot back after a rollback: the flags already say the old slot
                log.error("update %s: %s; the old slot boots next time", r.rollout_id, exc)
                raise StopUpdate from None  # (tried again on the next resume, not in a loop)
            with contextlib.suppress(InstallError, OSError):
                await self.installer.revert(r.from_slot)
            await self._set(r.but(state="failed", detail=f"reboot failed: {exc}; the trial of slot {r.to_slot} "
                                                         "is disarmed"))
            raise StopUpdate from None

    # -- the reboot mark: did the kernel boot again since the reboot was asked for? ---------------
    def _boot_id(self) -> str:
        try:
            return Path(self.settings.boot_id_path).read_text().strip() if self.settings.boot_id_path else ""
        except OSError:
            return ""

    async def _mark_reboot(self) -> None:
        boot_id = self._boot_id()
        if boot_id:
            await in_thread(self._clock, atomic_write, self.state_dir / REBOOT_MARK_FILE, boot_id.encode())

    async def _clear_reboot_mark(self) -> None:
        await in_thread(self._clock, (self.state_dir / REBOOT_MARK_FILE).unlink, True)

    def _rebooted_since_request(self) -> bool:
        try:
            asked_at = (self.state_dir / REBOOT_MARK_FILE).read_text().strip()
        except OSError:
            return False
        now = self._boot_id()
        return bool(asked_at and now and asked_at != now)

    async def _forget_legacy_staging(self) -> None:
        """A download begun by an agent that staged into a file restarts into the slot."""
        legacy = self.state_dir / LEGACY_STAGING_FILE
        if not legacy.exists():
            return
        if self._record.state == "downloading" and self._record.chunks_done:
            await self._set(self._record.but(chunks_done=0), report=False)
        await in_thread(self._clock, legacy.unlink, True)

    # -- helpers ---------------------------------------------------------------------------
    async def _refuse(self, base: UpdateRecord, exc: ArtifactError) -> None:
        """An offer refused before anything is written: one WARNING line each time (a forged or
        mis-signed image is something to see on the device too), and the `rejected` report."""
        log.warning("update %s refused: %s", base.rollout_id or "-", exc)
        await self._set(base.but(state="rejected", detail=str(exc)))

    async def _set(self, record: UpdateRecord, *, report: bool = True, slots: dict[str, str] | None = None,
                   manifests: dict[str, bytes | None] | None = None, progress: DownloadProgress | None = None) -> None:
        record = record.but(updated_ms=self._clock.now_ms())
        versions = dict(self._slot_versions)
        versions.update(slots or {})
        fields = None
        if report:
            active = versions.get(self.installer.booted_slot(), self._initial_version)
            fields = report_fields(record, device=self.device_id, ts_ms=record.updated_ms, active_version=active)
            if progress is not None:
                fields["progress"] = progress
            elif record.state != self._record.state and record.state != "rejected":  # (`_refuse` logs those)
                log.info("update %s: %s%s", record.rollout_id or "-", record.state,
                         f" ({record.detail})" if record.detail else "")
        made = await self._store.save(record, report=fields, slots=slots, manifests=manifests)
        self._record = record
        self._slot_versions = versions
        if made is not None:
            self._last_report = made

    def _latest(self) -> RolloutReport:
        if self._last_report is None:  # an offer always reports; belt and braces
            raise UpdaterError("no report made")
        return self._last_report

    async def _flush(self) -> int:
        if self._on_report is None:
            return 0
        sent: list[int] = []
        try:
            for seq, report in await self._store.unsent():
                await self._on_report(report)
                sent.append(seq)
        except EdgeAgentError:
            pass
        finally:
            await self._store.mark_sent(sent)
        return len(sent)

    def _check_open(self) -> None:
        if self._closed:
            raise UpdaterError("updater is closed (rebooting); open a new one")


def _made(state_dir: str | Path) -> Path:
    """The updater's state directory, created if it is not there yet."""
    path = Path(state_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UpdaterError(f"cannot create {path}: {exc.strerror or exc}") from exc
    return path


class _NoHealthCheck:
    async def check(self, clock: Clock, timeout_s: float) -> HealthResult:
        return HealthResult(False, "opened to read only")


class _NoReboot:
    async def reboot(self, reason: str, *, trial: bool = False) -> None:
        raise UpdaterError("opened to read only")


__all__ = [
    "PARTIAL_SLOT",
    "ReportSink",
    "Updater",
    "UpdaterSettings",
    "UpdaterStatus",
]
