"""Wave gates: when a wave passes, soaks, waits for approval or fails, and how a rollout ends.

Called by the orchestrator inside its transactions (`store.atomic()`); every method reads the
current rows and writes the transition, nothing is kept in memory.

    success gate   a wave whose devices all finished passes when `success_threshold_pct` of it
                   succeeded; then it soaks `soak_s` (devices must keep heartbeating), then waits
                   for approval if `manual_approval`, then the next wave starts
    failure gate   over the whole rollout, once `min_finished` devices finished: more than
                   `failure_threshold_pct` of them failed, were rejected, timed out or rolled
                   back -> abort (or pause) the rollout
    compliance     (a config rollout with `min_compliance_pct`) a wave that passed its success
                   gate waits until that share of it is in sync by the devices' own heartbeats
                   (not only their reports), up to `compliance_wait_s`, else it fails
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from agent.core.clock import Clock
from rollout_engine.plan import DeviceInfo
from rollout_engine.status import wave_label, wave_number
from rollout_engine.store import FAILURES, TERMINAL, DeviceRow, RolloutRow, RolloutStore

log = logging.getLogger("rollout_engine.orchestrator")


def finished_failed(totals: dict[str, int]) -> tuple[int, int]:
    finished = sum(n for s, n in totals.items() if s in TERMINAL and s != "canceled")
    failed = sum(n for s, n in totals.items() if s in FAILURES)
    return finished, failed


#: Of a config rollout's devices, those in sync by their heartbeats (the orchestrator's port).
InSync = Callable[[RolloutRow, list[str]], set[str]]


class WaveGates:
    def __init__(self, store: RolloutStore, *, clock: Clock, changed: Callable[[str], None],
                 in_sync: InSync = lambda r, devices: set(devices)) -> None:
        self.store = store
        self.clock = clock
        self._changed = changed
        self._in_sync = in_sync

    @staticmethod
    def label(r: RolloutRow, idx: int) -> str:
        """How texts name wave `idx` of `r`: numbered from 1, the canary marked."""
        return wave_label(idx, canary=idx == 0 and r.spec.waves.canary > 0)

    def failure_gate(self, r: RolloutRow) -> bool:
        gates = r.spec.gates
        totals = self.store.totals(r.id)
        finished, failed = finished_failed(totals)
        finished -= r.fail_base_finished
        failed -= r.fail_base_failed
        if finished < gates.min_finished:
            return False
        why = ""
        if failed * 100.0 > gates.failure_threshold_pct * finished:
            why = (
                f"failure threshold: {failed} of {finished} finished devices failed "
                f"({failed * 100.0 / finished:.1f}% > {gates.failure_threshold_pct:g}%)"
            )
        else:
            for kind in ("failed", "timed_out", "rejected", "rolled_back"):  # per kind (`gates.abort`)
                limit = getattr(gates.abort, f"{kind}_pct")
                n = totals.get(kind, 0)
                if limit is not None and n * 100.0 > limit * finished:
                    why = (f"abort criterion: {n} of {finished} finished devices {kind}"
                           f" ({n * 100.0 / finished:.1f}% > {limit:g}%)")
                    break
        if not why:
            return False
        with self.store.atomic():
            if gates.failure_action == "pause":
                self.store.set_rollout(r.id, state="paused", detail=why + "; paused")
            else:
                self.stop_rollout(r, "aborted", why)
        log.warning("rollout %s: %s", r.id, why)
        self._changed(r.id)
        return True

    def wave_gates(self, r: RolloutRow, infos: dict[str, DeviceInfo]) -> bool:
        """Move the current wave on if its gates allow; True when something changed."""
        now = self.clock.now_ms()
        wave = self.store.wave(r.id, r.current_wave)
        assert wave is not None
        gates = r.spec.gates
        members = self.store.devices(r.id, wave=wave.idx)
        succeeded = [d for d in members if d.state == "succeeded"]
        size = len(members)
        pct = len(succeeded) * 100.0 / size if size else 100.0
        with self.store.atomic():
            if wave.state == "running" and r.spec.rollout.download_only and not wave.install_approved:
                downloaded = [d for d in members if d.state == "downloaded"]
                if not downloaded or any(d.state not in TERMINAL and d.state != "downloaded" for d in members):
                    return False
                why = (f"{len(downloaded)} of {size} downloaded; `rollout approve {r.id}` installs them")
                self.store.set_wave(r.id, wave.idx, state="awaiting_approval", detail=why)
                self.store.set_rollout(r.id, detail=f"{self.label(r, wave.idx)}: {why}")
                self._changed(r.id)
                return True
            if wave.state == "running":
                if any(d.state not in TERMINAL for d in members):
                    return False
                if size and pct < gates.success_threshold_pct:
                    self.fail_wave(
                        r,
                        wave.idx,
                        f"{len(succeeded)} of {size} succeeded ({pct:.1f}% < {gates.success_threshold_pct:g}%)",
                    )
                    return True
                if size and gates.min_compliance_pct:  # (a spec check: only of a kind that tells compliance)
                    held = self._compliance_gate(r, wave.idx, wave.detail, members, succeeded, now)
                    if held is not None:
                        return held
                if gates.soak_s > 0:
                    self.store.set_wave(
                        r.id,
                        wave.idx,
                        state="soaking",
                        soak_started_ms=now,
                        soak_until_ms=now + int(gates.soak_s * 1000),
                        detail=f"{len(succeeded)} of {size} succeeded; soaking {gates.soak_s:g}s",
                    )
                    self._changed(r.id)
                    return True
                self.pass_wave(r, wave.idx, f"{len(succeeded)} of {size} succeeded")
                return True
            if wave.state == "soaking":
                if wave.soak_until_ms is None or now < wave.soak_until_ms:
                    return False
                since = wave.soak_started_ms or 0
                silent = [
                    d
                    for d in succeeded
                    if not (
                        d.device_id in infos
                        and infos[d.device_id].online
                        and (infos[d.device_id].last_seen_ms or 0) >= since
                    )
                ]
                for d in silent:
                    self.store.set_device(
                        r.id,
                        d.device_id,
                        state="failed",
                        detail=f"stopped heartbeating during the {gates.soak_s:g}s soak",
                    )
                ok = len(succeeded) - len(silent)
                pct = ok * 100.0 / size if size else 100.0
                if size and pct < gates.success_threshold_pct:
                    self.fail_wave(
                        r,
                        wave.idx,
                        f"soak: {ok} of {size} kept heartbeating ({pct:.1f}% < {gates.success_threshold_pct:g}%)",
                    )
                    return True
                self.pass_wave(r, wave.idx, f"{ok} of {size} succeeded and kept heartbeating")
                return True
        return False

    def _compliance_gate(self, r: RolloutRow, idx: int, said: str, members: list[DeviceRow],
                         succeeded: list[DeviceRow], now: int) -> bool | None:
        """None when the wave is in sync enough to pass on; else whether something changed
        (it waits for heartbeats, saying so, or fails once `compliance_wait_s` is over)."""
        gates = r.spec.gates
        size = len(members)
        ok = len(self._in_sync(r, [d.device_id for d in succeeded]))
        share = ok * 100.0 / size
        if share >= gates.min_compliance_pct:
            return None
        why = f"{ok} of {size} in sync by their heartbeats ({share:.1f}% < {gates.min_compliance_pct:g}%)"
        if now < max(d.updated_ms for d in members) + gates.compliance_wait_s * 1000:
            detail = f"{why}: waiting up to {gates.compliance_wait_s:g}s for their heartbeats"
            if detail == said:
                return False
            self.store.set_wave(r.id, idx, detail=detail)
            self._changed(r.id)
            return True
        self.fail_wave(r, idx, f"compliance: {why}")
        return True

    def pass_wave(self, r: RolloutRow, idx: int, detail: str) -> None:
        now = self.clock.now_ms()
        last = idx + 1 >= r.wave_count
        if not last and r.spec.gates.manual_approval:
            self.store.set_wave(
                r.id, idx, state="awaiting_approval", finished_ms=now, detail=detail + "; waiting for approval"
            )
            self.store.set_rollout(
                r.id, detail=f"{self.label(r, idx)} passed; waiting for `rollout approve {r.id}`"
            )
        else:
            self.store.set_wave(r.id, idx, state="passed", finished_ms=now, detail=detail)
            if last:
                state, why = self.end_state(r)
                self.store.set_rollout(r.id, state=state, finished_ms=now, detail=why)
                log.info("rollout %s %s: %s", r.id, state, why)
            else:
                self.start_wave(r, idx + 1)
        self._changed(r.id)

    def end_state(self, r: RolloutRow) -> tuple[str, str]:
        """How a rollout whose last wave passed ends, as its devices tell: `failed` when it is a
        rollback no device took (nothing went back), else `succeeded`, naming the devices that
        did not make it (the gates let them through)."""
        totals = self.store.totals(r.id)
        succeeded = totals.get("succeeded", 0)
        others = {s: n for s, n in sorted(totals.items()) if s != "succeeded" and n}
        if r.rollback_of and not succeeded:
            return "failed", (f"no device went back to version {r.version}: "
                              + ", ".join(f"{n} {s}" for s, n in others.items()))
        why = f"all {r.wave_count} waves passed"
        if others:
            why += f"; {succeeded} succeeded, " + ", ".join(f"{n} {s}" for s, n in others.items())
        return "succeeded", why

    def fail_wave(self, r: RolloutRow, idx: int, why: str) -> None:
        name = self.label(r, idx)
        self.store.set_wave(r.id, idx, state="failed", finished_ms=self.clock.now_ms(), detail=why)
        self.stop_rollout(r, "aborted", f"{name} failed its success gate: {why}")
        log.warning("rollout %s aborted: %s failed: %s", r.id, name, why)

    def start_wave(self, r: RolloutRow, idx: int) -> None:
        now = self.clock.now_ms()
        self.store.set_wave(r.id, idx, state="running", started_ms=now, detail="")
        self.store.set_rollout(
            r.id, current_wave=idx, detail=f"wave {wave_number(idx)} of {r.wave_count} running"
        )
        deadline = now + int(r.spec.device.timeout_s * 1000)
        for d in self.store.devices(r.id, wave=idx, states=("queued",)):
            self.store.set_device(r.id, d.device_id, deadline_ms=deadline)
        self._changed(r.id)

    def stop_rollout(self, r: RolloutRow, state: str, why: str) -> None:
        """End `r` (inside the caller's transaction): devices not offered yet are canceled and
        never offered; devices mid-update finish and report."""
        now = self.clock.now_ms()
        self.store.set_rollout(r.id, state=state, finished_ms=now, detail=why)
        for w in self.store.waves(r.id):
            if w.state == "pending":
                self.store.set_wave(r.id, w.idx, state="canceled", detail=why)
            elif w.state in ("running", "soaking", "awaiting_approval"):
                self.store.set_wave(r.id, w.idx, state="canceled" if state == "canceled" else "failed",
                                    finished_ms=now, detail=why)
        for d in self.store.devices(r.id, states=("queued",)):
            self.store.set_device(
                r.id,
                d.device_id,
                state="canceled",
                detail=f"rollout {state}: {why}"[:500],
                deadline_ms=None,
                next_try_ms=None,
            )
        self._changed(r.id)


__all__ = ["WaveGates", "finished_failed"]
