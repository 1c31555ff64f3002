"""Reading the systemd journal of some units: `journalctl`, bounded in lines, bytes and time.

The agent reads the journal to explain a failure (`agent.worker.failure_logs`): the units a
failed update touched, from a little before it began; and for an operator's log bundle
(`agent.worker.remote`, its command line from `journal_command`). No journal (no systemd, no `journalctl`,
no right to read it: the agent's user needs the `systemd-journal` group for another unit's
journal) is not an error: the caller gets one line saying why, and the agent's own log still
goes with the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil

UNIT_NAME = re.compile(r"^[A-Za-z0-9:_.@-]{1,255}$")
JOURNAL_TIMEOUT_S = 5.0
JOURNAL_BYTES_MAX = 256 * 1024


def journal_command(units: tuple[str, ...], *, since_ms: int, max_lines: int = 0,
                    journalctl: str = "journalctl") -> list[str] | None:
    """journalctl's command line for `units` (none: every unit) since `since_ms` (wall clock),
    the newest `max_lines` (0: all); None when journalctl is not installed."""
    tool = shutil.which(journalctl)
    if tool is None:
        return None
    argv = [tool, "--no-pager", "--quiet", "--output=short-iso", f"--since=@{max(0, since_ms) // 1000}"]
    if max_lines > 0:
        argv.append(f"--lines={max_lines}")
    for unit in units:
        argv += ["--unit", unit]
    return argv


async def journal_lines(units: tuple[str, ...], *, since_ms: int, max_lines: int,
                        journalctl: str = "journalctl") -> list[str]:
    """The newest `max_lines` journal lines of `units` since `since_ms` (wall clock), oldest
    first, or one line saying why there are none."""
    named = [u for u in units if UNIT_NAME.match(u)]
    if not named or max_lines <= 0:
        return []
    argv = journal_command(tuple(named), since_ms=since_ms, max_lines=max_lines, journalctl=journalctl)
    if argv is None:
        return [f"(the journal of {', '.join(named)}: {journalctl} is not installed)"]
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
    except OSError as exc:
        return [f"(the journal of {', '.join(named)}: {exc})"]
    try:
        assert proc.stdout is not None
        out = await asyncio.wait_for(proc.stdout.read(JOURNAL_BYTES_MAX), JOURNAL_TIMEOUT_S)
        err = await asyncio.wait_for(proc.stderr.read(4096), JOURNAL_TIMEOUT_S) if proc.stderr else b""
    except TimeoutError:
        return [f"(the journal of {', '.join(named)}: journalctl gave nothing within {JOURNAL_TIMEOUT_S:.0f}s)"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
    lines = out.decode("utf-8", "replace").splitlines()
    if not lines and err.strip():
        return [f"(the journal of {', '.join(named)}: {err.decode('utf-8', 'replace').strip().splitlines()[-1]})"]
    return lines[-max_lines:]


__all__ = ["journal_command", "journal_lines"]
