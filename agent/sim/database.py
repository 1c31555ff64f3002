"""The simulated leaders' PostgreSQL (`simulate --database URL`): a schema of the run's own in
that database, so that a run never meets another's devices, dropped at the end."""

from __future__ import annotations

import os
import secrets
import urllib.parse

from agent.core.errors import ConfigError, StoreError
from agent.core.sql import ServerUrl


def _with_schema(url: str, schema: str) -> str:
    parts = urllib.parse.urlsplit(url)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k != "options"]
    query.append(("options", f"-c search_path={schema}"))
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query, quote_via=urllib.parse.quote)))


class RunSchema:
    """`create()` makes the schema and returns the leaders' URL; `drop()` removes it."""

    def __init__(self, url: str, seed: int) -> None:
        self.url = url
        self.schema = f"ea_sim_{seed}_{os.getpid()}_{secrets.token_hex(3)}"

    def create(self) -> str:
        self._run(f"CREATE SCHEMA {self.schema}")
        return _with_schema(self.url, self.schema)

    def drop(self) -> None:
        self._run(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE")

    def _run(self, sql: str) -> None:
        target = ServerUrl(self.url)
        try:
            conn = target.backend.load().connect(target)
        except StoreError as exc:
            raise ConfigError("simulate", "database", str(exc)) from None
        try:
            conn.execute(sql)
        finally:
            conn.close()


__all__ = ["RunSchema"]
