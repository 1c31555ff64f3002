"""The worker's releases: a device's whole desired state (`release_rollout`) converged all or
nothing through the kinds' own parts (the updater, the configuration targets, the applications).

    offer ─► the document verified (the fleet's key); each part's offer checked by its kind and
        │    against the document (name, version, digest) ─► rejected, saying which part and why
        ├─► a new firmware: the updater installs it and boots it on trial; the other parts
        │   converge on that trial boot, as one more health check of it (`ReleaseHold`)
        └─► the stages in order, the parts of a stage side by side, each to its hold:
                config    applied and confirmed, not committed (its journal says `held`)
                app       installed, started on trial, healthy, not committed
            all held ─► (the firmware committed, when the release has one) ─► every part committed
            one fails ─► every held part taken back, the firmware's health check fails (its old
                          slot boots) ─► rolled_back, naming the part and why

The release's journal (`releases/release.json`, one typed document written atomically) says
where it stands; a start reads it and settles what a stop or a power cut left:

    firmware          the firmware's trial boot decides (its health check runs the other parts)
    converging        cut off while parts converged: every held part taken back (and, on a trial
                      boot, the firmware with them)
    firmware_commit   the parts healthy, the firmware committing: its outcome decides
    committing        the firmware committed (or none): every held part committed
    reverting         every held part taken back

The parts' own reports come to this module (their reporter, and the updater's `claims`) and go
to the leader as the release's, so one device is told one story per rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from agent.actors import ActorRef
from agent.core.clock import Clock
from agent.core.codec import decode
from agent.core.errors import CodecError, EdgeAgentError
from agent.core.files import atomic_write
from agent.service.parts import PartBase
from agent.worker.actors import LEADER
from agent.worker.agent import WorkerAgent
from release_rollout.document import ReleaseDocument, SignedRelease, parse_release, peek_release
from release_rollout.errors import ReleaseError
from release_rollout.messages import KIND_RELEASE_CANCEL, KIND_RELEASE_OFFER, PartOffer, ReleaseOffer
from rollout_engine.device import Facts, OfferRunner, Rejected, Reporter, Resume
from rollout_engine.keys import Verifier
from rollout_engine.messages import FINAL_REPORT_STATES, ReportState, RolloutCancel, RolloutReport, report_message

if TYPE_CHECKING:
    from agent.worker.apps import AppsPart
    from agent.worker.config_targets import ConfigTargetsPart
    from agent.worker.updater_actor import UpdaterPart
    from firmware_rollout.device.health import HealthResult
    from firmware_rollout.device.updater import Updater

log = logging.getLogger(__name__)

JOURNAL = "release.json"
OUTCOME_POLL_S = 1.0  # how often it looks whether the updater has opened (its outcome, the slot it runs)
OUTCOME_WAIT_S = 900.0  # ...and for how long
Stand = Literal["firmware", "converging", "firmware_commit", "committing", "reverting", "done"]


class _Journal(msgspec.Struct, frozen=True):
    rollout_id: str
    document: bytes  # the signed release document
    parts: tuple[PartOffer, ...]
    stand: Stand
    failed: str = ""  # which part failed, and why
    before: str = ""  # what the device ran before, in a few words (the report says it is back on it)
    started_ms: int = 0  # when the device took the offer (its clock)
    figures: tuple[str, ...] = ()  # each part's time to its hold, and what it fetched (the success says them)


@dataclass
class _Part:
    """One part's offer as its kind checked it."""

    pid: str
    kind: str
    version: str
    offer: Any  # the kind's offer message
    checked: Any = None  # what its module made of it


@dataclass(frozen=True)
class CheckedRelease:
    signed: SignedRelease
    parts: dict[str, _Part]


@dataclass
class _Converging:
    """The parts held in one convergence: their tasks, and the word they wait for."""

    verdict: asyncio.Future[str]
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    said: dict[str, RolloutReport] = field(default_factory=dict)  # part -> its newest report
    figures: dict[str, str] = field(default_factory=dict)  # part -> its time to its hold (and fetch)


class ReleaseModule:
    """The release kind's module of the device's offer runner (`rollout_engine.device`)."""

    offer_type = ReleaseOffer

    def __init__(self, worker: WorkerAgent, *, key: Verifier, state_dir: Path) -> None:
        self.worker = worker
        self.key = key
        self.clock: Clock = worker.clock
        self.path = state_dir / JOURNAL
        self.report: Reporter | None = None  # the runner's (`attach`)
        # the runner's next report and its sink, for reports that carry more (a download's progress)
        self._runner: OfferRunner[ReleaseOffer, CheckedRelease] | None = None
        self._send: Callable[[RolloutReport], Awaitable[None]] | None = None
        self._converging: _Converging | None = None
        self._settling = asyncio.Lock()
        self._trial_at_ms = 0  # when this start's trial boot began converging the other parts

    # -- the kinds' parts of this worker ------------------------------------------------------
    @property
    def firmware(self) -> UpdaterPart | None:
        return self.worker.kind_parts.get("firmware")  # type: ignore[return-value]

    @property
    def config(self) -> ConfigTargetsPart | None:
        return self.worker.kind_parts.get("config")  # type: ignore[return-value]

    @property
    def apps(self) -> AppsPart | None:
        return self.worker.kind_parts.get("app")  # type: ignore[return-value]

    async def running_firmware(self) -> str | None:
        """The firmware the device runs as its updater read the slots, waiting up to
        `OUTCOME_WAIT_S` for it to open (until then the device does not know: its heartbeat says
        ""); None: it did not open. Without an updater, the version the config file states."""
        if self.firmware is None:
            return self.worker.firmware_version()
        updater = await self._opened_updater()
        return updater.active_version if updater is not None else None

    async def _opened_updater(self) -> Updater | None:
        """The updater once it has opened (read the slots), waiting up to `OUTCOME_WAIT_S`; None:
        it did not open (or this device has none)."""
        part = self.firmware
        deadline = self.clock.monotonic() + OUTCOME_WAIT_S
        while part is not None:
            updater = part.actor.updater if part.actor is not None else None
            if updater is not None:
                return updater
            if self.clock.monotonic() >= deadline:
                return None
            await self.clock.sleep(OUTCOME_POLL_S)
        return None

    # -- the runner's module -------------------------------------------------------------------
    def facts(self, offer: ReleaseOffer) -> Facts:
        try:
            document = peek_release(offer.document)
        except ReleaseError:
            return Facts(rollout_id=offer.rollout_id, version="?", windows=offer.maintenance_windows,
                         trust=offer.trust)
        return Facts(rollout_id=offer.rollout_id, version=document.version, windows=offer.maintenance_windows,
                     trust=offer.trust, units=self._units_of(document))

    def _units_of(self, document: ReleaseDocument) -> tuple[str, ...]:
        """The systemd units the release's parts drive (their journal explains its failure)."""
        from app_rollout.unit import service_name

        targets = self.config.module.targets() if self.config is not None else {}
        units: list[str] = []
        for part in document.parts:
            if part.kind == "app":
                units.append(service_name(part.name))
            elif part.kind == "config" and part.name in targets:
                units.extend(targets[part.name].units)
        return tuple(dict.fromkeys(units))

    def check(self, offer: ReleaseOffer) -> CheckedRelease:
        rid = offer.rollout_id
        try:
            signed = parse_release(offer.document, self.key, source=f"the release of rollout {rid}")
        except ReleaseError as exc:
            raise Rejected(str(exc)) from None
        document = signed.document
        payloads = {p.part: p.payload for p in offer.parts}
        named = {p.id for p in document.parts}
        if set(payloads) != named or len(payloads) != len(offer.parts):
            raise Rejected(f"the offer carries parts {', '.join(sorted(payloads)) or 'none'}; the release names"
                           f" {', '.join(sorted(named))}")
        parts = {}
        for p in document.parts:
            try:
                parts[p.id] = self._check_part(rid, p.id, p.kind, p.name, p.version, p.sha256, payloads[p.id])
            except Rejected as exc:
                raise Rejected(f"part {p.id}: {exc}") from None
        return CheckedRelease(signed, parts)

    def _check_part(self, rid: str, pid: str, kind: str, name: str, version: str, sha256: str,
                    payload: bytes) -> _Part:
        """One part's offer checked by its own kind, and against what the document says of it."""
        if kind == "firmware":
            from firmware_rollout.artifact.manifest import verify_signed_manifest
            from firmware_rollout.messages import UpdateOffer

            if self.firmware is None:
                raise Rejected("this device takes no firmware (no [firmware] updater)")
            fw = _decoded(payload, UpdateOffer)
            try:
                manifest = verify_signed_manifest(fw.signed_manifest, self.key).manifest
            except EdgeAgentError as exc:
                raise Rejected(str(exc)) from None
            if (manifest.name, manifest.version) != (name, version) or fw.rollout_id != rid:
                raise Rejected(f"the offer's firmware is {manifest.name} {manifest.version}")
            return _Part(pid, kind, version, fw)
        if kind == "config":
            from config_rollout.messages import ConfigOffer

            config = self.config
            if config is None:
                raise Rejected("this device has no [config_targets]")
            if name == "agent":
                raise Rejected("the agent's own settings take effect at its next start: they go in a release of"
                               " their own, not in a device's release")
            offer = _decoded(payload, ConfigOffer)
            checked = config.module.check(offer)
            if (checked.release.name, checked.release.version, checked.release.release_id) != (name, version, sha256):
                raise Rejected(f"the offer's release is {checked.release.name} {checked.release.version}, not the"
                               " one the document signs")
            return _Part(pid, kind, version, offer, checked)
        from app_rollout.messages import AppOffer

        apps = self.apps
        if apps is None:
            raise Rejected("this device has no [apps] helper")
        offer = _decoded(payload, AppOffer)
        app = apps.module.check(offer)
        if (app.name, app.version, offer.bundle) != (name, version, sha256):
            raise Rejected(f"the offer's bundle is {app.name} {app.version}, not the one the document signs")
        return _Part(pid, kind, version, offer, app)

    async def apply(self, offer: ReleaseOffer, checked: CheckedRelease, report: Reporter) -> None:
        rid, document = offer.rollout_id, checked.signed.document
        version = document.version
        journal = self._journal()
        if journal is not None and journal.rollout_id == rid:
            if journal.stand != "done":
                log.info("release %s: offered again while it converges (%s)", rid, journal.stand)
                return
            # concluded, and the runner kept no outcome of it (a stop between the journal's "done"
            # and the report, or a failure it does not keep): the outcome said again, not tried again
            await self._conclude(journal, commit=not journal.failed)
            return
        if self._converging is not None:
            await report(rid, version, "failed", "busy", "another release is converging on this device")
            return
        fw = checked.parts.get("firmware")
        running = await self.running_firmware() if fw is not None else ""
        if running is None:
            part = self.firmware
            why = part.actor.not_open if part is not None and part.actor is not None else ""
            await report(rid, version, "failed", "firmware", f"the updater did not open within {OUTCOME_WAIT_S:g} s"
                         + (f": {why}" if why else "") + ": what the device runs is not known")
            return
        before = self._before(checked, running)
        if fw is not None and fw.version != running:
            self._keep(_Journal(rid, offer.document, offer.parts, "firmware", before=before,
                                started_ms=self.clock.now_ms()))
            await report(rid, version, "installing", "firmware",
                         f"release {document.name} {version}: firmware {fw.version} first (the other parts converge"
                         " on its trial boot)")
            why = self._hand_firmware(fw.offer)
            if why:
                self._keep(_Journal(rid, offer.document, offer.parts, "done", failed=why, before=before))
                await report(rid, version, "failed", "firmware", why)
            return
        self._keep(_Journal(rid, offer.document, offer.parts, "converging", before=before,
                            started_ms=self.clock.now_ms()))
        await report(rid, version, "installing", "converging",
                     f"release {document.name} {version}: {document.says()}")
        why = await self._converge(rid, checked)
        figures = self._figures()
        if why:
            self._stand("reverting", failed=why)
            await self._settle(commit=False, reason=why)
            await report(rid, version, "rolled_back", "release", self._back(document.name, version, why, before))
            return
        self._stand("committing", figures=figures)
        await self._settle(commit=True)
        await self._conclude(self._journal() or _Journal(rid, offer.document, offer.parts, "done", figures=figures),
                             commit=True)

    async def resume(self, report: Reporter) -> None:
        """What a stop left, settled (the module's docstring, by the journal's stand)."""
        journal = self._journal()
        if journal is None or journal.stand == "done":
            return
        try:
            document = peek_release(journal.document)
        except ReleaseError as exc:
            log.warning("%s: %s: every held part taken back", self.path, exc)
            await self._settle(commit=False, reason=str(exc))
            return
        rid, version = journal.rollout_id, document.version
        with_firmware = document.firmware is not None and journal.stand in ("firmware", "converging",
                                                                              "firmware_commit")
        if journal.stand == "converging" and not self._on_firmware_trial(rid):
            why = "interrupted while its parts converged"
            await self._settle(commit=False, reason=why)
            await report(rid, version, "rolled_back", "release", self._back(document.name, version, why,
                                                                            journal.before))
            return
        if with_firmware:
            outcome = await self._firmware_outcome(rid)
            await self._firmware_decided(journal, outcome)
            return
        if journal.stand in ("committing", "reverting"):
            commit = journal.stand == "committing"
            await self._settle(commit=commit, reason=journal.failed or "interrupted")
            await self._conclude(journal, commit=commit)

    # -- convergence ---------------------------------------------------------------------------
    async def _converge(self, rid: str, checked: CheckedRelease) -> str:
        """Every part but the firmware to its hold, stage after stage: "" when all are held (or
        ran already), else the first failure (the parts held so far wait for the word)."""
        loop = asyncio.get_running_loop()
        run = self._converging = _Converging(loop.create_future())
        try:
            await self._apps_restored()
            return await self._stages(rid, checked, run)
        except asyncio.CancelledError:
            self.abandon()  # (the agent stopping: its parts' journals say what the next start settles)
            raise

    async def _stages(self, rid: str, checked: CheckedRelease, run: _Converging) -> str:
        document = checked.signed.document
        for stage in document.order:
            ready: dict[str, asyncio.Event] = {}
            started: dict[str, asyncio.Task[None]] = {}
            for pid in stage:
                if pid == "firmware":
                    continue
                ready[pid] = asyncio.Event()
                started[pid] = asyncio.ensure_future(self._run_part(rid, document.version, checked.parts[pid], run,
                                                                    ready[pid]))
                run.tasks.append(started[pid])
            for pid, task in started.items():
                waiter = asyncio.ensure_future(ready[pid].wait())
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            for pid, task in started.items():
                said = run.said.get(pid)
                if ready[pid].is_set() or (task.done() and said is not None and said.state == "succeeded"):
                    continue
                detail = said.detail if said is not None else "it stopped without a word"
                return f"{pid} failed: {detail}"
        return ""

    async def _run_part(self, rid: str, release_version: str, part: _Part, run: _Converging,
                        ready: asyncio.Event) -> None:
        """One part to its hold through its own module; its reports kept, and its steps said as
        the release's."""
        started = self.clock.monotonic()

        async def hold() -> str:
            figure = f"{part.pid} held after {self.clock.monotonic() - started:.1f} s"
            apps = self.apps
            if part.kind == "app" and apps is not None:
                f = apps.module.figures
                figure += f" (fetched {f.bytes_fetched} bytes, reused {f.bytes_reused})"
            run.figures[part.pid] = figure
            ready.set()
            return await asyncio.shield(run.verdict)

        async def said(rollout_id: str, version: str, state: ReportState, phase: str, detail: str, *,
                       until_ms: int = 0) -> None:
            run.said[part.pid] = RolloutReport(device=self.worker.device_id, rollout_id=rid,
                                               version=version[:64], state=state, phase=phase[:32],
                                               detail=detail[:1000], ts_ms=0, seq=0)
            log.info("release %s: %s %s: %s", rid, part.pid, state, detail)
            if state not in FINAL_REPORT_STATES:
                await self._reporter()(rid, release_version, "installing", f"{part.pid}"[:32],
                                       f"{part.pid}: {detail}")

        try:
            if part.kind == "config":
                config = self.config
                assert config is not None
                await config.module.apply(part.offer, part.checked, said, hold=hold, said_as=release_version)
            else:
                apps = self.apps
                assert apps is not None
                await apps.module.apply(part.offer, part.checked, said, hold=hold)
        except Exception as exc:  # a part's own fault must not leave the others waiting
            log.exception("release %s: %s", rid, part.pid)
            run.said[part.pid] = RolloutReport(device=self.worker.device_id, rollout_id=rid, version=part.version,
                                               state="failed", phase="failed", ts_ms=0, seq=0,
                                               detail=f"{type(exc).__name__}: {exc}"[:1000])

    def abandon(self) -> None:
        """The agent stops: the parts converging now stop where they are, as they would in a
        process that ends (their journals say what the next start settles)."""
        run, self._converging = self._converging, None
        if run is not None:
            for task in run.tasks:
                task.cancel()

    async def _settle(self, *, commit: bool, reason: str = "") -> None:
        """Every held part committed or taken back: the running convergence's by its word, and
        any a start found held (the parts' journals)."""
        async with self._settling:
            run, self._converging = self._converging, None
            if run is not None:
                if not run.verdict.done():
                    run.verdict.set_result("" if commit else reason or "its release was taken back")
                await asyncio.gather(*run.tasks, return_exceptions=True)
            config, apps = self.config, self.apps
            if config is not None:
                for name in config.module.held():
                    why = await config.module.settle_held(name, commit=commit, reason=reason)
                    if why:
                        log.warning("release: %s", why)
            if apps is not None:
                for name in apps.module.held():
                    why = await apps.module.settle_held(name, commit=commit)
                    if why:
                        log.warning("release: %s", why)
            journal = self._journal()
            if journal is not None:
                self._keep(msgspec.structs.replace(journal, stand="done",
                                                   failed=journal.failed or ("" if commit else reason)))

    # -- the firmware as a part ----------------------------------------------------------------
    def _hand_firmware(self, offer: object) -> str:
        part = self.firmware
        if part is None or part.ref is None:
            return "the updater is not running"
        try:
            part.ref.tell(offer)
        except EdgeAgentError as exc:
            return f"the updater did not take the firmware: {exc}"
        return ""

    def _on_firmware_trial(self, rid: str) -> bool:
        part = self.firmware
        updater = part.actor.updater if part is not None and part.actor is not None else None
        if updater is None:
            return self._journal_firmware()
        from firmware_rollout.messages import TERMINAL_STATES

        status = updater.status()
        return status.rollout_id == rid and status.state not in TERMINAL_STATES

    def _journal_firmware(self) -> bool:
        journal = self._journal()
        if journal is None:
            return False
        with contextlib.suppress(ReleaseError):
            return peek_release(journal.document).firmware is not None
        return False

    async def trial_boot(self, timeout_s: float) -> HealthResult:
        """The updater's hold on a trial boot: the release's other parts converge, within
        `timeout_s`; healthy when all of them are held (they commit after the firmware)."""
        from firmware_rollout.device.health import HealthResult

        journal = self._journal()
        if journal is None or journal.stand not in ("firmware", "converging", "firmware_commit"):
            return HealthResult(True)
        part = self.firmware
        updater = part.actor.updater if part is not None and part.actor is not None else None
        if updater is None or updater.status().rollout_id != journal.rollout_id:
            return HealthResult(True)  # another rollout's trial: not the release's to decide
        if journal.stand == "firmware_commit":
            return HealthResult(True, "the release's parts were healthy")
        document = peek_release(journal.document)
        name, version = document.name, document.version
        if journal.stand == "converging":
            why = "its trial boot was cut off while the other parts converged"
            self._stand("reverting", failed=why)
            await self._settle(commit=False, reason=why)
            return HealthResult(False, f"release {name} {version}: {why}")
        report = self._reporter()
        try:
            checked = self.check(ReleaseOffer(rollout_id=journal.rollout_id, document=journal.document,
                                              parts=journal.parts))
        except Rejected as exc:
            self._stand("reverting", failed=str(exc))
            return HealthResult(False, f"release {name} {version}: {exc}")
        self._trial_at_ms = self.clock.now_ms()
        self._stand("converging")
        await report(journal.rollout_id, version, "verifying", "converging",
                     f"firmware {checked.parts['firmware'].version} booted on trial: converging {document.says()}")
        try:
            why = await self.clock.wait_for(self._converge(journal.rollout_id, checked), timeout_s)
        except TimeoutError:
            why = f"its parts did not converge within {timeout_s:g}s of the trial boot"
        if why:
            self._stand("reverting", failed=why)
            await self._settle(commit=False, reason=why)
            return HealthResult(False, f"release {name} {version}: {why}")
        booted = f"firmware {checked.parts['firmware'].version} booted on trial after" \
                 f" {(self._trial_at_ms - journal.started_ms) / 1000:.1f} s" if journal.started_ms else ""
        self._stand("firmware_commit", figures=self._figures(*([booted] if booted else [])))
        return HealthResult(True, f"release {name} {version}: every part healthy")

    async def _apps_restored(self) -> None:
        """On a new slot's first boot the application helper writes back the units this root
        file system lacks and reloads systemd before it answers: the parts converge after that
        (a reload while a config target is applied can drop the path unit's trigger that makes
        its service read the new file)."""
        apps = self.apps
        if apps is not None:
            with contextlib.suppress(EdgeAgentError, OSError):
                await apps.module.helper.records()

    async def claims(self, report: RolloutReport) -> bool:
        """The updater's reports of the release's firmware: said as the release's; its outcome
        settles the other parts. False: not the release's (the updater sends it itself)."""
        journal = self._journal()
        if journal is None or report.rollout_id != journal.rollout_id:
            return False
        document = peek_release(journal.document)
        if report.state in FINAL_REPORT_STATES:
            await self._firmware_decided(journal, report.phase if report.state != "succeeded" else "committed",
                                         detail=report.detail)
            return True
        runner, send = self._runner, self._send
        assert runner is not None and send is not None
        await send(msgspec.structs.replace(  # (with its download's progress: the leader's download view)
            runner.next_report(journal.rollout_id, document.version, report.state, f"firmware {report.phase}"[:32],
                               f"firmware {report.version}: {report.detail}"),
            progress=report.progress, active_version=report.active_version))
        return True

    def attach(self, runner: OfferRunner[ReleaseOffer, CheckedRelease],
               send: Callable[[RolloutReport], Awaitable[None]]) -> None:
        """The offer runner that drives this module, and the sink of its reports."""
        self._runner, self._send, self.report = runner, send, runner.report

    async def _firmware_outcome(self, rid: str) -> str:
        """The updater's outcome of the release's firmware once it has opened ("" while the trial
        runs: its health check decides)."""
        from firmware_rollout.messages import TERMINAL_STATES

        updater = await self._opened_updater()
        if updater is None:
            return "rolled_back"
        status = updater.status()
        if status.rollout_id != rid:
            return "rolled_back"  # (the updater knows nothing of it: nothing was committed)
        return status.state if status.state in TERMINAL_STATES else ""

    async def _firmware_decided(self, journal: _Journal, outcome: str, *, detail: str = "") -> None:
        """The firmware's outcome settles the release: committed, every held part committed; any
        other end, every held part taken back; "" the trial goes on (its health check decides)."""
        if not outcome:
            return
        if outcome == "committed":
            self._stand("committing")
            await self._settle(commit=True)
            await self._conclude(msgspec.structs.replace(journal, stand="committing"), commit=True)
            return
        why = journal.failed or (self._journal() or journal).failed or f"the firmware {outcome}: {detail}"
        self._stand("reverting", failed=why)
        await self._settle(commit=False, reason=why)
        await self._conclude(msgspec.structs.replace(journal, failed=why), commit=False)

    async def _conclude(self, journal: _Journal, *, commit: bool) -> None:
        document = peek_release(journal.document)
        report = self._reporter()
        if commit:
            figures = f" ({'; '.join(journal.figures)})" if journal.figures else ""
            await report(journal.rollout_id, document.version, "succeeded", "converged",
                         f"release {document.name} {document.version} converged: {document.says()}{figures}")
        else:
            await report(journal.rollout_id, document.version, "rolled_back", "release",
                         self._back(document.name, document.version, journal.failed or "taken back", journal.before))

    # -- words -------------------------------------------------------------------------------
    def _before(self, checked: CheckedRelease, firmware: str) -> str:
        """What the device runs of each part now, in a few words (`firmware`: the slot it runs)."""
        said = []
        for pid, part in checked.parts.items():
            if part.kind == "firmware":
                said.append(f"firmware {firmware}")
            elif part.kind == "app":
                states = self.worker.app_states() or {}
                state = states.get(pid.split(":", 1)[1])
                said.append(f"{pid} {state.version if state is not None else 'none'}")
            else:
                held = (self.worker.config_states() or {}).get(pid.split(":", 1)[1])
                said.append(f"{pid} {held.version if held is not None and held.version else 'none'}")
        return ", ".join(said)

    @staticmethod
    def _back(name: str, version: str, why: str, before: str) -> str:
        return f"release {name} {version} taken back whole: {why}; back on {before or 'what it ran'}"

    def _reporter(self) -> Reporter:
        assert self.report is not None
        return self.report

    # -- the journal ---------------------------------------------------------------------------
    def _journal(self) -> _Journal | None:
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=_Journal)
        except FileNotFoundError:
            return None
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("%s: unreadable (%s)", self.path, exc)
            return None

    def _keep(self, journal: _Journal) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(self.path, msgspec.json.encode(journal), mode=0o600)

    def _stand(self, stand: Stand, *, failed: str = "", figures: tuple[str, ...] = ()) -> None:
        journal = self._journal()
        if journal is not None:
            self._keep(msgspec.structs.replace(journal, stand=stand, failed=failed or journal.failed,
                                               figures=figures or journal.figures))

    def _figures(self, *first: str) -> tuple[str, ...]:
        """What the running convergence's parts took to their holds, in the release's order."""
        run = self._converging
        return (*first, *(run.figures.values() if run is not None else ()))


def _decoded(payload: bytes, type_: type[Any]) -> Any:
    try:
        return decode(payload, type_)
    except CodecError as exc:
        raise Rejected(f"its offer does not decode: {exc}") from None


class ReleaseHold:
    """The updater's hold on a trial boot (`UpdaterActor.hold`): the release's other parts."""

    def __init__(self, module: ReleaseModule) -> None:
        self.module = module

    async def check(self, clock: Clock, timeout_s: float) -> HealthResult:
        return await self.module.trial_boot(timeout_s)


class ReleasesPart(PartBase):
    """The offer runner with the release module; release offers and cancels routed to it; the
    updater's hold and claims set before it starts."""

    name = "releases"

    def __init__(self, worker: WorkerAgent, key: Verifier) -> None:
        from agent.worker.hardware import system_utc_offset_s

        self.worker = worker
        state_dir = worker.data_dir / "releases"
        self.module = ReleaseModule(worker, key=key, state_dir=state_dir)

        async def send(report: RolloutReport) -> None:
            await worker.outbox.enqueue(report_message(report, msg_id=worker.ids.next(), receiver=LEADER))

        self.runner: OfferRunner[ReleaseOffer, CheckedRelease] = OfferRunner(
            self.module, device_id=worker.device_id, key=key, clock=worker.clock, state_dir=state_dir, send=send,
            utc_offset_s=system_utc_offset_s, excerpt=worker.failure_logs)
        self.module.attach(self.runner, send)
        firmware = self.module.firmware
        if firmware is not None:
            firmware.hold = ReleaseHold(self.module)
            firmware.claims = self.module.claims
        self.ref: ActorRef | None = None

    async def start(self) -> None:
        worker = self.worker
        self.ref = worker.system.spawn(self.runner, name="release-offers", capacity=4, policy="reject")
        self.ref.tell(Resume())
        worker.register_command(KIND_RELEASE_OFFER, ReleaseOffer, self.ref)
        worker.register_command(KIND_RELEASE_CANCEL, RolloutCancel, self.ref)

    async def stop(self) -> None:
        """The parts it holds stop where they are (its actor stops with the worker's)."""
        self.module.abandon()


__all__ = ["ReleaseHold", "ReleaseModule", "ReleasesPart"]
