"""`edge-agent status`: a fleet summary read from the leader's database.

The database is opened read-only, so the command is safe while the leader runs (WAL readers do
not block the writer). `summarize()` builds a `FleetStatus`, `format_status()` renders it for
people. A file that is
missing, not SQLite, or not a leader database is a `StoreError` (the CLI's one line on stderr,
exit 2).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from agent.core.clock import Clock, SystemClock
from agent.core.durations import format_age, utc_iso
from agent.leader.config_pending import fleet_compliance
from agent.leader.jobs import JobCounts
from agent.leader.readonly import LeaderDb, open_leader_db
from agent.leader.registry import LAST_ATTEMPT_FAILED, LEADER_QUIET_S, AppCounts, ReleaseHealth
from agent.leader.release_view import ReleaseCount, fleet_releases
from rollout_engine.lease import LEASE_NAME

DEFAULT_STALE_AFTER_S = 30.0


class StaleDevice(msgspec.Struct, kw_only=True, frozen=True):
    device_id: str
    last_seen_ms: int | None
    age_s: float | None
    online: bool


class LeaderView(msgspec.Struct, kw_only=True, frozen=True):
    """One leader of the fleet, as the database records it: the devices it served last, its
    newest mark of life, whether it runs (marked within `QUIET_BEATS` of its own pace), and the
    fleet's singletons whose lease it holds now ("rollouts", "job queue")."""

    name: str
    serves: int = 0
    alive_ms: int | None = None
    running: bool = True
    silent_s: float = 0.0  # since its newest mark
    runs: list[str] = msgspec.field(default_factory=list)


class FleetStatus(msgspec.Struct, kw_only=True, frozen=True):
    """The fleet as one leader's database records it (`status --json`, the console)."""

    generated_ms: int
    total: int
    online: int
    offline: int
    versions: dict[str, int] = msgspec.field(default_factory=dict)
    stale_after_s: float = 0.0  # asked for, or the least deadline (a device's own may be longer)
    stale_by_deadline: bool = False  # stale: past each device's own deadline (its announced interval)
    stale_count: int = 0
    stale: list[StaleDevice] = msgspec.field(default_factory=list)
    jobs: JobCounts | None = None
    leader_alive_ms: int | None = None  # the running leader's newest alive mark (None: none)
    leader_stale: bool = False  # no mark for LEADER_QUIET_S: the leader is not running, the view is old
    # configuration target -> in_sync / pending / drifted / damaged / not_applied -> devices, and
    # last_attempt_failed beside them (their heartbeats; `compliance_counts`)
    config: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    # leader -> devices it served last (its newest heartbeat or birth); several when they share
    # a PostgreSQL registry
    leaders: dict[str, int] = msgspec.field(default_factory=dict)
    # leader -> when it last marked itself alive (each marks itself every 30 s while it runs)
    leaders_alive_ms: dict[str, int] = msgspec.field(default_factory=dict)
    # several leaders on PostgreSQL: the leader that took the orchestrator lease last, since when,
    # and until when it holds it (past: none holds it now, a leader stopped or died)
    rollouts_run_by: str = ""
    rollouts_since_ms: int | None = None
    rollouts_until_ms: int | None = None
    # device certificates on record for a name no device may hold: a leader of the registry, or a
    # broker client id (`doctor --config` checks the operators and claims of a leader's config too)
    reserved_certs: list[str] = msgspec.field(default_factory=list)
    # every leader of the registry (several on PostgreSQL), by name
    leader_views: list[LeaderView] = msgspec.field(default_factory=list)
    # application -> the devices on each version, on trial, that took their last new one back
    apps: dict[str, AppCounts] = msgspec.field(default_factory=dict)
    # each release line's newest release that converged: on how many devices, how many run it whole
    releases: list[ReleaseCount] = msgspec.field(default_factory=list)
    # each firmware release's healthy hours, as the devices that run it count them
    health: list[ReleaseHealth] = msgspec.field(default_factory=list)




def summarize(
    db_path: str | Path,
    *,
    clock: Clock | None = None,
    stale_after_s: float | None = None,
    stale_limit: int = 50,
) -> FleetStatus:
    """Summarise the fleet in the leader database at `db_path`. Raises `StoreError`.

    A device is stale when it has not been heard from (heartbeat or presence `online`) for
    `stale_after_s`; by default when it is past its own deadline (`INTERVALS_TO_DEADLINE` of the
    heartbeat interval it announced, at least the registry's heartbeat deadline).
    """
    now = (clock or SystemClock()).now_ms()
    with open_leader_db(db_path) as db:
        return fleet_status(db, now, stale_after_s=stale_after_s, stale_limit=stale_limit)


def fleet_status(db: LeaderDb, now: int, *, stale_after_s: float | None = None, stale_limit: int = 50) -> FleetStatus:
    """The summary, from the registry's and the job queue's reads."""
    registry = db.registry
    own = stale_after_s is None  # each device's own deadline (its announced interval), at least the leader's
    if stale_after_s is None:
        stale_after_s = registry.heartbeat_deadline_s() or DEFAULT_STALE_AFTER_S
    total, online = registry.online_count()
    stale_count, stale_rows = registry.stale(None if own else now - int(stale_after_s * 1000), limit=stale_limit,
                                             now_ms=now)
    stale = [StaleDevice(device_id=device_id, last_seen_ms=last_seen,
                         age_s=None if last_seen is None else round((now - last_seen) / 1000.0, 3), online=is_online)
             for device_id, last_seen, is_online in stale_rows]
    alive = registry.leader_alive_ms()
    lease = db.rollouts.lease(LEASE_NAME)
    jobs = db.jobs.counts()
    return FleetStatus(generated_ms=now, total=total, online=online, offline=total - online,
                       versions=registry.versions(), stale_after_s=stale_after_s, stale_by_deadline=own,
                       stale_count=stale_count, stale=stale,
                       jobs=jobs, leader_alive_ms=alive,
                       leader_stale=alive is not None and now - alive > LEADER_QUIET_S * 1000,
                       config=fleet_compliance(db, now), apps=registry.app_counts(), releases=fleet_releases(db),
                       health=registry.release_health(now),
                       leaders=registry.leaders(),
                       leaders_alive_ms=registry.leaders_alive_ms(),
                       reserved_certs=_reserved_certs(db), rollouts_run_by=lease.holder if lease else "",
                       rollouts_since_ms=lease.acquired_ms if lease else None,
                       rollouts_until_ms=lease.expires_ms if lease else None,
                       leader_views=_leader_views(db, now, rollouts=(lease.holder, lease.expires_ms) if lease else None,
                                                  jobs=(jobs.run_by, jobs.run_until_ms or 0) if jobs else None))


def _leader_views(db: LeaderDb, now: int, *, rollouts: tuple[str, int] | None,
                  jobs: tuple[str, int] | None) -> list[LeaderView]:
    """Every leader that marked itself alive in the registry or served a device, with the
    singletons (the orchestrator, the job queue) whose lease it holds at `now`."""
    serves = db.registry.leaders()
    alive = db.registry.leaders_alive_ms()
    running_now = db.registry.leaders_running(now)
    views = []
    for name in sorted({*serves, *alive}):
        at = alive.get(name)
        silent = (now - at) / 1000.0 if at is not None else 0.0
        running = running_now.get(name, False)
        runs = [what for what, lease in (("rollouts", rollouts), ("job queue", jobs))
                if lease is not None and lease[0] == name and lease[1] > now]
        views.append(LeaderView(name=name, serves=serves.get(name, 0), alive_ms=at, running=running,
                                silent_s=round(max(0.0, silent), 3), runs=runs))
    return views


def _reserved_certs(db: LeaderDb) -> list[str]:
    from agent.leader.identities import reserved_reason

    leaders = db.registry.leader_names()
    return [name for name in db.identities.approved_names()
            if reserved_reason(name, leaders=leaders, operators=(), claims=(), reserved=())]


def _leader(view: LeaderView) -> str:
    """One leader of several: how many devices it served last, what it runs, and whether it still
    marks itself alive (silent for `QUIET_BEATS` of its pace: it stopped or died; its devices
    move to the others at their next heartbeat)."""
    text = f"{view.name} serves {view.serves}"
    if view.runs:
        text += f", runs the {' and the '.join(view.runs)}"
    if not view.running and view.alive_ms is not None:
        text += f" (silent for {format_age(view.silent_s)}: not running)"
    return text


def format_status(summary: FleetStatus) -> str:
    """Render a summary as a few lines of text for a terminal."""
    lines = [
        f"fleet: {summary.total} devices, {summary.online} online, {summary.offline} offline"
        f" (as of {utc_iso(summary.generated_ms)})"
    ]
    if summary.leader_stale and summary.leader_alive_ms is not None:
        age = format_age((summary.generated_ms - summary.leader_alive_ms) / 1000.0)
        lines.insert(0, f"STALE: the leader last marked itself alive at {utc_iso(summary.leader_alive_ms)} ({age} ago):"
                        " is it running? Online and offline below are as it last knew them")
    if summary.reserved_certs:
        lines.insert(0, "RESERVED: a device certificate is on record for a name no device may hold: "
                        + ", ".join(summary.reserved_certs) + " (edge-agent devices revoke them at once)")
    if len(summary.leader_views) > 1:
        lines.append("leaders: " + "; ".join(_leader(view) for view in summary.leader_views))
    if summary.rollouts_run_by and summary.rollouts_until_ms is not None:
        if summary.rollouts_until_ms > summary.generated_ms:
            lines.append(f"rollouts: run by leader {summary.rollouts_run_by} since"
                         f" {utc_iso(summary.rollouts_since_ms or 0)}")
        else:
            lines.append(f"rollouts: no leader runs them now: the orchestrator lease of leader"
                         f" {summary.rollouts_run_by} ran out at {utc_iso(summary.rollouts_until_ms)}")
    if summary.versions:
        lines.append("versions: " + ", ".join(f"{v} x{n}" for v, n in summary.versions.items()))
    if summary.health:
        lines.append("healthy hours: " + ", ".join(
            f"{h.firmware} {h.healthy_ratio * 100:.1f}% of {h.hours:.0f} h ({h.unexpected_restarts} unexpected"
            f" restarts, {h.devices} devices)" for h in summary.health))
    if summary.stale_by_deadline:
        lines.append(f"stale (past their heartbeat deadline: 2.5 of their intervals, at least"
                     f" {format_age(summary.stale_after_s)}): {summary.stale_count}")
    else:
        lines.append(f"stale (not heard from for {format_age(summary.stale_after_s)}): {summary.stale_count}")
    width = max((len(d.device_id) for d in summary.stale), default=0)
    for dev in summary.stale:
        seen = "never" if dev.last_seen_ms is None else (
            f"{utc_iso(dev.last_seen_ms)} ({format_age(dev.age_s or 0.0)} ago)")
        state = "online" if dev.online else "offline"
        lines.append(f"  {dev.device_id:<{width}}  last seen {seen}  {state}")
    if summary.stale and summary.stale_count > len(summary.stale):
        lines.append(f"  ... and {summary.stale_count - len(summary.stale)} more")
    for target, counts in summary.config.items():
        failed = counts.get(LAST_ATTEMPT_FAILED, 0)
        lines.append(f"config {target}: " + ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in counts.items()
                                                      if kind != LAST_ATTEMPT_FAILED and (n or kind == "in_sync"))
                     + (f"; the last attempt did not commit on {failed} (they hold what they held)" if failed else ""))
    for name, app in summary.apps.items():
        more = [f"{app.on_trial} on trial"] if app.on_trial else []
        more += [f"{app.took_back} took their last new version back"] if app.took_back else []
        lines.append(f"app {name}: " + ", ".join(f"{v} x{n}" for v, n in app.versions.items())
                     + (f" ({'; '.join(more)})" if more else ""))
    for r in summary.releases:
        drifted = r.converged - r.whole
        lines.append(f"release {r.name} {r.version} (rollout {r.rollout_id}): {r.whole} of the {r.converged} devices it"
                     f" converged on run it whole" + (f"; {drifted} drifted: " + "; ".join(
                         f"{d} ({', '.join(what)})" for d, what in r.drifted.items()) if drifted else ""))
    if summary.jobs is not None:
        j = summary.jobs
        lines.append(
            f"jobs: {j.pending} pending, {j.confirmed} confirmed ({j.failed} failed),"
            f" queue epoch {j.epoch}" + (f", run by leader {j.run_by}" if j.run_by else "")
        )
    return "\n".join(lines)


__all__ = ["DEFAULT_STALE_AFTER_S", "FleetStatus", "JobCounts", "StaleDevice", "format_status", "summarize"]
