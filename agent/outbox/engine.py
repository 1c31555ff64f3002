"""The outbox's SQL work, synchronous, run by one thread at a time (the writer thread).

`Engine` owns the connection and the in-memory state that must agree with it:

* which rows are in flight (handed to the relay, not yet acked/nacked/released): a `Flight`
  shared with the loop thread's `Reader`; rows leave it only after the commit that settles
  them, so a poll never hands a row out again with its state from before that commit,
* the counters and the per-class depths, mirrored from their tables and written back with the
  deltas of each transaction in that same transaction.

Write operations run between `begin()` and `commit()`; the writer groups many of them into one
transaction (group commit). Enqueued rows are written in bulk (`executemany`) at the end of a
run of enqueues, so a batch of messages costs one statement, not one per message.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

from agent.core.errors import OutboxFull
from agent.outbox.partition import fnv1a_32
from agent.outbox.policy import DEFAULT_CLASS, ClassPolicy, FullPolicy
from agent.outbox.reads import Flight, ReadOps
from agent.outbox.schema import CLASS_FIELDS, COUNTER_NAMES, NEXT_ID
from agent.outbox.settle import SettleOps
from agent.outbox.types import EnqueueResult, OutboxMessage

_INSERT_INTO = (
    "INSERT INTO outbox (id, msg_id, owner, receiver, kind, payload, key, conflict, seq,"
    " created_at, send_at, expires_at, size, rhash, fifo) VALUES "
)
_VALUES = "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
# Rows go in by multi-row INSERTs of these sizes (about a fifth cheaper per row than one
# statement per row). A few fixed sizes keep the
# statements in sqlite3's cache; 64 rows x 15 values stays under the oldest variable limit (999).
_INSERT_SIZES = (64, 32, 16, 8, 4, 2, 1)
_INSERTS = {n: _INSERT_INTO + ", ".join([_VALUES] * n) for n in _INSERT_SIZES}
# Deferred insert row layout (list, mutable so an overwrite in the same batch edits it).
_I_MSG, _I_KIND, _I_PAYLOAD, _I_CONFLICT, _I_SEQ = 1, 4, 5, 7, 8
_I_SEND, _I_EXPIRES, _I_SIZE = 10, 11, 12

_KEY_LOOKUP = (
    "SELECT id, seq, kind, size, send_at, created_at FROM outbox INDEXED BY outbox_key"
    " WHERE owner = ? AND receiver = ? AND key = ? AND status = 'pending' ORDER BY id"
)
# The same, for many keys at once: [[owner, receiver, key], ...] as one JSON parameter.
_KEYS_LOOKUP = (
    "SELECT j.key, o.id, o.seq, o.kind, o.size, o.send_at, o.created_at"
    " FROM json_each(?) AS j JOIN outbox AS o INDEXED BY outbox_key"
    " ON o.owner = json_extract(j.value, '$[0]') AND o.receiver = json_extract(j.value, '$[1]')"
    " AND o.key = json_extract(j.value, '$[2]')"
    " WHERE o.status = 'pending' ORDER BY j.key, o.id"
)
_PREFETCH_MIN = 32  # keys in a batch before one bulk lookup beats one lookup per message
_PREFETCH_CHUNK = 10_000
class Engine(ReadOps, SettleOps):
    """Synchronous outbox operations on one connection, driven by one thread (the writer, or
    a CLI command). Only `flight` is shared with another thread."""

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
        # Rows handed to the relay: shared with the loop thread's Reader.
        self.flight = Flight()
        self.inflight = self.flight.rows
        self.write_transactions = 0
        self.counters: dict[str, int] = {}
        self.depth: dict[str, list[int]] = {}  # kind -> [pending, pending_bytes, dead]
        self.next_id = 1
        self._data_version = -1
        self._snap: tuple[dict[str, int], dict[str, list[int]], int] | None = None
        self._ins: dict[int, list[Any]] = {}  # deferred inserts, by id
        self._settle: list[int] = []  # in-flight rows to settle after this commit
        # What this transaction did that a resumed ready scan must hear of (see Flight.gen):
        # a row made takeable again, and the lowest send_at inserted.
        self._moved = False
        self._low: int | None = None
        self._del: list[tuple[int]] = []  # deferred deletes (rows replaced by an overwrite)
        # (owner, receiver, key) -> [[id, seq, kind, size, send_at, created_at], ...] of its
        # pending rows, valid for the current transaction (every deferred change of that key
        # goes through it)
        self._keys: dict[tuple[str, str, str], list[list[Any]]] = {}
        self._reload()

    # -- state mirrors ---------------------------------------------------------------------
    def _reload(self) -> None:
        conn = self.conn
        tally = dict(conn.execute("SELECT name, value FROM outbox_tally").fetchall())
        self.counters = {name: int(tally.get(name, 0)) for name in COUNTER_NAMES}
        self.depth = {}
        for name, value in tally.items():
            field, colon, kind = name.partition(":")
            if colon and field in CLASS_FIELDS:
                self._d(kind)[CLASS_FIELDS.index(field)] = int(value)
        top = conn.execute("SELECT max(id) FROM outbox").fetchone()[0] or 0
        self.next_id = max(int(tally.get(NEXT_ID, 1)), top + 1)
        self._data_version = conn.execute("PRAGMA data_version").fetchone()[0]

    def _check_external(self) -> None:
        """Another connection (the CLI) committed: reload the mirrors."""
        if self.conn.execute("PRAGMA data_version").fetchone()[0] != self._data_version:
            self._reload()
            self.flight.settle((), moved=True)  # committed already: rows may be back

    def _d(self, kind: str) -> list[int]:
        d = self.depth.get(kind)
        if d is None:
            d = self.depth[kind] = [0, 0, 0]
        return d

    # -- transactions ----------------------------------------------------------------------
    def begin(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")
        # Holding the write lock now: nobody else can commit until we do.
        self._check_external()
        self._snap = (
            dict(self.counters),
            {k: list(v) for k, v in self.depth.items()},
            self.next_id,
        )

    def commit(self) -> None:
        assert self._snap is not None
        self._flush()
        counters0, depth0, next0 = self._snap
        conn = self.conn
        # Deltas (another connection, the CLI, may have moved the totals meanwhile), all in
        # the one tally table: every counter and depth of a commit lands on the same page.
        deltas = [(k, v - counters0[k]) for k, v in self.counters.items() if v != counters0[k]]
        for kind, d in self.depth.items():
            p0, b0, x0 = depth0.get(kind) or (0, 0, 0)
            if d[0] != p0 or d[1] != b0 or d[2] != x0:
                deltas += [
                    (f"pending:{kind}", d[0] - p0),
                    (f"bytes:{kind}", d[1] - b0),
                    (f"dead:{kind}", d[2] - x0),
                ]
        if deltas:
            conn.executemany(
                "INSERT INTO outbox_tally (name, value) VALUES (?, ?)"
                " ON CONFLICT (name) DO UPDATE SET value = value + excluded.value",
                deltas,
            )
        if self.next_id != next0:  # ids are never reused, even after the top rows are gone
            conn.execute(
                "UPDATE outbox_tally SET value = max(value, ?) WHERE name = ?",
                (self.next_id, NEXT_ID),
            )
        conn.execute("COMMIT")
        self.write_transactions += 1
        self._snap = None
        self._keys.clear()
        self._settle_now()
        # (data_version does not move for this connection's own commits)

    def _settle_now(self) -> None:
        if self._settle or self._moved or self._low is not None:
            self.flight.settle(self._settle, moved=self._moved, low_send=self._low)
            self._settle.clear()
            self._moved = False
            self._low = None

    def rollback(self) -> None:
        """Undo the open transaction, in the database and in memory. Never raises sqlite3."""
        self._ins.clear()
        self._del.clear()
        self._keys.clear()
        if self.conn.in_transaction:
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        if self._snap is not None:
            self.counters, self.depth, self.next_id = self._snap
            self._snap = None
        # The rows stay pending; the relay (told of the failure) gets them again.
        self._moved = True
        self._settle_now()

    def _flush(self) -> None:
        """Write the deferred inserts and deletes of this run of enqueues."""
        if self._ins:
            rows = list(self._ins.values())
            self._ins.clear()
            low = min(row[_I_SEND] for row in rows)
            if self._low is None or low < self._low:
                self._low = low
            execute = self.conn.execute
            i, total = 0, len(rows)
            for n in _INSERT_SIZES:
                sql = _INSERTS[n]
                while total - i >= n:
                    execute(sql, list(chain.from_iterable(rows[i : i + n])))
                    i += n
        if self._del:
            self.conn.executemany("DELETE FROM outbox WHERE id = ?", self._del)
            self._del.clear()

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
            self._prefetch_keys(msgs)
            out = [self._enqueue_one(m, now_ms, delay_ms) for m in msgs]
            self._flush()
        except (OutboxFull, ValueError) as exc:
            self._ins.clear()
            self._del.clear()
            self._keys.clear()
            self.conn.execute("ROLLBACK TO enqueue_many")
            self.conn.execute("RELEASE enqueue_many")
            self.counters, self.depth, self.next_id = snap
            if isinstance(exc, OutboxFull):
                self.counters["rejected_full"] += 1
            raise
        self.conn.execute("RELEASE enqueue_many")
        return out

    def _prefetch_keys(self, msgs: Sequence[OutboxMessage]) -> None:
        """Look up the pending rows of every key of a large batch in one query (instead of
        one per message) and fill the key cache with them."""
        cache = self._keys
        wanted: list[tuple[str, str, str]] = []
        seen: set[tuple[str, str, str]] = set()
        for m in msgs:
            if m.key is not None:
                ident = (m.owner, m.receiver, m.key)
                if ident not in cache and ident not in seen:
                    seen.add(ident)
                    wanted.append(ident)
        if len(wanted) < _PREFETCH_MIN:
            return
        self._flush()  # (nothing deferred touches these keys: they are not in the cache)
        for ident in wanted:
            cache[ident] = []
        for start in range(0, len(wanted), _PREFETCH_CHUNK):
            chunk = wanted[start : start + _PREFETCH_CHUNK]
            for idx, *row in self.conn.execute(_KEYS_LOOKUP, (json.dumps(chunk),)):
                cache[chunk[idx]].append(row)

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
            rid = self._insert(m, payload, kind, pol, size, now, now + delay_ms, expires, None)
            return EnqueueResult("stored", rid)
        ident = (m.owner, m.receiver, key)
        rows = self._keys.get(ident)
        if rows is None:
            # Deferred rows of this batch are all in the cache, so the database is exact here.
            rows = [list(r) for r in self.conn.execute(_KEY_LOOKUP, ident)]
            self._keys[ident] = rows
        if conflict == "append":
            if rows:
                self.counters["duplicates"] += 1
                return EnqueueResult("duplicate", rows[0][0])
        elif rows:
            if m.seq <= max(r[1] for r in rows):
                self.counters["enqueued"] += 1
                self.counters["dropped"] += 1
                return EnqueueResult("stale", rows[-1][0])
            inflight = self.inflight
            free = [r for r in rows if r[0] not in inflight]
            if free:
                rid = self._overwrite(m, payload, kind, pol, size, now, delay_ms, expires, free)
                rows[:] = [r for r in rows if r[0] in inflight] + [free[0]]
                return EnqueueResult("overwritten", rid)
            # every pending row of this key is in flight: the newer one waits behind them
            self.flight.wait_behind(ident)
        self._room(kind, pol, 1, size, ())
        send_at = now + delay_ms
        rid = self._insert(m, payload, kind, pol, size, now, send_at, expires, key)
        rows.append([rid, m.seq, kind, size, send_at, now])
        return EnqueueResult("stored", rid)

    def _overwrite(
        self,
        m: OutboxMessage,
        payload: bytes,
        kind: str,
        pol: ClassPolicy,
        size: int,
        now: int,
        delay_ms: int,
        expires: int | None,
        free: list[list[Any]],
    ) -> int:
        """Replace `free` (pending rows of this key, none in flight) by the newer message.

        A row written earlier in this same batch is edited in place. A committed row is
        deleted and the newcomer inserted under a new id, keeping the old row's place in the
        ready order (its send_at, unless the newcomer asks for a delay). Why not an UPDATE:
        the loop thread reads committed rows without the writer's lock, so it may be handing
        out the old row at this very moment; rewriting it would let that row's ack delete the
        newer message. Deleted instead, the old row's ack deletes nothing and the newer one
        stays. Ids still follow created_at, so the oldest pending row is the lowest id. Every
        replaced row counts as overwritten."""
        keep = free[0]
        old_id, _, old_kind, old_size, old_send, _ = keep
        same = old_kind == kind
        add_n = (0 if same else 1) - sum(1 for o in free[1:] if o[2] == kind)
        add_b = (size - old_size if same else size) - sum(o[3] for o in free[1:] if o[2] == kind)
        self._room(kind, pol, add_n, add_b, [r[0] for r in free])
        for other in free[1:]:
            self._delete_pending(other)
        send_at = old_send if delay_ms <= 0 else max(old_send, now + delay_ms)
        ins = self._ins.get(old_id)
        if ins is not None:  # not committed yet: nobody else can see it, edit it
            old = self._d(old_kind)
            old[0] -= 1
            old[1] -= old_size
            new = self._d(kind)
            new[0] += 1
            new[1] += size
            ins[_I_MSG] = m.msg_id
            ins[_I_KIND] = kind
            ins[_I_PAYLOAD] = payload
            ins[_I_CONFLICT] = m.conflict
            ins[_I_SEQ] = m.seq
            ins[_I_SEND] = send_at
            ins[_I_EXPIRES] = expires
            ins[_I_SIZE] = size
            self.counters["enqueued"] += 1
            self.counters["overwritten"] += 1
            rid = old_id
        else:
            self._delete_pending(keep)
            rid = self._insert(m, payload, kind, pol, size, now, send_at, expires, m.key)
        keep[:] = [rid, m.seq, kind, size, send_at, now]
        return rid

    def _insert(
        self,
        m: OutboxMessage,
        payload: bytes,
        kind: str,
        pol: ClassPolicy,
        size: int,
        created: int,
        send_at: int,
        expires: int | None,
        key: str | None,
    ) -> int:
        rid = self.next_id
        self.next_id = rid + 1
        receiver = m.receiver
        self._ins[rid] = [
            rid, m.msg_id, m.owner, receiver, kind, payload, key, m.conflict, m.seq,
            created, send_at, expires, size, fnv1a_32(receiver), 1 if pol.fifo else 0,
        ]
        d = self.depth.get(kind)
        if d is None:
            d = self.depth[kind] = [0, 0, 0]
        d[0] += 1
        d[1] += size
        self.counters["enqueued"] += 1
        return rid

    def _delete_pending(self, r: Sequence[Any]) -> None:
        """Remove a pending row replaced by an overwrite (counted as overwritten).
        `r` is (id, seq, kind, size, ...)."""
        rid = r[0]
        if self._ins.pop(rid, None) is None:
            self._del.append((rid,))
        d = self._d(r[2])
        d[0] -= 1
        d[1] -= r[3]
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


__all__ = ["DEFAULT_CLASS", "ClassPolicy", "Engine", "FullPolicy"]
