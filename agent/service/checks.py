"""Health checks for `/healthz`: each is `async () -> (ok, detail)`.

The run wiring builds a mapping such as

    {"transport": gate_check(transport.connected),
     "database": sqlite_writable_check(db_path, clock=clock),
     "relay": task_check(relay_task),
     "disk": disk_space_check(data_dir, min_free_bytes=64 * 2**20)}
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path

from agent.core.clock import Clock
from agent.core.gate import Gate
from agent.core.reserve import DiskReserve

CheckResult = tuple[bool, str]
Check = Callable[[], Awaitable[CheckResult]]


def gate_check(gate: Gate, *, up: str = "connected", down: str = "disconnected") -> Check:
    async def check() -> CheckResult:
        return (True, up) if gate.is_open else (False, down)

    return check


def predicate_check(alive: Callable[[], bool], *, up: str = "alive", down: str = "dead") -> Check:
    async def check() -> CheckResult:
        return (True, up) if alive() else (False, down)

    return check


def problem_check(problem: Callable[[], str | None], *, up: str = "alive") -> Check:
    """Healthy while `problem()` is None; otherwise failing with what it says."""

    async def check() -> CheckResult:
        found = problem()
        return (True, up) if found is None else (False, found)

    return check


def task_check(task: Callable[[], asyncio.Task[object] | None] | asyncio.Task[object]) -> Check:
    """Healthy while the task (or the task a callable returns now) is still running."""

    async def check() -> CheckResult:
        current = task() if callable(task) and not isinstance(task, asyncio.Task) else task
        if current is None:
            return False, "not started"
        if not current.done():
            return True, "running"
        if current.cancelled():
            return False, "cancelled"
        exc = current.exception()
        return False, f"stopped: {type(exc).__name__}: {exc}" if exc else "finished"

    return check


def lease_check(task: Callable[[], asyncio.Task[object] | None], *, held_by: Callable[[], str | None]) -> Check:
    """A singleton of several leaders (the rollout orchestrator, the job queue): healthy while
    the loop that holds or waits for its lease runs (`task`), saying whether this leader runs it
    or stands by; `held_by()` names the holder when it is another leader ("" when none holds it,
    None when this one does)."""
    running = task_check(task)

    async def check() -> CheckResult:
        ok, detail = await running()
        if not ok:
            return ok, detail
        holder = held_by()
        if holder is None:
            return True, "running: this leader holds the lease"
        return True, f"standing by: {f'leader {holder} holds the lease' if holder else 'no leader holds the lease'}"

    return check


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"  # pragma: no cover - loop always returns


def disk_space_check(path: str | Path, *, min_free_bytes: int = 64 * 1024 * 1024) -> Check:
    """Free space (for this unprivileged user) on the filesystem holding `path`."""
    target = Path(path)

    async def check() -> CheckResult:
        try:
            usage = shutil.disk_usage(target)
        except OSError as exc:
            return False, f"cannot stat {target}: {exc.strerror}"
        detail = f"{_human(usage.free)} free of {_human(usage.total)} (minimum {_human(min_free_bytes)})"
        return usage.free >= min_free_bytes, detail

    return check


def reserve_disk_check(reserve: DiskReserve, *, min_free_bytes: int = 64 * 1024 * 1024) -> Check:
    """`disk_space_check` that also says "disk full" while the agent's reserve is given back."""

    async def check() -> CheckResult:
        return reserve.disk_state(min_free_bytes=min_free_bytes)

    return check


def _try_write_lock(path: str, timeout_s: float) -> CheckResult:
    try:
        conn = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=timeout_s,
                               isolation_level=None)
    except sqlite3.Error as exc:
        return False, f"cannot open: {exc}"
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
    except sqlite3.Error as exc:
        return False, f"not writable: {exc}"
    finally:
        conn.close()
    return True, "writable"


def sqlite_writable_check(path: str | Path, *, clock: Clock, timeout_s: float = 2.0) -> Check:
    """Takes the database's write lock and releases it at once: fails on a read-only
    filesystem, a missing file, or a writer stuck for longer than `timeout_s`. Writes nothing."""
    db = str(path)

    async def check() -> CheckResult:
        with clock.busy():
            return await asyncio.to_thread(_try_write_lock, db, timeout_s)

    return check


def agent_checks(*, connected: Gate, database: str | Path, clock: Clock, data_dir: Path,
                 relay_running: Callable[[], bool] | None, reserve: DiskReserve | None = None) -> dict[str, Check]:
    """What every agent's core part reports on `/healthz`: the broker connection, its database
    writable, room on the disk of its data directory ("disk full" while its reserve is given
    back), its relay running (when it runs one)."""
    found = {"transport": gate_check(connected), "database": sqlite_writable_check(database, clock=clock),
             "disk": reserve_disk_check(reserve) if reserve is not None else disk_space_check(data_dir)}
    if relay_running is not None:
        found["relay"] = predicate_check(relay_running, up="running", down="stopped")
    return found


__all__ = [
    "Check",
    "CheckResult",
    "agent_checks",
    "disk_space_check",
    "gate_check",
    "predicate_check",
    "problem_check",
    "reserve_disk_check",
    "sqlite_writable_check",
    "task_check",
]
