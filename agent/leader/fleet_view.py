"""The fleet device by device, as the leader's database records it: the device table of
`edge-agent status` (filtered and paged in SQL, so a fleet of 100,000 lists in well under a
second) and one device in full (its last heartbeat and system sample, its recent rejects, its
rollouts).

Read from a `LeaderDb` (read-only). The rollout columns come from the rollout tables when the
leader has run a rollout; a database without them has no rollouts to show.
"""

from __future__ import annotations

import sqlite3
from typing import Annotated

import msgspec

from agent.core.codec import decode
from agent.core.errors import CodecError
from agent.leader.readonly import LeaderDb
from agent.protocol import SystemSample

_tags = msgspec.json.Decoder(list[str])
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class DeviceFilter(msgspec.Struct, kw_only=True, frozen=True):
    """Which devices to list: every given condition must hold. `limit` 0 lists all."""

    online: bool | None = None
    version: str | None = None
    tag: str | None = None
    rollout: str | None = None
    limit: NonNegative = 50
    offset: NonNegative = 0


class DeviceRow(msgspec.Struct, kw_only=True, frozen=True):
    device_id: str
    online: bool
    offline_reason: str | None
    last_seen_ms: int | None
    firmware_version: str
    tags: list[str]
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


class DeviceDetail(msgspec.Struct, kw_only=True, frozen=True):
    device: DeviceRow
    heartbeat_seq: int | None
    heartbeat_at_ms: int | None
    uptime_s: float | None
    boot: str
    first_seen_ms: int
    changed_ms: int
    telemetry_count: int
    telemetry_names: int
    outbox_pending: int | None  # as its newest heartbeat reported; None: not reported
    sample: SystemSample | None
    rejects: list[DeviceReject]
    rollouts: list[DeviceRollout]


def ago(now_ms: int, at_ms: int | None) -> str:
    """How long ago `at_ms` was, for a person: `12s ago`, `5m ago`, `3h ago`, `2d ago`, `never`."""
    if at_ms is None:
        return "never"
    seconds = max(0, (now_ms - at_ms) // 1000)
    if seconds < 120:
        return f"{seconds}s ago"
    if seconds < 7200:
        return f"{seconds // 60}m ago"
    if seconds < 172800:
        return f"{seconds // 3600}h ago"
    return f"{seconds // 86400}d ago"


def _where(flt: DeviceFilter, db: LeaderDb) -> tuple[str, list[object]]:
    clauses: list[str] = []
    params: list[object] = []
    if flt.online is not None:
        clauses.append("online = ?")
        params.append(1 if flt.online else 0)
    if flt.version is not None:
        clauses.append("firmware_version = ?")
        params.append(flt.version)
    if flt.tag is not None:
        clauses.append("EXISTS (SELECT 1 FROM json_each(devices.tags) WHERE json_each.value = ?)")
        params.append(flt.tag)
    if flt.rollout is not None:
        if "rollout_devices" not in db.tables:
            clauses.append("0")
        else:
            clauses.append("device_id IN (SELECT device_id FROM rollout_devices WHERE rollout_id = ?)")
            params.append(flt.rollout)
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


def _row(values: tuple[object, ...]) -> DeviceRow:
    device_id, online, reason, last_seen, version, tags = values
    try:
        tag_list = _tags.decode(tags if isinstance(tags, bytes | str) else "[]")
    except msgspec.DecodeError:
        tag_list = []
    return DeviceRow(device_id=str(device_id), online=bool(online),
                     offline_reason=None if reason is None else str(reason),
                     last_seen_ms=None if last_seen is None else int(str(last_seen)),
                     firmware_version=str(version), tags=tag_list)


def _with_rollouts(db: LeaderDb, rows: list[DeviceRow]) -> list[DeviceRow]:
    if not rows or not {"rollout_devices", "rollouts"} <= db.tables:
        return rows
    newest: dict[str, tuple[str, str]] = {}
    ids = [r.device_id for r in rows]
    for start in range(0, len(ids), 500):  # SQLite's bound-parameter limit
        chunk = ids[start:start + 500]
        marks = ",".join("?" * len(chunk))
        for device_id, rollout_id, state in db.conn.execute(
            f"SELECT rd.device_id, rd.rollout_id, rd.state FROM rollout_devices rd JOIN rollouts r"
            f" ON r.id = rd.rollout_id WHERE rd.device_id IN ({marks}) ORDER BY r.seq DESC", chunk,
        ):
            newest.setdefault(str(device_id), (str(rollout_id), str(state)))
    return [msgspec.structs.replace(r, rollout_id=newest[r.device_id][0], rollout_state=newest[r.device_id][1])
            if r.device_id in newest else r for r in rows]


_ROW_COLUMNS = "device_id, online, offline_reason, last_seen_ms, firmware_version, tags"


def list_devices(db: LeaderDb, flt: DeviceFilter) -> DevicePage:
    """One page of the devices that pass `flt`, by device id."""
    where, params = _where(flt, db)
    (matching,) = db.conn.execute(f"SELECT COUNT(*) FROM devices{where}", params).fetchone()
    page = f" LIMIT {int(flt.limit)} OFFSET {int(flt.offset)}" if flt.limit else f" LIMIT -1 OFFSET {int(flt.offset)}"
    rows = [_row(v) for v in db.conn.execute(f"SELECT {_ROW_COLUMNS} FROM devices{where} ORDER BY device_id{page}",
                                              params)]
    return DevicePage(matching=int(matching), offset=flt.offset, devices=_with_rollouts(db, rows))


def _sample(blob: object) -> SystemSample | None:
    if not isinstance(blob, bytes):
        return None
    try:
        return decode(blob, SystemSample)
    except CodecError:
        return None


def device_detail(db: LeaderDb, device_id: str, *, rejects: int = 10) -> DeviceDetail | None:
    """Everything the leader keeps about one device; None if it has never been heard of."""
    conn = db.conn
    found = conn.execute(f"SELECT {_ROW_COLUMNS}, hb_seq, hb_at_ms, uptime_s, boot, first_seen_ms, changed_ms,"
                         " telemetry_count, sample, outbox_pending FROM devices WHERE device_id = ?",
                         (device_id,)).fetchone()
    if found is None:
        return None
    row = _with_rollouts(db, [_row(found[:6])])[0]
    hb_seq, hb_at, uptime, boot, first_seen, changed, telemetry, sample, pending = found[6:]
    (names,) = conn.execute("SELECT COUNT(*) FROM telemetry_last WHERE device_id = ?", (device_id,)).fetchone()
    recent: list[DeviceReject] = []
    if "rejects" in db.tables:
        recent = [DeviceReject(at_ms=int(at), kind=kind, msg_id=msg_id, size=int(size), reason=str(reason))
                  for at, kind, msg_id, size, reason in conn.execute(
                      "SELECT at_ms, kind, msg_id, size, reason FROM rejects WHERE sender = ? ORDER BY id DESC LIMIT ?",
                      (device_id, rejects))]
    return DeviceDetail(
        device=row, heartbeat_seq=None if hb_seq < 0 else int(hb_seq), heartbeat_at_ms=hb_at, uptime_s=uptime,
        boot=str(boot), first_seen_ms=int(first_seen), changed_ms=int(changed), telemetry_count=int(telemetry),
        telemetry_names=int(names), outbox_pending=None if pending is None else int(pending), sample=_sample(sample),
        rejects=recent, rollouts=_rollouts_of(db, device_id),
    )


def _rollouts_of(db: LeaderDb, device_id: str) -> list[DeviceRollout]:
    if not {"rollout_devices", "rollouts"} <= db.tables:
        return []
    try:
        rows = db.conn.execute(
            "SELECT r.id, r.name, r.version, r.state, rd.wave, rd.state, rd.detail, rd.updated_ms"
            " FROM rollout_devices rd JOIN rollouts r ON r.id = rd.rollout_id WHERE rd.device_id = ?"
            " ORDER BY r.seq DESC", (device_id,)).fetchall()
    except sqlite3.OperationalError:  # a rollout schema this version does not know
        return []
    return [DeviceRollout(rollout_id=str(a), name=str(b), version=str(c), rollout_state=str(d), wave=int(e),
                          state=str(f), detail=str(g), updated_ms=int(h)) for a, b, c, d, e, f, g, h in rows]


__all__ = ["ago", "DeviceDetail", "DeviceFilter", "DevicePage", "DeviceReject", "DeviceRollout", "DeviceRow",
           "device_detail", "list_devices"]
