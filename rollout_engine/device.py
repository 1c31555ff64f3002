"""The device's side of every rollout kind: one offer runner, a module per kind.

    offer ─► trust (the fleet's document that came with it) ─► the module checks it
        │         └── rejected (a trust document refused, not signed by the fleet's key, not for
        │                       this device: the module's reason)
        ├─► outside its maintenance window: waiting_window, a timer; the window opens: a message
        │   to the runner (never a sleep: a cancel is taken meanwhile and drops it: canceled)
        └─► the module applies it and reports its own steps and outcome

The runner is an actor: offers, window openings and cancels are its messages, one at a time.
It sends every report through `send` (the worker's outbox: OVERWRITE per device and rollout);
`seq` grows with every report, across restarts too (the leader keeps the newest). Its journal
(`JOURNAL`, one typed document written atomically) holds the offers waiting for their window: a
device killed while one waits arms its timer again at the next start; and the outcome of the last
rollouts it concluded (`succeeded`, `rolled_back`): an offer of one of them again (sent again
after a takeover, or come twice while the module was busy with it) is answered with that outcome,
not applied again. A `failed` or `timed_out` one is the leader's retry: it is applied. What a module had under
way when the device stopped, its `resume` finishes (each module keeps its own durable record of
its steps: a config apply's journal).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import msgspec

from agent.actors import Actor, Context
from agent.core.clock import Clock, TimerHandle
from agent.core.errors import EdgeAgentError
from agent.core.files import atomic_write
from agent.core.redact import redact
from rollout_engine.errors import TrustError
from rollout_engine.keys import Verifier
from rollout_engine.messages import ReportState, RolloutCancel, RolloutReport
from rollout_engine.trust import take_trust_document
from rollout_engine.windows import parse_window, window_wait

log = logging.getLogger(__name__)

JOURNAL = "offers.json"
OfferT = TypeVar("OfferT", bound=msgspec.Struct)  # a kind's offer message
CheckedT = TypeVar("CheckedT")  # what the module made of an offer it checked


@dataclass(frozen=True)
class Facts:
    """What the runner reads of any offer."""

    rollout_id: str
    version: str  # what it installs, as shown (not verified yet: only to name it in a report)
    windows: tuple[str, ...]  # device-local "HH:MM-HH:MM" (none: any time)
    trust: bytes  # the fleet's trust document that came with it ("" none)
    # the systemd units it touches: their journal goes with a failure's report (`excerpt`)
    units: tuple[str, ...] = ()


class ExcerptSource(Protocol):
    """The device's logs, for a failure's report (the worker's `FailureLogs`)."""

    async def explain(self, detail: str, units: tuple[str, ...], since_ms: int) -> tuple[str, tuple[str, ...]]:
        """A failure's `detail` without the device's secrets, and the lines that explain it: the
        agent's and `units`' since `since_ms`, redacted, bounded."""
FAILURE_STATES = frozenset({"failed", "rolled_back"})
EXCERPT_SPAN_MS = 15 * 60_000  # a failure whose offer this start did not take: lines of this long
BEGUN_KEPT = 32  # offers whose start (and units) the runner remembers for their failure's excerpt
CONCLUDED_KEPT = 32  # rollouts whose outcome the runner says again when one is offered again
SAID_AGAIN: frozenset[str] = frozenset({"succeeded", "rolled_back"})  # outcomes a repeated offer does not undo


async def excerpted(report: RolloutReport, source: ExcerptSource, units: tuple[str, ...],
                    since_ms: int) -> RolloutReport:
    """`report` with its detail redacted and the log lines of its failure attached."""
    try:
        detail, lines = await source.explain(report.detail, units, since_ms)
    except Exception as exc:  # never a lost report for want of its logs
        log.warning("rollout %s: no log excerpt for its report: %s", report.rollout_id, exc)
        return report
    return msgspec.structs.replace(report, detail=detail, excerpt=lines)


class Reporter(Protocol):
    async def __call__(self, rollout_id: str, version: str, state: ReportState, phase: str, detail: str, *,
                       until_ms: int = 0) -> None: ...


class Rejected(EdgeAgentError):
    """An offer this device does not take: reported `rejected` with the reason."""


class OfferModule(Protocol[OfferT, CheckedT]):
    """A kind's device side, as the runner drives it."""

    @property
    def offer_type(self) -> type[OfferT]: ...

    def facts(self, offer: OfferT) -> Facts: ...

    def check(self, offer: OfferT) -> CheckedT:
        """What the device would apply (verified whole); `Rejected` says why not."""

    async def apply(self, offer: OfferT, checked: CheckedT, report: Reporter) -> None:
        """Apply it, reporting each step and the outcome (`report`)."""

    async def resume(self, report: Reporter) -> None:
        """At the start: finish what a stop or a power cut interrupted, and report it."""


class _Waiting(msgspec.Struct, frozen=True):
    offer: bytes  # the offer as it came (msgpack of the module's `offer_type`)
    until_ms: int


class _Concluded(msgspec.Struct, frozen=True):
    version: str
    state: ReportState
    phase: str
    detail: str


class _Journal(msgspec.Struct, frozen=True):
    waiting: dict[str, _Waiting] = {}
    concluded: dict[str, _Concluded] = {}  # rollout -> its outcome here, oldest first


@dataclass(frozen=True)
class _WindowOpen:
    rollout_id: str


@dataclass(frozen=True)
class Resume:
    """Told first, at the start: finish what a stop interrupted, arm the waiting offers again."""


class OfferRunner(Actor, Generic[OfferT, CheckedT]):
    """One kind's offers on a device, one at a time (`module` does the kind's own work)."""

    def __init__(self, module: OfferModule[OfferT, CheckedT], *, device_id: str, key: Verifier, clock: Clock,
                 state_dir: Path, send: Callable[[RolloutReport], Awaitable[None]],
                 utc_offset_s: Callable[[], float] = lambda: 0.0, excerpt: ExcerptSource | None = None) -> None:
        self.module = module
        self.device_id = device_id
        self.key = key
        self.clock = clock
        self.journal_path = state_dir / JOURNAL
        self._send = send
        self._utc_offset_s = utc_offset_s
        self._seq = 0
        self._timers: dict[str, TimerHandle] = {}
        self._excerpt = excerpt
        self._begun: dict[str, tuple[tuple[str, ...], int]] = {}  # rollout -> (its units, when it began)

    # -- messages ------------------------------------------------------------------------------
    async def receive(self, message: object, ctx: Context) -> None:
        module = self.module
        if isinstance(message, module.offer_type):
            await self._offer(message, ctx, window_open=False)
        elif isinstance(message, _WindowOpen):
            waiting = self._forget(message.rollout_id)
            if waiting is not None:
                await self._offer(msgspec.msgpack.decode(waiting.offer, type=module.offer_type), ctx,
                                  window_open=True)
        elif isinstance(message, RolloutCancel):
            await self._cancel(message)
        elif isinstance(message, Resume):
            await self._resume(ctx)

    async def on_stop(self, ctx: Context) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    async def _offer(self, offer: OfferT, ctx: Context, *, window_open: bool) -> None:
        facts = self.module.facts(offer)
        rid, version = facts.rollout_id, facts.version
        concluded = self._journal().concluded.get(rid)
        if concluded is not None:
            log.info("offer %s: concluded here already (%s): its outcome said again", rid, concluded.state)
            await self._send(self.next_report(rid, concluded.version, concluded.state, concluded.phase,
                                              concluded.detail))
            return
        self._begin(rid, facts.units)
        try:
            take_trust_document(self.key, facts.trust, came_with=f"offer {rid}")
        except TrustError as exc:
            log.warning("offer %s: trust document refused: %s", rid, exc)
            await self.report(rid, version, "rejected", "rejected", f"trust document refused: {exc}")
            return
        try:
            checked = self.module.check(offer)
            windows = [parse_window(w) for w in facts.windows]
        except (Rejected, ValueError) as exc:
            await self.report(rid, version, "rejected", "rejected", str(exc))
            return
        wait_s, until = window_wait(windows, self.clock.now_ms(), self._utc_offset_s())
        if wait_s > 0 and not window_open:
            until_ms = self.clock.now_ms() + int(wait_s * 1000)
            self._wait(rid, msgspec.msgpack.encode(offer), until_ms, ctx)
            log.info("offer %s (%s) waits %.0fs for its maintenance window (%s)", rid, version, wait_s, until)
            await self.report(rid, version, "waiting_window", "idle", until, until_ms=until_ms)
            return
        await self.module.apply(offer, checked, self.report)

    async def _cancel(self, cancel: RolloutCancel) -> None:
        waiting = self._forget(cancel.rollout_id)
        if waiting is None:
            return  # applied already (it reported), or never offered here
        version = self.module.facts(msgspec.msgpack.decode(waiting.offer, type=self.module.offer_type)).version
        await self.report(cancel.rollout_id, version, "canceled", "canceled",
                          f"canceled while waiting for its maintenance window: {cancel.reason}" if cancel.reason
                          else "canceled while waiting for its maintenance window")

    async def _resume(self, ctx: Context) -> None:
        await self.module.resume(self.report)
        for rid, waiting in self._journal().waiting.items():  # the timers of a previous start
            self._arm(rid, max(0.0, (waiting.until_ms - self.clock.now_ms()) / 1000), ctx)

    # -- the waiting offers --------------------------------------------------------------------
    def _journal(self) -> _Journal:
        try:
            return msgspec.json.decode(self.journal_path.read_bytes(), type=_Journal)
        except FileNotFoundError:
            return _Journal()
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("%s: unreadable (%s): the offers waiting for a window are offered again by the"
                        " leader", self.journal_path, exc)
            return _Journal()

    def _keep(self, journal: _Journal) -> None:
        self.journal_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(self.journal_path, msgspec.json.encode(journal), mode=0o600)

    def _wait(self, rid: str, offer: bytes, until_ms: int, ctx: Context) -> None:
        journal = self._journal()
        self._keep(msgspec.structs.replace(journal, waiting={**journal.waiting, rid: _Waiting(offer, until_ms)}))
        self._arm(rid, (until_ms - self.clock.now_ms()) / 1000, ctx)

    def _arm(self, rid: str, delay_s: float, ctx: Context) -> None:
        old = self._timers.pop(rid, None)
        if old is not None:
            old.cancel()

        def opened() -> None:
            with contextlib.suppress(EdgeAgentError):  # (stopping, or a full mailbox: the leader offers it again)
                ctx.self.tell(_WindowOpen(rid))

        self._timers[rid] = self.clock.call_later(delay_s, opened)

    def _forget(self, rid: str) -> _Waiting | None:
        """Stop waiting for `rid`'s window; the offer that waited (None: none did)."""
        timer = self._timers.pop(rid, None)
        if timer is not None:
            timer.cancel()
        journal = self._journal()
        waiting = journal.waiting.get(rid)
        if waiting is not None:
            self._keep(msgspec.structs.replace(journal, waiting={k: v for k, v in journal.waiting.items() if k != rid}))
        return waiting

    # -- reports -------------------------------------------------------------------------------
    def next_report(self, rollout_id: str, version: str, state: ReportState, phase: str, detail: str, *,
                    until_ms: int = 0) -> RolloutReport:
        """The next report, its `seq` above every earlier one (across restarts: from the clock)."""
        now = self.clock.now_ms()
        self._seq = max(self._seq + 1, now)
        return RolloutReport(device=self.device_id, rollout_id=rollout_id, version=version[:64], state=state,
                             phase=phase[:32], detail=redact(detail)[:1000], ts_ms=now, seq=self._seq,
                             until_ms=until_ms)

    async def report(self, rollout_id: str, version: str, state: ReportState, phase: str, detail: str, *,
                     until_ms: int = 0) -> None:
        report = self.next_report(rollout_id, version, state, phase, detail, until_ms=until_ms)
        if state in SAID_AGAIN:
            self._conclude(report)
        if state in FAILURE_STATES:
            report = await self.with_excerpt(report)
        await self._send(report)

    def _conclude(self, report: RolloutReport) -> None:
        """Keep `report`'s outcome (before it is sent: a repeated offer after a power cut here is
        answered, not applied again)."""
        journal = self._journal()
        concluded = {k: v for k, v in journal.concluded.items() if k != report.rollout_id}
        concluded[report.rollout_id] = _Concluded(report.version, report.state, report.phase, report.detail)
        while len(concluded) > CONCLUDED_KEPT:
            del concluded[next(iter(concluded))]
        self._keep(msgspec.structs.replace(journal, concluded=concluded))

    def _begin(self, rollout_id: str, units: tuple[str, ...]) -> None:
        self._begun.pop(rollout_id, None)
        self._begun[rollout_id] = (units, self.clock.now_ms())
        while len(self._begun) > BEGUN_KEPT:
            del self._begun[next(iter(self._begun))]

    async def with_excerpt(self, report: RolloutReport, units: tuple[str, ...] = ()) -> RolloutReport:
        """`report` carrying the log lines of its failure (those of `units` besides the ones its
        offer named), when this runner has an excerpt source."""
        if self._excerpt is None or report.excerpt:
            return report
        named, since_ms = self._begun.get(report.rollout_id, ((), report.ts_ms - EXCERPT_SPAN_MS))
        return await excerpted(report, self._excerpt, tuple(dict.fromkeys(named + units)), since_ms)


__all__ = ["EXCERPT_SPAN_MS", "FAILURE_STATES", "JOURNAL", "ExcerptSource", "Facts", "OfferModule", "OfferRunner",
           "Rejected", "Reporter", "Resume", "excerpted"]
