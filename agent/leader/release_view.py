"""Which release each device runs, and its drift: read from what the leader already keeps.

A device runs the newest release a rollout succeeded on it with; it has drifted from it when
what its heartbeats state no longer matches every part (a firmware, a configuration target's
version or a document changed on the device, an application's version). No field of its own:
the release is the one all of whose parts the device states.

Read from a `LeaderDb` (read-only), each part through the store that owns it: the rollout
tables' release rollouts and the devices they succeeded on, the registry's stated parts.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from agent.core.errors import CodecError
from agent.leader.readonly import LeaderDb
from agent.protocol import AppState, ConfigState
from release_rollout.document import peek_release
from release_rollout.errors import ReleaseError
from release_rollout.kind import admitted

DRIFTED_SHOWN = 20  # devices a fleet summary names per release


class DeviceRelease(msgspec.Struct, kw_only=True, frozen=True):
    """The release a device runs (the newest that succeeded on it), and how it has drifted."""

    name: str
    version: str
    rollout_id: str
    drift: list[str] = []  # each part it no longer runs as the release says ("" none: it runs it whole)


class ReleaseCount(msgspec.Struct, kw_only=True, frozen=True):
    """One release over the fleet: the devices it converged on, how many run it whole now, and
    (the first `DRIFTED_SHOWN`) the drifted ones with what drifted."""

    name: str
    version: str
    rollout_id: str
    converged: int
    whole: int
    drifted: dict[str, list[str]] = {}


Parts = list[tuple[str, str, str, str]]  # (part id, kind, name, version)


def _releases(db: LeaderDb) -> list[tuple[str, str, str, Parts]]:
    """Every release rollout, newest first: (rollout id, release name, version, its parts)."""
    found = []
    for rid, _state, version, release in db.rollouts.of_kind("release"):
        try:
            document, _stored = admitted(release)
        except (ReleaseError, CodecError):
            continue
        parts: Parts = [(p.id, str(p.kind), p.name, p.version) for p in document.parts]
        found.append((rid, document.name, version, parts))
    return found


def _held(kind: str, name: str, firmware: str, configs: Mapping[str, ConfigState] | None,
          apps: Mapping[str, AppState] | None) -> str:
    """The version of a part a device states it runs ("" none)."""
    if kind == "firmware":
        return firmware
    if kind == "config":
        state = (configs or {}).get(name)
        return state.version if state is not None else ""
    app = (apps or {}).get(name)
    return app.version if app is not None else ""


def drift_of(parts: Parts, firmware: str, configs: Mapping[str, ConfigState] | None,
             apps: Mapping[str, AppState] | None) -> list[str]:
    """What of `parts` a device no longer runs, as its heartbeats state it, in a few words each."""
    drift = []
    for pid, kind, name, version in parts:
        held = _held(kind, name, firmware, configs, apps)
        state = (configs or {}).get(name) if kind == "config" else None
        if state is not None and held == version and state.drifted:
            drift.append(f"{pid} {version}: {', '.join(state.drifted)} changed on the device")
        elif held != version:
            drift.append(f"{pid} runs {held or 'nothing'}, the release says {version}")
    return drift


def changes_of(parts: Parts, firmware: str, configs: Mapping[str, ConfigState] | None,
               apps: Mapping[str, AppState] | None) -> list[str]:
    """What a release would change on a device, part by part ("firmware 1.0.0 → 1.1.0"), as its
    heartbeats state what it runs; a part it runs already is not named."""
    return [f"{pid} {held or 'none'} → {version}" for pid, kind, name, version in parts
            if (held := _held(kind, name, firmware, configs, apps)) != version]


def plan_changes(db: LeaderDb, release: bytes, firmware: Mapping[str, str],
                 apps: Mapping[str, Mapping[str, AppState]]) -> dict[str, str]:
    """device -> what the release would change on it (`rollout start --dry-run` of a release);
    `firmware` and `apps`: what each device runs, as the plan read them from the registry."""
    try:
        document = peek_release(release)
    except (ReleaseError, CodecError):
        return {}
    parts: Parts = [(p.id, str(p.kind), p.name, p.version) for p in document.parts]
    configs = {device: states for device, (_tags, states) in db.registry.config_states().items()}
    changes = {}
    for device, version in firmware.items():
        said = changes_of(parts, version, configs.get(device), apps.get(device))
        changes[device] = ", ".join(said) if said else "runs every part already (succeeds at once)"
    return changes


def device_release(db: LeaderDb, device_id: str, firmware: str, configs: Mapping[str, ConfigState] | None,
                   apps: Mapping[str, AppState] | None) -> DeviceRelease | None:
    """The release the device runs and its drift; None when no release rollout succeeded on it."""
    succeeded = {rid for rid, *_rest, state, _detail, _at, _from in db.rollouts.of_device(device_id)
                 if state == "succeeded"}
    for rid, name, version, parts in _releases(db):
        if rid in succeeded:
            return DeviceRelease(name=name, version=version, rollout_id=rid,
                                 drift=drift_of(parts, firmware, configs, apps))
    return None


def fleet_releases(db: LeaderDb) -> list[ReleaseCount]:
    """Each release line's newest release that converged somewhere: on how many devices, and
    how many of them run it whole now (a device that a newer release converged on since counts
    for that one only)."""
    newest: dict[str, str] = {}  # device -> the newest release rollout that succeeded on it
    counts: list[ReleaseCount] = []
    releases = _releases(db)
    if not releases:  # (no release rollout: the fleet's states are not read)
        return counts
    configs = {device: states for device, (_tags, states) in db.registry.config_states().items()}
    apps = db.registry.app_states()
    seen_lines: set[str] = set()
    for rid, name, version, parts in releases:
        devices = [d for d in db.rollouts.succeeded_in(rid) if d not in newest]
        for d in devices:
            newest[d] = rid
        if name in seen_lines or not devices:
            continue
        seen_lines.add(name)
        _, lines = db.registry.page(among=devices, limit=0)
        drifted: dict[str, list[str]] = {}
        for line in lines:
            drift = drift_of(parts, line.firmware_version, configs.get(line.device_id), apps.get(line.device_id))
            if drift:
                drifted[line.device_id] = drift
        counts.append(ReleaseCount(name=name, version=version, rollout_id=rid, converged=len(devices),
                                   whole=len(devices) - len(drifted),
                                   drifted=dict(list(sorted(drifted.items()))[:DRIFTED_SHOWN])))
    return counts


__all__ = ["DeviceRelease", "ReleaseCount", "changes_of", "device_release", "drift_of", "fleet_releases",
           "plan_changes"]
