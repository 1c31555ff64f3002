"""Where the leader puts device applications' messages: its own store, and any forwarders.

    MessageSinks.apply(batch)
      1. which envelope ids the leader's store has already (redeliveries: not forwarded again)
      2. each forwarder queues the new ones durably (the northbound broker's outbox); a failure
         fails the batch, nothing is stored, the devices retry later
      3. the store keeps them (`agent.leader.messages.MessageLog`)
    Only then are the devices answered `accepted`: what they were told is stored or queued.

Counted per class: applied (new), duplicates (suppressed), rejected (refused by the leader,
counted by `LeaderAgent`), forwarded (new messages queued, once for each forwarder).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agent.core.errors import StoreError
from agent.leader.messages import MessageLog
from agent.protocol import AppMessage


class Forwarder(Protocol):
    """A downstream sink: `forward` returns once the messages are durably queued for it."""

    name: str

    async def forward(self, batch: Sequence[tuple[str, AppMessage]]) -> None: ...


@dataclass(slots=True)
class ClassCounts:
    applied: int = 0
    duplicates: int = 0
    rejected: int = 0
    forwarded: int = 0


@dataclass(slots=True)
class SinkStats:
    by_class: dict[str, ClassCounts] = field(default_factory=dict)

    def of(self, cls: str) -> ClassCounts:
        counts = self.by_class.get(cls)
        if counts is None:
            # bounded: class names are validated (48 characters), but a hostile device could send
            # many names; beyond this many distinct classes they are counted under "other"
            if len(self.by_class) >= MAX_COUNTED_CLASSES:
                cls = "other"
                counts = self.by_class.get(cls)
            if counts is None:
                counts = self.by_class[cls] = ClassCounts()
        return counts

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {name: {"applied": c.applied, "duplicates": c.duplicates, "rejected": c.rejected,
                       "forwarded": c.forwarded} for name, c in sorted(self.by_class.items())}


MAX_COUNTED_CLASSES = 256


class MessageSinks:
    def __init__(self, log: MessageLog, forwarders: Sequence[Forwarder] = ()) -> None:
        self.log = log
        self.forwarders: list[Forwarder] = list(forwarders)
        self.stats = SinkStats()

    def add_forwarder(self, forwarder: Forwarder) -> None:
        self.forwarders.append(forwarder)

    async def apply(self, batch: Sequence[tuple[str, AppMessage]]) -> list[bool]:
        """Store (envelope id, message) pairs; per pair, True if new. Raises `StoreError` when
        nothing could be stored or queued (the whole batch is then answered busy)."""
        if not batch:
            return []
        if self.forwarders:
            seen = self.log.known([msg_id for msg_id, _ in batch])
            fresh = [item for item in batch if item[0] not in seen]
            for forwarder in self.forwarders:
                try:
                    await forwarder.forward(fresh)
                except StoreError as exc:
                    raise StoreError(f"not queued for {forwarder.name}: {exc}") from exc
        new = self.log.apply_batch(batch)
        for (_, m), was_new in zip(batch, new, strict=True):
            counts = self.stats.of(m.cls)
            if was_new:
                counts.applied += 1
                # counted once a message, by the store's verdict: a message that reached two
                # batches at once (the direct path and its outbox's resend) was queued twice,
                # which the forwarder's own queue keeps once by its id
                counts.forwarded += len(self.forwarders)
            else:
                counts.duplicates += 1
        return new

    def rejected(self, cls: str) -> None:
        self.stats.of(cls).rejected += 1


__all__ = ["ClassCounts", "Forwarder", "MessageSinks", "SinkStats"]
