"""How the updater restarts the device on the slot the installer selected."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from agent.core.clock import Clock, SystemClock
from firmware_rollout.errors import UpdaterError


@runtime_checkable
class Rebooter(Protocol):
    async def reboot(self, reason: str, *, trial: bool = False) -> None:
        """Restart on the slot the installer selected (`trial`: the armed trial slot, which a
        Raspberry Pi boots only when asked with `reboot "0 tryboot"`). May not return."""


class ExecRebooter:
    """Restarts the agent process in place (`exec` of the same command line): enough when the
    "slots" are directories; a device with real partitions uses `CommandRebooter`."""

    def __init__(self, argv: Sequence[str] | None = None) -> None:
        self._argv = list(argv) if argv is not None else [sys.executable, *sys.argv]

    async def reboot(self, reason: str, *, trial: bool = False) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(self._argv[0], self._argv)


class CommandRebooter:
    """Runs a reboot command such as `systemctl reboot`, then waits for the system to go down.
    A command that cannot run, exits non-zero, or returns and the device is still up after
    `settle_s` is an `UpdaterError`: the updater reports it and disarms the trial."""

    def __init__(self, argv: Sequence[str], *, trial_argv: Sequence[str] = (), clock: Clock | None = None,
                 settle_s: float = 120.0) -> None:
        self._argv = list(argv)
        self._trial_argv = list(trial_argv) or self._argv
        self._clock = clock or SystemClock()
        self._settle_s = settle_s

    async def reboot(self, reason: str, *, trial: bool = False) -> None:
        argv = self._trial_argv if trial else self._argv
        try:
            proc = await asyncio.create_subprocess_exec(*argv)
        except OSError as exc:
            raise UpdaterError(f"cannot run {argv[0]!r}: {exc.strerror or exc}") from exc
        if await proc.wait() != 0:
            raise UpdaterError(f"{' '.join(argv)} exited {proc.returncode}")
        await self._clock.sleep(self._settle_s)  # the shutdown ends this process meanwhile
        raise UpdaterError(f"{' '.join(argv)} exited 0 but the device was still up {self._settle_s:g}s later")


__all__ = ["CommandRebooter", "ExecRebooter", "Rebooter"]
