"""The plan of a rollout before it starts, as `rollout start` (and its `--dry-run`) and the
console's preview make it: the waves against the devices the leader's registry holds now, and
every device left out with the reason. Planned once: the leader starts the rollout on these
very waves."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agent.core.clock import SystemClock
from agent.core.errors import RolloutError
from agent.core.sql import ServerUrl
from agent.leader.readonly import LeaderDb, open_leader_db
from agent.leader.rollout_kinds import traits_of
from agent.protocol import AppState
from rollout_engine.kinds import Described
from rollout_engine.plan import DeviceInfo, exclusion, plan_waves
from rollout_engine.spec import RolloutSpec


@dataclass(frozen=True)
class Plan:
    """The waves `rollout start` gives the leader, and every known or listed device left out."""

    waves: list[list[str]]
    left_out: list[tuple[str, str]]  # (device, why), sorted by device
    warnings: list[str] = field(default_factory=list)  # what the start goes on despite (a downgrade for some)
    changes: dict[str, str] = field(default_factory=dict)  # device -> what a release changes on it, part by part

    def summary(self) -> str:
        sizes = ", ".join(str(len(w)) for w in self.waves)
        count = sum(len(w) for w in self.waves)
        text = f"plan: {count} device{'s' if count != 1 else ''} in {len(self.waves)} waves ({sizes})"
        if self.left_out:
            reasons = Counter(why for _, why in self.left_out)
            text += f"; left out {len(self.left_out)}: " + ", ".join(f"{n} {why}" for why, n in reasons.most_common())
        return text


SHOWN = 50  # devices listed per wave and left out by --dry-run before "and N more"


def render_plan(rid: str, spec: RolloutSpec, manifest: Described, plan: Plan,
                held: dict[str, tuple[str, str]]) -> str:
    """What `rollout start --dry-run` prints: each wave's devices, who is left out and why, and
    who belongs to an unfinished rollout of its kind and lane (the start would be refused for them)."""
    def listed(ids: list[str]) -> str:
        more = f" and {len(ids) - SHOWN} more" if len(ids) > SHOWN else ""
        return ", ".join(ids[:SHOWN]) + more

    lines = [f"rollout {rid} (dry run, nothing started): {manifest.name} {manifest.version} from "
             f"{spec.rollout.artifact}"]
    for n, wave in enumerate(plan.waves, 1):
        label = " (canary)" if n == 1 and spec.waves.canary else ""
        lines.append(f"wave {n}{label}: {len(wave)} device{'s' if len(wave) != 1 else ''}: {listed(wave)}")
        if plan.changes:
            lines += [f"  {device}  {plan.changes.get(device, '?')}" for device in wave[:SHOWN]]
    if plan.left_out:
        lines.append(f"left out: {len(plan.left_out)}")
        lines += [f"  {device}  {why}" for device, why in plan.left_out[:SHOWN]]
        if len(plan.left_out) > SHOWN:
            lines.append(f"  and {len(plan.left_out) - SHOWN} more")
    if held:
        lines.append(f"in an unfinished rollout (the start would be refused for them unless [rollout] supersede "
                     f"names it): {len(held)}")
        lines += [f"  {device}  {state} in {owner}" for device, (owner, state) in sorted(held.items())[:SHOWN]]
    lines.append(plan.summary())
    return "\n".join(lines)


def plan_rollout(spec: RolloutSpec, manifest: Described, db: Path | ServerUrl) -> Plan:
    """The waves, planned once, here, against the devices the leader's registry holds now: a
    spec that cannot be planned (no device matches, a wave rounding to 0 devices, an image older
    than every target that is not signed as a rollback) is refused before the leader hears of
    it, and the leader starts the rollout on these very waves."""
    traits = traits_of(spec.rollout.kind, source=f"rollout {spec.rollout.name}")
    version = manifest.version if traits.skips_held else None
    now_ms = SystemClock().now_ms()
    with open_leader_db(db) as leader:
        _, lines = leader.registry.page(limit=0)
        apps = leader.registry.app_states()
        devices = [DeviceInfo(line.device_id, line.firmware_version, tuple(line.tags), line.online, line.last_seen_ms,
                              facts=tuple(sorted(line.facts.items())),
                              apps=tuple(sorted((n, a.version) for n, a in apps.get(line.device_id, {}).items())))
                   for line in lines]
        changes = _release_changes(leader, spec, {line.device_id: line.firmware_version for line in lines}, apps)
    left_out = [(d.device_id, why) for d in devices
                if (why := exclusion(spec, d, target_version=version, now_ms=now_ms))]
    known = {d.device_id for d in devices}
    if spec.targets.select == "devices":
        left_out += [(d, "unknown to the leader") for d in spec.targets.devices if d not in known]
    left_out.sort()
    out = {d for d, _ in left_out}
    targets = sorted(known - out)
    seen = ", ".join(f"{v or 'unknown'} x{n}" for v, n in Counter(d.firmware_version for d in devices).most_common())
    known_text = f"the leader knows {len(devices)} devices ({seen})" if devices else "the leader knows no device yet"
    if not targets:
        reasons = Counter(why for _, why in left_out)
        why = "; ".join(f"{n} {w}" for w, n in reasons.most_common(5))
        raise RolloutError(f"no device matches the rollout's targets: {known_text}" + (f"; left out: {why}" if why
                                                                                        else ""))
    by_id = {d.device_id: d for d in devices}
    check = traits.check_targets
    warnings = check(manifest, spec.rollout.artifact, [by_id[t] for t in targets]) if check is not None else []
    try:
        return Plan(plan_waves(spec, targets), left_out, warnings, changes)
    except RolloutError as exc:
        # a device seen only by its presence has no version until its first heartbeat
        raise RolloutError(f"{exc} [{len(targets)} of the {len(devices)} devices the leader knows are targeted; "
                           f"versions: {seen}]") from None


def _release_changes(leader: LeaderDb, spec: RolloutSpec, firmware: dict[str, str],
                     apps: Mapping[str, Mapping[str, AppState]]) -> dict[str, str]:
    """A release's change on each device, part by part (other kinds: none)."""
    if spec.rollout.kind != "release":
        return {}
    from agent.leader.release_view import plan_changes
    from release_rollout.kind import read_document

    return plan_changes(leader, read_document(Path(spec.rollout.artifact)), firmware, apps)


__all__ = ["SHOWN", "Plan", "plan_rollout", "render_plan"]
