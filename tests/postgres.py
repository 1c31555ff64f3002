"""A real PostgreSQL cluster for tests and benchmarks: Debian's server binaries, `initdb` in a
temporary folder, a free loopback port, stopped and removed at the end.

`PostgresCluster().start()` returns once the server accepts connections; `url(schema=...)` is a
libpq URL whose sessions use that schema first (each test gets a fresh schema of one shared
cluster: much cheaper than a cluster or a database each); `stop()` / `start()` again take the
server away and bring it back on the same port and data, as an operator's restart would.
`initdb` refuses root: run as root, the cluster runs as Debian's `postgres` user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import urllib.parse
import uuid
from pathlib import Path

from mosquitto import free_port


class PostgresMissing(RuntimeError):
    pass


def server_bindir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise PostgresMissing("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): install Debian's"
                              " `postgresql` package (apt-get install -y postgresql); the PostgreSQL tests need it")
    return Path(found[-1]).parent


class PostgresCluster:
    def __init__(self, user: str = "ea", database: str = "ea") -> None:
        self.bindir = server_bindir()
        self.work = Path(tempfile.mkdtemp(prefix="ea-pg-"))
        self.data = self.work / "data"
        self.log = self.work / "postgres.log"
        self.port = free_port()
        self.user = user
        self.database = database
        self._as_postgres: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.work, "postgres")
            self._as_postgres = ["runuser", "-u", "postgres", "--"]
        self._initialised = False

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self._as_postgres, *args], check=check, capture_output=True, text=True, timeout=120)

    def start(self) -> PostgresCluster:
        if not self._initialised:
            self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", self.user,
                      "--no-sync", "-E", "UTF8")
        opts = (f"-p {self.port} -k {self.work} -c listen_addresses=127.0.0.1 -c fsync=off"
                " -c max_connections=200 -c shared_buffers=32MB")
        done = self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "-l", str(self.log),
                         "-o", opts, "start", check=False)
        if done.returncode != 0:
            raise RuntimeError(f"PostgreSQL did not start: {done.stderr.strip()} {self.log_tail()}")
        if not self._initialised:
            self.psql(f"CREATE DATABASE {self.database}", database="postgres")
            self._initialised = True
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def close(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.work, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def psql(self, sql: str, *, database: str | None = None) -> str:
        done = subprocess.run([str(self.bindir / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user,
                               "-d", database or self.database, "-v", "ON_ERROR_STOP=1", "-At", "-c", sql],
                              check=False, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"psql: {done.stderr.strip()}")
        return done.stdout.strip()

    def url(self, *, schema: str | None = None, database: str | None = None) -> str:
        base = f"postgresql://{self.user}@127.0.0.1:{self.port}/{database or self.database}"
        if schema is None:
            return base
        return base + "?options=" + urllib.parse.quote(f"-c search_path={schema}")

    def new_schema(self) -> str:
        """A fresh empty schema's URL (its sessions create and read their tables there)."""
        name = "t_" + uuid.uuid4().hex[:12]
        self.psql(f"CREATE SCHEMA {name}")
        return self.url(schema=name)

    def new_database(self) -> str:
        name = "d_" + uuid.uuid4().hex[:12]
        self.psql(f"CREATE DATABASE {name}", database="postgres")
        return self.url(database=name)
