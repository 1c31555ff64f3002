"""The contract between the outbox store and the relay that drains it.

The store is durable (SQLite); the relay is the only reader of ready rows in its process. Which
rows are in flight is known to the store object (the relay hands them out and back), not written
to the database on every peek: an empty or busy poll takes no write lock. After a crash every
row that was in flight is simply pending again (at-least-once; the receiver deduplicates by id).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import msgspec

Conflict = Literal["append", "overwrite"]
Status = Literal["pending", "in_flight", "done", "dead", "expired"]
EnqueueOutcome = Literal["stored", "duplicate", "overwritten", "stale"]


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxMessage:
    """What a caller hands to `enqueue`. `msg_id` is the wire id (time-ordered, unique)."""

    msg_id: str
    owner: str  # the agent (device) that owns the row; many simulated devices share a file
    receiver: str
    kind: str  # message class: caps, limiter bulkheads and metrics are per class
    payload: bytes
    key: str | None = None  # idempotency key (append) or coalescing key (overwrite)
    conflict: Conflict = "append"
    seq: int = 0
    ttl_ms: int | None = None  # None: the class default; 0: never expires


class EnqueueResult(msgspec.Struct, frozen=True, gc=False):
    """`stored`: new row; `duplicate`: append with a key already pending for that receiver,
    `row_id` is the existing row; `overwritten`: replaced a pending row with a lower seq;
    `stale`: an overwrite whose seq was not higher than the pending one's, dropped.

    One per enqueue: a Struct (immutable, compared by value) builds about five times faster
    than a frozen dataclass, and holds no references that could form a cycle (gc=False)."""

    outcome: EnqueueOutcome
    row_id: int | None


class OutboxRow(msgspec.Struct, frozen=True, gc=False):
    """A row handed to the relay (one per delivery: a Struct, immutable and compared by value,
    builds about five times faster than a frozen dataclass; gc=False as its fields are plain
    values). Build it with keywords; the store builds it positionally in this field order."""

    row_id: int
    msg_id: str
    owner: str
    receiver: str
    kind: str
    payload: bytes
    key: str | None
    conflict: Conflict
    seq: int
    created_at_ms: int
    send_at_ms: int
    expires_at_ms: int | None
    attempts: int  # tries already made (0 before the first)
    last_error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassStats:
    """One message class: its depths now, and what entered and left it since the file was made
    (persisted), so the outbox's conservation law can be checked class by class."""

    pending: int = 0
    in_flight: int = 0
    dead: int = 0
    pending_bytes: int = 0
    enqueued: int = 0
    delivered: int = 0
    dead_lettered: int = 0
    expired: int = 0
    dropped: int = 0
    overwritten: int = 0
    replayed: int = 0

    @property
    def conservation_ok(self) -> bool:
        return self.enqueued == (
            self.delivered + self.dead_lettered + self.expired + self.dropped + self.overwritten
            + self.pending - self.replayed
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxStats:
    """Counters since the database was created (persisted), and current depths.

    Conservation: enqueued == delivered + dead_lettered + expired + dropped + overwritten +
    pending (pending includes in flight). `duplicates` and `rejected_full` never entered.
    """

    enqueued: int
    delivered: int
    dead_lettered: int
    expired: int
    dropped: int
    overwritten: int
    pending: int
    in_flight: int
    dead: int  # rows currently in the dead letters (replay moves them back to pending)
    replayed: int
    duplicates: int
    rejected_full: int
    oldest_pending_age_ms: int | None
    by_class: dict[str, ClassStats] = field(default_factory=dict)

    @property
    def conservation_ok(self) -> bool:
        return self.enqueued == (
            self.delivered
            + self.dead_lettered
            + self.expired
            + self.dropped
            + self.overwritten
            + self.pending
            - self.replayed
        )


class OutboxReader(Protocol):
    """What the relay needs from the store."""

    async def take_ready(
        self,
        *,
        limit: int,
        partition: int = 0,
        partitions: int = 1,
        kinds: Sequence[str] | None = None,
    ) -> list[OutboxRow]:
        """Up to `limit` due rows (send_at <= now, not expired, not in flight) of this partition,
        oldest first per receiver; FIFO classes yield at most one row per receiver and none while
        one is in flight; an OVERWRITE key likewise has at most one row in flight (a newer row
        waits, so a key holds at most one row in flight and one pending). Marks them in flight
        in memory. Read-only on the database."""

    async def ack(self, row_ids: Sequence[int]) -> None:
        """Delivered: the rows leave the pending set (durably, group-committed)."""

    async def nack(
        self,
        row_id: int,
        *,
        delay_ms: int,
        error: str,
        outcome: Literal["transient", "capacity"] = "transient",
    ) -> bool:
        """A failed try: send_at = now + delay. `transient` (timeout, network) spends an
        attempt: returns True if that try was the last allowed (attempts reached
        max_attempts) and the row went to the dead letters. `capacity` (the receiver answered
        busy) spends none, so a long-busy receiver never dead-letters anything. An OVERWRITE
        row with a newer row of its key waiting is coalesced (counted overwritten) instead."""

    async def release(self, row_ids: Sequence[int]) -> None:
        """Hand rows back untried (relay stopping, transport went down): no attempt spent.
        An OVERWRITE row with a newer row of its key waiting is coalesced instead."""

    async def dead_letter(self, row_id: int, *, error: str) -> None:
        """A permanent failure: to the dead letters at once, with the reason."""

    async def next_due_ms(self) -> int | None:
        """Earliest send_at among pending rows not in flight (a read, never a write)."""

    async def wait_for_change(self) -> None:
        """Return when an enqueue, nack, release, replay, or an ack of a row another waited behind
        (FIFO receiver, OVERWRITE key) may have made new work ready."""
