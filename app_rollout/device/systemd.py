"""What the application helper asks of systemd: `systemctl` and `systemd-run`, as commands (the
helper runs as root beside PID 1; no D-Bus library is loaded for this)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from app_rollout.errors import AppInstallError

COMMAND_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class UnitState:
    active: str  # ActiveState: active, activating, failed, inactive, ...
    sub: str  # SubState: running, auto-restart, dead, ...
    restarts: int  # NRestarts: how often systemd restarted it since it was started
    since_us: int  # ActiveEnterTimestampMonotonic (0: never active)
    result: str  # Result: success, exit-code, signal, ...
    status: int = 0  # ExecMainStatus: the main process's exit code (or signal)


async def run(*argv: str, timeout_s: float = COMMAND_TIMEOUT_S) -> tuple[int, str]:
    """`argv`'s exit code and its output (stdout then stderr, cut to 2000 characters)."""
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    except OSError as exc:
        raise AppInstallError(f"{argv[0]}: {exc.strerror or exc}") from None
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return -1, f"{' '.join(argv[:3])}: no answer in {timeout_s:g}s"
    return proc.returncode if proc.returncode is not None else -1, out.decode(errors="replace")[-2000:]


class Systemd:
    """The service manager as the helper uses it."""

    async def _ok(self, *argv: str) -> None:
        code, out = await run(*argv)
        if code != 0:
            raise AppInstallError(f"{' '.join(argv)}: exit {code}: {out.strip()[-300:]}")

    async def reload(self) -> None:
        await self._ok("systemctl", "daemon-reload")

    async def restart(self, unit: str) -> None:
        """Enable `unit` and (re)start it; a start that fails is said by its state, not here."""
        await self._ok("systemctl", "enable", unit)
        await run("systemctl", "reset-failed", unit)
        await run("systemctl", "restart", "--no-block", unit)

    async def stop(self, unit: str) -> None:
        await run("systemctl", "disable", "--now", unit)
        await run("systemctl", "reset-failed", unit)

    async def state(self, unit: str) -> UnitState:
        code, out = await run("systemctl", "show", unit, "--property=ActiveState,SubState,NRestarts,"
                                                         "ActiveEnterTimestampMonotonic,Result,ExecMainStatus")
        if code != 0:
            raise AppInstallError(f"systemctl show {unit}: exit {code}: {out.strip()[-300:]}")
        values = dict(line.partition("=")[::2] for line in out.splitlines() if "=" in line)
        return UnitState(active=values.get("ActiveState", "?"), sub=values.get("SubState", "?"),
                         restarts=int(values.get("NRestarts", "0") or 0),
                         since_us=int(values.get("ActiveEnterTimestampMonotonic", "0") or 0),
                         result=values.get("Result", "?"), status=int(values.get("ExecMainStatus", "0") or 0))

    async def run_as(self, name: str, argv: list[str], *, directory: str, timeout_s: float,
                     hidden: tuple[str, ...] = ()) -> tuple[int, str]:
        """`argv` run as application `name` runs: its own dynamic user, its data, its files, the
        same sandbox as its unit (`hidden`: the paths it may not see)."""
        sandbox = ["DynamicUser=yes", f"StateDirectory=edge-apps/{name}", "NoNewPrivileges=yes",
                   "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "PrivateDevices=yes",
                   "CapabilityBoundingSet=", "RestrictSUIDSGID=yes", *(f"InaccessiblePaths=-{p}" for p in hidden)]
        return await run("systemd-run", "--wait", "--pipe", "--quiet", "--collect", f"--unit=edge-app-{name}-check",
                         f"--working-directory={directory}", *(f"--property={p}" for p in sandbox), "--", *argv,
                         timeout_s=timeout_s)


__all__ = ["Systemd", "UnitState", "run"]
