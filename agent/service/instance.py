"""One agent per data directory: `edge-agent run` holds an exclusive lock on `DATA_DIR/agent.lock`
for as long as it runs, so a second `run` on the same directory is refused in one line instead of
two processes sharing one outbox and one MQTT identity (each would take the other's session over,
for ever). The kernel drops the lock when the process dies, SIGKILL included.

`running_pid()` tells a read-only command (`doctor`) whether an agent holds the directory,
without creating anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from agent.core.errors import ConfigError

LOCK_NAME = "agent.lock"


class AlreadyRunning(ConfigError):
    """Another agent process holds this data directory."""


class InstanceLock:
    """Held by `edge-agent run` from before the databases open until the process ends."""

    def __init__(self, data_dir: Path, *, source: str = "agent.data_dir") -> None:
        self.path = data_dir / LOCK_NAME
        self._source = source  # named in the refusal: the config file, or --data-dir
        self._fd: int | None = None

    def acquire(self) -> InstanceLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f" (pid {holder})" if holder else ""
            raise AlreadyRunning(self._source, "agent.data_dir" if self._source != "--data-dir" else None,
                                 f"another agent runs on {self.path.parent}{who}; one data directory"
                                 " holds one agent") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing drops the lock; the file stays for the next run
            self._fd = None


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    return None


def running_pid(data_dir: Path) -> int | None:
    """The pid of the agent that holds `data_dir` (0 if unknown), or None when none does."""
    path = data_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd) or 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


__all__ = ["LOCK_NAME", "AlreadyRunning", "InstanceLock", "running_pid"]
