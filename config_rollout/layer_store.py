"""The fleet's layers of configuration, in the leader's database (component "config_layers"):
its `leader.db`, or the fleet's PostgreSQL when its leaders share one (`[leader] database`), so
that every leader offers the same values and a fail-over loses none.

    config_layers        one value a layer sets: (target, scope "tag" or "device", selector: the
                         tag or the device id, document, key) -> the value (JSON), who set it and
                         when, and for a device's override when it expires
    config_group_order   per target, the tags' groups in their stated order (a later one wins);
                         a tag's first value puts it last, `order` states it again
    config_layer_changes every set, unset and order, with who made it and when (the audit trail)

What a device gets (`values_for`): its groups' values in the stated order, then its own
overrides that have not expired; one value per key, the last one winning, each naming its layer.
An expired override is not read (and goes at the next write).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agent.core.backends import server_migrations
from agent.core.errors import StoreError
from agent.core.sql import Connection, StoreTarget, dialect_of, has_table
from agent.core.sqlite import Synchronous, store_errors
from agent.core.store import Store
from config_rollout.layers import LayerValue, digest

Scope = Literal["tag", "device"]


def _v1(conn: sqlite3.Connection) -> None:
    conn.execute(
        """CREATE TABLE config_layers (
            target TEXT NOT NULL,
            scope TEXT NOT NULL CHECK (scope IN ('tag', 'device')),
            selector TEXT NOT NULL,
            document TEXT NOT NULL,
            key TEXT NOT NULL,
            value TEXT NOT NULL,
            expires_ms INTEGER,
            set_by TEXT NOT NULL,
            set_ms INTEGER NOT NULL,
            PRIMARY KEY (target, scope, selector, document, key)
        )"""
    )
    conn.execute(
        """CREATE TABLE config_group_order (
            target TEXT NOT NULL,
            tag TEXT NOT NULL,
            position INTEGER NOT NULL,
            PRIMARY KEY (target, tag)
        )"""
    )


def _v2(conn: sqlite3.Connection) -> None:
    conn.execute(
        """CREATE TABLE config_layer_changes (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            at_ms INTEGER NOT NULL,
            by TEXT NOT NULL,
            action TEXT NOT NULL,
            target TEXT NOT NULL,
            scope TEXT NOT NULL DEFAULT '',
            selector TEXT NOT NULL DEFAULT '',
            document TEXT NOT NULL DEFAULT '',
            key TEXT NOT NULL DEFAULT '',
            value TEXT
        )"""
    )
    conn.execute("CREATE INDEX config_layer_changes_at ON config_layer_changes(at_ms)")


@dataclass(frozen=True)
class LayerChange:
    """One change of the layers: a value set or unset, or a target's groups ordered."""

    at_ms: int
    by: str
    action: str  # "set", "unset", "order"
    target: str
    scope: str
    selector: str
    document: str
    key: str
    value: str | None  # set: the value (JSON); order: the tags (JSON)


@dataclass(frozen=True)
class LayerRow:
    target: str
    scope: Scope
    selector: str
    document: str
    key: str
    value: str  # JSON
    expires_ms: int | None
    set_by: str
    set_ms: int

    @property
    def source(self) -> str:
        return f"{self.scope} {self.selector}"


class LayerStore(Store):
    """All reads and writes of the layer tables, on the leader's database."""

    COMPONENT = "config_layers"
    MIGRATIONS = (_v1, _v2)
    SERVER_MIGRATIONS = server_migrations("config_rollout", COMPONENT)
    WHAT = "the configuration layers"

    @classmethod
    def open(cls, target: StoreTarget | str, *, synchronous: Synchronous = "FULL") -> LayerStore:
        """The layers in `target`: a leader's `leader.db`, or the fleet's PostgreSQL."""
        return cls(cls.connect_target(target, synchronous=synchronous), path=target)

    @classmethod
    def open_readonly(cls, path: str | Path) -> LayerStore:
        return cls(cls.connect_readonly(path), path=path)

    # -- writes --------------------------------------------------------------------------------
    def set_value(self, target: str, scope: Scope, selector: str, document: str, key: str, value: object, *,
                  set_by: str, now_ms: int, expires_ms: int | None = None) -> None:
        """Set one key of one document in a layer (a tag's group is put last in the order when
        it is new)."""
        self.check_open()
        with self.atomic(), store_errors(f"{self.path}: set a configuration layer value"):
            self._conn.execute("DELETE FROM config_layers WHERE expires_ms IS NOT NULL AND expires_ms <= ?",
                               (now_ms,))
            self._conn.execute(
                "INSERT INTO config_layers (target, scope, selector, document, key, value, expires_ms, set_by,"
                " set_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (target, scope, selector, document, key)"
                " DO UPDATE SET value = excluded.value, expires_ms = excluded.expires_ms, set_by = excluded.set_by,"
                " set_ms = excluded.set_ms",
                (target, scope, selector, document, key, json.dumps(value), expires_ms, set_by, now_ms))
            self._changed(now_ms, set_by, "set", target, scope, selector, document, key, json.dumps(value))
            if scope == "tag":
                self._conn.execute(
                    "INSERT INTO config_group_order (target, tag, position) SELECT ?, ?,"
                    " COALESCE(MAX(position), 0) + 1 FROM config_group_order WHERE target = ?"
                    " ON CONFLICT (target, tag) DO NOTHING",
                    (target, selector, target))

    def unset(self, target: str, scope: Scope, selector: str, document: str, key: str, *, by: str,
              now_ms: int) -> bool:
        """Remove one value; whether there was one."""
        self.check_open()
        with self.atomic(), store_errors(f"{self.path}: unset a configuration layer value"):
            gone = self._conn.execute(
                "DELETE FROM config_layers WHERE target = ? AND scope = ? AND selector = ? AND document = ?"
                " AND key = ?", (target, scope, selector, document, key)).rowcount
            if gone:
                self._changed(now_ms, by, "unset", target, scope, selector, document, key, None)
            self._conn.execute(
                "DELETE FROM config_group_order WHERE target = ? AND tag NOT IN"
                " (SELECT selector FROM config_layers WHERE target = ? AND scope = 'tag')", (target, target))
        return bool(gone)

    def _changed(self, at_ms: int, by: str, action: str, target: str, scope: str, selector: str, document: str,
                 key: str, value: str | None) -> None:
        self._conn.execute(
            "INSERT INTO config_layer_changes (at_ms, by, action, target, scope, selector, document, key, value)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", (at_ms, by[:256], action, target, scope, selector, document, key,
                                                  value))

    def order(self, target: str, tags: Sequence[str], *, by: str, now_ms: int) -> None:
        """State the order of the target's groups (the last one wins): every tag that has values,
        each once. A `StoreError` names the tag left out or not known."""
        known = self.group_order(target)
        if sorted(tags) != sorted(known) or len(set(tags)) != len(tags):
            missing = sorted(set(known) - set(tags))
            unknown = sorted(set(tags) - set(known))
            raise StoreError(
                f"target {target}'s groups are {', '.join(known) or 'none'}: "
                + (f"name {', '.join(missing)} too" if missing else
                   f"{', '.join(unknown)} has no values" if unknown else "name each once"))
        with self.atomic(), store_errors(f"{self.path}: order configuration groups"):
            for position, tag in enumerate(tags, 1):
                self._conn.execute("UPDATE config_group_order SET position = ? WHERE target = ? AND tag = ?",
                                   (position, target, tag))
            self._changed(now_ms, by, "order", target, "tag", "", "", "", json.dumps(list(tags)))

    # -- reads ---------------------------------------------------------------------------------
    def reads(self) -> LayerReads:
        self.check_open()
        return LayerReads(self._conn)

    def group_order(self, target: str) -> list[str]:
        return self.reads().group_order(target)

    def rows(self, target: str | None = None, *, now_ms: int) -> list[LayerRow]:
        return self.reads().rows(target, now_ms=now_ms)

    def values_for(self, target: str, device_id: str, tags: Sequence[str], *, now_ms: int) -> tuple[LayerValue, ...]:
        return self.reads().values_for(target, device_id, tags, now_ms=now_ms)

    def values_for_devices(self, target: str, devices: Mapping[str, Sequence[str]], *,
                           now_ms: int) -> dict[str, tuple[LayerValue, ...]]:
        return self.reads().values_for_devices(target, devices, now_ms=now_ms)


class LayerReads:
    """The layer tables' reads, on any connection to the leader's database (a read-only one for
    the views); a database whose leader never wrote a layer has none."""

    def __init__(self, conn: Connection | sqlite3.Connection) -> None:
        self._conn = conn
        dialect = dialect_of(conn)
        self.present = all(int(conn.execute(has_table(dialect, table)).fetchone()[0])
                           for table in ("config_layers", "config_group_order"))

    def _q(self, sql: str, args: Sequence[object] = ()) -> list[tuple[object, ...]]:
        if not self.present:
            return []
        with store_errors("configuration layers"):
            return self._conn.execute(sql, args).fetchall()

    def changes(self, *, since_ms: int = 0, limit: int = 1000) -> list[LayerChange]:
        """The layers' changes since `since_ms`, oldest first (none before this record began)."""
        if not self.present or not int(self._conn.execute(
                has_table(dialect_of(self._conn), "config_layer_changes")).fetchone()[0]):
            return []
        return [LayerChange(int(str(a)), str(b), str(c), str(t), str(sc), str(se), str(d), str(k),
                            None if v is None else str(v))
                for a, b, c, t, sc, se, d, k, v in self._q(
                    "SELECT at_ms, by, action, target, scope, selector, document, key, value FROM config_layer_changes"
                    " WHERE at_ms >= ? ORDER BY id LIMIT ?", (since_ms, limit))]

    def group_order(self, target: str) -> list[str]:
        return [str(t) for (t,) in self._q(
            "SELECT tag FROM config_group_order WHERE target = ? ORDER BY position", (target,))]

    def rows(self, target: str | None = None, *, now_ms: int) -> list[LayerRow]:
        """The values in force (of one target, or all), groups in order, then devices."""
        rows = self._q(
            "SELECT l.target, l.scope, l.selector, l.document, l.key, l.value, l.expires_ms, l.set_by, l.set_ms"
            " FROM config_layers AS l LEFT JOIN config_group_order AS o ON o.target = l.target AND o.tag ="
            f" l.selector AND l.scope = 'tag' WHERE {'TRUE' if target is None else 'l.target = ?'} AND"
            " (l.expires_ms IS NULL OR l.expires_ms > ?)"
            " ORDER BY l.target, l.scope DESC, o.position, l.selector, l.document, l.key",
            (now_ms,) if target is None else (target, now_ms))
        return [LayerRow(str(t), "tag" if sc == "tag" else "device", str(se), str(d), str(k), str(v),
                         None if e is None else int(str(e)), str(b), int(str(m)))
                for t, sc, se, d, k, v, e, b, m in rows]

    def values_for(self, target: str, device_id: str, tags: Sequence[str], *, now_ms: int) -> tuple[LayerValue, ...]:
        """What the layers give one device of `target`: its groups' values in their order, then
        its own overrides; one per key, the last winning."""
        return _Layers(self.rows(target, now_ms=now_ms)).winners(device_id, tags)

    def values_for_devices(self, target: str, devices: Mapping[str, Sequence[str]], *,
                           now_ms: int) -> dict[str, tuple[LayerValue, ...]]:
        """`values_for` of many devices (device -> its tags), the layers read once."""
        layers = _Layers(self.rows(target, now_ms=now_ms))
        return {device: layers.winners(device, tags) for device, tags in devices.items()}

    def digests(self, target: str, devices: Mapping[str, Sequence[str]], *, now_ms: int) -> dict[str, str]:
        """device -> the digest of what the layers give it now (`layers.digest`; "" for none),
        the layers read once."""
        layers = _Layers(self.rows(target, now_ms=now_ms))
        by_tags: dict[tuple[str, ...], str] = {}  # a device without its own values: its groups' alone
        found: dict[str, str] = {}
        for device, tags in devices.items():
            if device in layers.devices:
                found[device] = digest(layers.winners(device, tags))
            elif (key := tuple(tags)) in by_tags:
                found[device] = by_tags[key]
            else:
                found[device] = by_tags[key] = digest(layers.winners(device, tags))
        return found

    def targets(self, *, now_ms: int) -> list[str]:
        return sorted({row.target for row in self.rows(now_ms=now_ms)})


class _Layers:
    """A target's rows, the groups' in their order and each device's own, to pick from per device."""

    def __init__(self, rows: Sequence[LayerRow]) -> None:
        self.groups = [r for r in rows if r.scope == "tag"]
        self.devices: dict[str, list[LayerRow]] = {}
        for r in rows:
            if r.scope == "device":
                self.devices.setdefault(r.selector, []).append(r)

    def winners(self, device_id: str, tags: Sequence[str]) -> tuple[LayerValue, ...]:
        winners: dict[tuple[str, str], LayerValue] = {}
        for row in [*(r for r in self.groups if r.selector in tags), *self.devices.get(device_id, ())]:
            winners.pop((row.document, row.key), None)
            winners[(row.document, row.key)] = LayerValue(document=row.document, key=row.key, value=row.value,
                                                          source=_source(row))
        return tuple(winners.values())


TARGET = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
SELECTOR = r"^[A-Za-z0-9_.:-]{1,128}$"
DOCUMENT = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"


@dataclass(frozen=True)
class LayerEdit:
    """One value to set (or unset: `value` None) in a layer, checked as the CLI and the console
    take it: names by their patterns, a TOML or JSON document, a dotted key, a value of at most
    4 KiB, an expiry (a duration from `now_ms`) only for a device's override."""

    target: str
    scope: Scope
    selector: str
    document: str
    key: str
    value: object = None
    expires_ms: int | None = None

    @classmethod
    def checked(cls, *, target: str, scope: str, selector: str, document: str, key: str,
                value_text: str | None = None, expires_text: str | None = None, now_ms: int = 0,
                fields: dict[str, str] | None = None) -> LayerEdit:
        """A `ConfigError` names the field (by `fields`' names for them: a CLI option, a form field)."""
        import re

        from agent.core.durations import parse_seconds
        from agent.core.errors import ConfigError
        from config_rollout.errors import ConfigReleaseError
        from config_rollout.layers import KEY_PATTERN, parse_value

        named = {"target": "target", "scope": "scope", "selector": "selector", "document": "document",
                 "key": "key", "value": "value", "expires": "expires", **(fields or {})}
        for field, text, pattern in (("target", target, TARGET), ("selector", selector, SELECTOR),
                                     ("document", document, DOCUMENT), ("key", key, KEY_PATTERN)):
            if not re.match(pattern, text or ""):
                raise ConfigError(named[field], None, f"{text!r} is not a valid {field}")
        if scope not in ("tag", "device"):
            raise ConfigError(named["scope"], None, "a tag's group or a device")
        if not document.endswith((".toml", ".json")):
            raise ConfigError(named["document"], None, f"{document}: only a TOML or JSON document takes layer values")
        value = None
        if value_text is not None:
            try:
                value = parse_value(value_text.strip(), named["value"])
            except ConfigReleaseError as exc:
                raise ConfigError(named["value"], None, str(exc).removeprefix(f"{named['value']}: ")) from None
            LayerValue(document=document, key=key, value=json.dumps(value))  # (bounded as on the wire)
        expires_ms = None
        if expires_text:
            if scope != "device":
                raise ConfigError(named["expires"], None, "only a device's override expires")
            try:
                expires_ms = now_ms + int(parse_seconds(expires_text.strip()) * 1000)
            except ValueError as exc:
                raise ConfigError(named["expires"], None, str(exc)) from None
        return cls(target, "tag" if scope == "tag" else "device", selector, document, key, value, expires_ms)


def _source(row: LayerRow) -> str:
    if row.expires_ms is None:
        return row.source
    import datetime

    until = datetime.datetime.fromtimestamp(row.expires_ms / 1000, datetime.UTC).strftime("%Y-%m-%dT%H:%MZ")
    return f"{row.source} until {until}"


__all__ = ["LayerChange", "LayerEdit", "LayerReads", "LayerRow", "LayerStore", "Scope"]
