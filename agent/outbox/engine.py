"""The outbox's SQL work, synchronous, run by one thread at a time (the writer thread).

`Engine` is what the store's writer runs: it takes messages in (`enqueue`: APPEND and OVERWRITE
by key, class caps with their full policies, deferred bulk inserts) and answers inspection reads
(`stats`, `list_dead`, `get`); `settle` (a `Settlement`) takes the relay's answers and the dead
letters' lifecycle. Both write through one `Books` (`books`): the connection, the in-flight set
shared with the loop thread's reader, the counter and depth mirrors and the open transaction's
deferred work (`agent.outbox.books`).

Write operations run between `books.begin()` and `books.commit()`; the writer groups many of
them into one transaction (group commit). Enqueued rows are written in bulk at the end of a run
of enqueues, so a batch of messages costs one statement, not one per message.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from agent.core.errors import OutboxFull
from agent.outbox.books import I_CONFLICT, I_EXPIRES, I_KIND, I_MSG, I_PAYLOAD, I_SEND, I_SEQ, I_SIZE, Books
from agent.outbox.partition import fnv1a_32
from agent.outbox.policy import DEFAULT_CLASS, ClassPolicy, FullPolicy
from agent.outbox.reads import ROW_COLUMNS, build_row
from agent.outbox.schema import C_DROPPED, C_ENQUEUED, C_OVERWRITTEN, class_stats
from agent.outbox.settle import Settlement
from agent.outbox.types import EnqueueResult, OutboxMessage, OutboxRow, OutboxStats

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
class Engine:
    """Synchronous outbox operations on one connection, driven by one thread (the writer, or
    a CLI command)."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        *,
        max_attempts: int = 20,
        classes: Mapping[str, ClassPolicy] | None = None,
        default_class: ClassPolicy = DEFAULT_CLASS,
    ) -> None:
        self.books = Books(conn)
        self.settle = Settlement(self.books, max_attempts=max_attempts)
        self.classes = dict(classes or {})
        self.default_class = default_class

    def set_max_pages(self, pages: int) -> int:
        """Cap the database file at `pages` pages (`OutboxStore.open(max_db_bytes=...)`)."""
        return int(self.books.conn.execute(f"PRAGMA max_page_count = {int(pages)}").fetchone()[0])

    # -- inspection reads ------------------------------------------------------------------
    def stats(self, now_ms: int) -> OutboxStats:
        b = self.books
        b.check_external()
        c = b.counters
        row = b.conn.execute(
            "SELECT created_at FROM outbox WHERE status = 'pending' ORDER BY id LIMIT 1"
        ).fetchone()
        flying: dict[str, int] = {}
        for _, kind, _, _, _ in b.inflight.values():
            flying[kind] = flying.get(kind, 0) + 1
        by_class = {
            kind: class_stats(d, in_flight=flying.get(kind, 0)) for kind, d in sorted(b.depth.items()) if any(d)
        }
        return OutboxStats(
            enqueued=c["enqueued"],
            delivered=c["delivered"],
            dead_lettered=c["dead_lettered"],
            expired=c["expired"],
            dropped=c["dropped"],
            overwritten=c["overwritten"],
            pending=sum(d[0] for d in b.depth.values()),
            in_flight=len(b.inflight),
            dead=sum(d[2] for d in b.depth.values()),
            replayed=c["replayed"],
            duplicates=c["duplicates"],
            rejected_full=c["rejected_full"],
            oldest_pending_age_ms=None if row is None else max(0, now_ms - row[0]),
            by_class=by_class,
        )

    def list_dead(self, limit: int, offset: int) -> list[OutboxRow]:
        return [
            build_row(r)
            for r in self.books.conn.execute(
                f"SELECT {ROW_COLUMNS} FROM outbox WHERE status = 'dead'"
                " ORDER BY id LIMIT ? OFFSET ?",
                (max(0, limit), max(0, offset)),
            )
        ]

    def get(self, rid: int) -> OutboxRow | None:
        r = self.books.conn.execute(f"SELECT {ROW_COLUMNS} FROM outbox WHERE id = ?", (rid,)).fetchone()
        return None if r is None else build_row(r)

    # -- enqueue ---------------------------------------------------------------------------
    def enqueue(
        self, msgs: Sequence[OutboxMessage], now_ms: int, delay_ms: int = 0
    ) -> list[EnqueueResult]:
        """Store `msgs` in order. One message: raises OutboxFull/ValueError before changing
        anything. Several: all or nothing (a savepoint)."""
        if len(msgs) == 1:
            return [self._enqueue_one(msgs[0], now_ms, delay_ms)]
        b = self.books
        b.flush()
        b.conn.execute("SAVEPOINT enqueue_many")
        assert b.in_transaction
        snap = b.snapshot()
        try:
            self._prefetch_keys(msgs)
            out = [self._enqueue_one(m, now_ms, delay_ms) for m in msgs]
            b.flush()
        except (OutboxFull, ValueError) as exc:
            b.discard_deferred()
            b.conn.execute("ROLLBACK TO enqueue_many")
            b.conn.execute("RELEASE enqueue_many")
            b.restore(snap)
            if isinstance(exc, OutboxFull):
                b.counters["rejected_full"] += 1
            raise
        b.conn.execute("RELEASE enqueue_many")
        return out

    def _prefetch_keys(self, msgs: Sequence[OutboxMessage]) -> None:
        """Look up the pending rows of every key of a large batch in one query (instead of
        one per message) and fill the key cache with them."""
        cache = self.books.keys
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
        self.books.flush()  # (nothing deferred touches these keys: they are not in the cache)
        for ident in wanted:
            cache[ident] = []
        for start in range(0, len(wanted), _PREFETCH_CHUNK):
            chunk = wanted[start : start + _PREFETCH_CHUNK]
            for idx, *row in self.books.conn.execute(_KEYS_LOOKUP, (json.dumps(chunk),)):
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
            d = self.books.depth.get(kind)
            if d is None or d[0] >= pol.max_messages or d[1] + size > pol.max_bytes:
                self._room(kind, pol, 1, size, ())
            rid = self._insert(m, payload, kind, pol, size, now, now + delay_ms, expires, None)
            return EnqueueResult("stored", rid)
        ident = (m.owner, m.receiver, key)
        rows = self.books.keys.get(ident)
        if rows is None:
            # Deferred rows of this batch are all in the cache, so the database is exact here.
            rows = [list(r) for r in self.books.conn.execute(_KEY_LOOKUP, ident)]
            self.books.keys[ident] = rows
        if conflict == "append":
            if rows:
                self.books.counters["duplicates"] += 1
                return EnqueueResult("duplicate", rows[0][0])
        elif rows:
            if m.seq <= max(r[1] for r in rows):
                self.books.count_enqueued(kind, dropped=True)
                return EnqueueResult("stale", rows[-1][0])
            inflight = self.books.inflight
            free = [r for r in rows if r[0] not in inflight]
            if free:
                rid = self._overwrite(m, payload, kind, pol, size, now, delay_ms, expires, free)
                rows[:] = [r for r in rows if r[0] in inflight] + [free[0]]
                return EnqueueResult("overwritten", rid)
            # every pending row of this key is in flight: the newer one waits behind them
            self.books.flight.wait_behind(ident)
        self._room(kind, pol, 1, size, ())
        send_at = now + delay_ms
        rid = self._insert(m, payload, kind, pol, size, now, send_at, expires, key)
        rows.append([rid, m.seq, kind, size, send_at, now])
        return EnqueueResult("stored", rid)

    def supersede(self, owner: str, receiver: str, key: str, seq: int) -> int:
        """Delete the pending rows of an OVERWRITE key older than `seq` (a newer message of the
        key reached the receiver another way: they would arrive stale); counted overwritten.
        Rows in flight are left to their ack. Returns how many went."""
        ident = (owner, receiver, key)
        rows = self.books.keys.get(ident)
        if rows is None:
            rows = [list(r) for r in self.books.conn.execute(_KEY_LOOKUP, ident)]
            self.books.keys[ident] = rows
        inflight = self.books.inflight
        gone = [r for r in rows if r[1] < seq and r[0] not in inflight]
        if not gone:
            return 0
        for r in gone:
            self.books.delete_pending(r)
        rows[:] = [r for r in rows if r not in gone]
        self.books.flush()
        return len(gone)

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
            self.books.delete_pending(other)
        send_at = old_send if delay_ms <= 0 else max(old_send, now + delay_ms)
        ins = self.books.ins.get(old_id)
        if ins is not None:  # not committed yet: nobody else can see it, edit it
            old = self.books.d(old_kind)
            old[0] -= 1
            old[1] -= old_size
            new = self.books.d(kind)
            new[0] += 1
            new[1] += size
            ins[I_MSG] = m.msg_id
            ins[I_KIND] = kind
            ins[I_PAYLOAD] = payload
            ins[I_CONFLICT] = m.conflict
            ins[I_SEQ] = m.seq
            ins[I_SEND] = send_at
            ins[I_EXPIRES] = expires
            ins[I_SIZE] = size
            self.books.count_enqueued(kind)
            old[C_OVERWRITTEN] += 1
            self.books.counters["overwritten"] += 1
            rid = old_id
        else:
            self.books.delete_pending(keep)
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
        rid = self.books.next_id
        self.books.next_id = rid + 1
        receiver = m.receiver
        self.books.ins[rid] = [
            rid, m.msg_id, m.owner, receiver, kind, payload, key, m.conflict, m.seq,
            created, send_at, expires, size, fnv1a_32(receiver), 1 if pol.fifo else 0,
        ]
        d = self.books.depth.get(kind) or self.books.d(kind)
        d[0] += 1
        d[1] += size
        d[C_ENQUEUED] += 1
        self.books.counters["enqueued"] += 1
        return rid

    def _room(
        self, kind: str, pol: ClassPolicy, add: int, add_bytes: int, keep: Sequence[int]
    ) -> None:
        """Make room for `add` rows and `add_bytes` in `kind`, or raise OutboxFull."""
        if add <= 0 and add_bytes <= 0:
            return
        d = self.books.depth.get(kind)
        count, nbytes = (d[0], d[1]) if d is not None else (0, 0)
        over_n = count + add - pol.max_messages
        over_b = nbytes + add_bytes - pol.max_bytes
        if over_n <= 0 and over_b <= 0:
            return
        if pol.full_policy == "reject" or add_bytes > pol.max_bytes or add > pol.max_messages:
            self.books.counters["rejected_full"] += 1
            raise OutboxFull(
                f"message class {kind!r} is full ({count} messages, {nbytes} bytes;"
                f" caps {pol.max_messages} / {pol.max_bytes})"
            )
        self.books.flush()
        victims: list[tuple[int, int, str, str, str | None]] = []
        freed_n = freed_b = 0
        for rid, size, owner, receiver, key in self.books.conn.execute(
            "SELECT id, size, owner, receiver, key FROM outbox"
            " WHERE status = 'pending' AND kind = ? ORDER BY id",
            (kind,),
        ):
            if rid in self.books.inflight or rid in keep:
                continue
            victims.append((rid, size, owner, receiver, key))
            freed_n += 1
            freed_b += size
            if freed_n >= over_n and freed_b >= over_b:
                break
        if freed_n < over_n or freed_b < over_b:
            self.books.counters["rejected_full"] += 1
            raise OutboxFull(f"message class {kind!r} is full and its rows are in flight")
        self.books.conn.executemany("DELETE FROM outbox WHERE id = ?", [(v[0],) for v in victims])
        d = self.books.d(kind)
        d[0] -= freed_n
        d[1] -= freed_b
        d[C_DROPPED] += freed_n
        self.books.counters["dropped"] += freed_n
        for rid, _, owner, receiver, key in victims:
            if key is not None:
                rows = self.books.keys.get((owner, receiver, key))
                if rows is not None:
                    rows[:] = [r for r in rows if r[0] != rid]


__all__ = ["DEFAULT_CLASS", "ClassPolicy", "Engine", "FullPolicy"]
