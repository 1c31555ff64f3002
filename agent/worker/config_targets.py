"""The worker's configuration targets feature: config offers from a rollout applied to the target
of the release's name, commit-confirmed (`config_rollout.device.apply`), and reported to the
leader as the engine's `RolloutReport`s, so the wave engine's gates, thresholds and soak read them
as they read any kind's:

    offer ─► installing (verified, applying) ─► verifying (applied, confirming) ─► succeeded
                 └── rejected (not signed by the fleet's key, no such target, a document it does not take,
                              a layer value the release does not take)
                 └── failed (did not validate, or an application vetoed it)
                 └── rolled_back (not confirmed within confirm_s: reverted)

The confirm check, from the target's `settle_s` after the apply: the broker connection is up and
the leader answers now (the `verifying` report sent straight to it and accepted: an answer from
before the apply proves nothing); with the target's health command, `ConfigApplier` tries both
until `confirm_s`: a config that cuts the device off reverts by itself. One offer is applied at a
time; an offer of a release already committed is answered `succeeded` at once; an offer outside
its maintenance window waits for it (a `config.cancel` drops it). At the start, what an
interrupted apply left is finished first and reported. The trust document, the maintenance window
(a timer, and an offer waiting for it kept across a restart), the cancel and the report sequence
are the device's offer runner's (`rollout_engine.device`); this is configuration's module of it.
Loaded only for a worker that declares `[config_targets]` or takes releases of its own settings
(the built-in target `agent`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agent.actors import ActorRef
from agent.core.config import ConfigTargetSection
from agent.core.errors import EdgeAgentError
from agent.service.parts import PartBase
from agent.worker.actors import LEADER, envelope_of
from agent.worker.agent import WorkerAgent
from agent.worker.env import ConfigSteps
from agent.worker.hardware import system_utc_offset_s
from config_rollout.device.agent_settings import AGENT_TARGET, agent_target, offers_agent_target, settings_check
from config_rollout.device.apply import ConfigApplier
from config_rollout.device.review import ConfigReviews
from config_rollout.errors import ConfigReleaseError
from config_rollout.layers import Rendered, render
from config_rollout.messages import KIND_CONFIG_CANCEL, KIND_CONFIG_OFFER, OFFER_RELEASE_MAX, ConfigOffer
from config_rollout.release import ConfigRelease, parse_release, peek_release
from rollout_engine.device import Facts, OfferRunner, Rejected, Reporter, Resume
from rollout_engine.keys import Verifier
from rollout_engine.messages import ReportState, RolloutCancel, RolloutReport, report_message

log = logging.getLogger(__name__)
ApplyPhase = str  # a report's `phase`: the applier's step, in the words the firmware updater uses for its own
LEADER_ANSWER_S = 5.0  # one confirm's round trip to the leader, at most

#: What the leader sees of each outcome of `ConfigApplier.apply`.
OUTCOME_REPORTS: dict[str, tuple[ReportState, ApplyPhase]] = {
    "committed": ("succeeded", "committed"), "failed": ("failed", "failed"),
    "rolled_back": ("rolled_back", "rolled_back"), "restarting": ("verifying", "verifying")}


@dataclass(frozen=True)
class Checked:
    """An offer verified whole: the release, its documents rendered with the device's layer
    values, and the target that takes it."""

    release: ConfigRelease
    rendered: Rendered
    name: str
    target: ConfigTargetSection


class ConfigModule:
    """Configuration's module of the device's offer runner (`rollout_engine.device`): checks a
    release against the fleet's key and this device's targets, applies it commit-confirmed.
    `restart` asks the service to start the agent again (the built-in target `agent` takes effect
    so; None: it is not offered)."""

    offer_type = ConfigOffer

    def __init__(self, worker: WorkerAgent, key: Verifier, steps: ConfigSteps | None = None,
                 restart: Callable[[], None] | None = None) -> None:
        self._worker = worker
        self._key = key
        self._steps = steps
        self._restart = restart
        self.runner: OfferRunner[ConfigOffer, Checked] | None = None  # set by the part

    def facts(self, offer: ConfigOffer) -> Facts:
        name, version = _shown(offer)
        target = self.targets().get(name)
        return Facts(rollout_id=offer.rollout_id, version=version, windows=offer.maintenance_windows,
                     trust=offer.trust, units=target.units if target is not None else ())

    def targets(self) -> dict[str, ConfigTargetSection]:
        """The declared targets, and the built-in `agent` where this agent takes its own settings."""
        worker = self._worker
        found = dict(worker.config.config_targets)
        if self._restart is not None and offers_agent_target(worker.config):
            found[AGENT_TARGET] = agent_target(worker.data_dir)
        return found

    def check(self, offer: ConfigOffer) -> Checked:
        rid = offer.rollout_id
        try:
            release = parse_release(offer.release, self._key, source=f"the release of rollout {rid}",
                                    max_document_bytes=OFFER_RELEASE_MAX)
        except ConfigReleaseError as exc:
            raise Rejected(str(exc)) from None
        target = self.targets().get(release.name)
        if target is None:
            name = release.name
            raise Rejected("this agent takes no release of its own settings ([agent] remote_settings, or it runs"
                           " under no service that can start it again)" if name == AGENT_TARGET else
                           f"this device has no [config_targets.{name}]: it takes no release {name!r}")
        try:
            rendered = render(release.documents, offer.layers)
        except ConfigReleaseError as exc:
            raise Rejected(str(exc)) from None
        return Checked(release, rendered, release.name, target)

    async def apply(self, offer: ConfigOffer, checked: Checked, report: Reporter, *,
                    hold: Callable[[], Awaitable[str]] | None = None, said_as: str = "") -> None:
        """Apply it commit-confirmed; `hold`: once confirmed, asked whether to commit ("") or
        revert (why): a release commits its parts together; `said_as`: the version the confirm's
        report to the leader names (a release's own: one story per rollout)."""
        worker = self._worker
        rid, name, version = offer.rollout_id, checked.name, checked.release.version
        await report(rid, version, "installing", "installing", f"applying {name} {version}")
        worker.beat_fast(worker.config.heartbeat.fast_hold_s)
        applier = self._applier(name, checked.target, rid, version, said_as=said_as)
        try:
            result = await applier.apply(checked.release, checked.rendered,
                                         context={"rollout_id": rid, "version": version}, hold=hold)
        except (EdgeAgentError, OSError) as exc:
            detail = f"the apply stopped: {exc}"
            await report(rid, version, "failed", "failed", detail)
            log.error("config %s %s: %s", name, version, detail)
            return
        state, phase = OUTCOME_REPORTS[result.state]
        log.info("config %s %s: %s (%s)", name, version, result.state, result.detail)
        await report(rid, version, state, phase, result.detail)

    async def resume(self, report: Reporter) -> None:
        for name, target in sorted(self.targets().items()):
            context = ConfigApplier(name, target, self._worker.data_dir).journal().get("context") or {}
            applier = self._applier(name, target, str(context.get("rollout_id", "")), str(context.get("version", "")))
            try:
                await applier.resume()
                taken = applier.take_unreported()
            except (EdgeAgentError, OSError) as exc:
                log.error("config %s: finishing the interrupted apply failed: %s", name, exc)
                continue
            if taken is None:
                continue
            context, result = taken
            log.info("config %s: %s at the start (%s)", name, result.state, result.detail)
            if context.get("rollout_id"):
                state, phase = OUTCOME_REPORTS[result.state]
                await report(context["rollout_id"], context.get("version", ""), state, phase, result.detail)

    def held(self) -> list[str]:
        """The targets whose apply a release holds (confirmed, waiting for the release's word)."""
        held = []
        for name, target in sorted(self.targets().items()):
            try:
                if ConfigApplier(name, target, self._worker.data_dir).held():
                    held.append(name)
            except EdgeAgentError as exc:
                log.warning("config %s: %s", name, exc)
        return held

    async def settle_held(self, name: str, *, commit: bool, reason: str = "") -> str:
        """A held apply of target `name` committed, or reverted saying `reason`: "" done (or
        nothing held), else why not."""
        target = self.targets().get(name)
        if target is None:
            return ""
        try:
            await self._applier(name, target, "", "").settle_held(commit=commit, reason=reason)
        except (EdgeAgentError, OSError) as exc:
            return f"config {name}: {exc}"
        return ""

    def _applier(self, name: str, target: ConfigTargetSection, rollout_id: str, version: str, *,
                 said_as: str = "") -> ConfigApplier:
        worker = self._worker
        steps = self._steps
        own = name == AGENT_TARGET
        return ConfigApplier(name, target, worker.data_dir,
                             confirm=self._host_check(rollout_id, said_as or version,
                                                      f"applied {name} {version}: confirming"),
                             reviews=config_reviews(worker), clock=worker.clock,
                             on_step=(lambda step: steps(worker, name, step)) if steps is not None else None,
                             check=settings_check(worker.config) if own else None,
                             restarts=self._restart if own else None)

    def _host_check(self, rollout_id: str, version: str, detail: str) -> Callable[[], Awaitable[str]]:
        """The host's part of the confirm: connected to the broker, and the leader accepts the
        `verifying` report sent straight to it now."""
        worker = self._worker

        async def check() -> str:
            if not worker.transport.connected.is_open:
                return "the broker connection is down"
            assert self.runner is not None
            report = self.runner.next_report(rollout_id, version, "verifying", "verifying", detail)
            envelope = envelope_of(report_message(report, msg_id=worker.ids.next(), receiver=LEADER), worker.clock)
            try:
                await worker.clock.wait_for(worker.link.tell(envelope), LEADER_ANSWER_S)
            except (TimeoutError, EdgeAgentError) as exc:
                return f"the leader did not answer: {str(exc) or f'no answer within {LEADER_ANSWER_S:g} s'}"
            return ""

        return check


def config_reviews(worker: WorkerAgent) -> ConfigReviews:
    """The worker's one board of applications' verdicts on staged configs (the applier asks,
    the local API answers)."""
    if worker.config_reviews is None:
        worker.config_reviews = ConfigReviews()
    return worker.config_reviews


def _shown(offer: ConfigOffer) -> tuple[str, str]:
    """The offer's release's name and version, NOT verified: only to name it in a report."""
    try:
        shown = peek_release(offer.release)
    except ConfigReleaseError:
        return "?", "?"
    return shown.name, shown.version


class ConfigTargetsPart(PartBase):
    """The offer runner with configuration's module, spawned into the started worker, config
    offers and cancels routed to it; an interrupted apply is finished first."""

    name = "config targets"

    def __init__(self, worker: WorkerAgent, key: Verifier, steps: ConfigSteps | None = None,
                 restart: Callable[[], None] | None = None) -> None:
        self._worker = worker
        self.module = ConfigModule(worker, key, steps, restart)

        async def send(report: RolloutReport) -> None:
            await worker.outbox.enqueue(report_message(report, msg_id=worker.ids.next(), receiver=LEADER))

        self.runner = OfferRunner(self.module, device_id=worker.device_id, key=key, clock=worker.clock,
                                  state_dir=worker.data_dir / "config", send=send, utc_offset_s=system_utc_offset_s,
                                  excerpt=worker.failure_logs)
        self.module.runner = self.runner
        self.ref: ActorRef | None = None

    async def start(self) -> None:
        worker = self._worker
        self.ref = worker.system.spawn(self.runner, name="config-offers", capacity=8, policy="reject",
                                       stall_s=worker.config.mailbox.stall_s)
        self.ref.tell(Resume())
        worker.register_command(KIND_CONFIG_OFFER, ConfigOffer, self.ref)
        worker.register_command(KIND_CONFIG_CANCEL, RolloutCancel, self.ref)

    async def stop(self) -> None:
        """Nothing of its own: its actor stops with the worker's."""


__all__ = ["Checked", "ConfigModule", "ConfigTargetsPart", "config_reviews"]
