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


def drift_of(parts: Parts, firmware: str, configs: Mapping[str, ConfigState] | None,
             apps: Mapping[str, AppState] | None) -> list[str]:
    """What of `parts` a device no longer runs, as its heartbeats state it, in a few words each."""
    drift = []
    for pid, kind, name, version in parts:
        if kind == "firmware":
            held = firmware
        elif kind == "config":
            state = (configs or {}).get(name)
            held = state.version if state is not None else ""
            if state is not None and held == version and state.drifted:
                drift.append(f"{pid} {version}: {', '.join(state.drifted)} changed on the device")
                continue
        else:
            app = (apps or {}).get(name)
            held = app.version if app is not None else ""
        if held != version:
            drift.append(f"{pid} runs {held or 'nothing'}, the release says {version}")
    return drift


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
    counts = []
    configs = {device: states for device, (_tags, states) in db.registry.config_states().items()}
    apps = db.registry.app_states()
    seen_lines: set[str] = set()
    for rid, name, version, parts in _releases(db):
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


__all__ = ["DeviceRelease", "ReleaseCount", "device_release", "drift_of", "fleet_releases"]
