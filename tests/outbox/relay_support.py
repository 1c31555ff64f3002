"""An in-memory OutboxReader with the store's counting rules, for relay tests that want to
script the store's behaviour exactly (the real SQLite store is used by the scenario tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from msgspec.structs import replace

from agent.core.clock import Clock
from agent.core.errors import StoreClosed
from agent.outbox.partition import fnv1a_32
from agent.outbox.types import ClassStats, EnqueueResult, OutboxMessage, OutboxRow, OutboxStats


@dataclass
class _Rec:
    row: OutboxRow
    status: str = "pending"


class MemoryOutbox:
    def __init__(self, clock: Clock, *, max_attempts: int = 20, fifo: Sequence[str] = ()) -> None:
        self.clock = clock
        self.max_attempts = max_attempts
        self.fifo = set(fifo)
        self.recs: dict[int, _Rec] = {}
        self.in_flight: set[int] = set()
        self.next_id = 1
        self.write_txns = 0
        self.reads = 0
        self.enqueued = self.delivered = self.dead_lettered = self.expired = 0
        self.dropped = self.overwritten = self.replayed = 0
        self.nack_outcomes: list[str] = []
        self.closed = False
        self._change = asyncio.Event()

    def _changed(self) -> None:
        self._change.set()
        self._change = asyncio.Event()

    def _check(self) -> None:
        if self.closed:
            raise StoreClosed("closed")

    async def enqueue(self, msg: OutboxMessage, *, delay_ms: int = 0) -> EnqueueResult:
        self._check()
        now = self.clock.now_ms()
        self.write_txns += 1
        self.enqueued += 1
        row_id = self.next_id
        self.next_id += 1
        ttl = msg.ttl_ms or 0
        self.recs[row_id] = _Rec(
            OutboxRow(
                row_id=row_id,
                msg_id=msg.msg_id,
                owner=msg.owner,
                receiver=msg.receiver,
                kind=msg.kind,
                payload=msg.payload,
                key=msg.key,
                conflict=msg.conflict,
                seq=msg.seq,
                created_at_ms=now,
                send_at_ms=now + delay_ms,
                expires_at_ms=now + ttl if ttl else None,
                attempts=0,
            )
        )
        self._changed()
        return EnqueueResult("stored", row_id)

    async def take_ready(
        self,
        *,
        limit: int,
        partition: int = 0,
        partitions: int = 1,
        kinds: Sequence[str] | None = None,
    ) -> list[OutboxRow]:
        self._check()
        self.reads += 1
        now = self.clock.now_ms()
        out: list[OutboxRow] = []
        busy = {self.recs[i].row.receiver for i in self.in_flight if self.recs[i].row.kind in self.fifo}
        for row_id in sorted(self.recs):
            rec = self.recs[row_id]
            row = rec.row
            if rec.status != "pending" or row_id in self.in_flight or row.send_at_ms > now:
                continue
            if fnv1a_32(row.receiver) % partitions != partition:
                continue
            if kinds is not None and row.kind not in kinds:
                continue
            if row.expires_at_ms is not None and row.expires_at_ms <= now:
                continue
            if row.kind in self.fifo:
                if row.receiver in busy:
                    continue
                busy.add(row.receiver)
            self.in_flight.add(row_id)
            out.append(row)
            if len(out) >= limit:
                break
        return out

    async def ack(self, row_ids: Sequence[int]) -> None:
        self._check()
        self.write_txns += 1
        for row_id in row_ids:
            self.in_flight.discard(row_id)
            rec = self.recs[row_id]
            if rec.status == "pending":
                rec.status = "done"
                self.delivered += 1
        self._changed()

    async def nack(self, row_id: int, *, delay_ms: int, error: str, outcome: str = "transient") -> bool:
        self._check()
        self.write_txns += 1
        self.in_flight.discard(row_id)
        rec = self.recs[row_id]
        self.nack_outcomes.append(outcome)
        attempts = rec.row.attempts + (0 if outcome == "capacity" else 1)
        rec.row = replace(
            rec.row,
            attempts=attempts,
            send_at_ms=self.clock.now_ms() + delay_ms,
            last_error=error,
        )
        dead = attempts >= self.max_attempts
        if dead:
            rec.status = "dead"
            self.dead_lettered += 1
        self._changed()
        return dead

    async def release(self, row_ids: Sequence[int]) -> None:
        self._check()
        for row_id in row_ids:
            self.in_flight.discard(row_id)
        self._changed()

    async def dead_letter(self, row_id: int, *, error: str) -> None:
        self._check()
        self.write_txns += 1
        self.in_flight.discard(row_id)
        rec = self.recs[row_id]
        rec.row = replace(rec.row, last_error=error, attempts=rec.row.attempts + 1)
        rec.status = "dead"
        self.dead_lettered += 1
        self._changed()

    async def next_due_ms(self) -> int | None:
        self._check()
        self.reads += 1
        due = [
            r.row.send_at_ms
            for i, r in self.recs.items()
            if r.status == "pending" and i not in self.in_flight
        ]
        return min(due) if due else None

    async def wait_for_change(self) -> None:
        self._check()
        await self._change.wait()

    async def replay(self, row_ids: Sequence[int] | None = None) -> int:
        n = 0
        for row_id, rec in self.recs.items():
            if rec.status == "dead" and (row_ids is None or row_id in row_ids):
                rec.status = "pending"
                rec.row = replace(rec.row, attempts=0, send_at_ms=self.clock.now_ms())
                n += 1
        self.replayed += n
        self.write_txns += 1
        self._changed()
        return n

    async def stats(self) -> OutboxStats:
        pending = sum(1 for r in self.recs.values() if r.status == "pending")
        dead = sum(1 for r in self.recs.values() if r.status == "dead")
        by_class: dict[str, ClassStats] = {}
        for kind in {r.row.kind for r in self.recs.values()}:
            by_class[kind] = ClassStats(
                pending=sum(
                    1 for r in self.recs.values() if r.row.kind == kind and r.status == "pending"
                ),
                in_flight=sum(1 for i in self.in_flight if self.recs[i].row.kind == kind),
                dead=sum(
                    1 for r in self.recs.values() if r.row.kind == kind and r.status == "dead"
                ),
            )
        return OutboxStats(
            enqueued=self.enqueued,
            delivered=self.delivered,
            dead_lettered=self.dead_lettered,
            expired=self.expired,
            dropped=self.dropped,
            overwritten=self.overwritten,
            pending=pending,
            in_flight=len(self.in_flight),
            dead=dead,
            replayed=self.replayed,
            duplicates=0,
            rejected_full=0,
            oldest_pending_age_ms=None,
            by_class=by_class,
        )

    async def close(self) -> None:
        self.closed = True
        self._change.set()


def message(
    msg_id: str,
    *,
    receiver: str = "leader",
    kind: str = "k",
    owner: str = "dev",
    payload: bytes = b"x" * 16,
    key: str | None = None,
    conflict: str = "append",
    seq: int = 0,
    ttl_ms: int | None = None,
) -> OutboxMessage:
    return OutboxMessage(
        msg_id=msg_id,
        owner=owner,
        receiver=receiver,
        kind=kind,
        payload=payload,
        key=key,
        conflict=conflict,  # type: ignore[arg-type]
        seq=seq,
        ttl_ms=ttl_ms,
    )
