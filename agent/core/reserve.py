"""Room an agent keeps for itself on a full disk: a file of `RESERVE_BYTES` in its data dir.

An agent started on a full disk could not open its databases (SQLite needs a few pages for a
WAL and its shared-memory index, and the start counter's commit needs its own), so it would
exit and be restarted for ever, and applications would see "connection refused". Instead it
gives the reserve back (`release_if_full`, at open, logged at ERROR): with that room it opens,
serves, answers 503 with Retry-After for what it cannot store and delivers what it holds. Once
the disk has room again, `restore` makes the reserve anew (the agent retries every
`RESTORE_EVERY_S`). `/healthz` and `doctor` say "disk full" meanwhile (`disk_state`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path

from agent.core.clock import Clock
from agent.core.tasks import cancel_and_wait

RESERVE_FILE = "disk-reserve"
RESERVE_BYTES = 2 * 1024 * 1024
FULL_BELOW_BYTES = 1024 * 1024  # less room than this on the data dir's disk: it is full
RESTORE_EVERY_S = 10.0

log = logging.getLogger(__name__)


def _mib(n: float) -> str:
    return f"{n / 1024 / 1024:.1f} MiB"


class DiskReserve:
    """The reserve of one data dir. `released`: given back at this start, not made anew yet."""

    def __init__(self, data_dir: Path, *, size: int = RESERVE_BYTES) -> None:
        self.data_dir = data_dir
        self.path = data_dir / RESERVE_FILE
        self.size = size
        self.released = False
        self._keeping: asyncio.Task[None] | None = None

    def free_bytes(self) -> int | None:
        """Room on the data dir's disk (for an unprivileged user), None if it cannot be read."""
        try:
            return shutil.disk_usage(self.data_dir).free
        except OSError:
            return None

    @property
    def held(self) -> bool:
        try:
            return self.path.stat().st_size >= self.size
        except OSError:
            return False

    def release_if_full(self) -> bool:
        """Give the reserve back when the disk is full; True if it was."""
        free = self.free_bytes()
        if free is None or free >= FULL_BELOW_BYTES or not self.path.exists():
            return False
        try:
            self.path.unlink()
        except OSError as exc:
            log.error("disk full: %s free on %s, and the reserve %s cannot be given back: %s", _mib(free),
                      self.data_dir, self.path, exc.strerror or exc)
            return False
        self.released = True
        log.error("disk full: %s free on %s; gave back the %s reserve so the agent can run: what it cannot"
                  " store is answered 503 until there is room again", _mib(free), self.data_dir, _mib(self.size))
        return True

    def restore(self) -> bool:
        """Make the reserve if it is missing and the disk has room for it and to spare; True when
        it is held afterwards."""
        if self.held:
            self.released = False
            return True
        free = self.free_bytes()
        if free is None or free < self.size + FULL_BELOW_BYTES:
            return False
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.size)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("the disk reserve %s cannot be made: %s", self.path, exc.strerror or exc)
            try:
                self.path.unlink()
            except OSError:
                pass
            return False
        if self.released:
            log.info("disk has room again on %s: the %s reserve is back", self.data_dir, _mib(self.size))
        self.released = False
        return True

    def start(self, clock: Clock) -> None:
        """With the agent: make the reserve if it is missing (the first start, or deleted by
        hand); when it was given back, retry that every `RESTORE_EVERY_S` until it is held."""
        if not self.released:
            self.restore()
        elif self._keeping is None:
            self._keeping = asyncio.create_task(self._keep(clock), name="disk-reserve")

    async def stop(self) -> None:
        await cancel_and_wait(self._keeping)
        self._keeping = None

    async def _keep(self, clock: Clock) -> None:
        while not self.restore():
            await clock.sleep(RESTORE_EVERY_S)

    def full(self, free: int) -> bool:
        """With `free` bytes of room: is the disk full? Below `FULL_BELOW_BYTES`, or the reserve
        given back (by this process, or by the agent: it is missing and there is no room for it)."""
        return free < FULL_BELOW_BYTES or self.released or (not self.held and free < self.size + FULL_BELOW_BYTES)

    def disk_state(self, *, min_free_bytes: int) -> tuple[bool, str]:
        """(healthy, one line) for `/healthz` and `doctor`: "disk full: ..." while the disk is
        full or the reserve is given back, "disk nearly full" below `min_free_bytes`."""
        free = self.free_bytes()
        if free is None:
            return False, f"cannot read the free space of {self.data_dir}"
        total = shutil.disk_usage(self.data_dir).total
        room = f"{_mib(free)} free of {_mib(total)} on {self.data_dir}"
        if self.full(free):
            given = "; the agent's reserve is given back" if not self.held else ""
            return False, f"disk full: {room}{given}"
        if free < min_free_bytes:
            return False, f"disk nearly full: {room} (minimum {_mib(min_free_bytes)})"
        return True, f"{room} (minimum {_mib(min_free_bytes)})"


__all__ = ["FULL_BELOW_BYTES", "RESERVE_BYTES", "RESERVE_FILE", "RESTORE_EVERY_S", "DiskReserve"]
