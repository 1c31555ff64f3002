"""The outbox's books: one connection, the in-memory state that must agree with it, and the open
transaction's deferred work. `Engine` (enqueue, inspection reads) and `Settlement` (what happens
to rows after they were handed out) both write through one `Books`.

What the books hold:

* which rows are in flight (handed to the relay, not yet acked/nacked/released): a `Flight`
  shared with the loop thread's `Reader`; rows leave it only after the commit that settles
  them, so a poll never hands a row out again with its state from before that commit;
* the counters and the per-class depths, mirrored from the tally table and written back with
  the deltas of each transaction in that same transaction;
* the next row id (ids are never reused, even after the top rows are gone);
* per transaction: inserts and deletes deferred to the end of a run of enqueues (one statement
  for many rows), and the pending rows of each OVERWRITE key looked at so far.

Writes run between `begin()` and `commit()`; the writer groups many operations into one
transaction (group commit).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import Any

from agent.outbox.reads import Flight, KeyIdent
from agent.outbox.schema import (
    C_DROPPED,
    C_ENQUEUED,
    C_OVERWRITTEN,
    CLASS_FIELDS,
    COUNTER_NAMES,
    NEXT_ID,
)

_INSERT_INTO = (
    "INSERT INTO outbox (id, msg_id, owner, receiver, kind, payload, key, conflict, seq,"
    " created_at, send_at, expires_at, size, rhash, fifo) VALUES "
)
_VALUES = "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
# Rows go in by multi-row INSERTs of these sizes (about a fifth cheaper per row than one
# statement per row). A few fixed sizes keep the statements in sqlite3's cache; 64 rows x 15
# values stays under the oldest variable limit (999).
_INSERT_SIZES = (64, 32, 16, 8, 4, 2, 1)
_INSERTS = {n: _INSERT_INTO + ", ".join([_VALUES] * n) for n in _INSERT_SIZES}
# Deferred insert row layout (a list, so an overwrite in the same batch edits it in place).
I_MSG, I_KIND, I_PAYLOAD, I_CONFLICT, I_SEQ = 1, 4, 5, 7, 8
I_SEND, I_EXPIRES, I_SIZE = 10, 11, 12

Mirrors = tuple[dict[str, int], dict[str, list[int]], int]  # counters, depths, next id


class Books:
    """The connection and everything kept beside it; driven by one thread at a time (the
    writer, or a CLI command). Only `flight` is shared with another thread."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        # Rows handed to the relay: shared with the loop thread's Reader.
        self.flight = Flight()
        self.inflight = self.flight.rows
        self.write_transactions = 0
        self.counters: dict[str, int] = {}
        self.depth: dict[str, list[int]] = {}  # kind -> its CLASS_FIELDS (depths, then flows)
        self.next_id = 1
        self.ins: dict[int, list[Any]] = {}  # deferred inserts, by id
        self.dels: list[tuple[int]] = []  # deferred deletes (rows replaced by an overwrite)
        # (owner, receiver, key) -> [[id, seq, kind, size, send_at, created_at], ...] of its
        # pending rows, valid for the current transaction (every deferred change of that key
        # goes through it)
        self.keys: dict[KeyIdent, list[list[Any]]] = {}
        self._data_version = -1
        self._snap: Mirrors | None = None
        self._settle: list[int] = []  # in-flight rows to settle after this commit
        # What this transaction did that a resumed ready scan must hear of (see Flight.gen):
        # a row made takeable again, and the lowest send_at inserted.
        self._moved = False
        self._low: int | None = None
        self.reload()

    # -- mirrors ---------------------------------------------------------------------------
    def reload(self) -> None:
        conn = self.conn
        tally = dict(conn.execute("SELECT name, value FROM outbox_tally").fetchall())
        self.counters = {name: int(tally.get(name, 0)) for name in COUNTER_NAMES}
        self.depth = {}
        for name, value in tally.items():
            field, colon, kind = name.partition(":")
            if colon and field in CLASS_FIELDS:
                self.d(kind)[CLASS_FIELDS.index(field)] = int(value)
        top = conn.execute("SELECT max(id) FROM outbox").fetchone()[0] or 0
        self.next_id = max(int(tally.get(NEXT_ID, 1)), top + 1)
        self._data_version = conn.execute("PRAGMA data_version").fetchone()[0]

    def check_external(self) -> None:
        """Another connection (the CLI) committed: reload the mirrors."""
        if self.conn.execute("PRAGMA data_version").fetchone()[0] != self._data_version:
            self.reload()
            self.flight.settle((), moved=True)  # committed already: rows may be back

    def d(self, kind: str) -> list[int]:
        """The CLASS_FIELDS of a message class: [pending, pending_bytes, dead, then its flows]
        (made on first use)."""
        d = self.depth.get(kind)
        if d is None:
            d = self.depth[kind] = [0] * len(CLASS_FIELDS)
        return d

    def snapshot(self) -> Mirrors:
        return dict(self.counters), {k: list(v) for k, v in self.depth.items()}, self.next_id

    def restore(self, snap: Mirrors) -> None:
        self.counters, self.depth, self.next_id = snap

    # -- transactions ----------------------------------------------------------------------
    @property
    def in_transaction(self) -> bool:
        return self._snap is not None

    def begin(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")
        # Holding the write lock now: nobody else can commit until we do.
        self.check_external()
        self._snap = self.snapshot()

    def commit(self) -> None:
        assert self._snap is not None
        self.flush()
        counters0, depth0, next0 = self._snap
        conn = self.conn
        # Deltas (another connection, the CLI, may have moved the totals meanwhile), all in
        # the one tally table: every counter and depth of a commit lands on the same page.
        deltas = [(k, v - counters0[k]) for k, v in self.counters.items() if v != counters0[k]]
        for kind, d in self.depth.items():
            d0 = depth0.get(kind)
            if d0 is None:
                deltas += [(f"{f}:{kind}", v) for f, v in zip(CLASS_FIELDS, d, strict=True) if v]
            elif d != d0:
                deltas += [(f"{f}:{kind}", v - v0) for f, v, v0 in zip(CLASS_FIELDS, d, d0, strict=True) if v != v0]
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
        self.keys.clear()
        self._settle_now()
        # (data_version does not move for this connection's own commits)

    def rollback(self) -> None:
        """Undo the open transaction, in the database and in memory. Never raises sqlite3."""
        self.discard_deferred()
        if self.conn.in_transaction:
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        if self._snap is not None:
            self.restore(self._snap)
            self._snap = None
        # The rows stay pending; the relay (told of the failure) gets them again.
        self._moved = True
        self._settle_now()

    def discard_deferred(self) -> None:
        """Forget the deferred inserts and deletes and the key cache (the caller rolls back)."""
        self.ins.clear()
        self.dels.clear()
        self.keys.clear()

    def flush(self) -> None:
        """Write the deferred inserts and deletes of this run of enqueues."""
        if self.ins:
            rows = list(self.ins.values())
            self.ins.clear()
            low = min(row[I_SEND] for row in rows)
            if self._low is None or low < self._low:
                self._low = low
            execute = self.conn.execute
            i, total = 0, len(rows)
            for n in _INSERT_SIZES:
                sql = _INSERTS[n]
                while total - i >= n:
                    execute(sql, list(chain.from_iterable(rows[i : i + n])))
                    i += n
        if self.dels:
            self.conn.executemany("DELETE FROM outbox WHERE id = ?", self.dels)
            self.dels.clear()

    def prepare_write(self) -> None:
        """Before a settling write: deferred rows go in, and the key cache (which such a
        write can make wrong) is dropped."""
        self.flush()
        self.keys.clear()

    # -- the in-flight set -----------------------------------------------------------------
    def settle_flight(self, ids: Iterable[int], *, moved: bool = True) -> None:
        """Rows the relay is done with leave the in-flight set once this transaction has
        committed (or rolled back): until then the loop thread's reader still sees their old
        state, and must not hand them out again."""
        if self._snap is None:
            self.flight.settle(ids, moved=moved)
        else:
            self._settle.extend(ids)
            if moved:
                self._moved = True

    def mark_moved(self) -> None:
        """This transaction made rows takeable again (a resumed ready scan must start over)."""
        self._moved = True

    def _settle_now(self) -> None:
        if self._settle or self._moved or self._low is not None:
            self.flight.settle(self._settle, moved=self._moved, low_send=self._low)
            self._settle.clear()
            self._moved = False
            self._low = None

    # -- rows ------------------------------------------------------------------------------
    def delete_pending(self, r: Sequence[Any]) -> None:
        """Remove a pending row replaced by a newer one of its key (counted as overwritten).
        `r` is (id, seq, kind, size, ...)."""
        rid = r[0]
        if self.ins.pop(rid, None) is None:
            self.dels.append((rid,))
        d = self.d(r[2])
        d[0] -= 1
        d[1] -= r[3]
        d[C_OVERWRITTEN] += 1
        self.counters["overwritten"] += 1

    def count_enqueued(self, kind: str, *, dropped: bool = False) -> None:
        """A message entered `kind` (and, `dropped`, was dropped at once: a stale overwrite)."""
        d = self.d(kind)
        d[C_ENQUEUED] += 1
        self.counters["enqueued"] += 1
        if dropped:
            d[C_DROPPED] += 1
            self.counters["dropped"] += 1


__all__ = ["I_CONFLICT", "I_EXPIRES", "I_KIND", "I_MSG", "I_PAYLOAD", "I_SEQ", "I_SEND", "I_SIZE", "Books",
           "Mirrors"]
