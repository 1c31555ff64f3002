"""What happens to rows after they were handed out (ack, nack, dead letter), and the dead
letters' lifecycle (replay, purge), plus TTL expiry. `Settlement` writes through the outbox's
`Books`, on the writer thread, inside the transaction the writer opened."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from agent.outbox.books import Books
from agent.outbox.schema import C_DEAD_LETTERED, C_DELIVERED, C_EXPIRED, C_REPLAYED

NackOutcome = Literal["transient", "capacity"]
NACK_OUTCOMES: tuple[NackOutcome, ...] = ("transient", "capacity")

_CHUNK = 500  # ids per IN (...) list, well under SQLite's variable limit


def _chunks(ids: Sequence[int]) -> Iterable[list[int]]:
    for i in range(0, len(ids), _CHUNK):
        yield [int(x) for x in ids[i : i + _CHUNK]]


def _marks(n: int) -> str:
    return "(" + ", ".join("?" * n) + ")"


class Settlement:
    """The relay's writes and the dead letters, on the outbox's books."""

    def __init__(self, books: Books, *, max_attempts: int) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self._books = books
        self.max_attempts = max_attempts

    # -- relay side: writes ----------------------------------------------------------------
    def ack(self, ids: Sequence[int]) -> int:
        """Delivered: delete the rows. Returns how many were still pending."""
        self._books.settle_flight(ids, moved=False)
        if not ids:
            return 0
        self._books.prepare_write()
        flying = self._books.inflight
        known: list[int] = []
        other: list[int] = []
        for rid in dict.fromkeys(ids):  # (a repeated id is acked once)
            (known if rid in flying else other).append(rid)
        n = self._delete_flying(known) if known else 0
        if other:
            n += self._delete_ids(other, "", (), flow=C_DELIVERED)
        self._books.counters["delivered"] += n
        return n

    def _delete_flying(self, ids: list[int]) -> int:
        """Delete rows the relay holds: their class and size are known from the in-flight set,
        so the DELETE returns nothing (RETURNING costs about a third of an ack). Should one of
        them no longer be pending (nacked to the dead letters in the same group), the chunk is
        undone and deleted again with RETURNING."""
        flying = self._books.inflight
        depth = self._books.depth
        conn = self._books.conn
        n = 0
        for chunk in _chunks(ids):
            conn.execute("SAVEPOINT ack")
            cur = conn.execute(
                f"DELETE FROM outbox WHERE id IN {_marks(len(chunk))} AND status = 'pending'",
                chunk,
            )
            if cur.rowcount != len(chunk):
                conn.execute("ROLLBACK TO ack")
                conn.execute("RELEASE ack")
                n += self._delete_ids(chunk, "", (), flow=C_DELIVERED)
                continue
            conn.execute("RELEASE ack")
            for rid in chunk:
                _, kind, size, _, _ = flying[rid]
                d = depth.get(kind) or self._books.d(kind)
                d[0] -= 1
                d[1] -= size
                d[C_DELIVERED] += 1
            n += len(chunk)
        return n

    def _delete_ids(self, ids: Sequence[int], cond: str, extra: tuple[object, ...], *, flow: int) -> int:
        """Delete the pending rows among `ids` (matching `cond`); adjusts depths and counts each
        row in its class's `flow` (a CLASS_FIELDS index: delivered, expired)."""
        n = 0
        depth = self._books.depth
        for chunk in _chunks(ids):
            gone = self._books.conn.execute(
                f"DELETE FROM outbox WHERE id IN {_marks(len(chunk))} AND status = 'pending'"
                f"{cond} RETURNING kind, size",
                (*chunk, *extra),
            ).fetchall()
            for kind, size in gone:
                d = depth.get(kind) or self._books.d(kind)
                d[0] -= 1
                d[1] -= size
                d[flow] += 1
            n += len(gone)
        return n

    def nack(
        self, rid: int, now_ms: int, delay_ms: int, error: str, outcome: NackOutcome = "transient"
    ) -> bool:
        """A failed try, due again after `delay_ms`. A `transient` failure spends an attempt
        (the row dies when attempts reach max_attempts); a `capacity` answer (the receiver is
        busy) does not: a receiver busy for hours must not dead-letter what it will take later.
        An OVERWRITE row with a newer row of its key waiting is coalesced instead of retried."""
        if outcome not in NACK_OUTCOMES:
            raise ValueError(f"outcome must be one of {NACK_OUTCOMES}, got {outcome!r}")
        self._books.settle_flight((rid,))
        self._books.prepare_write()
        spend = 1 if outcome == "transient" else 0
        row = self._books.conn.execute(
            "UPDATE outbox SET attempts = attempts + ?1, send_at = ?2, last_error = ?3,"
            " status = CASE WHEN ?1 AND attempts + 1 >= ?4 THEN 'dead' ELSE 'pending' END"
            " WHERE id = ?5 AND status = 'pending'"
            " RETURNING status, kind, size, owner, receiver, key, conflict, seq",
            (spend, now_ms + max(0, delay_ms), error, self.max_attempts, rid),
        ).fetchone()
        if row is None:
            return False
        if row[6] == "overwrite" and self._newer_waits(row[3], row[4], row[5], row[7]):
            # A newer message with this key waited behind the failed one: that one supersedes
            # it, so the failed one is not retried (counted as overwritten).
            self._coalesce(rid, row[1], row[2])
            return False
        if row[0] != "dead":
            return False
        self._to_dead(row[1], row[2])
        return True

    def _newer_waits(self, owner: str, receiver: str, key: str, seq: int) -> bool:
        return self._books.conn.execute(
            "SELECT 1 FROM outbox INDEXED BY outbox_key WHERE owner = ? AND receiver = ?"
            " AND key = ? AND status = 'pending' AND seq > ? LIMIT 1",
            (owner, receiver, key, seq),
        ).fetchone() is not None

    def _coalesce(self, rid: int, kind: str, size: int) -> None:
        """Delete a row superseded by a newer one of its key (counted overwritten). It still
        counts as pending in the depths (even if a nack just marked it dead)."""
        self._books.delete_pending((rid, 0, kind, size))
        self._books.flush()

    def _to_dead(self, kind: str, size: int) -> None:
        d = self._books.d(kind)
        d[0] -= 1
        d[1] -= size
        d[2] += 1
        d[C_DEAD_LETTERED] += 1
        self._books.counters["dead_lettered"] += 1

    def dead_letter(self, rid: int, error: str) -> bool:
        self._books.settle_flight((rid,))
        self._books.prepare_write()
        row = self._books.conn.execute(
            "UPDATE outbox SET status = 'dead', attempts = attempts + 1, last_error = ?"
            " WHERE id = ? AND status = 'pending' RETURNING kind, size",
            (error, rid),
        ).fetchone()
        if row is None:
            return False
        self._to_dead(row[0], row[1])
        return True

    def replay(self, ids: Sequence[int] | None, now_ms: int) -> int:
        self._books.prepare_write()
        self._books.mark_moved()
        sql = "UPDATE outbox SET status = 'pending', attempts = 0, send_at = ? WHERE status = 'dead'"
        back: list[tuple[str, int]] = []
        if ids is None:
            back = self._books.conn.execute(sql + " RETURNING kind, size", (now_ms,)).fetchall()
        else:
            for chunk in _chunks(ids):
                back += self._books.conn.execute(
                    f"{sql} AND id IN {_marks(len(chunk))} RETURNING kind, size", (now_ms, *chunk)
                ).fetchall()
        for kind, size in back:
            d = self._books.d(kind)
            d[0] += 1
            d[1] += size
            d[2] -= 1
            d[C_REPLAYED] += 1
        self._books.counters["replayed"] += len(back)
        return len(back)

    def purge(self, ids: Sequence[int] | None) -> int:
        self._books.prepare_write()
        sql = "DELETE FROM outbox WHERE status = 'dead'"
        gone: list[tuple[str]] = []
        if ids is None:
            gone = self._books.conn.execute(sql + " RETURNING kind").fetchall()
        else:
            for chunk in _chunks(ids):
                gone += self._books.conn.execute(
                    f"{sql} AND id IN {_marks(len(chunk))} RETURNING kind", chunk
                ).fetchall()
        for (kind,) in gone:
            self._books.d(kind)[2] -= 1
        self._books.counters["purged"] += len(gone)
        return len(gone)

    def expire(self, now_ms: int, ids: Sequence[int] | None = None) -> int:
        """Delete pending rows past their expires_at (not those in flight); counted."""
        self._books.prepare_write()
        if ids is None:
            found = self._books.conn.execute(
                "SELECT id FROM outbox INDEXED BY outbox_expiry"
                " WHERE status = 'pending' AND expires_at IS NOT NULL AND expires_at <= ?",
                (now_ms,),
            ).fetchall()
            ids = [r[0] for r in found if r[0] not in self._books.inflight]
        if not ids:
            return 0
        n = self._delete_ids(ids, " AND expires_at <= ?", (now_ms,), flow=C_EXPIRED)
        self._books.counters["expired"] += n
        return n

    def set_max_pages(self, pages: int) -> int:
        return int(self._books.conn.execute(f"PRAGMA max_page_count = {int(pages)}").fetchone()[0])

    def release(self, ids: Sequence[int]) -> None:
        """Rows handed back untried: no attempt spent. An OVERWRITE row with a newer row of
        its key waiting is coalesced (counted overwritten) rather than sent again, so a key
        never holds more than one row in flight and one pending."""
        keyed = [rid for rid in ids if (f := self._books.inflight.get(rid)) is not None and f[4]]
        self._books.settle_flight(ids)
        if not keyed or not self._books.in_transaction:  # (outside a transaction: nothing to write)
            return
        self._books.prepare_write()
        for chunk in _chunks(keyed):
            for rid, kind, size in self._books.conn.execute(
                f"SELECT o.id, o.kind, o.size FROM outbox AS o WHERE o.id IN {_marks(len(chunk))}"
                " AND o.status = 'pending' AND EXISTS (SELECT 1 FROM outbox AS n"
                " INDEXED BY outbox_key WHERE n.owner = o.owner AND n.receiver = o.receiver"
                " AND n.key = o.key AND n.status = 'pending' AND n.seq > o.seq)",
                chunk,
            ).fetchall():
                self._coalesce(rid, kind, size)


__all__ = ["NACK_OUTCOMES", "NackOutcome", "Settlement"]
