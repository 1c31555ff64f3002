"""Layer 2: the durable outbox (SQLite store) and the relay that drains it."""

from agent.outbox.partition import fnv1a_32, partition_of
from agent.outbox.policy import ClassPolicy
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

# The relay side: retry policy, AIMD limiter, relay, tell_reliable, metrics snapshots.
from agent.outbox.limiter import AimdLimiter, AimdSettings
from agent.outbox.metrics import (
    LaneMetrics,
    OutboxMetrics,
    RelayMetrics,
    collect_metrics,
)
from agent.outbox.relay import Deliver, Relay
from agent.outbox.reliable import tell_reliable
from agent.outbox.retry import RetryPolicy

__all__ += [
    "AimdLimiter",
    "AimdSettings",
    "Deliver",
    "LaneMetrics",
    "OutboxMetrics",
    "RelayMetrics",
    "Relay",
    "RetryPolicy",
    "collect_metrics",
    "tell_reliable",
]
