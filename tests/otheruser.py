"""Another user on this machine, for the tests of who may open a socket: a child process that
drops to a uid and its group (no other) and runs one function, and a directory any user may enter
(pytest's own temporary directories are root's alone). A forked child needs no Python of its own
to start: the test's virtual environment may sit in root's home."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

NOBODY = 65534  # uid of `nobody`, gid of `nogroup`


def as_user(uid: int, work: Callable[[], bytes]) -> bytes:
    """`work()` in a child process running as `uid` (group `uid`, no supplementary ones): what it
    returned, or `child failed: ...`."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = work()
        except BaseException as exc:
            out = f"child failed: {exc!r}".encode()
        os.write(write_end, out)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        out = pipe.read()
    os.waitpid(pid, 0)
    return out


def unix_status(path: Path, request: bytes) -> int:
    """The HTTP status `request` on the Unix socket at `path` is answered with (0: none)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        sock.sendall(request)
        line = sock.makefile("rb").readline()
    return int(line.split(b" ", 2)[1]) if line.startswith(b"HTTP/1.1 ") else 0


def unix_status_as(uid: int, path: Path, request: bytes) -> int:
    out = as_user(uid, lambda: str(unix_status(path, request)).encode())
    return int(out) if out.isdigit() else 0


@contextmanager
def open_directory() -> Iterator[Path]:
    """A directory any user may enter, for a socket another uid connects to."""
    where = Path(tempfile.mkdtemp(prefix="ea-open-"))
    where.chmod(0o755)
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)
