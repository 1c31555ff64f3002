"""Durable file writes, the one way the agent and its tools replace a file: a temporary file
beside the target, written and fsynced, renamed over the target, the directory fsynced. A power
cut leaves the old file or the new one, never a part of either."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from agent.core.errors import FileWriteError


def fsync_path(path: str | Path) -> None:
    """fsync a file already written, or a folder after a rename in it; an OSError is raised
    (where the caller's durability depends on it; `fsync_dir` shrugs off a folder it cannot open)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str | Path) -> None:
    """fsync a directory after a rename in it (a platform that cannot open one is left alone:
    the rename itself is still atomic)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes, *, mode: int | None = None) -> Path:
    """Replace `path` with `data` durably. `mode`: exactly these permission bits (the umask
    cannot add any, and none are left looser while the file is written); None: 0666 less the
    umask. Raises OSError; the temporary file is gone whatever happens."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666 if mode is None else mode)
    try:
        try:
            if mode is not None:
                os.fchmod(fd, mode)  # the umask may have taken bits away; set exactly what was asked
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(target.parent)
    return target


def write_private_file(path: str | Path, data: bytes | str, mode: int = 0o600) -> Path:
    """Atomically replace `path` with `data`, mode `mode` (0600 by default); a `FileWriteError`
    naming the file when it cannot."""
    target = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        atomic_write(target, payload, mode=mode)
    except OSError as exc:
        raise FileWriteError(f"{target}: cannot write: {exc.strerror or exc}") from exc
    return target


__all__ = ["atomic_write", "fsync_dir", "fsync_path", "write_private_file"]
