"""The rollout orchestrator: a durable state machine on the leader.

    rollout   running ⇄ paused ──► succeeded | aborted | canceled
    wave      pending ─► running ─► soaking ─► (awaiting_approval) ─► passed      (or failed / canceled)
    device    queued ─► notified ─► downloading ─► installing ─► rebooting ─► verifying ─► succeeded
                 │          └──────────── failed / rejected / rolled_back (device reports) ◄┘
                 └► timed_out (no progress within device.timeout_s) · canceled (rollout stopped first)

Everything it knows lives in `RolloutStore` (the leader's SQLite); every transition is one
transaction, and timers are stored deadlines of the leader's Clock, so a leader killed at any
moment carries on exactly when it restarts: a device that succeeded is never offered again
(offers go only to `queued` devices), a wave starts only when the previous one passed its gates
and the move to it is committed.

The orchestrator does not talk to the network itself. A `RolloutPort` gives it the devices the
registry knows and takes the offers it makes (the leader puts them in its outbox, keyed per
device and rollout, so a re-sent offer replaces an unsent one). Device reports come in through
`on_report(msg_id, report)`, deduplicated by message id and ordered by the report's `seq`.

`run()` ticks when woken (a report, a control) or at the next stored deadline, and at least
every `poll_s`: that tick is also when controls the CLI wrote into the database are applied
(one indexed read of `rollout_controls WHERE applied_ms IS NULL`). In-process callers apply a
control at once with `control()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from agent.core.clock import Clock
from agent.core.codec import encode
from agent.core.errors import EdgeAgentError, RolloutError, store_log_level
from rollout_engine.errors import ReportRefused
from rollout_engine.gates import WaveGates, finished_failed
from rollout_engine.kinds import OfferContext, Outgoing, RolloutKind
from rollout_engine.lease import LeaseLost
from rollout_engine.messages import RolloutCancel, RolloutReport, cancel_key
from rollout_engine.plan import DeviceInfo, matches, plan_waves, select_targets
from rollout_engine.spec import RolloutSpec, start_control_from_json
from rollout_engine.status import describe, wave_number
from rollout_engine.store import (
    TERMINAL,
    ControlOutcome,
    DeviceRow,
    RolloutRow,
    RolloutStore,
)

log = logging.getLogger(__name__)

RETRYABLE = frozenset({"failed", "timed_out"})


WINDOW_WAIT_MAX_MS = 2 * 86_400_000  # a window a device says opens later than this is its clock's error


class RolloutPort(Protocol):
    """What the orchestrator needs from the leader."""

    def devices(self) -> Sequence[DeviceInfo]:
        """Every device the registry knows, with online state and last heartbeat."""

    async def send(self, messages: Sequence[Outgoing], *, ttl_ms: int) -> None:
        """Durably queue `messages` (each under its outbox key, which replaces an unsent one), to
        expire undelivered after `ttl_ms` (0: never; an offer lives as long as the device's timeout:
        after it the device counts as timed out, and a stale offer must not start an install days
        later; a cancel lives until it reaches a device offline for days); raise `EdgeAgentError`
        when it cannot."""

    async def ask_fast_heartbeats(self, devices: Sequence[str], *, for_s: float) -> None:
        """Ask `devices` to heartbeat at their fast pace for the next `for_s` seconds (a soak
        reads their heartbeats); raise `EdgeAgentError` when it cannot."""


def rollout_id_for(spec: RolloutSpec, now_ms: int) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", spec.rollout.name.lower()).strip("-")[:40] or "rollout"
    digest = hashlib.sha256(spec.to_json() + str(now_ms).encode()).hexdigest()[:6]
    return f"{slug}-{digest}"


class Orchestrator:
    def __init__(
        self,
        store: RolloutStore,
        *,
        clock: Clock,
        port: RolloutPort,
        poll_s: float = 2.0,
        on_change: Callable[[str], None] | None = None,
        kinds: Mapping[str, RolloutKind],
        own_mirror: str = "",
    ) -> None:
        self.store = store
        self.kinds = dict(kinds)  # spec `kind` -> what a rollout of it installs (`rollout_engine.kinds`)
        # the leader's artifact HTTP server, offered after the spec's mirrors (empty: none)
        self.own_mirror = own_mirror
        self.trust_document = b""  # handed to devices with every offer (the leader's [firmware] trust_document)
        self.clock = clock
        self.port = port
        self.poll_s = poll_s
        self._on_change = on_change
        self._kindless: set[str] = set()  # rollouts of a kind this leader lacks (said once each)
        self._paced: set[tuple[str, int]] = set()  # soaking waves whose devices were asked for fast heartbeats
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._stopped = False
        self.ticks = 0
        self.after_tick: Callable[[], None] | None = None  # after each tick that did not fail
        self.gates = WaveGates(store, clock=clock, changed=self._changed,
                               in_sync=lambda r, devices: self.kind_of(r.spec).in_sync(r.signed_manifest, devices))

    def kind_of(self, spec: RolloutSpec) -> RolloutKind:
        """The kind a rollout of `spec` installs; a `RolloutError` when this leader has none of it."""
        kind = self.kinds.get(spec.rollout.kind)
        if kind is None:
            raise RolloutError(f"rollout kind {spec.rollout.kind!r}: this leader knows "
                               f"{', '.join(sorted(self.kinds)) or 'none'}")
        return kind

    # -- starting --------------------------------------------------------------------------
    async def start_rollout(
        self,
        spec: RolloutSpec,
        *,
        rollout_id: str | None = None,
        devices: Sequence[str] | None = None,
        rollback_of: str = "",
    ) -> str:
        """Plan and start a rollout of `spec` (its artifact path must be absolute or relative to
        the working directory). `devices` overrides the target selector (a rollback)."""
        async with self._lock:
            return await self._start(spec, rollout_id=rollout_id, devices=devices, rollback_of=rollback_of)

    async def _start(
        self, spec: RolloutSpec, *, rollout_id: str | None, devices: Sequence[str] | None, rollback_of: str,
        waves: Sequence[Sequence[str]] | None = None,
    ) -> str:
        """Start a rollout of `spec`: on its `waves` as planned already (`rollout start`), else on
        `devices`, else on the registry's devices its targets select, planned here."""
        kind = self.kind_of(spec)
        kind.traits.check_spec(spec, source=f"rollout {spec.rollout.name}")
        undone = self.store.get(rollback_of) if rollback_of else None
        admitted = kind.admit(spec.rollout.artifact, undone=undone)
        version = admitted.version
        infos = {d.device_id: d for d in self.port.devices()}
        if waves is not None:
            targets = sorted({d for wave in waves for d in wave})
        elif devices is None:
            targets = select_targets(spec, list(infos.values()),
                                     target_version=version if kind.traits.skips_held else None,
                                     now_ms=self.clock.now_ms())
        else:
            targets = sorted(set(devices))
        rid = rollout_id or rollout_id_for(spec, self.clock.now_ms())
        superseded = self._claim_devices(rid, targets, spec.rollout.supersede, rollback_of=rollback_of,
                                         among=kind.traits.holds_with(kind.traits.lane_of(admitted.release)))
        if waves is None:
            waves = plan_waves(spec, targets)
        held = kind.held(admitted.release, [infos[d] for d in targets if d in infos])
        from_versions = {d: held[d] for d in targets if d in held}
        self.store.create_rollout(
            rid,
            spec=spec,
            artifact=admitted.artifact,
            version=version,
            signed_manifest=admitted.release,
            waves=waves,
            from_versions=from_versions,
            rollback_of=rollback_of,
        )
        start_ms = spec.schedule.start_ms()
        with self.store.atomic():
            for old, names in superseded.items():
                for device in names:
                    self.store.set_device(old, device, state="canceled", detail=f"superseded by {rid}",
                                          deadline_ms=None)
            if start_ms is not None and start_ms > self.clock.now_ms():
                self.store.set_rollout(rid, state="scheduled", detail=f"scheduled to start at {spec.schedule.start_at}")
            else:
                self.gates.start_wave(self._get(rid), 0)
        for old in superseded:
            self._changed(old)
        log.info("rollout %s of version %s started: %d devices in %d waves", rid, version, len(targets), len(waves))
        self._changed(rid)
        return rid

    def _claim_devices(self, rid: str, targets: Sequence[str], supersede: str, *,
                       rollback_of: str, among: Callable[[RolloutRow], bool]) -> dict[str, list[str]]:
        """One unfinished rollout of each kind and lane owns a device: the devices `targets`
        shares with another `among` takes (its kind, its lane: the same application or config
        target) are a `RolloutError` listing them, except those of `supersede` (or of the rollout
        a rollback undoes) not yet offered the image, which that rollout gives up (returned per
        rollout). Rollouts of different kinds or lanes may hold a device together."""
        held = self.store.holders(targets, among=among)
        if not held:
            return {}
        giving_up = {supersede, rollback_of} - {""}
        taken: dict[str, list[str]] = {}
        refused: list[str] = []
        for device, (owner, state) in sorted(held.items()):
            if owner in giving_up and state == "queued":
                taken.setdefault(owner, []).append(device)
            elif owner in giving_up:
                refused.append(f"{device} ({state} in {owner}: wait for it to finish, or cancel {owner})")
            else:
                refused.append(f"{device} ({state} in {owner})")
        if refused:
            shown = ", ".join(refused[:10]) + (f" and {len(refused) - 10} more" if len(refused) > 10 else "")
            hint = "" if supersede else "; to take over a rollout's queued devices, set supersede = \"ID\" in [rollout]"
            raise RolloutError(f"rollout {rid}: {len(refused)} of its devices belong to an unfinished rollout:"
                               f" {shown}{hint}")
        return taken

    # -- controls --------------------------------------------------------------------------
    async def control(self, rollout_id: str, action: str, arg: str = "") -> str:
        """Apply a control now; returns what it did. Raises `RolloutError` for a control that
        does not apply (unknown rollout, wrong state)."""
        async with self._lock:
            result = await self._apply(rollout_id, action, arg)
        self.wake()
        return result

    async def _apply(self, rollout_id: str, action: str, arg: str) -> str:
        if action == "start":
            start = start_control_from_json(arg.encode())
            rid = await self._start(start.spec, rollout_id=rollout_id or None, devices=None, rollback_of="",
                                    waves=start.waves or None)
            return f"started {rid}"
        r = self.store.find(rollout_id)
        if r is None:
            raise RolloutError(f"no rollout {rollout_id!r}")
        now = self.clock.now_ms()
        if action == "rollback":
            return await self._rollback(r, arg)
        if not r.active:
            raise RolloutError(f"rollout {r.id} is {r.state}; {action} applies only to a running or paused one")
        if r.state == "scheduled" and action != "cancel":
            raise RolloutError(f"rollout {r.id} is scheduled to start at {r.spec.schedule.start_at}: {action} applies"
                               " once it runs (cancel applies now)")
        with self.store.atomic():
            if action == "pause":
                if r.state == "paused":
                    return f"{r.id} is paused already"
                self.store.set_rollout(r.id, state="paused", detail="paused by operator")
                result = f"paused {r.id}"
            elif action == "resume":
                if r.state != "paused":
                    return f"{r.id} is running already"
                totals = self.store.totals(r.id)
                finished, failed = finished_failed(totals)
                self.store.set_rollout(
                    r.id,
                    state="running",
                    detail="resumed by operator",
                    fail_base_finished=finished,
                    fail_base_failed=failed,
                )
                result = f"resumed {r.id}"
            elif action == "cancel":
                self.gates.stop_rollout(r, "canceled", "canceled by operator")
                result = f"canceled {r.id}"
            elif action in ("next", "approve"):
                if r.state == "paused":  # a paused rollout starts no wave: it would run while it says paused
                    raise RolloutError(f"rollout {r.id} is paused: `rollout resume {r.id}` first")
                wave = self.store.wave(r.id, r.current_wave)
                assert wave is not None
                if action == "approve" and wave.state != "awaiting_approval":
                    raise RolloutError(f"rollout {r.id}: wave {wave.idx + 1} is {wave.state}, not awaiting approval")
                if action == "approve" and r.spec.rollout.download_only and not wave.install_approved:
                    self.store.set_wave(r.id, wave.idx, state="running", install_approved=1,
                                        detail="install approved by operator")
                    staged = self.store.devices(r.id, wave=wave.idx, states=("downloaded",))
                    for d in staged:  # offered again, to install: the timeout runs again
                        self.store.set_device(r.id, d.device_id, state="queued", next_try_ms=None,
                                              detail="install approved by operator")
                    self.store.set_rollout(r.id, detail=f"{self.gates.label(r, wave.idx)}: installing")
                    self._changed(r.id)
                    return f"{r.id}: wave {wave.idx + 1} installs what {len(staged)} devices downloaded"
                if r.current_wave + 1 >= r.wave_count:
                    raise RolloutError(f"rollout {r.id}: wave {r.current_wave + 1} is the last wave")
                detail = "approved by operator" if action == "approve" else "moved past by operator"
                if wave.state not in ("passed", "failed"):
                    self.store.set_wave(r.id, wave.idx, state="passed", finished_ms=now, detail=detail)
                self.gates.start_wave(self._get(r.id), r.current_wave + 1)
                result = f"{r.id}: wave {r.current_wave + 2} started ({detail})"
            else:
                raise RolloutError(f"unknown control {action!r}")
        self._changed(r.id)
        return result

    async def _rollback(self, r: RolloutRow, artifact: str) -> str:
        path = artifact or r.spec.rollout.rollback_artifact
        if not path:
            raise RolloutError(f"rollout {r.id} names no rollback_artifact; give one")
        targets = [d.device_id for d in self.store.devices(r.id, states=("succeeded",))]
        if not targets:
            raise RolloutError(f"rollout {r.id}: no device took version {r.version}; nothing to roll back")
        if r.active:
            with self.store.atomic():
                self.gates.stop_rollout(r, "canceled", "canceled for a rollback")
        base = msgspec.to_builtins(r.spec)
        base["rollout"].update(artifact=str(Path(path).resolve()), name=f"rollback of {r.id}")
        base["waves"] = {"canary": 0, "counts": [len(targets)]}
        base["gates"] = {"success_threshold_pct": 0.0, "failure_threshold_pct": 100.0}
        base["targets"] = {"select": "all"}
        from rollout_engine.spec import spec_from_dict

        spec = spec_from_dict(base, source=f"rollback of {r.id}")
        rid = f"{r.id}-rollback"
        n = 1
        while self.store.get(rid) is not None:
            n += 1
            rid = f"{r.id}-rollback{n}"
        await self._start(spec, rollout_id=rid, devices=targets, rollback_of=r.id)
        with self.store.atomic():
            self.store.set_rollout(r.id, detail=f"rolled back by {rid}")
        return f"{r.id}: rollback {rid} offers the previous version to {len(targets)} devices"

    async def apply_pending_controls(self) -> int:
        """Apply the controls the CLI wrote; each gets its result recorded. Returns how many."""
        pending = self.store.pending_controls()
        for c in pending:
            outcome: ControlOutcome = "applied"
            try:
                result = await self._apply(c.rollout_id, c.action, c.arg)
            except EdgeAgentError as exc:  # a RolloutError, a ConfigError of its spec, a store failure
                result, outcome = str(exc), "refused"
            with self.store.atomic():
                self.store.finish_control(c.id, result, outcome)
            log.info("control %s %s by %s: %s%s", c.action, c.rollout_id, c.actor or "someone unrecorded",
                     "refused: " if outcome == "refused" else "", result)
        return len(pending)

    # -- device reports --------------------------------------------------------------------
    async def on_report(self, msg_id: str, report: RolloutReport) -> bool:
        """Apply one report (at most once per `msg_id`, newest `seq` wins). True when it changed
        the device's state; `ReportRefused` about a rollout the device is not in or that offered
        it nothing."""
        async with self._lock:
            changed = self._apply_report(msg_id, report)
        if changed:
            self.wake()
        return changed

    def _apply_report(self, msg_id: str, report: RolloutReport) -> bool:
        now = self.clock.now_ms()
        with self.store.atomic():
            if not self.store.claim(msg_id):
                return False
            d = self.store.device(report.rollout_id, report.device)
            if d is None:  # (the claim is undone with the transaction)
                raise ReportRefused(f"{report.device} is not in a rollout {report.rollout_id!r}")
            if d.offers == 0:
                raise ReportRefused(f"rollout {report.rollout_id!r} has offered {report.device} nothing yet")
            if report.seq <= d.report_seq:
                return False
            r = self._get(report.rollout_id)
            state = report.state
            fields: dict[str, Any] = {"state": state, "detail": report.detail, "report_seq": report.seq}
            if report.progress is not None:  # how far its download got: the timeout counts from here
                p = report.progress
                fields.update(bytes_done=p.bytes_done, bytes_total=p.bytes_total, rate_bytes_per_s=p.rate_bytes_per_s,
                              progress_reports=d.progress_reports + 1, bytes_to_fetch=p.bytes_to_fetch,
                              bytes_fetched=p.bytes_fetched)
            elif state in ("installing", "rebooting", "verifying", "succeeded") and d.bytes_total:
                fields["bytes_done"] = d.bytes_total  # the download is complete
            if state in TERMINAL:
                fields["deadline_ms"] = None
                if state in RETRYABLE and r.active and d.attempts <= r.spec.device.retries:
                    fields.update(self._retry_fields(r, d, f"{state}: {report.detail}", now))
            elif state == "downloaded":  # waits for the operator's go-ahead: no timeout meanwhile
                fields["deadline_ms"] = None
            elif state == "waiting_window" and now < report.until_ms <= now + WINDOW_WAIT_MAX_MS:
                # the timeout runs from when the device's window opens, not from the offer
                fields["deadline_ms"] = report.until_ms + int(r.spec.device.timeout_s * 1000)
            else:
                fields["deadline_ms"] = now + int(r.spec.device.timeout_s * 1000)
            self.store.set_device(r.id, d.device_id, **fields)
            if report.excerpt and state in ("failed", "rolled_back"):
                self.store.keep_log(r.id, d.device_id, at_ms=now, state=state, lines=report.excerpt)
        self._changed(r.id)
        return True

    def _retry_fields(self, r: RolloutRow, d: DeviceRow, why: str, now: int) -> dict[str, Any]:
        backoff_ms = int(r.spec.device.retry_backoff_s * 1000 * 2 ** max(0, d.attempts - 1))
        return {
            "state": "queued",
            "detail": f"retry {d.attempts + 1} of {r.spec.device.retries + 1} after: {why}"[:500],
            "next_try_ms": now + backoff_ms,
            "deadline_ms": now + backoff_ms + int(r.spec.device.timeout_s * 1000),
        }

    # -- the loop --------------------------------------------------------------------------
    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    async def run(self) -> None:
        """Tick until `stop()`: on a wake-up, at the next stored deadline, and every `poll_s`.
        First, one line for each unfinished rollout it takes up (a restarted leader says what it
        resumes)."""
        self._stopped = False
        self.log_resumed()
        while not self._stopped:
            self._wake.clear()
            try:
                await self.tick()
                if self.after_tick is not None:
                    self.after_tick()
            except LeaseLost as exc:  # another leader runs the rollouts now
                log.warning("rollouts: %s; this leader stops orchestrating", exc)
                return
            except EdgeAgentError as exc:
                log.log(store_log_level(exc, logging.ERROR), "rollout tick failed: %s", exc)
            delay = self._until_next_deadline_s()
            if self._stopped:
                break
            if not self._wake.is_set():
                with contextlib.suppress(TimeoutError):
                    await self.clock.wait_for(self._wake.wait(), max(delay, 0.001))

    def _until_next_deadline_s(self) -> float:
        """Seconds to the next stored deadline, at most `poll_s` (also when the store cannot
        say: a database away is tried again at the next tick)."""
        try:
            deadline = self.store.next_deadline_ms()
        except EdgeAgentError:
            return self.poll_s
        if deadline is None:
            return self.poll_s
        return min(self.poll_s, max(0.0, (deadline - self.clock.now_ms()) / 1000))

    def log_resumed(self) -> None:
        try:
            active = self.store.rollouts(active_only=True)
            counts = {r.id: self.store.counts(r.id) for r in active}
        except EdgeAgentError as exc:
            log.log(store_log_level(exc, logging.ERROR), "cannot read the unfinished rollouts: %s", exc)
            return
        for r in active:
            states = Counter[str]()
            for per_wave in counts[r.id].values():
                states.update(per_wave)
            log.info("rollout %s of version %s taken up %s: wave %d of %d; devices: %s", r.id, r.version, r.state,
                     wave_number(r.current_wave), r.wave_count,
                     ", ".join(f"{state} {n}" for state, n in states.most_common()) or "none")

    async def tick(self) -> None:
        """One pass: controls, timers, gates, waves, offers."""
        self.ticks += 1
        async with self._lock:
            await self.apply_pending_controls()
            await self._send_cancels()
            now = self.clock.now_ms()
            for d in self.store.due_devices(now):
                self._expire(d, now)
            active = self.store.rollouts(active_only=True)
            if not active:
                return
            infos = {d.device_id: d for d in self.port.devices()}
            for r in active:
                if r.spec.rollout.kind not in self.kinds:
                    if r.id not in self._kindless:
                        self._kindless.add(r.id)
                        log.error("rollout %s is of kind %r, which this leader does not know: it waits for a"
                                  " leader that does", r.id, r.spec.rollout.kind)
                    continue
                if self._keep_schedule(r, now):
                    continue
                await self._advance(r.id, infos)
                await self._rollback_on_abort(r.id)

    def _keep_schedule(self, r: RolloutRow, now: int) -> bool:
        """Start a scheduled rollout when its time comes; end one at its `end_at`. True when
        the rollout does not run this tick."""
        schedule = r.spec.schedule
        if r.state == "scheduled":
            start = schedule.start_ms()
            if start is not None and now < start:
                return True
            with self.store.atomic():
                self.store.set_rollout(r.id, state="running")
                self.gates.start_wave(self._get(r.id), 0)
            log.info("rollout %s: its scheduled start (%s) came", r.id, schedule.start_at)
            return False
        end = schedule.end_ms()
        if end is not None and now >= end:
            state = "stopped" if schedule.end_behavior == "stop" else "canceled"
            with self.store.atomic():
                self.gates.stop_rollout(r, state, f"schedule.end_at {schedule.end_at} reached")
            log.info("rollout %s %s at its end_at", r.id, state)
            return True
        return False

    async def _rollback_on_abort(self, rid: str) -> None:
        """`gates.on_abort = "rollback"`: an aborted rollout offers the previous version to the
        devices it updated (once)."""
        r = self._get(rid)
        if r.state != "aborted" or r.spec.gates.on_abort != "rollback" or "rolled back by" in r.detail:
            return
        if not self.store.devices(r.id, states=("succeeded",)):
            return
        try:
            result = await self._rollback(r, "")
        except (RolloutError, EdgeAgentError) as exc:
            log.error("rollout %s: the rollback on abort did not start: %s", r.id, exc)
            with self.store.atomic():
                self.store.set_rollout(r.id, detail=f"{r.detail}; rolled back by nothing: {exc}"[:500])
            return
        log.warning("rollout %s aborted: %s", r.id, result)

    async def _send_cancels(self) -> None:
        """A canceled or aborted rollout tells each device still updating to stop (once)."""
        due = self.store.cancels_due()
        if not due:
            return
        wire = {rid: self.kind_of(self._get(rid).spec).traits.cancel_kind for rid in {rid for rid, _, _ in due}}
        await self.port.send([Outgoing(device, wire[rid], encode(RolloutCancel(rollout_id=rid, reason=why[:500])),
                                       cancel_key(device, rid)) for rid, device, why in due], ttl_ms=0)
        with self.store.atomic():
            self.store.cancel_sent([(rid, device) for rid, device, _ in due])
        log.info("cancels sent to %d devices still updating", len(due))

    def _expire(self, d: DeviceRow, now: int) -> None:
        r = self._get(d.rollout_id)
        timeout_s = r.spec.device.timeout_s
        if d.state == "queued":
            why = (
                f"not reachable within {timeout_s:g}s (offline)"
                if d.offers == 0
                else f"not reachable for its retry within {timeout_s:g}s"
            )
        else:
            why = f"no progress for {timeout_s:g}s while {d.state}"
        with self.store.atomic():
            if d.state != "queued" and r.active and d.attempts <= r.spec.device.retries:
                self.store.set_device(r.id, d.device_id, **self._retry_fields(r, d, f"timed out: {why}", now))
            else:
                self.store.set_device(
                    r.id, d.device_id, state="timed_out", detail=why, deadline_ms=None, next_try_ms=None
                )
        self._changed(r.id)

    async def _advance(self, rid: str, infos: dict[str, DeviceInfo]) -> None:
        r = self._get(rid)
        if r.state != "running":
            return
        if r.spec.targets.include_new and not r.rollback_of:
            self._include_new(r, infos)
        if self.gates.failure_gate(r):
            return
        await self._offer(r, infos)
        for _ in range(r.wave_count + 1):  # one wave may pass and the next start in one tick
            r = self._get(rid)
            if r.state != "running" or not self.gates.wave_gates(r, infos):
                break
        await self._pace_soak(rid)

    async def _pace_soak(self, rid: str) -> None:
        """A wave that began its soak asks its updated devices for fast heartbeats until the soak
        ends (and a minute more): the gate hears from each while it lasts. Once per wave and run of
        the leader; a device that misses it still heartbeats at its idle pace."""
        now = self.clock.now_ms()
        for wave in self.store.waves(rid):
            if wave.state != "soaking" or (rid, wave.idx) in self._paced or wave.soak_until_ms is None:
                continue
            self._paced.add((rid, wave.idx))
            devices = [d.device_id for d in self.store.devices(rid, wave=wave.idx, states=("succeeded",))]
            if not devices:
                continue
            try:
                await self.port.ask_fast_heartbeats(devices, for_s=max(1.0, (wave.soak_until_ms - now) / 1000 + 60))
            except EdgeAgentError as exc:
                log.warning("rollout %s: could not ask wave %d for fast heartbeats: %s", rid, wave.idx, exc)

    def _include_new(self, r: RolloutRow, infos: dict[str, DeviceInfo]) -> None:
        last = r.wave_count - 1
        wave = self.store.wave(r.id, last)
        if wave is None or wave.state not in ("pending", "running"):
            return
        known = {d.device_id for d in self.store.devices(r.id)}
        kind = self.kind_of(r.spec)
        now = self.clock.now_ms()
        skips = kind.traits.skips_held
        # a new device, or one whose tags, version or facts changed since the plan
        joining = [info for info in infos.values() if info.device_id not in known
                   and not (skips and info.firmware_version == r.version) and matches(r.spec, info, now_ms=now)]
        busy = self.store.holders([info.device_id for info in joining],
                                  among=kind.traits.holds_with(kind.traits.lane_of(r.signed_manifest)))
        joining = [info for info in joining if info.device_id not in busy]  # (another rollout of its kind has it)
        if not joining:
            return
        held_by = kind.held(r.signed_manifest, joining)
        for info in joining:
            held = held_by.get(info.device_id, "")
            if skips and held == r.version:
                continue
            with self.store.atomic():
                added = self.store.add_device(r.id, info.device_id, last, from_version=held)
                if added and wave.state == "running":
                    self.store.set_device(r.id, info.device_id, deadline_ms=now + int(r.spec.device.timeout_s * 1000))
            if added:
                log.info("rollout %s: device %s now matches its targets: joins wave %d", r.id, info.device_id, last)

    async def _offer(self, r: RolloutRow, infos: dict[str, DeviceInfo]) -> None:
        now = self.clock.now_ms()
        open_waves = {
            w.idx
            for w in self.store.waves(r.id)
            if w.idx <= r.current_wave and w.state in ("running", "soaking", "awaiting_approval", "passed")
        }
        ready = [
            d
            for d in self.store.devices(r.id, states=("queued",), max_wave=r.current_wave)
            if d.wave in open_waves
            and (d.next_try_ms is None or d.next_try_ms <= now)
            and d.device_id in infos
            and infos[d.device_id].online
        ]
        spec = r.spec
        per_minute = spec.schedule.devices_per_minute
        if per_minute and ready:  # the rollout rate: at most this many offers in any minute
            recent = sum(1 for _, at, _ in self.store.offers(r.id) if at > now - 60_000)
            ready = ready[: max(0, per_minute - recent)]
        if not ready:
            return
        # Stored first, then sent: an orchestrator that lost its lease (fenced) sends nothing, and
        # every offer a device gets is one the rollout tables hold (`resend_offers` after a takeover).
        deadline = self.clock.now_ms() + int(spec.device.timeout_s * 1000)
        with self.store.atomic():
            for d in ready:
                attempt = d.attempts + 1
                self.store.set_device(
                    r.id,
                    d.device_id,
                    state="notified",
                    attempts=attempt,
                    offers=d.offers + 1,
                    last_offer_ms=self.clock.now_ms(),
                    deadline_ms=deadline,
                    next_try_ms=None,
                    detail=f"offered (attempt {attempt})",
                )
                self.store.record_offer(r.id, d.device_id, attempt)
        try:
            await self.port.send(self._offers_of(r, ready), ttl_ms=self._offer_ttl_ms(r))
        except EdgeAgentError:
            with self.store.atomic():  # not sent: as they were, offered again on a later tick
                for d in ready:
                    self.store.set_device(r.id, d.device_id, state="queued", attempts=d.attempts, offers=d.offers,
                                          last_offer_ms=d.last_offer_ms, deadline_ms=d.deadline_ms,
                                          next_try_ms=d.next_try_ms, detail=d.detail)
                self.store.unrecord_offers(r.id, [(d.device_id, d.attempts + 1) for d in ready])
            raise
        self._changed(r.id)

    async def resend_offers(self) -> int:
        """Send again the offer of every device that was offered an update and has not answered
        (`notified`) in an unfinished rollout, as it was (no new attempt), and (on the next tick)
        the cancels to the devices still updating in a canceled or aborted one: after a takeover,
        what the previous orchestrator sent may be stranded in its leader's outbox. A device
        takes a repeated offer of the update it runs as a resume, a repeated cancel as nothing
        new. How many offers were sent."""
        sent = 0
        async with self._lock:
            with self.store.atomic():
                self.store.cancels_unsent()
            for r in self.store.rollouts(active_only=True):
                notified = self.store.devices(r.id, states=("notified",))
                if not notified:
                    continue
                await self.port.send(self._offers_of(r, notified), ttl_ms=self._offer_ttl_ms(r))
                sent += len(notified)
        return sent

    def _offers_of(self, r: RolloutRow, devices: Sequence[DeviceRow]) -> list[Outgoing]:
        """What rollout `r` offers each of `devices`, made by its kind."""
        spec = r.spec
        context = OfferContext(
            mirrors=tuple(dict.fromkeys([*spec.download.mirrors, *([self.own_mirror] if self.own_mirror else [])])),
            trust=self.trust_document,
            approved_waves=frozenset(w.idx for w in self.store.waves(r.id) if w.install_approved))
        return self.kind_of(spec).offers(r, devices, context)

    @staticmethod
    def _offer_ttl_ms(r: RolloutRow) -> int:
        """An offer undelivered after the device's timeout is stale: the device timed out already."""
        return max(1, int(r.spec.device.timeout_s * 1000))

    # -- helpers ---------------------------------------------------------------------------
    def _get(self, rid: str) -> RolloutRow:
        r = self.store.get(rid)
        if r is None:
            raise RolloutError(f"no rollout {rid!r}")
        return r

    def _changed(self, rid: str) -> None:
        if self._on_change is not None:
            self._on_change(rid)


__all__ = ["Orchestrator", "RolloutPort", "describe", "rollout_id_for"]
