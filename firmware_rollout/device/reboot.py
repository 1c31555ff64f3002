"""How the updater restarts the device on the slot the installer selected."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from firmware_rollout.errors import UpdaterError


@runtime_checkable
class Rebooter(Protocol):
    async def reboot(self, reason: str) -> None:
        """Restart on the slot the installer selected. May not return (a real reboot or exec)."""


class ExecRebooter:
    """Restarts the agent process in place (`exec` of the same command line): enough when the
    "slots" are directories; a device with real partitions uses `CommandRebooter`."""

    def __init__(self, argv: Sequence[str] | None = None) -> None:
        self._argv = list(argv) if argv is not None else [sys.executable, *sys.argv]

    async def reboot(self, reason: str) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(self._argv[0], self._argv)


class CommandRebooter:
    """Runs a reboot command such as `systemctl reboot`; a failure to run it is an `UpdaterError`."""

    def __init__(self, argv: Sequence[str]) -> None:
        self._argv = list(argv)

    async def reboot(self, reason: str) -> None:
        try:
            proc = await asyncio.create_subprocess_exec(*self._argv)
        except OSError as exc:
            raise UpdaterError(f"cannot run {self._argv[0]!r}: {exc.strerror or exc}") from exc
        if await proc.wait() != 0:
            raise UpdaterError(f"{' '.join(self._argv)} exited {proc.returncode}")


__all__ = ["CommandRebooter", "ExecRebooter", "Rebooter"]
