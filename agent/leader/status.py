"""`edge-agent status`: a fleet summary read from the leader's database.

The database is opened read-only, so the command is safe while the leader runs (WAL readers do
not block the writer). `summarize()` builds a `FleetStatus`, `format_status()` renders it for
people. A file that is
missing, not SQLite, or not a leader database is a `StoreError` (the CLI's one line on stderr,
exit 2).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import msgspec

from agent.core.clock import Clock, SystemClock
from agent.leader.readonly import open_leader_db

DEFAULT_STALE_AFTER_S = 30.0


class StaleDevice(msgspec.Struct, kw_only=True, frozen=True):
    device_id: str
    last_seen_ms: int | None
    age_s: float | None
    online: bool


class JobCounts(msgspec.Struct, kw_only=True, frozen=True):
    pending: int = 0
    confirmed: int = 0
    failed: int = 0  # confirmed with ok=False
    epoch: int = 0


class FleetStatus(msgspec.Struct, kw_only=True, frozen=True):
    """The fleet as one leader's database records it (`status --json`, the console)."""

    generated_ms: int
    total: int
    online: int
    offline: int
    versions: dict[str, int] = msgspec.field(default_factory=dict)
    stale_after_s: float = 0.0
    stale_count: int = 0
    stale: list[StaleDevice] = msgspec.field(default_factory=list)
    jobs: JobCounts | None = None




def summarize(
    db_path: str | Path,
    *,
    clock: Clock | None = None,
    stale_after_s: float | None = None,
    stale_limit: int = 50,
) -> FleetStatus:
    """Summarise the fleet in the leader database at `db_path`. Raises `StoreError`.

    A device is stale when it has not been heard from (heartbeat or presence `online`) for
    `stale_after_s`; by default the registry's heartbeat deadline.
    """
    now = (clock or SystemClock()).now_ms()
    with open_leader_db(db_path) as db:
        return _summarize(db.conn, set(db.tables), now, stale_after_s, stale_limit)


def _summarize(conn: sqlite3.Connection, tables: set[str], now: int, stale_after_s: float | None,
               stale_limit: int) -> FleetStatus:
    if stale_after_s is None:
        row = conn.execute(
            "SELECT value FROM registry_meta WHERE key = 'heartbeat_deadline_ms'"
        ).fetchone()
        stale_after_s = row[0] / 1000.0 if row else DEFAULT_STALE_AFTER_S
    stale_ms = int(stale_after_s * 1000)
    total, online = conn.execute(
        "SELECT COUNT(*), COALESCE(SUM(online), 0) FROM devices"
    ).fetchone()
    versions = {
        (str(v) or "unknown"): int(n)
        for v, n in conn.execute(
            "SELECT firmware_version, COUNT(*) FROM devices GROUP BY firmware_version"
            " ORDER BY COUNT(*) DESC, firmware_version"
        )
    }
    stale_where = "last_seen_ms IS NULL OR last_seen_ms <= ?"
    (stale_count,) = conn.execute(
        f"SELECT COUNT(*) FROM devices WHERE {stale_where}", (now - stale_ms,)
    ).fetchone()
    stale = [
        StaleDevice(
            device_id=str(device_id),
            last_seen_ms=last_seen,
            age_s=None if last_seen is None else round((now - last_seen) / 1000.0, 3),
            online=bool(is_online),
        )
        for device_id, last_seen, is_online in conn.execute(
            f"SELECT device_id, last_seen_ms, online FROM devices WHERE {stale_where}"
            " ORDER BY last_seen_ms IS NOT NULL, last_seen_ms, device_id LIMIT ?",
            (now - stale_ms, stale_limit),
        )
    ]
    jobs = None
    if "jobs" in tables and "jobqueue_meta" in tables:
        counts = dict(conn.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())
        (failed,) = conn.execute(
            "SELECT COUNT(*) FROM jobs WHERE state = 'confirmed' AND ok = 0"
        ).fetchone()
        row = conn.execute("SELECT value FROM jobqueue_meta WHERE key = 'epoch'").fetchone()
        jobs = JobCounts(
            pending=int(counts.get("pending", 0)),
            confirmed=int(counts.get("confirmed", 0)),
            failed=int(failed),
            epoch=int(row[0]) if row else 0,
        )
    return FleetStatus(
        generated_ms=now,
        total=int(total),
        online=int(online),
        offline=int(total) - int(online),
        versions=versions,
        stale_after_s=stale_after_s,
        stale_count=int(stale_count),
        stale=stale,
        jobs=jobs,
    )


def _age(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000.0))


def format_status(summary: FleetStatus) -> str:
    """Render a summary as a few lines of text for a terminal."""
    lines = [
        f"fleet: {summary.total} devices, {summary.online} online, {summary.offline} offline"
        f" (as of {_when(summary.generated_ms)})"
    ]
    if summary.versions:
        lines.append("versions: " + ", ".join(f"{v} x{n}" for v, n in summary.versions.items()))
    lines.append(f"stale (not heard from for {_age(summary.stale_after_s)}): {summary.stale_count}")
    width = max((len(d.device_id) for d in summary.stale), default=0)
    for dev in summary.stale:
        seen = "never" if dev.last_seen_ms is None else (
            f"{_when(dev.last_seen_ms)} ({_age(dev.age_s or 0.0)} ago)")
        state = "online" if dev.online else "offline"
        lines.append(f"  {dev.device_id:<{width}}  last seen {seen}  {state}")
    if summary.stale and summary.stale_count > len(summary.stale):
        lines.append(f"  ... and {summary.stale_count - len(summary.stale)} more")
    if summary.jobs is not None:
        j = summary.jobs
        lines.append(
            f"jobs: {j.pending} pending, {j.confirmed} confirmed ({j.failed} failed),"
            f" queue epoch {j.epoch}"
        )
    return "\n".join(lines)


__all__ = ["DEFAULT_STALE_AFTER_S", "FleetStatus", "JobCounts", "StaleDevice", "format_status", "summarize"]
