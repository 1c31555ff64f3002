"""The fleet device by device, as the leader's database records it: the device table of
`edge-agent status` (filtered and paged by the registry, so a fleet of 100,000 lists in well
under a second) and one device in full (its last heartbeat and system sample, its recent
rejects, its rollouts).

Read from a `LeaderDb` (read-only), each part through the store that owns it: the registry's
devices, the reject log's refusals, the rollout tables' states, joined here by device id.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from agent.leader.readonly import LeaderDb
from agent.leader.registry import DeviceLine, DeviceState
from agent.leader.release_view import DeviceRelease, device_release
from config_rollout.attempt_acks import AttemptAck, acknowledged

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class DeviceFilter(msgspec.Struct, kw_only=True, frozen=True):
    """Which devices to list: every given condition must hold. `limit` 0 lists all."""

    online: bool | None = None
    version: str | None = None
    tag: str | None = None
    rollout: str | None = None
    limit: NonNegative = 50
    offset: NonNegative = 0


class DeviceRow(DeviceLine, kw_only=True, frozen=True):
    """A device as the registry lists it, with the newest rollout that includes it."""

    rollout_id: str | None = None  # the newest rollout that includes the device
    rollout_state: str | None = None  # the device's state in it


class DevicePage(msgspec.Struct, kw_only=True, frozen=True):
    matching: int  # devices that pass the filter, of which `devices` is one page
    offset: int
    devices: list[DeviceRow]


class DeviceReject(msgspec.Struct, kw_only=True, frozen=True):
    at_ms: int
    kind: str | None
    msg_id: str | None
    size: int
    reason: str


class DeviceRollout(msgspec.Struct, kw_only=True, frozen=True):
    rollout_id: str
    name: str
    version: str
    rollout_state: str
    wave: int
    state: str  # the device's
    detail: str
    updated_ms: int
    from_version: str = ""  # what the device ran when the rollout took it ("": not known)
    # the log lines its newest failure report in the rollout carried (redacted on the device)
    log: tuple[str, ...] = ()
    log_ms: int = 0


class DeviceEvent(msgspec.Struct, kw_only=True, frozen=True):
    """A change of the device's state in a rollout."""

    at_ms: int
    rollout_id: str
    state: str
    detail: str


class ControlRecord(msgspec.Struct, kw_only=True, frozen=True):
    """A control of a rollout: who asked what, when, and what came of it."""

    asked_ms: int
    rollout_id: str
    action: str
    actor: str
    applied_ms: int | None
    outcome: str  # "applied", "refused", "": not applied yet
    result: str


class DeviceDetail(DeviceState, kw_only=True, frozen=True):
    """One device in full: the registry's state of it, its row, its recent refusals, its
    rollouts, its timeline of states in them and the controls of those rollouts."""

    device: DeviceRow
    rejects: list[DeviceReject]
    rollouts: list[DeviceRollout]
    timeline: list[DeviceEvent] = []
    controls: list[ControlRecord] = []
    # each configuration target: in_sync, pending, drifted, failed or not_applied
    compliance: dict[str, str] = {}
    # target -> the operator's acknowledgement of its last attempt that did not commit (only of
    # that attempt: the device's next one is said again)
    acknowledged: dict[str, AttemptAck] = {}
    release: DeviceRelease | None = None  # the release it runs (the newest that converged on it), its drift


def list_devices(db: LeaderDb, flt: DeviceFilter) -> DevicePage:
    """One page of the devices that pass `flt`, by device id."""
    among = db.rollouts.devices_in(flt.rollout) if flt.rollout is not None else None
    matching, lines = db.registry.page(online=flt.online, version=flt.version, tag=flt.tag, among=among,
                                       limit=flt.limit, offset=flt.offset)
    return DevicePage(matching=matching, offset=flt.offset, devices=_rows(db, lines))


def _rows(db: LeaderDb, lines: list[DeviceLine]) -> list[DeviceRow]:
    """The registry's lines, each with the newest rollout that includes the device."""
    newest = db.rollouts.newest_of([line.device_id for line in lines])
    rows = []
    for line in lines:
        rollout_id, rollout_state = newest.get(line.device_id, (None, None))
        rows.append(DeviceRow(**msgspec.structs.asdict(line), rollout_id=rollout_id, rollout_state=rollout_state))
    return rows


def device_detail(db: LeaderDb, device_id: str, *, rejects: int = 10, events: int = 100) -> DeviceDetail | None:
    """Everything the leader keeps about one device; None if it has never been heard of."""
    found = db.registry.device(device_id)
    if found is None:
        return None
    line, state = found
    recent = [DeviceReject(at_ms=r.at_ms, kind=r.kind, msg_id=r.msg_id, size=r.size, reason=r.reason)
              for r in db.rejects.newest(device=device_id, limit=rejects)]
    logs = db.rollouts.logs_of(device_id)
    rollouts = [DeviceRollout(rollout_id=a, name=b, version=c, rollout_state=d, wave=e, state=f, detail=g, updated_ms=h,
                              from_version=i, log=logs[a].lines if a in logs else (),
                              log_ms=logs[a].at_ms if a in logs else 0)
                for a, b, c, d, e, f, g, h, i in db.rollouts.of_device(device_id)]
    timeline = [DeviceEvent(at_ms=a, rollout_id=b, state=c, detail=d)
                for a, b, c, d in db.rollouts.timeline_of(device_id, limit=events)]
    controls = [ControlRecord(asked_ms=a, rollout_id=b, action=c, actor=d, applied_ms=e, outcome=f, result=g)
                for a, b, c, d, e, f, g in db.rollouts.controls_of([r.rollout_id for r in rollouts])]
    compliance = {}
    seen: dict[str, AttemptAck] = {}
    if state.configs:
        import time

        from agent.leader.config_pending import config_pending

        pending = config_pending(db, {device_id: (line.tags, state.configs)}, int(time.time() * 1000))
        compliance = {target: c.compliance_with((device_id, target) in pending) for target, c in state.configs.items()}
        acks = db.attempt_acks.newest([device_id])
        said = {target: acknowledged(c, acks.get((device_id, target))) for target, c in state.configs.items()}
        seen = {target: ack for target, ack in said.items() if ack is not None}
    release = device_release(db, device_id, line.firmware_version, state.configs, state.apps)
    return DeviceDetail(**msgspec.structs.asdict(state), device=_rows(db, [line])[0], rejects=recent,
                        rollouts=rollouts, timeline=timeline, controls=controls, compliance=compliance,
                        acknowledged=seen,
                        release=release)


__all__ = ["ControlRecord", "DeviceDetail", "DeviceEvent", "DeviceFilter", "DevicePage", "DeviceReject",
           "DeviceRollout", "DeviceRow", "device_detail", "list_devices"]
