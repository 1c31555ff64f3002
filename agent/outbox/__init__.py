"""Layer 3: the durable outbox (SQLite store) and the relay that drains it."""

from agent.outbox.engine import ClassPolicy
from agent.outbox.partition import fnv1a_32, partition_of
from agent.outbox.store import OutboxStore
from agent.outbox.types import (
    ClassStats,
    EnqueueResult,
    OutboxMessage,
    OutboxReader,
    OutboxRow,
    OutboxStats,
)

__all__ = [
    "ClassPolicy",
    "ClassStats",
    "EnqueueResult",
    "OutboxMessage",
    "OutboxReader",
    "OutboxRow",
    "OutboxStats",
    "OutboxStore",
    "fnv1a_32",
    "partition_of",
]
