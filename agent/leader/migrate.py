"""Growing up: a single gateway's shared stores copied from its `leader.db` into the fleet's
database server (PostgreSQL: the catalogue reads and the identity sequences here are its SQL).

`copy_to_server(leader_db, target)` copies what `[leader] database` moves to the server (the
device registry, with its processed message ids, the application messages, the rejects, the
device identities, the job queue with its epoch, the rollout tables, the configuration layers
with their groups' order and the acknowledged configuration attempts, each when the leader has
them), in one transaction: all of it or
nothing, so a rollout in flight goes on where it was under the leader that holds the orchestrator
lease, every job not confirmed yet is offered again by the leader that takes the job queue (under
the next epoch), and every leader offers the same layer values. The outbox stays each leader's
own, in `leader.db`, which the same leader keeps using. The leader must
be stopped (its data directory's lock says so); the target must hold no devices, messages or
rejects unless `into_non_empty` (then rows already there win: a device, a message id, a
processed id is never copied twice).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.core.errors import StoreError
from agent.core.sql import Connection, ServerUrl
from agent.core.sqlite import close_quietly, describe, read_int
from agent.core.store import Store
from agent.leader.identities import IdentityStore
from agent.leader.jobs import JobQueue
from agent.leader.messages import MessageLog
from agent.leader.registry import DeviceRegistry
from agent.leader.rejects import RejectLog
from agent.service.instance import running_pid
from config_rollout.attempt_acks import AttemptAckStore
from config_rollout.layer_store import LayerStore
from rollout_engine.store import RolloutStore

_CHUNK = 1_000


@dataclass(frozen=True)
class _Table:
    store: type[Store]
    name: str
    identity: str = ""  # a column PostgreSQL numbers itself (kept when the target was empty)


# In an order that keeps every row's references valid.
_TABLES = (
    _Table(DeviceRegistry, "registry_fleet"),
    _Table(DeviceRegistry, "registry_meta"),
    _Table(DeviceRegistry, "devices"),
    _Table(DeviceRegistry, "telemetry_last"),
    _Table(DeviceRegistry, "processed_messages"),
    _Table(DeviceRegistry, "fleet_online"),
    _Table(MessageLog, "app_messages", identity="id"),
    _Table(MessageLog, "app_message_usage"),
    _Table(RejectLog, "rejects", identity="id"),
    _Table(IdentityStore, "identity_meta"),
    _Table(IdentityStore, "device_identities"),
    _Table(IdentityStore, "issued_certs"),
    _Table(IdentityStore, "identity_controls", identity="id"),
    _Table(IdentityStore, "enrol_tokens"),
    _Table(IdentityStore, "enrol_allow"),
    _Table(JobQueue, "jobqueue_meta"),
    _Table(JobQueue, "jobs", identity="store_seq"),
    _Table(RolloutStore, "rollouts"),
    _Table(RolloutStore, "rollout_waves"),
    _Table(RolloutStore, "rollout_devices"),
    _Table(RolloutStore, "rollout_offers"),  # (PostgreSQL numbers their rows anew, in this order)
    _Table(RolloutStore, "rollout_device_events"),
    _Table(RolloutStore, "rollout_processed"),
    _Table(RolloutStore, "rollout_controls", identity="id"),
    _Table(RolloutStore, "rollout_serving"),
    _Table(LayerStore, "config_layers"),
    _Table(LayerStore, "config_group_order"),
    _Table(AttemptAckStore, "config_attempt_acks"),
)
_STORES: tuple[type[Store], ...] = (DeviceRegistry, MessageLog, RejectLog)
# a leader without [identity] has no identities; a database of a registry alone, no job queue
_OPTIONAL: tuple[type[Store], ...] = (IdentityStore, JobQueue, RolloutStore, LayerStore, AttemptAckStore)
_HELD = ("devices", "processed_messages", "app_messages", "rejects")  # a target holding any is not empty


def copy_to_server(leader_db: Path, target: ServerUrl, *, into_non_empty: bool = False) -> dict[str, int]:
    """Copy the shared stores of the stopped leader whose database is `leader_db` into `target`;
    the rows copied per table. `StoreError` in one line for a running leader, a source not at
    this program's schema, a target of another fleet, or a non-empty target."""
    if (pid := running_pid(leader_db.parent)) is not None:
        raise StoreError(f"a leader runs on {leader_db.parent}{f' (pid {pid})' if pid else ''}: stop it first,"
                         " so that nothing changes while its state is copied")
    sources: dict[type[Store], sqlite3.Connection] = {}
    try:
        for store in _STORES:
            sources[store] = store.connect_readonly(leader_db)  # each checks its tables' version
        for store in _OPTIONAL:
            if read_int(leader_db, "SELECT version FROM schema_versions WHERE component = ?",
                        (store.COMPONENT,)) is not None:
                sources[store] = store.connect_readonly(leader_db)
        for store in sources:  # the target's tables, at this program's version
            opened = store.connect_target(target)
            opened.close()
        server = target.backend.load()
        conn = server.connect(target)
        try:
            with server.atomic(conn):
                return _copy(sources, conn, target, into_non_empty)
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise StoreError(f"{leader_db}: cannot read: {describe(exc)}") from exc
    finally:
        for source in sources.values():
            close_quietly(source)


def _copy(sources: dict[type[Store], sqlite3.Connection], conn: Connection, target: ServerUrl,
          into_non_empty: bool) -> dict[str, int]:
    """Inside the target's transaction: the rows of every table, in `_TABLES`' order."""
    copied: dict[str, int] = {}
    held = {t: int(conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]) for t in _HELD}
    if any(held.values()) and not into_non_empty:
        said = ", ".join(f"{n} {t.replace('_', ' ')}" for t, n in held.items() if n)
        raise StoreError(f"{target} is not empty ({said}): pass --into-non-empty to add this leader's state"
                         " to it (rows already there win)")
    fleets = {str(r[0]) for r in sources[DeviceRegistry].execute("SELECT fleet FROM registry_fleet")}
    theirs = {str(r[0]) for r in conn.execute("SELECT fleet FROM registry_fleet")}
    if fleets and theirs and fleets != theirs:
        raise StoreError(f"{target} holds fleet {', '.join(sorted(theirs))}, this leader's database fleet"
                         f" {', '.join(sorted(fleets))}: a database serves one fleet")
    empty = not any(held.values())
    for table in _TABLES:
        if table.store in sources:
            copied[table.name] = _copy_table(sources[table.store], conn, table, keep_identity=empty)
    return copied


def _copy_table(source: sqlite3.Connection, conn: Connection, table: _Table, *,
                keep_identity: bool) -> int:
    types = {str(name): str(kind) for name, kind in conn.execute(
        "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = ?"
        " AND table_schema = current_schema()", (table.name,))}
    columns = [str(r[1]) for r in source.execute(f"PRAGMA table_info({table.name})")]
    missing = [c for c in columns if c not in types]
    if missing:
        raise StoreError(f"{table.name}: columns {', '.join(missing)} are not in the PostgreSQL schema")
    if table.identity and not keep_identity:
        columns.remove(table.identity)  # PostgreSQL numbers them after the rows already there
    text = [types[c] == "text" for c in columns]
    sql = (f"INSERT INTO {table.name} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
           " ON CONFLICT DO NOTHING")
    count = 0
    for rows in _chunks(source.execute(f"SELECT {', '.join(columns)} FROM {table.name}")):
        conn.executemany(sql, [[_value(v, is_text) for v, is_text in zip(row, text, strict=True)] for row in rows])
        count += len(rows)
    if table.identity and keep_identity and count:
        conn.execute(f"SELECT setval(pg_get_serial_sequence('{table.name}', '{table.identity}'),"
                     f" (SELECT MAX({table.identity}) FROM {table.name}))")
    return count


def _value(value: Any, is_text: bool) -> Any:
    """SQLite keeps what it was given: a JSON text may be stored as bytes (tags of old rows)."""
    if is_text and isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def _chunks(cursor: sqlite3.Cursor) -> Iterator[list[Any]]:
    while rows := cursor.fetchmany(_CHUNK):
        yield rows


__all__ = ["copy_to_server"]
