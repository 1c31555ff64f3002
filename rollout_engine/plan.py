"""Which devices a rollout targets and which wave each one is in.

The plan is a pure function of the spec, the device list and the seed: devices are sorted by
id, shuffled with `random.Random(seed)`, then cut into waves (canary first). The same inputs
give the same plan on every machine, so a restarted leader, the CLI and the simulator agree.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from agent.core.errors import RolloutError
from rollout_engine.spec import RolloutSpec, WavesSection


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """A device as the leader's registry knows it (times are the leader clock's ms)."""

    device_id: str
    firmware_version: str = ""
    tags: tuple[str, ...] = ()
    online: bool = False
    last_seen_ms: int | None = None
    first_seen_ms: int = 0
    facts: tuple[tuple[str, str], ...] = ()  # what it says it is (arch, board, os), sorted by name
    apps: tuple[tuple[str, str], ...] = ()  # each application's committed version, as it says, sorted by name


def exclusion(spec: RolloutSpec, device: DeviceInfo, *, target_version: str | None,
              now_ms: int | None = None) -> str:
    """Why the rollout leaves `device` out, in a few words ("" when it takes it). `now_ms`: the
    leader clock's now, for `seen_within_s`; None skips that check, as `target_version` None
    skips the version's."""
    t = spec.targets
    if t.select == "tags" and not set(t.tags) & set(device.tags):
        return f"no tag of {', '.join(t.tags)}"
    if t.select == "versions" and device.firmware_version not in t.versions:
        return f"runs {device.firmware_version or 'an unknown version'}, not {', '.join(t.versions)}"
    if t.select == "devices" and device.device_id not in t.devices:
        return "not in the list"
    if t.match:
        facts = dict(device.facts)
        for name, pattern in sorted(t.match.items()):
            if not fnmatchcase(facts.get(name, ""), pattern):
                return f"its {name} is {facts[name]!r}, not {pattern!r}" if name in facts else f"no {name} reported"
    if t.online is not None and device.online != t.online:
        return "offline" if t.online else "online"
    if t.seen_within_s is not None and now_ms is not None and (
            device.last_seen_ms is None or now_ms - device.last_seen_ms > t.seen_within_s * 1000):
        return f"not heard from within {t.seen_within_s:g} s"
    if target_version is not None and device.firmware_version == target_version:
        return f"already on {target_version}"
    return ""


def matches(spec: RolloutSpec, device: DeviceInfo, *, now_ms: int | None = None) -> bool:
    """Whether the spec's targets take `device` (its version aside)."""
    return not exclusion(spec, device, target_version=None, now_ms=now_ms)


def select_targets(spec: RolloutSpec, devices: Sequence[DeviceInfo], *, target_version: str | None,
                   now_ms: int | None = None) -> list[str]:
    """Ids of the devices the rollout updates: taken by the targets and not already running
    `target_version` (None: whatever they run), sorted."""
    return sorted(d.device_id for d in devices
                  if not exclusion(spec, d, target_version=target_version, now_ms=now_ms))


def wave_sizes(waves: WavesSection, total: int) -> list[int]:
    """Sizes of the waves for `total` devices (canary first). Raises `RolloutError` when a wave
    would hold no device."""
    if total <= 0:
        raise RolloutError("no device matches the rollout's targets")
    sizes: list[int] = []
    left = total
    if waves.canary:
        if waves.canary >= total:
            raise RolloutError(f"the canary wave ({waves.canary}) would take all {total} targeted devices")
        sizes.append(waves.canary)
        left -= waves.canary
    body: list[int] = []
    if waves.counts is not None:
        for count in waves.counts:
            if left <= 0:
                break
            body.append(min(count, left))
            left -= body[-1]
        if left > 0:
            body.append(left)  # the devices no count covers form a last wave
    elif waves.percents is not None:
        n = left
        for i, pct in enumerate(waves.percents):
            size = left if i == len(waves.percents) - 1 else round(n * pct / 100.0)
            if size <= 0:
                raise RolloutError(
                    f"wave {len(sizes) + i + 1} ({pct:g}% of {n} devices) would hold no device;"
                    " use fewer or larger waves"
                )
            size = min(size, left)
            body.append(size)
            left -= size
            if left <= 0 and i < len(waves.percents) - 1:
                raise RolloutError(f"waves after wave {len(sizes) + i + 1} would hold no device")
    else:
        assert waves.ramp is not None
        ramp = float(waves.ramp.base)
        while left > 0:
            take = min(max(1, int(ramp)), left)
            body.append(take)
            left -= take
            ramp *= waves.ramp.factor
    return sizes + body


def plan_waves(spec: RolloutSpec, device_ids: Sequence[str], *, seed: int | None = None) -> list[list[str]]:
    """Assign `device_ids` to waves: deterministic for (spec, ids, seed)."""
    ids = sorted(set(device_ids))
    random.Random(spec.rollout.seed if seed is None else seed).shuffle(ids)
    out: list[list[str]] = []
    start = 0
    for size in wave_sizes(spec.waves, len(ids)):
        out.append(sorted(ids[start : start + size]))
        start += size
    return out


__all__ = ["DeviceInfo", "matches", "plan_waves", "select_targets", "wave_sizes"]
