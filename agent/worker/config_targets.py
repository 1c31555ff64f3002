"""The worker's configuration targets feature: config offers from a rollout applied to the target
of the release's name, commit-confirmed (`config_rollout.device.apply`), and reported to the
leader as the firmware updater reports (`UpdateReport`), so the wave engine's gates, thresholds
and soak read them alike:

    offer ─► installing (verified, applying) ─► verifying (applied, confirming) ─► succeeded
                 └── rejected (not signed by the fleet's key, no such target, a document it does not take,
                              a layer value the release does not take)
                 └── failed (did not validate, or an application vetoed it)
                 └── rolled_back (not confirmed within confirm_s: reverted)

The confirm check, from the target's `settle_s` after the apply: the broker connection is up and
the leader answers now (the `verifying` report sent straight to it and accepted: an answer from
before the apply proves nothing); with the target's health command, `ConfigApplier` tries both
until `confirm_s`: a config that cuts the device off reverts by itself. One offer is applied at a
time; an offer of a release already committed is answered `succeeded` at once. Loaded only for a
worker that declares `[config_targets]`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from agent.actors import Actor, ActorRef, Context
from agent.core.errors import EdgeAgentError
from agent.service.parts import PartBase
from agent.worker.actors import LEADER, envelope_of
from agent.worker.agent import WorkerAgent
from agent.worker.configuring import config_reviews
from agent.worker.env import ConfigSteps
from config_rollout.device.apply import ConfigApplier
from config_rollout.errors import ConfigReleaseError
from config_rollout.layers import render
from config_rollout.messages import KIND_CONFIG_OFFER, OFFER_RELEASE_MAX, ConfigOffer
from config_rollout.release import parse_release, peek_release
from firmware_rollout.artifact.keys import VerifyKey
from firmware_rollout.messages import ReportState, UpdateReport, UpdaterState, report_message

log = logging.getLogger(__name__)
LEADER_ANSWER_S = 5.0  # one confirm's round trip to the leader, at most

#: What the leader sees of each outcome of `ConfigApplier.apply`.
OUTCOME_REPORTS: dict[str, tuple[ReportState, UpdaterState]] = {
    "committed": ("succeeded", "committed"), "failed": ("failed", "failed"), "rolled_back": ("rolled_back",
                                                                                          "rolled_back")}


class ConfigOfferActor(Actor):
    """Applies the config offers one at a time and reports each step."""

    def __init__(self, worker: WorkerAgent, key: VerifyKey, steps: ConfigSteps | None = None) -> None:
        self._worker = worker
        self._key = key
        self._steps = steps
        self._seq = 0

    async def receive(self, message: object, ctx: Context) -> None:
        if isinstance(message, ConfigOffer):
            await self._apply(message)

    async def _apply(self, offer: ConfigOffer) -> None:
        worker = self._worker
        name, version = "?", "?"
        try:
            shown = peek_release(offer.release)  # only to name it in a refusal; verified next
            name, version = shown.name, shown.version
        except ConfigReleaseError:
            pass
        try:
            release = parse_release(offer.release, self._key, source=f"the release of rollout {offer.rollout_id}",
                                    max_document_bytes=OFFER_RELEASE_MAX)
        except ConfigReleaseError as exc:
            await self._report(offer, version, "rejected", "rejected", str(exc))
            return
        target = worker.config.config_targets.get(release.name)
        if target is None:
            await self._report(offer, version, "rejected", "rejected",
                               f"this device has no [config_targets.{name}]: it takes no release {name!r}")
            return
        try:
            rendered = render(release.documents, offer.layers)
        except ConfigReleaseError as exc:
            await self._report(offer, version, "rejected", "rejected", str(exc))
            return
        await self._report(offer, version, "installing", "installing", f"applying {name} {version}")
        worker.beat_fast(worker.config.heartbeat.fast_hold_s)
        steps = self._steps
        applier = ConfigApplier(release.name, target, worker.data_dir,
                                confirm=self._host_check(offer, version, f"applied {name} {version}: confirming"),
                                reviews=config_reviews(worker), clock=worker.clock,
                                on_step=(lambda step: steps(worker, release.name, step)) if steps is not None else None)
        try:
            result = await applier.apply(release, rendered)
        except (EdgeAgentError, OSError) as exc:
            detail = f"the apply stopped: {exc}"
            await self._report(offer, version, "failed", "failed", detail)
            log.error("config %s %s: %s", name, version, detail)
            return
        state, phase = OUTCOME_REPORTS[result.state]
        log.info("config %s %s: %s (%s)", name, version, result.state, result.detail)
        await self._report(offer, version, state, phase, result.detail)

    def _host_check(self, offer: ConfigOffer, version: str, detail: str) -> Callable[[], Awaitable[str]]:
        """The host's part of the confirm: connected to the broker, and the leader accepts the
        `verifying` report sent straight to it now."""
        worker = self._worker

        async def check() -> str:
            if not worker.transport.connected.is_open:
                return "the broker connection is down"
            report = self._next_report(offer, version, "verifying", "verifying", detail)
            envelope = envelope_of(report_message(report, msg_id=worker.ids.next(), receiver=LEADER), worker.clock)
            try:
                await worker.clock.wait_for(worker.link.tell(envelope), LEADER_ANSWER_S)
            except (TimeoutError, EdgeAgentError) as exc:
                return f"the leader did not answer: {str(exc) or f'no answer within {LEADER_ANSWER_S:g} s'}"
            return ""

        return check

    def _next_report(self, offer: ConfigOffer, version: str, state: ReportState, phase: UpdaterState,
                     detail: str) -> UpdateReport:
        worker = self._worker
        now = worker.clock.now_ms()
        self._seq = max(self._seq + 1, now)  # grows across restarts too (the leader keeps the highest)
        return UpdateReport(device=worker.device_id, rollout_id=offer.rollout_id, version=version[:64],
                            state=state, phase=phase, detail=detail[:1000], ts_ms=now, seq=self._seq)

    async def _report(self, offer: ConfigOffer, version: str, state: ReportState, phase: UpdaterState,
                      detail: str) -> None:
        worker = self._worker
        report = self._next_report(offer, version, state, phase, detail)
        await worker.outbox.enqueue(report_message(report, msg_id=worker.ids.next(), receiver=LEADER))


class ConfigTargetsPart(PartBase):
    """The actor spawned into the started worker, config offers routed to it."""

    name = "config targets"

    def __init__(self, worker: WorkerAgent, key: VerifyKey, steps: ConfigSteps | None = None) -> None:
        self._worker = worker
        self._key = key
        self._steps = steps
        self.actor: ConfigOfferActor | None = None
        self.ref: ActorRef | None = None

    async def start(self) -> None:
        worker = self._worker
        self.actor = ConfigOfferActor(worker, self._key, self._steps)
        self.ref = worker.system.spawn(self.actor, name="config-offers", capacity=8, policy="reject",
                                       stall_s=worker.config.mailbox.stall_s)
        worker.register_command(KIND_CONFIG_OFFER, ConfigOffer, self.ref)

    async def stop(self) -> None:
        """Nothing of its own: its actor stops with the worker's."""


__all__ = ["ConfigOfferActor", "ConfigTargetsPart"]
