"""The database servers a leader's stores can live on, as a table: a URL's scheme names its
backend, and the backend names the module that connects to it.

The embedded default is a file (`leader.db`, SQLite: `agent.core.sqlite`), never in this table.
A server backend's module offers what `agent.core.store.Store` needs of it (`ServerModule`); it
is imported only when a store opens on such a URL, so a device never loads a server's driver.
A store that can live on a server keeps its DDL per backend as SQL files beside its module
(`server_migrations`: `agent/leader/sql/postgresql/registry/0001.sql`, ...), read into
`Store.SERVER_MIGRATIONS`.

Adding a backend: a line here, its module (as `agent.core.postgres`), its DDL in each shared
store, its cases in `agent.core.sql`'s few dialect helpers, and its driver as an extra in
`pyproject.toml`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    import contextlib

    from agent.core.clock import Clock
    from agent.core.sql import Notice, ServerUrl


class Listener(Protocol):
    """A session that hears the notices other sessions send on its channels, with no poll."""

    listening: bool  # False while its session is lost: the caller asks on its own ticks then

    async def wait(self, clock: Clock, timeout_s: float) -> frozenset[Notice]: ...

    def close(self) -> None: ...


class ServerModule(Protocol):
    """What a server backend's module offers the stores."""

    def connect(self, target: ServerUrl) -> Any: ...

    def open_migrated(self, target: ServerUrl, component: str, steps: Sequence[str]) -> Any: ...

    def atomic(self, conn: Any, *, synced: bool = True) -> contextlib.AbstractContextManager[Any]: ...

    def schema_version(self, conn: Any, component: str) -> int | None: ...

    def migrate(self, conn: Any, component: str, steps: Sequence[str]) -> int: ...

    def listen(self, target: ServerUrl, channels: Sequence[str]) -> Listener: ...

    def notify(self, conn: Any, channel: str, payload: str = "") -> None: ...


@dataclass(frozen=True)
class Backend:
    name: str  # also the dialect its stores speak (`agent.core.sql.Dialect`)
    schemes: tuple[str, ...]  # the URL prefixes that name it
    module: str  # its connection module
    extra: str  # the pip extra that installs its driver

    def load(self) -> ServerModule:
        return cast("ServerModule", importlib.import_module(self.module))


BACKENDS: tuple[Backend, ...] = (
    Backend("postgresql", ("postgresql://", "postgres://"), "agent.core.postgres", "postgresql"),
)


def backend_named(url: str) -> Backend | None:
    """The backend whose scheme `url` starts with; None for a file path (or an unknown scheme)."""
    return next((b for b in BACKENDS if url.startswith(b.schemes)), None)


def server_migrations(package: str, component: str) -> dict[str, tuple[str, ...]]:
    """A store's SQL scripts per server backend: `<package>/sql/<backend>/<component>/0001.sql`,
    `0002.sql`, ... (the file's number is the schema version it brings the tables to)."""
    from importlib.resources import files

    found: dict[str, tuple[str, ...]] = {}
    for backend in BACKENDS:
        folder = files(package) / "sql" / backend.name / component
        if not folder.is_dir():
            continue
        names = sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".sql"))
        if names != [f"{n:04d}.sql" for n in range(1, len(names) + 1)]:
            raise RuntimeError(f"{package}: sql/{backend.name}/{component}: scripts must be 0001.sql, 0002.sql, ..."
                               f" (found {', '.join(names)})")
        found[backend.name] = tuple((folder / name).read_text(encoding="utf-8") for name in names)
    return found


def schemes() -> Iterator[str]:
    for backend in BACKENDS:
        yield from backend.schemes


__all__ = ["BACKENDS", "Backend", "Listener", "ServerModule", "backend_named", "schemes", "server_migrations"]
