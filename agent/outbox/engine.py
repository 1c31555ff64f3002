"""The outbox's SQL work, synchronous, run by one thread at a time (the writer thread).

`Engine` owns the connection and the in-memory state that must agree with it:

* which rows are in flight (handed to the relay, not yet acked/nacked/released),
* the counters and the per-class depths, mirrored from their tables and written back with the
  deltas of each transaction in that same transaction.

Write operations run between `begin()` and `commit()`; the writer groups many of them into one
transaction (group commit). Enqueued rows are written in bulk (`executemany`) at the end of a
run of enqueues, so a batch of messages costs one statement, not one per message.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from agent.core.errors import OutboxFull
from agent.outbox.partition import fnv1a_32
from agent.outbox.schema import COUNTER_NAMES
from agent.outbox.types import ClassStats, EnqueueResult, OutboxMessage, OutboxRow, OutboxStats

FullPolicy = Literal["reject", "drop_oldest"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassPolicy:
    """Limits of one message class. Defaults fit an SD card: 100k messages and 64 MiB of
    payload per class. `ttl_ms` 0 means messages never expire; `fifo` delivers one message per
    receiver at a time, in order."""

    max_messages: int = 100_000
    max_bytes: int = 64 * 1024 * 1024
    full_policy: FullPolicy = "drop_oldest"
    ttl_ms: int = 0
    fifo: bool = False

    def __post_init__(self) -> None:
        if self.max_messages < 1:
            raise ValueError(f"max_messages must be >= 1, got {self.max_messages}")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes}")
        if self.full_policy not in ("reject", "drop_oldest"):
            raise ValueError(f"full_policy must be reject or drop_oldest: {self.full_policy!r}")
        if self.ttl_ms < 0:
            raise ValueError(f"ttl_ms must be >= 0, got {self.ttl_ms}")


DEFAULT_CLASS = ClassPolicy()

_INSERT = (
    "INSERT INTO outbox (id, msg_id, owner, receiver, kind, payload, key, conflict, seq,"
    " created_at, send_at, expires_at, size, rhash, fifo)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# Deferred insert row layout (list, mutable so an overwrite in the same batch edits it).
_I_ID, _I_MSG, _I_OWNER, _I_RECV, _I_KIND, _I_PAYLOAD, _I_KEY, _I_CONFLICT, _I_SEQ = range(9)
_I_CREATED, _I_SEND, _I_EXPIRES, _I_SIZE = 9, 10, 11, 12

_OVERWRITE = (
    "UPDATE outbox SET msg_id = ?, kind = ?, payload = ?, conflict = ?, seq = ?,"
    " send_at = max(send_at, ?), expires_at = ?, size = ?, attempts = 0, last_error = NULL"
    " WHERE id = ?"
)
_KEY_LOOKUP = (
    "SELECT id, seq, kind, size FROM outbox INDEXED BY outbox_key"
    " WHERE owner = ? AND receiver = ? AND key = ? AND status = 'pending' ORDER BY id"
)
_ROW_COLUMNS = (
    "id, msg_id, owner, receiver, kind, payload, key, conflict, seq, created_at, send_at,"
    " expires_at, attempts, last_error"
)
_CHUNK = 500  # ids per IN (...) list, well under SQLite's variable limit


def _chunks(ids: Sequence[int]) -> Iterable[list[int]]:
    for i in range(0, len(ids), _CHUNK):
        yield [int(x) for x in ids[i : i + _CHUNK]]


def _marks(n: int) -> str:
    return "(" + ", ".join("?" * n) + ")"


def _fast_constructor(cls: type, columns: Sequence[str]) -> Callable[..., Any]:
    """A function building `cls` (a slots dataclass, possibly frozen) from a tuple whose items
    are the fields named in `columns`, bypassing the frozen `__setattr__` checks (about 3x
    faster than `cls(**kwargs)`; this is the relay's hot path). Fields not in `columns` get
    their defaults, so adding a defaulted field to the contract keeps working."""
    setters: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    lines = ["def build(r):", "    o = _new(_cls)"]
    for f in dataclasses.fields(cls):
        setters[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        if f.name in columns:
            lines.append(f"    _set_{f.name}(o, r[{columns.index(f.name)}])")
        elif f.default is not dataclasses.MISSING:
            setters[f"_def_{f.name}"] = f.default
            lines.append(f"    _set_{f.name}(o, _def_{f.name})")
        elif f.default_factory is not dataclasses.MISSING:
            setters[f"_fac_{f.name}"] = f.default_factory
            lines.append(f"    _set_{f.name}(o, _fac_{f.name}())")
        else:
            raise TypeError(f"{cls.__name__}.{f.name} has no column and no default")
    lines.append("    return o")
    exec("\n".join(lines), setters)  # noqa: S102 - generated from the dataclass's own fields
    return setters["build"]  # type: ignore[no-any-return]


# Column order of every SELECT that builds an OutboxRow (see _ROW_COLUMNS).
_row = _fast_constructor(
    OutboxRow,
    (
        "row_id", "msg_id", "owner", "receiver", "kind", "payload", "key", "conflict", "seq",
        "created_at_ms", "send_at_ms", "expires_at_ms", "attempts", "last_error",
    ),
)
_result = _fast_constructor(EnqueueResult, ("outcome", "row_id"))


class Engine:
    """Synchronous outbox operations on one connection. Not thread-safe: one thread drives it."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        *,
        max_attempts: int = 20,
        classes: Mapping[str, ClassPolicy] | None = None,
        default_class: ClassPolicy = DEFAULT_CLASS,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.conn = conn
        self.max_attempts = max_attempts
        self.classes = dict(classes or {})
        self.default_class = default_class
        # row id -> (receiver, kind, size, fifo)
        self.inflight: dict[int, tuple[str, str, int, bool]] = {}
        self.fifo_busy: dict[str, int] = {}
        self.write_transactions = 0
        self.counters: dict[str, int] = {}
        self.depth: dict[str, list[int]] = {}  # kind -> [pending, pending_bytes, dead]
        self.next_id = 1
        self._data_version = -1
        self._snap: tuple[dict[str, int], dict[str, list[int]], int] | None = None
        self._ins: dict[int, list[object]] = {}
        self._upd: dict[int, tuple[object, ...]] = {}
        self._keys: dict[tuple[str, str, str], list[list[object]]] = {}
        self._reload()

    # -- state mirrors ---------------------------------------------------------------------
    def _reload(self) -> None:
        conn = self.conn
        self.counters = dict.fromkeys(COUNTER_NAMES, 0)
        self.counters.update(conn.execute("SELECT name, value FROM outbox_counters").fetchall())
        self.depth = {
            k: [p, b, d]
            for k, p, b, d in conn.execute(
                "SELECT kind, pending, pending_bytes, dead FROM outbox_classes"
            )
        }
        row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'").fetchone()
        top = conn.execute("SELECT max(id) FROM outbox").fetchone()[0] or 0
        self.next_id = max(row[0] if row else 0, top) + 1
        self._data_version = conn.execute("PRAGMA data_version").fetchone()[0]

    def _check_external(self) -> None:
        """Another connection (the CLI) committed: reload the mirrors."""
        if self.conn.execute("PRAGMA data_version").fetchone()[0] != self._data_version:
            self._reload()

    def policy(self, kind: str) -> ClassPolicy:
        return self.classes.get(kind, self.default_class)

    def _d(self, kind: str) -> list[int]:
        d = self.depth.get(kind)
        if d is None:
            d = self.depth[kind] = [0, 0, 0]
        return d

    # -- transactions ----------------------------------------------------------------------
    @property
    def in_transaction(self) -> bool:
        return self._snap is not None

    def begin(self) -> None:
        self._check_external()
        self.conn.execute("BEGIN IMMEDIATE")
        self._snap = (
            dict(self.counters),
            {k: list(v) for k, v in self.depth.items()},
            self.next_id,
        )

    def commit(self) -> None:
        assert self._snap is not None
        self._flush()
        counters0, depth0, _ = self._snap
        conn = self.conn
        changed = [(v - counters0.get(k, 0), k) for k, v in self.counters.items()]
        changed = [c for c in changed if c[0]]
        if changed:
            conn.executemany(
                "UPDATE outbox_counters SET value = value + ? WHERE name = ?", changed
            )
        rows = []
        for kind, d in self.depth.items():
            d0 = depth0.get(kind)
            if d0 is None or d0 != d:
                rows.append((kind, d[0], d[1], d[2]))
        if rows:
            conn.executemany(
                "INSERT INTO outbox_classes (kind, pending, pending_bytes, dead)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (kind) DO UPDATE SET"
                " pending = excluded.pending, pending_bytes = excluded.pending_bytes,"
                " dead = excluded.dead",
                rows,
            )
        conn.execute("COMMIT")
        self.write_transactions += 1
        self._snap = None
        self._keys.clear()
        # (data_version does not move for this connection's own commits)

    def rollback(self) -> None:
        """Undo the open transaction, in the database and in memory. Never raises sqlite3."""
        self._ins.clear()
        self._upd.clear()
        self._keys.clear()
        if self.conn.in_transaction:
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        if self._snap is not None:
            self.counters, self.depth, self.next_id = self._snap
            self._snap = None

    def _flush(self) -> None:
        """Write the deferred inserts and overwrites of this run of enqueues."""
        if self._ins:
            self.conn.executemany(_INSERT, self._ins.values())
            self._ins.clear()
        if self._upd:
            self.conn.executemany(_OVERWRITE, self._upd.values())
            self._upd.clear()

    # -- enqueue ---------------------------------------------------------------------------
    def enqueue(
        self, msgs: Sequence[OutboxMessage], now_ms: int, delay_ms: int = 0
    ) -> list[EnqueueResult]:
        """Store `msgs` in order. One message: raises OutboxFull/ValueError before changing
        anything. Several: all or nothing (a savepoint)."""
        if len(msgs) == 1:
            return [self._enqueue_one(msgs[0], now_ms, delay_ms)]
        self._flush()
        self.conn.execute("SAVEPOINT enqueue_many")
        assert self._snap is not None
        snap = (dict(self.counters), {k: list(v) for k, v in self.depth.items()}, self.next_id)
        try:
            out = [self._enqueue_one(m, now_ms, delay_ms) for m in msgs]
            self._flush()
        except (OutboxFull, ValueError) as exc:
            self._ins.clear()
            self._upd.clear()
            self._keys.clear()
            self.conn.execute("ROLLBACK TO enqueue_many")
            self.conn.execute("RELEASE enqueue_many")
            self.counters, self.depth, self.next_id = snap
            if isinstance(exc, OutboxFull):
                self.counters["rejected_full"] += 1
            raise
        self.conn.execute("RELEASE enqueue_many")
        return out

    def enqueue_each(
        self, items: Sequence[tuple[OutboxMessage, int, int]]
    ) -> list[tuple[EnqueueResult | None, BaseException | None]]:
        """Independent enqueues (concurrent callers): (message, now_ms, delay_ms) each; one
        refused message (OutboxFull, ValueError) does not affect the others."""
        out: list[tuple[EnqueueResult | None, BaseException | None]] = []
        one = self._enqueue_one
        for m, now, delay in items:
            try:
                out.append((one(m, now, delay), None))
            except (OutboxFull, ValueError) as exc:
                out.append((None, exc))
        return out

    def _enqueue_one(self, m: OutboxMessage, now: int, delay_ms: int) -> EnqueueResult:
        payload = m.payload
        if type(payload) is not bytes:
            if not isinstance(payload, bytes | bytearray | memoryview):
                raise ValueError(f"payload must be bytes, got {type(payload).__name__}")
            payload = bytes(payload)
        conflict = m.conflict
        key = m.key
        if conflict != "append" and conflict != "overwrite":
            raise ValueError(f"conflict must be append or overwrite, got {conflict!r}")
        if key is None and conflict == "overwrite":
            raise ValueError("an overwrite message needs a key")
        kind = m.kind
        pol = self.classes.get(kind, self.default_class)
        size = len(payload)
        ttl = pol.ttl_ms if m.ttl_ms is None else m.ttl_ms
        if ttl < 0:
            raise ValueError(f"ttl_ms must be >= 0, got {ttl}")
        expires = now + ttl if ttl else None
        if key is None:
            d = self.depth.get(kind)
            if d is None or d[0] >= pol.max_messages or d[1] + size > pol.max_bytes:
                self._room(kind, pol, 1, size, ())
            rid = self._insert(m, payload, kind, pol, size, now, delay_ms, expires, None)
            return _result(("stored", rid))
        ident = (m.owner, m.receiver, key)
        rows = self._keys.get(ident)
        if rows is None:
            # Deferred rows of this batch are all in the cache, so the database is exact here.
            rows = [list(r) for r in self.conn.execute(_KEY_LOOKUP, ident)]
            self._keys[ident] = rows
        if conflict == "append":
            if rows:
                self.counters["duplicates"] += 1
                return _result(("duplicate", rows[0][0]))  # type: ignore[arg-type]
            self._room(kind, pol, 1, size, ())
            rid = self._insert(m, payload, kind, pol, size, now, delay_ms, expires, key)
            rows.append([rid, m.seq, kind, size])
            return _result(("stored", rid))
        # overwrite
        if rows:
            top = max(r[1] for r in rows)  # type: ignore[type-var]
            if m.seq <= top:  # type: ignore[operator]
                self.counters["enqueued"] += 1
                self.counters["dropped"] += 1
                return _result(("stale", rows[-1][0]))  # type: ignore[arg-type]
            inflight = self.inflight
            free = [r for r in rows if r[0] not in inflight]
            if free:
                keep, others = free[0], free[1:]
                rid = keep[0]
                same = keep[2] == kind
                add_n = (0 if same else 1) - sum(1 for o in others if o[2] == kind)
                add_b = (size - keep[3] if same else size) - sum(  # type: ignore[operator]
                    o[3] for o in others if o[2] == kind  # type: ignore[misc]
                )
                self._room(kind, pol, add_n, add_b, [r[0] for r in free])  # type: ignore[misc]
                for other in others:
                    self._delete_pending(other)  # type: ignore[arg-type]
                old = self._d(keep[2])  # type: ignore[arg-type]
                old[0] -= 1
                old[1] -= keep[3]  # type: ignore[operator]
                new = self._d(kind)
                new[0] += 1
                new[1] += size
                c = self.counters
                c["enqueued"] += 1
                c["overwritten"] += 1
                send_at = now + delay_ms
                ins = self._ins.get(rid)  # type: ignore[call-overload]
                if ins is not None:
                    ins[_I_MSG] = m.msg_id
                    ins[_I_KIND] = kind
                    ins[_I_PAYLOAD] = payload
                    ins[_I_CONFLICT] = conflict
                    ins[_I_SEQ] = m.seq
                    ins[_I_SEND] = max(ins[_I_SEND], send_at)  # type: ignore[type-var]
                    ins[_I_EXPIRES] = expires
                    ins[_I_SIZE] = size
                else:
                    self._upd[rid] = (  # type: ignore[index]
                        m.msg_id, kind, payload, conflict, m.seq, send_at, expires, size, rid
                    )
                keep[1], keep[2], keep[3] = m.seq, kind, size
                rows[:] = [r for r in rows if r[0] in inflight] + [keep]
                return _result(("overwritten", rid))  # type: ignore[arg-type]
            # every pending row of this key is in flight: the newer one waits behind it
        self._room(kind, pol, 1, size, ())
        rid = self._insert(m, payload, kind, pol, size, now, delay_ms, expires, key)
        rows.append([rid, m.seq, kind, size])
        return _result(("stored", rid))

    def _insert(
        self,
        m: OutboxMessage,
        payload: bytes,
        kind: str,
        pol: ClassPolicy,
        size: int,
        now: int,
        delay_ms: int,
        expires: int | None,
        key: str | None,
    ) -> int:
        rid = self.next_id
        self.next_id = rid + 1
        receiver = m.receiver
        self._ins[rid] = [
            rid, m.msg_id, m.owner, receiver, kind, payload, key, m.conflict, m.seq,
            now, now + delay_ms, expires, size, fnv1a_32(receiver), 1 if pol.fifo else 0,
        ]
        d = self.depth.get(kind)
        if d is None:
            d = self.depth[kind] = [0, 0, 0]
        d[0] += 1
        d[1] += size
        self.counters["enqueued"] += 1
        return rid

    def _delete_pending(self, r: list[int | str]) -> None:
        """Remove a pending row replaced by an overwrite (counted as overwritten)."""
        rid = int(r[0])
        if self._ins.pop(rid, None) is None:
            self._upd.pop(rid, None)
            self.conn.execute("DELETE FROM outbox WHERE id = ?", (rid,))
        d = self._d(str(r[2]))
        d[0] -= 1
        d[1] -= int(r[3])
        self.counters["overwritten"] += 1

    def _room(
        self, kind: str, pol: ClassPolicy, add: int, add_bytes: int, keep: Sequence[int]
    ) -> None:
        """Make room for `add` rows and `add_bytes` in `kind`, or raise OutboxFull."""
        if add <= 0 and add_bytes <= 0:
            return
        d = self.depth.get(kind)
        count, nbytes = (d[0], d[1]) if d is not None else (0, 0)
        over_n = count + add - pol.max_messages
        over_b = nbytes + add_bytes - pol.max_bytes
        if over_n <= 0 and over_b <= 0:
            return
        if pol.full_policy == "reject" or add_bytes > pol.max_bytes or add > pol.max_messages:
            self.counters["rejected_full"] += 1
            raise OutboxFull(
                f"message class {kind!r} is full ({count} messages, {nbytes} bytes;"
                f" caps {pol.max_messages} / {pol.max_bytes})"
            )
        self._flush()
        victims: list[tuple[int, int, str, str, str | None]] = []
        freed_n = freed_b = 0
        for rid, size, owner, receiver, key in self.conn.execute(
            "SELECT id, size, owner, receiver, key FROM outbox"
            " WHERE status = 'pending' AND kind = ? ORDER BY id",
            (kind,),
        ):
            if rid in self.inflight or rid in keep:
                continue
            victims.append((rid, size, owner, receiver, key))
            freed_n += 1
            freed_b += size
            if freed_n >= over_n and freed_b >= over_b:
                break
        if freed_n < over_n or freed_b < over_b:
            self.counters["rejected_full"] += 1
            raise OutboxFull(f"message class {kind!r} is full and its rows are in flight")
        self.conn.executemany("DELETE FROM outbox WHERE id = ?", [(v[0],) for v in victims])
        d = self._d(kind)
        d[0] -= freed_n
        d[1] -= freed_b
        self.counters["dropped"] += freed_n
        for rid, _, owner, receiver, key in victims:
            if key is not None:
                rows = self._keys.get((owner, receiver, key))
                if rows is not None:
                    rows[:] = [r for r in rows if r[0] != rid]

    # -- relay side: writes ----------------------------------------------------------------
    def _settle_flight(self, ids: Iterable[int]) -> None:
        for rid in ids:
            f = self.inflight.pop(rid, None)
            if f is not None and f[3]:
                n = self.fifo_busy[f[0]] - 1
                if n:
                    self.fifo_busy[f[0]] = n
                else:
                    del self.fifo_busy[f[0]]

    def ack(self, ids: Sequence[int]) -> int:
        """Delivered: delete the rows. Returns how many were still pending."""
        self._settle_flight(ids)
        if not ids:
            return 0
        self._flush()
        self._keys.clear()
        n = self._delete_ids(ids, "", ())
        self.counters["delivered"] += n
        return n

    def _delete_ids(self, ids: Sequence[int], cond: str, extra: tuple[object, ...]) -> int:
        """Delete the pending rows among `ids` (matching `cond`); adjusts depths."""
        n = 0
        depth = self.depth
        for chunk in _chunks(ids):
            gone = self.conn.execute(
                f"DELETE FROM outbox WHERE id IN {_marks(len(chunk))} AND status = 'pending'"
                f"{cond} RETURNING kind, size",
                (*chunk, *extra),
            ).fetchall()
            for kind, size in gone:
                d = depth.get(kind) or self._d(kind)
                d[0] -= 1
                d[1] -= size
            n += len(gone)
        return n

    def nack(self, rid: int, now_ms: int, delay_ms: int, error: str) -> bool:
        self._settle_flight((rid,))
        self._flush()
        self._keys.clear()
        row = self.conn.execute(
            "UPDATE outbox SET attempts = attempts + 1, send_at = ?, last_error = ?,"
            " status = CASE WHEN attempts + 1 >= ? THEN 'dead' ELSE 'pending' END"
            " WHERE id = ? AND status = 'pending'"
            " RETURNING status, kind, size, owner, receiver, key, conflict, seq",
            (now_ms + max(0, delay_ms), error, self.max_attempts, rid),
        ).fetchone()
        if row is None:
            return False
        if row[6] == "overwrite" and self.conn.execute(
            "SELECT 1 FROM outbox INDEXED BY outbox_key WHERE owner = ? AND receiver = ?"
            " AND key = ? AND status = 'pending' AND seq > ? LIMIT 1",
            (row[3], row[4], row[5], row[7]),
        ).fetchone():
            # A newer message with this key waited behind the failed one: that one supersedes
            # it, so the failed one is not retried (counted as overwritten).
            self._delete_pending([rid, 0, row[1], row[2]])
            return False
        if row[0] != "dead":
            return False
        self._to_dead(row[1], row[2])
        return True

    def _to_dead(self, kind: str, size: int) -> None:
        d = self._d(kind)
        d[0] -= 1
        d[1] -= size
        d[2] += 1
        self.counters["dead_lettered"] += 1

    def dead_letter(self, rid: int, error: str) -> bool:
        self._settle_flight((rid,))
        self._flush()
        self._keys.clear()
        row = self.conn.execute(
            "UPDATE outbox SET status = 'dead', attempts = attempts + 1, last_error = ?"
            " WHERE id = ? AND status = 'pending' RETURNING kind, size",
            (error, rid),
        ).fetchone()
        if row is None:
            return False
        self._to_dead(row[0], row[1])
        return True

    def replay(self, ids: Sequence[int] | None, now_ms: int) -> int:
        self._flush()
        self._keys.clear()
        sql = "UPDATE outbox SET status = 'pending', attempts = 0, send_at = ? WHERE status = 'dead'"
        back: list[tuple[str, int]] = []
        if ids is None:
            back = self.conn.execute(sql + " RETURNING kind, size", (now_ms,)).fetchall()
        else:
            for chunk in _chunks(ids):
                back += self.conn.execute(
                    f"{sql} AND id IN {_marks(len(chunk))} RETURNING kind, size", (now_ms, *chunk)
                ).fetchall()
        for kind, size in back:
            d = self._d(kind)
            d[0] += 1
            d[1] += size
            d[2] -= 1
        self.counters["replayed"] += len(back)
        return len(back)

    def purge(self, ids: Sequence[int] | None) -> int:
        self._flush()
        self._keys.clear()
        sql = "DELETE FROM outbox WHERE status = 'dead'"
        gone: list[tuple[str]] = []
        if ids is None:
            gone = self.conn.execute(sql + " RETURNING kind").fetchall()
        else:
            for chunk in _chunks(ids):
                gone += self.conn.execute(
                    f"{sql} AND id IN {_marks(len(chunk))} RETURNING kind", chunk
                ).fetchall()
        for (kind,) in gone:
            self._d(kind)[2] -= 1
        self.counters["purged"] += len(gone)
        return len(gone)

    def expire(self, now_ms: int, ids: Sequence[int] | None = None) -> int:
        """Delete pending rows past their expires_at (not those in flight); counted."""
        self._flush()
        self._keys.clear()
        if ids is None:
            found = self.conn.execute(
                "SELECT id FROM outbox INDEXED BY outbox_expiry"
                " WHERE status = 'pending' AND expires_at IS NOT NULL AND expires_at <= ?",
                (now_ms,),
            ).fetchall()
            ids = [r[0] for r in found if r[0] not in self.inflight]
        if not ids:
            return 0
        n = self._delete_ids(ids, " AND expires_at <= ?", (now_ms,))
        self.counters["expired"] += n
        return n

    def set_max_pages(self, pages: int) -> int:
        return int(self.conn.execute(f"PRAGMA max_page_count = {int(pages)}").fetchone()[0])

    # -- relay side: reads -----------------------------------------------------------------
    def release(self, ids: Sequence[int]) -> None:
        self._settle_flight(ids)

    def _ready_sql(self, partitions: int, kinds: Sequence[str] | None) -> tuple[str, list[object]]:
        sql = (
            "SELECT id, msg_id, owner, receiver, kind, payload, key, conflict, seq, created_at,"
            " send_at, expires_at, attempts, last_error, fifo, size"
            " FROM outbox INDEXED BY outbox_ready WHERE status = 'pending' AND send_at <= ?"
        )
        extra: list[object] = []
        if partitions > 1:
            sql += " AND rhash % ? = ?"
        if kinds is not None:
            sql += f" AND kind IN ({', '.join('?' * len(kinds))})"
            extra.extend(kinds)
        return sql + " ORDER BY send_at, id", extra

    def _fifo_head(self, receiver: str) -> int | None:
        row = self.conn.execute(
            "SELECT id FROM outbox INDEXED BY outbox_fifo"
            " WHERE receiver = ? AND status = 'pending' AND fifo = 1 ORDER BY id LIMIT 1",
            (receiver,),
        ).fetchone()
        return row[0] if row else None

    def take_ready(
        self,
        now_ms: int,
        limit: int,
        partition: int = 0,
        partitions: int = 1,
        kinds: Sequence[str] | None = None,
    ) -> list[OutboxRow]:
        """Read due rows and mark them in flight. Expired rows met on the way are deleted and
        counted in a small write transaction of their own (never handed out)."""
        if limit <= 0 or (kinds is not None and not kinds):
            return []
        if partitions < 1 or not 0 <= partition < partitions:
            raise ValueError(f"partition {partition} out of range for {partitions} partitions")
        self._check_external()
        sql, extra = self._ready_sql(partitions, kinds)
        args: list[object] = [now_ms]
        if partitions > 1:
            args += [partitions, partition]
        args += extra
        out: list[OutboxRow] = []
        expired: list[int] = []
        inflight = self.inflight
        fifo_busy = self.fifo_busy
        picked: set[str] = set()  # FIFO receivers given a row in this call
        heads: dict[str, int | None] = {}  # FIFO receiver -> id of its oldest pending row
        taken: list[tuple[int, str, str, int, bool]] = []
        for r in self.conn.execute(sql, args):
            rid = r[0]
            if rid in inflight:
                continue
            exp = r[11]
            if exp is not None and now_ms >= exp:
                expired.append(rid)
                continue
            fifo = r[14] == 1
            if fifo:
                receiver = r[3]
                if receiver in fifo_busy or receiver in picked:
                    continue
                if receiver not in heads:
                    heads[receiver] = self._fifo_head(receiver)
                if heads[receiver] != rid:
                    continue
                picked.add(receiver)
            out.append(_row(r))
            taken.append((rid, r[3], r[4], r[15], fifo))
            if len(out) >= limit:
                break
        for rid, receiver, kind, size, fifo in taken:
            inflight[rid] = (receiver, kind, size, fifo)
            if fifo:
                fifo_busy[receiver] = fifo_busy.get(receiver, 0) + 1
        if expired:
            self.begin()
            try:
                self.expire(now_ms, expired)
                self.commit()
            except BaseException:
                self.rollback()
                raise
        return out

    def next_due_ms(self) -> int | None:
        """Earliest send_at of a pending row that take_ready could hand out (not in flight,
        not behind its FIFO receiver's head)."""
        inflight = self.inflight
        heads: dict[str, int | None] = {}
        for rid, send_at, receiver, fifo in self.conn.execute(
            "SELECT id, send_at, receiver, fifo FROM outbox INDEXED BY outbox_ready"
            " WHERE status = 'pending' ORDER BY send_at, id"
        ):
            if rid in inflight:
                continue
            if fifo:
                if receiver in self.fifo_busy:
                    continue
                if receiver not in heads:
                    heads[receiver] = self._fifo_head(receiver)
                if heads[receiver] != rid:
                    continue
            return int(send_at)
        return None

    def stats(self, now_ms: int) -> OutboxStats:
        self._check_external()
        c = self.counters
        row = self.conn.execute(
            "SELECT created_at FROM outbox WHERE status = 'pending' ORDER BY id LIMIT 1"
        ).fetchone()
        flying: dict[str, int] = {}
        for _, kind, _, _ in self.inflight.values():
            flying[kind] = flying.get(kind, 0) + 1
        by_class = {
            kind: ClassStats(
                pending=d[0], in_flight=flying.get(kind, 0), dead=d[2], pending_bytes=d[1]
            )
            for kind, d in sorted(self.depth.items())
            if d[0] or d[2] or flying.get(kind)
        }
        return OutboxStats(
            enqueued=c["enqueued"],
            delivered=c["delivered"],
            dead_lettered=c["dead_lettered"],
            expired=c["expired"],
            dropped=c["dropped"],
            overwritten=c["overwritten"],
            pending=sum(d[0] for d in self.depth.values()),
            in_flight=len(self.inflight),
            dead=sum(d[2] for d in self.depth.values()),
            replayed=c["replayed"],
            duplicates=c["duplicates"],
            rejected_full=c["rejected_full"],
            oldest_pending_age_ms=None if row is None else max(0, now_ms - row[0]),
            by_class=by_class,
        )

    def list_dead(self, limit: int, offset: int) -> list[OutboxRow]:
        return [
            _row(r)
            for r in self.conn.execute(
                f"SELECT {_ROW_COLUMNS} FROM outbox WHERE status = 'dead'"
                " ORDER BY id LIMIT ? OFFSET ?",
                (max(0, limit), max(0, offset)),
            )
        ]

    def get(self, rid: int) -> OutboxRow | None:
        r = self.conn.execute(f"SELECT {_ROW_COLUMNS} FROM outbox WHERE id = ?", (rid,)).fetchone()
        return None if r is None else _row(r)


__all__ = ["DEFAULT_CLASS", "ClassPolicy", "Engine", "FullPolicy"]
