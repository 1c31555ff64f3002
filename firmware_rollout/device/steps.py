"""The updater's steps: one class per state that has work to do (as Mender's client keeps one
class per state), each with the state it runs in, reading the record, doing that state's work
and saving the next state in one transaction with its report.

    state              step               next
    downloading        Download           verifying; failed (a source or slot failure);
                                          rejected (a tampered chunk)
    verifying          VerifySlot         installing; staged (a download-only offer)
    installing         Install            rebooting (the trial armed); failed
    rebooting          RebootIntoTrial    the device reboots; its next start counts the trial boot
    verifying_health   CheckHealth        committed; rolled_back (unhealthy, a crash loop)
    rolled_back        RebootBack         the old slot boots again (when the new one still runs)

Every other state (idle, staged, committed, failed, rejected, canceled) waits for an offer, a
go-ahead or a cancel: no step runs. `STEPS` is the table `Updater` follows. A step that ends
the update raises `StopUpdate` after saving the state that says how.

A step sees the updater only through `UpdateContext`: the record and the checked manifest of
its image, the installer, the health check, its settings, and the few acts that move it on.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from typing import TYPE_CHECKING, ClassVar, NoReturn, Protocol

from agent.core.clock import Clock
from agent.core.errors import ArtifactError, Capacity, Permanent
from agent.core.tasks import in_thread
from firmware_rollout.artifact.manifest import Manifest
from firmware_rollout.device.delta import Delta
from firmware_rollout.device.health import HealthCheck, HealthResult
from firmware_rollout.device.progress import Progress, Throttle
from firmware_rollout.device.slots import Installer
from firmware_rollout.device.sources import ChunkSource
from firmware_rollout.device.store import UpdateRecord
from firmware_rollout.errors import ChunkMismatch, InstallError
from firmware_rollout.messages import UpdaterState
from rollout_engine.messages import DownloadProgress

if TYPE_CHECKING:  # (the updater imports this module)
    from firmware_rollout.device.updater import UpdaterSettings

log = logging.getLogger(__name__)

HEALTH_GRACE_S = 1.0
LOCK_POLL_S = 5.0  # how often a held update lock is tried again
LOCK_REPORT_EVERY_S = 60.0  # and the leader told that the device still waits (its timeout restarts)


class StopUpdate(Exception):
    """The step ended the update (the state that says how is already recorded)."""


class UpdateContext(Protocol):
    """What a step may see and do of the updater (`Updater` is one)."""

    @property
    def record(self) -> UpdateRecord: ...
    @property
    def installer(self) -> Installer: ...
    @property
    def health(self) -> HealthCheck: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def settings(self) -> UpdaterSettings: ...

    def manifest(self) -> Manifest:
        """The checked manifest of the recorded update's image."""
        ...

    async def save(self, record: UpdateRecord, *, report: bool = True, slots: dict[str, str] | None = None,
                   manifests: dict[str, bytes | None] | None = None,
                   progress: DownloadProgress | None = None) -> None: ...

    async def report_about(self, state: str, detail: str) -> None:
        """A report about the recorded update in a state the record does not take (waiting_lock)."""
        ...

    async def flush(self) -> int: ...

    async def delta(self, manifest: Manifest) -> Delta: ...

    async def reboot(self, reason: str, *, trial: bool = False) -> None: ...


def update_lock_held(path: str) -> bool:
    """Another process holds flock(2) on `path` (a missing file is no lock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # there, but not ours to try: treat as held rather than reboot under it
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


async def fail(u: UpdateContext, detail: str) -> NoReturn:
    """End the update `failed`."""
    await u.save(u.record.but(state="failed", detail=detail))
    raise StopUpdate


async def check_slot(u: UpdateContext) -> None:
    """Open the slot for the recorded image and read it back whole (cached by the installer
    until the slot is written again)."""
    r = u.record
    assert r.signed_manifest is not None
    try:
        await u.installer.open_slot(r.to_slot, r.signed_manifest)
        await u.installer.check_slot(r.to_slot)
    except (ArtifactError, InstallError, OSError) as exc:
        await fail(u, f"install failed: the image read back from slot {r.to_slot} is not the signed one: {exc}")


class Step(Protocol):
    state: ClassVar[UpdaterState]

    def due(self, u: UpdateContext, source: ChunkSource | None) -> bool: ...

    async def run(self, u: UpdateContext, source: ChunkSource | None) -> None: ...


class Download:
    """Every chunk into the inactive slot, at its offset: copied from the active slot when it
    holds it (a delta), else fetched from the source; each written (checked against the signed
    manifest by the installer) and fsynced before the progress row moves."""

    state: ClassVar[UpdaterState] = "downloading"

    def due(self, u: UpdateContext, source: ChunkSource | None) -> bool:
        return source is not None  # a resume without a source waits for the next offer

    async def run(self, u: UpdateContext, source: ChunkSource | None) -> None:
        assert source is not None
        manifest = u.manifest()
        layout = manifest.layout()
        r = u.record
        assert r.signed_manifest is not None
        try:
            await u.installer.open_slot(r.to_slot, r.signed_manifest)
        except (InstallError, ArtifactError, OSError) as exc:
            await fail(u, f"install failed: slot {r.to_slot} cannot take the image: {exc}")
        done = r.chunks_done
        delta = await u.delta(manifest)
        to_fetch = sum(layout.length(i) for i in range(manifest.chunk_count) if i not in delta.copies)
        fetched = sum(layout.length(i) for i in range(done) if i not in delta.copies)
        progress = Progress(u.clock, manifest, layout, done, to_fetch=to_fetch, fetched=fetched)
        source.plan([i for i in range(done, manifest.chunk_count) if i not in delta.copies])
        if done:
            log.info("update %s: resuming the download of version %s at chunk %d of %d", r.rollout_id,
                     manifest.version, done + 1, manifest.chunk_count)
        if delta.copies:
            log.info("update %s: %d of %d chunks are in the active slot; %d of %d bytes to download",
                     r.rollout_id, len(delta.copies), manifest.chunk_count, to_fetch, manifest.size)
        throttle = Throttle(u.clock, u.settings.max_download_kbps)
        for index in range(done, manifest.chunk_count):
            if not await self._copy(u, delta, index):
                data = await self._fetch(u, source, index)
                progress.fetched += len(data)
                await throttle.spent(len(data))
                await self._write(u, index, data, manifest)
            snapshot = progress.after(index + 1)
            if snapshot is None:
                await u.save(u.record.but(chunks_done=index + 1), report=False)
                continue
            await u.save(u.record.but(chunks_done=index + 1, detail=progress.text(snapshot)), progress=snapshot)
            await u.flush()
            if progress.milestone(snapshot):
                log.info("update %s: downloading %s", u.record.rollout_id, progress.text(snapshot))
        await u.save(u.record.but(state="verifying", detail="download complete"))

    @staticmethod
    async def _copy(u: UpdateContext, delta: Delta, index: int) -> bool:
        """Chunk `index` copied from the active slot into the new one; False: download it (it is
        not there, or the slot changed under us: a bad sector, a local modification). The
        installer's check against the signed manifest is the one check a copy needs."""
        data = await delta.read(index)
        if data is None:
            return False
        r = u.record
        try:
            await u.installer.write_chunk(r.to_slot, index, data)
        except ChunkMismatch:
            log.warning("delta: chunk %d in the active slot %s does not match its hash: downloading it",
                        index, delta.slot)
            return False
        except (InstallError, ArtifactError, OSError) as exc:
            await fail(u, f"install failed: chunk {index} not written into slot {r.to_slot}: {exc}")
        return True

    @staticmethod
    async def _write(u: UpdateContext, index: int, data: bytes, manifest: Manifest) -> None:
        r = u.record
        try:  # the installer checks the chunk against the signed manifest before it writes it
            await u.installer.write_chunk(r.to_slot, index, data)
        except ChunkMismatch:
            await u.save(r.but(state="rejected", detail=f"tampered chunk: chunk {index} of {manifest.chunk_count}"
                                                        " from the source does not match the signed manifest"))
            raise StopUpdate from None
        except (InstallError, ArtifactError, OSError) as exc:
            await fail(u, f"install failed: chunk {index} not written into slot {r.to_slot}: {exc}")

    @staticmethod
    async def _fetch(u: UpdateContext, source: ChunkSource, index: int) -> bytes:
        clock = u.clock
        settings = u.settings
        base_s, cap_s = settings.fetch_backoff_base_s, settings.fetch_backoff_cap_s
        attempt = 0
        while True:
            try:
                return await clock.wait_for(source.fetch(index), settings.fetch_timeout_s)
            except Capacity as exc:  # busy: wait as asked, the attempt is not spent
                await clock.sleep(max(exc.retry_after_ms / 1000, base_s))
                continue
            except (Permanent, ArtifactError) as exc:
                await fail(u, f"download of chunk {index} refused by the source: {exc}")
            except Exception as exc:  # timeout, transient, connection trouble, an odd source: retry
                attempt += 1
                if attempt >= settings.fetch_attempts:
                    await fail(u, f"download of chunk {index} failed after {attempt} attempts: {exc!r}")
                await clock.sleep(min(cap_s, base_s * 2 ** (attempt - 1)))


class VerifySlot:
    """The slot read back and checked whole; then installed, or held for the leader's go-ahead."""

    state: ClassVar[UpdaterState] = "verifying"

    def due(self, u: UpdateContext, source: ChunkSource | None) -> bool:
        return True

    async def run(self, u: UpdateContext, source: ChunkSource | None) -> None:
        await check_slot(u)
        r = u.record
        if r.stage_only:
            await u.save(r.but(state="staged", detail="downloaded and verified; installed on the leader's go-ahead"))
            return
        await u.save(r.but(state="installing", detail=f"writing slot {r.to_slot}"))


class Install:
    """The trial of the new slot armed (the slot checked once more first)."""

    state: ClassVar[UpdaterState] = "installing"

    def due(self, u: UpdateContext, source: ChunkSource | None) -> bool:
        return True

    async def run(self, u: UpdateContext, source: ChunkSource | None) -> None:
        r = u.record
        await check_slot(u)
        try:
            await u.installer.mark_trial(r.to_slot)
        except (InstallError, OSError) as exc:
            with contextlib.suppress(InstallError, OSError):
                await u.installer.revert(r.from_slot)
            await fail(u, f"install failed: {exc}")
        await u.save(r.but(state="rebooting", boot_count=0, detail=f"slot {r.to_slot} marked for a trial boot"),
                     slots={r.to_slot: r.version}, manifests={r.to_slot: r.signed_manifest})


class RebootIntoTrial:
    """Reboot into the armed slot, once no application holds the update lock."""

    state: ClassVar[UpdaterState] = "rebooting"

    def due(self, u: UpdateContext, source: ChunkSource | None) -> bool:
        return True

    async def run(self, u: UpdateContext, source: ChunkSource | None) -> None:
        await self._wait_for_update_lock(u)
        r = u.record
        await u.reboot(f"trying version {r.version} in slot {r.to_slot}", trial=True)

    @staticmethod
    async def _wait_for_update_lock(u: UpdateContext) -> None:
        """While an application holds the update lock, the new slot waits (installed and armed)
        and the leader hears `waiting_lock` every LOCK_REPORT_EVERY_S."""
        path = u.settings.update_lock
        told_at: float | None = None
        while path:
            held: bool = await in_thread(u.clock, update_lock_held, path)
            if not held:
                if told_at is not None:  # the leader heard waiting_lock: say it goes on
                    await u.save(u.record.but(detail=f"the update lock {path} is free: rebooting"))
                    await u.flush()
                return
            now = u.clock.monotonic()
            if told_at is None or now - told_at >= LOCK_REPORT_EVERY_S:
                if told_at is None:
                    log.info("update %s: waiting for the update lock %s", u.record.rollout_id, path)
                await u.report_about("waiting_lock", f"an application holds the update lock {path}")
                await u.flush()
                told_at = now
            await u.clock.sleep(LOCK_POLL_S)


class CheckHealth:
    """On the trial boot: the health check decides commit or roll back (a crash loop rolls back)."""

    state: ClassVar[UpdaterState] = "verifying_health"

    def due(self, u: UpdateContext, source: ChunkSource | None) -> bool:
        return True

    async def run(self, u: UpdateContext, source: ChunkSource | None) -> None:
        r = u.record
        if r.boot_count > u.settings.max_boots:
            await roll_back(u, f"crash loop: slot {r.to_slot} booted {r.boot_count} times without a commit "
                               f"(limit {u.settings.max_boots})")
            return
        clock = u.clock
        began = clock.monotonic()
        told = False
        while True:
            result = await _check_once(u)
            if not result.wait:
                break
            waited = clock.monotonic() - began
            if waited >= u.settings.leader_wait_s:
                result = HealthResult(False, f"{result.detail}: the leader was still offline after {waited:g}s")
                break
            if not told:
                told = True
                log.warning("trial boot of slot %s: %s (up to %gs) instead of reverting", r.to_slot, result.detail,
                            u.settings.leader_wait_s)
            # the deadline moves on: a power loss meanwhile starts the wait again (max_boots bounds that)
            r = r.but(health_deadline_ms=clock.now_ms() + int(u.settings.health_timeout_s * 1000),
                      detail=f"waiting for the leader, which announced itself offline (up to "
                             f"{u.settings.leader_wait_s:g}s)")
            await u.save(r)
        if not result.ok:
            await roll_back(u, f"health check failed: {result.detail}")
            return
        await u.installer.commit(r.to_slot)
        await u.save(r.but(state="committed", detail=result.detail or "healthy"), slots={r.to_slot: r.version})


async def _check_once(u: UpdateContext) -> HealthResult:
    """The health check within what is left of the record's deadline."""
    clock = u.clock
    remaining = (u.record.health_deadline_ms - clock.now_ms()) / 1000
    if remaining <= 0:
        return HealthResult(False, "health deadline passed before the check ran")
    try:
        # The check decides within `remaining` itself; the outer limit only stops a check that hangs.
        return await clock.wait_for(u.health.check(clock, remaining), remaining + HEALTH_GRACE_S)
    except TimeoutError:
        return HealthResult(False, f"no health result within {remaining:g}s")
    except Exception as exc:  # a broken check is a failed check, never a stuck update
        return HealthResult(False, f"health check raised {exc!r}")


async def roll_back(u: UpdateContext, detail: str) -> None:
    r = u.record
    await u.save(r.but(state="rolled_back", detail=detail))
    await u.installer.revert(r.from_slot)


class RebootBack:
    """After a rollback while the new slot still runs: reboot into the old one."""

    state: ClassVar[UpdaterState] = "rolled_back"

    def due(self, u: UpdateContext, source: ChunkSource | None) -> bool:
        return u.installer.booted_slot() != u.record.from_slot

    async def run(self, u: UpdateContext, source: ChunkSource | None) -> None:
        await u.reboot(f"back to slot {u.record.from_slot} after a rollback")


#: The step each state runs; the other states wait.
STEPS: dict[str, Step] = {step.state: step for step in (Download(), VerifySlot(), Install(), RebootIntoTrial(),
                                                        CheckHealth(), RebootBack())}


__all__ = ["STEPS", "CheckHealth", "Download", "Install", "RebootBack", "RebootIntoTrial", "Step", "StopUpdate",
           "UpdateContext", "VerifySlot", "check_slot", "fail", "roll_back", "update_lock_held"]
