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
interrupted apply left is finished first and reported. Loaded only for a worker that declares
`[config_targets]` or takes releases of its own settings (the built-in target `agent`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agent.actors import Actor, ActorRef, Context
from agent.core.clock import TimerHandle
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
from config_rollout.layers import render
from config_rollout.messages import KIND_CONFIG_CANCEL, KIND_CONFIG_OFFER, OFFER_RELEASE_MAX, ConfigOffer
from config_rollout.release import parse_release, peek_release
from rollout_engine.errors import TrustError
from rollout_engine.keys import Verifier
from rollout_engine.messages import ReportState, RolloutCancel, RolloutReport, report_message
from rollout_engine.trust import take_trust_document
from rollout_engine.windows import parse_window, window_wait

log = logging.getLogger(__name__)
ApplyPhase = str  # a report's `phase`: the applier's step, in the words the firmware updater uses for its own
LEADER_ANSWER_S = 5.0  # one confirm's round trip to the leader, at most

#: What the leader sees of each outcome of `ConfigApplier.apply`.
OUTCOME_REPORTS: dict[str, tuple[ReportState, ApplyPhase]] = {
    "committed": ("succeeded", "committed"), "failed": ("failed", "failed"),
    "rolled_back": ("rolled_back", "rolled_back"), "restarting": ("verifying", "verifying")}


class ResumeTargets:
    """Told first, at the start: finish what an interrupted apply left, report what it decided."""


@dataclass(frozen=True)
class WindowOpen:
    """An offer's maintenance window has opened: apply it, unless it was canceled meanwhile."""

    rollout_id: str


class ConfigOfferActor(Actor):
    """Applies the config offers one at a time and reports each step. `restart` asks the service
    to start the agent again (the built-in target `agent` takes effect so; None: it is not offered)."""

    def __init__(self, worker: WorkerAgent, key: Verifier, steps: ConfigSteps | None = None,
                 restart: Callable[[], None] | None = None) -> None:
        self._worker = worker
        self._key = key
        self._steps = steps
        self._restart = restart
        self._utc_offset_s = system_utc_offset_s
        self._seq = 0
        # offers waiting for their maintenance window, by rollout (in memory: after a restart
        # the leader's timeout, counted from the window, offers it again)
        self._waiting: dict[str, tuple[ConfigOffer, TimerHandle]] = {}

    async def receive(self, message: object, ctx: Context) -> None:
        if isinstance(message, ConfigOffer):
            await self._apply(message, ctx)
        elif isinstance(message, WindowOpen):
            waiting = self._waiting.pop(message.rollout_id, None)
            if waiting is not None:
                await self._apply(waiting[0], ctx, window_open=True)
        elif isinstance(message, RolloutCancel):
            await self._cancel(message)
        elif isinstance(message, ResumeTargets):
            await self._resume()

    async def _cancel(self, cancel: RolloutCancel) -> None:
        waiting = self._waiting.pop(cancel.rollout_id, None)
        if waiting is None:
            return  # applied already (it reported), or never offered here
        offer, timer = waiting
        timer.cancel()
        version = _shown(offer)[1]
        await self._report(offer.rollout_id, version, "canceled", "canceled",
                           f"canceled while waiting for its maintenance window: {cancel.reason}" if cancel.reason
                           else "canceled while waiting for its maintenance window")

    async def on_stop(self, ctx: Context) -> None:
        for _, timer in self._waiting.values():
            timer.cancel()
        self._waiting.clear()

    def targets(self) -> dict[str, ConfigTargetSection]:
        """The declared targets, and the built-in `agent` where this agent takes its own settings."""
        worker = self._worker
        found = dict(worker.config.config_targets)
        if self._restart is not None and offers_agent_target(worker.config):
            found[AGENT_TARGET] = agent_target(worker.data_dir)
        return found

    def _applier(self, name: str, target: ConfigTargetSection, rollout_id: str, version: str) -> ConfigApplier:
        worker = self._worker
        steps = self._steps
        own = name == AGENT_TARGET
        return ConfigApplier(name, target, worker.data_dir,
                             confirm=self._host_check(rollout_id, version, f"applied {name} {version}: confirming"),
                             reviews=config_reviews(worker), clock=worker.clock,
                             on_step=(lambda step: steps(worker, name, step)) if steps is not None else None,
                             check=settings_check(worker.config) if own else None,
                             restarts=self._restart if own else None)

    async def _resume(self) -> None:
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
                await self._report(context["rollout_id"], context.get("version", ""), state, phase, result.detail)

    async def _apply(self, offer: ConfigOffer, ctx: Context, *, window_open: bool = False) -> None:
        worker = self._worker
        name, version = _shown(offer)
        rid = offer.rollout_id
        try:
            take_trust_document(self._key, offer.trust, came_with=f"offer {rid}")
        except TrustError as exc:
            log.warning("offer %s: trust document refused: %s", rid, exc)
            await self._report(rid, version, "rejected", "rejected", f"trust document refused: {exc}")
            return
        try:
            release = parse_release(offer.release, self._key, source=f"the release of rollout {rid}",
                                    max_document_bytes=OFFER_RELEASE_MAX)
        except ConfigReleaseError as exc:
            await self._report(rid, version, "rejected", "rejected", str(exc))
            return
        target = self.targets().get(release.name)
        if target is None:
            why = ("this agent takes no release of its own settings ([agent] remote_settings, or it runs"
                   " under no service that can start it again)" if release.name == AGENT_TARGET else
                   f"this device has no [config_targets.{name}]: it takes no release {name!r}")
            await self._report(rid, version, "rejected", "rejected", why)
            return
        try:
            rendered = render(release.documents, offer.layers)
            windows = [parse_window(w) for w in offer.maintenance_windows]
        except (ConfigReleaseError, ValueError) as exc:
            await self._report(rid, version, "rejected", "rejected", str(exc))
            return
        wait_s, until = window_wait(windows, worker.clock.now_ms(), self._utc_offset_s())
        if wait_s > 0 and not window_open:
            old = self._waiting.pop(rid, None)
            if old is not None:
                old[1].cancel()
            self._waiting[rid] = (offer, worker.clock.call_later(wait_s, lambda: _tell(ctx, WindowOpen(rid))))
            log.info("config %s %s waits %.0fs for its maintenance window (%s)", name, version, wait_s, until)
            await self._report(rid, version, "waiting_window", "idle", until,
                               until_ms=worker.clock.now_ms() + int(wait_s * 1000))
            return
        await self._report(rid, version, "installing", "installing", f"applying {name} {version}")
        worker.beat_fast(worker.config.heartbeat.fast_hold_s)
        applier = self._applier(release.name, target, rid, version)
        try:
            result = await applier.apply(release, rendered, context={"rollout_id": rid, "version": version})
        except (EdgeAgentError, OSError) as exc:
            detail = f"the apply stopped: {exc}"
            await self._report(rid, version, "failed", "failed", detail)
            log.error("config %s %s: %s", name, version, detail)
            return
        state, phase = OUTCOME_REPORTS[result.state]
        log.info("config %s %s: %s (%s)", name, version, result.state, result.detail)
        await self._report(rid, version, state, phase, result.detail)

    def _host_check(self, rollout_id: str, version: str, detail: str) -> Callable[[], Awaitable[str]]:
        """The host's part of the confirm: connected to the broker, and the leader accepts the
        `verifying` report sent straight to it now."""
        worker = self._worker

        async def check() -> str:
            if not worker.transport.connected.is_open:
                return "the broker connection is down"
            report = self._next_report(rollout_id, version, "verifying", "verifying", detail)
            envelope = envelope_of(report_message(report, msg_id=worker.ids.next(), receiver=LEADER), worker.clock)
            try:
                await worker.clock.wait_for(worker.link.tell(envelope), LEADER_ANSWER_S)
            except (TimeoutError, EdgeAgentError) as exc:
                return f"the leader did not answer: {str(exc) or f'no answer within {LEADER_ANSWER_S:g} s'}"
            return ""

        return check

    def _next_report(self, rollout_id: str, version: str, state: ReportState, phase: ApplyPhase,
                     detail: str, until_ms: int = 0) -> RolloutReport:
        worker = self._worker
        now = worker.clock.now_ms()
        self._seq = max(self._seq + 1, now)  # grows across restarts too (the leader keeps the highest)
        return RolloutReport(device=worker.device_id, rollout_id=rollout_id, version=version[:64],
                            state=state, phase=phase, detail=detail[:1000], ts_ms=now, seq=self._seq,
                            until_ms=until_ms)

    async def _report(self, rollout_id: str, version: str, state: ReportState, phase: ApplyPhase,
                      detail: str, *, until_ms: int = 0) -> None:
        worker = self._worker
        report = self._next_report(rollout_id, version, state, phase, detail, until_ms)
        await worker.outbox.enqueue(report_message(report, msg_id=worker.ids.next(), receiver=LEADER))


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


def _tell(ctx: Context, message: object) -> None:
    with contextlib.suppress(EdgeAgentError):  # (stopping, or a full mailbox: the leader offers it again)
        ctx.self.tell(message)


class ConfigTargetsPart(PartBase):
    """The actor spawned into the started worker, config offers routed to it; an interrupted
    apply is finished first."""

    name = "config targets"

    def __init__(self, worker: WorkerAgent, key: Verifier, steps: ConfigSteps | None = None,
                 restart: Callable[[], None] | None = None) -> None:
        self._worker = worker
        self.actor = ConfigOfferActor(worker, key, steps, restart)
        self.ref: ActorRef | None = None

    async def start(self) -> None:
        worker = self._worker
        self.ref = worker.system.spawn(self.actor, name="config-offers", capacity=8, policy="reject",
                                       stall_s=worker.config.mailbox.stall_s)
        self.ref.tell(ResumeTargets())
        worker.register_command(KIND_CONFIG_OFFER, ConfigOffer, self.ref)
        worker.register_command(KIND_CONFIG_CANCEL, RolloutCancel, self.ref)

    async def stop(self) -> None:
        """Nothing of its own: its actor stops with the worker's."""


__all__ = ["ConfigOfferActor", "ConfigTargetsPart", "ResumeTargets", "config_reviews"]
