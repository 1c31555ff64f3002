"""The read side: what the relay polls (`Reader.take_ready`, `next_due_ms`, on the event loop's
thread with a connection of its own), the in-flight bookkeeping shared with the writer
(`Flight`). Inspection reads are the engine's (`Engine.stats`, on the writer thread). Polls are plain reads
outside any transaction; expired rows met on the way are deleted by the writer.

Rows are built positionally (`build_row`): the relay builds one per message.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from agent.outbox.types import OutboxRow

KeyIdent = tuple[str, str, str]  # (owner, receiver, key) of an OVERWRITE row


def build_row(r: Sequence[Any]) -> OutboxRow:
    """An OutboxRow from a row of the ready scan or of `ROW_COLUMNS` (same leading order)."""
    return OutboxRow(
        r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12], r[13]
    )


ROW_COLUMNS = (
    "id, msg_id, owner, receiver, kind, payload, key, conflict, seq, created_at, send_at,"
    " expires_at, attempts, last_error"
)
FIFO_HEAD = (
    "SELECT id FROM outbox INDEXED BY outbox_fifo"
    " WHERE receiver = ? AND status = 'pending' AND fifo = 1 ORDER BY id LIMIT 1"
)


def ready_sql(partitions: int, kinds: Sequence[str] | None, *, after: bool = False) -> str:
    """The ready scan (parameters: now, [after_send_at, after_id], [partitions, partition],
    [*kinds]); `after` resumes past a (send_at, id) position."""
    sql = (
        "SELECT id, msg_id, owner, receiver, kind, payload, key, conflict, seq, created_at,"
        " send_at, expires_at, attempts, last_error, fifo, size"
        " FROM outbox INDEXED BY outbox_ready WHERE status = 'pending' AND send_at <= ?"
    )
    if after:
        sql += " AND (send_at, id) > (?, ?)"
    if partitions > 1:
        sql += " AND rhash % ? = ?"
    if kinds is not None:
        sql += f" AND kind IN ({', '.join('?' * len(kinds))})"
    return sql + " ORDER BY send_at, id"


class Flight:
    """Rows handed to the relay and not yet acked, nacked or released, in memory only.

    Shared by the loop thread (the Reader marks rows it hands out) and the writer thread
    (ack/nack/release settle them). The lock guards the compound updates and is never held
    across a SQLite call.

    `gen` lets a Reader resume a scan where its previous take of a partition stopped (see
    `Reader.take_ready`): it moves whenever a committed change may have put a takeable row
    before such a resume point (a row nacked, released or replayed, rolled back, or inserted
    with a send_at below `high`, the latest `now` any reader scanned up to). Acks and plain
    appends (send_at >= now, ids only grow) leave it alone.

    `freed` tells the store a settle may have made a row takeable that the relay could not
    take before: a row back to pending (`moved`), the last in-flight row of a FIFO receiver
    gone (its next row becomes the head), or the in-flight row of an OVERWRITE key with a
    newer row waiting gone. An ack of any other row frees nothing, so it wakes nobody."""

    def __init__(self) -> None:
        # id -> receiver, kind, size, fifo, and (owner, receiver, key) of an OVERWRITE row
        self.rows: dict[int, tuple[str, str, int, bool, KeyIdent | None]] = {}
        self.fifo_busy: dict[str, int] = {}  # FIFO receiver -> rows of it in flight
        self.keys_busy: dict[KeyIdent, int] = {}  # OVERWRITE key -> rows of it in flight
        self.key_row: dict[KeyIdent, int] = {}  # OVERWRITE key -> its latest row taken
        # Rows acked by the relay whose deleting commit is deferred (see OutboxStore.ack):
        # still in flight (never handed out again) until that commit.
        self.acked: set[int] = set()
        # OVERWRITE keys with a newer row waiting for the one in flight: its ack is not deferred
        self.waiting: set[KeyIdent] = set()
        self.lock = threading.Lock()
        self.gen = 0
        self.freed = False
        self.high = -(1 << 62)

    def add(self, taken: Sequence[Sequence[Any]]) -> None:
        """Mark rows of the ready scan (see `ready_sql` for the columns) in flight."""
        with self.lock:
            rows, busy, keys = self.rows, self.fifo_busy, self.keys_busy
            for r in taken:
                fifo = r[14] == 1
                ident = (r[2], r[3], r[6]) if r[7] == "overwrite" else None
                rows[r[0]] = (r[3], r[4], r[15], fifo, ident)
                if fifo:
                    busy[r[3]] = busy.get(r[3], 0) + 1
                if ident is not None:
                    keys[ident] = keys.get(ident, 0) + 1
                    self.key_row[ident] = r[0]

    def settle(self, ids: Iterable[int], *, moved: bool = True, low_send: int | None = None) -> None:
        """`ids` leave the in-flight set. `moved`: they (or other rows) are takeable again at
        a position a resumed scan may already have passed; `low_send`: the lowest send_at of
        rows just inserted. Called after the commit that made the change."""
        with self.lock:
            if moved or (low_send is not None and low_send < self.high):
                self.gen += 1
            if moved:
                self.freed = True
            rows, busy, keys = self.rows, self.fifo_busy, self.keys_busy
            acked = self.acked
            for rid in ids:
                f = rows.pop(rid, None)
                if f is None:
                    continue
                if acked:
                    acked.discard(rid)
                if f[3]:
                    n = busy[f[0]] - 1
                    if n:
                        busy[f[0]] = n
                    else:
                        del busy[f[0]]
                        self.freed = True
                ident = f[4]
                if ident is not None:
                    n = keys[ident] - 1
                    if n:
                        keys[ident] = n
                    else:
                        del keys[ident]
                        self.key_row.pop(ident, None)
                        if ident in self.waiting:
                            self.waiting.discard(ident)
                            self.freed = True

    def defer_acks(self, ids: Sequence[int]) -> bool:
        """Mark `ids` acked, their commit deferred; False (nothing marked) unless every one
        is an OVERWRITE row in flight, of no FIFO class, with no newer row of its key waiting
        for it (a row not in flight could be handed out meanwhile; a waiting row or a FIFO
        receiver's next row waits for the commit)."""
        with self.lock:
            rows, waiting = self.rows, self.waiting
            for rid in ids:
                f = rows.get(rid)
                if f is None or f[3] or f[4] is None or (waiting and f[4] in waiting):
                    return False
            self.acked.update(ids)
            return True

    def wait_behind(self, ident: KeyIdent) -> None:
        """A newer row of this OVERWRITE key waits for the one in flight."""
        with self.lock:
            if ident in self.keys_busy:
                self.waiting.add(ident)

    def pop_freed(self) -> bool:
        """Whether a settle freed a row (see `freed`) since the last call."""
        with self.lock:
            freed, self.freed = self.freed, False
            return freed

    def blocked_by_acked(self, idents: Iterable[KeyIdent]) -> tuple[bool, bool]:
        """Note that these OVERWRITE keys have a row waiting. Returns (one of them waits only
        for a row whose ack is deferred, one of them is no longer in flight at all: its row
        was settled while the scan ran, before it could be noted as waiting)."""
        with self.lock:
            acked, key_row, busy = self.acked, self.key_row, self.keys_busy
            gone = False
            for i in idents:
                if i in busy:
                    self.waiting.add(i)
                else:
                    gone = True
            return bool(acked) and any(key_row.get(i) in acked for i in idents), gone

    def keyed(self, ids: Iterable[int]) -> bool:
        """True if any of `ids` is an OVERWRITE row in flight (releasing it may coalesce)."""
        with self.lock:
            rows = self.rows
            return any((f := rows.get(rid)) is not None and f[4] is not None for rid in ids)

    def snapshot(
        self, now_ms: int | None = None
    ) -> tuple[set[int], set[str], set[KeyIdent], int]:
        """The rows, FIFO receivers and OVERWRITE keys in flight now, and `gen`. A reader takes this BEFORE its
        query: the query's snapshot of the database is then at least as new, so a row settled
        by the writer while the query runs (acked, nacked) is skipped rather than handed out
        again with the state it had before that commit. `now_ms`: the reader scans rows due by
        then (raises `high`)."""
        with self.lock:
            if now_ms is not None and now_ms > self.high:
                self.high = now_ms
            return set(self.rows), set(self.fifo_busy), set(self.keys_busy), self.gen


class Reader:
    """The relay's polls, on a read-only connection of their own, run on the event loop's
    thread: a WAL reader sees the last committed state, never waits for the writer and never
    syncs, so a poll costs no thread hop and no write lock."""

    def __init__(self, conn: sqlite3.Connection, flight: Flight) -> None:
        self.conn = conn
        self.flight = flight
        # Set by a take that skipped a row waiting only for a deferred ack (the store clears it)
        self.unblock = False
        # Set by a take that skipped a row whose blocker was settled during the scan: the
        # settle could not know of it, so the store wakes the relay itself (and clears it)
        self.retake = False
        # (partition, partitions) -> (Flight.gen, send_at, id): where the next take resumes
        self._cursors: dict[tuple[int, int], tuple[int, int, int]] = {}

    def _fifo_head(self, receiver: str) -> int | None:
        row = self.conn.execute(FIFO_HEAD, (receiver,)).fetchone()
        return row[0] if row else None

    def take_ready(
        self,
        now_ms: int,
        limit: int,
        partition: int = 0,
        partitions: int = 1,
        kinds: Sequence[str] | None = None,
    ) -> tuple[list[OutboxRow], list[int]]:
        """Due rows, marked in flight, and the ids of expired rows met on the way (never
        handed out; the caller has the writer delete and count them).

        A take of all classes remembers, per partition, the position (send_at, id) up to which
        every row it met was in flight or handed out; while `Flight.gen` stays put, the next
        take of that partition starts there instead of reading past those rows again (they
        only leave by an ack, which deletes them). A resumed take that comes back short
        forgets the position, so the next take reads from the start."""
        if partitions < 1 or not 0 <= partition < partitions:
            raise ValueError(f"partition {partition} out of range for {partitions} partitions")
        if limit <= 0 or (kinds is not None and not kinds):
            return [], []
        inflight, fifo_busy, keys_busy, gen = self.flight.snapshot(now_ms)
        key = (partition, partitions)
        cursor = self._cursors.pop(key, None) if kinds is None else None
        args: list[object] = [now_ms]
        if cursor is not None and cursor[0] == gen:
            args += [cursor[1], cursor[2]]
        else:
            cursor = None
        if partitions > 1:
            args += [partitions, partition]
        if kinds is not None:
            args.extend(kinds)
        expired: list[int] = []
        picked: set[str] = set()  # FIFO receivers given a row in this call
        picked_keys: set[KeyIdent] = set()  # OVERWRITE keys given a row in this call
        heads: dict[str, int | None] = {}  # FIFO receiver -> id of its oldest pending row
        took: list[Any] = []  # scan rows handed out
        behind: list[KeyIdent] = []  # OVERWRITE keys whose row waited for one in flight
        resume = True  # every row so far was in flight or taken: the position may move on
        last: Any = None  # the last such row
        sql = ready_sql(partitions, kinds, after=cursor is not None)
        for r in self.conn.execute(sql, args):
            rid = r[0]
            if rid in inflight:
                if resume:
                    last = r
                continue
            exp = r[11]
            if exp is not None and now_ms >= exp:
                expired.append(rid)
                resume = False
                continue
            if r[14] == 1:  # FIFO class
                receiver = r[3]
                if receiver in fifo_busy or receiver in picked:
                    resume = False
                    continue
                if receiver not in heads:
                    heads[receiver] = self._fifo_head(receiver)
                if heads[receiver] != rid:
                    resume = False
                    continue
                picked.add(receiver)
            if r[7] == "overwrite":  # one row of a key in flight at a time: the newer waits
                ident = (r[2], r[3], r[6])
                if ident in keys_busy or ident in picked_keys:
                    if ident in keys_busy:
                        behind.append(ident)
                    resume = False
                    continue
                picked_keys.add(ident)
            took.append(r)
            if resume:
                last = r
            if len(took) >= limit:
                break
        if took:
            self.flight.add(took)
        if behind:
            deferred, gone = self.flight.blocked_by_acked(behind)
            if deferred:
                self.unblock = True  # the store commits its deferred acks now
            if gone:
                self.retake = True
        if kinds is None and (cursor is None or len(took) >= limit):
            if last is not None:
                self._cursors[key] = (gen, last[10], last[0])
            elif cursor is not None:
                self._cursors[key] = cursor
        return [build_row(r) for r in took], expired

    def next_due_ms(self) -> int | None:
        """Earliest send_at of a pending row that take_ready could hand out (not in flight,
        not behind its FIFO receiver's head, not waiting behind its OVERWRITE key in flight)."""
        inflight, fifo_busy, keys_busy, _ = self.flight.snapshot()
        heads: dict[str, int | None] = {}
        for rid, send_at, receiver, fifo, owner, key, conflict in self.conn.execute(
            "SELECT id, send_at, receiver, fifo, owner, key, conflict"
            " FROM outbox INDEXED BY outbox_ready WHERE status = 'pending' ORDER BY send_at, id"
        ):
            if rid in inflight:
                continue
            if keys_busy and conflict == "overwrite" and (owner, receiver, key) in keys_busy:
                continue
            if fifo:
                if receiver in fifo_busy:
                    continue
                if receiver not in heads:
                    heads[receiver] = self._fifo_head(receiver)
                if heads[receiver] != rid:
                    continue
            return int(send_at)
        return None


class FileReads:
    """Counts read from an outbox file on a read-only connection of the caller's own: no await
    and nothing queued behind the writer, so a display that calls them never reorders the run
    it shows (the simulator's progress)."""

    def __init__(self, path: Path) -> None:
        self._conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)

    def pending(self) -> int:
        """Rows pending, every class."""
        return int(self._conn.execute("SELECT COALESCE(SUM(pending), 0) FROM outbox_classes").fetchone()[0])

    def owners_pending(self, kind: str) -> set[str]:
        """The owners with a row of `kind` pending."""
        return {str(owner) for (owner,) in self._conn.execute(
            "SELECT DISTINCT owner FROM outbox WHERE kind = ? AND status = 'pending'", (kind,))}

    def close(self) -> None:
        self._conn.close()


__all__ = [
    "FileReads",
    "FIFO_HEAD",
    "ROW_COLUMNS",
    "Flight",
    "KeyIdent",
    "Reader",
    "build_row",
    "ready_sql",
]
