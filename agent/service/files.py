"""Files with restrictive modes: private directories, atomic private writes, secret checks.

The agent runs with `UMask=0027` under systemd and calls `set_service_umask()` itself, so every
file it creates (database, WAL, keys) is at most 0640; credentials and keys are written 0600
through `write_private_file`, which never leaves a half-written file behind: it writes a temp
file in the same directory, fsyncs it, renames it over the target and fsyncs the directory.

A credentials file that others can read is refused (like ssh refuses a readable private key):
a password readable by every local user is no password.
"""

from __future__ import annotations

import os
import ssl
import stat
from pathlib import Path

from agent.core.config import AgentConfig, MqttSection
from agent.core.errors import ConfigError, FileWriteError
from agent.core.files import write_private_file

SERVICE_UMASK = 0o027


class InsecureFile(ConfigError):
    """A credentials file is readable or writable by group/others, or owned by someone else."""


def set_service_umask() -> int:
    """Files we create are never world-accessible and never group-writable. Returns the old mask."""
    return os.umask(SERVICE_UMASK)


def ensure_private_dir(path: str | Path, mode: int = 0o750) -> Path:
    """Create `path` (and parents) with `mode`; tighten an existing directory that is looser."""
    target = Path(path)
    try:
        target.mkdir(mode=mode, parents=True, exist_ok=True)
        current = stat.S_IMODE(target.stat().st_mode)
        if current & ~mode:
            os.chmod(target, current & mode)
    except OSError as exc:
        raise FileWriteError(f"{target}: cannot create private directory: {exc.strerror}") from exc
    return target


def restrict_mode(path: str | Path, mode: int = 0o600) -> None:
    """Take bits away from an existing file (a database the driver created, its -wal, -shm)."""
    target = Path(path)
    try:
        current = stat.S_IMODE(target.stat().st_mode)
        if current & ~mode:
            os.chmod(target, current & mode)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise FileWriteError(f"{target}: cannot restrict mode: {exc.strerror}") from exc


def restrict_database_files(db_path: str | Path, mode: int = 0o600) -> None:
    """The SQLite database and its WAL and shared-memory files."""
    for suffix in ("", "-wal", "-shm", "-journal"):
        restrict_mode(f"{db_path}{suffix}", mode)


def unreadable_by(path: str | Path, user: str) -> str:
    """Why the system user `user` cannot read `path` ("" when it can, or when there is no such
    user on this system): each folder on the way must let it in, the file let it read."""
    import grp
    import pwd

    try:
        who = pwd.getpwnam(user)
    except KeyError:
        return ""
    groups = {who.pw_gid} | {g.gr_gid for g in grp.getgrall() if user in g.gr_mem}
    if who.pw_uid == 0:
        return ""

    def allowed(st: os.stat_result, bits: int) -> bool:
        if st.st_uid == who.pw_uid:
            return bool(st.st_mode & (bits << 6))
        if st.st_gid in groups:
            return bool(st.st_mode & (bits << 3))
        return bool(st.st_mode & bits)

    target = Path(path).absolute()
    for folder in reversed(target.parents):
        try:
            st = folder.stat()
        except OSError:
            return f"{folder}: {user} cannot look in it"
        if not allowed(st, 0o1):
            return f"{folder} is {stat.S_IMODE(st.st_mode):04o} uid {st.st_uid} gid {st.st_gid}: {user} cannot enter it"
    try:
        st = target.stat()
    except FileNotFoundError:
        return f"{target} does not exist yet"
    except OSError as exc:
        return f"{target}: {exc.strerror or exc}"
    if not allowed(st, 0o4):
        return f"{target} is {stat.S_IMODE(st.st_mode):04o} uid {st.st_uid} gid {st.st_gid}: {user} cannot read it"
    return ""


def check_private_file(path: str | Path, *, what: str = "credentials file") -> None:
    """Refuse a file that group/others can read or write, or that another user owns.

    Raises `InsecureFile` saying exactly what is wrong and how to fix it.
    """
    target = Path(path)
    try:
        st = target.stat()
    except FileNotFoundError:
        raise ConfigError(str(target), None, f"{what} not found") from None
    except OSError as exc:
        raise ConfigError(str(target), None, f"cannot read {what}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InsecureFile(str(target), None, f"{what} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise InsecureFile(
            str(target),
            None,
            f"{what} has mode {mode:04o}: group/others can access it; "
            f"refusing to use it (fix: chmod 600 {target})",
        )
    euid = os.geteuid()
    if st.st_uid not in (euid, 0):
        raise InsecureFile(
            str(target),
            None,
            f"{what} is owned by uid {st.st_uid}, not by this user (uid {euid}) or root; "
            f"refusing to use it (fix: chown to the service user)",
        )


def read_secret(path: str | Path, *, what: str = "password file") -> str:
    """The first line of a private file (a password), checked with `check_private_file`."""
    check_private_file(path, what=what)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), None, f"cannot read {what}: {exc}") from None
    secret = text.splitlines()[0] if text else ""
    if not secret:
        raise ConfigError(str(path), None, f"{what} is empty")
    return secret


def check_mqtt_credentials(section: MqttSection) -> None:
    """Refuse to start with a password file or TLS client key that others can read.

    Call before building the transport from `[mqtt]`; a missing file is a `ConfigError` too.
    """
    if section.password_file:
        check_private_file(section.password_file, what="mqtt.password_file")
    if section.tls_key:
        check_private_file(section.tls_key, what="mqtt.tls_key")


def artifact_tls(config: AgentConfig, *, source: str = "config") -> ssl.SSLContext | None:
    """The artifact server's TLS context from `[artifacts] tls_cert/tls_key` (None: plain HTTP),
    requiring a client certificate signed by `client_ca` when that is set; a `ConfigError` on
    the key whose file does not load. `preflight` checks with it."""
    a = config.artifacts
    if not a.tls_cert:
        return None
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        tls.load_cert_chain(a.tls_cert, a.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(source, "artifacts.tls_cert", f"cannot load {a.tls_cert} with {a.tls_key}: {exc}") from None
    if a.client_ca:
        try:
            tls.load_verify_locations(cafile=a.client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(source, "artifacts.client_ca", f"cannot load {a.client_ca}: {exc}") from None
        tls.verify_mode = ssl.CERT_REQUIRED
    return tls


__all__ = [
    "artifact_tls",
    "SERVICE_UMASK",
    "check_mqtt_credentials",
    "FileWriteError",
    "InsecureFile",
    "check_private_file",
    "ensure_private_dir",
    "read_secret",
    "restrict_database_files",
    "restrict_mode",
    "set_service_umask",
    "unreadable_by",
    "write_private_file",
]
